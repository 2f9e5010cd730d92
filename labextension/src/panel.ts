/**
 * The side panel: what the daemon holds, polled from the server extension while the panel is shown.
 *
 * Stable hooks for tests and styles: the root has class `jp-Overmind`; every part carries a
 * `data-testid` (overmind-status, overmind-down, overmind-error, overmind-summary, overmind-entries,
 * overmind-entry [data-key], overmind-evict, overmind-evict-all, overmind-empty, overmind-units,
 * overmind-device, overmind-kernels, overmind-fallbacks, overmind-refresh).
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import {
  evict,
  fetchState,
  IConnection,
  IDevice,
  IEntry,
  IFallback,
  IPanelState,
  IPending,
  StateResult
} from './api';

/** Milliseconds between two polls while the panel is shown; errors back off up to MAX_INTERVAL. */
const INTERVAL = 2000;
/** Slower while no daemon runs: each of those answers is a 503 in the server's log. */
const DOWN_INTERVAL = 5000;
const MAX_INTERVAL = 30000;
const MAX_FALLBACKS = 20;
/** Milliseconds between two renderings of unchanged state, for the ages it shows. */
const AGE_MS = 30000;
/** Milliseconds an error of an evict stays on show. */
const MESSAGE_MS = 10000;

type Child = Node | string | null | undefined | false;

/** A DOM element with attributes (a `data-*`, `class`, `title`...) and children. */
function h(
  tag: string,
  attrs: Record<string, string | undefined> = {},
  ...children: Child[]
): HTMLElement {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== undefined) {
      el.setAttribute(name, value);
    }
  }
  for (const child of children) {
    if (child) {
      el.append(child);
    }
  }
  return el;
}

/** 1536 -> "1.5 KiB"; binary units, as the budget and the GPU units are counted. */
export function formatBytes(n: number): string {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = n;
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i++;
  }
  if (i === 0) {
    return `${value} B`;
  }
  const digits = value < 10 && !Number.isInteger(value) ? 1 : 0;
  return `${value.toFixed(digits)} ${units[i]}`;
}

/** An entry's compaction: served from its checkpoint while the daemon copies it into its arena. */
function pendingLine(pending: IPending): HTMLElement {
  const percent = Math.floor((100 * pending.done) / Math.max(1, pending.bytes));
  const text = pending.copying
    ? `copying from its checkpoint: ${percent}%` +
      (pending.eta !== null ? `, ${Math.round(pending.eta)} s left` : '')
    : 'served from its checkpoint; copy queued';
  return h(
    'div',
    { class: 'jp-Overmind-hint', 'data-testid': 'overmind-pending' },
    h('progress', { max: '100', value: String(percent) }),
    ` ${text}`
  );
}

/** Seconds since the epoch -> "12 s ago", "3 min ago", "2 h ago". */
function ago(seconds: number): string {
  const delta = Math.max(0, Date.now() / 1000 - seconds);
  if (delta < 60) {
    return 'less than a minute ago';
  }
  if (delta < 3600) {
    return `${Math.round(delta / 60)} min ago`;
  }
  return `${Math.round(delta / 3600)} h ago`;
}

function who(c: { pid: number; label: string }): string {
  return c.label ? `${c.label} (pid ${c.pid})` : `pid ${c.pid}`;
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
    serverSettings: ServerConnection.ISettings;
  }
}

export class OvermindPanel extends Widget {
  constructor(options: OvermindPanel.IOptions) {
    super();
    this.addClass('jp-Overmind');
    this._settings = options.serverSettings;

    const refresh = h(
      'button',
      {
        class: 'jp-Button jp-mod-minimal jp-Overmind-refresh',
        title: 'Refresh now',
        'data-testid': 'overmind-refresh'
      },
      '⟳'
    );
    refresh.addEventListener('click', () => void this._poll.refresh());
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

    this._poll = new Poll<StateResult, Error, 'overmind-state'>({
      auto: true,
      factory: () => this._load(),
      frequency: { interval: INTERVAL, backoff: true, max: MAX_INTERVAL },
      name: 'overmind:state',
      // Stand by while the panel is hidden (another tab of the sidebar, a collapsed sidebar)
      // and while the browser tab is hidden.
      standby: () => !this.isVisible || 'when-hidden'
    });
  }

