"""The per-user daemon: accepts kernels on a Unix socket and serves the store and the units ledger.

One thread accepts; each connection gets a reader thread that decodes frames and dispatches each request
to the handler of its operation (operations.Op: the whole list of what a client may ask). The store's
handlers are in store_service.py, the ledger's in units_service.py, the daemon's own here; all have the
shape `(peer, request) -> Reply | None` (None: the answer comes later), and the dispatcher closes the
descriptors a handler did not take. The daemon never imports torch and never unpickles anything: it
keeps descriptors and JSON.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from . import arena, descriptors, helper_threads, settings
from ._version import __version__
from .catalogue import STATUS_ENTRIES
from .compaction import Compactor
from .disk import DiskRoom
from .errors import DaemonError, DescriptorsLost, ProtocolError, RemoteError, StateDirError
from .ledger import Ledger
from .lifecycle import DaemonLock, socket_path, state_dir_refused
from .operations import TAKES_DESCRIPTORS, Handler, Op, Peer, Reply, Request, parse
from .payloads import (
    Connection as ConnectionInfo,
)
from .payloads import (
    Empty,
    FallbackRequest,
    FallbackStatus,
    HelloReply,
    HelloRequest,
    PingReply,
    ShutdownReply,
    StatusReply,
    StatusRequest,
)
from .protocol import PROTOCOL_VERSION, FrameKind
from .store import Store
from .store_service import StoreService
from .transport import close_fds, peer_credentials, recv_frame, send_frame
from .units_service import UnitsService

__all__ = ["Daemon", "run"]

log = logging.getLogger("kernel_server")

_MAX_FALLBACKS = 100
ORPHAN_SWEEP_S = 5.0  # how often the checkpoints entries were loaded from are looked at


class Connection:
    """One client. Everything it takes from the daemon is released when it goes away."""

    def __init__(self, daemon: Daemon, sock: socket.socket, conn_id: int, pid: int, uid: int) -> None:
        self.daemon = daemon
        self.sock = sock
        self.id = conn_id
        self.pid = pid
        self.uid = uid
        self.role = "?"
        self.label = ""
        self.command = _command_of(pid)
        self.connected = time.time()
        self.greeted = False
        self.alive = True
        self._send_lock = threading.Lock()

    def describe(self) -> ConnectionInfo:
        return {"conn": self.id, "pid": self.pid, "role": self.role, "label": self.label,
                "command": self.command, "connected": self.connected}

    def send(self, kind: FrameKind, payload: dict[str, Any], fds: list[int] | None = None) -> bool:
        """Send a frame; False if the peer is gone. Closes `fds` in every case."""
        try:
            with self._send_lock:
                if not self.alive:
                    return False
                send_frame(self.sock, kind, payload, fds or [])
                return True
        except OSError:
            return False
        finally:
            close_fds(fds or [])

    def stop_sending(self) -> None:
        """Send nothing more on this connection: a send under way ends first, and every later one (a
        lookup answered after the client went, a push) returns False, its descriptors closed."""
        with self._send_lock:
            self.alive = False

    def reply(self, request_id: int, reply: Reply[Any]) -> bool:
        return self.send(FrameKind.REPLY, {"id": request_id, "ok": True, **reply.payload}, reply.fds)

    def error(self, request_id: int | None, code: str, message: str) -> bool:
        self.daemon.count_error(code)
        return self.send(FrameKind.REPLY, {"id": request_id, "ok": False,
                                           "error": {"code": code, "message": message}})

    def push(self, op: str, payload: dict[str, Any]) -> bool:
        return self.send(FrameKind.PUSH, {"op": op, **payload})


class Daemon:
    """The daemon of one state directory: serves the kernels that connect to the socket `serve` listens on,
    each on a thread of its own that checks its requests and dispatches them to `handlers` (the store's, the
    units ledger's and its own), and releases what a connection held when it ends (docs/design.md invariant
    5). `run` makes one and serves until a signal or a "shutdown" request stops it.

    Args:
        home: the state directory (OVERMIND_HOME), named in replies and errors; file arenas live there when
            it is on a disk and `arena_dir` is not set (arena.arena_directory).
        budget: the bytes the store may hold; the `budget` setting when None.
    """

    def __init__(self, home: Path, budget: int | None = None) -> None:
        self.home = home
        directory = arena.arena_directory(home)
        on_disk = arena.choose_backing(settings.get(settings.ARENA), directory) == "file"
        self.store = Store(settings.get(settings.BUDGET) if budget is None else budget,
                           DiskRoom(directory, settings.get(settings.DISK_RESERVE)) if on_disk else None)
        self.started = time.time()
        self._conns: dict[int, Connection] = {}
        self._conn_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self.ledger = Ledger.from_env(self.kernel_of)
        self.compactor = Compactor(self.store, lambda: arena.arena_directory(self.home),
                                   enabled=settings.get(settings.COMPACT))
        self.store.compacting = self.compactor.enabled
        # The handler of every operation (operations.Op); a test checks none is missing.
        self.handlers: dict[Op, Handler] = {
            Op.HELLO: self.hello, Op.PING: self.ping, Op.STATUS: self.status, Op.FALLBACK: self.fallback,
            Op.SHUTDOWN: self.shutdown,
            **StoreService(self.store, self.compactor, self.kernel_of).handlers(),
            **UnitsService(self.ledger).handlers(),
        }
        self._fallbacks: collections.deque[FallbackStatus] = collections.deque(maxlen=_MAX_FALLBACKS)
        self.errors = collections.Counter[str]()  # error replies by code, for status ("internal" is a bug)
        self._short_log = descriptors.Throttle()  # out of descriptors: one line every few seconds at most
        self._no_thread_log = descriptors.Throttle()

    # -- serving ------------------------------------------------------------------------------

    def serve(self, listener: socket.socket) -> None:
        self._listener = listener
        threading.Thread(target=self._drop_orphans, name="overmind-orphans", daemon=True).start()
        d = self.store.descriptors
        log.info("daemon %s (protocol %d) serving at %s, budget %d bytes, descriptor limit %d (entries may "
                 "hold %d)", __version__, PROTOCOL_VERSION, listener.getsockname(), self.store.budget, d.limit, d.cap)
        waiting = select.poll()  # a blocked accept holds a descriptor: wait for a connection without one
        waiting.register(listener, select.POLLIN)
        while not self._stopping.is_set():
            try:
                if not waiting.poll(1000):
                    continue
                sock, _ = listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    break
                if descriptors.exhausted(exc):
                    self._accept_later(listener, exc)
                    continue
                log.exception("accept failed")
                time.sleep(0.1)
                continue
            if helper_threads.start(self._serve_connection, sock, name="overmind-conn") is None:
                self._turn_away(sock)
        self._close_all()

    def _turn_away(self, sock: socket.socket) -> None:
        """No thread to be had for the connection `sock` (the user's process limit, reached for now): tell its
        client why, and close it. Its load runs plainly and the next one asks again; the daemon and its
        entries stay."""
        self._no_thread_log.log(logging.WARNING, "no thread to be had for a new connection (the process limit, "
                                "ulimit -u?): turned away")
        message = (f"the daemon at {self.home} can start no thread for this kernel now (the user's process limit, "
                   "ulimit -u, is reached: the threads of every kernel count); this load runs plainly, and the "
                   "next one asks again")
        with contextlib.suppress(OSError):  # (a timeout too)
            send_frame(sock, FrameKind.REPLY, {"id": None, "ok": False, "error": {"code": "no_thread",
                                                                                 "message": message}}, [])
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.5)
            while sock.recv(1 << 16):  # its hello, read until the client closes: a close with unread bytes
                pass  # would reset the connection, and the client could lose the reason before reading it
        sock.close()

    def _accept_later(self, listener: socket.socket, exc: OSError) -> None:
        """The descriptor table is full. Linux takes a new connection's descriptor before it waits for
        one, so accept fails at once whether or not anyone connects: wait until a connection does (poll
        takes no descriptor), then make room for it by evicting unpinned entries; it waits in the
        listen backlog meanwhile and is accepted on the next try (Note [Descriptor budget])."""
        poller = select.poll()
        try:
            poller.register(listener, select.POLLIN)
            if not poller.poll(1000):
                return
        except (OSError, ValueError):  # the listener was closed meanwhile: the daemon is stopping
            return
        evicted = self.store.shed(descriptors.SHED)
        self.store.count("accept_deferred")
        self._short_log.log(logging.WARNING, "out of file descriptors (%s, limit %d): a new connection waits; "
                            "evicted %d unpinned entries to make room", exc.strerror, self.store.descriptors.limit,
                            len(evicted))
        if not evicted:
            time.sleep(0.05)  # everything pinned: try again shortly, without spinning

    def _drop_orphans(self) -> None:
        """Every few seconds, drop the entries whose checkpoints are gone (Note [Orphaned entries]), and give
        back unpinned entries in file arenas while the disk under them is short of its reserve, then hand the
        compactor the entries it skipped for want of disk room that fit now (Note [Disk room])."""
        while not self._stopping.wait(ORPHAN_SWEEP_S):
            dropped = self.store.drop_orphaned()
            if dropped:
                log.info("dropped %d entries whose checkpoint files are gone", len(dropped))
            evicted = self.store.make_disk_room()  # Note [Disk room] in disk.py
            if evicted:
                log.warning("the disk under the arenas fell below its reserve: evicted %d unpinned entries in files",
                            len(evicted))
            for key in self.store.compactions_due():  # the copies that found no room before (same Note)
                self.compactor.submit(key)

    def count_error(self, code: str) -> None:
        with self._lock:
            self.errors[code] += 1

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()

    def _serve_connection(self, sock: socket.socket) -> None:
        pid, uid, _ = peer_credentials(sock)
        conn = Connection(self, sock, next(self._conn_ids), pid, uid)
        if uid != os.getuid():
            log.warning("refused pid %d of uid %d", pid, uid)
            conn.error(None, "refused", f"this daemon serves uid {os.getuid()} only; start your own with "
                                         "OVERMIND_HOME pointing at a directory you own")
            sock.close()
            return
        with self._lock:
            self._conns[conn.id] = conn
            self.store.descriptors.connections = len(self._conns)
        try:
            self._read_loop(conn)
        finally:
            with self._lock:
                self._conns.pop(conn.id, None)
                self.store.descriptors.connections = len(self._conns)
            conn.stop_sending()
            self._release(conn)
            try:
                sock.close()
            except OSError:
                pass

    def _read_loop(self, conn: Connection) -> None:
        while not self._stopping.is_set():
            try:
                frame = recv_frame(conn.sock)
            except DescriptorsLost as exc:
                self._answer_lost_descriptors(conn, exc)
                continue
            except ProtocolError as exc:
                conn.error(None, "bad_frame", str(exc))
                if exc.fatal:
                    return
                continue
            except OSError:
                return
            if frame is None:
                return
            request_id = frame.payload.get("id")
            try:
                if frame.version != PROTOCOL_VERSION:
                    raise self._protocol_mismatch(frame.version)
                if frame.kind != FrameKind.REQUEST:
                    raise RemoteError("bad_frame", f"clients send requests, not {frame.kind.name.lower()}s")
                if not isinstance(request_id, int) or isinstance(request_id, bool):
                    raise RemoteError("bad_frame", "a request needs an integer 'id'")
                op = _op(frame.payload.get("op"))
                if not conn.greeted and op is not Op.HELLO:
                    raise RemoteError("no_hello", "the first request must be 'hello'")
                request = parse(op, request_id, frame.payload)  # "bad_request" unless it fits its type
                if request.op in TAKES_DESCRIPTORS:
                    request.descriptors, frame.fds = frame.fds, []
                try:
                    reply = self.handlers[request.op](conn, request)
                finally:
                    close_fds(request.descriptors)  # what the handler did not take
                if reply is not None:
                    conn.reply(request_id, reply)
            except RemoteError as exc:
                conn.error(request_id if isinstance(request_id, int) else None, exc.code, str(exc))
            except (DaemonError, ValueError, TypeError, KeyError) as exc:
                conn.error(request_id if isinstance(request_id, int) else None, "bad_request",
                           f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # a bug of ours: report it, keep serving
                log.exception("handler failed")
                conn.error(request_id if isinstance(request_id, int) else None, "internal",
                           f"{type(exc).__name__}: {exc} (see the daemon log)")
            finally:
                close_fds(frame.fds)

    def _answer_lost_descriptors(self, conn: Connection, exc: DescriptorsLost) -> None:
        """A request whose descriptors the kernel could not hand us (our table was full): answer it
        as a shortage; the connection and what it holds stay (Note [Descriptor budget])."""
        request_id = exc.payload.get("id")
        self.store.count("descriptors_short")
        evicted = self.store.shed(descriptors.SHED)  # room for the next try
        self._short_log.log(logging.WARNING, "out of file descriptors (limit %d): %s; answered descriptors_exhausted "
                            "and evicted %d unpinned entries", self.store.descriptors.limit, exc, len(evicted))
        conn.error(request_id if isinstance(request_id, int) and not isinstance(request_id, bool) else None,
                   "descriptors_exhausted",
                   f"the daemon ran out of file descriptors (its limit is {self.store.descriptors.limit}) "
                   f"when this request's descriptors arrived, and they were lost; this load runs plainly. "
                   f"If it happens again, {descriptors.ADVICE}")

    def _release(self, conn: Connection) -> None:
        for notify, result in self.store.release_connection(conn.id):
            notify(result)
        self.ledger.release_connection(conn.id)

    def _close_all(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.compactor.stop()
        self.store.close()

    def _protocol_mismatch(self, version: int) -> RemoteError:
        """The error a client that speaks protocol `version` gets (at hello, or in a frame's header), with
        the fix; the client raises it as ProtocolMismatch."""
        return RemoteError("protocol_mismatch", f"daemon at {self.home} speaks protocol {PROTOCOL_VERSION}, this "
                                                f"client {version}: run `overmind-daemon stop` and let the client "
                                                "start a new one")

    def kernel_of(self, conn_id: int) -> ConnectionInfo:
        conn = self._conns.get(conn_id)
        return conn.describe() if conn else {"conn": conn_id, "pid": None, "role": "gone", "label": ""}

    # -- handlers -----------------------------------------------------------------------------

    def hello(self, conn: Peer, req: Request[HelloRequest]) -> Reply[HelloReply]:
        if req.payload["protocol"] != PROTOCOL_VERSION:
            raise self._protocol_mismatch(req.payload["protocol"])
        assert isinstance(conn, Connection)  # the daemon's own handler: it names the connection
        conn.role = req.payload.get("role", "kernel")[:32]
        conn.label = req.payload.get("label", "")[:1024]  # a notebook's path
        conn.greeted = True
        return Reply({"protocol": PROTOCOL_VERSION, "version": __version__, "pid": os.getpid(),
                      "home": str(self.home), "budget": self.store.budget, "conn": conn.id})

    def ping(self, conn: Peer, req: Request[Empty]) -> Reply[PingReply]:
        return Reply({"pong": time.time()})

    def status(self, conn: Peer, req: Request[StatusRequest]) -> Reply[StatusReply]:
        with self._lock:
            pids = {c.pid for c in self._conns.values()}  # whose untimed hits may still come
        snap = self.store.snapshot(self.kernel_of, req.payload.get("limit", STATUS_ENTRIES), pids)
        snap["descriptors"]["open"] = descriptors.open_descriptors()
        with self._lock:
            kernels = [c.describe() for c in self._conns.values() if c.greeted]
            errors = dict(self.errors)
        return Reply({
            "daemon": {"pid": os.getpid(), "version": __version__, "protocol": PROTOCOL_VERSION,
                       "home": str(self.home), "started": self.started},
            "kernels": kernels,
            "fallbacks": list(self._fallbacks),
            "units": self.ledger.snapshot(),
            "errors": errors,
            **snap,
        })

    def fallback(self, conn: Peer, req: Request[FallbackRequest]) -> Reply[Empty]:
        """A kernel reports a call that went the plain way, for `status` and the side panel."""
        p = req.payload
        self._fallbacks.append({"time": time.time(), "pid": conn.pid, "label": self.kernel_of(conn.id)["label"],
                                "call": p.get("call", "")[:500], "kind": p.get("kind", "")[:500],
                                "reason": p.get("reason", "")[:500]})
        return Reply({})

    def shutdown(self, conn: Peer, req: Request[Empty]) -> Reply[ShutdownReply]:
        threading.Timer(0.05, self.stop).start()
        return Reply({"stopping": os.getpid()})


def _command_of(pid: int) -> str:
    """A process's command line, short: its program and arguments by base name ("python -m
    ipykernel_launcher -f kernel-1f2e.json"), at most 160 characters; "" when it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).split(b"\0")
    except OSError:
        return ""
    words = [os.path.basename(a.decode(errors="replace")) if a.startswith(b"/") else a.decode(errors="replace")
             for a in argv if a]
    text = " ".join(words)
    return text if len(text) <= 160 else text[:159] + "\u2026"


def _op(name: Any) -> Op:
    try:
        return Op(name)
    except ValueError:
        raise RemoteError("unknown_op", f"unknown operation {name!r}; this daemon knows "
                                        f"{sorted(op.value for op in Op)}") from None


def run(home: Path, budget: int | None = None, ready_fd: int | None = None) -> int:
    """Run a daemon in this process until stopped. Returns 0, also when another daemon already runs.
    Writes to `ready_fd` (and closes it) once it serves or found another daemon serving."""

    def ready() -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            os.write(ready_fd, b"ok")
            os.close(ready_fd)
            ready_fd = None

    descriptors.raise_limit()  # Note [Descriptor budget]
    lock = DaemonLock(home)  # StateDirError, as below, where the directory takes no file: said, not a traceback
    try:
        acquired = lock.acquire()
    except StateDirError:
        lock.close()
        raise
    if not acquired:
        log.info("a daemon (pid %s) already serves %s", lock.holder_pid(), home)
        lock.close()
        ready()
        return 0
    path = socket_path(home)
    bound = False  # the socket file at `path` is this daemon's
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            path.unlink(missing_ok=True)  # a stale socket of a dead daemon; we hold the lock
            listener.bind(str(path))
            bound = True
        except OSError as exc:  # a full filesystem (no inode for it), or a directory by its name
            listener.close()
            raise state_dir_refused(home, f"create the daemon's socket {path.name}", exc) from exc
        finally:
            os.umask(old_umask)
        listener.listen(64)
        daemon = Daemon(home, budget)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: threading.Thread(target=daemon.stop, daemon=True).start())
        ready()
        daemon.serve(listener)
        log.info("daemon stopped")
        return 0
    finally:
        try:
            if bound and path.exists() and lock.holder_pid() == os.getpid():
                path.unlink()
        finally:
            lock.close()
