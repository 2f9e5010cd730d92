"""The compactor: copies an entry's pending pieces from its checkpoint files into an arena of the
daemon's own (Note [Pending pieces] in store.py).

It reads only the files the entry names (checked by identity before and after the copy) and the
entry's own sealed arena, never a kernel's memory; it runs in the daemon, so it survives the kernel
that loaded the model. A kernel's first forward right after its load matters more than the entry
being compact a moment earlier: the copy runs in one SCHED_IDLE thread and, before each chunk, waits
(up to `patience` seconds) for a core of the machine to be idle, since a thread that touches fresh
pages stalls its core whatever its scheduling class (Note [Filling an arena] in arena.py). Its pages
are allocated a chunk at a time too, after that wait: one fallocate of a whole 2 GiB arena zeroed its
pages in 0.16 s of a core, right as the loading kernel ran its first forward (1.1B bf16 on 2 cores:
call and first forward 0.50 s after a miss, against plain's 0.31 s). With the daemon out of
descriptors, an entry is put back in the queue for later (Note [Descriptor budget] in descriptors.py);
it stays servable from its files meanwhile.

# Note [A dropped entry's copy stops]
An entry can leave the store while the compactor copies it: evicted (`evict --all` to free the disk), stale,
orphaned. Its copy is then worth nothing, and it held what the user had just freed: a 229 MiB copy waiting
for an idle core before each chunk held its unwritten room on the disk, and the arena files it had read
and written, for 30 s after `evict --all`, and a load in that time was refused for want of disk with no
entry left. So the store, as it drops the entry, sets its job's `dropped` and gives the copy's unwritten
room back at once (Note [Disk room] in disk.py); the copy stops before its next chunk, or within 0.1 s of
its wait for an idle core, and closes its new arena and its descriptors, which frees the blocks it wrote.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from . import arena, descriptors, helper_threads
from .store import CompactionJob, Store

__all__ = ["Compactor", "idle_cores"]

log = logging.getLogger(__name__)

_CHUNK = 32 << 20
_RETRY_AFTER = 5.0  # seconds before an entry the daemon had no descriptors to compact is tried again


def _cpu_times() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def idle_cores(window: float = 0.1) -> float:
    """How many of the machine's cores were idle over the next `window` seconds."""
    busy0, total0 = _cpu_times()
    time.sleep(window)
    busy1, total1 = _cpu_times()
    if total1 <= total0:
        return float(os.cpu_count() or 1)
    return (1 - (busy1 - busy0) / (total1 - total0)) * (os.cpu_count() or 1)


