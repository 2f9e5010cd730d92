/**
 * The side panel: what the daemon holds, from the poll it shares with the status-bar item.
 *
 * Stable hooks for tests and styles: the root has class `jp-Overmind`; every part carries a
 * `data-testid` (overmind-status, overmind-down, overmind-error, overmind-summary, overmind-entries,
 * overmind-entry [data-key], overmind-evict, overmind-evict-all, overmind-empty, overmind-loading,
 * overmind-progress, overmind-units, overmind-device, overmind-kernels, overmind-kernel [data-pid],
 * overmind-fallbacks, overmind-refresh, and the charts overmind-chart-memory [data-segments],
 * overmind-chart-saved [data-hits], overmind-chart-units, each with its overmind-chart-open button).
 * Views of issue 40: overmind-pss (what shared memory means for RSS), overmind-focus [data-path] (the
 * focused notebook's kernel, whose entries, holders and kernel row carry `data-focused`), and
 * overmind-evicted (a row evicted a moment ago, see Note [No reflow under the pointer]).
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { launchIcon, refreshIcon } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import {
  evict,
  IConnection,
  IDevice,
  IEntry,
  IFallback,
  IPanelState,
  IPending,
  IProgress,
  IUnitHolder
} from './api';
import { chart, CHART_TITLES, ChartKind, IShownEntries } from './charts';
import { breakable, Child, h, nameOf, prose, who } from './dom';
import { heldFraction, OvermindModel, WARN_FRACTION } from './model';
import { agoText, hitRate, PSS_LINE, PSS_TEXT } from './texts';

const MAX_FALLBACKS = 20;
/** Milliseconds between two refreshes of the relative times on show ("5 seconds ago"). */
const AGE_MS = 1000;
/** Milliseconds an error of an evict stays on show. */
const MESSAGE_MS = 10000;

/**
 * A relative time that moves on while it is shown: the panel rewrites the text of every `data-ago` span
 * each second, in place (rebuilding the body would move a button under the pointer).
 */
function ago(seconds: number): HTMLElement {
  return h('span', { class: 'jp-Overmind-ago', 'data-ago': String(seconds) }, agoText(seconds));
}

/** A long operation: a bar, and the model's name, percent and time left (written by the server). */
function progressLine(progress: IProgress): HTMLElement {
  const bar = h('progress', { max: '100' });
  if (progress.percent !== null) {
    bar.setAttribute('value', String(progress.percent));
  }
  return h(
    'div',
    { class: 'jp-Overmind-progress', 'data-testid': 'overmind-progress' },
    h('div', { class: 'jp-Overmind-label' }, ...breakable(progress.text)),
    bar
  );
}

/** An entry served from its checkpoint until the daemon copied it into its arena. */
function pendingLine(pending: IPending): HTMLElement {
  return h(
    'div',
    { class: 'jp-Overmind-hint', 'data-testid': 'overmind-pending' },
    ...breakable(pending.text)
  );
}

function bar(used: number, total: number, testid: string): HTMLElement {
  const fraction = total > 0 ? Math.min(1, used / total) : 0;
  const fill = h('div', { class: 'jp-Overmind-barFill' });
  fill.style.width = `${(fraction * 100).toFixed(1)}%`;
  return h(
    'div',
    {
      class: 'jp-Overmind-bar',
      role: 'meter',
      'aria-valuemin': '0',
      'aria-valuemax': String(total),
      'aria-valuenow': String(used),
      'data-testid': testid
    },
    fill
  );
}

export namespace OvermindPanel {
  export interface IOptions {
    model: OvermindModel;
    serverSettings: ServerConnection.ISettings;
    /** Open a chart in a main-area tab (a button on each chart); no button without it. */
    openChart?: (kind: ChartKind) => void;
  }
}

