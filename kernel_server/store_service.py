"""The store's operations (kernel_server/store.py holds the state machine), in the shape of every
handler: `(peer, request) -> Reply | None` (operations.py)."""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable
from typing import Any

from . import arena
from .catalogue import EVICTED_DESCRIBED, LS_PAGE
from .compaction import Compactor
from .errors import RemoteError
from .operations import Handler, Op, Peer, Reply, Request
from .payloads import (
    CancelReply,
    Connection,
    EvictedEntry,
    EvictedReply,
    EvictRequest,
    HitsRequest,
    KeyRequest,
    LookupReply,
    LookupRequest,
    LsReply,
    LsRequest,
    ProgressRequest,
    PublishReply,
    PublishRequest,
    ReserveRequest,
    Source,
    UnpinRequest,
    Watched,
)
from .payloads import CancelRequest as CancelLookup
from .payloads import Empty as Nothing
from .store import LookupResult, Store

__all__ = ["StoreService"]


class StoreService:
    def __init__(self, store: Store, compactor: Compactor, kernel_of: Callable[[int], Connection]) -> None:
        self.store = store
        self.compactor = compactor
        self.kernel_of = kernel_of

    def handlers(self) -> dict[Op, Handler]:
        return {Op.LS: self.ls, Op.LOOKUP: self.lookup, Op.CANCEL: self.cancel, Op.RESERVE: self.reserve,
                Op.PUBLISH: self.publish, Op.ABANDON: self.abandon, Op.UNPIN: self.unpin, Op.EVICT: self.evict,
                Op.PROGRESS: self.progress, Op.HITS: self.hits}

    def ls(self, conn: Peer, req: Request[LsRequest]) -> Reply[LsReply]:
        """A page of the entries, by key (Note [Status with many entries] in catalogue.py)."""
        p = req.payload
        page = self.store.listing(self.kernel_of, p.get("after", ""), p.get("limit", LS_PAGE))
        return Reply(LsReply(entries=page["entries"], total=page["total"], next=page["next"]))

    def lookup(self, conn: Peer, req: Request[LookupRequest]) -> Reply[LookupReply] | None:
        key = req.payload["key"]
        request_id = req.id

        def notify(result: LookupResult) -> None:
            if result.error is not None:  # a waiter's hit that could not be sent
                conn.error(request_id, result.error.code, str(result.error))
            else:
                conn.reply(request_id, _lookup_reply(key, result))

        result = self.store.lookup(conn.id, conn.pid, key, wait=req.payload.get("wait", True),
                                   request_id=request_id, notify=notify)
        return None if result is None else _lookup_reply(key, result)

    def cancel(self, conn: Peer, req: Request[CancelLookup]) -> Reply[CancelReply]:
        target = req.payload["request"]
        if self.store.cancel_wait(conn.id, target):
            conn.reply(target, Reply[LookupReply]({"status": "cancelled"}))
            return Reply({"cancelled": True})
        return Reply({"cancelled": False})

    def reserve(self, conn: Peer, req: Request[ReserveRequest]) -> Reply[EvictedReply]:
        """`bytes` of the budget for the load of `key`, of the disk too unless its arena is a memfd (`backing`:
        Note [Disk room] in disk.py), and the `descriptors` its publish will bring (graph, arena and one per
        source: 2 unless said; Note [Descriptor budget] in descriptors.py); `evict` false: only if that fits
        without evicting an entry (Note [Reserving ahead] in store.py)."""
        p = req.payload
        evicted = self.store.reserve(conn.id, p["key"], p["bytes"], p.get("descriptors", 2), p.get("backing", "file"),
                                     evict=p.get("evict", True))
        return Reply({"evicted": evicted})

    def publish(self, conn: Peer, req: Request[PublishRequest]) -> Reply[PublishReply]:
        """Descriptors: the graph, the arena, one per range of `parts` (Note [Arena parts] in arena.py),
        then one per source file of `sources` (Note [Pending pieces] in store.py). `parts`: [arena
        offset, bytes] each; `pieces`: [arena offset, bytes, source index, file offset] each. The
        descriptors are checked where they are (the dispatcher closes them on a refusal) and taken
        when the store gets them."""
        fds, p = req.descriptors, req.payload
        key, graph_bytes, arena_bytes = p["key"], p["graph_bytes"], p["arena_bytes"]
        raw_parts, raw_sources, pieces = p.get("parts", []), p.get("sources", []), p.get("pieces", [])
        if len(fds) != 2 + len(raw_parts) + len(raw_sources):
            raise RemoteError("bad_request", "publish carries 2 descriptors (graph, arena), one per part and one "
                                             f"per source, not {len(fds)} for {len(raw_parts)} parts and "
                                             f"{len(raw_sources)} sources")
        watch = [_watched(w) for w in p.get("watch", [])]
        try:
            arena.check_sealed(fds[0], graph_bytes)
            backing = arena.check_sealed(fds[1], arena_bytes)
            parts = [arena.Part(fd, offset, nbytes) for fd, (offset, nbytes) in zip(fds[2:], raw_parts, strict=False)]
            for part in parts:
                arena.check_sealed(part.fd, part.nbytes)
            arena.check_parts(parts, arena_bytes)
            sources = [_source(fd, raw) for fd, raw in zip(fds[2 + len(parts):], raw_sources, strict=True)]
            _check_pieces(pieces, arena_bytes, sources, parts)
        except (ValueError, TypeError, OSError) as exc:
            raise RemoteError("bad_arena", f"refused arena: {exc}") from None
        req.take_descriptors()  # the store's now, also when it refuses
        answers = self.store.publish(conn.id, key, graph_fd=fds[0], arena_fd=fds[1], graph_bytes=graph_bytes,
                                     arena_bytes=arena_bytes, backing=backing, meta=p.get("meta", {}),
                                     times=p.get("times"), deps=p.get("deps", []), sources=sources, pieces=pieces,
                                     parts=parts,
                                     pin=p.get("pin", False), marker=p.get("marker", False), watch=watch)
        for notify, result in answers:
            notify(result)
        if pieces:
            self.compactor.submit(key)
        return Reply({"published": key, "served_waiters": len(answers)})

    def abandon(self, conn: Peer, req: Request[KeyRequest]) -> Reply[Nothing]:
        answers = self.store.abandon(conn.id, req.payload["key"])
        for notify, result in answers:
            notify(result)
        return Reply({})

    def unpin(self, conn: Peer, req: Request[UnpinRequest]) -> Reply[Nothing]:
        self.store.unpin(conn.id, req.payload["key"], req.payload.get("count", 1))
        return Reply({})

    def progress(self, conn: Peer, req: Request[ProgressRequest]) -> Reply[Nothing]:
        """How far this connection's load of `key` got (Note [Progress] in store.py)."""
        p = req.payload
        self.store.report_progress(conn.id, p["key"], p.get("label", "")[:200], p["done"], p["total"],
                                   p.get("unit", "")[:16])
        return Reply({})

    def hits(self, conn: Peer, req: Request[HitsRequest]) -> Reply[Nothing]:
        """This connection's hit times (Note [Load time saved] in store.py)."""
        self.store.report_hits(conn.pid, [(h["key"], float(h["t"]), float(h["hit_s"])) for h in req.payload["hits"]])
        return Reply({})

    def evict(self, conn: Peer, req: Request[EvictRequest]) -> Reply[EvictedReply]:
        if req.payload.get("all"):
            return _evicted(self.store.evict(None))
        key = req.payload.get("key")
        if key is None:
            raise RemoteError("bad_request", "evict needs the 'key' of an entry (or a prefix of it), or 'all': true")
        matches = self.store.keys_with_prefix(key, 2)
        if len(matches) > 1:
            raise RemoteError("ambiguous_key", f"{key!r} matches more than one entry; give more of the key "
                                               "(`overmind-daemon ls` lists the keys)")
        evicted = self.store.evict(matches[0]) if matches else []
        if not evicted:
            raise RemoteError("no_entry", f"no entry {key!r}; `overmind-daemon ls` lists the keys")
        return _evicted(evicted)


