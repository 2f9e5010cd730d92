"""Which bytes of this process hold which cache entry: the registry of our private mappings, and what
/proc says about the rest of the address space.

# Note [Mapping registry]
Every private mapping this process made for an entry is recorded with its spans: an address range
and the entry's arena offset at its start. An arena mapping is one span (offset 0 at its start); a
mapping of a checkpoint file that an entry still refers to (Note [Atomic miss] in publishing.py) has a
span per piece of the entry it holds. `rebuild.pack` uses the registry to recognise storages that
already are an entry's bytes; `rebuild.rebuild` and `publishing.publish` add to it; a mapping leaves it
when its last storage dies (the finalizer of the mmap object), or else before the registry is next
asked or added to (Note [Cleanup that Ctrl-C cannot cut short]). A span over a checkpoint file is
trusted only while the file is still the one the entry was made from (`SourceFile.intact`): a file
rewritten in place changes the unwritten pages of every private mapping of it.

Written pages come from /proc/self/pagemap: a page of a private file mapping that is present but no
longer a file page (or swapped out) was copied on write, so this process changed it.

# Note [Finding file mappings]
A miss asks which file maps each storage it publishes (Note [Atomic miss] in publishing.py). Reading
/proc/self/maps has the kernel format every mapping of the process (a few thousand with torch
imported): 0.5-0.9 ms, each miss. The PROCMAP_QUERY ioctl of the same file (Linux 6.11) answers for one
address, with the same fields, in a few microseconds; the storages of a load lie in a few mappings, so
a miss asks a few times. The text is read where the kernel lacks the ioctl (ENOTTY, EINVAL) or cannot
name the file.

# Note [Finding written pages]
Asked of every storage a miss publishes and of every storage `pack` meets (Note [Atomic miss] in
publishing.py: a piece must be unwritten file bytes). Reading pagemap's 8 bytes a page for a 2.2 GB
checkpoint mapping, and summing them, took 67-85 ms (the kernel fills 4.3 MB for 537 k pages); the
PAGEMAP_SCAN ioctl of the same file (Linux 6.7) returns only the runs of pages that match "not a file
page, and present or swapped", 1.5-6 ms there, usually none. Both ask the same question of the same page
tables; the ioctl is used where the kernel has it, the read elsewhere (ENOTTY, EINVAL).

A checkpoint's mapping holds a span per piece, a few hundred, and `pack` asks about each storage it
meets. So the question is asked once per mapping (`Span.extent`: from its first span to the end of its
last), not once per span. The walk of the page tables is the cost, and one walk over the mapping costs
what the walks over its spans cost together. Asked span by span, a same-dtype 1.1B model's key
(`result_key`) opened pagemap 202 times and took 7.0-7.1 ms after its miss, 3.5-3.7 ms now; after a hit
whose pieces were pending, 8.0-9.1 ms, now 4.7 ms (benchmarks/RESULTS.md, "The key of a model passed to
a cached call").
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (no stubs: the C half of `signal`)
import bisect
import collections
import ctypes
import errno
import mmap
import operator
import os
import signal
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from kernel_server import arena
from kernel_server.arena import Part, SourceFile

__all__ = [
    "ArenaFile",
    "FileMapping",
    "Pin",
    "Span",
    "WrittenPages",
    "entry_of",
    "file_mapping_of",
    "finder",
    "finish_unmapped",
    "register",
    "span_of",
    "uninterrupted",
]

_T = TypeVar("_T")


@dataclass(frozen=True)
class ArenaFile:
    """A descriptor of an entry's arena, kept open beside this process's mapping of it for the device
    copier (Note [Device copies] in units/copier.py), whether the arena holds every byte of the entry
    (no pending pieces: Note [Pending pieces] in kernel_server/store.py), and its parts, the arena's
    ranges in files of their own (Note [Arena parts] in kernel_server/arena.py). All kept open here."""

    fd: int
    complete: bool
    parts: tuple[Part, ...] = ()

    def fds(self) -> list[int]:
        """The arena's descriptor, then its parts', as the copier takes them."""
        return [self.fd, *(p.fd for p in self.parts)]

    def dup(self) -> ArenaFile:
        return ArenaFile(os.dup(self.fd), self.complete, tuple(p.dup() for p in self.parts))

    def close(self) -> None:
        os.close(self.fd)
        for part in self.parts:
            part.close()


@dataclass(slots=True, eq=False)  # a miss makes one per piece, hundreds: a plain __init__
class Span:
    start: int  # address
    end: int
    key: str  # the entry
    base: int  # the entry's arena offset at `start`
    source: SourceFile | None = field(default=None, compare=False)
    arena: ArenaFile | None = field(default=None, compare=False)  # of an arena mapping, where kept
    # [first address, end] of all the spans of its mapping, one list they share: where to ask for
    # written pages, once for all of them (Note [Finding written pages])
    extent: list[int] = field(default_factory=lambda: [0, 0], compare=False)

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
             source: SourceFile | None = None, arena_file: ArenaFile | None = None,
             keep: list[Any] | None = None) -> Callable[[], None]:
    """Record `mapping` as holding entry `key`: `pieces` are (offset in the mapping, length, arena
    offset), by default the whole mapping at arena offset 0. `pin` is held until the mapping dies;
    `source` and `arena_file` (a mapping of the entry's arena: its descriptor) are closed then, and
    `keep` is emptied. Returns a function that takes the record back at once (a publish that failed
    after mapping its arena). Runs whole, SIGINT held (Note [Cleanup that Ctrl-C cannot cut short]): a
    Ctrl-C between the finalizer made here and the pin held would have the finalizer release a pin never
    held, and the entry stay pinned."""
    return uninterrupted(_register, mapping, key, pin, pieces, source, arena_file, keep)


def _register(mapping: mmap.mmap, key: str, pin: Pin | None, pieces: list[tuple[int, int, int]] | None,
              source: SourceFile | None, arena_file: ArenaFile | None,
              keep: list[Any] | None) -> Callable[[], None]:
    if _unmapped:  # the spans of dead mappings out first: their addresses may be this one's
        finish_unmapped()
    start = address_of(mapping)
    if pieces is None:
        pieces = [(0, len(mapping), 0)]
    extent = [start, start]  # all its spans share it, filled in once they are sorted
    spans = sorted((Span(start + at, start + at + length, key, base, source, arena_file, extent)
                    for at, length, base in pieces if length), key=_start_of)
    if spans:
        extent[:] = spans[0].start, max(map(_end_of, spans))
    cleanup = _Cleanup(key, spans, pin, source, arena_file, keep)
    finalizer = weakref.finalize(mapping, _collect, cleanup)
    # after the finalizer: its callback is called before the finalizer's (Note [Cleanup that Ctrl-C
    # cannot cut short])
    ref = cleanup.ref = _Dying(mapping, _unmapped.append)
    ref.cleanup = cleanup
    records = [(ref, at, length, base) for at, length, base in pieces]
    with _lock:
        i = bisect.bisect(_starts, start)
        if not spans or i == len(_starts) or spans[-1].start <= _starts[i]:
            # in one place: no other mapping's span starts inside this mapping, whose addresses are its
            # own until it is unmapped, and a dead mapping's spans are gone (above)
            _starts[i:i] = [span.start for span in spans]
            _spans[i:i] = spans
        else:  # (a mapping closed by hand, its spans still here: each span where it sorts)
            for span in spans:
                i = bisect.bisect(_starts, span.start)
                _starts.insert(i, span.start)
                _spans.insert(i, span)
        _by_key.setdefault(key, []).extend(records)
    if pin is not None:
        pin.hold()
    return finalizer


class _Dying(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a registered mapping, with what its death leaves to do."""

    __slots__ = ("cleanup",)
    cleanup: _Cleanup


@dataclass(slots=True, eq=False)
class _Cleanup:
    """What a registered mapping's death leaves to do, done once (Note [Cleanup that Ctrl-C cannot cut
    short]): its spans and records out of the registry, `source` and `arena_file` closed, `keep` emptied,
    `pin` released."""

    key: str
    spans: list[Span]
    pin: Pin | None
    source: SourceFile | None
    arena_file: ArenaFile | None
    keep: list[Any] | None
    ref: _Dying | None = None
    done: bool = False

    def finish(self) -> None:
        with _lock:
            if self.done:
                return
            self.done = True
            for span in self.spans:
                i = bisect.bisect_left(_starts, span.start)
                while i < len(_spans) and _spans[i].start == span.start:
                    if _spans[i] is span:
                        del _starts[i]
                        del _spans[i]
                        break
                    i += 1
            mine = _by_key.get(self.key, [])
            mine[:] = [r for r in mine if r[0] is not self.ref]
            if not mine:
                _by_key.pop(self.key, None)
        try:
            if self.source is not None:
                self.source.close()
            if self.arena_file is not None:
                self.arena_file.close()
        finally:
            try:
                if self.keep is not None:
                    self.keep.clear()
            finally:
                if self.pin is not None:
                    self.pin.release()


# Note [Cleanup that Ctrl-C cannot cut short]
# A registered mapping's death leaves work to do: its spans out of the registry, its descriptors closed
# (an arena's descriptor keeps the memory of an entry the daemon evicted), what it kept let go of, and its
# pin released, which unpins the entry at the daemon (a pinned entry is never evicted for the budget).
# That work runs in the mapping's finalizer, on the thread that let go of the last storage over it: in a
# notebook, the main thread, where a Ctrl-C is raised as KeyboardInterrupt at almost any instruction.
# One raised in a finalizer cannot reach the cell (Python prints "Exception ignored" and goes on), and it
# cut the work short for good: a kernel that re-ran `m = from_pretrained(...)` (a hit that frees the model
# before) under Ctrl-C kept entries pinned and descriptors open, 67 -> 77 after 40 interrupted runs. So:
# - A mapping's death is recorded by C code, which a signal cannot interrupt: a weak reference whose
#   callback is `_unmapped.append`, made after the finalizer so that it is called first (the callbacks
#   of an object's weak references run newest first). What the finalizer did not finish, because a
#   Ctrl-C landed before its first step, is finished by the next sweep (`finish_unmapped`): at each
#   cached call, after each cell, at `status`, and before the registry is asked (`span_of`) or added to
#   (`register`), whose dead spans' addresses may be another mapping's by then. While nothing waits, a
#   sweep is a deque's truth test.
# - The work itself runs with SIGINT held on the main thread (`_hold_interrupts`: its Python handler
#   records the Ctrl-C instead of raising it), from its first step to its last; a Ctrl-C that lands
#   before the hold has done nothing yet, and one after it finds the work done. Each mapping's work is
#   claimed once (`_Cleanup.done`), so no step runs twice (a pin released twice would unpin another
#   holder's pin; a descriptor closed twice, a file opened since).
# - The Ctrl-C held is raised once the work is done where that reaches the user (a sweep, in the cell's
#   call); in a finalizer, where it cannot, it is warned of, and the user interrupts again.

_unmapped: collections.deque[_Dying] = collections.deque()  # mappings dead, their cleanup perhaps unfinished
_interrupted = False  # a Ctrl-C came while SIGINT was held


def _record_interrupt(signum: int, frame: Any) -> None:
    global _interrupted
    _interrupted = True


def _hold_interrupts() -> Any:
    """Hold SIGINT: on the main thread (the only one a Ctrl-C is raised in), its Python handler now
    records it (Note [Cleanup that Ctrl-C cannot cut short]). Returns the handler to put back, None where
    nothing was changed: another thread, SIGINT held already (a finalizer inside a sweep), or a handler
    that raises nothing (ignored, the default's end of the process, or one not set from Python)."""
    global _interrupted
    # (`_signal`'s functions, not `signal`'s wrappers of them: a hit holds SIGINT a few times, and each
    # wrapper's enum conversions are Python calls)
    old = _signal.getsignal(signal.SIGINT)
    if old is _record_interrupt or not callable(old) or threading.get_ident() != threading.main_thread().ident:
        return None
    _interrupted = False
    _signal.signal(signal.SIGINT, _record_interrupt)  # last: from here on, a Ctrl-C is recorded
    return old


def _put_back_interrupts(old: Any) -> bool:
    """Put back what `_hold_interrupts` replaced; whether a Ctrl-C came meanwhile."""
    if old is None:
        return False
    _signal.signal(signal.SIGINT, old)
    return _interrupted


def _finish_unmapped() -> None:
    while True:
        try:
            dead = _unmapped.popleft()
        except IndexError:
            return
        dead.cleanup.finish()


def _collect(cleanup: _Cleanup) -> None:
    """The finalizer of a registered mapping (Note [Cleanup that Ctrl-C cannot cut short])."""
    old = _hold_interrupts()
    try:
        cleanup.finish()
        _finish_unmapped()
    finally:
        interrupted = _put_back_interrupts(old)
    if interrupted:
        from . import notices

        notices.tell("overmind: a Ctrl-C came while this kernel let go of a model from the cache, inside a "
                     "finalizer, where Python cannot raise it: the cell went on. Interrupt again to stop it.")


def uninterrupted(work: Callable[..., _T], *args: Any) -> _T:
    """`work(*args)` with SIGINT held from its first step to its last (Note [Cleanup that Ctrl-C cannot cut
    short]); a Ctrl-C that came meanwhile is raised after, as KeyboardInterrupt. A Ctrl-C can still land
    before the hold, in this call's first instructions, with nothing of `work` done."""
    old = _hold_interrupts()
    try:
        return work(*args)
    finally:
        if _put_back_interrupts(old):
            raise KeyboardInterrupt


def finish_unmapped() -> None:
    """Finish what the finalizers of dead mappings left undone, a Ctrl-C having landed in one first (Note
    [Cleanup that Ctrl-C cannot cut short]): at each cached call, after each cell, at `status`. Raises
    KeyboardInterrupt for a Ctrl-C that came meanwhile, once the work is done."""
    if not _unmapped:
        return
    old = _hold_interrupts()
    try:
        _finish_unmapped()
    finally:
        interrupted = _put_back_interrupts(old)
    if interrupted:
        raise KeyboardInterrupt


_start_of = operator.attrgetter("start")
_end_of = operator.attrgetter("end")
_base_of = operator.itemgetter(3)  # of a record: (mapping, offset in it, length, arena offset)


def span_of(address: int) -> Span | None:
    if not _starts:  # (a process's first miss: nothing to look up, nor a lock to take)
        return None
    if _unmapped:  # a dead mapping's spans, whose addresses another mapping may have now
        finish_unmapped()
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


def finder(key: str) -> Callable[[int, int], tuple[mmap.mmap, int] | None]:
    """`find(offset, nbytes)`: a live mapping of this process that holds bytes [offset, offset + nbytes)
    of entry `key`, and where in it they start. The records of the entry's mappings are taken once and
    sorted by arena offset, for a skeleton that asks for every storage of its graph: a checkpoint's
    mapping has a record per piece, and one look through them all per storage took 2 ms of a 1.1B
    model's skeleton. Of the records that hold the bytes, the one that starts nearest below them
    answers: a pending piece's file rather than the arena around it."""
    with _lock:
        records = sorted(_by_key.get(key, []), key=_base_of)
    bases = [base for _, _, _, base in records]

    def find(offset: int, nbytes: int) -> tuple[mmap.mmap, int] | None:
        for i in range(bisect.bisect_right(bases, offset) - 1, -1, -1):
            ref, at, length, base = records[i]
            m = ref() if offset + nbytes <= base + length else None
            if m is not None:
                return m, at + offset - base
        return None

    return find


class _ScanArg(ctypes.Structure):
    """struct pm_scan_arg (linux/fs.h)."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages", "category_inverted",
        "category_mask", "category_anyof_mask", "return_mask")]


class _Region(ctypes.Structure):
    """struct page_region (linux/fs.h)."""

    _fields_ = [(name, ctypes.c_uint64) for name in ("start", "end", "categories")]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, ...)
_PAGE_IS_FILE, _PAGE_IS_PRESENT, _PAGE_IS_SWAPPED = 1 << 2, 1 << 3, 1 << 4
_SCAN_REGIONS = 256
_libc = ctypes.CDLL(None, use_errno=True)
_scan_works = True  # until the kernel says it has no PAGEMAP_SCAN
_NO_SUCH_IOCTL = (errno.ENOTTY, errno.EINVAL)  # what a kernel older than an ioctl answers


def _scan_written(fd: int, start: int, end: int) -> list[tuple[int, int]] | None:
    """The runs [start, end) of pages of [start, end) this process wrote (present and not a file page,
    or swapped), by PAGEMAP_SCAN on /proc/self/pagemap's `fd`; None where the kernel lacks it (Note
    [Finding written pages])."""
    global _scan_works
    regions = (_Region * _SCAN_REGIONS)()
    found: list[tuple[int, int]] = []
    at = start
    while _scan_works and at < end:
        arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=at, end=end, vec=ctypes.addressof(regions),
                       vec_len=_SCAN_REGIONS, category_inverted=_PAGE_IS_FILE, category_mask=_PAGE_IS_FILE,
                       category_anyof_mask=_PAGE_IS_PRESENT | _PAGE_IS_SWAPPED, return_mask=_PAGE_IS_PRESENT)
        count = _libc.ioctl(fd, _PAGEMAP_SCAN, ctypes.byref(arg))
        if count < 0:
            if ctypes.get_errno() in _NO_SUCH_IOCTL:  # a kernel before 6.7
                _scan_works = False
                return None
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        found.extend((regions[i].start, regions[i].end) for i in range(count))
        if arg.walk_end <= at:
            raise OSError(f"PAGEMAP_SCAN made no progress at {at:#x}")
        at = arg.walk_end
    return found if _scan_works else None


class WrittenPages:
    """Which pages of address ranges this process wrote (private copies), asked of the kernel once per
    range: present pages that are no longer the file's, and swapped ones (Note [Finding written pages])."""

    def __init__(self) -> None:
        # per range: the runs of written pages (starts, ends) from PAGEMAP_SCAN, or numpy cumulative
        # sums of pagemap's entries; None for a range without a written page
        self._runs: dict[tuple[int, int], tuple[list[int], list[int]] | None] = {}
        self._sums: dict[tuple[int, int], Any] = {}

    def any(self, start: int, end: int, address: int, nbytes: int) -> bool:
        """Whether a page of [address, address + nbytes), inside the range [start, end), was written."""
        key = (start, end)
        if key not in self._runs and key not in self._sums:
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                runs = _scan_written(f.fileno(), start // arena.PAGE * arena.PAGE, end) if _scan_works else None
                if runs is not None:
                    self._runs[key] = ([a for a, _ in runs], [b for _, b in runs]) if runs else None
                else:
                    self._sums[key] = self._read_sums(f.fileno(), start, end)
        if key in self._runs:
            found = self._runs[key]
            if found is None:
                return False
            starts, ends = found
            # the first run that ends after `address`: written if it begins before the range's end
            i = bisect.bisect_right(ends, address)
            return i < len(starts) and starts[i] < address + nbytes
        sums = self._sums[key]
        if sums is None:
            return False
        base = start // arena.PAGE
        first = address // arena.PAGE - base
        last = (address + nbytes - 1) // arena.PAGE - base
        return bool(sums[last + 1] - sums[first])

    @staticmethod
    def _read_sums(fd: int, start: int, end: int) -> Any:
        """Cumulative counts of the written pages of [start, end) from pagemap's entries (numpy), or None."""
        import torch

        page = arena.PAGE
        first_page, last_page = start // page, (end + page - 1) // page
        raw = os.pread(fd, (last_page - first_page) * 8, first_page * 8)
        entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
        present, swapped, file = (entries >> 63) & 1, (entries >> 62) & 1, (entries >> 61) & 1
        written = (present & (1 - file)) | swapped
        # numpy, not torch, for the lookups: indexing a tensor costs ~20 us, an array ~0.1 us
        sums = torch.cat([torch.zeros(1, dtype=torch.int64), written.cumsum(0)]).numpy()
        return sums if sums[-1] else None


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


class _Query(ctypes.Structure):
    """struct procmap_query (linux/fs.h, Linux 6.11)."""

    _fields_ = [*((name, ctypes.c_uint64) for name in (
        "size", "query_flags", "query_addr", "vma_start", "vma_end", "vma_flags", "vma_page_size", "vma_offset",
        "inode")), *((name, ctypes.c_uint32) for name in ("dev_major", "dev_minor", "vma_name_size", "build_id_size")),
        ("vma_name_addr", ctypes.c_uint64), ("build_id_addr", ctypes.c_uint64)]


_PROCMAP_QUERY = (3 << 30) | (ctypes.sizeof(_Query) << 16) | (ord("f") << 8) | 17  # _IOWR('f', 17, ...)
_VMA_SHARED = 0x08
_NAME_BYTES = 4096 + 64  # a path (PATH_MAX) and " (deleted)"
_query_works = True  # until the kernel says it has no PROCMAP_QUERY


def query_mapping(address: int) -> FileMapping | Literal[False] | None:
    """The mapping of a named file that holds `address`, asked of the kernel by the PROCMAP_QUERY ioctl
    of /proc/self/maps: None where no file is mapped there, False where the kernel lacks the ioctl or
    cannot name the file (Note [Finding file mappings])."""
    global _query_works
    if not _query_works:
        return False
    name = ctypes.create_string_buffer(_NAME_BYTES)
    query = _Query(size=ctypes.sizeof(_Query), query_addr=address, vma_name_size=_NAME_BYTES,
                   vma_name_addr=ctypes.addressof(name))
    fd = os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC)
    try:
        failed = _libc.ioctl(fd, _PROCMAP_QUERY, ctypes.byref(query)) < 0
        error = ctypes.get_errno()
    finally:
        os.close(fd)
    if failed:
        if error == errno.ENOENT:  # nothing mapped there
            return None
        if error in _NO_SUCH_IOCTL:  # a kernel before 6.11
            _query_works = False
        return False
    if not query.inode:
        return None
    return FileMapping(query.vma_start, query.vma_end, query.vma_offset, os.makedev(query.dev_major, query.dev_minor),
                       query.inode, name.value.decode(errors="surrogateescape"), not query.vma_flags & _VMA_SHARED)


