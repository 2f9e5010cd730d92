/**
 * The REST routes of the overmind server extension (overmind_jupyter/server), typed.
 *
 * GET  {baseUrl}overmind/state  -> {state: "ok", ...IPanelState} or {state: "down", message, home}
 * POST {baseUrl}overmind/evict  {key} | {all: true} -> {evicted: [{key, label, bytes}]}

 * Sizes and durations come with their display strings (`bytes_text`, `texts`, `progress.text`), written
 * on the server by the formatter the CLI and the notebook widgets share; relative times use
 * JupyterLab's `Time.formatHuman`.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** A process connected to the daemon, named by the server (its notebook, else its label or command). */
export interface IConnection {
  conn: number;
  pid: number;
  role: string;
  label: string;
  /** What the panel shows: the notebook's or console's path, else the daemon's label or command. */
  name: string;
  /** "pid 123, notebook kernel 1a2b3c4d", or "pid 123: python train.py" outside the server. */
  detail: string;
  command?: string;
  /** The session's path, for a kernel of this Jupyter server. */
  path?: string;
  session_type?: string;
  kernel_id?: string;
  pins?: number;
  /** The connection of the kernel that draws the view (the notebook widgets'; never in the panel). */
  mine?: boolean;
}

/** A long operation the daemon reports: a load in flight, a preload, work on an entry. */
export interface IProgress {
  /** The model's name. */
  label: string;
  done: number;
  total: number;
  unit: string;
  eta_s: number | null;
  /** 0-100, null while the total is unknown. */
  percent: number | null;
  /** "loading llama: 40% (1.2 GiB of 3.0 GiB), 3.5 s left". */
  text: string;
}

/**
 * What the miss that made an entry cost its caller, in seconds: the whole wait (`waited_s`, from the
 * call's start to its return) is the load itself (`load_s`) plus caching (`cache_s`). The kernel measured
 * them and printed them in the cell (Note [Load time saved] in kernel_server/store.py).
 */
export interface IMissTimes {
  waited_s: number;
  load_s: number;
  cache_s: number;
}

/** A hit of the session: the plain load's time (`load_s`, measured at the miss) against the hit's wait. */
export interface IHit extends IMissTimes {
  t: number;
  key: string;
  label: string;
  pid: number;
  /** The hit's whole wait; null until the kernel reported it (after the hit, never on its path). */
  hit_s: number | null;
}

/** The sums behind the time saved, since the daemon started: saved_s = plain_s - hit_s - cache_s. */
export interface ITimeSaved {
  misses: number;
  cache_s: number;
  hits: number;
  plain_s: number;
  hit_s: number;
  saved_s: number;
  /** Hits left out of the sums, their times never reported: of kernels that ended before reporting them. */
  untimed_ended?: number;
  /** And of kernels that run and have yet to report them. */
  untimed_waiting?: number;
}

/** What the daemon still copies of an entry from its checkpoint files (it is servable already). */
export interface IPending {
  bytes: number;
  done: number;
  copying: boolean;
  /** False: never copied (OVERMIND_COMPACT=0). */
  queued: boolean;
  /** True: the copy waits for room on the disk (OVERMIND_DISK_RESERVE). */
  short_of_disk: boolean;
  eta: number | null;
  sources: string[];
  /** "copying from its checkpoint: 40%, 3.5 s left". */
  text: string;
}

export interface IEntry extends IMissTimes {
  key: string;
  label: string;
  bytes: number;
  bytes_text: string;
  /** "20 s: loading 8.0 s + caching 12 s", as the cell said it after the miss. */
  miss_text: string;
  progress?: IProgress | null;
  hits: number;
  created: number;
  last_used: number;
  backing?: string;
  pinned_by: IConnection[];
  pending?: IPending | null;
}

export interface ILoad {
  key: string;
  since: number;
  reserved: number;
  reserved_text: string;
  loader: IConnection;
  waiters: number;
  progress?: IProgress | null;
}

export interface IFallback {
  time: number;
  pid: number;
  label: string;
  name: string;
  detail: string;
  call: string;
  kind: string;
  reason: string;
}

