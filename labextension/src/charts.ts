/**
 * The panel's pictures, as plain SVG: memory per entry against the budget, load time saved by hits,
 * GPU units over time. Shapes carry no text; what they mean is written next to them in HTML, so that
 * every text sits on the panel's own background (readable in every theme).
 */

import { IEntry, IHit, IPanelState } from './api';
import { IUnitSample } from './model';
import { breakable, Child, h, nameOf } from './dom';

const SVG_NS = 'http://www.w3.org/2000/svg';
/** The narrowest segment of the memory bar, in thousandths of its width: a small model stays visible. */
const MIN_SEGMENT = 8;

/**
 * Colours of the entries' segments: ten distinct hues, then the same with stripes one way and the other,
 * so that the first 30 entries never look alike. The same list as the notebook widget's (see Note
 * [Segment colours] in overmind_jupyter/widgets/cache.py; a test compares them).
 */
export const SEGMENT_COLOURS = [
  '#4e79a7',
  '#f28e2b',
  '#59a14f',
  '#e15759',
  '#b07aa1',
  '#edc948',
  '#76b7b2',
  '#ff9da7',
  '#9c755f',
  '#1f3f8f'
];
export const SEGMENT_PATTERNS = 3;
/** Light stripes over a segment's colour, by pattern (none for the first). */
const STRIPES = ['', 'jp-Overmind-stripes1', 'jp-Overmind-stripes2'];

/** Entry i's colour, and its pattern: 0 plain, 1 and 2 stripes (Note [Segment colours]). */
export function segmentFill(i: number): { colour: string; pattern: number } {
  return {
    colour: SEGMENT_COLOURS[i % SEGMENT_COLOURS.length],
    pattern: Math.floor(i / SEGMENT_COLOURS.length) % SEGMENT_PATTERNS
  };
}

/** Entry i's fill as a CSS background (the legend's swatches). */
function segmentBackground(i: number): string {
  const { colour, pattern } = segmentFill(i);
  if (!pattern) {
    return colour;
  }
  const angle = pattern === 1 ? 45 : -45;
  return `repeating-linear-gradient(${angle}deg, ${colour} 0 3px, rgba(255, 255, 255, 0.6) 3px 5px), ${colour}`;
}

/** The SVG patterns of the stripes, white over transparent, for the memory bar's `<defs>`. */
function stripeDefs(): SVGElement {
  const defs = svg('defs', {});
  STRIPES.forEach((id, pattern) => {
    if (!id) {
      return;
    }
    const stripes = svg('pattern', {
      id,
      width: 5,
      height: 5,
      patternUnits: 'userSpaceOnUse',
      patternTransform: `rotate(${pattern === 1 ? 45 : -45})`
    });
    stripes.append(svg('rect', { x: 3, y: 0, width: 2, height: 5, fill: 'rgba(255, 255, 255, 0.6)' }));
    defs.append(stripes);
  });
  return defs;
}

function svg(tag: string, attrs: Record<string, string | number>, ...children: SVGElement[]): SVGElement {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) {
    el.setAttribute(name, String(value));
  }
  el.append(...children);
  return el;
}

/** A coloured square before a legend's line. */
function swatch(colour: string, className = ''): HTMLElement {
  const el = h('span', { class: `jp-Overmind-swatch ${className}`.trim(), 'aria-hidden': 'true' });
  el.style.background = colour;
  return el;
}

/** A chart's frame: the heading, the picture and its legend. */
function figure(testid: string, title: string, picture: Element, ...legend: Child[]): HTMLElement {
  return h(
    'figure',
    { class: 'jp-Overmind-chart', 'data-testid': testid },
    h('figcaption', { class: 'jp-Overmind-chartTitle' }, h('span', {}, title)),
    picture,
    h('div', { class: 'jp-Overmind-legend' }, ...legend)
  );
}

/**
 * Memory per entry against the budget: one stacked bar (entries, loads in flight, free), and a legend
 * naming each entry, its size and the kernels that use it.
 */
