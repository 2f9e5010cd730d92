"""The store's entries: what one entry holds, and the catalogue that keeps them in every order the store
reads them in, kept up to date as entries come, are used, pinned and go (kernel_server/store.py holds the
state machine around them: loads, budget, hits).

# Note [Eviction in O(log n)]
A store may hold thousands of small entries: tokenizers, processors and schedulers take a few KB each.
Every reserve may have to make room, every hit makes an entry the most recently used, every connection's
end drops its pins, and status shows the largest and the most recent entries; all of it runs with the
store's lock held, while other kernels' hits wait for it. When eviction summed every entry's bytes after
each victim and looked through every entry for what built on the victim, making room among 8,000 entries
took 22.6 s, and a kernel whose hit waited 3 s meanwhile declared the daemon hung. So nothing here scans
or sorts all entries per operation; the catalogue keeps, as entries come and go:
- the entries by key in the order of their last use (an OrderedDict: a use moves one to the end in O(1)),
  which eviction walks from the front;
- the bytes and descriptors all entries hold, summed (`nbytes`, `nfds`), and what their file arenas take
  of the disk (`disk_bytes`);
- each key's dependents, the entries whose `deps` name it, so that dropping an entry finds what builds on
  it without looking at the others;
- the keys each connection pins, so that a connection's end and eviction's set of held entries cost what
  the pins are, not what the store holds;
- the listed entries' keys in sorted order, for `ls`'s pages and a prefix's matches, and the entries by
  size (then last use) in sorted order, for status's largest entries. A sorted list is kept in sorted
  chunks of at most 2 * _SortedChunks.CHUNK items (the idea of sortedcontainers' SortedList): an insertion
  or a deletion bisects the chunks, then one chunk, and moves at most a chunk's pointers, however many
  entries there are (one plain list would move half of them: 15 us an entry at 100,000).
Eviction copies the keys in order of use once per reserve that must make room (a C-level copy, about
0.1 ms for 10,000), then spends O(log n) per victim.
benchmarks/many_entries.py measures it; benchmarks/RESULTS.md has the figures (issue 38).

# Note [Status with many entries]
A frame carries at most protocol.MAX_PAYLOAD (1 MiB) of JSON, and an entry's description takes a few
hundred bytes (its meta alone may take 16 KB): at 2,500 entries the status reply no longer fit, and
`%overmind status`, `ls` and the side panel failed or showed an empty cache. So:
- status carries at most `limit` entries (STATUS_ENTRIES unless the request says): the largest, up to
  half of them, largest first (of equal sizes, the most recently used first), then the most recently
  used of the others, most recent first; with
  `entries_total`, the entries listed in all, and `entries_more`, those it does not carry. The views show
  the entries carried and say how many more there are;
- `ls` is paged by key: a page holds the entries whose keys sort after the request's `after`, at most
  `limit` (LS_PAGE unless said), and `next` is the `after` of the following page (null after the last).
  A key, not an offset: entries that come and go between two pages do not shift those not yet listed, so
  every entry present throughout a listing is listed exactly once, and any entry can be evicted by its key;
- both replies stop short of REPLY_ENTRY_BYTES of described entries (`ls` carries at least one per page),
  and a hit's label in status's `hits_log` is cut at LABEL_CHARS, so that a reply fits a frame whatever the
  entries' metas.
Markers (entries without bytes, Note [Random loads] in overmind_jupyter/randomness.py) are never listed.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from . import arena

if TYPE_CHECKING:  # payloads imports this module
    from .payloads import Connection, EntryStatus, MissTimes, Pending, Pinning, Progress

__all__ = ["EVICTED_DESCRIBED", "LABEL_CHARS", "LS_PAGE", "MAX_LISTED", "REPLY_ENTRY_BYTES", "STATUS_ENTRIES",
           "Catalogue", "ConnId", "Entry", "Usage"]

ConnId = int
T = TypeVar("T", str, tuple[int, float, str])

STATUS_ENTRIES = 50  # entries a status reply carries unless its request says (Note [Status with many entries])
LS_PAGE = 500  # entries an `ls` page holds unless its request says
MAX_LISTED = 1000  # the most either request may ask for
REPLY_ENTRY_BYTES = 512 * 1024  # JSON of described entries one reply carries at most
LABEL_CHARS = 512  # of a hit's label in status's hits_log, and of an evicted entry's in evict's reply
EVICTED_DESCRIBED = 50  # the evicted entries an evict's reply names (it lists every key)


_UNTIMED: MissTimes = {"waited_s": 0.0, "load_s": 0.0, "cache_s": 0.0}  # a marker's: no load of its own


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
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    hits: int = 0
    pins: Counter[ConnId] = field(default_factory=Counter)
    parts: list[arena.Part] = field(default_factory=list)  # ranges of the arena in files of their own
    sources: list[arena.SourceFile] = field(default_factory=list)
    pieces: list[list[int]] = field(default_factory=list)  # [arena offset, bytes, source index, file offset]
    compaction: dict[str, float] | None = None  # {"total", "done", "started"} while the compactor copies
    queued: bool = True  # the compactor copies its pieces in time (not with OVERMIND_COMPACT=0)
    short_of_disk: bool = False  # its copy waits for room on the disk (Note [Disk room] in disk.py)
    marker: bool = False  # no bytes: it tells the kernel where to look instead (its meta says why)
    watch: list[dict[str, Any]] = field(default_factory=list)  # checkpoints read: Note [Orphaned entries] in store.py
    # what the miss that made it cost its caller (Note [Load time saved] in store.py)
    times: MissTimes = field(default_factory=_UNTIMED.copy)

    @property
    def nbytes(self) -> int:
        return self.graph_bytes + self.arena_bytes

    @property
    def pending_bytes(self) -> int:
        return sum(p[1] for p in self.pieces)

    @property
    def disk_bytes(self) -> int:
        """What its arena takes of the disk, given back when it goes (Note [Disk room] in disk.py): a file
        arena's bytes but the pieces still in their checkpoint (holes in it); nothing for a memfd."""
        return self.arena_bytes - self.pending_bytes if self.backing == "file" else 0

    @property
    def nfds(self) -> int:
        """The descriptors this entry holds: graph, arena, parts, source files (Note [Descriptor budget] in
        descriptors.py)."""
        return 2 + len(self.parts) + len(self.sources)

    def byte_fds(self) -> list[int]:
        """The descriptors of its bytes, in the order a hit sends them (protocol.py): the arena, its parts
        (Note [Arena parts] in arena.py), its source files."""
        return [self.arena_fd, *(p.fd for p in self.parts), *(s.fd for s in self.sources)]

    def intact(self) -> bool:
        return all(s.intact() for s in self.sources)

    def pending(self) -> Pending | None:
        """What is left to copy into the arena (Note [Pending pieces] in store.py), for status: bytes, done, eta."""
        if not self.pieces:
            return None
        total = self.pending_bytes
        c = self.compaction
        done = int(c["done"]) if c else 0
        elapsed = time.time() - c["started"] if c else 0.0
        eta = (total - done) * elapsed / done if done and elapsed > 0 else None
        return {"bytes": total, "done": done, "copying": c is not None, "queued": self.queued,
                "short_of_disk": self.short_of_disk, "eta": eta,
                "sources": [s.path for s in self.sources]}

    def progress(self) -> Progress | None:
        """The compactor's work on this entry, as every long operation reports it (Note [Progress] in store.py)."""
        pending = self.pending()
        if pending is None or not pending["copying"]:
            return None
        return {"label": f"copying {self.meta.get('label') or self.key[:12]} into shared memory",
                "done": pending["done"], "total": pending["bytes"], "unit": "B", "eta_s": pending["eta"]}

    def describe(self, kernels: Callable[[ConnId], Connection]) -> EntryStatus:
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
            **self.times,
            "pinned_by": [_pinning(kernels(c), n) for c, n in sorted(self.pins.items())],
        }


