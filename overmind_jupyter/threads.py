"""The helper threads a cached load may start, and when it starts none.

# Note [Helper threads]
A load with the cache on starts no thread that the plain load would not start where the library
promises that: transformers loads on the calling thread alone when `HF_DEACTIVATE_ASYNC_LOAD` is true
(users set it where worker threads break a device's context, or to debug), and so does the cache then
(`allowed()` is False). Elsewhere each helper thread is one the work needs:
- `overmind-fill` (kernel_server/arena.py, `copy_from`): one helper for a miss whose copy into a file
  arena is more than one chunk (64 MiB); a fill's cost is the first touch of fresh pages, which two
  threads share (Note [Filling an arena]). A smaller copy runs on the calling thread. Without helpers
  the whole copy runs on the calling thread.
- the populate thread (populating.py): one per hit, ending when the hit's pages are mapped, so that the hit
  returns at once and the first forward pass takes no page faults. Without helpers there is none: the
  first forward faults the pages in, on the thread that reads them, as a plain load's copy would.
- `overmind-unpin` (results.py): one per process, started by the first unpin, because unpins run in
  finalizers, which must not wait for the daemon. Without helpers, the unpins wait in a queue and are
  sent by the calling thread at its next load and after each cell (an entry stays pinned a little
  longer; the daemon unpins everything of a process that exits).
- the client's reader and push threads (kernel_server/client.py): only for a wait on another kernel's
  load longer than a second, a timed-out wait, or push handlers (widgets); a hit and a miss read their
  replies on the calling thread (Note [Who reads the socket]).
A process that cannot start a thread at all (its user's process limit, `ulimit -u`, reached on a shared
machine; no memory for a stack) still loads plainly where the library starts no thread, so the cache
must too: each helper is started through kernel_server's `helper_threads.start`, and one the OS refuses
is done without, as above (the fill's share by the calling thread, the pages by the first forward, the
unpins at the next load, the long wait's reading by the waiting thread; pushes are dropped).
"""

from __future__ import annotations

import os

__all__ = ["allowed"]

# transformers' own test of its truth values (utils/import_utils.is_env_variable_true)
_TRUE = ("true", "1", "y", "yes", "on")


def allowed() -> bool:
    """Whether a cached load may start helper threads: not where the library promises a load on the
    calling thread alone (Note [Helper threads]). Read at each call, as transformers reads it."""
    return os.environ.get("HF_DEACTIVATE_ASYNC_LOAD", "false").lower() not in _TRUE
