"""The client side of the daemon's protocol: one connection, many threads.

A `Client` owns one connection (its lease, docs/design.md invariant 5), a reader thread that routes each
reply to the request that awaits it, and a thread that runs push handlers. It imports nothing heavy.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import lifecycle
from .errors import (
    DaemonHung,
    DaemonLost,
    DaemonUnavailable,
    DescriptorsLost,
    PeerRefused,
    ProtocolError,
    ProtocolMismatch,
    RemoteError,
    WaitTimeout,
)
from .operations import Op, error_for
from .protocol import PROTOCOL_VERSION, Frame, FrameKind
from .transport import close_fds, recv_frame, send_frame

__all__ = ["ANSWER_TIMEOUT", "Client", "Response", "existing_shared_client", "reset_shared_client", "shared_client"]

# Note [Two kinds of waiting]
# Waiting for another kernel's load of the same model is long (bounded by the caller's timeout, and
# listed by status as a waiter); waiting for the daemon to answer anything is short: a daemon that does
# not answer within ANSWER_TIMEOUT seconds (stopped by SIGSTOP, stuck) is given up (DaemonHung), the
# load runs plainly, and the next call connects anew. `wait_alive` tells the two apart by pinging the
# daemon on the same connection while a reply is outstanding: a live daemon answers pings while it
# holds a lookup for another kernel's load.
ANSWER_TIMEOUT = 3.0



@dataclass
class Response:
    payload: dict[str, Any]
    fds: list[int] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.payload[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.payload.get(name, default)

    def close(self) -> None:
        close_fds(self.fds)
        self.fds = []


class Client:
    """A connection to the user's daemon, started on demand.

    Args:
        home: the state directory; defaults to `lifecycle.state_dir()` (OVERMIND_HOME).
        spawn: start a daemon if none answers.
        role: shown by `overmind-daemon status` ("kernel", "worker", "cli").
        label: a name for this process (the kernel id, say).
        timeout: seconds to wait for a daemon to come up.
    """

    def __init__(self, home: Path | None = None, *, spawn: bool = True, role: str = "kernel",
                 label: str = "", timeout: float = 15.0) -> None:
        self.home = home if home is not None else lifecycle.state_dir()
        self.pid = os.getpid()
        sock = lifecycle.try_connect(self.home)
        if sock is None:
            if not spawn:
                raise DaemonUnavailable(f"no daemon runs at {self.home}; start one with `overmind-daemon start`")
            proc = lifecycle.spawn_daemon(self.home)
            sock = lifecycle.wait_for_socket(self.home, proc, timeout)
        self._sock = sock
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[Frame]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = False
        self._failure: Exception | None = None
        self._push_handlers: dict[str, list[Callable[[dict[str, Any]], None]]] = {}
        self._pushes: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_loop, name="overmind-client", daemon=True)
        self._reader.start()
        self._pusher = threading.Thread(target=self._push_loop, name="overmind-push", daemon=True)
        self._pusher.start()
        try:
            hello = self.request(Op.HELLO, protocol=PROTOCOL_VERSION, role=role, label=label, pid=os.getpid(),
                                 timeout=ANSWER_TIMEOUT)
        except WaitTimeout:
            self.close()
            raise DaemonHung(f"the daemon at {self.home} accepted the connection but did not answer within "
                             f"{ANSWER_TIMEOUT:.0f} s (stopped, or stuck: see {lifecycle.log_path(self.home)}); "
                             "loads run plainly until it answers") from None
        except RemoteError as exc:
            self.close()
            if exc.code == "protocol_mismatch":
                raise ProtocolMismatch(str(exc)) from None
            raise
        except BaseException:
            self.close()
            raise
        self.daemon_pid: int = hello["pid"]
        self.conn_id: int = hello["conn"]
        self.budget: int = hello["budget"]

    # -- requests -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed or self._failure is not None

    def submit(self, op: str, *, fds: Sequence[int] = (), **fields: Any) -> tuple[int, Future[Frame]]:
        """Send a request; returns its id and a future for the reply frame."""
        fut: Future[Frame] = Future()
        with self._lock:
            if isinstance(self._failure, PeerRefused):  # however the refusal raced the hello
                raise PeerRefused(str(self._failure))
            if self._failure is not None:
                raise DaemonLost(f"connection to the daemon is gone: {self._failure}")
            if self._closed:
                raise DaemonUnavailable("this client was closed")
            request_id = next(self._ids)
            self._pending[request_id] = fut
        try:
            with self._send_lock:
                send_frame(self._sock, FrameKind.REQUEST, {"op": op, "id": request_id, **fields}, fds)
        except OSError as exc:
            with self._lock:
                self._pending.pop(request_id, None)
            self._reader.join(1.0)  # it may hold the daemon's reason for closing (a refusal)
            if isinstance(self._failure, PeerRefused):
                raise self._failure from exc
            raise DaemonLost(f"the daemon went away: {exc}") from exc
        return request_id, fut

    def request(self, op: str, *, fds: Sequence[int] = (), timeout: float | None = 60.0,
                **fields: Any) -> Response:
        """Send a request and wait for its reply. Raises RemoteError (or a subclass) on an error reply."""
        request_id, fut = self.submit(op, fds=fds, **fields)
        return self.wait(request_id, fut, timeout)

    def wait_alive(self, request_id: int, fut: Future[Frame], timeout: float | None) -> Response:
        """Wait up to `timeout` for a reply that may take long (a lookup that waits for another kernel's
        load), as long as the daemon keeps answering pings; see Note [Two kinds of waiting]."""
        deadline = None if timeout is None else time.monotonic() + timeout
        slice_ = ANSWER_TIMEOUT / 3
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return _response(fut.result(slice_ if left is None else max(0.0, min(slice_, left))))
            except FutureTimeout:
                pass
            if left is not None and left <= slice_:
                return self.wait(request_id, fut, 0)  # the caller's own timeout: cancels and raises
            try:
                self.request(Op.PING, timeout=ANSWER_TIMEOUT - slice_)
            except WaitTimeout:
                with self._lock:
                    self._pending.pop(request_id, None)
                self.close()
                raise DaemonHung(f"the daemon at {self.home} (pid {self.daemon_pid}) did not answer within "
                                 f"{ANSWER_TIMEOUT:.0f} s; this load runs plainly, and the next one asks again"
                                 ) from None

    def wait(self, request_id: int, fut: Future[Frame], timeout: float | None) -> Response:
        try:
            frame = fut.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(request_id, None)
            self._fire_and_forget(Op.CANCEL, request=request_id)
            raise WaitTimeout(f"no answer from the daemon within {timeout} s") from None
        return _response(frame)

    # -- pushes -------------------------------------------------------------------------------

    def on_push(self, op: str, handler: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `handler(payload)` (on a helper thread) for each push `op`; returns the undo."""
        self._push_handlers.setdefault(op, []).append(handler)
        return lambda: self._push_handlers.get(op, []).remove(handler)

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._pushes.put(None)
        self._fail_pending(DaemonUnavailable("client closed"))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- threads ------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        failure: Exception = DaemonLost("the daemon closed the connection")
        try:
            while True:
                try:
                    frame = recv_frame(self._sock)
                except DescriptorsLost as exc:  # this process's table was full: that request fails alone
                    self._descriptors_lost(exc)
                    continue
                if frame is None:
                    break
                if frame.kind == FrameKind.PUSH:
                    close_fds(frame.fds)
                    self._pushes.put(frame.payload)
                    continue
                request_id = frame.payload.get("id")
                with self._lock:
                    fut = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
                if fut is not None:
                    fut.set_result(frame)
                elif request_id is None and not frame.payload.get("ok", True):
                    error = frame.payload.get("error", {})
                    failure = PeerRefused(error.get("message", "the daemon refused this connection"))
                    if error.get("code") == "refused":
                        break
                else:
                    self._late_reply(frame)
        except (OSError, ProtocolError) as exc:
            failure = DaemonLost(f"lost the daemon: {exc}")
        with self._lock:
            self._failure = failure if not self._closed else self._failure
        self._fail_pending(failure)
        self._pushes.put(None)

    def _descriptors_lost(self, exc: DescriptorsLost) -> None:
        """A reply whose descriptors this process had no room for: give back what it granted (the pins
        of a hit) and answer its request with an error instead."""
        self._late_reply(Frame(FrameKind.REPLY, exc.payload))
        request_id = exc.payload.get("id")
        with self._lock:
            fut = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        if fut is not None:
            message = f"{exc}; close models or files this process holds, or raise its limit (`ulimit -n`)"
            fut.set_result(Frame(FrameKind.REPLY, {"id": request_id, "ok": False,
                                                   "error": {"code": "descriptors_exhausted", "message": message}}))

    def _late_reply(self, frame: Frame) -> None:
        """A reply nobody waits for any more (its wait timed out): give back what it granted."""
        close_fds(frame.fds)
        payload = frame.payload
        if payload.get("status") == "hit":
            for entry in payload.get("entries", []):
                self._fire_and_forget(Op.UNPIN, key=entry["key"])
        elif payload.get("status") == "load":
            self._fire_and_forget(Op.ABANDON, key=payload.get("key", ""))

    def _fire_and_forget(self, op: str, **fields: Any) -> None:
        try:
            self.submit(op, **fields)
        except DaemonUnavailable:
            pass

    def _fail_pending(self, exc: Exception) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def _push_loop(self) -> None:
        while True:
            payload = self._pushes.get()
            if payload is None:
                return
            for handler in list(self._push_handlers.get(str(payload.get("op")), [])):
                try:
                    handler(payload)
                except Exception:  # a handler's bug must not stop the others
                    import logging

                    logging.getLogger("overmind").exception("push handler %r failed", handler)


