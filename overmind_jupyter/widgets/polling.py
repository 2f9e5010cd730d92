"""The one background thread that keeps every notebook widget of this kernel live.

# Note [Widget polling]
A live widget subscribes to a feed: a key and a function that reads one snapshot ("status": the daemon's
status through this kernel's own connection; "units": the units ledger; ("gate", id): an adapter gate's
state, read in-process). One daemon thread, `overmind-widgets`, reads each feed that has an active
subscriber once per tick (`INTERVAL`, or at once after `kick()`), and hands the snapshot, or the exception
that reading it raised, to each subscriber, which turns it into trait values.

- Never block the kernel: reading is a socket round trip of about a millisecond, or a snapshot under a
  gate's condition; nothing waits on the kernel's main thread, and the main thread never waits on this one.
- One writer: every trait of our own widgets is written on this thread, inside `hold_sync`, so that a
  snapshot reaches the frontend as one update. Controls' handlers (evict, switch, mix, generate) run the
  action on a thread of their own, leave what the user must see in a plain attribute, and `kick()`; the
  next tick shows it. ipywidgets sends trait changes as comm messages on the kernel's iopub socket, which
  ipykernel accepts from any thread (it hands the send to its IO thread), so updates reach the frontend
  while a cell runs as well as between cells.
- Stop when closed: `widget.close()` ends its subscriptions; the thread ends when none is left, and at
  interpreter exit. A subscription whose widget is open but shown nowhere (its output cleared, its notebook
  closed: the views tell the kernel when they go, see widgets/live.py) is skipped until a view is back.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

from .._lazy import lazy_instance

__all__ = ["INTERVAL", "Poller", "Subscription", "poller"]

log = logging.getLogger("overmind")

#: Seconds between two reads of a feed; a widget shows a change within about this long.
INTERVAL = 0.5

Deliver = Callable[[Any, "Exception | None"], None]


class Subscription:
    """One widget's interest in one feed; `close()` ends it (idempotent).

    Args:
        poller: the poller it belongs to.
        key: the feed's key; subscribers of one key share one read per tick.
        fetch: reads a snapshot of the feed.
        deliver: called on the poller's thread with `(snapshot, None)` or `(None, exception)`.
        active: whether to deliver now (a widget shown nowhere is skipped).
    """

    def __init__(self, poller: Poller, key: Hashable, fetch: Callable[[], Any], deliver: Deliver,
                 active: Callable[[], bool]) -> None:
        self.poller = poller
        self.key = key
        self.fetch = fetch
        self.deliver = deliver
        self.active = active
        self.closed = False
        self.delivered = 0  # snapshots handed over so far (for tests and diagnostics)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.poller._remove(self)


class Poller:
    """Reads each feed that has an active subscriber once per `interval` on one daemon thread.

    See Note [Widget polling].

    Args:
        interval: seconds between ticks.
    """

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._subs: dict[int, Subscription] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def subscribe(self, key: Hashable, fetch: Callable[[], Any], deliver: Deliver, *,
                  active: Callable[[], bool] = lambda: True) -> Subscription:
        """Deliver snapshots of the feed `key` (read by `fetch`) from the next tick on; starts the thread."""
        sub = Subscription(self, key, fetch, deliver, active)
        with self._lock:
            self._subs[next(self._ids)] = sub
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="overmind-widgets", daemon=True)
                self._thread.start()
        self.kick()
        return sub

    def kick(self) -> None:
        """Run the next tick now (after an action whose effect the user waits to see)."""
        self._wake.set()

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout: float = 1.0) -> None:
        """End the thread (at interpreter exit); subscriptions stay, and no new thread starts."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            for sub_id, other in list(self._subs.items()):
                if other is sub:
                    del self._subs[sub_id]

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopped or not self._subs:
                    self._thread = None
                    return
                subs = list(self._subs.values())
            self._wake.clear()
            self._tick(subs)
            self._wake.wait(self.interval)

    def _tick(self, subs: list[Subscription]) -> None:
        groups: dict[Hashable, list[Subscription]] = {}
        for sub in subs:
            try:
                if not sub.closed and sub.active():
                    groups.setdefault(sub.key, []).append(sub)
            except Exception:  # a broken predicate must not stop the other widgets
                log.exception("overmind widget: active() of %r failed", sub.key)
        for members in groups.values():
            try:
                snapshot, error = members[0].fetch(), None
            except Exception as exc:  # noqa: BLE001 - shown by the widget: the daemon is down, the gate is closed, ...
                snapshot, error = None, exc
            for sub in members:
                if sub.closed:
                    continue
                try:
                    sub.deliver(snapshot, error)
                    sub.delivered += 1
                except Exception:
                    log.exception("overmind widget: updating from %r failed", sub.key)


def _new_poller() -> Poller:
    made = Poller()
    atexit.register(made.stop)
    return made


poller = lazy_instance(_new_poller)  # this process's poller, created on first use
