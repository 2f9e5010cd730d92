"""The GPU-unit ledger: which connection holds how many 1 GiB units of which device.

Every kernel of the user asks the daemon for units before it moves a model to a GPU, and keeps them
until the daemon asks for them back (lazy release). The daemon never imports torch nor touches CUDA:
kernels report the devices they see (`units_register`), or `OVERMIND_FAKE_GPUS` in the daemon's
environment defines simulated ones (README, "GPU units").

Operations (JSON requests, see kernel_server/protocol.py; all ids are integers):

- `units_register {devices: [{id, name, total_bytes, model, simulated}]}` -> `{devices: [...], simulated,
  unit_bytes, reserve_gib}`. `id` names the physical device (a CUDA UUID), `name` is how the reporting
  kernel addresses it ("cuda:0"). The first report of an id fixes its capacity. A daemon that simulates
  devices ignores the report and answers with its own.
- `units_acquire {units, devices: [id] | null, timeout_s: seconds | null, label, busy, context_units, spare}` ->
  answered when granted: `{holding, device, units, context}`; or an error `units_timeout`,
  `units_too_large`, `no_device`, `unknown_device`; or `{status: "cancelled"}`. `devices` lists the
  acceptable devices in order of preference (null: all); the first that fits is taken. A timeout of 0 never
  waits. `context_units` (default 0) are the units of the connection's CUDA context, counted with its first
  grant on each device (`context`: the units counted with this one; Note [CUDA contexts]). `spare` (default
  false) marks a holding that is asked to release before any other (Note [Spare holdings]).
- `units_release {holding}` -> `{released: units}`. `units_touch {holding, busy}` -> `{}`: marks a holding
  busy or idle and makes it the most recently used. `units_cancel {request}` -> `{cancelled, revoked}`:
  withdraws a waiting acquire (it is answered `cancelled`), or gives back the holding an acquire was
  granted if the client stopped waiting before the answer came. `units_state {}` -> the snapshot.
- Push `units_release_request {holding, device, units, waiter}`: the daemon asks the holder to give the
  holding back (`units_release`) when it can; the holder may ignore it while the holding is busy.

# Note [Units accounting]
For every device, the units of its holdings never exceed its capacity: a holding is only created by
`_grant`, which runs only when the device's free units cover the request. Capacity is the device's
memory in whole GiB minus a reserve (OVERMIND_GPU_RESERVE, GiB, default 1, for allocator slack and what
the ledger does not see), and is fixed by the first report of a device, so it never shrinks under its
holdings. Holdings and waiters belong to the connection that took them and die with it (docs/design.md
invariant 5).

# Note [CUDA contexts]
Every process that uses a device holds a CUDA context there, device memory of its own that no model's
units cover and that stays until the process ends. So a kernel's acquire says how many units its context
takes (`context_units`), and the grant that first gives the connection units on a device also makes a
context holding of those units there: one per connection and device, always busy (never asked to
release), gone with the connection. The waiter needs its units plus the context's wherever it has no
context yet, and that is what fits, what is asked for, and what is too large. What it costs, and which
kernels ask for it, is the kernel's to say (overmind_jupyter/units/devices.py, Note [Context units]).

# Note [Units fairness]
Waiting acquires are served in arrival order. One that cannot be served holds back every later one on
the device it waits for: the first of its devices where asking idle holders to release makes room (its
target; the idle holders there are asked in least-recently-used order, just enough of them), or, when
no device can make room now (its holders are busy), every device large enough for it. Later requests
for other devices go ahead. Busy holders are never asked; a holder that turns busy after it was asked
is asked again when it turns idle, if the units are still needed. A holder that neither gives its
units back nor turns busy within `ask_patience` seconds of being asked (a hung kernel) no longer counts
as making room, and the next idle holder is asked.

# Note [Spare holdings]
A spare holding is device memory kept for speed alone: the device copier's copies of entries (Note [Device
copies] in overmind_jupyter/units/copier.py), which make the next kernel's move to the device a copy within
the device. Its units count like any holding's, so no kernel is granted memory that a copy occupies; but a
spare holding is always asked to release before any kernel's idle holding, whatever their recency: a copy
costs the next hit some speed, a kernel's model costs its owner a move. Spare holdings are never busy
longer than one copy.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from . import settings
from .errors import RemoteError
from .formats import units_text
from .settings import GiB

if TYPE_CHECKING:  # payloads imports this module
    from .payloads import Connection, DeviceStatus, UnitsSnapshot, UnitsWaiter

__all__ = ["MAX_DEVICES", "MAX_UNITS", "Ledger"]

log = logging.getLogger("kernel_server")

ConnId = int
Effect = Callable[[], Any]

MAX_DEVICES = settings.MAX_FAKE_GPUS
MAX_UNITS = 1 << 20


# -- records ------------------------------------------------------------------------------------------

@dataclass(eq=False)
class Device:
    id: str
    name: str  # as the first reporter addresses it ("cuda:0")
    model: str  # "NVIDIA H200", or "simulated"
    total_bytes: int
    capacity: int
    simulated: bool
    holdings: dict[int, Holding] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return sum(h.units for h in self.holdings.values())

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(eq=False)
class Holding:
    id: int
    conn: ConnId
    device: str
    units: int
    label: str
    request_id: int
    busy: bool
    last_used: int  # the ledger's tick: higher is more recent
    push: Callable[[str, dict[str, Any]], bool]
    context: bool = False  # the connection's CUDA context on the device (Note [CUDA contexts])
    spare: bool = False  # asked to release before every other holding (Note [Spare holdings])
    granted: float = field(default_factory=time.time)
    idle_since: float = field(default_factory=time.monotonic)
    asked: float | None = None  # when a release was requested; cleared when it turns busy


@dataclass(eq=False)  # identity: a request is itself, whatever its fields
class _Waiter:
    conn: ConnId
    pid: int
    request_id: int
    devices: list[str]
    units: int
    label: str
    busy: bool
    deadline: float | None
    timeout: float | None
    answer: Callable[[dict[str, Any] | RemoteError], Any]
    push: Callable[[str, dict[str, Any]], bool]
    context: int = 0  # units of its CUDA context, counted where it has none yet (Note [CUDA contexts])
    spare: bool = False  # Note [Spare holdings]
    arrived: float = field(default_factory=time.monotonic)


# -- the ledger ---------------------------------------------------------------------------------------

class Ledger:
    """Units of every known device, their holdings and the waiting acquires.

    Args:
        kernels: describes a connection id for snapshots (`Daemon.kernel_of`).
        fake_gpus: simulated devices, as in OVERMIND_FAKE_GPUS; None for real devices reported by kernels.
        reserve_gib: GiB of each device kept out of the ledger.
        clock: monotonic seconds, for timeouts.
        timers: run a thread that expires waiting acquires; without it, call `expire()`.
        ask_patience: seconds an asked holder counts as making room; see Note [Units fairness].
    """

    def __init__(self, kernels: Callable[[ConnId], Connection] = lambda c: {"conn": c, "pid": None, "role": "?",
                                                                            "label": ""}, *,
                 fake_gpus: str | None = None, reserve_gib: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, timers: bool = True,
                 ask_patience: float = 30.0) -> None:
        self.kernels = kernels
        self.reserve_gib = reserve_gib
        self.fake_spec = fake_gpus
        self.config_error: str | None = None
        self._clock = clock
        self._timers = timers
        self.ask_patience = ask_patience
        self._cond = threading.Condition(threading.Lock())
        self._devices: dict[str, Device] = {}
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._holding_ids = itertools.count(1)
        self._ticks = itertools.count(1)
        self._reaper: threading.Thread | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        if fake_gpus:
            for i, gib in enumerate(settings.parse_fake_gpus(fake_gpus)):
                total = int(gib * GiB)
                self._devices[f"sim:{i}"] = Device(f"sim:{i}", f"cuda:{i}", "simulated", total,
                                                   self._capacity(total), True)

    @classmethod
    def from_env(cls, kernels: Callable[[ConnId], Connection]) -> Ledger:
        """The daemon's ledger, configured by OVERMIND_FAKE_GPUS and OVERMIND_GPU_RESERVE. A bad device list
        is reported once and simulates nothing, as if unset; a bad reserve does not stop the daemon either:
        every units operation then answers an error that names it (Note [Bad settings] in settings.py)."""
        fake_gpus = settings.get(settings.FAKE_GPUS) or None
        try:
            return cls(kernels, fake_gpus=fake_gpus, reserve_gib=settings.GPU_RESERVE.read())
        except settings.SettingError as exc:
            log.error("units ledger disabled: %s", exc)
            ledger = cls(kernels)
            ledger.config_error = f"{exc}; fix it and restart the daemon with `overmind-daemon stop`"
            return ledger

    @property
    def simulated(self) -> bool:
        return self.fake_spec is not None

    def _capacity(self, total_bytes: int) -> int:
        return max(0, int((total_bytes - self.reserve_gib * GiB) // GiB))

    # -- state changes (each runs its effects after the lock is released) ---------------------

    def register(self, devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Record the devices a kernel sees; returns the views of the devices it may use, in its order."""
        with self._cond:
            if self.simulated:
                return [self._view(d, d.name) for d in self._devices.values()]
            out = []
            for spec in devices:
                dev = self._devices.get(spec["id"])
                if dev is None:
                    if len(self._devices) >= MAX_DEVICES:
                        raise RemoteError("bad_request", f"the ledger holds at most {MAX_DEVICES} devices")
                    total = spec["total_bytes"]
                    dev = self._devices[spec["id"]] = Device(spec["id"], spec["name"], spec["model"], total,
                                                             self._capacity(total), spec["simulated"])
                    log.info("units: %s %s (%s), %d units", dev.id, dev.name, dev.model, dev.capacity)
                out.append(self._view(dev, spec["name"]))
            return out

    def acquire(self, conn: ConnId, pid: int, request_id: int, *, units: int, devices: list[str] | None,
                timeout: float | None, label: str, busy: bool,
                answer: Callable[[dict[str, Any] | RemoteError], Any],
                push: Callable[[str, dict[str, Any]], bool], context: int = 0, spare: bool = False) -> None:
        """Queue an acquire; `answer` is called (outside the lock) with the grant or the error, maybe
        before this returns. Raises RemoteError for a request that can never be served."""
        with self._cond:
            if not self._devices:
                raise RemoteError("no_device", "the units ledger knows no GPU: use units from a kernel that "
                                               "sees one, or start the kernel and the daemon with "
                                               "OVERMIND_FAKE_GPUS=2x16 in their environment to simulate two "
                                               "devices of 16 GiB")
            names = list(self._devices) if devices is None else devices
            unknown = [d for d in names if d not in self._devices]
            if unknown or not names:
                raise RemoteError("unknown_device", f"no device {unknown or names}; the ledger knows "
                                                    f"{self._known()}")
            now = self._clock()
            waiter = _Waiter(conn, pid, request_id, list(dict.fromkeys(names)), units, label, busy,
                             None if timeout is None else now + timeout, timeout, answer, push, context, spare, now)
            if all(self._need(waiter, d) > self._devices[d].capacity for d in waiter.devices):
                raise RemoteError("units_too_large", self._too_large(waiter))
            self._waiters.append(waiter)
            self.stats["acquires"] += 1
            effects = self._schedule()
            if waiter in self._waiters and timeout == 0:
                self._waiters.remove(waiter)
                effects.append(self._timed_out(waiter))
            elif waiter in self._waiters:
                self._start_reaper()
                self._cond.notify()
        _run(effects)

    def release(self, conn: ConnId, holding: int) -> int:
        """Give a holding back; returns its units."""
        with self._cond:
            h = self._holding(conn, holding)
            del self._devices[h.device].holdings[h.id]
            self.stats["released"] += 1
            effects = self._schedule()
        _run(effects)
        return h.units

    def touch(self, conn: ConnId, holding: int, busy: bool) -> None:
        with self._cond:
            h = self._holding(conn, holding)
            h.busy = busy
            h.last_used = next(self._ticks)
            if busy:
                h.asked = None  # see Note [Units fairness]: asked again once idle, if still needed
            else:
                h.idle_since = time.monotonic()
            effects = self._schedule()  # a busy holder may have been a waiter's target
        _run(effects)

    def cancel(self, conn: ConnId, request_id: int) -> tuple[bool, int | None]:
        """Withdraw a waiting acquire, or revoke what it was granted; (cancelled, revoked holding)."""
        effects: list[Effect] = []
        revoked = None
        with self._cond:
            waiter = next((w for w in self._waiters if w.conn == conn and w.request_id == request_id), None)
            if waiter is not None:
                self._waiters.remove(waiter)
                self.stats["cancelled"] += 1
                answer = waiter.answer
                effects.append(lambda: answer({"status": "cancelled"}))
            else:
                for dev in self._devices.values():
                    for h in list(dev.holdings.values()):
                        if h.conn == conn and h.request_id == request_id:
                            del dev.holdings[h.id]
                            revoked = h.id
                            self.stats["revoked"] += 1
            effects += self._schedule()
        _run(effects)
        return waiter is not None or revoked is not None, revoked

    def release_connection(self, conn: ConnId) -> None:
        """Drop every holding and waiter of a connection that went away (docs/design.md invariant 5)."""
        with self._cond:
            self._waiters = collections.deque(w for w in self._waiters if w.conn != conn)
            dropped = 0
            for dev in self._devices.values():
                for h in list(dev.holdings.values()):
                    if h.conn == conn:
                        del dev.holdings[h.id]
                        dropped += h.units
            if dropped:
                self.stats["released_on_disconnect"] += 1
                log.info("units: connection %d went away, %d units freed", conn, dropped)
            effects = self._schedule()
        _run(effects)

    def expire(self) -> None:
        """Answer the waiting acquires whose timeout passed, and ask more holders where asked ones did not
        answer in time (the timer thread calls this)."""
        with self._cond:
            effects = self._expire()
        _run(effects)

    # -- reads --------------------------------------------------------------------------------

    def snapshot(self) -> UnitsSnapshot:
        """Every device with its capacity, holdings (least recently used first) and waiters."""
        with self._cond:
            now = self._clock()
            mono = time.monotonic()
            devices: list[DeviceStatus] = []
            for dev in self._devices.values():
                holders = sorted(dev.holdings.values(), key=lambda h: h.last_used)
                devices.append({
                    "id": dev.id, "name": dev.name, "model": dev.model, "simulated": dev.simulated,
                    "total_bytes": dev.total_bytes, "capacity": dev.capacity, "used": dev.used, "free": dev.free,
                    "holders": [{
                        "holding": h.id, "kernel": (k := self.kernels(h.conn)), "pid": k["pid"],
                        "label": h.label, "model": h.label, "units": h.units,
                        "busy": h.busy, "idle_s": None if h.busy else round(mono - h.idle_since, 3),
                        "granted": h.granted, "release_requested": h.asked is not None, "context": h.context,
                        "spare": h.spare,
                    } for h in holders],
                })
            waiters: list[UnitsWaiter] = [
                {"kernel": self.kernels(w.conn), "model": w.label, "units": w.units,
                 "devices": [self._devices[d].name for d in w.devices], "device_ids": w.devices,
                 "waited_s": round(now - w.arrived, 3), "timeout": w.timeout} for w in self._waiters]
            return {"unit_bytes": GiB, "reserve_gib": self.reserve_gib, "simulated": self.simulated,
                    "fake_gpus": self.fake_spec, "config_error": self.config_error, "devices": devices,
                    "waiters": waiters, "stats": dict(self.stats)}

    # -- internals (lock held) ----------------------------------------------------------------

    def _view(self, dev: Device, name: str) -> dict[str, Any]:
        return {"id": dev.id, "name": name, "model": dev.model, "simulated": dev.simulated,
                "total_bytes": dev.total_bytes, "capacity": dev.capacity, "used": dev.used, "free": dev.free}

    def _known(self) -> str:
        return ", ".join(f"{d.id} ({d.name})" for d in self._devices.values()) or "none"

    def _holding(self, conn: ConnId, holding: int) -> Holding:
        for dev in self._devices.values():
            h = dev.holdings.get(holding)
            if h is not None and h.conn == conn:
                return h
        raise RemoteError("no_holding", f"this connection holds no units under holding {holding} "
                                        "(released already, or revoked by a cancel)")

    def _schedule(self) -> list[Effect]:
        """Grant what fits in arrival order and ask idle holders for room; see Note [Units fairness]."""
        effects: list[Effect] = []
        blocked: set[str] = set()
        for w in list(self._waiters):
            usable = [d for d in w.devices if d not in blocked]
            fit = next((d for d in usable if self._devices[d].free >= self._need(w, d)), None)
            if fit is not None:
                self._waiters.remove(w)
                effects.append(self._grant(w, fit))
                continue
            if w.timeout == 0:
                continue  # answered by `acquire` at once; it neither waits nor holds anyone back
            target = next((d for d in usable if self._devices[d].free + self._idle(d) >= self._need(w, d)), None)
            if target is not None:
                effects += self._ask(target, w)
                blocked.add(target)
            else:
                blocked.update(d for d in w.devices if self._devices[d].capacity >= self._need(w, d))
        return effects

    def _need(self, w: _Waiter, device: str) -> int:
        """The units `w` takes on `device`: its own, and its connection's context there if it has none yet."""
        held = w.context and any(h.context and h.conn == w.conn for h in self._devices[device].holdings.values())
        return w.units + (0 if held else w.context)

    def _idle(self, device: str) -> int:
        return sum(h.units for h in self._devices[device].holdings.values() if not h.busy)

    def _ask(self, device: str, w: _Waiter) -> list[Effect]:
        dev = self._devices[device]
        # spare holdings first (Note [Spare holdings]), then least recently used first
        idle = sorted((h for h in dev.holdings.values() if not h.busy), key=lambda h: (not h.spare, h.last_used))
        now = self._clock()
        answering = [h for h in idle if h.asked is not None and now - h.asked < self.ask_patience]
        coming = dev.free + sum(h.units for h in answering)
        need = self._need(w, device)
        effects: list[Effect] = []
        for h in idle:
            if coming >= need:
                break
            if h.asked is not None:
                continue  # asked already: making room, or given up on
            h.asked = now
            coming += h.units
            self.stats["release_requests"] += 1
            payload = {"holding": h.id, "device": device, "units": h.units,
                       "waiter": {"pid": w.pid, "model": w.label, "units": w.units}}
            effects.append(partial(h.push, "units_release_request", payload))
        return effects

    def _grant(self, w: _Waiter, device: str) -> Effect:
        """Make `w`'s holding on `device`, whose free units cover it (Note [Units accounting])."""
        context = self._need(w, device) - w.units
        if context:  # the connection's first units here: its CUDA context too (Note [CUDA contexts])
            c = Holding(next(self._holding_ids), w.conn, device, context, "CUDA context", w.request_id, True,
                        next(self._ticks), w.push, context=True)
            self._devices[device].holdings[c.id] = c
        h = Holding(next(self._holding_ids), w.conn, device, w.units, w.label, w.request_id, w.busy,
                    next(self._ticks), w.push, spare=w.spare)
        self._devices[device].holdings[h.id] = h
        self.stats["granted"] += 1
        grant = {"holding": h.id, "device": device, "units": h.units, "context": context,
                 "waited_s": round(self._clock() - w.arrived, 6)}
        answer = w.answer
        return lambda: answer(grant)

    def _expire(self) -> list[Effect]:
        now = self._clock()
        effects: list[Effect] = []
        for w in list(self._waiters):
            if w.deadline is not None and w.deadline <= now:
                self._waiters.remove(w)
                effects.append(self._timed_out(w))
        return effects + self._schedule()

    def _timed_out(self, w: _Waiter) -> Effect:
        self.stats["timeouts"] += 1
        parts = []
        for d in w.devices:
            dev = self._devices[d]
            holders = ", ".join(
                f"pid {self.kernels(h.conn).get('pid')} {h.label or 'model'} {h.units} ({_holder_state(h)})"
                for h in sorted(dev.holdings.values(), key=lambda h: h.last_used)) or "nobody"
            parts.append(f"{dev.name} has {dev.free} of {dev.capacity} units free, held by {holders}")
        waited = "no waiting (timeout 0)" if w.timeout == 0 else f"{w.timeout:g} s"
        error = RemoteError("units_timeout", (
            f"{units_text(w.units)} for {w.label or 'a model'} {'was' if w.units == 1 else 'were'} not free within "
            f"{waited}: {'; '.join(parts)}. "
            "Busy models (inside `with units.using(...)`, or moved there by their own `.to()`) are never asked "
            "back: leave their using blocks, or free models with `units.release(model)` or `model.to('cpu')` in "
            "the kernels listed; `units.place` also takes a longer timeout"))
        answer = w.answer
        return lambda: answer(error)

    def _too_large(self, w: _Waiter) -> str:
        devs = [self._devices[d] for d in w.devices]
        biggest = max(devs, key=lambda d: d.capacity)
        where = ""
        if biggest.simulated:  # by the daemon's setting, or by a kernel's own, whose value the daemon never sees
            where = (f" (simulated by the daemon's OVERMIND_FAKE_GPUS={self.fake_spec})" if self.simulated
                     else " (simulated by the OVERMIND_FAKE_GPUS of the kernel that first reported it)")
        context = self._need(w, biggest.id) - w.units
        asked = f"{units_text(w.units)} requested" + (f" and {context} for this kernel's CUDA context"
                                                      if context else "")
        return (f"{asked} but the largest of {', '.join(d.name for d in devs)} has "
                f"{units_text(biggest.capacity)}: {biggest.total_bytes / GiB:.1f} GiB minus the "
                f"{self.reserve_gib:g} GiB reserve{where}. Use a larger device, or lower "
                "OVERMIND_GPU_RESERVE and restart the daemon with `overmind-daemon stop`")

    def _start_reaper(self) -> None:
        if self._timers and self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="overmind-units-timer", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        """While requests wait: answer them at their deadlines, and look again at least once a second
        (asked holders that did not answer, see Note [Units fairness])."""
        while True:
            with self._cond:
                if not self._waiters:
                    self._cond.wait()
                    continue
                now = self._clock()
                deadline = min((w.deadline for w in self._waiters if w.deadline is not None),
                               default=now + 1.0)
                self._cond.wait(max(0.0, min(deadline - now, 1.0)))
                effects = self._expire()
            _run(effects)

    def check_config(self) -> None:
        """Raise the configuration error (a bad OVERMIND_GPU_RESERVE) for every units request."""
        if self.config_error is not None:
            raise RemoteError("bad_config", self.config_error)


def _holder_state(h: Holding) -> str:
    if h.context:
        return "held while its kernel runs"
    return "busy" if h.busy else "idle, asked to release" if h.asked else "idle"


def _run(effects: list[Effect]) -> None:
    for effect in effects:
        try:
            effect()
        except Exception:  # a reply to a peer that went away must not stop the others
            log.exception("units: answering a request failed")


