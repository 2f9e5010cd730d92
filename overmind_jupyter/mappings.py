"""Which bytes of this process hold which cache entry: the registry of our private mappings, and what
/proc says about the rest of the address space.

# Note [Mapping registry]
Every private mapping this process made for an entry is recorded with its spans: an address range
and the entry's arena offset at its start. An arena mapping is one span (offset 0 at its start); a
mapping of a checkpoint file that an entry still refers to (Note [Atomic miss] in publishing.py) has a
span per piece of the entry it holds. `rebuild.pack` uses the registry to recognise storages that
already are an entry's bytes; `rebuild.rebuild` and `publishing.publish` add to it; a mapping leaves it
when its last storage dies (the finalizer of the mmap object). A span over a checkpoint file is
trusted only while the file is still the one the entry was made from (`SourceFile.intact`): a file
rewritten in place changes the unwritten pages of every private mapping of it.

Written pages come from /proc/self/pagemap: a page of a private file mapping that is present but no
longer a file page (or swapped out) was copied on write, so this process changed it.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernel_server import arena
from kernel_server.arena import SourceFile

__all__ = [
    "FileMapping",
    "Pin",
    "Span",
    "WrittenPages",
    "entry_of",
    "file_mapping_of",
    "find",
    "register",
    "span_of",
]


@dataclass(frozen=True)
class Span:
    start: int  # address
    end: int
    key: str  # the entry
    base: int  # the entry's arena offset at `start`
    source: SourceFile | None = field(default=None, compare=False)

    def offset(self, address: int) -> int:
        return self.base + address - self.start


class Pin:
    """One pin of an entry held by this process for a set of mappings: released (`on_release(key)`,
    which unpins it at the daemon) when the last of them is gone."""

    def __init__(self, key: str, on_release: Callable[[str], None]) -> None:
        self.key = key
        self._on_release = on_release
        self._count = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._count += 1

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._on_release(self.key)


_lock = threading.Lock()
_starts: list[int] = []
_spans: list[Span] = []
# entry key -> its live mappings: (mapping, offset in the mapping, length, arena offset)
_by_key: dict[str, list[tuple[weakref.ref[mmap.mmap], int, int, int]]] = {}


def address_of(mapping: mmap.mmap) -> int:
    import torch

    return int(torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr())


def register(mapping: mmap.mmap, key: str, pin: Pin | None, pieces: list[tuple[int, int, int]] | None = None,
             source: SourceFile | None = None) -> Callable[[], None]:
    """Record `mapping` as holding entry `key`: `pieces` are (offset in the mapping, length, arena
    offset), by default the whole mapping at arena offset 0. `pin` is held until the mapping dies;
    `source` is closed then. Returns a function that takes the record back at once (a publish that
    failed after mapping its arena)."""
    start = address_of(mapping)
    if pieces is None:
        pieces = [(0, len(mapping), 0)]
    spans = [Span(start + at, start + at + length, key, base, source) for at, length, base in pieces if length]
    ref = weakref.ref(mapping)
    records = [(ref, at, length, base) for at, length, base in pieces]
    with _lock:
        for span in spans:
            i = bisect.bisect(_starts, span.start)
            _starts.insert(i, span.start)
            _spans.insert(i, span)
        _by_key.setdefault(key, []).extend(records)
    if pin is not None:
        pin.hold()
    done = threading.Event()

    def forget() -> None:
        if done.is_set():
            return
        done.set()
        with _lock:
            for span in spans:
                i = bisect.bisect_left(_starts, span.start)
                while i < len(_spans) and _spans[i].start == span.start:
                    if _spans[i] is span:
                        del _starts[i]
                        del _spans[i]
                        break
                    i += 1
            mine = _by_key.get(key, [])
            mine[:] = [r for r in mine if r[0] is not ref]
            if not mine:
                _by_key.pop(key, None)
        if source is not None:
            source.close()
        if pin is not None:
            pin.release()

    weakref.finalize(mapping, forget)
    return forget


def span_of(address: int) -> Span | None:
    with _lock:
        i = bisect.bisect(_starts, address) - 1
        if i < 0:
            return None
        span = _spans[i]
    return span if span.start <= address < span.end else None


def entry_of(address: int) -> tuple[str, int] | None:
    """(entry key, arena offset) of an address inside a registered mapping."""
    span = span_of(address)
    return None if span is None else (span.key, span.offset(address))


def find(key: str, offset: int, nbytes: int) -> tuple[mmap.mmap, int] | None:
    """A live mapping of this process that holds bytes [offset, offset + nbytes) of entry `key`, and
    where in it they start."""
    with _lock:
        records = list(_by_key.get(key, []))
    for ref, at, length, base in records:
        m = ref()
        if m is not None and base <= offset and offset + nbytes <= base + length:
            return m, at + offset - base
    return None


class WrittenPages:
    """Which pages of address ranges this process wrote (private copies), read from /proc/self/pagemap
    once per range: present pages that are no longer the file's, and swapped ones."""

    def __init__(self) -> None:
        self._sums: dict[tuple[int, int], Any] = {}  # numpy arrays, or None for a range without a written page

    def any(self, start: int, end: int, address: int, nbytes: int) -> bool:
        """Whether a page of [address, address + nbytes), inside the range [start, end), was written."""
        try:
            sums = self._sums[(start, end)]
        except KeyError:
            import torch

            page = arena.PAGE
            first_page, last_page = start // page, (end + page - 1) // page
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                raw = os.pread(f.fileno(), (last_page - first_page) * 8, first_page * 8)
            entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
            present, swapped, file = (entries >> 63) & 1, (entries >> 62) & 1, (entries >> 61) & 1
            written = (present & (1 - file)) | swapped
            # numpy, not torch, for the lookups below: indexing a tensor costs ~20 us, an array ~0.1 us
            sums = torch.cat([torch.zeros(1, dtype=torch.int64), written.cumsum(0)]).numpy()
            sums = self._sums[(start, end)] = sums if sums[-1] else None
        if sums is None:
            return False
        base = start // arena.PAGE
        first = address // arena.PAGE - base
        last = (address + nbytes - 1) // arena.PAGE - base
        return bool(sums[last + 1] - sums[first])


@dataclass(frozen=True)
class FileMapping:
    """One line of /proc/self/maps that maps a file privately."""

    start: int
    end: int
    offset: int  # of `start` in the file
    dev: int
    ino: int
    path: str
    private: bool


class ProcessMaps:
    """/proc/self/maps, read once: which file (if any) backs an address."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._maps: list[FileMapping] = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[4] == "0":
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                self._starts.append(lo)
                self._maps.append(FileMapping(lo, hi, int(fields[2], 16), os.makedev(major, minor), int(fields[4]),
                                              fields[5].rstrip("\n"), fields[1].endswith("p")))

    def at(self, address: int) -> FileMapping | None:
        i = bisect.bisect(self._starts, address) - 1
        if i < 0:
            return None
        m = self._maps[i]
        return m if m.start <= address < m.end else None


def file_mapping_of(maps: ProcessMaps, written: WrittenPages, address: int, nbytes: int) -> FileMapping | None:
    """The private mapping of a named regular file that holds [address, address + nbytes) unwritten
    (so those bytes are the file's, as long as the file is not changed), or None."""
    m = maps.at(address)
    if (m is None or not m.private or address + nbytes > m.end or not m.path.startswith("/")
            or m.path.endswith(" (deleted)")):
        return None
    if written.any(m.start, m.end, address, nbytes):
        return None
    return m