def _pinning(conn: Connection, pins: int) -> Pinning:
    return {**conn, "pins": pins}


class Catalogue:
    """The entries by key, with the orders, sums and indices the store needs of them (Note [Eviction in
    O(log n)]). Not thread-safe: the store calls it with its lock held. Entries' pins change only
    through `pin`, `unpin` and `release`, and their descriptors through `recount`."""

    def __init__(self) -> None:
        self._by_use: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._keys = _SortedChunks[str]()  # the listed entries' keys
        self._sizes = _SortedChunks[tuple[int, float, str]]()  # the listed entries' (bytes, last used, key)
        self._listed = 0
        self._dependents: dict[str, set[str]] = {}  # key -> keys of the entries whose deps name it
        self._pinned: dict[ConnId, set[str]] = {}  # connection -> keys of the entries it pins
        self.nbytes = 0  # what all entries hold
        self.nfds = 0
        self.file_bytes = 0  # what the entries in file arenas hold on disk (Note [Disk room] in disk.py)
        self.disk_bytes = 0  # what their arenas take of it: Entry.disk_bytes, summed

    # -- membership ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_use)

    def __contains__(self, key: object) -> bool:
        return key in self._by_use

    def get(self, key: str) -> Entry | None:
        return self._by_use.get(key)

    def by_use(self) -> list[str]:
        """Every key, the least recently used first; a copy, so that the caller may drop as it goes."""
        return list(self._by_use)

    def entries(self) -> list[Entry]:
        """Every entry, the least recently used first; a copy."""
        return list(self._by_use.values())

    @property
    def listed(self) -> int:
        """How many entries status and `ls` list (markers are not listed)."""
        return self._listed

    def add(self, entry: Entry) -> None:
        """Add `entry`, whose key is not here yet, as the most recently used, with the pins it has."""
        self._by_use[entry.key] = entry
        self.nbytes += entry.nbytes
        self.nfds += entry.nfds
        self.file_bytes += entry.nbytes if entry.backing == "file" else 0
        self.disk_bytes += entry.disk_bytes
        for dep in set(entry.deps):
            self._dependents.setdefault(dep, set()).add(entry.key)
        for conn in entry.pins:
            self._pinned.setdefault(conn, set()).add(entry.key)
        if not entry.marker:
            self._listed += 1
            self._keys.add(entry.key)
            self._sizes.add(_size(entry))

    def remove(self, key: str) -> Entry | None:
        """Forget the entry of `key` and its pins (None if there is none); its descriptors are the caller's
        to close. What builds on it stays: the store drops that first (`dependents`)."""
        entry = self._by_use.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry.nbytes
        self.nfds -= entry.nfds
        self.file_bytes -= entry.nbytes if entry.backing == "file" else 0
        self.disk_bytes -= entry.disk_bytes
        for dep in set(entry.deps):
            dependents = self._dependents.get(dep)
            if dependents is not None:
                dependents.discard(key)
                if not dependents:
                    del self._dependents[dep]
        for conn in entry.pins:
            self._forget_pin(conn, key)
        if not entry.marker:
            self._listed -= 1
            self._keys.discard(key)
            self._sizes.discard(_size(entry))
        return entry

    def used(self, entry: Entry, now: float) -> None:
        """`entry` was used at `now`: the most recently used now."""
        if not entry.marker:
            self._sizes.discard(_size(entry))
        entry.last_used = now
        self._by_use.move_to_end(entry.key)
        if not entry.marker:
            self._sizes.add(_size(entry))

    def recount(self, entry: Entry, nfds_before: int, disk_before: int) -> None:
        """`entry` holds another number of descriptors than `nfds_before`, and takes another part of the disk
        than `disk_before` (its pieces were copied and its sources let go)."""
        self.nfds += entry.nfds - nfds_before
        self.disk_bytes += entry.disk_bytes - disk_before

    def dependents(self, key: str) -> list[str]:
        """The keys of the entries that build on `key`, directly or through others."""
        out: list[str] = []
        seen, stack = {key}, [key]
        while stack:
            for dependent in self._dependents.get(stack.pop(), ()):
                if dependent not in seen:
                    seen.add(dependent)
                    out.append(dependent)
                    stack.append(dependent)
        return out

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, entry: Entry, conn: ConnId, count: int = 1) -> None:
        entry.pins[conn] += count
        self._pinned.setdefault(conn, set()).add(entry.key)

    def unpin(self, entry: Entry, conn: ConnId, count: int = 1) -> None:
        if entry.pins[conn] > count:
            entry.pins[conn] -= count
            return
        del entry.pins[conn]
        self._forget_pin(conn, entry.key)

    def release(self, conn: ConnId) -> None:
        """Drop every pin of `conn` (its connection ended)."""
        for key in self._pinned.pop(conn, ()):
            entry = self._by_use.get(key)
            if entry is not None:
                entry.pins.pop(conn, None)

    def held_by_pins(self) -> set[str]:
        """Keys eviction passes over: pinned entries and every entry they build on."""
        held: set[str] = set()
        stack = [key for keys in self._pinned.values() for key in keys]
        while stack:
            key = stack.pop()
            entry = self._by_use.get(key)
            if entry is not None and key not in held:
                held.add(key)
                stack += entry.deps
        return held

    def _forget_pin(self, conn: ConnId, key: str) -> None:
        keys = self._pinned.get(conn)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._pinned[conn]

    # -- what the views see (Note [Status with many entries]) -------------------------------------

    def shown(self, limit: int) -> list[Entry]:
        """At most `limit` listed entries: the largest, up to half of them, largest first (of equal sizes,
        the most recently used first), then the most recently used of the others, most recent first.
        Every listed entry when there are no more."""
        largest = [self._by_use[key] for _, _, key in itertools.islice(self._sizes.descending(), limit // 2)]
        taken = {entry.key for entry in largest}
        recent: list[Entry] = []
        for entry in reversed(self._by_use.values()):
            if len(largest) + len(recent) >= limit:
                break
            if not entry.marker and entry.key not in taken:
                recent.append(entry)
        return largest + recent

    def page(self, after: str, limit: int) -> list[Entry]:
        """The listed entries whose keys sort after `after`, at most `limit`, in the order of their keys."""
        return [self._by_use[key] for key in itertools.islice(self._keys.following(after), limit)]

    def with_prefix(self, prefix: str, limit: int) -> list[str]:
        """The keys of listed entries that start with `prefix`, at most `limit`, in order."""
        keys = self._keys.following(prefix, inclusive=True)
        return list(itertools.islice(itertools.takewhile(lambda key: key.startswith(prefix), keys), limit))


def _size(entry: Entry) -> tuple[int, float, str]:
    """Where `entry` sorts by size: its bytes, then its last use, then its key."""
    return entry.nbytes, entry.last_used, entry.key


class _SortedChunks(Generic[T]):
    """A sorted list kept as sorted chunks (Note [Eviction in O(log n)]): `add` and `discard` take
    O(log n + CHUNK) whatever its length, where one list would move up to n pointers."""

    CHUNK = 256  # a chunk splits in two past 2 * CHUNK items, and joins its neighbour below CHUNK // 2

    def __init__(self) -> None:
        self._chunks: list[list[T]] = []
        self._lasts: list[T] = []  # each chunk's last item: which chunk an item belongs in

    def add(self, item: T) -> None:
        if not self._chunks:
            self._chunks.append([item])
            self._lasts.append(item)
            return
        i = min(bisect.bisect_left(self._lasts, item), len(self._chunks) - 1)
        chunk = self._chunks[i]
        bisect.insort(chunk, item)
        self._lasts[i] = chunk[-1]
        if len(chunk) > 2 * self.CHUNK:
            self._chunks[i:i + 1] = [chunk[:self.CHUNK], chunk[self.CHUNK:]]
            self._lasts[i:i + 1] = [chunk[self.CHUNK - 1], chunk[-1]]

    def discard(self, item: T) -> None:
        i = bisect.bisect_left(self._lasts, item)
        if i == len(self._chunks):
            return
        chunk = self._chunks[i]
        j = bisect.bisect_left(chunk, item)
        if j == len(chunk) or chunk[j] != item:
            return
        del chunk[j]
        if len(chunk) >= self.CHUNK // 2 or len(self._chunks) == 1:
            if chunk:
                self._lasts[i] = chunk[-1]
            else:
                del self._chunks[i], self._lasts[i]
            return
        k = i + 1 if i + 1 < len(self._chunks) else i - 1  # join a neighbour (then split if too long)
        first, second = min(i, k), max(i, k)
        joined = self._chunks[first] + self._chunks[second]
        self._chunks[first:second + 1] = [joined]
        self._lasts[first:second + 1] = [joined[-1]]
        if len(joined) > 2 * self.CHUNK:
            half = len(joined) // 2
            self._chunks[first:first + 1] = [joined[:half], joined[half:]]
            self._lasts[first:first + 1] = [joined[half - 1], joined[-1]]

    def following(self, item: T, *, inclusive: bool = False) -> Iterator[T]:
        """The items after `item` (or from it, `inclusive`), in order."""
        find = bisect.bisect_left if inclusive else bisect.bisect_right
        i = find(self._lasts, item)
        if i < len(self._chunks):
            chunk = self._chunks[i]
            yield from chunk[find(chunk, item):]
            for chunk in self._chunks[i + 1:]:
                yield from chunk

    def descending(self) -> Iterator[T]:
        for chunk in reversed(self._chunks):
            yield from reversed(chunk)
