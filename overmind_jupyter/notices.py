"""Fallbacks and notices: what a cached call tells about itself. A call that went the plain way is
recorded with its reason (`fallbacks()`), counted (`calls()`), told to the daemon, and warned once per
function, reason and line of the user's (Note [Never worse] in loading.py); a notice that is no fallback is warned once
per topic. A load in a thread of the user's warns in the main thread, at its next load or cell. Every
warning names the user's own line, the first frame outside overmind and the loading libraries (a
thread's: the line in that thread).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import warnings
from types import FrameType
from typing import Any

from kernel_server.client import existing_shared_client
from kernel_server.errors import DaemonError
from kernel_server.operations import Op

from .errors import FallbackWarning, OvermindWarning

__all__ = ["calls", "clear_fallbacks", "count", "emit_deferred", "fall_back", "fallbacks", "tell_once"]

_fallbacks: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
# (kind, the function called, reason, the user's line): a function falling back for a reason not told of it
# at that line yet is told; a loop over one call with other arguments (its label names them), once, as
# Python warns once per line; another cell's load of another model, again
_warned: set[tuple[str, str, str, str, int]] = set()
_calls: collections.Counter[str] = collections.Counter()


def calls() -> dict[str, int]:
    """How this process's cached calls went: "hit", "miss" (loaded and published) and "plain"."""
    return dict(_calls)


def count(outcome: str) -> None:
    """Count one cached call that went `outcome` ("hit" or "miss"; `fall_back` counts "plain")."""
    _calls[outcome] += 1


def fallbacks() -> list[dict[str, Any]]:
    """The calls that went the plain way in this process, newest last: {time, call, reason, kind}."""
    return list(_fallbacks)


# a load in a thread of the user's: (message, category, the user's line in that thread), warned in the main
# thread at its next load or cell
_deferred_warnings: collections.deque[tuple[str, type[Warning], str, int]] = collections.deque(maxlen=20)


def fall_back(label: str, kind: str, reason: str, *, plain: bool = True, loaded: bool = False) -> None:
    """Record, count, report and warn of a call that went the plain way (`plain`: False for a move without
    the ledger). `loaded`: the load itself ran, and only caching its result failed."""
    if plain:  # the call went the plain way (a move to a device without the ledger does not count)
        _calls["plain"] += 1
    _fallbacks.append({"time": time.time(), "call": label, "kind": kind, "reason": reason})
    _report(label, kind, reason)
    user, _ = _user_code(sys._getframe(1))
    said = (kind, label.split("(", 1)[0], reason, user.f_code.co_filename, user.f_lineno)
    if said in _warned:
        return
    _warned.add(said)
    went = ("was loaded normally but not cached" if loaded else "loads without the cache" if plain
            else "goes as torch moves it, without the units ledger")
    _warn(f"overmind: {label} {went}: {reason}", FallbackWarning)


def tell_once(topic: str, message: str) -> None:
    """A notice that is no fallback (the call is cached), once per topic and process."""
    if ("notice", topic) in _told:
        return
    _told.add(("notice", topic))
    _warn(message, OvermindWarning)


def _warn(message: str, category: type[Warning]) -> None:
    """Warn at the user's line that loaded (`_user_frame`); from another thread, later in the main one."""
    level = _user_frame()
    if threading.current_thread() is threading.main_thread():
        warnings.warn(message, category, stacklevel=level)
        return
    frame = sys._getframe(level - 1)  # warn's stacklevel 1 is this function's frame
    _deferred_warnings.append((message, category, frame.f_code.co_filename, frame.f_lineno))


_told: set[tuple[str, str]] = set()

# Where the code of the loaders lives: a warning names the first frame outside them, the user's cell.
_LIBRARIES = tuple(os.path.dirname(os.path.dirname(__file__)) + os.sep + name + os.sep
                   for name in ("overmind_jupyter", "kernel_server"))
_LIBRARY_NAMES = ("transformers", "diffusers", "peft", "torch", "huggingface_hub", "accelerate",
                  "sentence_transformers")


def _user_frame() -> int:
    """The `stacklevel` of `warnings.warn`, called by the function calling this, that names the first
    frame outside overmind and the loading libraries: the line of the user's that loaded."""
    return 2 + _user_code(sys._getframe(2))[1]


def _user_code(frame: FrameType) -> tuple[FrameType, int]:
    """The first frame from `frame` up that is outside overmind and the loading libraries (the outermost
    where all are inside), and how many frames up it is."""
    up = 0
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_LIBRARIES) or any(
            f"{os.sep}{name}{os.sep}" in frame.f_code.co_filename for name in _LIBRARY_NAMES)):
        frame, up = frame.f_back, up + 1
    return frame, up


def clear_fallbacks() -> None:
    """Forget this process's fallbacks, and warn again for every reason."""
    _fallbacks.clear()
    _warned.clear()
    _deferred_warnings.clear()


def emit_deferred() -> None:
    """Emit the warnings of loads in other threads, each at the line of its thread that loaded; only in
    the main thread (where a notebook shows them)."""
    while threading.current_thread() is threading.main_thread() and _deferred_warnings:
        message, category, filename, lineno = _deferred_warnings.popleft()
        warnings.warn_explicit(message, category, filename, lineno)


def _report(label: str, kind: str, reason: str) -> None:
    """Tell the daemon too (for `overmind-daemon status` and the side panel), without waiting."""
    client = existing_shared_client()
    if client is None or kind == "daemon":
        return
    try:
        client.submit(Op.FALLBACK, call=label, kind=kind, reason=reason)
    except DaemonError:
        pass