export class OvermindPanel extends Widget {
  constructor(options: OvermindPanel.IOptions) {
    super();
    this.addClass('jp-Overmind');
    this._model = options.model;
    this._settings = options.serverSettings;
    this._openChart = options.openChart ?? null;
    // the rows evicted a moment ago go once the pointer leaves them (see Note [No reflow under the pointer])
    this.node.addEventListener('pointermove', event => {
      const target = event.target as Element | null;
      if (this._ghosts.size && !target?.closest('[data-testid="overmind-entries"]')) {
        this._dropGhosts();
      }
    });
    this.node.addEventListener('pointerleave', () => this._dropGhosts());

    const refresh = h(
      'button',
      {
        class: 'jp-Button jp-mod-minimal jp-Overmind-refresh',
        title: 'Refresh now',
        'aria-label': 'Refresh now',
        'data-testid': 'overmind-refresh'
      },
      refreshIcon.element({ tag: 'span', elementSize: 'normal' })
    );
    refresh.addEventListener('click', () => void this._model.refresh());
    this._status = h('div', {
      class: 'jp-Overmind-status',
      'data-testid': 'overmind-status',
      'aria-live': 'polite'
    });
    this._body = h('div', { class: 'jp-Overmind-body' });
    this.node.append(
      h(
        'header',
        { class: 'jp-Overmind-header' },
        h('h2', { class: 'jp-Overmind-title' }, 'Overmind'),
        refresh
      ),
      this._status,
      this._body
    );
    this._setStatus('connecting', 'Asking the server…');
    this._model.changed.connect(this._update, this);
    this._ages = window.setInterval(() => this._tick(), AGE_MS);
  }

