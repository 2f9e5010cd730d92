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
the descriptor limit sets (Note [Descriptor budget] in descriptors.py). Neither the sums nor the order of
eviction are computed from every entry: the catalogue keeps them (Note [Eviction in O(log n)] in catalogue.py).

# Note [Reserved at publish]
A loader reserves the room of its entry before it writes gigabytes (a converting miss's stage, a large
copy). A publish also reserves whatever was not reserved before it, bytes and descriptors, as `reserve`
would, evicting or refusing alike: so a miss that writes at most a few MiB into a memfd before it
publishes (a same-dtype load: its weights stay in the checkpoint files until the compactor copies them; a
converting load, whose stage reserved its ranges as it wrote them) makes one round trip, not two. A file
arena is reserved first where the miss would write more than 1 MiB into it (Note [Disk room] in disk.py):
bytes written before the check count twice in it (in the free space it reads and in the entry's size),
which the few KiB of a same-dtype load's buffers do not move, and a large copy is not written onto a disk
that then refuses it. A same-dtype miss into a file arena so makes one round trip too (its reservation
took 0.3-0.4 ms, and the publish's answer now comes later by about as much: benchmarks/RESULTS.md, "Stop
72"). Where the publish reserves, the tensors of what the miss copied move onto the arena only once the
publish is taken: refused, they stay where the load put them, and the arena's blocks go with its
descriptors (moved first, they kept the blocks taken for as long as the model lived, past the check that
refused them).

# Note [Orphaned entries]
An entry's key names the checkpoint files it was loaded from, by their identity: once they are deleted
or replaced, no lookup can reach the entry again (a checkpoint written anew has another key). So a
publish names the checkpoint paths it read ("watch": path, device, inode, ctime), and the daemon drops
the entries whose paths are gone or changed, every few seconds (`drop_orphaned`), instead of keeping
them until the budget evicts them. The ctime counts because a file system may give a checkpoint
written anew the inode of the one deleted before it, and any change the ctime shows (a directory's
listing, a file's bytes) changes the key too. Kernels that use such a model keep their mappings.

# Note [Closing after the lock]
Closing the last descriptor of an arena frees its memory, and that takes time: 49 ms for 1 GiB of shmem
here, most of a second for a large model. Every kernel's hit waits for the store's lock, so the lock is
not held for that: an entry dropped under it (evicted, stale, orphaned) leaves the catalogue at once, and
its descriptors are closed once the lock is released (`_locked`). Only shedding, which evicts to get
descriptors back for a connection or a reply when the table is full, closes them at once (Note
[Descriptor budget] in descriptors.py).

# Note [Single flight]
The first connection that misses a key becomes its loader; later lookups of that key wait and are
answered with the entry when the loader publishes. If the loader abandons the load or disconnects, the
oldest waiter becomes the loader instead. Pins, reservations, loads and waits all belong to the
connection that took them (docs/design.md invariant 5) and `release_connection` drops them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import arena, descriptors
from .catalogue import LABEL_CHARS, REPLY_ENTRY_BYTES, STATUS_ENTRIES, Catalogue, ConnId, Entry, Usage
from .disk import DiskRoom
from .errors import BudgetExceeded, DescriptorsExhausted, RemoteError
from .formats import byte_text
from .payloads import (
    Connection,
    DescriptorsStatus,
    LoadStatus,
    LoggedHit,
    MissTimes,
    Progress,
    StoreSnapshot,
    TimeSaved,
)

__all__ = ["CompactionJob", "Entry", "LookupResult", "Store"]

log = logging.getLogger(__name__)

Notify = Callable[["LookupResult"], None]
D = TypeVar("D", bound=Mapping[str, Any])


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
    started: float = field(default_factory=time.time)
    reserved: int = 0
    on_disk: int = 0  # what of `reserved` its arena takes on the disk: all of it for a file arena (Note [Disk room])
    nfds: int = 0  # descriptors reserved for the entry (Note [Descriptor budget])
    waiters: deque[_Waiter] = field(default_factory=deque)
    loaded: float | None = None  # when the loader first reserved: its plain load had ended
    progress: dict[str, Any] | None = None  # what the loader last reported (Note [Progress])

    def describe_progress(self) -> Progress | None:
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
    """What the compactor needs of one entry, with descriptors of its own (closed by `close`). `dropped` is
    set once the entry leaves the store (evicted, stale, orphaned): the copy stops at its next chunk (Note
    [A dropped entry's copy stops] in compaction.py)."""

    key: str
    entry: Entry
    arena_fd: int
    arena_bytes: int
    backing: str
    pieces: list[list[int]]
    sources: list[arena.SourceFile]
    parts: list[arena.Part] = field(default_factory=list)
    dropped: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        for fd in [self.arena_fd, *(p.fd for p in self.parts), *(s.fd for s in self.sources)]:
            os.close(fd)


# Note [Load time saved]
# Every figure of time that status, the side panel, the widgets and the cell show comes from here, so
# that one event has one set of numbers. A miss costs its caller `waited_s`, from the call's start to the
# publish that ends it (the call returns right after), made of `load_s`, the load itself, and `cache_s`,
# the rest: the key, the lookup, staging, packing and publishing. The kernel measures all three and sends
# them with the publish ("times"); the daemon keeps `waited_s` (at least `load_s`) and `load_s`, and
# derives `cache_s` as their difference, so that the parts always add up to the whole. A publish without
# times (an older kernel's) is timed by the daemon: from the lookup that made the connection the loader
# to its first reserve (sent once the load returned) as `load_s`, and to the publish as `waited_s`.
# Each hit is logged with its entry's three figures; the hit's own wait (`hit_s`, the whole call as the
# kernel timed it) comes later, never on the hit's path: a `hits` report (fire and forget) fills it in.
# The hit waits for it in `_untimed`, by kernel and key, whatever came since: a kernel reports its hits
# after a cell, a miss, a status read, its end, or every few hundred hits (Note [Hit times] in
# overmind_jupyter/progress.py), and every hit it reports counts (300 hits in a loop once counted 200,
# the length of the log they were matched against). `_untimed` forgets its oldest hits past UNTIMED_HITS
# only: those of kernels that ended without reporting them. `hits_log` shows the last HITS_LOG hits,
# timed or not yet. The hits never timed are not in the sums below, and status says how many there are
# beside them (`untimed_ended`: of kernels that ended before reporting, killed say; `untimed_waiting`: of
# kernels that run and have yet to), so that "510 hits took 23 s" beside 640 hits reads true. What the
# cache saved, honestly:
#     saved = sum over timed hits of (load_s of its entry - hit_s)  -  sum over misses of cache_s
# each hit saves the plain load it replaced less its own wait, and every miss published since the daemon
# started added its caching to what its user waited, whether or not its entry was ever hit. `time_saved`
# in status keeps these sums over the daemon's life (`hits_log` holds only the recent hits);
# overmind_jupyter/view.py words them for every view.
HITS_LOG = 200
UNTIMED_HITS = 10_000

# Note [Progress]
# Every long operation reports progress in one shape, `{label, done, total, unit, eta_s}`: a load in
# flight (its loader sends `progress` reports, fire and forget), and the compactor's copy of an entry
# (Note [Pending pieces]). The status reply carries it on the load (`loading[i].progress`) and on the
# entry (`entries[i].progress`); views write it with kernel_server/formats.py's `progress_text`.


class Store:
    def __init__(self, budget: int, disk: DiskRoom | None = None) -> None:
        self.budget = budget
        self.disk = disk  # the disk under file arenas, when they are on one (Note [Disk room] in disk.py)
        self._lock = threading.Lock()  # taken through `_locked` (Note [Closing after the lock])
        self._dropped: list[int] = []  # descriptors of entries dropped under the lock, closed after it
        self._dropped_disk = 0  # bytes of file arenas among them: disk that closing them gives back
        self._entries = Catalogue()  # Note [Eviction in O(log n)] in catalogue.py
        self._loads: dict[str, _Load] = {}
        self.stats = Counter[str]()
        self.hits_log: deque[LoggedHit] = deque(maxlen=HITS_LOG)  # Note [Load time saved]
        self._untimed: dict[tuple[int, str], deque[LoggedHit]] = {}  # the hits not timed yet (the same Note),
        self._untimed_n = 0  # by (pid, key), oldest first, and how many
        self.time_saved = TimeSaved(misses=0, cache_s=0.0, hits=0, plain_s=0.0, hit_s=0.0)  # the same Note
        # The daemon keeps its count of connections current (Note [Descriptor budget]).
        self.descriptors = descriptors.DescriptorBudget.of_process()
        self.compacting = True  # whether the daemon's compactor copies entries' pieces (OVERMIND_COMPACT)
        # the compaction in flight (Note [A dropped entry's copy stops] in compaction.py)
        self._compaction: CompactionJob | None = None
        self._compaction_unwritten = 0  # bytes the compaction in flight has yet to take of the disk (Note [Disk room])
        self._short_of_disk: dict[str, bool] = {}  # entries whose compaction found no room on the disk: whether
        # handed back to the compactor since (`compactions_due`)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's lock; the descriptors of the entries dropped while it was held are closed once it
        is released (Note [Closing after the lock])."""
        dropped: list[int] = []
        try:
            with self._lock:
                try:
                    yield
                finally:
                    dropped, self._dropped, self._dropped_disk = self._dropped, [], 0
        finally:
            for fd in dropped:
                os.close(fd)

    # -- reads ---------------------------------------------------------------------------------

    @property
    def held(self) -> Usage:
        """What the entries hold."""
        return Usage(self._entries.nbytes, self._entries.nfds)

    @property
    def in_flight(self) -> Usage:
        """What the loads in flight reserved."""
        return Usage(sum(load.reserved for load in self._loads.values()),
                     sum(load.nfds for load in self._loads.values()))

    def snapshot(self, kernels: Callable[[ConnId], Connection], limit: int = STATUS_ENTRIES,
                 pids: Collection[int] = ()) -> StoreSnapshot:
        """The store for status: its totals, loads and counters, and at most `limit` of its entries, the
        largest and the most recently used (Note [Status with many entries] in catalogue.py). `pids`: the
        processes connected now, whose untimed hits may still be reported (Note [Load time saved])."""
        with self._locked():
            shown = [e.describe(kernels) for e in self._entries.shown(limit)]
            listed = self._entries.listed
            held, in_flight = self.held, self.in_flight
            loading = [LoadStatus(key=load.key, since=load.started, reserved=load.reserved, loader=kernels(load.owner),
                                  waiters=len(load.waiters), progress=load.describe_progress())
                       for load in self._loads.values()]
            hits_log = [LoggedHit(**h) for h in self.hits_log]
            waiting = sum(len(hits) for (pid, _), hits in self._untimed.items() if pid in pids)
            ended = self.stats["hits"] - self.time_saved["hits"] - waiting  # with those forgotten past UNTIMED_HITS
            time_saved = TimeSaved(**self.time_saved, untimed_ended=ended, untimed_waiting=waiting)
            stats = dict(self.stats)
            fds = DescriptorsStatus(limit=self.descriptors.limit, cap=self.descriptors.cap, entries=held.nfds,
                                    reserved=in_flight.nfds, connections=self.descriptors.connections, open=None)
            disk = None if self.disk is None else self.disk.describe(self._entries.file_bytes)
        entries = _within(shown, REPLY_ENTRY_BYTES)
        return StoreSnapshot(budget=self.budget, used=held.nbytes, disk=disk, reserved=in_flight.nbytes,
                             loading=loading, hits_log=hits_log, time_saved=time_saved, stats=stats, descriptors=fds,
                             entries=entries, entries_total=listed, entries_more=listed - len(entries))

    def listing(self, kernels: Callable[[ConnId], Connection], after: str, limit: int) -> dict[str, Any]:
        """A page of `ls`: the listed entries whose keys sort after `after`, at most `limit`, with `total`
        and the `next` page's `after` (None after the last page; Note [Status with many entries])."""
        with self._locked():
            page = [e.describe(kernels) for e in self._entries.page(after, limit + 1)]
            listed = self._entries.listed
        entries = _within(page[:limit], REPLY_ENTRY_BYTES, least=1)
        more = len(entries) < len(page)
        return {"entries": entries, "total": listed, "next": entries[-1]["key"] if more else None}

    def keys_with_prefix(self, prefix: str, limit: int) -> list[str]:
        """The keys of listed entries that start with `prefix`, at most `limit`."""
        with self._locked():
            return self._entries.with_prefix(prefix, limit)

    # -- lookups and loads ---------------------------------------------------------------------

    def lookup(self, conn: ConnId, pid: int, key: str, *, wait: bool, request_id: int,
               notify: Notify) -> LookupResult | None:
        """Decide a lookup; None means the caller waits and `notify` will be called with the result."""
        with self._locked():
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
                self._loads[key] = _Load(key, conn)
                return LookupResult("load")
            if load.owner == conn:
                return LookupResult("load")
            if not wait:
                return LookupResult("busy")
            load.waiters.append(_Waiter(conn, pid, request_id, notify))
            self.stats["waits"] += 1
            return None

    def cancel_wait(self, conn: ConnId, request_id: int) -> bool:
        with self._locked():
            for load in self._loads.values():
                for waiter in list(load.waiters):
                    if waiter.conn == conn and waiter.request_id == request_id:
                        load.waiters.remove(waiter)
                        return True
        return False

    def reserve(self, conn: ConnId, key: str, nbytes: int, nfds: int = 2, backing: str = "file",
                evict: bool = True) -> list[str]:
        """Reserve room for the load of `key` owned by `conn`: `nbytes` of the budget, of the disk too where
        its arena is a file (`backing`: Note [Disk room] in disk.py), and the `nfds` descriptors its entry will
        hold (Note [Descriptor budget]); returns the keys evicted to make it. `evict` False: only if it fits
        without evicting an entry (Note [Reserving ahead])."""
        with self._locked():
            return self._reserve(self._owned_load(conn, key), nbytes, nfds, nbytes if backing == "file" else 0,
                                 evict=evict)

    # Note [Reserving ahead]
    # A load may reserve more than it needs now, to ask less often (a stage reserves a granule ahead:
    # overmind_jupyter/staging.py). Room asked for ahead of need evicts nothing: such a reserve (`evict`
    # False) is refused, quietly and uncounted, where it does not fit beside every entry cached now, and the
    # loader then asks for what it needs, which evicts as any reserve does. Otherwise a small miss on a
    # nearly full disk or budget would evict entries that fit beside it, for room it never uses.

    def _reserve(self, load: _Load, nbytes: int, nfds: int, on_disk: int, evict: bool = True) -> list[str]:
        """`reserve` for `load`, with the lock held: `on_disk` of the `nbytes` go to the disk."""
        if nbytes > self.budget:
            raise BudgetExceeded(
                "budget_exceeded",
                f"this entry needs {byte_text(nbytes)} but the store's whole budget is {byte_text(self.budget)}: "
                "raise OVERMIND_BUDGET (bytes, or a suffix like 40G) and restart the daemon "
                "with `overmind-daemon stop`",
            )
        need, need_fds, need_disk = nbytes - load.reserved, nfds - load.nfds, on_disk - load.on_disk
        disk_short = not self._fits_disk(need_disk)  # as things stand
        if not evict and not (self._fits_fds(need_fds) and not disk_short and self._fits_bytes(need)):
            raise BudgetExceeded("budget_exceeded", f"no room for {byte_text(nbytes)} ahead of need without "
                                 "evicting an entry")  # Note [Reserving ahead]: quietly, no refusal counted
        # what eviction cannot free: a load that would not fit with every unused entry gone evicts none of
        # them for nothing; on the disk, with every unused entry in a file arena gone (Note [Disk room])
        held = self._held_bytes()
        if held.nfds + self.in_flight.nfds + need_fds > self.descriptors.cap:
            raise self._refuse_for_descriptors(nfds)
        if held.nbytes + self.in_flight.nbytes + need > self.budget:
            raise self._refuse_for_budget(nbytes, held.nbytes, load)
        if disk_short and not self._fits_disk(need_disk, evicting=True):
            raise BudgetExceeded("budget_exceeded", self._disk_refusal(on_disk))
        # where the disk fits as things stand, evicting for the budget only gives more of it back
        evicted = self._make_room(need, need_fds, need_disk if disk_short else 0) if evict else []
        if not self._fits_fds(need_fds):
            raise self._refuse_for_descriptors(nfds)
        if not self._fits_disk(need_disk):
            raise BudgetExceeded("budget_exceeded", self._disk_refusal(on_disk))
        if not self._fits_bytes(need):
            raise self._refuse_for_budget(nbytes, self._held_bytes().nbytes, load)
        load.reserved, load.on_disk, load.nfds = nbytes, on_disk, nfds
        if load.loaded is None:
            load.loaded = time.time()  # Note [Load time saved]
        return evicted

    def publish(self, conn: ConnId, key: str, *, graph_fd: int, arena_fd: int, graph_bytes: int,
                arena_bytes: int, backing: str, meta: dict[str, Any], deps: list[str],
                times: MissTimes | None = None, sources: list[arena.SourceFile] | None = None,
                pieces: list[list[int]] | None = None, parts: list[arena.Part] | None = None,
                pin: bool = False, marker: bool = False,
                watch: list[dict[str, Any]] | None = None) -> list[tuple[Notify, LookupResult]]:
        """Turn a load into an entry. Takes ownership of every descriptor, also on error. `pin` pins
        the entry once for the publisher (whose model now lies in its arena). Returns the waiters to
        answer (outside any lock). `times`: what the miss cost its caller, as the loader measured it
        (Note [Load time saved]; the daemon's own measure when None)."""
        sources, parts = sources or [], parts or []
        try:
            with self._locked():
                load = self._owned_load(conn, key)
                nfds = 2 + len(parts) + len(sources)
                on_disk = max(arena_bytes, load.on_disk) if backing == "file" else load.on_disk
                if graph_bytes + arena_bytes > load.reserved or nfds > load.nfds or on_disk > load.on_disk:
                    self._reserve(load, max(graph_bytes + arena_bytes, load.reserved), max(nfds, load.nfds),
                                  on_disk)  # Note [Reserved at publish]
                missing = [d for d in deps if d not in self._entries]
                if missing:
                    raise RemoteError("missing_dependency", f"entries {missing} were evicted meanwhile")
                entry = Entry(key, graph_fd, arena_fd, graph_bytes, arena_bytes, backing, meta, deps,
                              parts=parts, sources=sources, pieces=pieces or [], marker=marker, watch=watch or [],
                              times=_miss_times(load, times), queued=self.compacting)
                if marker:  # its lookup counted a miss, and the load it marks counts its own: one load, one miss
                    self.stats["misses"] -= 1
                else:
                    self.time_saved["misses"] += 1
                    self.time_saved["cache_s"] += entry.times["cache_s"]
                if pin:
                    entry.pins[conn] += 1
                del self._loads[key]
                self._entries.add(entry)
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
            for fd in (graph_fd, arena_fd, *(p.fd for p in parts), *(s.fd for s in sources)):
                os.close(fd)
            raise

    def abandon(self, conn: ConnId, key: str) -> list[tuple[Notify, LookupResult]]:
        with self._locked():
            load = self._loads.get(key)
            if load is None or load.owner != conn:
                return []
            self.stats["abandoned"] += 1
            return self._hand_over(load)

    def report_progress(self, conn: ConnId, key: str, label: str, done: float, total: float, unit: str) -> bool:
        """The loader of `key` says how far it got (Note [Progress]); False when it loads no such key."""
        with self._locked():
            load = self._loads.get(key)
            if load is None or load.owner != conn:
                return False
            since = load.progress["since"] if load.progress and load.progress["label"] == label else time.time()
            load.progress = {"label": label, "done": done, "total": total, "unit": unit, "since": since}
            return True

    def report_hits(self, pid: int, hits: list[tuple[str, float, float]]) -> None:
        """A kernel's hit times, `(key, when, hit_s)` each, filled into the hits it made, oldest first
        (Note [Load time saved]); a time that matches no untimed hit of that kernel is skipped."""
        with self._locked():
            for key, when, hit_s in hits:
                untimed = self._untimed.get((pid, key))
                if not untimed or untimed[0]["t"] > when + 1:
                    continue
                h = untimed.popleft()
                self._untimed_n -= 1
                if not untimed:
                    del self._untimed[pid, key]
                h["hit_s"] = hit_s
                self.time_saved["hits"] += 1
                self.time_saved["plain_s"] += h["load_s"]
                self.time_saved["hit_s"] += hit_s

    # -- compaction (Note [Pending pieces]) ---------------------------------------------------------

    def compaction_job(self, key: str) -> CompactionJob | None:
        """Start compacting `key`: its pieces and descriptors of its own; None when there is nothing
        (left) to do, the entry went stale, or its new arena would take the disk's reserve (Note [Disk room]
        in disk.py: `compactions_due` hands it back). Raises OSError (EMFILE: try later) with nothing changed."""
        with self._locked():
            entry = self._entries.get(key)
            if entry is None or not entry.pieces or entry.compaction is not None or not self._intact(entry):
                return None
            disk = self.disk if entry.backing == "file" else None  # memfd arenas: the budget bounds them
            if disk is not None and not self._fits_disk(entry.arena_bytes):
                if key not in self._short_of_disk:
                    _, free, kept = disk.usage()
                    log.warning("no room on the disk to compact %s (%s): its %s would leave less than the %s kept "
                                "free in %s (%s free, OVERMIND_DISK_RESERVE); it stays servable from its checkpoint "
                                "files, and is compacted once the disk has room", key[:12],
                                str(entry.meta.get("label") or "no label")[:LABEL_CHARS], byte_text(entry.arena_bytes),
                                byte_text(kept), disk.directory, byte_text(free))
                self._short_of_disk[key] = False  # not handed back yet
                entry.short_of_disk = True
                return None
            fds = _dup_all(entry.byte_fds())
            entry.short_of_disk = False
            self._short_of_disk.pop(key, None)
            self._compaction_unwritten = entry.arena_bytes if disk is not None else 0
            entry.compaction = {"total": entry.pending_bytes, "done": 0, "started": time.time()}
            n = len(entry.parts)
            parts = [arena.Part(fd, p.offset, p.nbytes) for p, fd in zip(entry.parts, fds[1:1 + n], strict=True)]
            sources = [arena.SourceFile(fd, dict(s.identity), s.path)
                       for s, fd in zip(entry.sources, fds[1 + n:], strict=True)]
            self._compaction = CompactionJob(key, entry, fds[0], entry.arena_bytes, entry.backing,
                                             [list(p) for p in entry.pieces], sources, parts)
            return self._compaction

    def compaction_progress(self, job: CompactionJob, done: int) -> None:
        with self._locked():
            if job.entry.compaction is not None:
                job.entry.compaction["done"] = done
            if self._compaction_unwritten and not job.dropped.is_set():
                self._compaction_unwritten = job.arena_bytes - done  # each chunk is allocated as it is copied

    def compaction_finish(self, job: CompactionJob, arena_fd: int | None) -> bool:
        """Swap the compacted arena in, which holds every byte (its parts' too), or, with None, give up:
        the entry stays servable from its sources. Takes ownership of `arena_fd`; False if the entry is
        gone, stale or changed."""
        with self._locked():
            self._compaction_unwritten = 0
            if self._compaction is job:
                self._compaction = None
            entry = self._entries.get(job.key)
            current = entry is job.entry and entry is not None and self._intact(entry)
            if entry is job.entry and entry is not None:
                entry.compaction = None
            if arena_fd is None:
                return False
            if not current or entry is None:
                self._dropped.append(arena_fd)  # closed after the lock (Note [Closing after the lock])
                return False
            old, nfds, on_disk = entry.byte_fds(), entry.nfds, entry.disk_bytes
            entry.arena_fd, entry.parts, entry.sources, entry.pieces = arena_fd, [], [], []
            self._entries.recount(entry, nfds, on_disk)
            self.stats["compacted"] += 1
        for fd in old:
            os.close(fd)
        return True

    def compactions_due(self) -> list[str]:
        """The entries whose compaction found no room on the disk and that fit there now, as many as fit
        together (Note [Disk room] in disk.py): the daemon hands them back to the compactor."""
        with self._locked():
            if self.disk is None or not self._short_of_disk:
                return []
            room = self.disk.room() + self._dropped_disk - self._unwritten_on_disk()
            due = []
            for key, handed in self._short_of_disk.items():
                entry = self._entries.get(key)
                if not handed and entry is not None and entry.arena_bytes <= room:
                    room -= entry.arena_bytes
                    due.append(key)
            for key in due:
                self._short_of_disk[key] = True
            return due

    # -- orphans (Note [Orphaned entries]) -------------------------------------------------------

    def drop_orphaned(self) -> list[str]:
        """Drop the entries a checkpoint of which is gone or replaced (and what builds on them)."""
        with self._locked():
            entries = self._entries.entries()  # a copy; what an entry watches never changes
        gone = [e for e in entries if e.watch and not all(_still_there(w) for w in e.watch)]
        with self._locked():
            dropped = [k for e in gone if self._entries.get(e.key) is e for k in self._drop(e.key)]
            self.stats["orphaned"] += len(dropped)
        return dropped

    # -- pins and eviction ---------------------------------------------------------------------

    def unpin(self, conn: ConnId, key: str, count: int = 1) -> None:
        with self._locked():
            entry = self._entries.get(key)
            if entry is not None and entry.pins[conn] > 0:
                self._entries.unpin(entry, conn, count)

    def evict(self, key: str | None) -> list[dict[str, Any]]:
        """Evict one entry (and its dependents) or, with None, every entry. Explicit eviction ignores
        pins: kernels keep their mappings, and the memory goes with the last of them.

        Returns:
            What went, in the order it went: each `key`, `label` (its meta's, cut at LABEL_CHARS) and
            `bytes`, so that the caller can say what it evicted (`%overmind evict`).
        """
        with self._locked():
            keys = self._entries.by_use() if key is None else [key]
            if key is not None and key not in self._entries:
                return []
            evicted: list[dict[str, Any]] = []
            for k in keys:
                if k not in self._entries:
                    continue
                going = {e.key: e for e in (self._entries.get(d) for d in [*self._entries.dependents(k), k])
                         if e is not None}
                evicted += [{"key": d, "label": str(going[d].meta.get("label") or "")[:LABEL_CHARS],
                             "bytes": going[d].nbytes} for d in self._drop(k)]
            self.stats["evicted"] += len(evicted)
            return evicted

    def count(self, stat: str) -> None:
        """Count an event of the daemon's in `stats` (shown by status)."""
        with self._locked():
            self.stats[stat] += 1

    def shed(self, fds: int) -> list[str]:
        """Evict least-recently-used unpinned entries until they gave back `fds` descriptors (or none
        is left to evict): room for a connection or a reply when the descriptor table is full."""
        with self._locked():
            return self._shed(fds)

    def release_connection(self, conn: ConnId) -> list[tuple[Notify, LookupResult]]:
        with self._locked():
            self._entries.release(conn)
            answers = []
            for load in list(self._loads.values()):
                load.waiters = deque(w for w in load.waiters if w.conn != conn)
                if load.owner == conn:
                    answers += self._hand_over(load)
            return answers

    def close(self) -> None:
        with self._locked():
            for key in self._entries.by_use():
                self._drop(key)

    # -- internals (lock held) -------------------------------------------------------------------

    def _count_hit(self, entry: Entry, pid: int) -> None:
        if entry.marker:
            return
        self.stats["hits"] += 1
        label = str(entry.meta.get("label") or "")[:LABEL_CHARS]  # Note [Status with many entries] in catalogue.py
        hit = LoggedHit(t=time.time(), key=entry.key, label=label, pid=pid, hit_s=None, **entry.times)
        self.hits_log.append(hit)
        self._untimed.setdefault((pid, entry.key), deque()).append(hit)  # Note [Load time saved]
        self._untimed_n += 1
        if self._untimed_n > UNTIMED_HITS:  # the oldest first: a kernel that ended without reporting it
            oldest = next(iter(self._untimed))
            self._untimed[oldest].popleft()
            self._untimed_n -= 1
            if not self._untimed[oldest]:
                del self._untimed[oldest]

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
            self._entries.pin(e, conn)  # first, so that shedding for the duplicates passes the chain over
        try:
            fds = self._dup_for_sending(_sent_with_hit(chain))
        except DescriptorsExhausted:
            for e in chain:
                self._entries.unpin(e, conn)
            raise
        now = time.time()
        for e in reversed(chain):  # the entry itself the most recently used
            self._entries.used(e, now)
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
            stack += [dep for d in e.deps if (dep := self._entries.get(d)) is not None]
        return list(seen.values())

    def _intact(self, entry: Entry) -> bool:
        """Whether every source file of `entry` and of the entries it builds on is unchanged; drops
        the stale ones (and what builds on them) otherwise (Note [Pending pieces])."""
        stale = [e.key for e in self._with_deps(entry) if not e.intact()]
        for key in stale:
            self.stats["stale"] += 1
            self._drop(key)
        return not stale

    def _held_bytes(self) -> Usage:
        """What the entries that eviction passes over hold: the pinned ones and what they build on."""
        held = [e for key in self._entries.held_by_pins() if (e := self._entries.get(key)) is not None]
        return Usage(sum(e.nbytes for e in held), sum(e.nfds for e in held))

    def _fits_bytes(self, need: int) -> bool:
        return self.held.nbytes + self.in_flight.nbytes + need <= self.budget

    def _unwritten_on_disk(self) -> int:
        """What loads in flight reserved on the disk and the compaction in flight has yet to write there."""
        return sum(load.on_disk for load in self._loads.values()) + self._compaction_unwritten

    def _fits_disk(self, need: int, *, evicting: bool = False) -> bool:
        """Whether `need` more bytes of file arenas leave the disk's free space above its reserve, counting
        what is reserved there and not written yet as taken (Note [Disk room] in disk.py); `evicting`: once
        every entry that room there may evict is gone too (`_evictable_on_disk`). Taking nothing more of the
        disk (a memfd arena) always fits."""
        if self.disk is None or need <= 0:
            return True
        given_back = self._dropped_disk + (self._evictable_on_disk() if evicting else 0)
        return need + self._unwritten_on_disk() <= self.disk.room() + given_back

    def _evictable_on_disk(self) -> int:
        """What making room on the disk could give back there at most (Note [Disk room] in disk.py): what the
        file arenas of the entries no pin holds take of it (each counted once, whether it goes on its own or
        with what it builds on; a memfd's nothing), and what the compaction in flight has yet to write if its
        entry is one of them (its copy stops). In what the pins hold, not what the store holds."""
        held = self._entries.held_by_pins()
        kept = sum(e.disk_bytes for key in held if (e := self._entries.get(key)) is not None)
        job = self._compaction
        copy = self._compaction_unwritten if job is not None and not job.dropped.is_set() and job.key not in held else 0
        return self._entries.disk_bytes - kept + copy

    def _disk_refusal(self, nbytes: int) -> str:
        """Why `nbytes` more do not fit on the disk, and what to do."""
        return self.disk.refusal(nbytes, self._unwritten_on_disk()) if self.disk is not None else "no room on the disk"

    def make_disk_room(self) -> list[str]:
        """Evict unpinned entries in file arenas while the disk's free space is below its reserve (something
        else filled it); returns the keys evicted. Entries in memfds stay: they take no disk."""
        with self._locked():
            disk = self.disk
            if disk is None or disk.room() >= 0:
                return []
            return self._evict_until(lambda: disk.room() + self._dropped_disk >= 0, on_disk=True)

    def _fits_fds(self, need_fds: int) -> bool:
        return self.held.nfds + self.in_flight.nfds + need_fds <= self.descriptors.cap

    def _make_room(self, need: int, need_fds: int = 0, need_disk: int = 0) -> list[str]:
        """Evict until `need` more bytes of the budget, `need_disk` more of the disk and `need_fds` more
        descriptors fit, or nothing is left to evict: for the disk, only entries in file arenas."""
        evicted = self._evict_until(lambda: self._fits_bytes(need) and self._fits_fds(need_fds))
        return evicted + self._evict_until(lambda: self._fits_disk(need_disk), on_disk=True)

    def _shed(self, fds: int) -> list[str]:
        target = self.held.nfds - fds
        evicted = self._evict_until(lambda: self.held.nfds <= target)
        dropped, self._dropped, self._dropped_disk = self._dropped, [], 0  # wanted now, not after the lock
        for fd in dropped:
            os.close(fd)
        return evicted

    def _evict_until(self, done: Callable[[], bool], on_disk: bool = False) -> list[str]:
        """Evict least-recently-used unpinned entries (dependents with them) until `done()`, in O(log n)
        per victim (Note [Eviction in O(log n)] in catalogue.py); `on_disk`: only those whose arenas are
        files, for room on the disk (Note [Disk room] in disk.py)."""
        if done():
            return []
        held = self._entries.held_by_pins()
        evicted: list[str] = []
        for key in self._entries.by_use():  # the least recently used first
            if done():
                break
            entry = self._entries.get(key)  # None: gone with an entry it builds on
            if key not in held and entry is not None and (not on_disk or entry.backing == "file"):
                evicted += self._drop(key)
        self.stats["evicted"] += len(evicted)
        return evicted

    def _refuse_for_budget(self, nbytes: int, pinned: int, load: _Load) -> BudgetExceeded:
        others = self.in_flight.nbytes - load.reserved  # what this load reserved before is its own
        reserved = f" and {byte_text(others)} is reserved by other loads in flight" if others else ""
        return BudgetExceeded(
            "budget_exceeded",
            f"no room for {byte_text(nbytes)}: {byte_text(pinned)} of the {byte_text(self.budget)} budget is held "
            f"by entries that kernels use now{reserved}; free models in other kernels, `%overmind evict`, or raise "
            "OVERMIND_BUDGET",
        )

    def _refuse_for_descriptors(self, fds: int) -> DescriptorsExhausted:
        self.stats["descriptors_refused"] += 1
        d, pinned = self.descriptors, self._held_bytes().nfds
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
        for k in [*self._entries.dependents(key), key]:
            entry = self._entries.remove(k)
            if entry is None:
                continue
            self._dropped += [entry.graph_fd, *entry.byte_fds()]
            self._dropped_disk += entry.disk_bytes  # what its arena's blocks take (Note [Disk room] in disk.py)
            self._short_of_disk.pop(k, None)
            job = self._compaction
            if job is not None and job.entry is entry and not job.dropped.is_set():
                job.dropped.set()  # Note [A dropped entry's copy stops] in compaction.py
                self._compaction_unwritten = 0
            dropped.append(k)
        return dropped

    def _hand_over(self, load: _Load) -> list[tuple[Notify, LookupResult]]:
        del self._loads[load.key]
        if not load.waiters:
            return []
        heir = load.waiters.popleft()
        self._loads[load.key] = _Load(load.key, heir.conn, waiters=load.waiters)
        return [(heir.notify, LookupResult("load"))]


def _miss_times(load: _Load, said: MissTimes | None) -> MissTimes:
    """What the miss of `load` cost its caller (Note [Load time saved]): the loader's own figures, else the
    daemon's; `cache_s` is always what `waited_s` holds beyond `load_s`."""
    if said is not None:
        load_s, waited_s = said["load_s"], said["waited_s"]
    else:
        now = time.time()
        load_s, waited_s = (load.loaded or now) - load.started, now - load.started
    waited_s = max(waited_s, load_s)
    return MissTimes(waited_s=round(waited_s, 4), load_s=round(load_s, 4), cache_s=round(waited_s - load_s, 4))


def _sent_with_hit(chain: list[Entry]) -> list[int]:
    """What a hit of `chain[0]` sends (protocol.py): its graph, then each entry's arena, parts and sources."""
    return [chain[0].graph_fd, *(fd for e in chain for fd in e.byte_fds())]


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


def _within(described: list[D], budget: int, least: int = 0) -> list[D]:
    """The first of `described` whose JSON takes at most `budget` bytes together, and at least `least` of
    them (Note [Status with many entries] in catalogue.py)."""
    total = 0
    for i, d in enumerate(described):
        total += len(json.dumps(d, separators=(",", ":")))
        if total > budget and i >= least:
            return described[:i]
    return described
