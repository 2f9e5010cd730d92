"""The daemon's store: cache entries by key, their byte budget, pins, and in-flight loads.

The store never looks inside an entry: it holds descriptors (the pickled object graph, the arena of
tensor bytes, see kernel_server/arena.py, and the checkpoint files its pending pieces still refer to)
and hands duplicates of them out.

# Note [Pending pieces]
An entry is servable from the moment it is published. Some of its bytes may still lie in the checkpoint
files it was loaded from instead of its arena (Note [Atomic miss] in overmind_jupyter/publishing.py):
each such piece says where in the arena it belongs and where in which source file it is now. The
daemon holds each source file open and checks its identity (device, inode, size, mtime_ns, ctime_ns)
before every hit: a file changed in any way makes the entry stale, and it is dropped (the lookup is a
miss). The compactor (kernel_server/compaction.py) copies the pieces into a new arena of the daemon's
own, reading only the files, and swaps it in; hits after that map the arena alone.

# Note [Budget accounting]
`used` (bytes of published entries) plus `reserved` (bytes promised to loads in flight) never exceeds
`budget`. A loader reserves before it allocates its arena; the reservation becomes the entry when it
publishes, and dies with the load. Room is made by evicting least-recently-used entries that no
connection pins; evicting an entry also evicts the entries built on top of it (its dependents), and an
entry whose dependent is pinned counts as pinned. Descriptors are accounted the same way, against a cap
the descriptor limit sets (Note [Descriptor budget] in descriptors.py).

# Note [Orphaned entries]
An entry's key names the checkpoint files it was loaded from, by their identity: once they are deleted
or replaced, no lookup can reach the entry again (a checkpoint written anew has another key). So a
publish names the checkpoint paths it read ("watch": path, device, inode, ctime), and the daemon drops
the entries whose paths are gone or changed, every few seconds (`drop_orphaned`), instead of keeping
them until the budget evicts them. The ctime counts because a file system may give a checkpoint
written anew the inode of the one deleted before it, and any change the ctime shows (a directory's
listing, a file's bytes) changes the key too. Kernels that use such a model keep their mappings.

# Note [Single flight]
The first connection that misses a key becomes its loader; later lookups of that key wait and are
answered with the entry when the loader publishes. If the loader abandons the load or disconnects, the
oldest waiter becomes the loader instead. Pins, reservations, loads and waits all belong to the
connection that took them (docs/design.md invariant 5) and `release_connection` drops them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import arena, descriptors
from .disk import DiskRoom
from .errors import BudgetExceeded, DescriptorsExhausted, RemoteError
from .formats import byte_text

__all__ = ["CompactionJob", "Entry", "LookupResult", "Store"]

ConnId = int
Notify = Callable[["LookupResult"], None]


class Usage(NamedTuple):
    """Bytes of the budget and file descriptors (Note [Descriptor budget] in descriptors.py)."""

    nbytes: int
    nfds: int


@dataclass
class Entry:
    key: str
    graph_fd: int
    arena_fd: int
    graph_bytes: int
    arena_bytes: int
    backing: str
    meta: dict[str, Any]
    deps: list[str]
    loader_pid: int
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    hits: int = 0
    pins: Counter[ConnId] = field(default_factory=Counter)
    sources: list[arena.SourceFile] = field(default_factory=list)
    pieces: list[list[int]] = field(default_factory=list)  # [arena offset, bytes, source index, file offset]
    compaction: dict[str, float] | None = None  # {"total", "done", "started"} while the compactor copies
    marker: bool = False  # no bytes: it tells the kernel where to look instead (its meta says why)
    watch: list[dict[str, Any]] = field(default_factory=list)  # checkpoints read: Note [Orphaned entries]
    load_s: float | None = None  # the plain load's wall time, measured at the miss (Note [Load time saved])

    @property
    def nbytes(self) -> int:
        return self.graph_bytes + self.arena_bytes

    @property
    def pending_bytes(self) -> int:
        return sum(p[1] for p in self.pieces)

    @property
    def nfds(self) -> int:
        """How many descriptors this entry holds: graph, arena, source files (Note [Descriptor budget])."""
        return 2 + len(self.sources)

    def intact(self) -> bool:
        return all(s.intact() for s in self.sources)

    def pending(self) -> dict[str, Any] | None:
        """What is left to copy into the arena (Note [Pending pieces]), for status: bytes, done, eta."""
        if not self.pieces:
            return None
        total = self.pending_bytes
        c = self.compaction
        done = int(c["done"]) if c else 0
        elapsed = time.time() - c["started"] if c else 0.0
        eta = (total - done) * elapsed / done if done and elapsed > 0 else None
        return {"bytes": total, "done": done, "copying": c is not None, "eta": eta,
                "sources": [s.path for s in self.sources]}

    def progress(self) -> dict[str, Any] | None:
        """The compactor's work on this entry, as every long operation reports it (Note [Progress])."""
        pending = self.pending()
        if pending is None or not pending["copying"]:
            return None
        return {"label": f"copying {self.meta.get('label') or self.key[:12]} into shared memory",
                "done": pending["done"], "total": pending["bytes"], "unit": "B", "eta_s": pending["eta"]}

    def describe(self, kernels: Callable[[ConnId], dict[str, Any]]) -> dict[str, Any]:
        return {
            "key": self.key,
            "meta": self.meta,
            "bytes": self.nbytes,
            "arena_bytes": self.arena_bytes,
            "backing": self.backing,
            "hits": self.hits,
            "created": self.created,
            "last_used": self.last_used,
            "deps": self.deps,
            "pending": self.pending(),
            "progress": self.progress(),
            "load_s": self.load_s,
            "pinned_by": [kernels(c) | {"pins": n} for c, n in sorted(self.pins.items())],
        }


