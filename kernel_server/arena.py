"""Arenas: sealed memory files that hold the tensor bytes (and the pickled graph) of a cache entry.

# Note [Copy-on-write mappings]
An arena is written once, by pwrite (or through a shared mapping that the writer drops) before it
is sealed (F_SEAL_WRITE refuses every later shared writable mapping and write()). Readers map it MAP_PRIVATE:
a page a reader writes to (`add_`, `load_state_dict`, an optimizer step) is copied into that process
alone, so no in-place write is ever seen by another kernel or by a later hit (docs/design.md invariant 3).
Never MAP_POPULATE a private mapping: the kernel write-faults every page of a writable private
mapping and so copies all of it. Populate with MADV_POPULATE_READ instead, which maps the shared
pages read-only.

Two backings exist (Note [Arena backing]): a memfd (shmem pages), and an unnamed O_TMPFILE file on a
disk filesystem (page-cache pages). Only the memfd can be sealed; the file is never named, so only
descriptors reach it. How each is filled: Note [Filling an arena].

# Note [Arena backing]
Chosen by measuring call + first forward of a hit (benchmarks/RESULTS.md). shmem pages are 4 KiB
where `shmem_enabled` is "never" (the usual default), so the first forward of a 1.1B model takes a
page fault per 4 KiB; a disk file's page cache gets large folios and MADV_POPULATE_READ maps them in
milliseconds. "auto" therefore takes a file in `arena_directory()` when that is on a disk filesystem
that supports O_TMPFILE, else a memfd. The file's dirty pages are written back to disk once (they
become clean page cache the kernel may drop and read back under memory pressure) and the blocks are
freed when the last descriptor closes. Except for a miss that converts dtypes in transformers' loader:
its weights are written into a memfd as the load converts them, since gigabytes written into a disk
file's page cache throttle the writer at the kernel's dirty limit (Note [Staged conversions] in
overmind_jupyter/staging.py). Which backing a miss gets depends on that alone, not on what the process
loaded before.

# Note [Filling an arena]
A kernel fills a new arena inside the loading call, before the call returns (Note [Atomic miss] in
overmind_jupyter/publishing.py). A memfd is filled with pwrite (one copy, no page fault), and so is a
file arena that takes one chunk (64 MiB) or less: the first write faults of a fresh shared mapping of a
file cost about 10 ms each here (a same-dtype 1.1B miss copies a few KiB of buffers, and spent 34 ms
there). A larger file arena is filled by `copy_from`: its blocks are reserved first (fallocate,
milliseconds), then threads copy into a shared mapping advised MADV_HUGEPAGE. What a fill costs on these
VMs is the first touch of the arena's fresh pages, not the copy: pwrite holds the file's lock, so only a
mapping lets two threads touch pages at once; the advice makes each fault allocate a 2 MiB folio, which
a hit later maps whole; and `copy_from` hands each piece back as soon as it is copied (`done`), so that
the caller can free the piece's source and the next pieces land on pages freed a moment before. The
reservation matters: a write fault in a shared mapping of a full disk is a SIGBUS, where fallocate
reports ENOSPC and the load falls back. The daemon fills the arenas it compacts the same way, from the
checkpoint files (kernel_server/compaction.py).

# Note [Arena parts]
An arena may come in several files: the arena's own, and *parts*, each a file of its own that holds one
range of the arena's bytes ([offset, offset + nbytes) of the arena is [0, nbytes) of the part), sealed as
the arena is, while the arena's own file has a hole there. A converting miss makes them: each converting
thread writes into a file of its own, since threads writing into one memfd wait for its lock (Note
[Staged conversions] in overmind_jupyter/staging.py). Whoever maps an entry maps its arena whole and then
each part over its range (`map_private`: MAP_FIXED on the same addresses), so that every reader still
sees one mapping with every byte at its arena offset; the compactor reads the parts where they lie
(kernel_server/compaction.py), and the device copier maps them as a kernel does (overmind_jupyter/units/
copier.py). The daemon holds a part's descriptor as it holds the arena's, and counts it (Note [Descriptor
budget] in descriptors.py); a publish's parts are checked as its arena is (`check_sealed`), and lie
inside the arena, page-aligned, apart from each other and from its pending pieces.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import functools
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import helper_threads, settings

__all__ = [
    "PAGE",
    "ArenaWriter",
    "Part",
    "SourceFile",
    "align",
    "arena_directory",
    "check_sealed",
    "choose_backing",
    "file_identity",
    "map_private",
    "populate",
    "read_all",
]

PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # Linux 5.14; not exported by the mmap module
_POPULATE_CHUNK = 16 << 20
_COPY_CHUNK = 64 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FIXED = 0x10
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}


def _filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` is on, from /proc/self/mountinfo (longest mount point); read once
    per path and device (a filesystem mounted over `path` since gives it another device)."""
    try:
        device = os.stat(path).st_dev
    except OSError:
        device = -1
    return _filesystem_at(str(path), device)


