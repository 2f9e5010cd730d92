"""The loader worker behind `overmind_jupyter.preload`: a fresh process of the kernel's interpreter
that runs one cached load and publishes it, so that the kernel's own call later is a hit (or waits for
this load: see Note [Single flight] in kernel_server/store.py).

    python -m overmind_jupyter.worker < job

The job is two pickles (the kernel's cwd and sys.path, then the load) written by the kernel that started
this worker (the user's own process, docs/design.md invariant 4); it never comes through the daemon. This
module imports torch only inside `main`.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import dill

    where = dill.load(sys.stdin.buffer)  # first where the kernel imports from, so that the job unpickles
    os.chdir(where["cwd"])
    sys.path[:0] = [p for p in where["path"] if p not in sys.path]
    job = dill.load(sys.stdin.buffer)

    from kernel_server.client import shared_client
    from overmind_jupyter import loading, placement

    notebook = os.path.basename(os.environ.get("JPY_SESSION_NAME", ""))  # the kernel's, inherited
    shared_client(role="worker", label=f"preload for {notebook} (pid {job['parent']})" if notebook
                  else f"preload for pid {job['parent']}")
    kwargs = placement.split_placement(job["kwargs"]).kwargs  # the cache holds CPU bytes
    loading.cached(job["fn"], *job["args"], **kwargs)  # published before it returns
    for fallback in loading.fallbacks():
        print(f"overmind preload: {fallback['call']}: {fallback['reason']}", file=sys.stderr)
    return 1 if loading.fallbacks() else 0


if __name__ == "__main__":
    sys.exit(main())