@dataclass
class _Waiter:
    conn: ConnId
    pid: int
    request_id: int
    notify: Notify


@dataclass
class _Load:
    key: str
    owner: ConnId
    owner_pid: int
    started: float = field(default_factory=time.time)
    reserved: int = 0
    nfds: int = 0  # descriptors reserved for the entry (Note [Descriptor budget])
    waiters: deque[_Waiter] = field(default_factory=deque)
    loaded: float | None = None  # when the loader first reserved: its plain load had ended
    progress: dict[str, Any] | None = None  # what the loader last reported (Note [Progress])

    def describe_progress(self) -> dict[str, Any] | None:
        p = self.progress
        if p is None:
            return None
        elapsed, done, total = time.time() - p["since"], p["done"], p["total"]
        eta = (total - done) * elapsed / done if done and total and elapsed > 0 and done < total else None
        return {"label": p["label"], "done": done, "total": total, "unit": p["unit"], "eta_s": eta}


@dataclass
class LookupResult:
    """What a lookup decided. `status` is "hit" (entries listed, the first is the key's own, each
    pinned once for the connection, descriptors duplicated for sending), "load" (the caller is now
    the loader), "busy" (another connection loads it and the caller did not want to wait),
    "cancelled", or "error" (a waiter's hit that could not be answered: `error` says why)."""

    status: str
    entries: list[Entry] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    error: RemoteError | None = None


@dataclass
class CompactionJob:
    """What the compactor needs of one entry, with descriptors of its own (closed by `close`)."""

    key: str
    entry: Entry
    arena_fd: int
    arena_bytes: int
    backing: str
    pieces: list[list[int]]
    sources: list[arena.SourceFile]

    def close(self) -> None:
        for fd in [self.arena_fd, *(s.fd for s in self.sources)]:
            os.close(fd)


# Note [Load time saved]
# What a hit saved is the plain load it replaced. The daemon measures the plain load at the miss: from the
# lookup that made the connection the loader to its first reserve (which a loader sends once the load
# returned, to make room for the result), unless the publish's meta carries the loader's own `load_s`.
# Each hit goes into `hits_log` (bounded) with that figure; the hit's own time comes later from the
# kernel, never on the hit's path: a `hits` report (fire and forget) fills `hit_s` in.
HITS_LOG = 200

# Note [Progress]
# Every long operation reports progress in one shape, `{label, done, total, unit, eta_s}`: a load in
# flight (its loader sends `progress` reports, fire and forget), and the compactor's copy of an entry
# (Note [Pending pieces]). The status reply carries it on the load (`loading[i].progress`) and on the
# entry (`entries[i].progress`); views write it with kernel_server/formats.py's `progress_text`.


