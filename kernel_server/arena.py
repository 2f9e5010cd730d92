"""Arenas: sealed memory files that hold the tensor bytes (and the pickled graph) of a cache entry.

# Note [Copy-on-write mappings]
An arena is written once, through a shared mapping that the writer drops before it seals the file
(F_SEAL_WRITE refuses every later shared writable mapping and write()). Readers map it MAP_PRIVATE:
a page a reader writes to (`add_`, `load_state_dict`, an optimizer step) is copied into that process
alone, so no in-place write is ever seen by another kernel or by a later hit (DESIGN.md invariant 3).
Never MAP_POPULATE a private mapping: the kernel write-faults every page of a writable private
mapping and so copies all of it. Populate with MADV_POPULATE_READ instead, which maps the shared
pages read-only.

Two backings exist and are chosen by measurement (benchmarks/RESULTS.md): a memfd (shmem pages),
and an unnamed O_TMPFILE file in the state directory (page-cache pages). Only the memfd can be
sealed; the file is never named, so only descriptors reach it.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import threading
from pathlib import Path

__all__ = [
    "PAGE",
    "ArenaWriter",
    "align",
    "check_sealed",
    "map_private",
    "populate",
    "read_all",
]

PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # Linux 5.14; not exported by the mmap module
_POPULATE_CHUNK = 16 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def align(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


class ArenaWriter:
    """A new arena of `nbytes`: write through `view`, then `seal()` and hand `fd` over.

    Args:
        nbytes: size of the file; a multiple of PAGE is best.
        name: shows in /proc/<pid>/fd of every holder, for debugging.
        backing: "memfd" (sealed shmem) or "file" (an unnamed file in `directory`).
        directory: where a "file" arena lives (the state directory).
    """

    def __init__(self, nbytes: int, *, name: str = "overmind", backing: str = "memfd",
                 directory: str | os.PathLike[str] | None = None) -> None:
        self.nbytes = nbytes
        self.backing = backing
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
                os.ftruncate(self.fd, nbytes)
                if backing == "file":
                    # Allocate the blocks now: on a full disk this raises ENOSPC here, where a write
                    # through the mapping into a sparse file would kill the process with SIGBUS.
                    os.posix_fallocate(self.fd, 0, nbytes)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, nbytes) if nbytes else None
        except BaseException:
            os.close(self.fd)
            raise

    @property
    def view(self) -> memoryview:
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)

    @property
    def mapping(self) -> mmap.mmap | None:
        return self._map

    def seal(self) -> int:
        """Drop the writable mapping and seal the file; returns the descriptor (still owned here)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self.backing == "memfd":
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
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
    if seals is None or seals & fcntl.F_SEAL_SEAL and not seals & fcntl.F_SEAL_WRITE:
        # Not a memfd, or a file that can never be sealed: an O_TMPFILE file on a tmpfs (such as
        # $XDG_RUNTIME_DIR) is shmem too, born with F_SEAL_SEAL alone.
        if st.st_nlink != 0:
            raise ValueError("a file arena must be unnamed (O_TMPFILE)")
        return "file"
    if seals & _SEALS != _SEALS:
        raise ValueError("memfd arena is not sealed against writes")
    return "memfd"


def map_private(fd: int, nbytes: int) -> mmap.mmap:
    """Map an arena copy-on-write (see Note [Copy-on-write mappings])."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def populate(address: int, nbytes: int, *, background: bool = True) -> threading.Thread | None:
    """Map every page of [address, address + nbytes) of a private mapping read-only ahead of use, so
    that the first forward pass takes no page faults. Runs in a thread by default (the call releases
    the GIL); a no-op on kernels without MADV_POPULATE_READ. Writes later still copy-on-write (see
    Note [Copy-on-write mappings])."""

    def run() -> None:
        # In chunks: the call holds the mmap lock, which every mmap() and large malloc of the
        # process waits for. An error (an old kernel, a mapping gone) only means faults do the work.
        for start in range(address, address + nbytes, _POPULATE_CHUNK):
            length = min(_POPULATE_CHUNK, address + nbytes - start)
            if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_READ):
                return

    if not background:
        run()
        return None
    thread = threading.Thread(target=run, name="overmind-populate", daemon=True)
    thread.start()
    return thread


def read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""