export function memoryChart(state: IPanelState, shown?: IShownEntries): HTMLElement {
  const entries = shown?.entries ?? state.entries;
  const ghosts = shown?.ghosts ?? new Set<string>();
  const width = 1000;
  const height = 14;
  const scale = width / Math.max(1, state.budget, state.used + state.reserved);
  const bar = svg('svg', {
    class: 'jp-Overmind-stack',
    viewBox: `0 0 ${width} ${height}`,
    preserveAspectRatio: 'none',
    role: 'img',
    'aria-label': `${state.texts.used} of ${state.texts.budget} used`
  });
  bar.append(stripeDefs(), svg('rect', { class: 'jp-Overmind-free', x: 0, y: 0, width, height }));
  let x = 0;
  entries.forEach((entry, i) => {
    if (ghosts.has(entry.key)) {
      return; // evicted: its legend line stays (see Note [No reflow under the pointer] in panel.ts)
    }
    const w = entry.bytes * scale;
    const { colour, pattern } = segmentFill(i);
    const rect = svg('rect', {
      x,
      y: 0,
      width: Math.max(w, MIN_SEGMENT),
      height,
      'data-key': entry.key,
      'data-colour': colour,
      'data-pattern': pattern,
      'data-testid': 'overmind-segment'
    });
    rect.style.fill = colour;
    const tip = svg('title', {});
    tip.textContent = `${entry.label}: ${entry.bytes_text}`; // on hover
    rect.append(tip);
    bar.append(rect);
    if (pattern) {
      bar.append(
        svg('rect', {
          x,
          y: 0,
          width: Math.max(w, MIN_SEGMENT),
          height,
          fill: `url(#${STRIPES[pattern]})`,
          'pointer-events': 'none'
        })
      );
    }
    x += Math.max(w, MIN_SEGMENT);
  });
  if (state.entries_more > 0) {
    // the entries status does not carry (the smaller and older ones), together
    const rest = svg('rect', {
      class: 'jp-Overmind-moreSegment',
      x,
      y: 0,
      width: state.more_bytes * scale,
      height
    });
    const tip = svg('title', {});
    tip.textContent = `${state.entries_more} more entries: ${state.texts.more_bytes}`;
    rest.append(tip);
    bar.append(rest);
    x += state.more_bytes * scale;
  }
  if (state.reserved > 0) {
    bar.append(
      svg('rect', {
        class: 'jp-Overmind-reservedSegment',
        x,
        y: 0,
        width: state.reserved * scale,
        height
      })
    );
  }
  const legend: Child[] = entries.map((entry, i) =>
    ghosts.has(entry.key) ? ghostLine(entry) : legendLine(entry, segmentBackground(i))
  );
  if (state.reserved > 0) {
    legend.push(
      h(
        'div',
        { class: 'jp-Overmind-legendLine' },
        swatch('', 'jp-Overmind-reservedSwatch'),
        `${state.texts.reserved} reserved by loads in flight`
      )
    );
  }
  legend.push(
    h(
      'div',
      { class: 'jp-Overmind-legendLine jp-Overmind-hint' },
      swatch('', 'jp-Overmind-freeSwatch'),
      `${state.texts.used} used of a ${state.texts.budget} budget`
    )
  );
  const chart = figure('overmind-chart-memory', 'Memory per model', bar, ...legend);
  chart.dataset.segments = String(entries.filter(e => !ghosts.has(e.key)).length);
  return chart;
}

/** The entries a view shows, in its order, and those of them evicted a moment ago (shown as such). */
export interface IShownEntries {
  entries: IEntry[];
  ghosts: ReadonlySet<string>;
}

/** The legend's line of an entry just evicted: as high as it was, saying so. */
function ghostLine(entry: IEntry): HTMLElement {
  return h(
    'div',
    { class: 'jp-Overmind-legendLine jp-Overmind-hint jp-mod-evicted', 'data-key': entry.key },
    swatch('transparent'),
    h('span', { class: 'jp-Overmind-label' }, ...breakable(entry.label)),
    ' evicted'
  );
}

function legendLine(entry: IEntry, colour: string): HTMLElement {
  const users = entry.pinned_by.map(nameOf);
  return h(
    'div',
    { class: 'jp-Overmind-legendLine', 'data-key': entry.key },
    swatch(colour),
    h('span', { class: 'jp-Overmind-label' }, ...breakable(entry.label)),
    ` ${entry.bytes_text}`,
    h(
      'span',
      { class: 'jp-Overmind-hint jp-Overmind-users' },
      users.length ? ` · used by ${users.join(', ')}` : ' · not in use'
    )
  );
}

/**
 * Load time saved over the session: for each hit, the plain load time (measured at its miss) against
 * the hit's wait, summed over the hits in order; the area between the two lines is what the hits saved.
 * `texts.saved` is what the cache saved, the misses' caching (`texts.caching`) subtracted
 * (Note [Load time saved] in kernel_server/store.py).
 */
