"""Helper threads that the operating system may refuse.

A process on a shared machine can be at its user's process limit (`ulimit -u`), or short of memory
for another thread's stack; then every new thread fails to start, with RuntimeError. The plain load of
a library that starts no thread still works there, so each helper of ours does work that its caller can
do itself: `start` says whether the helper runs, and a caller that gets None does the work on its own
thread, or leaves it undone where it only saves time later (Note [Helper threads] in
overmind_jupyter/threads.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["start"]


def start(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread | None:
    """Run `target(*args)` on a new daemon thread named `name`; None where the process can start no thread."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # "can't start new thread": the OS refused it
        return None
    return thread