class ProcessMaps:
    """Which file (if any) backs an address, as the kernel says once asked (Note [Finding file mappings]):
    by PROCMAP_QUERY, or else from /proc/self/maps read once, a line parsed only when an address falls in
    it (a process with torch imported has a few thousand lines, a miss asks of tens). `known`: mappings
    whose place and file this process knows already (Note [Files the load maps] in load_maps.py)."""

    def __init__(self, known: Sequence[FileMapping] = ()) -> None:
        # what the kernel answered so far (a miss's storages share few), and the mappings known already
        self._found: list[FileMapping] = list(known)
        self._lines: list[str] | None = None
        self._starts: list[int] = []
        self._parsed: dict[int, FileMapping | None] = {}

    def at(self, address: int) -> FileMapping | None:
        for m in self._found:
            if m.start <= address < m.end:
                return m
        if self._lines is None:
            found = query_mapping(address)
            if found is not False:
                if found is not None:
                    self._found.append(found)
                return found
            self._read()
        return self._from_text(address)

    def _read(self) -> None:
        with open("/proc/self/maps") as f:
            self._lines = f.read().splitlines()
        self._starts = [int(line[:line.index("-")], 16) for line in self._lines]  # sorted, as the kernel lists

    def _from_text(self, address: int) -> FileMapping | None:
        assert self._lines is not None
        i = bisect.bisect(self._starts, address) - 1
        if i < 0:
            return None
        if i not in self._parsed:
            self._parsed[i] = self._parse(self._lines[i])
        m = self._parsed[i]
        return m if m is not None and m.start <= address < m.end else None

    @classmethod
    def read(cls, address: int) -> FileMapping | None:
        """What /proc/self/maps says of `address`, read now (the way of kernels without PROCMAP_QUERY)."""
        maps = cls()
        maps._read()
        return maps._from_text(address)

    @staticmethod
    def _parse(line: str) -> FileMapping | None:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[4] == "0":
            return None
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        major, minor = (int(x, 16) for x in fields[3].split(":"))
        return FileMapping(lo, hi, int(fields[2], 16), os.makedev(major, minor), int(fields[4]), fields[5],
                           fields[1].endswith("p"))


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
