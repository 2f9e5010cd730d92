"""How every view writes what the daemon reports: bytes, durations, relative times, progress, kernels.

One definition for the CLI, `%overmind status`, and the view that the notebook widgets and the side panel
draw (overmind_jupyter/view.py), so that they never disagree ("12 GiB" in one place, "11.8 GiB" in
another). Only relative times are written in the browser, which moves them on every second without a
round trip to the kernel (labextension/src/texts.ts `agoText`, JupyterLab's own wording).

# Note [One format]
Bytes: binary units (KiB, MiB, GiB, TiB), whole bytes below 1 KiB, one decimal below 100 of a unit and
none above ("11.8 GiB", "512 MiB"). Durations: whole milliseconds below 1 s, one decimal below 10 s, then
whole seconds, minutes, hours and days at the thresholds of `_STEPS`. Relative times: "just now" below
2 s, else the duration and "ago" (the CLI's and the text status's).
"""

from __future__ import annotations

import decimal
import math
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # payloads imports what imports this module
    from .payloads import MissTimes, TimeSaved

__all__ = ["ago_text", "byte_text", "eta_text", "evicted_text", "kernel_line", "kernel_name", "miss_text",
           "pending_text", "percent", "progress_text", "saved_figure", "saved_seconds", "saved_text", "seconds_text",
           "units_text"]

_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
# (below this many seconds, divide by this, unit): the last step takes everything above
_STEPS: tuple[tuple[float, float, str], ...] = ((90, 1, "s"), (5400, 60, "min"), (129600, 3600, "h"),
                                                (float("inf"), 86400, "d"))
_JUST_NOW = 2.0


def byte_text(n: float | None) -> str:
    """`n` bytes as text: "512 B", "1.5 KiB", "11.8 GiB", "512 MiB" (Note [One format])."""
    if n is None:
        return "?"
    if abs(n) < 1024:
        return f"{_fixed(n, 0)} B"
    value = float(n)
    for unit in _BYTE_UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{_fixed(value, 1 if abs(value) < 100 else 0)} {unit}"
    raise AssertionError("unreachable")


def disk_text(disk: Mapping[str, Any] | None) -> str:
    """The disk under the cache's file arenas (Note [Disk room] in disk.py), or "" where they take memory."""
    if not disk:
        return ""
    return (f"disk: {byte_text(disk['used'])} of arenas in {disk['directory']}; {byte_text(disk['free'])} free, "
            f"{byte_text(disk['reserve'])} kept free for you")


def seconds_text(s: float) -> str:
    """A duration: "4 ms", "1.4 s", "42 s", "12 min", "3 h", "2 d" (Note [One format])."""
    s = max(0.0, float(s))
    if s < 0.9995:
        return f"{_round(s * 1000)} ms"
    if s < 10:
        return f"{_fixed(s, 1)} s"
    for below, per, unit in _STEPS:
        if s < below:
            return f"{_round(s / per)} {unit}"
    raise AssertionError("unreachable")


def saved_figure(s: float) -> str:
    """What the cache saved (`saved_seconds`) as a figure: "1.4 s"; "none" while the caching and the hits
    took longer than the loads the hits replaced, never a negative saving (`saved_text` says why)."""
    return "none" if _lost(s) else seconds_text(s)


def _lost(s: float) -> bool:
    """Whether `s` seconds saved is a loss as the texts show it (a loss that rounds to "0 ms" is none)."""
    return s < 0 and seconds_text(-s) != "0 ms"


def miss_text(times: MissTimes) -> str:
    """What a miss cost (its `waited_s`, `load_s`, `cache_s`: Note [Load time saved] in store.py):
    "20.1 s: loading 8.0 s + caching 12.1 s". The cell's line after a miss and every view say it so."""
    return (f"{seconds_text(times['waited_s'])}: loading {seconds_text(times['load_s'])} "
            f"+ caching {seconds_text(times['cache_s'])}")


def saved_seconds(sums: TimeSaved) -> float:
    """What the cache saved, from status's `time_saved` (Note [Load time saved] in store.py): the plain
    loads the timed hits replaced, less the hits' waits, less the caching every miss added."""
    return sums["plain_s"] - sums["hit_s"] - sums["cache_s"]


def entries_text(n: int) -> str:
    """"1 entry", "3 entries"."""
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def units_text(n: int) -> str:
    """GPU units: "1 unit", "0 units", "3 units"."""
    return f"{n} unit{'' if n == 1 else 's'}"


