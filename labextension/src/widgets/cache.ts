/**
 * The cache table of `%overmind status` (overmind_jupyter/widgets/cache.py `CacheTable`): what the daemon
 * holds, who uses it, an evict button per entry, the memory and time-saved charts, the adapter gates of
 * this kernel and the calls that fell back.
 *
 * It draws the side panel's state (`state`: api.ts `IPanelState`, made by the same Python as the panel's
 * REST answer) with the panel's charts, and `local`: what only this kernel knows (see `ILocal`).
 */

import type { IEntry, IFallback, IPanelState } from '../api';
import { memoryChart, savedChart } from '../charts';
import { breakable, Child, h, nameOf } from '../dom';
import { hitRate, PSS_LINE, PSS_TEXT } from '../texts';
import type { IModel, IRenderProps, IWidgetModule } from './anywidget';
import { agoAttrs, live, send, stateOf } from './live';
import './cache.css';

/** An adapter gate open in this kernel (widgets/cache.py `open_gates`). */
interface IGate {
  model: string;
  mode: string;
  default: string;
  adapters: number;
  in_flight: number;
  queued: number;
}

/** A call of this kernel that fell back without reaching the daemon (its own list is in `state`). */
interface ILocalFallback {
  time: number;
  call: string;
  kind: string;
  reason: string;
}

/** What only the kernel knows: the `local` trait (widgets/cache.py `local_facts`). */
interface ILocal {
  enabled?: boolean;
  patched?: number;
  pid?: number;
  /** This kernel's connection to the daemon (the state's connections of it carry `mine`). */
  conn?: number | null;
  daemon_error?: string;
  gates?: IGate[];
  fallbacks?: ILocalFallback[];
}

/** An entry as the daemon reports it: the panel's fields and the key's meta the panel does not show. */
interface IMetaEntry extends IEntry {
  meta?: { class?: string; source?: string; dtype?: string; label?: string } | null;
}

/** A fallback of any kernel, with whether it is this kernel's. */
interface IShownFallback {
  time: number;
  call: string;
  reason: string;
  who: string;
  here: boolean;
}