@functools.lru_cache(maxsize=64)
def _filesystem_at(path: str, device: int) -> str:
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                point, fstype = fields[4], fields[fields.index("-") + 1]
                if "\\" in point:  # "\040" is a space
                    point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), point)
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fstype
    except (OSError, ValueError, IndexError):
        return ""
    return kind


def arena_directory(state_dir: str | os.PathLike[str]) -> Path:
    """Where "file" arenas live: OVERMIND_ARENA_DIR, else the state directory when it is on a disk
    filesystem, else ~/.cache/overmind/arenas (a state directory under $XDG_RUNTIME_DIR is a tmpfs)."""
    configured = settings.get(settings.ARENA_DIR)
    if configured:
        return Path(configured)
    state = Path(os.path.realpath(state_dir))
    if _filesystem_of(state) not in _MEMORY_FILESYSTEMS:
        return state
    return Path.home() / ".cache" / "overmind" / "arenas"


def choose_backing(backing: str, directory: Path) -> str:
    """Resolve "auto" (Note [Arena backing]) for `directory`; "memfd" and "file" are taken as they are.
    A file that cannot be made there after all (no O_TMPFILE, a full disk) is the caller's to handle."""
    if backing != "auto":
        return backing
    return "memfd" if _filesystem_of(Path(os.path.realpath(directory))) in _MEMORY_FILESYSTEMS else "file"


def file_identity(st: os.stat_result) -> dict[str, int]:
    """What names one version of a file: a file rewritten in any way, even with its size and mtime
    restored, has another ctime (which no user can set back), or another inode if it was replaced."""
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


@dataclass(eq=False)
class SourceFile:
    """A checkpoint file that pieces of an entry still lie in (Note [Pending pieces] in store.py): a
    read-only descriptor of it, owned by its holder, and the identity it had when the entry was made."""

    fd: int
    identity: dict[str, int]
    path: str = ""

    def intact(self) -> bool:
        """Whether the file is still that version: a file changed in any way is not."""
        try:
            return file_identity(os.fstat(self.fd)) == self.identity
        except OSError:
            return False

    def dup(self) -> SourceFile:
        return SourceFile(os.dup(self.fd), dict(self.identity), self.path)

    def describe(self) -> dict[str, object]:
        return {"path": self.path, **self.identity}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(eq=False)
class Part:
    """A range of an entry's arena held by a file of its own (Note [Arena parts]): bytes [offset, offset +
    nbytes) of the arena are bytes [0, nbytes) of `fd`, a descriptor owned by its holder."""

    fd: int
    offset: int
    nbytes: int

    def dup(self) -> Part:
        return Part(os.dup(self.fd), self.offset, self.nbytes)

    def describe(self) -> list[int]:
        return [self.offset, self.nbytes]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def check_parts(parts: list[Part], arena_bytes: int) -> None:
    """Parts received from a client: page-aligned, inside the arena, apart. Raises ValueError."""
    end = 0
    for part in sorted(parts, key=lambda p: p.offset):
        if (part.offset % PAGE or part.nbytes % PAGE or part.nbytes <= 0 or part.offset < end
                or part.offset + part.nbytes > arena_bytes):
            raise ValueError(f"part {part.describe()} is not whole pages, or overlaps another, or lies outside "
                             f"the arena ({arena_bytes} bytes)")
        end = part.offset + part.nbytes