def saved_text(sums: TimeSaved) -> str:
    """`saved_seconds` in words, with its parts: "12 s saved: 3 hits took 400 ms instead of 14 s, less 1.6 s
    of caching in 2 misses". Never a negative saving: while the caching cost more than the hits saved, "none
    saved yet (the caching cost 9 ms more than the hits saved): 3 hits took ..."; while the hits took longer
    than the loads they replaced (a hit in a fresh process imports the model's code first), "none saved yet
    (the hits took longer than the loads they replaced): 1 hit took 3.3 s instead of 33 ms, plus 36 ms of
    caching in 2 misses". Before the first hit, only what is true then: "none saved yet: no hit yet, and the
    caching cost 24 ms in 1 miss" ("none saved yet: no load through the cache yet" before the first miss).
    Hits whose times never came are said beside the timed ones: "3 hits took 400 ms instead of 14 s (2 more,
    of kernels that ended before telling their times), less ..." (`_untimed_text`)."""
    hits, misses, saved = sums["hits"], sums["misses"], saved_seconds(sums)
    untimed = _untimed_text(sums, hits)
    if not hits:  # no "0 hits took 0 ms instead of 0 ms": nothing was compared yet
        if not misses:
            return "none saved yet: no load through the cache yet"
        none = f"no hit timed yet{untimed}" if untimed else "no hit yet"
        return (f"none saved yet: {none}, and the caching cost {seconds_text(sums['cache_s'])} in {misses} "
                f"miss{'' if misses == 1 else 'es'}")
    slower = _lost(sums["plain_s"] - sums["hit_s"])  # then the caching adds to what the hits lost
    if slower:
        head = "none saved yet (the hits took longer than the loads they replaced)"
    elif _lost(saved):
        head = f"none saved yet (the caching cost {seconds_text(-saved)} more than the hits saved)"
    else:
        head = f"{seconds_text(saved)} saved"
    return (f"{head}: {hits} hit{'' if hits == 1 else 's'} took "
            f"{seconds_text(sums['hit_s'])} instead of {seconds_text(sums['plain_s'])}{untimed}, "
            f"{'plus' if slower else 'less'} "
            f"{seconds_text(sums['cache_s'])} of caching in {misses} miss{'' if misses == 1 else 'es'}")


def _untimed_text(sums: TimeSaved, timed: int) -> str:
    """The hits that the sums of `sums` leave out, their times never reported (Note [Load time saved] in
    store.py), as `saved_text` puts them beside the `timed` ones: " (130 more, of kernels that ended before
    telling their times)", " (4 more, not timed yet)", " (134 more: 130 of kernels that ended before
    telling their times, 4 not timed yet)" (" (2 hits, ...)" where none was timed); "" when every hit was."""
    ended, waiting = sums.get("untimed_ended", 0), sums.get("untimed_waiting", 0)
    if not ended and not waiting:
        return ""
    n = f"{ended + waiting} more" if timed else f"{ended + waiting} hit{'' if ended + waiting == 1 else 's'}"
    if not waiting:
        return f" ({n}, of kernels that ended before telling their times)"
    if not ended:
        return f" ({n}, not timed yet)"
    return f" ({n}: {ended} of kernels that ended before telling their times, {waiting} not timed yet)"


def ago_text(t: float | None, now: float | None = None) -> str:
    """A time (seconds since the epoch) relative to `now`: "just now", "42 s ago", "3 min ago"; "never"
    for none."""
    if not t:
        return "never"
    s = max(0.0, (time.time() if now is None else now) - t)
    if s < _JUST_NOW:
        return "just now"
    return seconds_text(s) + " ago"


def eta_text(eta_s: float | None) -> str:
    """The time left: "3.5 s left", "2 min left"; "" when unknown."""
    return "" if eta_s is None else seconds_text(eta_s) + " left"