class Store:
    def __init__(self, budget: int, disk: DiskRoom | None = None) -> None:
        self.budget = budget
        self.disk = disk  # the disk under file arenas, when they are on one (Note [Disk room] in disk.py)
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._loads: dict[str, _Load] = {}
        self.stats = Counter[str]()
        self.hits_log: deque[dict[str, Any]] = deque(maxlen=HITS_LOG)  # Note [Load time saved]
        # The daemon keeps its count of connections current (Note [Descriptor budget]).
        self.descriptors = descriptors.DescriptorBudget.of_process()

    # -- reads ---------------------------------------------------------------------------------

    @property
    def held(self) -> Usage:
        """What the entries hold."""
        return Usage(sum(e.nbytes for e in self._entries.values()), sum(e.nfds for e in self._entries.values()))

    @property
    def in_flight(self) -> Usage:
        """What the loads in flight reserved."""
        return Usage(sum(load.reserved for load in self._loads.values()),
                     sum(load.nfds for load in self._loads.values()))

    def snapshot(self, kernels: Callable[[ConnId], dict[str, Any]]) -> dict[str, Any]:
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.last_used, reverse=True)
            held, in_flight = self.held, self.in_flight
            return {
                "budget": self.budget,
                "used": held.nbytes,
                "disk": None if self.disk is None else self.disk.describe(
                    sum(e.nbytes for e in self._entries.values() if e.backing == "file")),
                "reserved": in_flight.nbytes,
                "entries": [e.describe(kernels) for e in entries if not e.marker],
                "loading": [
                    {"key": load.key, "since": load.started, "reserved": load.reserved,
                     "loader": kernels(load.owner), "waiters": len(load.waiters),
                     "progress": load.describe_progress()}
                    for load in self._loads.values()
                ],
                "hits_log": [dict(h) for h in self.hits_log],
                "stats": dict(self.stats),
                "descriptors": {"limit": self.descriptors.limit, "cap": self.descriptors.cap,
                                "entries": held.nfds, "reserved": in_flight.nfds,
                                "connections": self.descriptors.connections},
            }

    # -- lookups and loads ---------------------------------------------------------------------

    def lookup(self, conn: ConnId, pid: int, key: str, *, wait: bool, request_id: int,
               notify: Notify) -> LookupResult | None:
        """Decide a lookup; None means the caller waits and `notify` will be called with the result."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not self._intact(entry):
                entry = None
            if entry is not None:
                result = self._hit(conn, entry)  # DescriptorsExhausted: answered as an error, nothing pinned
                self._count_hit(entry, pid)
                return result
            load = self._loads.get(key)
            if load is None:
                self.stats["misses"] += 1
                self._loads[key] = _Load(key, conn, pid)
                return LookupResult("load")
            if load.owner == conn:
                return LookupResult("load")
            if not wait:
                return LookupResult("busy")
            load.waiters.append(_Waiter(conn, pid, request_id, notify))
            self.stats["waits"] += 1
            return None

    def cancel_wait(self, conn: ConnId, request_id: int) -> bool:
        with self._lock:
            for load in self._loads.values():
                for waiter in list(load.waiters):
                    if waiter.conn == conn and waiter.request_id == request_id:
                        load.waiters.remove(waiter)
                        return True
        return False

    def reserve(self, conn: ConnId, key: str, nbytes: int, nfds: int = 2) -> list[str]:
        """Reserve room for the load of `key` owned by `conn`: `nbytes` of the budget and the `nfds`
        descriptors its entry will hold (Note [Descriptor budget]); returns the keys evicted to make it."""
        with self._lock:
            load = self._owned_load(conn, key)
            if nbytes > self.budget:
                raise BudgetExceeded(
                    "budget_exceeded",
                    f"this entry needs {byte_text(nbytes)} but the store's whole budget is {byte_text(self.budget)}: "
                    "raise OVERMIND_BUDGET (bytes, or a suffix like 40G) and restart the daemon "
                    "with `overmind-daemon stop`",
                )
            need, need_fds = nbytes - load.reserved, nfds - load.nfds
            evicted = self._make_room(need, need_fds)
            if not self._fits_fds(need_fds):
                raise self._refuse_for_descriptors(nfds)
            if not self._fits_disk(need):
                raise BudgetExceeded("budget_exceeded", self.disk.refusal(nbytes, self.in_flight.nbytes)
                                     if self.disk is not None else "no room on the disk")
            if not self._fits_bytes(need):
                held = self._held_by_pins()
                pinned = sum(e.nbytes for e in self._entries.values() if e.key in held)
                raise BudgetExceeded(
                    "budget_exceeded",
                    f"no room for {byte_text(nbytes)}: {byte_text(pinned)} of the {byte_text(self.budget)} budget "
                    "is held "
                    "by entries that kernels use now and {} is reserved by other loads; free models in "
                    "other kernels, `%overmind evict`, or raise OVERMIND_BUDGET".format(
                        byte_text(self.in_flight.nbytes)),
                )
            load.reserved, load.nfds = nbytes, nfds
            if load.loaded is None:
                load.loaded = time.time()  # Note [Load time saved]
            return evicted

    def publish(self, conn: ConnId, key: str, *, graph_fd: int, arena_fd: int, graph_bytes: int,
                arena_bytes: int, backing: str, meta: dict[str, Any], deps: list[str],
                sources: list[arena.SourceFile] | None = None, pieces: list[list[int]] | None = None,
                pin: bool = False, marker: bool = False,
                watch: list[dict[str, Any]] | None = None) -> list[tuple[Notify, LookupResult]]:
        """Turn a load into an entry. Takes ownership of every descriptor, also on error. `pin` pins
        the entry once for the publisher (whose model now lies in its arena). Returns the waiters to
        answer (outside any lock)."""
        sources = sources or []
        try:
            with self._lock:
                load = self._owned_load(conn, key)
                if graph_bytes + arena_bytes > load.reserved:
                    raise RemoteError(
                        "not_reserved",
                        f"publish of {graph_bytes + arena_bytes} bytes exceeds the {load.reserved} reserved",
                    )
                extra_fds = 2 + len(sources) - load.nfds  # more than reserved: a client that did not say
                if extra_fds > 0:
                    self._make_room(0, extra_fds)
                    if not self._fits_fds(extra_fds):
                        raise self._refuse_for_descriptors(2 + len(sources))
                missing = [d for d in deps if d not in self._entries]
                if missing:
                    raise RemoteError("missing_dependency", f"entries {missing} were evicted meanwhile")
                entry = Entry(key, graph_fd, arena_fd, graph_bytes, arena_bytes, backing, meta, deps, load.owner_pid,
                              sources=sources, pieces=pieces or [], marker=marker, watch=watch or [],
                              load_s=_load_seconds(load, meta))
                if pin:
                    entry.pins[conn] += 1
                del self._loads[key]
                self._entries[key] = entry
                self.stats["published"] += 1
                answers = []
                for waiter in load.waiters:
                    try:
                        answers.append((waiter.notify, self._hit(waiter.conn, entry)))
                        self._count_hit(entry, waiter.pid)
                    except DescriptorsExhausted as exc:
                        answers.append((waiter.notify, LookupResult("error", error=exc)))
                return answers
        except BaseException:
            for fd in (graph_fd, arena_fd, *(s.fd for s in sources)):
                os.close(fd)
            raise

    def abandon(self, conn: ConnId, key: str) -> list[tuple[Notify, LookupResult]]:
        with self._lock:
            load = self._loads.get(key)
            if load is None or load.owner != conn:
                return []
            self.stats["abandoned"] += 1
            return self._hand_over(load)

    def report_progress(self, conn: ConnId, key: str, label: str, done: float, total: float, unit: str) -> bool:
        """The loader of `key` says how far it got (Note [Progress]); False when it loads no such key."""
        with self._lock:
            load = self._loads.get(key)
            if load is None or load.owner != conn:
                return False
            since = load.progress["since"] if load.progress and load.progress["label"] == label else time.time()
            load.progress = {"label": label, "done": done, "total": total, "unit": unit, "since": since}
            return True

    def report_hits(self, pid: int, hits: list[tuple[str, float, float]]) -> None:
        """A kernel's hit times, `(key, when, hit_s)` each, filled into the hits it made (Note [Load time
        saved]); a hit that fell out of the log meanwhile is skipped."""
        with self._lock:
            for key, when, hit_s in hits:
                for h in reversed(self.hits_log):
                    if h["key"] == key and h["pid"] == pid and h["hit_s"] is None and h["t"] <= when + 1:
                        h["hit_s"] = hit_s
                        break

    # -- compaction (Note [Pending pieces]) ---------------------------------------------------------

    def compaction_job(self, key: str) -> CompactionJob | None:
        """Start compacting `key`: its pieces and descriptors of its own; None when there is nothing
        (left) to do or the entry went stale. Raises OSError (EMFILE: try later) with nothing changed."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.pieces or entry.compaction is not None or not self._intact(entry):
                return None
            fds = _dup_all([entry.arena_fd, *(s.fd for s in entry.sources)])
            entry.compaction = {"total": entry.pending_bytes, "done": 0, "started": time.time()}
            sources = [arena.SourceFile(fd, dict(s.identity), s.path)
                       for s, fd in zip(entry.sources, fds[1:], strict=True)]
            return CompactionJob(key, entry, fds[0], entry.arena_bytes, entry.backing,
                                 [list(p) for p in entry.pieces], sources)

    def compaction_progress(self, job: CompactionJob, done: int) -> None:
        with self._lock:
            if job.entry.compaction is not None:
                job.entry.compaction["done"] = done

    def compaction_finish(self, job: CompactionJob, arena_fd: int | None) -> bool:
        """Swap the compacted arena in (or, with None, give up: the entry stays servable from its
        sources). Takes ownership of `arena_fd`; False if the entry is gone, stale or changed."""
        with self._lock:
            entry = self._entries.get(job.key)
            current = entry is job.entry and entry is not None and self._intact(entry)
            if entry is job.entry and entry is not None:
                entry.compaction = None
            if arena_fd is None:
                return False
            if not current or entry is None:
                os.close(arena_fd)
                return False
            old, sources = entry.arena_fd, entry.sources
            entry.arena_fd, entry.sources, entry.pieces = arena_fd, [], []
            self.stats["compacted"] += 1
        for fd in [old, *(s.fd for s in sources)]:
            os.close(fd)
        return True

    # -- orphans (Note [Orphaned entries]) -------------------------------------------------------

    def drop_orphaned(self) -> list[str]:
        """Drop the entries a checkpoint of which is gone or replaced (and what builds on them)."""
        with self._lock:
            watched = [(e.key, e.watch) for e in self._entries.values() if e.watch]
        gone = [key for key, watch in watched if not all(_still_there(w) for w in watch)]
        with self._lock:
            dropped = [k for key in gone if key in self._entries for k in self._drop(key)]
            self.stats["orphaned"] += len(dropped)
        return dropped

    # -- pins and eviction ---------------------------------------------------------------------

    def unpin(self, conn: ConnId, key: str, count: int = 1) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.pins[conn] > 0:
                entry.pins[conn] = max(0, entry.pins[conn] - count)
                if not entry.pins[conn]:
                    del entry.pins[conn]

    def evict(self, key: str | None) -> list[str]:
        """Evict one entry (and its dependents) or, with None, every entry. Explicit eviction ignores
        pins: kernels keep their mappings, and the memory goes with the last of them."""
        with self._lock:
            keys = list(self._entries) if key is None else [key]
            if key is not None and key not in self._entries:
                return []
            evicted: list[str] = []
            for k in keys:
                if k in self._entries:
                    evicted += self._drop(k)
            self.stats["evicted"] += len(evicted)
            return evicted

    def count(self, stat: str) -> None:
        """Count an event of the daemon's in `stats` (shown by status)."""
        with self._lock:
            self.stats[stat] += 1

    def shed(self, fds: int) -> list[str]:
        """Evict least-recently-used unpinned entries until they gave back `fds` descriptors (or none
        is left to evict): room for a connection or a reply when the descriptor table is full."""
        with self._lock:
            return self._shed(fds)

    def release_connection(self, conn: ConnId) -> list[tuple[Notify, LookupResult]]:
        with self._lock:
            for entry in self._entries.values():
                entry.pins.pop(conn, None)
            answers = []
            for load in list(self._loads.values()):
                load.waiters = deque(w for w in load.waiters if w.conn != conn)
                if load.owner == conn:
                    answers += self._hand_over(load)
            return answers

    def close(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._drop(key)

    # -- internals (lock held) -------------------------------------------------------------------

    def _count_hit(self, entry: Entry, pid: int) -> None:
        if entry.marker:
            return
        self.stats["hits"] += 1
        self.hits_log.append({"t": time.time(), "key": entry.key, "label": str(entry.meta.get("label") or ""),
                              "pid": pid, "load_s": entry.load_s, "hit_s": None})

    def _owned_load(self, conn: ConnId, key: str) -> _Load:
        load = self._loads.get(key)
        if load is None or load.owner != conn:
            raise RemoteError("not_loading", f"this connection is not loading {key!r}; look it up first")
        return load

    def _hit(self, conn: ConnId, entry: Entry) -> LookupResult:
        """Pin `entry` and what it builds on for `conn`, with duplicates of their descriptors to send.
        Raises DescriptorsExhausted, with nothing pinned or left open, when none can be had."""
        chain = self._with_deps(entry)  # the entry first, then the entries it builds on
        for e in chain:
            e.pins[conn] += 1  # first, so that shedding for the duplicates passes the chain over
        try:
            fds = self._dup_for_sending(_sent_with_hit(chain))
        except DescriptorsExhausted:
            for e in chain:
                e.pins[conn] -= 1
                if not e.pins[conn]:
                    del e.pins[conn]
            raise
        now = time.time()
        for e in chain:
            e.last_used = now
        entry.hits += int(not entry.marker)
        return LookupResult("hit", chain, fds)

    def _dup_for_sending(self, fds: list[int]) -> list[int]:
        """Duplicates of `fds`; with the table full, shed unpinned entries and try once more, then
        raise DescriptorsExhausted (Note [Descriptor budget])."""
        for attempt in (1, 2):
            try:
                return _dup_all(fds)
            except OSError as exc:
                if not descriptors.exhausted(exc):
                    raise
                if attempt == 1:
                    self._shed(len(fds))
        self.stats["descriptors_short"] += 1
        raise self._short_of_descriptors("sending a hit")

    def _with_deps(self, entry: Entry) -> list[Entry]:
        seen: dict[str, Entry] = {}
        stack = [entry]
        while stack:
            e = stack.pop()
            if e.key in seen:
                continue
            seen[e.key] = e
            stack += [self._entries[d] for d in e.deps if d in self._entries]
        return list(seen.values())

    def _dependents(self, key: str) -> list[str]:
        out, stack = [], [key]
        while stack:
            k = stack.pop()
            for e in self._entries.values():
                if k in e.deps and e.key not in out:
                    out.append(e.key)
                    stack.append(e.key)
        return out

    def _intact(self, entry: Entry) -> bool:
        """Whether every source file of `entry` and of the entries it builds on is unchanged; drops
        the stale ones (and what builds on them) otherwise (Note [Pending pieces])."""
        stale = [e.key for e in self._with_deps(entry) if not e.intact()]
        for key in stale:
            self.stats["stale"] += 1
            self._drop(key)
        return not stale

    def _held_by_pins(self) -> set[str]:
        """Keys eviction passes over: pinned entries and every entry they build on."""
        held: set[str] = set()
        stack = [e for e in self._entries.values() if e.pins]
        while stack:
            e = stack.pop()
            if e.key not in held:
                held.add(e.key)
                stack += [self._entries[d] for d in e.deps if d in self._entries]
        return held

    def _fits_bytes(self, need: int) -> bool:
        return self.held.nbytes + self.in_flight.nbytes + need <= self.budget and self._fits_disk(need)

    def _fits_disk(self, need: int) -> bool:
        """Whether `need` more bytes leave the disk's free space above its reserve, counting what loads in
        flight reserved as not written yet (Note [Disk room] in disk.py)."""
        return self.disk is None or need + self.in_flight.nbytes <= self.disk.room()

    def make_disk_room(self) -> list[str]:
        """Evict unpinned entries while the disk's free space is below its reserve (something else filled
        it); returns the keys evicted."""
        with self._lock:
            if self.disk is None or self.disk.room() >= 0:
                return []
            disk = self.disk
            return self._evict_until(lambda: disk.room() >= 0)

    def _fits_fds(self, need_fds: int) -> bool:
        return self.held.nfds + self.in_flight.nfds + need_fds <= self.descriptors.cap

    def _make_room(self, need: int, need_fds: int = 0) -> list[str]:
        """Evict until `need` more bytes and `need_fds` more descriptors fit, or nothing is left to evict."""
        return self._evict_until(lambda: self._fits_bytes(need) and self._fits_fds(need_fds))

    def _shed(self, fds: int) -> list[str]:
        target = self.held.nfds - fds
        return self._evict_until(lambda: self.held.nfds <= target)

    def _evict_until(self, done: Callable[[], bool]) -> list[str]:
        """Evict least-recently-used unpinned entries (dependents with them) until `done()`."""
        held = self._held_by_pins()
        evicted: list[str] = []
        for victim in sorted((e for e in self._entries.values() if e.key not in held), key=lambda e: e.last_used):
            if done():
                break
            if victim.key in self._entries:  # not gone with an entry it builds on
                evicted += self._drop(victim.key)
        self.stats["evicted"] += len(evicted)
        return evicted

    def _refuse_for_descriptors(self, fds: int) -> DescriptorsExhausted:
        self.stats["descriptors_refused"] += 1
        d, held = self.descriptors, self._held_by_pins()
        pinned = sum(e.nfds for e in self._entries.values() if e.key in held)
        return DescriptorsExhausted(
            "descriptors_exhausted",
            f"the daemon has no file descriptors left for a new entry (it needs {fds}): its limit of {d.limit} "
            f"leaves {d.cap} for entries, the rest being kept for connections and its own use, and entries that "
            f"kernels use now hold {pinned} of them, loads in flight {self.in_flight.nfds}. To cache more, "
            f"{descriptors.ADVICE}",
        )

    def _short_of_descriptors(self, doing: str) -> DescriptorsExhausted:
        return DescriptorsExhausted(
            "descriptors_exhausted",
            f"the daemon ran out of file descriptors (its limit is {self.descriptors.limit}) while {doing}; "
            f"this load runs plainly. If it happens again, {descriptors.ADVICE}",
        )

    def _drop(self, key: str) -> list[str]:
        dropped = []
        for k in [*self._dependents(key), key]:
            entry = self._entries.pop(k, None)
            if entry is None:
                continue
            for fd in (entry.graph_fd, entry.arena_fd, *(s.fd for s in entry.sources)):
                os.close(fd)
            dropped.append(k)
        return dropped

    def _hand_over(self, load: _Load) -> list[tuple[Notify, LookupResult]]:
        del self._loads[load.key]
        if not load.waiters:
            return []
        heir = load.waiters.popleft()
        self._loads[load.key] = _Load(load.key, heir.conn, heir.pid, waiters=load.waiters)
        return [(heir.notify, LookupResult("load"))]


def _load_seconds(load: _Load, meta: dict[str, Any]) -> float | None:
    """The plain load's wall time (Note [Load time saved]): the loader's own figure, else the daemon's."""
    said = meta.get("load_s")
    if isinstance(said, (int, float)) and not isinstance(said, bool) and 0 <= said < 1e7:
        return float(said)
    return (load.loaded or time.time()) - load.started


def _sent_with_hit(chain: list[Entry]) -> list[int]:
    """What a hit of `chain[0]` sends (protocol.py): its graph, then each entry's arena and sources."""
    return [chain[0].graph_fd, *(fd for e in chain for fd in (e.arena_fd, *(s.fd for s in e.sources)))]


def _dup_all(fds: list[int]) -> list[int]:
    """Duplicates of every one of `fds`, or OSError with none of them left open."""
    out: list[int] = []
    try:
        for fd in fds:
            out.append(os.dup(fd))
    except BaseException:
        for fd in out:
            os.close(fd)
        raise
    return out


def _still_there(watched: dict[str, Any]) -> bool:
    try:
        st = os.stat(watched["path"])
    except OSError:
        return False
    return (st.st_dev, st.st_ino, st.st_ctime_ns) == (watched["dev"], watched["ino"], watched["ctime_ns"])

