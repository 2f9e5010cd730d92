/**
 * The REST routes of the overmind server extension (overmind_jupyter/server), typed.
 *
 * GET  {baseUrl}overmind/state  -> PanelState, or 503 {message, reason: "daemon_down"}
 * POST {baseUrl}overmind/evict  {key} | {all: true} -> {evicted: string[]}
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IConnection {
  conn: number;
  pid: number;
  role: string;
  label: string;
  pins?: number;
}

/** What the daemon still copies of an entry from its checkpoint files (it is servable already). */
export interface IPending {
  bytes: number;
  done: number;
  copying: boolean;
  eta: number | null;
  sources: string[];
}

export interface IEntry {
  key: string;
  label: string;
  bytes: number;
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
  loader: IConnection;
  waiters: number;
}

export interface IFallback {
  time: number;
  pid: number;
  label: string;
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
  units: number | null;
  busy: boolean | null;
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
  holders: IUnitHolder[];
}

export interface IUnits {
  simulated: boolean;
  unit_bytes: number;
  error: string | null;
  waiting: number;
  devices: IDevice[];
}

export interface IPanelState {
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
  entries: IEntry[];
  loading: ILoad[];
  kernels: IConnection[];
  fallbacks: IFallback[];
  units: IUnits | null;
}

/** What a poll found: the state, or the daemon's absence (not an error: no model was loaded yet). */
export type StateResult =
  | { kind: 'ok'; state: IPanelState }
  | { kind: 'down'; message: string };

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
  if (status === 200) {
    return { kind: 'ok', state: body as IPanelState };
  }
  if (status === 503 && body?.reason === 'daemon_down') {
    return { kind: 'down', message: String(body.message) };
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
  return body.evicted as string[];
}
