"""The store's operations (kernel_server/store.py holds the state machine), in the shape of every
handler: `(peer, request) -> Reply | None` (operations.py)."""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable
from typing import Any

from . import arena
from .compaction import Compactor
from .errors import RemoteError
from .operations import Handler, Op, Peer, Reply, Request
from .protocol import MAX_FDS
from .store import LookupResult, Store

__all__ = ["MAX_META", "StoreService"]

MAX_META = 16 * 1024  # bytes of JSON an entry's description may take


class StoreService:
    def __init__(self, store: Store, compactor: Compactor, kernel_of: Callable[[int], dict[str, Any]]) -> None:
        self.store = store
        self.compactor = compactor
        self.kernel_of = kernel_of

    def handlers(self) -> dict[Op, Handler]:
        return {Op.LS: self.ls, Op.LOOKUP: self.lookup, Op.CANCEL: self.cancel, Op.RESERVE: self.reserve,
                Op.PUBLISH: self.publish, Op.ABANDON: self.abandon, Op.UNPIN: self.unpin, Op.EVICT: self.evict,
                Op.PROGRESS: self.progress, Op.HITS: self.hits}

    def ls(self, conn: Peer, req: Request) -> Reply:
        return Reply({"entries": self.store.snapshot(self.kernel_of)["entries"]})

    def lookup(self, conn: Peer, req: Request) -> Reply | None:
        key = _key(req)
        request_id = req.id

        def notify(result: LookupResult) -> None:
            if result.error is not None:  # a waiter's hit that could not be sent
                conn.error(request_id, result.error.code, str(result.error))
            else:
                conn.reply(request_id, _lookup_reply(key, result))

        result = self.store.lookup(conn.id, conn.pid, key, wait=bool(req.get("wait", True)),
                                   request_id=request_id, notify=notify)
        return None if result is None else _lookup_reply(key, result)

    def cancel(self, conn: Peer, req: Request) -> Reply:
        target = req.get("request")
        if not isinstance(target, int):
            raise RemoteError("bad_request", "cancel needs the integer 'request' to cancel")
        if self.store.cancel_wait(conn.id, target):
            conn.reply(target, Reply({"status": "cancelled"}))
            return Reply({"cancelled": True})
        return Reply({"cancelled": False})

    def reserve(self, conn: Peer, req: Request) -> Reply:
        """`bytes` of the budget for the load of `key`, and the `descriptors` its publish will bring
        (graph, arena and one per source: 2 unless said; Note [Descriptor budget] in descriptors.py)."""
        nbytes, nfds = req.get("bytes"), req.get("descriptors", 2)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise RemoteError("bad_request", "reserve needs a non-negative integer 'bytes'")
        if not isinstance(nfds, int) or isinstance(nfds, bool) or not 2 <= nfds <= MAX_FDS:
            raise RemoteError("bad_request", f"reserve's 'descriptors' is an integer from 2 to {MAX_FDS}: the "
                                             "graph, the arena and one per source file")
        evicted = self.store.reserve(conn.id, _key(req), nbytes, nfds)
        return Reply({"evicted": evicted})

    def publish(self, conn: Peer, req: Request) -> Reply:
        """Descriptors: the graph, the arena, then one per source file of `sources` (Note [Pending
        pieces] in store.py). `pieces`: [arena offset, bytes, source index, file offset] each. The
        descriptors are checked where they are (the dispatcher closes them on a refusal) and taken
        when the store gets them."""
        fds = req.descriptors
        key = _key(req)
        raw_sources, pieces = req.get("sources", []), req.get("pieces", [])
        if not isinstance(raw_sources, list) or len(fds) != 2 + len(raw_sources):
            raise RemoteError("bad_request", "publish carries 2 descriptors (graph, arena) and one per source, "
                                             f"not {len(fds)} for {len(raw_sources)} sources")
        graph_bytes, arena_bytes = req.get("graph_bytes"), req.get("arena_bytes")
        if not (isinstance(graph_bytes, int) and isinstance(arena_bytes, int)) or min(graph_bytes, arena_bytes) < 0:
            raise RemoteError("bad_request", "publish needs integer 'graph_bytes' and 'arena_bytes'")
        meta, deps = req.get("meta", {}), req.get("deps", [])
        if not isinstance(meta, dict) or len(str(meta)) > MAX_META:
            raise RemoteError("bad_request", f"'meta' must be an object of at most {MAX_META} bytes")
        if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
            raise RemoteError("bad_request", "'deps' must be a list of keys")
        watch = _watch(req.get("watch", []))
        try:
            arena.check_sealed(fds[0], graph_bytes)
            backing = arena.check_sealed(fds[1], arena_bytes)
            sources = [_source(fd, raw) for fd, raw in zip(fds[2:], raw_sources, strict=True)]
            _check_pieces(pieces, arena_bytes, sources)
        except (ValueError, TypeError, OSError) as exc:
            raise RemoteError("bad_arena", f"refused arena: {exc}") from None
        req.take_descriptors()  # the store's now, also when it refuses
        answers = self.store.publish(conn.id, key, graph_fd=fds[0], arena_fd=fds[1], graph_bytes=graph_bytes,
                                     arena_bytes=arena_bytes, backing=backing, meta=meta, deps=deps,
                                     sources=sources, pieces=pieces, pin=bool(req.get("pin")),
                                     marker=bool(req.get("marker")), watch=watch)
        for notify, result in answers:
            notify(result)
        if pieces:
            self.compactor.submit(key)
        return Reply({"published": key, "served_waiters": len(answers)})

    def abandon(self, conn: Peer, req: Request) -> Reply:
        answers = self.store.abandon(conn.id, _key(req))
        for notify, result in answers:
            notify(result)
        return Reply({})

    def unpin(self, conn: Peer, req: Request) -> Reply:
        count = req.get("count", 1)
        if not isinstance(count, int) or count < 1:
            raise RemoteError("bad_request", "'count' must be a positive integer")
        self.store.unpin(conn.id, _key(req), count)
        return Reply({})

    def progress(self, conn: Peer, req: Request) -> Reply:
        """How far this connection's load of `key` got (Note [Progress] in store.py)."""
        done, total, label, unit = req.get("done"), req.get("total"), req.get("label", ""), req.get("unit", "")
        if not (_number(done) and _number(total) and isinstance(label, str) and isinstance(unit, str)):
            raise RemoteError("bad_request", "progress needs numbers 'done' and 'total', strings 'label' and 'unit'")
        self.store.report_progress(conn.id, _key(req), label[:200], done, total, unit[:16])
        return Reply({})

    def hits(self, conn: Peer, req: Request) -> Reply:
        """This connection's hit times (Note [Load time saved] in store.py): [key, when, hit_s] each."""
        raw = req.get("hits")
        if not isinstance(raw, list) or len(raw) > 1000 or not all(
                isinstance(h, list) and len(h) == 3 and isinstance(h[0], str) and _number(h[1]) and _number(h[2])
                for h in raw):
            raise RemoteError("bad_request", "'hits' must be a list of at most 1000 [key, time, seconds]")
        self.store.report_hits(conn.pid, [(h[0], float(h[1]), float(h[2])) for h in raw])
        return Reply({})

    def evict(self, conn: Peer, req: Request) -> Reply:
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


def _key(req: Request) -> str:
    key = req.get("key")
    if not isinstance(key, str) or not 0 < len(key) <= 256:
        raise RemoteError("bad_request", "'key' must be a non-empty string of at most 256 characters")
    return key


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 and x == x and x != float("inf")


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


MAX_WATCHED = 64  # checkpoint paths a publish may name (Note [Orphaned entries] in store.py)


def _watch(raw: Any) -> list[dict[str, Any]]:
    def valid(w: Any) -> bool:
        return (isinstance(w, dict) and isinstance(w.get("path"), str) and 0 < len(w["path"]) <= 4096
                and all(isinstance(w.get(k), int) and not isinstance(w.get(k), bool)
                        for k in ("dev", "ino", "ctime_ns")))

    if not isinstance(raw, list) or len(raw) > MAX_WATCHED or not all(valid(w) for w in raw):
        raise RemoteError("bad_request", f"'watch' must be a list of at most {MAX_WATCHED} "
                                         "{path, dev, ino, ctime_ns} objects")
    return [{"path": w["path"], "dev": w["dev"], "ino": w["ino"], "ctime_ns": w["ctime_ns"]} for w in raw]
