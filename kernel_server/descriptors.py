"""How many file descriptors the daemon may hold, and what it does when it runs short.

# Note [Descriptor budget]
Every entry holds descriptors for its whole life: its graph and its arena, one per part of its arena
(Note [Arena parts] in arena.py), and one per checkpoint file its pending pieces still lie in
(`Entry.nfds`, Note [Pending pieces] in store.py); every connection
holds its socket. The daemon is started by a kernel and inherits its RLIMIT_NOFILE, whose soft limit is
often 1024: at two descriptors an entry, about 510 entries used to exhaust it, and from then on every
accept, hit and publish failed with EMFILE (publishers lost their connection and its leases, hits
answered `internal`, new kernels waited for a hello that never came). So:
- At start the daemon raises its soft limit to the hard limit (`raise_limit`; an unlimited or huge hard
  limit counts as MAX_LIMIT, the kernel's default `fs.nr_open`).
- The store keeps `descriptors held by entries + descriptors reserved by loads in flight <= cap`, where
  `cap = limit - headroom` and `headroom = max(64, limit // 4) + 4 per live connection`. A load
  reserves its descriptors with its bytes (`reserve`'s `descriptors`: 2 + its parts and source files; a publish
  that brings more makes room for the rest) and the store makes room as it does for bytes (Note [Budget
  accounting] in store.py): it evicts least-recently-used entries that no connection pins, dependents
  included. An entry that cannot fit, everything being pinned, is refused with `descriptors_exhausted`
  (errors.DescriptorsExhausted), and the kernel loads plainly.
- Why that headroom: the fixed part is what the daemon opens besides entries and sockets. At rest that
  is about 8 (standard streams, the log, the lock, the listening socket); the compactor takes up to 5 +
  the entry's parts and sources while it copies (a new arena, its mapping, its read-only reopening, the
  old arena's, the parts' and the sources' duplicates, /proc/stat); a publish that serves waiters
  duplicates an entry's descriptors for each of them at once. 64 covers that at the smallest limits
  anyone runs with (256); at large limits a quarter is little to give up, and it also covers connections
  that arrive between two reservations (the cap is checked when an entry comes, not when a connection
  does). Per connection the headroom holds its socket and the duplicates of the hit reply it is being
  sent (graph, arena, a source).
- The budget is a forecast, not a promise: a descriptor must also be free at the moment it is taken.
  So no place that takes one fails a connection or answers `internal` on EMFILE/ENFILE:
  - a hit whose duplicates fail sheds unpinned entries and tries once more; failing again, it closes
    what it duplicated, drops its pins and answers `descriptors_exhausted`;
  - Linux takes accept's descriptor before it waits for a connection: a blocked accept would hold one
    the whole time it waits, unseen in /proc/self/fd, and a publish bringing the last free descriptors
    would lose one to it. So the daemon waits for a connection with poll, which takes none, and only
    then accepts. While the table is full, accept fails at once: the daemon sheds unpinned entries to
    make room and accepts on the next try; the connection waits in the backlog meanwhile, and the log
    gets one line every few seconds at most (`Throttle`);
  - a frame whose descriptors the kernel could not install (MSG_CTRUNC while the header announces no
    more than protocol.MAX_FDS) is read whole and its request answered `descriptors_exhausted`
    (errors.DescriptorsLost, from transport.recv_frame); the client does the same for a reply;
  - the compactor puts the entry back in its queue for later; it stays servable from its files.
  No connection, lease or pin is lost to any of these.
- A kernel holds descriptors for the cached models it keeps too (its arena's, kept beside the mapping for
  the device copier, and its checkpoint files' where pieces are pending): 120 held models took 441 of a
  kernel's 1024, and at a low limit the user's own `open` failed where the plain load would not have. So
  enabling the cache raises the kernel's soft limit to its hard limit as well (`raise_limit`, from
  overmind_jupyter/api.py), and where the kernel runs out anyway (EMFILE, or ENFILE for the system), its
  fallback messages say that it did, why, and what to do (`short_here`), not only the errno's words.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass

__all__ = ["ADVICE", "MAX_LIMIT", "DescriptorBudget", "Throttle", "exhausted", "open_descriptors", "raise_limit",
           "short_here"]

log = logging.getLogger(__name__)

# What a user can do about a shortage; the messages of DescriptorsExhausted end with it.
ADVICE = ("free models in other kernels, run `%overmind evict`, or raise the hard limit on open files of the "
          "shell or service that starts Jupyter (`ulimit -Hn`, LimitNOFILE= of a systemd unit; the daemon "
          "raises its own soft limit to it) and restart the daemon with `overmind-daemon stop`")
MAX_LIMIT = 1 << 20  # the kernel's default fs.nr_open: no process gets more, whatever its hard limit says
MIN_HEADROOM = 64
PER_CONNECTION = 4
SHED = 2 * PER_CONNECTION  # descriptors freed by evicting unpinned entries when the table is full


def soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_LIMIT if soft == resource.RLIM_INFINITY else min(soft, MAX_LIMIT)


def raise_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (at most MAX_LIMIT); returns the soft
    limit now in force. A limit that cannot be raised is kept, and said so in the log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_LIMIT if hard == resource.RLIM_INFINITY else min(hard, MAX_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("descriptor limit raised from %d to %d (the hard limit is %s)", soft, target,
                     "unlimited" if hard == resource.RLIM_INFINITY else hard)
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d (%s); keeping %d", soft, target, exc, soft)
    return soft_limit()


def exhausted(exc: BaseException) -> bool:
    """Whether `exc` says this process (EMFILE) or the system (ENFILE) has no descriptor to give."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def short_here(exc: BaseException | None = None) -> str:
    """What a kernel that ran out of descriptors itself (`exc`: EMFILE, the default, or ENFILE for the whole
    system) says after the error's words: why, its limits and what to do (Note [Descriptor budget])."""
    if isinstance(exc, OSError) and exc.errno == errno.ENFILE:
        return ("the system's table of open files is full (fs.file-max): close files or processes, or raise "
                "fs.file-max (sysctl)")
    soft, hard = (("unlimited" if n == resource.RLIM_INFINITY else str(n))
                  for n in resource.getrlimit(resource.RLIMIT_NOFILE))
    return (f"this process reached its limit on open files (soft {soft}, hard {hard}), and each cached model it "
            "holds keeps descriptors open: free models you no longer use, or raise the limit (`ulimit -n`, up to "
            "`ulimit -Hn`; LimitNOFILE= of a systemd unit) where Jupyter starts, and restart the kernel")


def open_descriptors() -> int | None:
    """How many descriptors this process has open now; None when that cannot be read (listing
    /proc/self/fd itself takes one, which a full table does not have)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return None


@dataclass
class DescriptorBudget:
    """The descriptors the store's entries may hold (Note [Descriptor budget]). `connections` is kept
    up to date by the daemon."""

    limit: int
    connections: int = 0

    @classmethod
    def of_process(cls) -> DescriptorBudget:
        return cls(soft_limit())

    @property
    def headroom(self) -> int:
        return max(MIN_HEADROOM, self.limit // 4) + PER_CONNECTION * self.connections

    @property
    def cap(self) -> int:
        return max(0, self.limit - self.headroom)


class Throttle:
    """At most one log line every `every` seconds for a condition that may repeat many times a second;
    the lines in between are counted, and the next line says how many there were."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self._next = 0.0
        self._skipped = 0
        self._lock = threading.Lock()

    def log(self, level: int, message: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._skipped += 1
                return
            skipped, self._skipped, self._next = self._skipped, 0, now + self.every
        suffix = f" ({skipped} more like it since the last such line)" if skipped else ""
        log.log(level, message + suffix, *args)