/** The model's id or path, from the repr of the argument the key's meta keeps ("'/models/llama'"). */
function source(entry: IMetaEntry): string {
  const raw = String(entry.meta?.source ?? '');
  const quoted = /^(['"])(.*)\1$/s.exec(raw);
  return quoted ? quoted[2] : raw;
}

/** The loader's class ("AutoModelForCausalLM"), and the model's name (a path's last part). */
function names(entry: IMetaEntry): { cls: string; model: string; path: string } {
  const qualified = String(entry.meta?.class ?? '');
  const cls = qualified
    ? qualified.split('.').pop() ?? qualified
    : entry.label.split('(', 1)[0].split('.', 1)[0];
  const path = source(entry);
  const model = path.startsWith('/') ? path.replace(/\/+$/, '').split('/').pop() ?? path : path;
  return { cls, model: model || entry.label, path };
}

function kernelsOf(entry: IEntry): Child[] {
  if (!entry.pinned_by.length) {
    return [h('span', { class: 'om-muted' }, '-')];
  }
  return entry.pinned_by.map(c =>
    h(
      'div',
      { class: 'om-kernel', title: c.detail, 'data-testid': 'overmind-widget-kernel' },
      nameOf(c),
      c.mine ? h('b', {}, ' (this kernel)') : null  // view.state_view marks this kernel's connection
    )
  );
}

function progressBar(percent: number | null | undefined): Child {
  if (percent === null || percent === undefined) {
    return null;
  }
  return h('progress', { max: '100', value: String(percent) });
}

function entryRow(model: IModel, entry: IMetaEntry): HTMLElement {
  const { cls, model: name, path } = names(entry);
  const button = h(
    'button',
    { class: 'om-btn', 'data-testid': 'overmind-widget-evict', title: `evict ${entry.key}` },
    'evict'
  ) as HTMLButtonElement;
  button.addEventListener('click', () => {
    button.disabled = true;
    button.textContent = 'evicting...';
    send(model, { event: 'evict', key: entry.key });
  });
  const pending = entry.pending;
  const pendingPercent = pending && pending.bytes > 0 ? Math.floor((100 * pending.done) / pending.bytes) : null;
  return h(
    'tr',
    { 'data-testid': 'overmind-widget-entry', 'data-key': entry.key, title: entry.label },
    h(
      'td',
      {},
      h('div', {}, h('span', { class: 'om-title' }, cls), ' ', h('span', { 'data-testid': 'overmind-widget-model' }, name)),
      h('div', { class: 'om-muted om-mono' }, path && path !== name ? `${path} - ` : '', entry.key.slice(0, 12)),
      h(
        'div',
        {
          class: 'om-muted',
          'data-testid': 'overmind-widget-miss',
          title: 'What its first load cost: the load itself, and the caching around it'
        },
        `cached in ${entry.miss_text}`
      ),
      pending
        ? h('div', { class: 'om-muted', 'data-testid': 'overmind-widget-pending' }, progressBar(pendingPercent), ' ', pending.text)
        : null,
      entry.progress
        ? h('div', { class: 'om-muted', 'data-testid': 'overmind-widget-pending' }, progressBar(entry.progress.percent), ' ', entry.progress.text)
        : null
    ),
    h('td', {}, entry.meta?.dtype || h('span', { class: 'om-muted' }, 'as stored')),
    h('td', { class: 'om-num' }, entry.bytes_text),
    h('td', { class: 'om-num' }, String(entry.hits)),
    h('td', agoAttrs(entry.last_used), ''),
    h('td', {}, ...kernelsOf(entry)),
    h('td', {}, button)
  );
}

/**
 * The panel's memory chart under the widget's test ids: the figure in `overmind-widget-memory`, each
 * entry's segment `overmind-widget-memory-segment` (the panel's are `overmind-segment`).
 */
function memory(state: IPanelState): HTMLElement {
  const chart = memoryChart(state);
  chart.querySelectorAll('[data-testid="overmind-segment"]').forEach(segment => {
    segment.setAttribute('data-testid', 'overmind-widget-memory-segment');
  });
  return h('div', { class: 'om-chart', 'data-testid': 'overmind-widget-memory' }, chart);
}

function fallbacksOf(state: IPanelState | null, local: ILocal): IShownFallback[] {
  const all: IShownFallback[] = (state?.fallbacks ?? []).map((f: IFallback) => ({
    time: f.time,
    call: f.call,
    reason: f.reason,
    who: f.pid === local.pid ? 'this kernel' : `pid ${f.pid}${f.name ? ` ${f.name}` : ''}`,
    here: f.pid === local.pid
  }));
  for (const f of local.fallbacks ?? []) {
    all.push({ time: f.time, call: f.call, reason: f.reason, who: 'this kernel', here: true });
  }
  return all.sort((a, b) => a.time - b.time).slice(-50);
}

function draw(model: IModel, root: HTMLElement): void {
  const state = stateOf(model);
  const local: ILocal = model.get('local') || {};
  const error: string = model.get('error');
  const notice: string = model.get('notice');
  const parts: Child[] = [];
  const entries = (state?.entries ?? []) as IMetaEntry[];
  parts.push(
    h(
      'div',
      { class: 'om-head' },
      h('span', { class: 'om-title' }, 'overmind cache'),
      h(
        'span',
        { 'data-testid': 'overmind-widget-enabled' },
        `${local.enabled ? 'on' : 'off'} (${local.patched ?? 0} loaders patched)`
      ),
      state && h('span', { class: 'om-muted' }, `daemon pid ${state.daemon.pid}`),
      state &&
        h(
          'span',
          { 'data-testid': 'overmind-widget-used' },
          `${state.texts.used} of ${state.texts.budget} in ${state.entries_total} ${state.entries_total === 1 ? 'entry' : 'entries'}`
        ),
      state && h('span', { class: 'om-muted' }, `hits / misses ${hitRate(state.stats).text}`),
      state && state.loading.length > 0 && h('span', {}, `${state.loading.length} loading`)
    )
  );
  if (state) {
    // what a memory meter adding up RSS shows of shared models (as the side panel's summary says)
    parts.push(h('div', { class: 'om-muted om-pss', 'data-testid': 'overmind-widget-pss', title: PSS_TEXT }, PSS_LINE));
    for (const load of state.loading) {
      parts.push(
        h(
          'div',
          { class: 'om-progress', 'data-testid': 'overmind-widget-progress' },
          progressBar(load.progress?.percent),
          ' ',
          load.progress?.text ?? `loading ${load.key.slice(0, 12)}`,
          h('span', { class: 'om-muted' }, ` (${nameOf(load.loader)})`)
        )
      );
    }
  }
  if (error || local.daemon_error) {
    parts.push(
      h(
        'div',
        { class: 'om-error', 'data-testid': 'overmind-widget-down' },
        error || `no daemon: ${local.daemon_error} - \`%overmind on\` starts one`
      )
    );
  }
  if (entries.length) {
    parts.push(
      h(
        'table',
        { 'data-testid': 'overmind-widget-entries' },
        h(
          'thead',
          {},
          h(
            'tr',
            {},
            h('th', {}, 'Model'),
            h('th', {}, 'dtype'),
            h('th', { class: 'om-num' }, 'Size'),
            h('th', { class: 'om-num' }, 'Hits'),
            h('th', {}, 'Last used'),
            h('th', {}, 'Kernels using it'),
            h('th', {}, '')
          )
        ),
        h('tbody', {}, ...entries.map(e => entryRow(model, e)))
      )
    );
    if (state && state.entries_more > 0) {
      parts.push(
        h(
          'div',
          { class: 'om-muted', 'data-testid': 'overmind-widget-more' },
          `and ${state.entries_more} more ${state.entries_more === 1 ? 'entry' : 'entries'} (${state.texts.more_bytes}): ` +
            'the largest and the most recently used are shown; `overmind-daemon ls` lists every one'
        )
      );
    }
  } else if (state) {
    parts.push(h('div', { class: 'om-muted', 'data-testid': 'overmind-widget-empty' }, 'no cached models'));
  }
  if (state) {
    parts.push(memory(state));
    if (state.texts.disk) {
      parts.push(h('div', { class: 'om-muted', 'data-testid': 'overmind-widget-disk' }, state.texts.disk));
    }
    parts.push(
      h(
        'div',
        { class: 'om-chart', 'data-testid': 'overmind-widget-saved' },
        savedChart(state.hits_log, state.texts)
      )
    );
  }
  const gates = local.gates ?? [];
  if (gates.length) {
    parts.push(h('div', { class: 'om-section' }, 'Adapter gates in this kernel'));
    parts.push(
      h(
        'ul',
        { class: 'om-list', 'data-testid': 'overmind-widget-gates' },
        ...gates.map(g =>
          h(
            'li',
            {},
            `${g.model}: ${g.mode}, default ${g.default}, ${g.adapters} adapters, ` +
              `${g.in_flight} in flight, ${g.queued} queued`
          )
        )
      )
    );
  }
  const fallbacks = fallbacksOf(state, local);
  if (fallbacks.length) {
    parts.push(h('div', { class: 'om-section' }, `Calls that fell back (${fallbacks.length})`));
    parts.push(
      h(
        'ul',
        { class: 'om-list', 'data-testid': 'overmind-widget-fallbacks' },
        ...fallbacks
          .slice()
          .reverse()
          .map(f =>
            h(
              'li',
              { 'data-testid': 'overmind-widget-fallback' },
              h('span', { class: 'om-mono' }, ...breakable(f.call)),
              ': ',
              f.reason,
              ' ',
              h('span', { class: 'om-muted' }, `(${f.who}, `, h('span', agoAttrs(f.time), ''), ')')
            )
          )
      )
    );
  }
  if (notice) {
    parts.push(h('div', { class: 'om-notice', 'data-testid': 'overmind-widget-notice' }, notice));
  }
  root.replaceChildren(...(parts.filter(Boolean) as Node[]));
}

const widget: IWidgetModule = {
  render({ model, el }: IRenderProps) {
    const root = h('div', { class: 'om-w om-cache', 'data-testid': 'overmind-widget-cache' });
    el.append(root);
    return live(model, el, ['state', 'local', 'error', 'notice'], () => draw(model, root));
  }
};

export default widget;