def align(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


class ArenaWriter:
    """A new arena of `nbytes`: fill it with `write` (or through `view`), then `seal()` and hand `fd` over.

    Args:
        nbytes: size of the file; a multiple of PAGE is best.
        name: shows in /proc/<pid>/fd of every holder, for debugging.
        backing: "memfd" (sealed shmem) or "file" (an unnamed file in `directory`).
        directory: where a "file" arena lives (`arena_directory()`).
    """

    def __init__(self, nbytes: int, *, name: str = "overmind", backing: str = "memfd",
                 directory: str | os.PathLike[str] | None = None) -> None:
        self.nbytes = nbytes
        self.backing = backing
        self._map: mmap.mmap | None = None
        if backing == "memfd":
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        elif backing == "file":
            if directory is None:
                raise ValueError("a file arena needs a directory")
            self.fd = os.open(Path(directory), os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        else:
            raise ValueError(f"unknown arena backing {backing!r}: use 'memfd' or 'file'")
        try:
            if nbytes:
                os.ftruncate(self.fd, nbytes)  # `copy_from` reserves a file's blocks before it fills it
        except BaseException:
            os.close(self.fd)
            raise

    # C901 counts its closures (step, helper, report) in; they share the copy's queues and counters
    def copy_from(self, pieces: list[tuple[int, int, int]], *, threads: int = 1,  # noqa: C901
                  done: Callable[[int], None] | None = None, progress: Callable[[int], None] | None = None,
                  chunk: int = _COPY_CHUNK) -> None:
        """Copy `pieces` of this process's memory, each (offset in the arena, address, length), into a
        file arena, `chunk` bytes at a time, from the calling thread and up to `threads - 1` helpers,
        none for a copy of one chunk or less (Note [Filling an arena]). `done(i)` runs in the calling
        thread once piece i is copied whole, and `progress(n)` after each n bytes. Raises OSError (a
        full disk: nothing was written)."""
        if self.backing != "file":
            raise ValueError("copy_from fills file arenas; write a memfd with `write`")
        for offset, _, length in pieces:
            if offset < 0 or length < 0 or offset + length > self.nbytes:
                raise ValueError(f"piece {offset}+{length} lies outside the arena ({self.nbytes} bytes)")
        jobs = collections.deque((i, offset + at, address + at, min(chunk, length - at))
                                 for i, (offset, address, length) in enumerate(pieces)
                                 for at in range(0, length, chunk))
        left = [0] * len(pieces)
        for i, *_ in jobs:
            left[i] += 1
        finished = collections.deque(i for i, (_, _, length) in enumerate(pieces) if not length)
        if jobs:
            os.posix_fallocate(self.fd, 0, self.nbytes)
            if self._map is None:
                self._map = mmap.mmap(self.fd, self.nbytes)
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):
                pass  # no transparent huge pages here: 4 KiB folios, still correct
        base = _address_of(self._map) if self._map is not None and jobs else 0
        lock = threading.Condition()
        copied: list[int] = []
        errors: list[BaseException] = []
        copying = 0  # chunks being copied at this moment, by any thread
        stopping = False

        def step() -> bool:
            nonlocal copying
            with lock:
                if stopping or not jobs:
                    return False
                i, offset, address, length = jobs.popleft()
                copying += 1
            try:
                ctypes.memmove(base + offset, address, length)  # releases the GIL
            finally:
                with lock:
                    copying -= 1
                    lock.notify_all()
            with lock:
                copied.append(length)
                left[i] -= 1
                if not left[i]:
                    finished.append(i)
            return True

        def helper() -> None:
            try:
                while not errors and step():
                    pass
            except BaseException as exc:  # noqa: BLE001 (re-raised in the calling thread)
                errors.append(exc)

        def report() -> None:
            while finished:
                i = finished.popleft()
                if done is not None:
                    done(i)
            if progress is not None and copied:
                with lock:
                    n, copied[:] = sum(copied), []
                progress(n)

        # A helper shares more than one chunk's work; a smaller copy costs less than starting a thread.
        work = -(-sum(length for _, _, length in pieces) // chunk)
        helpers: list[threading.Thread] = []
        try:
            for _ in range(min(threads, len(jobs), work) - 1):
                h = helper_threads.start(helper, name="overmind-fill")
                if h is not None:  # (a helper the OS refuses leaves its share to the others and this thread)
                    helpers.append(h)
            while not errors and step():
                report()
            for h in helpers:
                h.join()
        except BaseException:
            # Note [An interrupted fill]
            with lock:
                stopping = True
            _uninterrupted(lambda: _wait_for(lock, lambda: not copying))
            raise
        if errors:
            raise errors[0]
        report()

    def write(self, offset: int, data: memoryview | bytes) -> None:
        """Write `data` at `offset` (pwrite: one copy, the GIL released, no page faults)."""
        view = memoryview(data).cast("B")
        while view:
            done = os.pwrite(self.fd, view, offset)
            view, offset = view[done:], offset + done

    @property
    def view(self) -> memoryview:
        """A writable shared mapping of the whole arena (made on first use; `seal` drops it). For small
        arenas: a write through it to a full disk is a SIGBUS where `write` raises ENOSPC."""
        if not self.nbytes:
            return memoryview(b"")
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.nbytes)
        return memoryview(self._map)

    def seal(self) -> int:
        """Drop the writable mapping and seal the file; returns the descriptor (still owned here).

        A file cannot be sealed: it is reopened read-only instead and the writable descriptor closed,
        so that no holder of the arena (the daemon, a kernel on a hit) has a way to write to it."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.backing == "memfd":
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        else:
            read_only = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            os.close(self.fd)
            self.fd = read_only
        return self.fd

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # exported views still alive; the mapping goes with them
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def check_sealed(fd: int, nbytes: int) -> str:
    """Validate an arena received from a client; return its backing. Raises ValueError."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("descriptor is not a regular file")
    if st.st_size != nbytes:
        raise ValueError(f"arena has {st.st_size} bytes, {nbytes} were announced")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = None  # not a memfd
    if seals is None or (seals & fcntl.F_SEAL_SEAL and not seals & fcntl.F_SEAL_WRITE):
        # Not a memfd, or a file that can never be sealed: an O_TMPFILE file on a tmpfs (such as
        # $XDG_RUNTIME_DIR) is shmem too, born with F_SEAL_SEAL alone.
        if st.st_nlink != 0:
            raise ValueError("a file arena must be unnamed (O_TMPFILE)")
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
            raise ValueError("a file arena must be passed read-only")
        return "file"
    if seals & _SEALS != _SEALS:
        raise ValueError("memfd arena is not sealed against writes")
    return "memfd"


# Note [An interrupted fill]
# A Ctrl-C in the kernel, or any exception, can end `copy_from` while its helpers still copy: in a
# join, in a callback, or in the middle of starting them. Its caller then unmaps the arena and frees
# the sources (the load's tensors), and a helper's copy into or out of them was a segfault, which kills
# the kernel (found by interrupting misses at random moments: 1 in about 10). So whatever ends the copy
# first stops the helpers from taking another chunk, then waits for the chunks being copied, of any
# thread, started or not, and a second Ctrl-C meanwhile waits too (a chunk takes tens of ms).
def _wait_for(lock: threading.Condition, done: Callable[[], bool]) -> None:
    with lock:
        while not done():
            lock.wait()


def _uninterrupted(wait: Callable[[], None]) -> None:
    """`wait()`, run again after each KeyboardInterrupt until it returns; those interrupts are dropped
    (the caller is raising already)."""
    while True:
        try:
            wait()
            return
        except KeyboardInterrupt:
            continue


def _address_of(mapping: mmap.mmap) -> int:
    """The address of a writable mapping; valid while it stays open."""
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # an export left alive would make the mapping's close() fail


def map_private(fd: int, nbytes: int, offset: int = 0, parts: Sequence[Part] = ()) -> mmap.mmap:
    """Map `nbytes` of an arena from `offset` (a multiple of PAGE) copy-on-write (see Note
    [Copy-on-write mappings]); `parts` (with offset 0 only) are mapped over their ranges (Note [Arena
    parts]). Raises OSError, ValueError."""
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    if parts:
        try:
            if offset:
                raise ValueError("an arena with parts is mapped whole")
            base = _address_of(m)
            for part in parts:
                if part.offset + part.nbytes > nbytes or part.offset % PAGE or part.nbytes % PAGE:
                    raise ValueError(f"part {part.describe()} lies outside the arena ({nbytes} bytes)")
                at = _libc.mmap(ctypes.c_void_p(base + part.offset), ctypes.c_size_t(part.nbytes),
                                mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED, part.fd, 0)
                if at != base + part.offset:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"cannot map a part of the arena: {os.strerror(errno)}")
        except BaseException:
            m.close()
            raise
    return m


def populate(address: int, nbytes: int) -> None:
    """Map every page of [address, address + nbytes) of a private mapping read-only ahead of use, so
    that the first forward pass takes no page faults (the call releases the GIL: overmind_jupyter's
    populating.py runs it on a thread of its own); a no-op on kernels without MADV_POPULATE_READ. Writes
    later still copy-on-write (see Note [Copy-on-write mappings])."""
    # In chunks: the call holds the mmap lock, which every mmap() and large malloc of the
    # process waits for. An error (an old kernel, a mapping gone) only means faults do the work.
    for start in range(address, address + nbytes, _POPULATE_CHUNK):
        length = min(_POPULATE_CHUNK, address + nbytes - start)
        if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_READ):
            return


def read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""