def _response(frame: Frame) -> Response:
    payload = frame.payload
    if payload.get("ok"):
        return Response(payload, frame.fds)
    close_fds(frame.fds)
    error = payload.get("error") or {}
    code = str(error.get("code", "error"))
    raise error_for(code, str(error.get("message", "the daemon refused the request")))


_shared: Client | None = None
_shared_lock = threading.Lock()


def shared_client(*, spawn: bool = True, role: str = "kernel", label: str = "") -> Client:
    """This process's long-lived connection (its lease), opened on first use and again after the
    daemon went away. `role` and `label` name it in `overmind-daemon status` (default label: the
    Jupyter kernel id, when this process is a kernel)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.closed or _shared.pid != os.getpid():
            try:
                _shared = Client(spawn=spawn, role=role, label=label or _kernel_label())
            except DaemonLost:  # reached a daemon that was exiting: its successor answers the next try
                time.sleep(0.05)
                _shared = Client(spawn=spawn, role=role, label=label or _kernel_label())
        return _shared


def _kernel_label() -> str:
    """The kernel id of an ipykernel process, from its connection file's name; else the command."""
    import sys

    for i, arg in enumerate(sys.argv):
        if arg == "-f" and i + 1 < len(sys.argv):
            name = os.path.basename(sys.argv[i + 1])
            return name.removeprefix("kernel-").removesuffix(".json")
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def existing_shared_client() -> Client | None:
    """This process's connection if it is open; never connects or starts a daemon."""
    client = _shared
    if client is None or client.closed or client.pid != os.getpid():
        return None
    return client


def reset_shared_client() -> None:
    """Close this process's connection (everything it held is released by the daemon)."""
    global _shared
    with _shared_lock:
        if _shared is not None and _shared.pid == os.getpid():
            _shared.close()
        _shared = None


def _after_fork_in_child() -> None:
    global _shared, _shared_lock
    _shared = None  # the parent's connection is not ours; never write to it
    _shared_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
