/**
 * The side panel: what the daemon holds, from the poll it shares with the status-bar item.
 *
 * Stable hooks for tests and styles: the root has class `jp-Overmind`; every part carries a
 * `data-testid` (overmind-status, overmind-down, overmind-error, overmind-summary, overmind-entries,
 * overmind-entry [data-key], overmind-evict, overmind-evict-all, overmind-empty, overmind-loading,
 * overmind-progress, overmind-units, overmind-device, overmind-kernels, overmind-kernel [data-pid],
 * overmind-fallbacks, overmind-refresh, and the charts overmind-chart-memory [data-segments],
 * overmind-chart-saved [data-hits], overmind-chart-units).
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Time } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { refreshIcon } from '@jupyterlab/ui-components';
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
  IProgress
} from './api';
import { memoryChart, savedChart, unitsChart } from './charts';
import { breakable, Child, h, prose, who } from './dom';
import { OvermindModel } from './model';

const MAX_FALLBACKS = 20;
/** Milliseconds between two refreshes of the relative times on show ("5 seconds ago"). */
const AGE_MS = 1000;
/** Milliseconds an error of an evict stays on show. */
const MESSAGE_MS = 10000;

/** Seconds since the epoch, as JupyterLab writes relative times ("2 minutes ago"). */
function agoText(seconds: number): string {
  return Time.formatHuman(new Date(seconds * 1000));
}

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

/** "3 hits of 4 lookups (75%)". */
export function hitRate(stats: IPanelState['stats']): { text: string; percent: number | null } {
  const hits = stats.hits ?? 0;
  const misses = stats.misses ?? 0;
  const percent = hits + misses > 0 ? Math.round((100 * hits) / (hits + misses)) : null;
  return { text: `${hits} / ${misses}${percent === null ? '' : ` (${percent}% hits)`}`, percent };
}

export namespace OvermindPanel {
  export interface IOptions {
    model: OvermindModel;
    serverSettings: ServerConnection.ISettings;
  }
}

export class OvermindPanel extends Widget {
  constructor(options: OvermindPanel.IOptions) {
    super();
    this.addClass('jp-Overmind');
    this._model = options.model;
    this._settings = options.serverSettings;

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
    const signature = JSON.stringify([state, down, message, samples]);
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
      parts.push(
        this._summary(state),
        this._loading(state),
        this._entries(state),
        savedChart(state.hits_log, state.texts),
        this._units(state),
        this._kernels(state.kernels),
        this._fallbacks(state.fallbacks)
      );
    }
    this._body.replaceChildren(...(parts.filter(Boolean) as Node[]));
  }

  private _summary(state: IPanelState): HTMLElement {
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
          `${state.texts.used} of ${state.texts.budget}`
        )
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
      memoryChart(state)
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
    const total = state.entries_total;
    evictAll.addEventListener('click', () => void this._evictAll(total));
    const list =
      state.entries.length === 0
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
            ...state.entries.map(e => this._entry(e))
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
    button.addEventListener('click', () => void this._evict({ key: entry.key }));
    const users: Child[] = entry.pinned_by.length
      ? ['in use by ', ...joined(entry.pinned_by.map(who))]
      : ['not in use'];
    return h(
      'li',
      { class: 'jp-Overmind-entry', 'data-testid': 'overmind-entry', 'data-key': entry.key },
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
      entry.progress
        ? progressLine(entry.progress)
        : entry.pending
          ? pendingLine(entry.pending)
          : null
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
      unitsChart(state, this._model.unitSamples),
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
          `${x.units ?? '?'} for ${x.label || 'a model'}`,
          x.name ? ' (' : '',
          x.name ? who({ ...x, label: x.kernel, pid: x.pid ?? 0 }) : null,
          x.name ? ')' : '',
          x.busy === null ? '' : x.busy ? ', busy' : ', idle'
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
            ...kernels.map(k =>
              h(
                'li',
                { class: 'jp-Overmind-kernel', 'data-testid': 'overmind-kernel', 'data-pid': String(k.pid) },
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

  private async _evict(what: { key: string } | { all: true }): Promise<void> {
    try {
      await evict(this._settings, what);
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
