"""The gate's admission: a semaphore keyed by the active adapter set, with aging and an exclusive side.

# Note [Keyed admission]

Every request holds a key while it runs: `ROUTED` for requests whose rows are routed per row (see Note
[Adapter routing]; they all share the model), or the name of the one adapter the model must be switched to
(switched mode: merged adapters, DoRA, layer types PEFT refuses in mixed batches). The rules, all under one
condition:

- Requests with the key of the running requests enter at once and share the model.
- A different key waits until the model is drained (no holder); the switch to it (`set_adapter`, merge, ...)
  runs with no holder, and nobody enters during it.
- When the model drains, the key of the oldest waiter goes next (first come, first served between keys).
- Aging: once a waiter of another key has waited `max_wait_s`, the running key stops admitting newcomers, so
  the model drains and that waiter goes next. No key starves: a waiter waits at most about `max_wait_s` plus
  the longest request already running.
- The exclusive side (structural changes) waits for the holders to drain and holds every newcomer meanwhile.
  It is reentrant in its thread, and refuses to start inside a request of the same gate, which would deadlock;
  a request from inside an exclusive section of its own thread is refused for the same reason.

Every wait ends in `finally`, so an exception (in a switch, in a request, in an exclusive body) leaves the
counts right and wakes the waiters.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

from ._errors import GateClosedError, GateDeadlockError

__all__ = ["ROUTED", "KeyedSemaphore", "Ticket"]

#: The key of requests routed per row. It is no adapter name (the brackets keep it apart).
ROUTED = "<routed>"

# The semaphores the current context holds a ticket of (by id), to refuse exclusive sections that would
# deadlock.
_HELD: ContextVar[frozenset[int]] = ContextVar("overmind_adapter_held", default=frozenset())


@dataclass(eq=False)
class _Waiter:
    key: str
    labels: tuple[str, ...]
    since: float


@dataclass(eq=False)
class Ticket:
    """One admitted request: its key, the adapters it counts for, and how long it waited."""

    key: str
    labels: tuple[str, ...]
    waited_s: float
    _released: bool = field(default=False, repr=False)


class KeyedSemaphore:
    """Admits requests that share a key together, switches key only when drained, and ages waiters.

    See Note [Keyed admission].

    Args:
        switch (`Callable[[str | None, str], bool | None]`):
            Called with `(previous_key, new_key)` when the model must change key; it runs with no holder.
            `previous_key` is `None` when the model's state is not known (at start, after an exclusive
            section, after a failed switch). It returns False when the model was already right for the new
            key (nothing changed): such a call is not counted in `state()["switches"]`, which counts the
            switches a user would call switches.
        max_wait_s (`float`):
            The aging bound: once a waiter of another key has waited this long, the running key admits no
            more.
        clock (`Callable[[], float]`, *optional*):
            Monotonic clock, for tests.
    """

    def __init__(
        self,
        switch: Callable[[str | None, str], bool | None],
        *,
        max_wait_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._switch = switch
        self._clock = clock
        self.max_wait_s = float(max_wait_s)
        self._cond = threading.Condition(threading.Lock())
        self._applied: str | None = None  # the key the model is set to; None: unknown
        self._key: str | None = None  # the key of the holders (meaningful while _holders > 0)
        self._holders = 0
        self._switching = False
        self._in_flight: Counter[str] = Counter()
        self._waiters: list[_Waiter] = []
        self._max_wait: dict[str, float] = {}
        self._exclusive_owner: int | None = None
        self._exclusive_depth = 0
        self._exclusive_waiting = 0
        self._closed = False
        self._switches = 0

    # -- requests --------------------------------------------------------------------------------------------

    def _may_enter(self, w: _Waiter, now: float) -> bool:
        if self._exclusive_owner is not None or self._exclusive_waiting or self._switching:
            return False
        if self._holders:
            if w.key != self._key:
                return False
            # Aging: a waiter of another key, older than us and past the bound, stops the sharing.
            limit = min(now - self.max_wait_s, w.since)
            return not any(v.key != w.key and v.since <= limit for v in self._waiters)
        return self._waiters[0] is w or self._waiters[0].key == w.key

    def acquire(self, key: str, labels: tuple[str, ...]) -> Ticket:
        """Wait until a request of `key` may run, switching the model if needed.

        Args:
            key (`str`):
                `ROUTED`, or the adapter the model must be switched to.
            labels (`tuple[str, ...]`):
                The adapters this request counts for in `state()` (its distinct row names).
        """
        w = _Waiter(key, labels, self._clock())
        with self._cond:
            if self._closed:
                raise GateClosedError(
                    "the adapter gate is closed; create a new one with adapters.gate(model)"
                )
            if self._exclusive_owner == threading.get_ident():
                raise GateDeadlockError(
                    "a request of the gate was made inside an exclusive section of the same thread (`with "
                    "gate.exclusive():`, or a change the gate makes exclusive such as `with "
                    "peft_model.disable_adapter():`), and would wait for that section to end: make the request "
                    "after the block, or call the model directly inside it"
                )
            self._waiters.append(w)
            try:
                while True:
                    if self._closed:
                        raise GateClosedError("the adapter gate was closed while this request waited")
                    if self._may_enter(w, self._clock()):
                        break
                    self._cond.wait()
            finally:
                self._waiters.remove(w)
                # Whoever was behind us may now be the oldest, or may share our key.
                self._cond.notify_all()
            self._key = key
            self._holders += 1
            if self._applied != key:
                self._switching = True
                previous, self._applied = self._applied, None
                self._cond.release()
                try:
                    changed = self._switch(previous, key)
                except BaseException:
                    self._cond.acquire()
                    self._holders -= 1
                    self._switching = False
                    self._cond.notify_all()
                    raise
                self._cond.acquire()
                self._applied = key
                self._switching = False
                self._switches += changed is not False
                self._cond.notify_all()
            waited = self._clock() - w.since
            for label in labels:
                self._in_flight[label] += 1
                if waited > self._max_wait.get(label, 0.0):
                    self._max_wait[label] = waited
        return Ticket(key, labels, waited)

    def release(self, ticket: Ticket) -> None:
        """Give back what `acquire` returned; a second release of the same ticket does nothing."""
        with self._cond:
            if ticket._released:
                return
            ticket._released = True
            self._holders -= 1
            for label in ticket.labels:
                self._in_flight[label] -= 1
                if not self._in_flight[label]:
                    del self._in_flight[label]
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self, key: str, labels: tuple[str, ...]) -> Iterator[Ticket]:
        """`acquire` on entry, `release` on exit, and mark the context as holding (see `exclusive`)."""
        ticket = self.acquire(key, labels)
        token = _HELD.set(_HELD.get() | {id(self)})
        try:
            yield ticket
        finally:
            _HELD.reset(token)
            self.release(ticket)

    # -- the exclusive side ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Wait for the holders to drain and hold every newcomer; yields `True` in the outermost section.

        The model's key is forgotten on exit (the body may have changed anything), so the next request
        re-applies.
        """
        me = threading.get_ident()
        with self._cond:
            if self._exclusive_owner == me:
                self._exclusive_depth += 1
                reentered = True
            else:
                reentered = False
                if self.held_here():
                    raise GateDeadlockError(
                        "an exclusive operation (load, delete, mix, merge, ...) was started inside a request "
                        "of the same gate, and would wait for itself: run it outside `gate.use(...)` and "
                        "callbacks"
                    )
                if self._closed:
                    raise GateClosedError(
                        "the adapter gate is closed; create a new one with adapters.gate(model)"
                    )
                self._exclusive_waiting += 1
                try:
                    while self._exclusive_owner is not None or self._holders or self._switching:
                        self._cond.wait()
                finally:
                    self._exclusive_waiting -= 1
                    self._cond.notify_all()
                self._exclusive_owner = me
                self._exclusive_depth = 1
        try:
            yield not reentered
        finally:
            with self._cond:
                self._exclusive_depth -= 1
                if not self._exclusive_depth:
                    self._exclusive_owner = None
                    self._applied = None
                self._cond.notify_all()

    def exclusive_here(self) -> bool:
        """Whether the current thread holds the exclusive side (it may change the model)."""
        return self._exclusive_owner == threading.get_ident()

    def held_here(self) -> bool:
        """Whether the current context (thread, task) holds a ticket of this semaphore."""
        return id(self) in _HELD.get()

    def close(self) -> None:
        """Refuse new requests and fail the waiting ones with `GateClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def forget(self) -> None:
        """Forget which key the model is set to (call with the exclusive side held)."""
        with self._cond:
            self._applied = None

    # -- reading ---------------------------------------------------------------------------------------------

    def state(self) -> dict[str, object]:
        """A JSON-serialisable snapshot: key, in-flight and queued counts per adapter, longest waits."""
        with self._cond:
            now = self._clock()
            queued: Counter[str] = Counter()
            oldest: dict[str, float] = {}
            for w in self._waiters:
                for label in w.labels:
                    queued[label] += 1
                    oldest[label] = max(oldest.get(label, 0.0), now - w.since)
            return {
                "key": self._key if self._holders else None,
                "applied": self._applied,
                "holders": self._holders,
                "in_flight": dict(sorted(self._in_flight.items())),
                "queued": dict(sorted(queued.items())),
                "oldest_wait_s": dict(sorted(oldest.items())),
                "max_wait_s": dict(sorted(self._max_wait.items())),
                "exclusive": self._exclusive_owner is not None,
                "exclusive_waiting": self._exclusive_waiting,
                "switches": self._switches,
                "closed": self._closed,
            }

    @property
    def idle(self) -> bool:
        """No holder, no waiter, no exclusive section."""
        with self._cond:
            return not (self._holders or self._waiters or self._exclusive_owner is not None)
