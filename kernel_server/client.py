"""The client side of the daemon's protocol: one connection, many threads.

A `Client` owns one connection (its lease, docs/design.md invariant 5). A request's reply is read by the
thread that waits for it, or by a reader thread once one is needed (Note [Who reads the socket]); push
handlers run on a thread of their own, started with the first handler. It imports nothing heavy.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (no stubs: the C half of `signal`)
import contextlib
import itertools
import math
import os
import queue
import select
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, overload

from . import descriptors, helper_threads, lifecycle
from .errors import (
    DaemonError,
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
from .payloads import (
    CancelReply,
    Empty,
    EvictedReply,
    Grant,
    HelloReply,
    HelloRequest,
    LookupReply,
    LsReply,
    PingReply,
    PublishReply,
    ShutdownReply,
    StatusReply,
    UnitsCancelReply,
    UnitsRegisterReply,
    UnitsReleaseReply,
    UnitsSnapshot,
)
from .protocol import PROTOCOL_VERSION, Frame, FrameKind
from .transport import close_fds, recv_frame, send_frame

__all__ = ["ANSWER_TIMEOUT", "Client", "Response", "existing_shared_client", "interrupts_held", "reset_shared_client",
           "shared_client"]

# Note [Two kinds of waiting]
# Waiting for another kernel's load of the same model is long (bounded by the caller's timeout, and
# listed by status as a waiter); waiting for the daemon to answer anything is short: a daemon that does
# not answer within ANSWER_TIMEOUT seconds (stopped by SIGSTOP, stuck) is given up (DaemonHung), the
# load runs plainly, and the next call connects anew. `wait_alive` tells the two apart by pinging the
# daemon on the same connection while a reply is outstanding: a live daemon answers pings while it
# holds a lookup for another kernel's load.
# Any request that waits at most ANSWER_TIMEOUT is owed a prompt answer, so its timeout gives the daemon
# up too, whatever the request: the connection is closed before DaemonHung is raised. The daemon stopped
# while a miss loaded, say: the RESERVE or PUBLISH after the load waits 3 s, and the ABANDON that
# follows fails at once on the closed connection instead of waiting 3 s more (a load cost 6 s that way).
# Nothing is lost by not sending it: once it runs again, the daemon reads what the connection sent before
# its end, and then releases all it held, a load it granted and no publish ended included (the next
# waiter loads). A PUBLISH that was sent whole is taken: every byte of its entry was fixed when it was
# sent, and the model the kernel that gave it up kept lies on its own memory or on private mappings, as
# after any miss (Note [Atomic miss] in overmind_jupyter/publishing.py).
ANSWER_TIMEOUT = 3.0
_TURN = 0.002  # see Note [Who reads the socket]
_BRIEF = 0.05  # see Note [Requests from finalizers]

# Note [Who reads the socket]
# A hit is one round trip, and a handoff between threads can wait a scheduler slice (milliseconds on a
# loaded machine), so a reply is read by the thread that waits for it: `_result` takes `_read_lock`
# (whoever holds it is the only one reading the socket) and reads frames until its own reply came,
# dispatching every other frame it meets as the reader thread would (replies to their futures, late
# replies given back, pushes to the push thread, a refusal or the end of the stream failing every
# request). The reader thread starts only when someone must wait without reading: a push handler is
# registered (pushes come unasked), a wait turns long (`wait_alive` past its first slice: a lookup
# that waits for another kernel's load), or a wait timed out (its late reply must give back its pins
# soon). Once started it holds the lock for the connection's life, and
# every wait is on a future again. Between requests with no reader thread, `closed` reads what is
# already there (without blocking), so a daemon gone since the last call is noticed as before. Frames
# are read whole: a poll decides that one has begun arriving, and the daemon writes a frame at once.
# While another thread reads, a waiting thread waits on its future in slices of _TURN seconds, and
# reads itself once the other one is done (its reply may come after the other's).
# A thread must not wait for a reply while it reads the socket (a finalizer that requests: none does;
# unpins go through the unpin thread of overmind_jupyter's results.py); such a wait would end in its timeout.

# Note [Interrupted waits]
# A wait for another kernel's load can be cut short by anything but the daemon: a KeyboardInterrupt (the
# user interrupts the cell), a SystemExit, a bug. The kernel lives on with its connection, so the daemon
# would keep the request: still a waiter, it would be made the loader when the load failed, and never load
# while the kernels behind it waited (for 10 minutes); served a hit, it would keep a pin, and the entry
# could never be evicted. So `wait_alive` withdraws the request before the exception goes on to the cell:
# it sends "cancel" and waits for the answer (a short wait: Note [Two kinds of waiting]). Cancelled, the
# lookup's own reply ("cancelled") came first. Not cancelled, the daemon had decided already: its reply,
# sent or on its way, is read, and what it granted is given back (each entry of a hit unpinned, a "load"
# abandoned, so that the next waiter loads), then a ping makes sure the daemon did both, since it serves a
# connection's requests in order. Should any of it fail or be interrupted in turn, the reply is left to the
# reader thread, which gives it back whenever it comes (`_late_reply`). The giving back itself runs with
# SIGINT held: it takes the reply's status out first (so that it runs once), and a second Ctrl-C between
# that and the unpin it sends left the pin with the live connection, nothing left to give back. A daemon
# error needs none of this: the request was answered, cancelled by the caller's timeout, or the connection
# and all it held are gone.

# An interrupt can also come while the request is being sent, after the daemon has it: between the send and
# the wait the exception would leave the daemon a waiter that never loads (seen on a loaded machine: the
# test sent SIGINT as soon as the daemon listed the waiter). So `request_alive` holds SIGINT's
# KeyboardInterrupt (in the main thread, where Python raises it) while it sends, and raises it inside the
# wait's protection.

# Note [Replies read whole]
# The withdrawal of Note [Interrupted waits] gives back what a reply granted once the reply is the request's
# (its future's result). A Ctrl-C that landed while the reply was read, after its bytes (and descriptors,
# SCM_RIGHTS) had left the socket and before the frame reached its future, lost the reply: `recv_frame`
# closed the descriptors, the withdrawal's "cancel" was answered "not cancelled" (the daemon had answered),
# its wait for a reply that would never come ran out after ANSWER_TIMEOUT, and the hit's pin stayed with the
# live connection for as long as the kernel lived: the entry never evicted for the budget. Measured: 2 pins
# left by 800 Ctrl-Cs at random moments of a tiny model's hits (4 ms each), each KeyboardInterrupt raised
# as `_recv_exact`'s `recv` of the body returned; none by 2100 since. (Cut between a frame's header and its
# body, the stream was out of step instead: the connection ended, its lease with it.) So `_read_until`
# reads and routes each frame with SIGINT held (in the main thread), and raises a Ctrl-C that came
# meanwhile once the frame is routed: in a wait, inside the wait's protection, which finds the reply and
# gives it back. The wait for a frame stays outside the hold: it is the poll, which a Ctrl-C cuts short as
# before (a wait with no deadline too, a units wait's); a frame whose first byte has come is read at once
# (the daemon writes a frame whole), and one whose rest does not come within ANSWER_TIMEOUT ends the
# connection as a daemon that does not answer would (`recv_frame`'s `stall`): the hold never keeps a Ctrl-C
# from the user longer than that. What it costs: two `_signal.signal` calls a frame read by the main
# thread (2 us in all; a hit reads one), less than `interrupts_held` saved by calling them too (21.8 ->
# 5.6 us, once a hit).

# Note [Requests from finalizers]
# The collector can run a finalizer at any allocation, so also inside a send of this client, with
# `_send_lock` held by the same thread. A tqdm bar dies that way (the progress relay of
# overmind_jupyter's progress.py holds it in a reference cycle), and its `__del__` closes it, which
# reports progress: through `submit`, it waited forever for the lock its own thread held, and the
# kernel hung at the end of a load. Reports that such code makes use `try_submit`, which waits for a
# lock at most _BRIEF seconds (another thread holds one for the microseconds of a send, or a scheduler
# slice), then drops the report: a progress report is worth less than a collection that ends.



R = TypeVar("R", bound=Mapping[str, Any])


@dataclass
class Response(Generic[R]):
    """A reply: its payload, of the reply type the operation declares (operations.PAYLOADS; the frame's
    "id" and "ok" taken out), and the descriptors it carried, which the caller owns (`close`).

    `reply["name"]` reads a field untyped; `reply.payload["name"]` reads it as its type declares.
    """

    payload: R
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
        self._read_lock = threading.Lock()  # held by whoever reads the socket (Note [Who reads the socket])
        self._reading: int | None = None  # the thread that holds it
        self._threads_lock = threading.Lock()
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._closed = False
        self._ended = False  # the stream ended (EOF, an error, a refusal): nothing more to read
        self._refusal: Exception | None = None
        self._failure: Exception | None = None
        self._push_handlers: dict[str, list[Callable[[dict[str, Any]], None]]] = {}
        self._pushes: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._pusher: threading.Thread | None = None
        _connections.add(self)  # disowned in a forked child (Note [Connections after a fork])
        try:
            hello = self.request(Op.HELLO, **HelloRequest(protocol=PROTOCOL_VERSION, role=role, label=label,
                                                          pid=os.getpid()), timeout=ANSWER_TIMEOUT)
        except DaemonHung:  # the connection is closed
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
        self.daemon_pid = hello.payload["pid"]
        self.conn_id = hello.payload["conn"]
        self.budget = hello.payload["budget"]

    # -- requests -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        if not (self._closed or self._failure is not None or self._reader is not None):
            self._read_waiting()  # a daemon gone since the last request (Note [Who reads the socket])
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
            self._read_to_end(1.0)  # the daemon's reason for closing (a refusal) may be there
            if isinstance(self._failure, PeerRefused):
                raise self._failure from exc
            raise DaemonLost(f"the daemon went away: {exc}") from exc
        return request_id, fut

    def try_submit(self, op: str, **fields: Any) -> bool:
        """Send a request whose reply nobody waits for, if this client's locks come free within
        `_BRIEF` seconds; False, with nothing sent, if they do not or the connection is gone. For
        reports that code may make from inside a send of this very thread (Note [Requests from
        finalizers])."""
        if not self._send_lock.acquire(timeout=_BRIEF):
            return False
        try:
            if not self._lock.acquire(timeout=_BRIEF):
                return False
            try:
                if self._failure is not None or self._closed:
                    return False
                request_id = next(self._ids)
                self._pending[request_id] = Future()  # for its reply, which whoever reads next takes
            finally:
                self._lock.release()
            send_frame(self._sock, FrameKind.REQUEST, {"op": op, "id": request_id, **fields}, ())
            return True
        except OSError:
            return False  # the next request finds the connection gone, and says so
        finally:
            self._send_lock.release()

    # The reply type of each operation, as operations.PAYLOADS declares it (tests/test_payloads.py checks
    # that the two agree); an operation named by its string is untyped.
    @overload
    def request(self, op: Literal[Op.HELLO], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[HelloReply]: ...

    @overload
    def request(self, op: Literal[Op.PING], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[PingReply]: ...

    @overload
    def request(self, op: Literal[Op.STATUS], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[StatusReply]: ...

    @overload
    def request(self, op: Literal[Op.UNITS_STATE], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[UnitsSnapshot]: ...

    @overload
    def request(self, op: Literal[Op.LS], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[LsReply]: ...

    @overload
    def request(self, op: Literal[Op.LOOKUP], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[LookupReply]: ...

    @overload
    def request(self, op: Literal[Op.CANCEL], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[CancelReply]: ...

    @overload
    def request(self, op: Literal[Op.RESERVE, Op.EVICT], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[EvictedReply]: ...

    @overload
    def request(self, op: Literal[Op.PUBLISH], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[PublishReply]: ...

    @overload
    def request(self, op: Literal[Op.ABANDON, Op.UNPIN, Op.PROGRESS, Op.HITS, Op.FALLBACK, Op.UNITS_TOUCH], *,
                fds: Sequence[int] = ..., timeout: float | None = ..., **fields: Any) -> Response[Empty]: ...

    @overload
    def request(self, op: Literal[Op.SHUTDOWN], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[ShutdownReply]: ...

    @overload
    def request(self, op: Literal[Op.UNITS_REGISTER], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[UnitsRegisterReply]: ...

    @overload
    def request(self, op: Literal[Op.UNITS_ACQUIRE], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[Grant]: ...

    @overload
    def request(self, op: Literal[Op.UNITS_RELEASE], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[UnitsReleaseReply]: ...

    @overload
    def request(self, op: Literal[Op.UNITS_CANCEL], *, fds: Sequence[int] = ...,
                timeout: float | None = ..., **fields: Any) -> Response[UnitsCancelReply]: ...

    @overload
    def request(self, op: str, *, fds: Sequence[int] = ..., timeout: float | None = ...,
                **fields: Any) -> Response[Any]: ...

    def request(self, op: str, *, fds: Sequence[int] = (), timeout: float | None = 60.0,
                **fields: Any) -> Response[Any]:
        """Send a request and wait for its reply, a `Response` of the reply type the operation declares.

        Raises RemoteError (or a subclass) on an error reply. A wait cut short by anything but the daemon
        leaves the reply to be given back when it comes (Note [Interrupted waits])."""
        return self.send(op, fds=fds, timeout=timeout, **fields)()

    def send(self, op: str, *, fds: Sequence[int] = (), timeout: float | None = 60.0,
             **fields: Any) -> Callable[[], Response[Any]]:
        """Send a request now, and return the wait for its reply (as `request` waits), for work the caller
        does while the daemon answers. The caller must wait: a reply nobody waits for stays pending."""
        request_id, fut = self.submit(op, fds=fds, **fields)

        def reply() -> Response[Any]:
            try:
                return self.wait(request_id, fut, timeout)
            except DaemonError:
                raise
            except BaseException:
                self._leave_reply(request_id, fut)
                raise

        return reply

    def request_alive(self, op: str, timeout: float | None, *, meanwhile: Callable[[], Any] | None = None,
                      **fields: Any) -> Response[Any]:
        """Send a request whose reply may take long (a lookup that waits for another kernel's load) and
        `wait_alive` for it; `meanwhile` runs while the daemon answers. An interrupt that comes while the
        request is sent is held until the wait's protection is in place, so that it too withdraws the
        request (Note [Interrupted waits])."""
        with interrupts_held() as held:
            request_id, fut = self.submit(op, **fields)
        return self.wait_alive(request_id, fut, timeout, meanwhile=meanwhile, held=held)

    def wait_alive(self, request_id: int, fut: Future[Frame], timeout: float | None,
                   meanwhile: Callable[[], Any] | None = None, held: _Held | None = None) -> Response[Any]:
        """Wait up to `timeout` for a reply that may take long (a lookup that waits for another kernel's
        load), as long as the daemon keeps answering pings; see Note [Two kinds of waiting]. A wait cut
        short by anything but the daemon (a KeyboardInterrupt) withdraws the lookup first, and gives back
        what the daemon granted it (Note [Interrupted waits]). `held`: an interrupt that came while the
        request was sent, raised here; `meanwhile` runs first; both inside the same protection."""
        try:
            if held is not None:
                held.raise_it()
            if meanwhile is not None:
                meanwhile()
            return self._wait_alive(request_id, fut, timeout)
        except DaemonError:  # answered, cancelled at the timeout, or the connection went with all it held
            raise
        except BaseException:
            self._withdraw(request_id, fut)
            raise

    def _wait_alive(self, request_id: int, fut: Future[Frame], timeout: float | None) -> Response[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        slice_ = ANSWER_TIMEOUT / 3
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return _response(self._result(fut, slice_ if left is None else max(0.0, min(slice_, left))))
            except FutureTimeout:
                pass
            self._start_reader()  # a long wait: on a future (Note [Who reads the socket])
            if left is not None and left <= slice_:
                return self.wait(request_id, fut, 0, waited=timeout)  # the caller's own timeout: cancels, raises
            self.request(Op.PING, timeout=ANSWER_TIMEOUT - slice_)  # no answer: DaemonHung, the connection closed

    def wait(self, request_id: int, fut: Future[Frame], timeout: float | None, *,
             waited: float | None = None, told: tuple[float, Callable[[], Any]] | None = None) -> Response[Any]:
        """The reply, waited for up to `timeout`; past it, the request is cancelled and WaitTimeout says
        how long the caller waited (`waited`, where that is more than `timeout`). `told`: (seconds, say):
        `say()` runs once the wait has lasted that long, and the wait goes on."""
        try:
            left = timeout
            if told is not None and (timeout is None or timeout > told[0]):
                try:
                    return _response(self._result(fut, told[0]))
                except FutureTimeout:
                    told[1]()
                    left = None if timeout is None else timeout - told[0]
            frame = self._result(fut, left)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(request_id, None)
            if timeout is not None and 0 < timeout <= ANSWER_TIMEOUT:  # owed at once (Note [Two kinds of waiting])
                self.close()
                raise DaemonHung(f"the daemon at {self.home} did not answer within {ANSWER_TIMEOUT:.0f} s "
                                 f"(stopped, or stuck: see {lifecycle.log_path(self.home)}); this load runs "
                                 "plainly, and the next one asks again") from None
            self._fire_and_forget(Op.CANCEL, request=request_id)
            if not self._closed:
                self._start_reader()  # its late reply gives back what it granted, soon
            waited = timeout if waited is None else waited
            raise WaitTimeout(f"no answer from the daemon within {waited:g} s") from None
        return _response(frame)

    def _withdraw(self, request_id: int, fut: Future[Frame]) -> None:
        """Cancel the lookup `request_id` and give back what its reply granted, before returning; see Note
        [Interrupted waits]."""
        given_back = False
        try:
            if self._failure is None and not self._closed:
                cancelled = self.request(Op.CANCEL, request=request_id, timeout=ANSWER_TIMEOUT)["cancelled"]
                frame = self._result(fut, 0 if cancelled else ANSWER_TIMEOUT)  # cancelled: answered already
                with self._lock:
                    self._pending.pop(request_id, None)
                self._late_reply(frame)
                given_back = True
                self.request(Op.PING, timeout=ANSWER_TIMEOUT)  # the daemon has done what came before it
        except (DaemonError, FutureTimeout):
            pass
        finally:
            if not given_back:
                self._leave_reply(request_id, fut)

    def _leave_reply(self, request_id: int, fut: Future[Frame]) -> None:
        """Let the reply of `request_id` be given back whenever it comes, by the reader thread."""
        with self._lock:
            waiting = self._pending.pop(request_id, None) is not None
        if not waiting:  # it came (or is being handed over): give back what it granted
            fut.add_done_callback(lambda done: None if done.exception() else self._late_reply(done.result()))
        elif not self._closed:
            self._start_reader()  # the late reply, when it comes, is given back

    def _result(self, fut: Future[Frame], timeout: float | None) -> Frame:
        """The reply frame of `fut`, read by this thread if no other one reads (Note [Who reads the
        socket]); raises FutureTimeout after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if fut.done():
                return fut.result()
            if self._reader is None and self._read_lock.acquire(blocking=False):
                try:
                    self._reading = threading.get_ident()
                    self._read_until(fut.done, deadline)
                finally:
                    self._reading = None
                    self._read_lock.release()
                if fut.done():
                    return fut.result()
                raise FutureTimeout()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._reader is not None or self._reading == threading.get_ident():
                return fut.result(left)
            # Another thread reads: it routes our reply to `fut`, and stops at its own; then we read.
            if left == 0.0:
                raise FutureTimeout()
            try:
                return fut.result(_TURN if left is None else min(_TURN, left))
            except FutureTimeout:
                pass

    # -- pushes -------------------------------------------------------------------------------

    def on_push(self, op: str, handler: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `handler(payload)` (on a helper thread) for each push `op`; returns the undo."""
        self._push_handlers.setdefault(op, []).append(handler)
        with self._threads_lock:
            if self._pusher is None:  # None where no thread starts: pushes are dropped then
                self._pusher = helper_threads.start(self._push_loop, name="overmind-push")
        self._start_reader()  # pushes come unasked: someone must read them
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

    def _start_reader(self) -> None:
        if self._reader is not None:
            return
        with self._threads_lock:
            if self._reader is None:  # None where no thread starts: each caller reads for itself, as before
                self._reader = helper_threads.start(self._read_loop, name="overmind-client")

    def _read_loop(self) -> None:
        with self._read_lock:
            self._reading = threading.get_ident()
            while not self._ended and self._read_one():
                pass

    def _read_until(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Read and dispatch frames until `done()`, the stream's end, or `deadline` (time.monotonic)
        with no frame arriving; the caller holds `_read_lock`. The wait for a frame is the poll, which a
        Ctrl-C cuts short; the frame itself is read and routed with SIGINT held (Note [Replies read whole])."""
        while not done() and not self._ended:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready = self._poller.poll(None if left is None else math.ceil(left * 1000))
            except OSError:
                ready = [(-1, 0)]  # the read below fails and ends the stream
            if not ready:
                return
            held = _hold_interrupts()  # the frame read and routed whole (Note [Replies read whole])
            try:
                alive = self._read_one()
            finally:
                held.put_back()
            held.raise_it()
            if not alive:
                return

    def _read_waiting(self) -> None:
        """Read the frames already there, if no one else reads (Note [Who reads the socket])."""
        if self._read_lock.acquire(blocking=False):
            try:
                self._reading = threading.get_ident()
                self._read_until(lambda: False, time.monotonic())
            finally:
                self._reading = None
                self._read_lock.release()

    def _read_to_end(self, timeout: float) -> None:
        """After a failed send: read up to the stream's end, for `timeout` seconds at most."""
        deadline = time.monotonic() + timeout
        if self._reading == threading.get_ident():
            return  # (this thread reads: a late reply's give-back that failed to send, the reader's own)
        reader = self._reader
        if reader is not None:
            reader.join(timeout)
            return
        if self._read_lock.acquire(timeout=timeout):
            try:
                self._reading = threading.get_ident()
                self._read_until(lambda: self._ended, deadline)
            finally:
                self._reading = None
                self._read_lock.release()

    def _read_one(self) -> bool:
        """Read one frame and route it; False once the stream ended. The caller holds `_read_lock`."""
        try:
            try:
                frame = recv_frame(self._sock, stall=ANSWER_TIMEOUT)  # read with SIGINT held: never for long
            except DescriptorsLost as exc:  # this process's table was full: that request fails alone
                self._descriptors_lost(exc)
                return True
            if frame is None:
                return self._end(self._refusal or DaemonLost("the daemon closed the connection"))
            if frame.kind == FrameKind.PUSH:
                close_fds(frame.fds)
                if self._pusher is not None:
                    self._pushes.put(frame.payload)
                return True
            request_id = frame.payload.get("id")
            with self._lock:
                fut = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
            if fut is not None:
                fut.set_result(frame)
            elif request_id is None and not frame.payload.get("ok", True):
                error = frame.payload.get("error", {})
                self._refusal = PeerRefused(error.get("message", "the daemon refused this connection"))
                if error.get("code") == "refused":
                    return self._end(self._refusal)
            else:
                self._late_reply(frame)
            return True
        except (OSError, ProtocolError) as exc:
            return self._end(DaemonLost(f"lost the daemon: {exc}"))

    def _end(self, failure: Exception) -> bool:
        with self._lock:
            self._ended = True
            self._failure = failure if not self._closed else self._failure
        self._fail_pending(failure)
        self._pushes.put(None)
        return False

    def _descriptors_lost(self, exc: DescriptorsLost) -> None:
        """A reply whose descriptors this process had no room for: give back what it granted (the pins
        of a hit) and answer its request with an error instead."""
        self._late_reply(Frame(FrameKind.REPLY, exc.payload))
        request_id = exc.payload.get("id")
        with self._lock:
            fut = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        if fut is not None:
            message = f"{exc}; {descriptors.short_here()}"
            fut.set_result(Frame(FrameKind.REPLY, {"id": request_id, "ok": False,
                                                   "error": {"code": "descriptors_exhausted", "message": message}}))

    def _late_reply(self, frame: Frame) -> None:
        """A reply nobody waits for any more (its wait timed out or was interrupted): give back what it
        granted, once (its descriptors and status are taken out of it), whole: a Ctrl-C that comes meanwhile
        is raised after (Note [Interrupted waits])."""
        with interrupts_held() as held:
            fds, frame.fds = frame.fds, []
            close_fds(fds)
            payload = frame.payload
            status = payload.pop("status", None)
            if status == "hit":
                for entry in payload.get("entries", []):
                    self._fire_and_forget(Op.UNPIN, key=entry["key"])
            elif status == "load":
                self._fire_and_forget(Op.ABANDON, key=payload.get("key", ""))
        held.raise_it()

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


def _response(frame: Frame) -> Response[Any]:
    """The reply `frame` carries, without the frame's "id" and "ok"; or the error it carries, raised."""
    payload = frame.payload
    if payload.get("ok"):
        return Response({k: v for k, v in payload.items() if k not in ("id", "ok")}, frame.fds)
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
            if _shared is not None and _shared.pid == os.getpid():
                # Ended, not closed (a read cut inside a frame by a Ctrl-C leaves the stream out of step,
                # and the next read fails): closed now, so that the daemon ends its lease too (its pins
                # and units, docs/design.md invariant 5) and its socket is not left open here.
                _shared.close()
            try:
                _shared = Client(spawn=spawn, role=role, label=label or _kernel_label())
            except DaemonLost:  # reached a daemon that was exiting: its successor answers the next try
                time.sleep(0.05)
                _shared = Client(spawn=spawn, role=role, label=label or _kernel_label())
        return _shared


def _kernel_label() -> str:
    """How views name this process: the notebook's (or console's) path, which a Jupyter server gives the
    kernels of its sessions in JPY_SESSION_NAME; else "kernel ID" for a kernel outside one (from its
    connection file's name); else the script's name."""
    import sys

    session = os.environ.get("JPY_SESSION_NAME")
    if session:
        return session
    for i, arg in enumerate(sys.argv):
        if arg == "-f" and i + 1 < len(sys.argv):
            name = os.path.basename(sys.argv[i + 1])
            return "kernel " + name.removeprefix("kernel-").removesuffix(".json")
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


# Note [Connections after a fork]
# A kernel that holds cached models forks: a DataLoader's workers, multiprocessing's fork context, the
# user's own os.fork. The child inherits the parent's connections, socket and all, and its finalizers
# still run: dropping an inherited model (or exiting through Python's exit) unpins its entry, and an
# unpin sent on the inherited socket is the parent's, to the daemon, which took the pin of a model the
# parent still held, so the budget could evict it; a reply meant for the child would reach the parent.
# So in the child every inherited connection is closed for this process at the fork: nothing is sent or
# read on it (its socket is not shut down, which would end the parent's connection too), what would
# have been sent is dropped as on a closed connection, and the child's own loads open a connection of
# their own (`shared_client`).
_connections: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _shared, _shared_lock
    _shared = None
    _shared_lock = threading.Lock()
    for client in list(_connections):  # the parent's: never written to or read here (Note [Connections after a fork])
        client._closed = True


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Held:
    """A SIGINT held by `_hold_interrupts`, raised later by `raise_it` with the handler it would have met."""

    __slots__ = ("frames", "handler")

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.handler: Any = None  # None: nothing was held

    def record(self, signum: int, frame: Any) -> None:
        self.frames.append(frame)

    def put_back(self) -> None:
        """End the hold: the handler it replaced is SIGINT's again."""
        if self.handler is not None:
            _signal.signal(signal.SIGINT, self.handler)

    def raise_it(self) -> None:
        if self.frames and callable(self.handler):
            frame, self.frames = self.frames[0], []
            self.handler(signal.SIGINT, frame)


def _hold_interrupts() -> _Held:
    """Hold SIGINT until `put_back` (Note [Interrupted waits]): in the main thread, where Python raises it,
    with a handler of Python's own in place (a kernel's); elsewhere, or with another handler, nothing.
    (`_signal`'s functions, not `signal`'s wrappers of them, whose enum conversions cost 10 us a hold:
    a hit holds SIGINT twice.)"""
    held = _Held()
    if threading.get_ident() != threading.main_thread().ident:
        return held
    previous = _signal.getsignal(signal.SIGINT)
    if callable(previous):
        held.handler = previous
        _signal.signal(signal.SIGINT, held.record)  # last: from here on, a SIGINT is recorded
    return held


@contextlib.contextmanager
def interrupts_held() -> Iterator[_Held]:
    """Hold SIGINT for the block (`_hold_interrupts`)."""
    held = _hold_interrupts()
    try:
        yield held
    finally:
        held.put_back()