export interface IUnitHolder {
  /** The model the units are for. */
  label: string;
  /** The kernel that holds them. */
  kernel: string;
  pid: number | null;
  /** The holding kernel as the panel names it. */
  name: string;
  detail: string;
  units: number | null;
  busy: boolean | null;
  /** Seconds since it went idle (null while busy), and as text ('' while busy). */
  idle_s: number | null;
  idle_text: string;
  /** The ledger asked it to give its units back for a waiting request. */
  release_requested: boolean;
  /** A device copy the copier keeps for speed: the first holding asked back (Note [Spare holdings]). */
  spare: boolean;
  /** Held by the kernel that shows the view (a notebook widget's own kernel). */
  mine?: boolean;
}

/** A request for units that waits for room. */
export interface IUnitWaiter {
  /** The model it is for. */
  label: string;
  units: number;
  /** The devices it may take. */
  devices: string[];
  waited_s: number;
  waited_text: string;
  /** The waiting kernel as the panel names it. */
  name: string;
  detail: string;
}

export interface IDevice {
  /** How kernels address it ("cuda:0"). */
  device: string;
  /** The ledger's id of the physical device. */
  id: string;
  model: string;
  total: number;
  used: number;
  free: number;
  simulated: boolean;
  /** The device's memory, in bytes, and as text. */
  total_bytes: number;
  total_text: string;
  holders: IUnitHolder[];
}

export interface IUnits {
  simulated: boolean;
  unit_bytes: number;
  error: string | null;
  /** OVERMIND_FAKE_GPUS of the daemon ('' with real devices). */
  fake_gpus: string;
  /** GiB of each device the ledger keeps out of its units. */
  reserve_gib: number;
  waiting: number;
  waiters: IUnitWaiter[];
  devices: IDevice[];
}

export interface IPanelState {
  state: 'ok';
  daemon: {
    pid: number;
    version: string;
    protocol: number;
    home: string;
    started: number;
  };
  budget: number;
  used: number;
  reserved: number;
  stats: { hits?: number; misses?: number; [name: string]: number | undefined };
  /** The largest entries, then the most recently used: not every one when the daemon holds many. */
  entries: IEntry[];
  /** The entries cached in all, those not in `entries`, and the bytes these hold. */
  entries_total: number;
  entries_more: number;
  more_bytes: number;
  loading: ILoad[];
  kernels: IConnection[];
  fallbacks: IFallback[];
  hits_log: IHit[];
  time_saved: ITimeSaved;
  units: IUnits | null;
  texts: {
    used: string;
    budget: string;
    reserved: string;
    unit_bytes: string;
    more_bytes: string;
    /** The disk under the file arenas: what they take there, what is free and kept free ('' in memory). */
    disk: string;
    /**
     * Of `time_saved`: the plain loads the hits replaced, the hits' waits, the misses' caching, and what
     * the cache saved (the first less the other two; "none" while caching cost more), said with its parts.
     */
    plain: string;
    hits: string;
    caching: string;
    saved: string;
    saved_detail: string;
  };
}

/** The server's answer while no daemon runs (not an error: no kernel has loaded a model yet). */
export interface IDownState {
  state: 'down';
  message: string;
  home: string;
}

/** What a poll found: the state, or the daemon's absence (not an error: no model was loaded yet). */
export type StateResult = IPanelState | IDownState;

/** An answer of the server that is not what the panel asked for; its message is readable. */
export class OvermindRequestError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

async function request(
  settings: ServerConnection.ISettings,
  path: string,
  init: RequestInit = {}
): Promise<{ status: number; body: any }> {
  const url = URLExt.join(settings.baseUrl, 'overmind', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new OvermindRequestError(`the Jupyter server cannot be reached: ${error}`, 0);
  }
  const text = await response.text();
  let body: any = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = { message: text };
  }
  return { status: response.status, body };
}

export async function fetchState(
  settings: ServerConnection.ISettings
): Promise<StateResult> {
  const { status, body } = await request(settings, 'state');
  if (status === 200 && (body?.state === 'ok' || body?.state === 'down')) {
    return body as StateResult;
  }
  throw new OvermindRequestError(
    body?.message || `the server answered ${status}`,
    status
  );
}

export async function evict(
  settings: ServerConnection.ISettings,
  what: { key: string } | { all: true }
): Promise<string[]> {
  const { status, body } = await request(settings, 'evict', {
    method: 'POST',
    body: JSON.stringify(what)
  });
  if (status !== 200) {
    throw new OvermindRequestError(
      body?.message || `the server answered ${status}`,
      status
    );
  }
  // the keys that went (the entry and its dependents), from the keys or the records of what went
  return (body.evicted as Array<string | { key: string }>).map(e => (typeof e === 'string' ? e : e.key));
}