  /** The latest state shown (null while the daemon is down or before the first answer). */
  get state(): IPanelState | null {
    return this._state;
  }

  /** Fetch the state now (after an evict, when the panel is shown). */
  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._poll.refresh();
  }

  private async _load(): Promise<StateResult> {
    let result: StateResult;
    try {
      result = await fetchState(this._settings);
    } catch (error) {
      this._setStatus('error', `${(error as Error).message}`);
      this._state = null;
      this._render(null, '');
      throw error; // the poll backs off
    }
    const interval = result.kind === 'down' ? DOWN_INTERVAL : INTERVAL;
    this._poll.frequency = { ...this._poll.frequency, interval };
    if (result.kind === 'down') {
      this._state = null;
      this._setStatus('down', 'no daemon');
      this._render(null, result.message);
    } else {
      this._state = result.state;
      const d = result.state.daemon;
      this._setStatus('ok', `daemon pid ${d.pid}, v${d.version} at ${d.home}`);
      this._render(result.state, '');
    }
    return result;
  }

  private _setStatus(kind: string, text: string): void {
    this._status.dataset.state = kind;
    this._status.textContent = text;
  }

  /** Rebuild the body when what it shows changed (so a button under the pointer stays put). */
  private _render(state: IPanelState | null, down: string): void {
    const message = Date.now() < this._messageUntil ? this._message : '';
    const clock = Math.floor(Date.now() / AGE_MS); // "used 3 min ago" moves on
    const signature = JSON.stringify([state, down, message, clock]);
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
            h('p', { class: 'jp-Overmind-hint' }, down)
          )
        );
      }
    } else {
      parts.push(
        this._summary(state),
        this._entries(state),
        this._loading(state),
        this._units(state),
        this._kernels(state.kernels),
        this._fallbacks(state.fallbacks)
      );
    }
    this._body.replaceChildren(...(parts.filter(Boolean) as Node[]));
  }

  private _summary(state: IPanelState): HTMLElement {
    const hits = state.stats.hits ?? 0;
    const misses = state.stats.misses ?? 0;
    const rate = hits + misses > 0 ? ` (${Math.round((100 * hits) / (hits + misses))}% hits)` : '';
    return h(
      'section',
      { class: 'jp-Overmind-section', 'data-testid': 'overmind-summary' },
      h(
        'div',
        { class: 'jp-Overmind-row' },
        h('span', {}, 'Cache'),
        h(
          'span',
          { 'data-testid': 'overmind-used' },
          `${formatBytes(state.used)} of ${formatBytes(state.budget)}`
        )
      ),
      bar(state.used + state.reserved, state.budget, 'overmind-budget'),
      state.reserved > 0 &&
        h('div', { class: 'jp-Overmind-hint' }, `${formatBytes(state.reserved)} reserved by loads in flight`),
      h(
        'div',
        { class: 'jp-Overmind-row', 'data-testid': 'overmind-stats' },
        h('span', {}, 'Hits / misses'),
        h('span', {}, `${hits} / ${misses}${rate}`)
      )
    );
  }

  private _entries(state: IPanelState): HTMLElement {
    const evictAll = h(
      'button',
      {
        class: 'jp-Button jp-mod-minimal jp-Overmind-evictAll',
        title: 'Evict every cached model',
        'data-testid': 'overmind-evict-all'
      },
      'Evict all'
    );
    evictAll.addEventListener('click', () => void this._evictAll(state.entries.length));
    if (state.entries.length === 0) {
      evictAll.setAttribute('disabled', '');
    }
    const list =
      state.entries.length === 0
        ? h(
            'p',
            { class: 'jp-Overmind-empty', 'data-testid': 'overmind-empty' },
            'No model is cached yet. Run `%overmind on` in a notebook, then load a model ' +
              'with from_pretrained: it stays here across kernel restarts.'
          )
        : h(
            'ul',
            { class: 'jp-Overmind-list', 'data-testid': 'overmind-entries' },
            ...state.entries.map(e => this._entry(e))
          );
    return h(
      'section',
      { class: 'jp-Overmind-section' },
      h(
        'h3',
        { class: 'jp-Overmind-heading' },
        h('span', {}, `Cached models (${state.entries.length})`),
        evictAll
      ),
      list
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
    button.addEventListener('click', () => void this._evict({ key: entry.key }));
    const users = entry.pinned_by.length
      ? `in use by ${entry.pinned_by.map(who).join(', ')}`
      : 'not in use';
    return h(
      'li',
      { class: 'jp-Overmind-entry', 'data-testid': 'overmind-entry', 'data-key': entry.key },
      h(
        'div',
        { class: 'jp-Overmind-row' },
        h('span', { class: 'jp-Overmind-label', title: entry.key }, entry.label),
        button
      ),
      h(
        'div',
        { class: 'jp-Overmind-hint' },
        `${formatBytes(entry.bytes)} · ${entry.hits} hit${entry.hits === 1 ? '' : 's'} · ` +
          `used ${ago(entry.last_used)} · ${users}`
      ),
      entry.pending ? pendingLine(entry.pending) : null
    );
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
            { class: 'jp-Overmind-hint' },
            `${l.key.slice(0, 12)} by ${who(l.loader)}, ${formatBytes(l.reserved)} reserved, ` +
              `${l.waiters} waiting, since ${ago(l.since)}`
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
    const size = formatBytes(units.unit_bytes);
    return h(
      'section',
      { class: 'jp-Overmind-section', 'data-testid': 'overmind-units' },
      h('h3', { class: 'jp-Overmind-heading' }, `GPU units (${size} each)`),
      units.error && h('div', { class: 'jp-Overmind-error' }, units.error),
      units.devices.length
        ? h('ul', { class: 'jp-Overmind-list' }, ...units.devices.map(d => this._device(d)))
        : h('p', { class: 'jp-Overmind-hint' }, 'No GPU is known to the daemon yet.'),
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
          { class: 'jp-Overmind-hint', 'data-testid': 'overmind-holder' },
          `${x.units ?? '?'} for ${x.label || 'a model'}` +
            (x.kernel || x.pid !== null ? ` (${x.kernel || 'pid ' + x.pid})` : '') +
            (x.busy === null ? '' : x.busy ? ', busy' : ', idle')
        )
      )
    );
  }

  private _kernels(kernels: IConnection[]): HTMLElement {
    return h(
      'section',
      { class: 'jp-Overmind-section', 'data-testid': 'overmind-kernels' },
      h('h3', { class: 'jp-Overmind-heading' }, `Connected (${kernels.length})`),
      kernels.length
        ? h(
            'ul',
            { class: 'jp-Overmind-list' },
            ...kernels.map(k => h('li', { class: 'jp-Overmind-hint' }, `${k.role}: ${who(k)}`))
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
            h('div', {}, `${f.call} — ${f.kind}`),
            h('div', { class: 'jp-Overmind-hint' }, `${f.reason} (${who(f)}, ${ago(f.time)})`)
          )
        )
      )
    );
  }

  private async _evict(what: { key: string } | { all: true }): Promise<void> {
    try {
      await evict(this._settings, what);
      this._message = '';
    } catch (error) {
      this._message = `Evict failed: ${(error as Error).message}`;
      this._messageUntil = Date.now() + MESSAGE_MS;
    }
    await this._poll.refresh();
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

  private _settings: ServerConnection.ISettings;
  private _poll: Poll<StateResult, Error, 'overmind-state'>;
  private _status: HTMLElement;
  private _body: HTMLElement;
  private _state: IPanelState | null = null;
  private _signature = '';
  private _message = '';
  private _messageUntil = 0;
}
