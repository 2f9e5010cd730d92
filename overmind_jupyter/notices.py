"""Fallbacks and notices: what a cached call tells about itself. A call that went the plain way is
recorded with its reason (`fallbacks()`), counted (`calls()`), told to the daemon, and warned once per
label and reason (Note [Never worse] in loading.py); a notice that is no fallback is warned once per
topic. A load in a thread of the user's warns in the main thread, at its next load or cell. Every
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
from typing import Any

from kernel_server.client import existing_shared_client
from kernel_server.errors import DaemonError
from kernel_server.operations import Op

from .errors import FallbackWarning, OvermindWarning

__all__ = ["calls", "clear_fallbacks", "count", "emit_deferred", "fall_back", "fallbacks", "tell", "tell_once"]

_fallbacks: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
# (kind, the call's label, reason): a call falling back for a reason not told of it yet is told. A load's
# label names the model (a checkpoint's load: the checkpoint and its other plain arguments; a call with no
# key yet: its function and checkpoint), so a load of another model is told again, and a loop over one call
# whose arguments have no key, once; a move by its method alone (`.to("cuda:0")`, `.cuda()` and a
# device_map's move of one model: once)
_warned: set[tuple[str, str, str]] = set()
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
    said = (kind, label if plain else label.split("(", 1)[0], reason)
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


def tell(message: str) -> None:
    """A notice that is no fallback, each time."""
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
    frame = sys._getframe(2)
    level = 2
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_LIBRARIES) or any(
            f"{os.sep}{name}{os.sep}" in frame.f_code.co_filename for name in _LIBRARY_NAMES)):
        frame = frame.f_back
        level += 1
    return level


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