class Compactor:
    """One background thread that compacts the entries it is given, one at a time.

    Args:
        store: the daemon's store.
        directory: where new file arenas go (`arena.arena_directory`), called when needed.
        patience: the longest wait for an idle core before each chunk, in seconds.
        enabled: False (OVERMIND_COMPACT=0) leaves entries referring to their checkpoint files for good:
            no second copy of the weights in memory, slower first forwards after a hit.
    """

    def __init__(self, store: Store, directory: Callable[[], Path], *, patience: float = 2.0,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.store = store
        self.directory = directory
        self.patience = patience
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._short_log = descriptors.Throttle()

    def submit(self, key: str) -> None:
        with self._lock:
            if self._stop.is_set() or not self.enabled:
                return
            self._queue.put(key)
            if self._thread is None:  # None also where no thread could start: the next submit tries again
                self._thread = helper_threads.start(self._run, name="overmind-compact")

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        except (AttributeError, OSError):
            pass
        while not self._stop.is_set():
            key = self._queue.get()
            if key is None:
                return
            try:
                job = self.store.compaction_job(key)
            except OSError as exc:
                if not descriptors.exhausted(exc):
                    raise
                self._later(key, exc)
                continue
            if job is None:
                continue
            retry: OSError | None = None
            try:
                fd = self._compact(job)
            except InterruptedError:
                if job.dropped.is_set():
                    log.info("stopped compacting %s: it left the cache", key[:12])
                fd = None
            except (OSError, ValueError) as exc:
                if isinstance(exc, OSError) and descriptors.exhausted(exc):
                    retry = exc
                else:
                    log.warning("compacting %s failed (%s); it stays servable from its files", key[:12], exc)
                fd = None
            finally:
                job.close()
            if fd is not None and self.store.compaction_finish(job, fd):
                log.info("compacted %s", key[:12])
            elif fd is None:
                self.store.compaction_finish(job, None)
                if retry is not None:
                    self._later(key, retry)

    def _later(self, key: str, exc: OSError) -> None:
        """Compact `key` again in a while: the daemon had no descriptor for it now."""
        self._short_log.log(logging.INFO, "no descriptors free to compact %s (%s); trying again in %.0f s",
                            key[:12], exc.strerror, _RETRY_AFTER)
        timer = threading.Timer(_RETRY_AFTER, self.submit, (key,))
        timer.daemon = True
        timer.start()

    def _wait_for_an_idle_core(self, job: CompactionJob) -> None:
        deadline = time.monotonic() + self.patience
        while time.monotonic() < deadline and not self._stop.is_set() and not job.dropped.is_set():
            if idle_cores() >= 0.8:
                return

    def _compact(self, job: CompactionJob) -> int | None:
        """A sealed arena with the entry's whole bytes, or None when the entry went stale meanwhile."""
        if not all(s.intact() for s in job.sources):
            return None
        copies = _plan(job)
        backing = job.backing
        writer = arena.ArenaWriter(job.arena_bytes, name=f"overmind:{job.key[:12]}", backing=backing,
                                   directory=self.directory() if backing == "file" else None)
        try:
            if job.arena_bytes:
                target = mmap.mmap(writer.fd, job.arena_bytes)
                try:
                    target.madvise(mmap.MADV_HUGEPAGE)
                except (AttributeError, OSError):
                    pass
                view = memoryview(target)
                try:
                    done = allowance = 0  # bytes copied, and bytes left before the next look for an idle core
                    for fd, src, dst, length in copies:
                        for at in range(0, length, _CHUNK):
                            if allowance <= 0:
                                self._wait_for_an_idle_core(job)
                                allowance = _CHUNK
                            if self._stop.is_set():
                                raise InterruptedError("the daemon is stopping")
                            if job.dropped.is_set():  # Note [A dropped entry's copy stops]
                                raise InterruptedError("the entry left the cache")
                            n = min(_CHUNK, length - at)
                            # a chunk's pages allocated at a time, after the wait: ENOSPC here, not a
                            # SIGBUS at the write; and a large arena's pages are not zeroed all at once
                            os.posix_fallocate(writer.fd, dst + at, n)
                            _read_into(fd, view[dst + at:dst + at + n], src + at)
                            done += n
                            allowance -= n
                            self.store.compaction_progress(job, done)
                finally:
                    view.release()
                    target.close()
            if not all(s.intact() for s in job.sources):  # changed while we copied: what we read is mixed
                writer.close()
                return None
            return writer.seal()
        except BaseException:
            writer.close()
            raise


def _plan(job: CompactionJob) -> list[tuple[int, int, int, int]]:
    """(descriptor, its offset, arena offset, bytes) for every range of the new arena: the pieces from
    their files, the parts from theirs (Note [Arena parts] in arena.py), the rest from the entry's current
    arena."""
    ranges = [(offset, nbytes, job.sources[source].fd, file_offset)
              for offset, nbytes, source, file_offset in job.pieces]
    ranges += [(part.offset, part.nbytes, part.fd, 0) for part in job.parts]
    copies = []
    at = 0
    for offset, nbytes, fd, file_offset in sorted(ranges):
        if offset > at:
            copies.append((job.arena_fd, at, at, offset - at))
        copies.append((fd, file_offset, offset, nbytes))
        at = max(at, offset + nbytes)
    if at < job.arena_bytes:
        copies.append((job.arena_fd, at, at, job.arena_bytes - at))
    return copies


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise ValueError(f"file ended at {offset} while compacting")
        view, offset = view[n:], offset + n