  /** The latest state shown (null while the daemon is down or before the first answer). */
  get state(): IPanelState | null {
    return this._model.state;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._update, this);
    window.clearInterval(this._ages);
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._model.refresh();
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this._dropGhosts();
  }

  private _dropGhosts(): void {
    if (this._ghosts.size) {
      this._ghosts.clear();
      this._ghostHeights.clear();
      this._update();
    }
  }

  /** Move the relative times on while the panel is on show (see `ago`). */
  private _tick(): void {
    if (!this.isVisible) {
      return;
    }
    this.node.querySelectorAll<HTMLElement>('[data-ago]').forEach(el => {
      el.textContent = agoText(Number(el.dataset.ago));
    });
  }

  private _update(): void {
    const view = this._model.view;
    if (view.state === 'error') {
      this._setStatus('error', view.message);
      this._render(null, '');
    } else if (view.state === 'down') {
      this._setStatus('down', 'no daemon');
      this._render(null, view.message);
    } else if (view.state === 'ok') {
      const d = view.daemon;
      this._setStatus('ok', `daemon pid ${d.pid}, v${d.version} at ${d.home}`);
      this._render(view, '');
    }
  }

  private _setStatus(kind: string, text: string): void {
    this._status.dataset.state = kind;
    this._status.replaceChildren(...breakable(text));
  }

  /** Rebuild the body when what it shows changed (so a button under the pointer stays put). */
  private _render(state: IPanelState | null, down: string): void {
    const message = Date.now() < this._messageUntil ? this._message : '';
    const samples = this._model.unitSamples.length; // relative times move on without a rebuild (`ago`)
    const focused = this._model.focused;
    const signature = JSON.stringify([state, down, message, samples, focused, [...this._ghosts.keys()]]);
    if (signature === this._signature) {
      return;
    }
    this._signature = signature;
    const parts: Child[] = [];
    if (message) {
      parts.push(h('div', { class: 'jp-Overmind-error', 'data-testid': 'overmind-error' }, message));
    }
    if (state === null) {
      if (down) {
        parts.push(
          h(
            'div',
            { class: 'jp-Overmind-down', 'data-testid': 'overmind-down' },
            h('p', {}, 'No overmind daemon is running.'),
            h('p', { class: 'jp-Overmind-hint' }, ...prose(down))
          )
        );
      }
    } else {
      const shown = this._shown(state);
      parts.push(
        this._focus(state, shown),
        this._summary(state, shown),
        this._loading(state),
        this._entries(state, shown),
        this._chart('saved', state),
        this._units(state),
        this._kernels(state.kernels),
        this._fallbacks(state.fallbacks)
      );
    }
    const before = this._ghosts.size ? this._listTop() : null;
    const height = this._body.getBoundingClientRect().height;
    this._body.replaceChildren(...(parts.filter(Boolean) as Node[]));
    if (before !== null) {
      // no shorter than it was, or a panel scrolled to its end would scroll back by what went
      this._body.style.minHeight = `${height}px`;
      this._holdList(before);
    } else {
      this._body.style.minHeight = '';
    }
  }

  /** Where the rows of the list of entries start on screen (null while there is none). */
  private _listTop(): number | null {
    const list = this._body.querySelector<HTMLElement>('[data-testid="overmind-entries"]');
    return list ? list.getBoundingClientRect().top + (parseFloat(list.style.paddingTop) || 0) : null;
  }

  /**
   * Put the list of entries back at `top` after a rebuild while rows evicted from the panel stay (see
   * Note [No reflow under the pointer]): what shrank above it (a line of the focused notebook's models,
   * a load that ended) leaves a gap above the list, what grew scrolls the panel by as much. The panel does
   * not anchor its scrolling itself (`overflow-anchor: none` in base.css), which would move it twice.
   */
  private _holdList(top: number): void {
    const list = this._body.querySelector<HTMLElement>('[data-testid="overmind-entries"]');
    const now = this._listTop();
    if (!list || now === null) {
      return;
    }
    if (now < top) {
      list.style.paddingTop = `${top - now}px`; // not a margin: it would collapse with the heading's
    } else if (now > top) {
      this.node.scrollTop += now - top;
    }
  }

  // Note [No reflow under the pointer]
  // A click on Evict removes a row, and the rows below would move up, the next one's Evict button under
  // the pointer, where a second click evicts a model nobody chose. So while the pointer stays over the
  // list, the rows evicted from this panel stay where they were, as high as they were (saying "evicted",
  // their button hidden), the others keep their order, the memory chart's legend above keeps its lines,
  // and the list keeps its place whatever changed above it (`_holdList`). All close up once the pointer
  // leaves the list (or the panel, or the panel is hidden). The confirmation dialog alone does not
  // prevent it: its button lies elsewhere, but the user comes back to the list for the next one.

  /** The entries in the order the panel shows them (see Note [No reflow under the pointer]). */
  private _shown(state: IPanelState): IShownEntries {
    if (!this._ghosts.size) {
      this._order = state.entries.map(e => e.key);
      return { entries: state.entries, ghosts: new Set() };
    }
    const live = new Map(state.entries.map(e => [e.key, e]));
    const entries: IEntry[] = [];
    for (const key of this._order) {
      const entry = live.get(key) ?? this._ghosts.get(key);
      if (entry) {
        entries.push(entry);
        live.delete(key);
      }
    }
    entries.push(...live.values()); // new entries go below
    const ghosts = new Set([...this._ghosts.keys()].filter(k => !state.entries.some(e => e.key === k)));
    return { entries, ghosts };
  }

  /** The focused notebook's kernel: what it uses of the cache and of the GPUs (or why nothing). */
  private _focus(state: IPanelState, shown: IShownEntries): HTMLElement | null {
    const path = this._model.focused;
    if (!path) {
      return null;
    }
    const kernel = state.kernels.find(k => k.path === path);
    const uses = shown.entries.filter(e => e.pinned_by.some(c => c.path === path));
    const holds: { device: string; holder: IUnitHolder }[] = [];
    for (const d of state.units?.devices ?? []) {
      holds.push(...d.holders.filter(x => x.name === path).map(x => ({ device: d.device, holder: x })));
    }
    const lines: Child[] = [];
    if (!kernel) {
      lines.push(
        h(
          'p',
          { class: 'jp-Overmind-hint' },
          ...prose('Its kernel is not connected to the daemon: `%overmind on` connects it.')
        )
      );
    } else {
      lines.push(
        h(
          'div',
          { class: 'jp-Overmind-hint', 'data-testid': 'overmind-focus-uses' },
          uses.length
            ? `uses ${uses.map(e => `${e.label} (${shown.ghosts.has(e.key) ? 'evicted' : e.bytes_text})`).join(', ')}`
            : 'uses no cached model'
        ),
        holds.length > 0 &&
          h(
            'div',
            { class: 'jp-Overmind-hint', 'data-testid': 'overmind-focus-units' },
            'holds ' +
              holds
                .map(({ device, holder }) => `${holder.units ?? '?'} GPU unit${holder.units === 1 ? '' : 's'} on ${device} for ${holder.label || 'a model'}`)
                .join(', ')
          )
      );
    }
    return h(
      'section',
      { class: 'jp-Overmind-section jp-Overmind-focus', 'data-testid': 'overmind-focus', 'data-path': path },
      h(
        'div',
        { class: 'jp-Overmind-row' },
        h('span', { class: 'jp-Overmind-label', title: kernel?.detail ?? path }, ...breakable(path)),
        h('span', { class: 'jp-Overmind-hint' }, kernel ? `pid ${kernel.pid}` : '')
      ),
      ...lines
    );
  }

  /** A chart of the panel, with its button that opens it larger in a main-area tab. */
  private _chart(kind: ChartKind, state: IPanelState, shown?: IShownEntries): HTMLElement | null {
    const figure = chart(kind, state, this._model.unitSamples, shown);
    const openChart = this._openChart;
    if (figure && openChart) {
      const open = h(
        'button',
        {
          class: 'jp-Button jp-mod-minimal jp-Overmind-chartOpen',
          title: `Open "${CHART_TITLES[kind]}" in a tab`,
          'aria-label': `Open ${CHART_TITLES[kind]} in a tab`,
          'data-testid': 'overmind-chart-open'
        },
        launchIcon.element({ tag: 'span', elementSize: 'normal' })
      );
      open.addEventListener('click', () => openChart(kind));
      figure.querySelector('figcaption')?.append(open);
    }
    return figure;
  }

  private _summary(state: IPanelState, shown: IShownEntries): HTMLElement {
    const held = heldFraction(state);
    const warn = held >= WARN_FRACTION;
    return h(
      'section',
      { class: 'jp-Overmind-section', 'data-testid': 'overmind-summary' },
      h(
        'div',
        { class: 'jp-Overmind-row' },
        h('span', {}, 'Cache'),
        h(
          'span',
          {
            class: warn ? 'jp-Overmind-warn' : undefined,
            'data-testid': 'overmind-used',
            'data-level': warn ? 'warn' : 'normal',
            title: warn
              ? `${Math.round(held * 100)}% of the budget held (the warning shows from ` +
                `${Math.round(WARN_FRACTION * 100)}%): the next model loaded will evict the least recently used ones`
              : `${Math.round(held * 100)}% of the budget held`
          },
          `${state.texts.used} of ${state.texts.budget}`
        )
      ),
      h(
        'div',
        { class: 'jp-Overmind-hint jp-Overmind-info', 'data-testid': 'overmind-pss', title: PSS_TEXT },
        PSS_LINE
      ),
      h(
        'div',
        { class: 'jp-Overmind-row', 'data-testid': 'overmind-stats' },
        h('span', {}, 'Hits / misses'),
        h('span', {}, hitRate(state.stats).text)
      ),
      state.texts.disk &&
        h(
          'div',
          { class: 'jp-Overmind-row', 'data-testid': 'overmind-disk' },
          h('span', {}, 'Disk'),
          h('span', { title: state.texts.disk }, state.texts.disk.replace(/^disk: /, ''))
        ),
      this._chart('memory', state, shown)
    );
  }

  private _entries(state: IPanelState, shown: IShownEntries): HTMLElement {
    const evictAll = h(
      'button',
      {
        class: 'jp-Button jp-mod-minimal jp-Overmind-evictAll',
        title: 'Evict every cached model',
        'data-testid': 'overmind-evict-all'
      },
      'Evict all'
    );
    const total = state.entries_total;
    evictAll.addEventListener('click', () => void this._evictAll(total));
    const list =
      shown.entries.length === 0
        ? h(
            'p',
            { class: 'jp-Overmind-empty', 'data-testid': 'overmind-empty' },
            ...prose(
              'No model is cached yet. Run `%overmind on` in a notebook, then load a model ' +
                'with `from_pretrained`: it stays here across kernel restarts.'
            )
          )
        : h(
            'ul',
            { class: 'jp-Overmind-list', 'data-testid': 'overmind-entries' },
            ...shown.entries.map(e => (shown.ghosts.has(e.key) ? this._ghost(e) : this._entry(e)))
          );
    const more =
      state.entries_more > 0 &&
      h(
        'p',
        { class: 'jp-Overmind-hint', 'data-testid': 'overmind-more' },
        `and ${state.entries_more} more (${state.texts.more_bytes}): the largest and the most ` +
          'recently used are shown; `overmind-daemon ls` lists every one'
      );
    return h(
      'section',
      { class: 'jp-Overmind-section' },
      h(
        'h3',
        { class: 'jp-Overmind-heading' },
        h('span', {}, `Cached models (${total})`),
        total > 0 && evictAll
      ),
      list,
      more
    );
  }

  private _entry(entry: IEntry): HTMLElement {
    const button = h(
      'button',
      {
        class: 'jp-Button jp-mod-minimal jp-Overmind-evict',
        title: `Evict ${entry.label} (${entry.key})`,
        'aria-label': `Evict ${entry.label}`,
        'data-testid': 'overmind-evict'
      },
      'Evict'
    );
    button.addEventListener('click', () => void this._evictOne(entry));
    const users: Child[] = entry.pinned_by.length
      ? ['in use by ', ...joined(entry.pinned_by.map(who))]
      : ['not in use'];
    const focused = !!this._model.focused && entry.pinned_by.some(c => c.path === this._model.focused);
    return h(
      'li',
      {
        class: `jp-Overmind-entry${focused ? ' jp-mod-focused' : ''}`,
        'data-testid': 'overmind-entry',
        'data-key': entry.key,
        'data-focused': focused ? 'true' : undefined
      },
      h(
        'div',
        { class: 'jp-Overmind-row' },
        h('span', { class: 'jp-Overmind-label', title: entry.key }, ...breakable(entry.label)),
        button
      ),
      h(
        'div',
        { class: 'jp-Overmind-hint' },
        `${entry.bytes_text} · ${entry.hits} hit${entry.hits === 1 ? '' : 's'} · last used `,
        ago(entry.last_used),
        ' · ',
        ...users
      ),
      h(
        'div',
        {
          class: 'jp-Overmind-hint',
          'data-testid': 'overmind-entry-miss',
          title: 'What its first load cost: the load itself, and the caching around it'
        },
        `cached in ${entry.miss_text}`
      ),
      entry.progress
        ? progressLine(entry.progress)
        : entry.pending
          ? pendingLine(entry.pending)
          : null
    );
  }

  /** A row evicted a moment ago, as high as it was (see Note [No reflow under the pointer]). */
  private _ghost(entry: IEntry): HTMLElement {
    const row = h(
      'li',
      { class: 'jp-Overmind-entry jp-mod-evicted', 'data-testid': 'overmind-evicted', 'data-key': entry.key },
      h(
        'div',
        { class: 'jp-Overmind-row' },
        h('span', { class: 'jp-Overmind-label', title: entry.key }, ...breakable(entry.label)),
        h(
          'button',
          { class: 'jp-Button jp-mod-minimal jp-Overmind-evict', disabled: '', 'aria-hidden': 'true', tabindex: '-1' },
          'Evict'
        )
      ),
      h('div', { class: 'jp-Overmind-hint' }, `${entry.bytes_text} · evicted`)
    );
    row.style.minHeight = `${this._ghostHeights.get(entry.key) ?? 0}px`; // its progress line gone
    row.style.boxSizing = 'border-box';
    return row;
  }

  private _loading(state: IPanelState): HTMLElement | null {
    if (!state.loading.length) {
      return null;
    }
    return h(
      'section',
      { class: 'jp-Overmind-section', 'data-testid': 'overmind-loading' },
      h('h3', { class: 'jp-Overmind-heading' }, `Loading (${state.loading.length})`),
      h(
        'ul',
        { class: 'jp-Overmind-list' },
        ...state.loading.map(l =>
          h(
            'li',
            { class: 'jp-Overmind-load', 'data-key': l.key },
            l.progress
              ? progressLine(l.progress)
              : h('div', { class: 'jp-Overmind-label' }, 'A model being loaded'),
            h(
              'div',
              { class: 'jp-Overmind-hint' },
              'for ',
              who(l.loader),
              `, ${l.reserved_text} reserved` + (l.waiters ? `, ${l.waiters} waiting` : '') + ', started ',
              ago(l.since)
            )
          )
        )
      )
    );
  }

  private _units(state: IPanelState): HTMLElement | null {
    const units = state.units;
    if (!units) {
      return null; // a daemon without a units ledger
    }
    return h(
      'section',
      { class: 'jp-Overmind-section', 'data-testid': 'overmind-units' },
      h('h3', { class: 'jp-Overmind-heading' }, `GPU units (${state.texts.unit_bytes} each)`),
      units.error && h('div', { class: 'jp-Overmind-error' }, ...prose(units.error)),
      units.devices.length
        ? h('ul', { class: 'jp-Overmind-list' }, ...units.devices.map(d => this._device(d)))
        : h('p', { class: 'jp-Overmind-hint' }, 'No GPU is known to the daemon yet.'),
      this._chart('units', state),
      units.waiting > 0 &&
        h(
          'div',
          { class: 'jp-Overmind-hint' },
          `${units.waiting} request${units.waiting === 1 ? '' : 's'} waiting for units`
        )
    );
  }

  private _device(device: IDevice): HTMLElement {
    return h(
      'li',
      { class: 'jp-Overmind-device', 'data-testid': 'overmind-device', 'data-device': device.device },
      h(
        'div',
        { class: 'jp-Overmind-row' },
        h(
          'span',
          { title: device.model },
          device.device,
          device.simulated && h('span', { class: 'jp-Overmind-badge' }, 'simulated')
        ),
        h('span', {}, `${device.used} / ${device.total} units`)
      ),
      bar(device.used, device.total, 'overmind-device-bar'),
      ...device.holders.map(x =>
        h(
          'div',
          {
            class: `jp-Overmind-hint${this._model.focused && x.name === this._model.focused ? ' jp-mod-focused' : ''}`,
            'data-testid': 'overmind-holder',
            'data-focused': this._model.focused && x.name === this._model.focused ? 'true' : undefined
          },
          `${x.units ?? '?'} for ${x.label || 'a model'}`,
          x.name ? ' (' : '',
          x.name ? who({ ...x, label: x.kernel, pid: x.pid ?? 0 }) : null,
          x.name ? ')' : '',
          x.busy === null ? '' : x.busy ? ', busy' : ', idle'
        )
      )
    );
  }

  private _kernels(all: IConnection[]): HTMLElement {
    const path = this._model.focused;
    // the focused notebook's kernel first
    const kernels = [...all.filter(k => path && k.path === path), ...all.filter(k => !path || k.path !== path)];
    return h(
      'section',
      { class: 'jp-Overmind-section', 'data-testid': 'overmind-kernels' },
      h('h3', { class: 'jp-Overmind-heading' }, `Connected (${kernels.length})`),
      kernels.length
        ? h(
            'ul',
            { class: 'jp-Overmind-list' },
            ...kernels.map(k =>
              h(
                'li',
                {
                  class: `jp-Overmind-kernel${path && k.path === path ? ' jp-mod-focused' : ''}`,
                  'data-testid': 'overmind-kernel',
                  'data-pid': String(k.pid),
                  'data-focused': path && k.path === path ? 'true' : undefined
                },
                h('div', { class: 'jp-Overmind-label', title: k.detail }, ...breakable(k.name)),
                h('div', { class: 'jp-Overmind-hint' }, `${k.role}, `, ...breakable(k.detail))
              )
            )
          )
        : h('p', { class: 'jp-Overmind-hint' }, 'No kernel is connected.')
    );
  }

  private _fallbacks(fallbacks: IFallback[]): HTMLElement | null {
    if (!fallbacks.length) {
      return null;
    }
    const newest = fallbacks.slice(-MAX_FALLBACKS).reverse();
    return h(
      'section',
      { class: 'jp-Overmind-section', 'data-testid': 'overmind-fallbacks' },
      h('h3', { class: 'jp-Overmind-heading' }, `Plain loads (${fallbacks.length})`),
      h(
        'ul',
        { class: 'jp-Overmind-list' },
        ...newest.map(f =>
          h(
            'li',
            { class: 'jp-Overmind-fallback' },
            h('div', {}, ...breakable(`${f.call} — ${f.kind}`)),
            h(
              'div',
              { class: 'jp-Overmind-hint' },
              ...prose(f.reason),
              ' (',
              who(f),
              ', ',
              ago(f.time),
              ')'
            )
          )
        )
      )
    );
  }

  /** Evict one entry once the user confirmed it (a dialog, as for Evict all). */
  private async _evictOne(entry: IEntry): Promise<void> {
    const users = entry.pinned_by.map(nameOf);
    const answer = await showDialog({
      title: `Evict ${entry.label}?`,
      body:
        `${entry.bytes_text} leave the cache: the next load of this model reads it from disk again.` +
        (users.length
          ? ` ${users.join(', ')} keep${users.length === 1 ? 's' : ''} ${users.length === 1 ? 'its' : 'their'} ` +
            'copy; the memory goes with the last of them.'
          : ''),
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Evict' })]
    });
    if (answer.button.accept) {
      await this._evict({ key: entry.key }, entry);
    }
  }

  private async _evict(what: { key: string } | { all: true }, entry?: IEntry): Promise<void> {
    try {
      const gone = await evict(this._settings, what);
      if (entry) {
        // they stay until the pointer leaves the list (see Note [No reflow under the pointer])
        const shown = new Map(this._model.state?.entries.map(e => [e.key, e]) ?? []);
        for (const key of gone) {
          const e = shown.get(key) ?? (key === entry.key ? entry : undefined);
          if (e) {
            this._ghosts.set(key, e);
            const row = this._body.querySelector<HTMLElement>(`[data-testid="overmind-entry"][data-key="${key}"]`);
            this._ghostHeights.set(key, row?.getBoundingClientRect().height ?? 0);
          }
        }
      }
      this._message = '';
    } catch (error) {
      this._message = `Evict failed: ${(error as Error).message}`;
      this._messageUntil = Date.now() + MESSAGE_MS;
    }
    await this._model.refresh();
  }

  private async _evictAll(count: number): Promise<void> {
    const answer = await showDialog({
      title: 'Evict every cached model?',
      body: `${count} model${count === 1 ? '' : 's'} will load from disk again on next use.`,
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Evict all' })]
    });
    if (answer.button.accept) {
      await this._evict({ all: true });
    }
  }

  private _model: OvermindModel;
  private _settings: ServerConnection.ISettings;
  private _status: HTMLElement;
  private _body: HTMLElement;
  private _signature = '';
  private _openChart: ((kind: ChartKind) => void) | null;
  private _ghosts = new Map<string, IEntry>();
  private _ghostHeights = new Map<string, number>();
  private _order: string[] = [];
  private _ages = 0;
  private _message = '';
  private _messageUntil = 0;
}

/** Nodes separated by ", ". */
function joined(nodes: Node[]): Child[] {
  const out: Child[] = [];
  nodes.forEach((node, i) => out.push(...(i ? [', ', node] : [node])));
  return out;
}
