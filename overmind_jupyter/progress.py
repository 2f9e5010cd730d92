"""How long work shows its progress: in the cell (tqdm, named by the model) and to the daemon (for the side
panel and the status widgets); and the hit times the daemon's time-saved figures need.

# Note [Load progress]
A first load runs the library's own loading, which shows its own tqdm bars (transformers' "Loading
weights"; `tqdm.auto`, so an ipywidgets bar in a notebook). While a miss loads, `loading(...)` makes the
bars that transformers creates on this thread (through its public `set_tqdm_hook`) carry the model's
name, and passes their progress on to the daemon as `progress` reports of the load's key (Note [Progress]
in kernel_server/store.py), sent without waiting for the answer and at most every `REPORT_S`, the first
once the load has run that long: a load over sooner (a same-dtype 1B load takes 0.1 s) is too short to
watch, and reports nothing, not even at its bar's close, since each report wakes the daemon (0.1-0.4 ms
of the call on these machines). Never waiting long for the connection either: a bar's close can run
inside a send of its own thread (Note [Requests from finalizers] in kernel_server/client.py), and a
report that cannot be sent at once is dropped. The copy of a miss into shared memory reports the same
way (publishing.py). Bars of other threads, and bars outside a miss, are left exactly as they were. A
failure to report is ignored: progress never fails a load.

# Note [Hit times]
The daemon logs each hit with the plain load time it saved (Note [Load time saved] in
kernel_server/store.py); the hit's own time, the whole wait of the call from its start to its return, is
measured here and sent later, never on the hit's path: it waits in `_hit_times` until the next request
that can carry it without a round trip of its own (a status read, a miss, the end of a cell or of the
process), or until SEND_HITS hits wait (a loop of hits in one cell or script), which the hit that makes
them so many sends without waiting for the answer. So none is pushed out of `_hit_times` (2,000 hits in
one script once reported only its last 1,000), and the daemon counts every hit it gets a time for.

# Note [Miss times]
A miss's cost is timed from the same start as a hit's: the call's start. `MissClock` takes the load
itself (`load_s`) and, as the publish is sent, the whole wait so far (`waited_s`, the call returns right
after); `cache_s` is the rest (key, lookup, staging, packing, publishing). The publish carries the three
(kernel_server/store.py Note [Load time saved]), and the cell says the same numbers: `tell_miss`. A
lookup that waited for another load of the same entry, which then ended without a result (its kernel
killed or interrupted, its load raised), is part of `cache_s`: without the cache this call would not have
waited. The cell says how much of it that wait was (`queued_s`), so that it does not read as slow caching.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kernel_server.formats import miss_text, seconds_text
from kernel_server.operations import Op
from kernel_server.payloads import MissTimes

__all__ = ["REPORT_S", "MissClock", "Reporter", "flush_hit_times", "hit", "loading", "model_name", "remove_hook",
           "tell_miss"]

REPORT_S = 0.25  # at most one progress report per load this often
QUEUED_S = 0.5  # a lookup that took this long waited for another load (an answer takes milliseconds)
_MAX_HITS = 1000  # hit times kept unsent at most: the most a `hits` report carries
SEND_HITS = 250  # hit times waiting that a hit sends at once (Note [Hit times])

_hit_times: collections.deque[dict[str, Any]] = collections.deque(maxlen=_MAX_HITS)
_current = threading.local()  # the Reporter of the miss this thread loads
_hook_lock = threading.Lock()
_installed: tuple[Any, Any] | None = None  # (our hook, the one it chains to)


def model_name(label: str) -> str:
    """The model a load's label names, short: "AutoModelForCausalLM('/m/llama-0.1b', dtype=...)" ->
    "llama-0.1b", with the subfolder that follows it ("sd/unet": Note [Labels tell entries apart] in
    keys.py); a call without a checkpoint, labelled by its arguments ("make(seed=3)"), by its function
    ("make")."""
    head, _, inner = label.partition("(")
    quoted = _QUOTED.match(inner)  # the checkpoint, as repr wrote it (a comma in it too)
    if quoted is None:
        return head
    written = quoted.group(0)[1:-1]
    # "." and "..": the folder's own name, in the caller's cwd (where its label was made, and this runs)
    name = os.path.basename(os.path.abspath(written)) if written.strip("/") else label
    sub = _SUBFOLDER.match(inner, quoted.end())
    folder = sub.group(1)[1:-1].strip("/") if sub else ""
    return f"{name}/{folder}" if folder else name


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|" + r'"(?:[^"\\]|\\.)*"')
_SUBFOLDER = re.compile(r", subfolder=(" + _QUOTED.pattern + ")")


class Reporter:
    """Passes one load's progress to the daemon (fire and forget, at most every `REPORT_S`, the first
    `REPORT_S` after it is made: Note [Load progress]).

    Args:
        client: the connection that loads `key`.
        key: the load's key.
        name: the model's short name, for the bars and the reports.
    """

    def __init__(self, client: Any, key: str, name: str) -> None:
        self.client = client
        self.key = key
        self.name = name
        self._last = time.monotonic()  # (as if it had reported as it was made)
        self._sent = False

    def report(self, what: str, done: float, total: float, unit: str = "it", *, force: bool = False) -> None:
        """Report now if the last report is `REPORT_S` old; `force`: now, if any was sent (a bar's end)."""
        now = time.monotonic()
        if now - self._last < REPORT_S and not (force and self._sent):
            return
        self._last, self._sent = now, True
        # Never waiting for the connection: a bar's close may run inside one of this thread's sends
        # (Note [Requests from finalizers] in kernel_server/client.py).
        try:
            self.client.try_submit(Op.PROGRESS, key=self.key, label=f"{what} {self.name}", done=max(0.0, float(done)),
                                   total=max(0.0, float(total or 0)), unit=unit)
        except Exception:  # noqa: BLE001 - progress never fails a load (Note [Load progress])
            pass


@contextlib.contextmanager
def loading(client: Any, key: str, label: str) -> Iterator[Reporter]:
    """While the block runs this thread's miss of `key`: name transformers' bars by the model and pass
    their progress to the daemon (Note [Load progress])."""
    reporter = Reporter(client, key, model_name(label))
    _install_hook()
    previous = getattr(_current, "reporter", None)
    _current.reporter = reporter
    try:
        yield reporter
    finally:
        _current.reporter = previous


def current() -> Reporter | None:
    """The reporter of the miss this thread runs, if any."""
    return getattr(_current, "reporter", None)


def _install_hook() -> None:
    """Chain our hook before transformers' current one, once (only if transformers is imported: a load
    through it imported it already). `remove_hook` gives the previous one back."""
    global _installed
    import sys

    logging = sys.modules.get("transformers.utils.logging")
    if _installed is not None or logging is None or not hasattr(logging, "set_tqdm_hook"):
        return
    with _hook_lock:
        if _installed is not None:
            return
        previous = logging.set_tqdm_hook(None)

        def hook(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            reporter = current()
            if reporter is not None:
                kwargs = dict(kwargs)
                kwargs["desc"] = f"{kwargs.get('desc') or 'Loading'} ({reporter.name})"
            bar = previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)
            if reporter is not None and hasattr(bar, "n") and hasattr(bar, "update"):
                _relay(bar, reporter, str(kwargs["desc"]))
            return bar

        logging.set_tqdm_hook(hook)
        _installed = (hook, previous)


def remove_hook() -> None:
    """Give transformers back the tqdm hook it had before ours (`disable()`: docs/design.md invariant 6).
    A hook set since, on top of ours, stays: ours then keeps passing its bars through unchanged."""
    global _installed
    import sys

    with _hook_lock:
        logging = sys.modules.get("transformers.utils.logging")
        if _installed is None or logging is None:
            return
        ours, previous = _installed
        now = logging.set_tqdm_hook(previous)
        if now is ours:
            _installed = None
        else:
            logging.set_tqdm_hook(now)


def _relay(bar: Any, reporter: Reporter, what: str) -> None:
    """Send `bar`'s progress to the daemon as it moves (tqdm's iteration calls `update` at each refresh)."""
    update, close = bar.update, bar.close
    what = what.rsplit(" (", 1)[0]

    def relayed_update(n: float = 1) -> Any:
        out = update(n)
        reporter.report(what, bar.n, bar.total or 0)
        return out

    def relayed_close() -> Any:
        reporter.report(what, bar.n, bar.total or 0, force=True)
        return close()

    bar.update, bar.close = relayed_update, relayed_close


# -- miss times (Note [Miss times]) ------------------------------------------------------------------------

@dataclass
class MissClock:
    """The times of one miss (Note [Miss times]).

    Args:
        started: `time.perf_counter()` at the call's start.
        queued_s: how long its lookup waited for another load of the entry, which ended without a result.
        load_s: the load itself, once it returned (with the import of transformers' loading module a miss
            made for it: Note [Staged conversions] in staging.py).
    """

    started: float
    queued_s: float = 0.0
    load_s: float = 0.0

    def times(self) -> MissTimes:
        """The miss's times now: `waited_s` since the call's start, `load_s`, and `cache_s`, the rest."""
        waited = round(max(time.perf_counter() - self.started, self.load_s), 4)
        load = round(self.load_s, 4)
        return {"waited_s": waited, "load_s": load, "cache_s": round(waited - load, 4)}


def tell_miss(label: str, times: MissTimes, queued_s: float = 0.0) -> None:
    """Say in the cell what a miss cost, in the numbers the daemon got (Note [Miss times]):
    "overmind: cached llama-0.1b in 20.1 s: loading 8.0 s + caching 12.1 s"."""
    queued = (f" (the caching includes {seconds_text(queued_s)} of waiting for another load of it, which ended "
              "without a result)") if queued_s >= QUEUED_S else ""
    print(f"overmind: cached {model_name(label)} in {miss_text(times)}{queued}", file=sys.stderr, flush=True)


# -- hit times (Note [Hit times]) --------------------------------------------------------------------------

def hit(key: str, seconds: float, client: Any = None) -> None:
    """Remember that a hit of `key` took `seconds` (sent later by `flush_hit_times`, at once through `client`
    once SEND_HITS wait: Note [Hit times])."""
    _hit_times.append({"key": key, "t": time.time(), "hit_s": seconds})
    if len(_hit_times) >= SEND_HITS:
        flush_hit_times(client)


def flush_hit_times(client: Any = None) -> None:
    """Send the hit times not sent yet, without waiting for the answer (Note [Hit times])."""
    if not _hit_times:
        return
    if client is None:
        from kernel_server.client import existing_shared_client

        client = existing_shared_client()
        if client is None:
            return
    batch = []
    while _hit_times:
        try:
            batch.append(_hit_times.popleft())
        except IndexError:
            break
    try:
        client.submit(Op.HITS, hits=batch)
    except Exception:  # noqa: BLE001 - the daemon went away: these hits went with its log
        pass


atexit.register(flush_hit_times)