def _source(fd: int, raw: Source) -> arena.SourceFile:
    """A source file a publish names, checked against what the descriptor is (Note [Pending pieces])."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"source {raw['path']} is not a regular file")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
        raise ValueError(f"source {raw['path']} must be passed read-only")
    identity = arena.file_identity(st)
    if {k: raw.get(k) for k in identity} != identity:
        raise ValueError(f"source {raw['path']} is not the file announced (it changed, or another was sent)")
    return arena.SourceFile(fd, identity, raw["path"][:4096])


def _check_pieces(pieces: list[list[int]], arena_bytes: int, sources: list[arena.SourceFile],
                  parts: list[arena.Part]) -> None:
    end = 0
    for piece in sorted(pieces):
        if piece[2] >= len(sources):
            raise ValueError(f"bad piece {piece!r}: its source index names no source")
        offset, nbytes, source, file_offset = piece
        if offset < end or offset + nbytes > arena_bytes or file_offset + nbytes > sources[source].identity["size"]:
            raise ValueError(f"piece {piece!r} overlaps another or lies outside its arena or file")
        if parts and any(offset < p.offset + p.nbytes and p.offset < offset + nbytes for p in parts):
            raise ValueError(f"piece {piece!r} overlaps a part of the arena")
        end = offset + nbytes


def _evicted(evicted: list[dict[str, Any]]) -> Reply[EvictedReply]:
    """An evict's reply: every key, the first EVICTED_DESCRIBED entries named as status names them, and the
    bytes of all (so that `%overmind evict` says what went)."""
    described = [EvictedEntry(key=e["key"], label=e["label"], bytes=e["bytes"]) for e in evicted[:EVICTED_DESCRIBED]]
    return Reply(EvictedReply(evicted=[e["key"] for e in evicted], entries=described,
                              bytes=sum(e["bytes"] for e in evicted)))


def _lookup_reply(key: str, result: LookupResult) -> Reply[LookupReply]:
    if result.status != "hit":
        return Reply({"status": result.status, "key": key})
    return Reply({
        "status": "hit",
        "key": key,
        "entries": [{"key": e.key, "arena_bytes": e.arena_bytes, "graph_bytes": e.graph_bytes, "meta": e.meta,
                     "parts": [p.describe() for p in e.parts], "sources": [s.describe() for s in e.sources],
                     "pieces": e.pieces} for e in result.entries],
    }, result.fds)


def _watched(w: Watched) -> dict[str, Any]:
    """A checkpoint path a publish names (Note [Orphaned entries] in store.py), without other fields."""
    return {"path": w["path"], "dev": w["dev"], "ino": w["ino"], "ctime_ns": w["ctime_ns"]}
