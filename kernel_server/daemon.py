"""The per-user daemon: accepts kernels on a Unix socket and serves the store.

One thread accepts; each connection gets a reader thread that decodes frames and calls the handler its
"op" names in `Daemon.handlers` (the whole list of what a client may ask). A handler returns a reply
payload, or None when it will answer later (a lookup that waits for another kernel's load). The daemon
never imports torch and never unpickles anything: it keeps descriptors and JSON.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import logging
import os
import select
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import arena, descriptors, settings
from ._version import __version__
from .compaction import Compactor
from .errors import DaemonError, DescriptorsLost, ProtocolError, RemoteError
from .ledger import Ledger
from .lifecycle import DaemonLock, socket_path
from .protocol import MAX_FDS, PROTOCOL_VERSION, FrameKind
from .store import LookupResult, Store
from .transport import close_fds, peer_credentials, recv_frame, send_frame

__all__ = ["Daemon", "run"]

log = logging.getLogger("kernel_server")

_MAX_META = 16 * 1024  # bytes of JSON an entry's description may take
_MAX_FALLBACKS = 100


@dataclass
class Reply:
    payload: dict[str, Any]
    fds: list[int] = field(default_factory=list)  # closed by the daemon once sent


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
        self.connected = time.time()
        self.greeted = False
        self.alive = True
        self._send_lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        return {"conn": self.id, "pid": self.pid, "role": self.role, "label": self.label,
                "connected": self.connected}

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

    def reply(self, request_id: int, reply: Reply) -> bool:
        return self.send(FrameKind.REPLY, {"id": request_id, "ok": True, **reply.payload}, reply.fds)

    def error(self, request_id: int | None, code: str, message: str) -> bool:
        self.daemon.count_error(code)
        return self.send(FrameKind.REPLY, {"id": request_id, "ok": False,
                                           "error": {"code": code, "message": message}})

    def push(self, op: str, payload: dict[str, Any]) -> bool:
        return self.send(FrameKind.PUSH, {"op": op, **payload})


class Daemon:
    def __init__(self, home: Path, budget: int | None = None) -> None:
        self.home = home
        self.store = Store(settings.get(settings.BUDGET) if budget is None else budget)
        self.started = time.time()
        self._conns: dict[int, Connection] = {}
        self._conn_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self.ledger = Ledger.from_env(self.kernel_of)
        self.compactor = Compactor(self.store, lambda: arena.arena_directory(self.home),
                                   enabled=settings.get(settings.COMPACT))
        # Every operation a client may ask for. Anything else gets an "unknown_op" error reply.
        self.handlers: dict[str, Callable[[Connection, dict[str, Any], list[int]], Reply | None]] = {
            "hello": self.op_hello,
            "ping": self.op_ping,
            "status": self.op_status,
            "ls": self.op_ls,
            "lookup": self.op_lookup,
            "cancel": self.op_cancel,
            "reserve": self.op_reserve,
            "publish": self.op_publish,
            "abandon": self.op_abandon,
            "unpin": self.op_unpin,
            "evict": self.op_evict,
            "fallback": self.op_fallback,
            "shutdown": self.op_shutdown,
            "units_register": self.ledger.op_register,
            "units_acquire": self.ledger.op_acquire,
            "units_release": self.ledger.op_release,
            "units_touch": self.ledger.op_touch,
            "units_cancel": self.ledger.op_cancel,
            "units_state": self.ledger.op_state,
        }
        self._fallbacks: collections.deque[dict[str, Any]] = collections.deque(maxlen=_MAX_FALLBACKS)
        self.errors = collections.Counter[str]()  # error replies by code, for status ("internal" is a bug)
        self._short_log = descriptors.Throttle()  # out of descriptors: one line every few seconds at most

    # -- serving ------------------------------------------------------------------------------

    def serve(self, listener: socket.socket) -> None:
        self._listener = listener
        d = self.store.descriptors
        log.info("daemon %s (protocol %d) serving at %s, budget %d bytes, descriptor limit %d (entries may "
                 "hold %d)", __version__, PROTOCOL_VERSION, listener.getsockname(), self.store.budget, d.limit, d.cap)
        while not self._stopping.is_set():
            try:
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
            threading.Thread(target=self._serve_connection, args=(sock,), daemon=True,
                             name="overmind-conn").start()
        self._close_all()

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
            with conn._send_lock:
                conn.alive = False
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
                    raise RemoteError(
                        "protocol_mismatch",
                        f"daemon at {self.home} speaks protocol {PROTOCOL_VERSION}, this client "
                        f"{frame.version}: run `overmind-daemon stop` and let the client start a new one",
                    )
                if frame.kind != FrameKind.REQUEST:
                    raise RemoteError("bad_frame", f"clients send requests, not {frame.kind.name.lower()}s")
                if not isinstance(request_id, int) or isinstance(request_id, bool):
                    raise RemoteError("bad_frame", "a request needs an integer 'id'")
                op = frame.payload.get("op")
                handler = self.handlers.get(op) if isinstance(op, str) else None
                if handler is None:
                    raise RemoteError("unknown_op", f"unknown operation {op!r}; this daemon knows "
                                                    f"{sorted(self.handlers)}")
                if not conn.greeted and op != "hello":
                    raise RemoteError("no_hello", "the first request must be 'hello'")
                fds, frame.fds = frame.fds, []  # the handler owns them now
                reply = handler(conn, frame.payload, fds)
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

    def kernel_of(self, conn_id: int) -> dict[str, Any]:
        conn = self._conns.get(conn_id)
        return conn.describe() if conn else {"conn": conn_id, "pid": None, "role": "gone", "label": ""}

    # -- handlers -----------------------------------------------------------------------------

    def op_hello(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        version = req.get("protocol")
        if version != PROTOCOL_VERSION:
            raise RemoteError(
                "protocol_mismatch",
                f"daemon at {self.home} speaks protocol {PROTOCOL_VERSION}, this client {version}: "
                "run `overmind-daemon stop` and let the client start a new one",
            )
        conn.role = str(req.get("role", "kernel"))[:32]
        conn.label = str(req.get("label", ""))[:200]
        conn.greeted = True
        return Reply({"protocol": PROTOCOL_VERSION, "version": __version__, "pid": os.getpid(),
                      "home": str(self.home), "budget": self.store.budget, "conn": conn.id})

    def op_ping(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        return Reply({"pong": time.time()})

    def op_status(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        snap = self.store.snapshot(self.kernel_of)
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

    def op_ls(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        return Reply({"entries": self.store.snapshot(self.kernel_of)["entries"]})

    def op_lookup(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply | None:
        close_fds(fds)
        key = _key(req)
        request_id = req["id"]

        def notify(result: LookupResult) -> None:
            if result.error is not None:  # a waiter's hit that could not be sent
                conn.error(request_id, result.error.code, str(result.error))
            else:
                conn.reply(request_id, _lookup_reply(key, result))

        result = self.store.lookup(conn.id, conn.pid, key, wait=bool(req.get("wait", True)),
                                   request_id=request_id, notify=notify)
        return None if result is None else _lookup_reply(key, result)

    def op_cancel(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        target = req.get("request")
        if not isinstance(target, int):
            raise RemoteError("bad_request", "cancel needs the integer 'request' to cancel")
        if self.store.cancel_wait(conn.id, target):
            conn.reply(target, Reply({"status": "cancelled"}))
            return Reply({"cancelled": True})
        return Reply({"cancelled": False})

    def op_reserve(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        """`bytes` of the budget for the load of `key`, and the `descriptors` its publish will bring
        (graph, arena and one per source: 2 unless said; Note [Descriptor budget] in descriptors.py)."""
        close_fds(fds)
        nbytes, nfds = req.get("bytes"), req.get("descriptors", 2)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise RemoteError("bad_request", "reserve needs a non-negative integer 'bytes'")
        if not isinstance(nfds, int) or isinstance(nfds, bool) or not 2 <= nfds <= MAX_FDS:
            raise RemoteError("bad_request", f"reserve's 'descriptors' is an integer from 2 to {MAX_FDS}: the "
                                             "graph, the arena and one per source file")
        evicted = self.store.reserve(conn.id, _key(req), nbytes, nfds)
        return Reply({"evicted": evicted})

    def op_publish(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        """Descriptors: the graph, the arena, then one per source file of `sources` (Note [Pending
        pieces] in store.py). `pieces`: [arena offset, bytes, source index, file offset] each."""
        try:
            key = _key(req)
            raw_sources, pieces = req.get("sources", []), req.get("pieces", [])
            if not isinstance(raw_sources, list) or len(fds) != 2 + len(raw_sources):
                raise RemoteError("bad_request", "publish carries 2 descriptors (graph, arena) and one per source, "
                                                 f"not {len(fds)} for {len(raw_sources)} sources")
            graph_bytes, arena_bytes = req.get("graph_bytes"), req.get("arena_bytes")
            if not (isinstance(graph_bytes, int) and isinstance(arena_bytes, int)) or min(graph_bytes, arena_bytes) < 0:
                raise RemoteError("bad_request", "publish needs integer 'graph_bytes' and 'arena_bytes'")
            meta, deps = req.get("meta", {}), req.get("deps", [])
            if not isinstance(meta, dict) or len(str(meta)) > _MAX_META:
                raise RemoteError("bad_request", f"'meta' must be an object of at most {_MAX_META} bytes")
            if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
                raise RemoteError("bad_request", "'deps' must be a list of keys")
            try:
                arena.check_sealed(fds[0], graph_bytes)
                backing = arena.check_sealed(fds[1], arena_bytes)
                sources = [_source(fd, raw) for fd, raw in zip(fds[2:], raw_sources)]
                _check_pieces(pieces, arena_bytes, sources)
            except (ValueError, TypeError, OSError) as exc:
                raise RemoteError("bad_arena", f"refused arena: {exc}") from None
        except BaseException:
            close_fds(fds)
            raise
        answers = self.store.publish(conn.id, key, graph_fd=fds[0], arena_fd=fds[1], graph_bytes=graph_bytes,
                                     arena_bytes=arena_bytes, backing=backing, meta=meta, deps=deps,
                                     sources=sources, pieces=pieces, pin=bool(req.get("pin")),
                                     marker=bool(req.get("marker")))
        for notify, result in answers:
            notify(result)
        if pieces:
            self.compactor.submit(key)
        return Reply({"published": key, "served_waiters": len(answers)})

    def op_abandon(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        answers = self.store.abandon(conn.id, _key(req))
        for notify, result in answers:
            notify(result)
        return Reply({})

    def op_unpin(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        count = req.get("count", 1)
        if not isinstance(count, int) or count < 1:
            raise RemoteError("bad_request", "'count' must be a positive integer")
        self.store.unpin(conn.id, _key(req), count)
        return Reply({})

    def op_evict(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        if req.get("all"):
            return Reply({"evicted": self.store.evict(None)})
        key = _key(req)
        matches = [e["key"] for e in self.store.snapshot(self.kernel_of)["entries"] if e["key"].startswith(key)]
        if len(matches) > 1:
            raise RemoteError("ambiguous_key", f"{key!r} matches {len(matches)} entries; give more of the key")
        evicted = self.store.evict(matches[0]) if matches else []
        if not evicted:
            raise RemoteError("no_entry", f"no entry {key!r}; `overmind-daemon ls` lists the keys")
        return Reply({"evicted": evicted})

    def op_fallback(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        """A kernel reports a call that went the plain way, for `status` and the side panel."""
        close_fds(fds)
        fields = {name: str(req.get(name, ""))[:500] for name in ("call", "kind", "reason")}
        self._fallbacks.append({"time": time.time(), "pid": conn.pid, "label": conn.label, **fields})
        return Reply({})

    def op_shutdown(self, conn: Connection, req: dict[str, Any], fds: list[int]) -> Reply:
        close_fds(fds)
        threading.Timer(0.05, self.stop).start()
        return Reply({"stopping": os.getpid()})


def _key(req: dict[str, Any]) -> str:
    key = req.get("key")
    if not isinstance(key, str) or not 0 < len(key) <= 256:
        raise RemoteError("bad_request", "'key' must be a non-empty string of at most 256 characters")
    return key


def _source(fd: int, raw: Any) -> arena.SourceFile:
    """A source file a publish names, checked against what the descriptor is (Note [Pending pieces])."""
    if not isinstance(raw, dict) or not isinstance(raw.get("path"), str):
        raise TypeError("each source needs a 'path' and its identity")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"source {raw['path']} is not a regular file")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
        raise ValueError(f"source {raw['path']} must be passed read-only")
    identity = arena.file_identity(st)
    if {k: raw.get(k) for k in identity} != identity:
        raise ValueError(f"source {raw['path']} is not the file announced (it changed, or another was sent)")
    return arena.SourceFile(fd, identity, raw["path"][:4096])


def _check_pieces(pieces: Any, arena_bytes: int, sources: list[arena.SourceFile]) -> None:
    if not isinstance(pieces, list) or not all(isinstance(p, list) for p in pieces):
        raise TypeError("'pieces' must be a list of lists")
    end = 0
    for piece in sorted(pieces):
        if (len(piece) != 4 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in piece)
                or piece[2] >= len(sources)):
            raise ValueError(f"bad piece {piece!r}: [arena offset, bytes, source index, file offset]")
        offset, nbytes, source, file_offset = piece
        if offset < end or offset + nbytes > arena_bytes or file_offset + nbytes > sources[source].identity["size"]:
            raise ValueError(f"piece {piece!r} overlaps another or lies outside its arena or file")
        end = offset + nbytes


def _lookup_reply(key: str, result: LookupResult) -> Reply:
    if result.status != "hit":
        return Reply({"status": result.status, "key": key})
    return Reply({
        "status": "hit",
        "key": key,
        "entries": [{"key": e.key, "arena_bytes": e.arena_bytes, "graph_bytes": e.graph_bytes, "meta": e.meta,
                     "sources": [s.describe() for s in e.sources], "pieces": e.pieces} for e in result.entries],
    }, result.fds)


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
    lock = DaemonLock(home)
    if not lock.acquire():
        log.info("a daemon (pid %s) already serves %s", lock.holder_pid(), home)
        lock.close()
        ready()
        return 0
    path = socket_path(home)
    try:
        path.unlink(missing_ok=True)  # a stale socket of a dead daemon; we hold the lock
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(path))
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
            if path.exists() and lock.holder_pid() == os.getpid():
                path.unlink()
        finally:
            lock.close()