def percent(done: float, total: float) -> int:
    """Whole percent of `done` in `total`, 0 to 100 (0 when the total is unknown)."""
    return max(0, min(100, int(100 * done // total))) if total and total > 0 else 0


def progress_text(progress: Mapping[str, Any]) -> str:
    """A daemon's `progress` object (`label`, `done`, `total`, `unit`, `eta_s`) as one line:
    "loading llama-0.1b: 40% (1.2 GiB of 3.0 GiB), 3.5 s left"."""
    done, total, unit = progress.get("done") or 0, progress.get("total") or 0, progress.get("unit") or ""
    amount = (f"{byte_text(done)} of {byte_text(total)}" if unit == "B"
              else f"{done:g} of {total:g}{' ' + unit if unit else ''}") if total else ""
    parts = [f"{percent(done, total)}%" if total else "", f"({amount})" if amount else ""]
    head = " ".join(p for p in parts if p)
    tail = eta_text(progress.get("eta_s"))
    label = str(progress.get("label") or "working")
    return f"{label}: {head}" + (f", {tail}" if tail else "") if head or tail else label


def pending_text(pending: Mapping[str, Any]) -> str:
    """An entry's pending pieces as words (Note [Pending pieces] in store.py): "copying from its
    checkpoint: 40%, 3.5 s left", "served from its checkpoint; copy queued", waiting for disk room, or never
    copied."""
    if not pending["copying"]:
        if not pending.get("queued", True):
            return "served from its checkpoint (never copied: OVERMIND_COMPACT=0)"
        if pending.get("short_of_disk"):
            return "served from its checkpoint; copied once the disk has room (OVERMIND_DISK_RESERVE)"
        return "served from its checkpoint; copy queued"
    left = eta_text(pending.get("eta"))
    return f"copying from its checkpoint: {percent(pending['done'], pending['bytes'])}%" + (f", {left}" if left else "")


def evicted_text(reply: Mapping[str, Any]) -> str:
    """An evict's reply as text: how many entries went and their bytes, then a line per entry as
    `%overmind status` shows it (its key's first 12 characters, its label, its size).

    Args:
        reply: the daemon's reply to evict: `evicted` (keys), and from this version on `entries` (the first
            of them, each `key`, `label`, `bytes`) and `bytes` (of all of them).
    """
    keys = list(reply.get("evicted") or [])
    entries = list(reply.get("entries") or [{"key": k, "label": "", "bytes": None} for k in keys])
    head = f"evicted {len(keys)} entr{'y' if len(keys) == 1 else 'ies'}"
    if reply.get("bytes") is not None and keys:
        head += f" ({byte_text(reply['bytes'])})"
    lines = [head + (":" if keys else "")]
    for e in entries:
        size = "" if e.get("bytes") is None else f"  {byte_text(e['bytes'])}"
        lines.append(f"  {str(e['key'])[:12]}  {e.get('label') or '(no label)'}{size}")
    if len(keys) > len(entries):
        lines.append(f"  ... and {len(keys) - len(entries)} more")
    return "\n".join(lines)


def kernel_name(kernel: Mapping[str, Any]) -> tuple[str, str]:
    """How views name a connection of the daemon's status (`label`, `pid`, `command`, `role`): a short
    name and the detail to show on hover.

    A notebook's kernel is named by its notebook's file name (the Jupyter server gives the kernel the
    notebook's path in JPY_SESSION_NAME: the label), with the path and pid as the detail; any other
    process by its pid and command.
    """
    label, pid = str(kernel.get("label") or ""), kernel.get("pid")
    command = str(kernel.get("command") or "")
    detail = f"pid {pid}" + (f", {label}" if label else "") + (f": {command}" if command else "")
    if kernel.get("notebook") or label.endswith(".ipynb"):
        return os.path.basename(label.rstrip("/")) or label, detail
    what = label or command
    return f"pid {pid}" + (f" {what}" if what else ""), detail


def kernel_line(kernel: Mapping[str, Any]) -> str:
    """A connection as the text statuses list it (`overmind-daemon status`, `%overmind status`): its name,
    then its role and what the name does not say, each once (a notebook's kernel: its pid, path and
    command; any other process, named by its pid and label: its command)."""
    name, detail = kernel_name(kernel)
    if name.startswith(f"pid {kernel.get('pid')}"):
        detail = str(kernel.get("command") or "")
    return f"{name}  ({kernel['role']}" + (f"; {detail})" if detail else ")")


def _round(x: float) -> int:
    return math.floor(x + 0.5)  # halves up (Python's round() goes to even)


def _fixed(x: float, digits: int) -> str:
    """`x` with `digits` decimals, ties away from zero on its exact binary value (Python's format rounds
    ties to even: 1.25 s would read "1.2 s")."""
    return str(decimal.Decimal(x).quantize(decimal.Decimal(1).scaleb(-digits), rounding=decimal.ROUND_HALF_UP))

