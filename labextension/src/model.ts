/**
 * One poll of the server extension, shared by the side panel and the status-bar item.
 *
 * It polls while one of its views is shown (the panel, or the status item) and the browser tab is
 * visible, at the interval of the settings; slower while no daemon runs. It keeps the GPU units of each
 * device over the last samples, for the panel's chart of units over time.
 */

import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { fetchState, IPanelState, StateResult } from './api';

/** Seconds between two polls unless the settings say otherwise. */
export const DEFAULT_INTERVAL_S = 2;
/** While no daemon runs, poll at most this often (a daemon starts with a kernel, not in a hurry). */
const DOWN_INTERVAL_MS = 5000;
const MAX_INTERVAL_MS = 30000;
/** Samples of GPU units kept for the chart: about five minutes at the default interval. */
const UNIT_SAMPLES = 150;

/**
 * The fraction of the budget held (entries, and loads in flight) from which the status item and the
 * panel's memory line turn the warning colour, as jupyter-resource-usage's memory item does near its
 * limit: from there on, the next model loaded is likely to evict the least recently used ones.
 */
export const WARN_FRACTION = 0.9;

/** The fraction of its budget the cache holds: its entries and what loads in flight reserved. */
export function heldFraction(state: { used: number; reserved: number; budget: number }): number {
  return state.budget > 0 ? (state.used + state.reserved) / state.budget : 0;
}

/** The GPU units each device had in use at one poll. */
export interface IUnitSample {
  t: number;
  used: Record<string, number>;
}

/** What the views show: the last answer, or the error of the last poll. */
export type ModelView =
  | { state: 'connecting' }
  | { state: 'error'; message: string }
  | StateResult;

export class OvermindModel {
  constructor(settings: ServerConnection.ISettings) {
    this._settings = settings;
    this._poll = new Poll<StateResult, Error, 'overmind-state'>({
      auto: true,
      factory: () => this._load(),
      frequency: { interval: DEFAULT_INTERVAL_S * 1000, backoff: true, max: MAX_INTERVAL_MS },
      name: 'overmind:state',
      // Stand by while no view is shown, and while the browser tab is hidden.
      standby: () => !this._isWanted() || 'when-hidden'
    });
  }

  /** Emitted after every poll. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get view(): ModelView {
    return this._view;
  }

  /** The daemon's state, or null while there is none to show. */
  get state(): IPanelState | null {
    return this._view.state === 'ok' ? this._view : null;
  }

  /** GPU units in use per device, oldest first. */
  get unitSamples(): readonly IUnitSample[] {
    return this._samples;
  }

  /**
   * The path of the notebook (or console) last focused in the main area ('' before one was): the views
   * show its kernel's models and units first (as jupyter-resource-usage's kernel usage follows it).
   */
  get focused(): string {
    return this._focused;
  }

  set focused(path: string) {
    if (path !== this._focused) {
      this._focused = path;
      this._changed.emit();
    }
  }

  /** Seconds between two polls (from the settings). */
  set interval(seconds: number) {
    this._intervalMs = Math.max(0.5, seconds) * 1000;
    this._applyInterval();
  }

  /** Poll only while this says a view is shown. */
  set wanted(test: () => boolean) {
    this._isWanted = test;
  }

  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  dispose(): void {
    this._poll.dispose();
    Signal.clearData(this);
  }

  private async _load(): Promise<StateResult> {
    try {
      const result = await fetchState(this._settings);
      this._view = result;
      if (result.state === 'ok') {
        this._sample(result);
      }
      this._applyInterval();
      return result;
    } catch (error) {
      this._view = { state: 'error', message: (error as Error).message };
      throw error; // the poll backs off
    } finally {
      this._changed.emit();
    }
  }

  private _applyInterval(): void {
    const down = this._view.state === 'down';
    const interval = down ? Math.max(this._intervalMs, DOWN_INTERVAL_MS) : this._intervalMs;
    if (this._poll.frequency.interval !== interval) {
      this._poll.frequency = { ...this._poll.frequency, interval };
    }
  }

  private _sample(state: IPanelState): void {
    const devices = state.units?.devices ?? [];
    if (!devices.length) {
      return;
    }
    const used: Record<string, number> = {};
    for (const d of devices) {
      used[d.device] = d.used;
    }
    this._samples.push({ t: Date.now() / 1000, used });
    if (this._samples.length > UNIT_SAMPLES) {
      this._samples.splice(0, this._samples.length - UNIT_SAMPLES);
    }
  }

  private _settings: ServerConnection.ISettings;
  private _poll: Poll<StateResult, Error, 'overmind-state'>;
  private _changed = new Signal<this, void>(this);
  private _view: ModelView = { state: 'connecting' };
  private _samples: IUnitSample[] = [];
  private _intervalMs = DEFAULT_INTERVAL_S * 1000;
  private _isWanted: () => boolean = () => true;
  private _focused = '';
}
