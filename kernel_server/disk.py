"""The disk under the file arenas: how much of it the store may still take.

# Note [Disk room]
A file arena (Note [Arena backing] in arena.py) is an unnamed file: `du` shows nothing, and its blocks stay
taken until the last kernel mapping it lets go. Where the state directory is on disk (no
$XDG_RUNTIME_DIR: containers, JupyterHub's single-user servers, ssh sessions), the memory budget alone
would let the cache fill a small disk the user needs: half of a 64 GB machine's memory is 32 GB of a 10 GB
home. So a new file arena must also leave the disk's free space at or above the reserve
(OVERMIND_DISK_RESERVE, the largest of its sizes and percentages of the filesystem; by default 10% or 3
GiB): the store counts what loads in flight have reserved for file arenas and not written yet against the
free space it reads, evicts unpinned entries in file arenas (least recently used first) while that falls
short, and refuses the rest, and the kernel then loads plainly, saying so. The daemon looks again every
few seconds, so that a disk filled by something else makes the cache give its unpinned file entries back
before the user runs out. An entry still mapped by a kernel frees its blocks when that kernel lets go of
it; an entry evicted under the store's lock counts as given back at once, as its descriptors close when
the lock is released (Note [Closing after the lock] in store.py), for what its arena holds: not the pieces
still served from its checkpoint (Note [Pending pieces] in store.py), which are holes in its file
(`Entry.disk_bytes`). memfd arenas take memory, not disk: the budget bounds them. So each reservation says
which its arena is ("backing", a file when it does not say), a memfd's is never refused for want of disk,
and no entry in a memfd is evicted to make room on the disk, which its eviction would not give.

A load evicts nothing for room it cannot get: one that would fall short even with every unpinned entry in
a file arena gone (what their arenas take, and the rest of a copy of one in flight, which then stops:
`Store._evictable_on_disk`, which costs what the pins hold, not what the store holds) is refused before
any is evicted, as one too large for the budget or the descriptors is (`Store._reserve`), after those two
refusals. Where entries that kernels hold took most of the disk, such a load once evicted every other
cached model there and then ran plainly all the same. A publish that reserves what its load did not (Note
[Reserved at publish] in store.py) goes through the same check. The periodic look is not a load: it
evicts what it can even where the free space stays below the reserve, since each byte it gives back is
the user's.

The compactor's copy of an entry (Note [Pending pieces] in store.py) is a new arena too, written after the
publish that passed the check above. A same-dtype miss writes almost nothing to its arena before it
publishes, so the free space still looked untouched to the misses after it: seven of them once passed the
check before any was compacted, the copies then left 10.7 MiB of a 60 MiB reserve free, and the periodic
look evicted other entries to make up. So a compaction starts only where its whole arena fits as a new
arena would (`Store.compaction_job`), and what it has not written yet counts against the free space like
a load in flight's reservation until it ends or its entry leaves the store (evicted, stale: the copy then
stops, Note [A dropped entry's copy stops] in compaction.py), so that a load and a copy never both count on
the same room. It evicts nothing: an entry that does not fit stays servable from its checkpoint files (hits map
them), and the daemon log says so once for that entry. Every few seconds, after looking at the reserve,
the daemon hands the skipped entries that fit by then back to the compactor, oldest first, as many as fit
together: an eviction, the end of a load or a copy, or the user's own files deleted make the room, and no
room is held back for a copy that waits.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .formats import byte_text

if TYPE_CHECKING:  # payloads imports what imports this module
    from .payloads import DiskStatus

__all__ = ["DiskRoom"]


@dataclass(frozen=True)
class DiskRoom:
    """The filesystem holding `directory`, and what of it the cache leaves free (`reserve`, a setting's
    value: "10%,3g")."""

    directory: Path
    reserve: str

    def usage(self) -> tuple[int, int, int]:
        """(size, free, kept free) in bytes, read now; free as an unprivileged user sees it."""
        existing = self.directory
        while not existing.exists() and existing != existing.parent:  # made at the first file arena
            existing = existing.parent
        st = os.statvfs(existing)
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        return size, free, self.kept(size)

    def kept(self, size: int) -> int:
        """The reserve in bytes, for a filesystem of `size` bytes: the largest of its parts."""
        kept = 0
        for part in self.reserve.split(","):
            m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt%]?)(?:i?b)?", part.strip().lower())
            if m is None:
                continue  # settings.disk_reserve checked it
            number, unit = float(m.group(1)), m.group(2)
            nbytes = int(size * number / 100) if unit == "%" else int(number * 1024 ** " kmgt".index(unit or " "))
            kept = max(kept, nbytes)
        return kept

    def room(self) -> int:
        """Bytes new arenas may still take before the free space falls below the reserve (negative when it
        has already)."""
        _, free, kept = self.usage()
        return free - kept

    def describe(self, used: int) -> DiskStatus:
        """What status shows: where, what the cache's arenas take there, what is free and kept free."""
        size, free, kept = self.usage()
        return {"directory": str(self.directory), "used": used, "free": free, "size": size, "reserve": kept}

    def refusal(self, nbytes: int, unwritten: int) -> str:
        """Why an arena of `nbytes` does not fit, and what to do."""
        size, free, kept = self.usage()
        said = (f"no room on the disk for {byte_text(nbytes)}: {self.directory} has {byte_text(free)} free"
                + (f", {byte_text(unwritten)} of it promised to arenas still being written" if unwritten else ""))
        if kept + nbytes > size:  # no entry of this size would ever fit there
            return (f"{said}, and the cache leaves {byte_text(kept)} of its {byte_text(size)} to you "
                    f"(OVERMIND_DISK_RESERVE={self.reserve}), so nothing of this size is ever cached there: lower "
                    "OVERMIND_DISK_RESERVE (e.g. 10%), or put the arenas on a larger disk (OVERMIND_ARENA_DIR), and "
                    "restart the daemon (`overmind-daemon stop`)")
        return (f"{said}, and the cache leaves {byte_text(kept)} of it to you (OVERMIND_DISK_RESERVE); free disk "
                "space, evict entries other kernels hold, or put the arenas elsewhere (OVERMIND_ARENA_DIR)")
