"""The Jupyter server's one connection to the user's daemon.

# Note [The server never spawns]
The server extension only reads the daemon and evicts from it; it never starts one. A daemon started by
the server would outlive it, hold the user's state directory and answer kernels that never asked for it;
and a panel that started one on every poll would hide the real state ("no daemon runs") from the user.
Kernels start the daemon (`%overmind on`, `cached(...)`); until then the panel says so.

The connection is opened on the first request, kept (one hello per server, not one per poll), opened
again when the daemon went away or OVERMIND_HOME changed, and closed with `close()`. It holds no lease:
no pins, no units, no in-flight loads (docs/design.md invariant 5), so it never keeps anything alive.
Every method blocks on the socket: the handlers call them in an executor, off the event loop.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from kernel_server import lifecycle
from kernel_server.client import Client, Response
from kernel_server.errors import DaemonUnavailable

__all__ = ["DaemonDown", "DaemonLink"]

_TIMEOUT = 10.0  # seconds a state or evict request may take before the panel hears about it


class DaemonDown(DaemonUnavailable):
    """No daemon answers at `home` (and the server starts none); the message says how one starts."""

    def __init__(self, home: Path | str, detail: str = "") -> None:
        message = (f"no overmind daemon runs at {home}; it starts with the first `%overmind on` "
                   "(or `overmind_jupyter.cached(...)`) in a kernel")
        super().__init__(f"{message} ({detail})" if detail else message)
        self.home = str(home)


class DaemonLink:
    """One connection to the daemon of the current OVERMIND_HOME, shared by the server's handlers.

    Args:
        label: how this server appears in the daemon's list of connections.
        timeout: seconds to wait for each answer.
    """

    def __init__(self, label: str = "", *, timeout: float = _TIMEOUT) -> None:
        self.label = label or f"jupyter-server pid {os.getpid()}"
        self.timeout = timeout
        self._client: Client | None = None
        self._lock = threading.Lock()

    @property
    def conn_id(self) -> int | None:
        """This server's connection id at the daemon (to leave it out of the panel's kernels)."""
        client = self._client
        return None if client is None or client.closed else client.conn_id

    def request(self, op: str, **fields: Any) -> Response[Any]:
        """Send `op` to the daemon and return its answer; a daemon that restarted since the last call
        is reached again once.

        Raises:
            DaemonDown: no daemon answers (the state directory may not even exist yet).
            StateDirError: the state directory exists but is unsafe (its message says what to do).
            RemoteError: the daemon refused the request (unknown key, ...).
        """
        for attempt in (0, 1):
            client = self._connect()
            try:
                return client.request(op, timeout=self.timeout, **fields)
            except DaemonUnavailable as exc:
                self._drop(client)
                if attempt:
                    raise DaemonDown(client.home, str(exc)) from exc
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _connect(self) -> Client:
        home = _home()
        with self._lock:
            client = self._client
            if client is not None and not client.closed and client.home == home:
                return client
            self._client = None
            if client is not None:
                client.close()
            try:
                # Note [The server never spawns]
                client = Client(home, spawn=False, role="server", label=self.label, timeout=self.timeout)
            except DaemonUnavailable as exc:
                raise DaemonDown(home) from exc
            self._client = client
            return client

    def _drop(self, client: Client) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
        client.close()


def _home() -> Path:
    """The state directory the kernels of this server use (OVERMIND_HOME, ...), as the CLI finds it.

    Raises:
        StateDirError: the directory is unsafe or unusable; its message says what to do.
    """
    return lifecycle.state_dir()