export function savedChart(
  log: IHit[],
  texts: { plain: string; hits: string; saved: string; caching?: string; saved_detail?: string }
): HTMLElement {
  const hits = log.filter(x => x.hit_s !== null);
  const untimed = log.length - hits.length;
  const width = 300;
  const height = 80;
  const picture = svg('svg', {
    class: 'jp-Overmind-lines',
    viewBox: `0 0 ${width} ${height}`,
    preserveAspectRatio: 'none',
    role: 'img',
    'aria-label': `load time saved: ${texts.saved}`
  });
  picture.append(svg('rect', { class: 'jp-Overmind-plot', x: 0, y: 0, width, height }));
  const plain = cumulative(hits.map(x => x.load_s));
  const served = cumulative(hits.map(x => x.hit_s ?? 0));
  const top = Math.max(1e-9, ...plain, ...served);
  const toPoints = (values: number[]): string =>
    [[0, height], ...values.map((v, i) => [((i + 1) * width) / values.length, height - (v / top) * (height - 4)])]
      .map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`)
      .join(' ');
  if (!hits.length) {
    picture.style.display = 'none'; // nothing to draw yet; the legend says why
  } else {
    const plainPoints = toPoints(plain);
    const servedPoints = toPoints(served);
    const area = `${plainPoints} ${servedPoints.split(' ').reverse().join(' ')}`;
    picture.append(
      svg('polygon', { class: 'jp-Overmind-savedArea', points: area }),
      svg('polyline', { class: 'jp-Overmind-plainLine', points: plainPoints }),
      svg('polyline', { class: 'jp-Overmind-hitLine', points: servedPoints })
    );
  }
  const chart = figure(
    'overmind-chart-saved',
    'Load time saved by hits',
    picture,
    hits.length
      ? h(
          'div',
          { class: 'jp-Overmind-legendLine' },
          swatch('var(--jp-brand-color1)'),
          `plain loads ${texts.plain}`,
          swatch('var(--jp-warn-color1)'),
          `hits ${texts.hits}`
        )
      : null,
    h(
      'div',
      { class: 'jp-Overmind-legendLine', 'data-testid': 'overmind-saved', title: texts.saved_detail },
      hits.length
        ? `${texts.saved} saved over ${hits.length} hit${hits.length === 1 ? '' : 's'}` +
            (texts.caching ? `, after ${texts.caching} of caching` : '')
        : untimed
          ? ''
          : 'No hit yet: the second load of a model is served from the cache.'
    ),
    untimed > 0 &&
      h(
        'div',
        { class: 'jp-Overmind-legendLine jp-Overmind-hint' },
        `${untimed} more hit${untimed === 1 ? '' : 's'} not timed yet (a kernel reports with its next request)`
      )
  );
  chart.dataset.hits = String(hits.length);
  return chart;
}

function cumulative(values: number[]): number[] {
  let sum = 0;
  return values.map(v => (sum += v));
}

/** GPU units in use over the last polls, one line per device, against each device's total. */
export function unitsChart(state: Pick<IPanelState, 'units'>, samples: readonly IUnitSample[]): HTMLElement | null {
  const devices = state.units?.devices ?? [];
  if (!devices.length) {
    return null;
  }
  const width = 300;
  const height = 60;
  const top = Math.max(1, ...devices.map(d => d.total));
  const picture = svg('svg', {
    class: 'jp-Overmind-lines',
    viewBox: `0 0 ${width} ${height}`,
    preserveAspectRatio: 'none',
    role: 'img',
    'aria-label': 'GPU units in use over time'
  });
  picture.append(svg('rect', { class: 'jp-Overmind-plot', x: 0, y: 0, width, height }));
  const n = Math.max(2, samples.length);
  devices.forEach((d, i) => {
    const points = samples.map((s, j) => {
      const px = (j * width) / (n - 1);
      const py = height - ((s.used[d.device] ?? 0) / top) * (height - 4);
      return `${px.toFixed(1)},${py.toFixed(1)}`;
    });
    if (points.length) {
      const line = svg('polyline', { class: 'jp-Overmind-unitLine', points: points.join(' ') });
      line.style.stroke = SEGMENT_COLOURS[i % SEGMENT_COLOURS.length];
      picture.append(line);
    }
  });
  const simulated = state.units?.simulated;
  return figure(
    'overmind-chart-units',
    `GPU units over time${simulated ? ' (simulated devices)' : ''}`,
    picture,
    ...devices.map((d, i) =>
      h(
        'div',
        { class: 'jp-Overmind-legendLine' },
        swatch(SEGMENT_COLOURS[i % SEGMENT_COLOURS.length]),
        `${d.device}: ${d.used} of ${d.total} units`
      )
    )
  );
}

/** The charts a view can show, each in the panel and, larger, in a main-area tab of its own. */
export type ChartKind = 'memory' | 'saved' | 'units';

export const CHART_TITLES: Record<ChartKind, string> = {
  memory: 'Memory per model',
  saved: 'Load time saved by hits',
  units: 'GPU units over time'
};

/** Chart `kind` of `state` (null where it has nothing to show: no GPU known for the units). */
export function chart(
  kind: ChartKind,
  state: IPanelState,
  samples: readonly IUnitSample[],
  shown?: IShownEntries
): HTMLElement | null {
  if (kind === 'memory') {
    return memoryChart(state, shown);
  }
  if (kind === 'saved') {
    return savedChart(state.hits_log, state.texts);
  }
  return unitsChart(state, samples);
}
