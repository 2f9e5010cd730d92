"""GPU residency in the kernel: models sit on devices under units leased from the daemon's ledger.

# Note [Residency]
`place` acquires the units a model needs on a device (kernel_server/ledger.py), moves the model there
and leaves it there after use: the units are given back lazily, when the daemon asks because another
holder waits for them, when the model is released explicitly or garbage-collected, or with the kernel's
connection. `using` marks a model busy for the length of a block; the daemon never asks a busy holding
to release, and this kernel never moves a busy model even if asked (the request is void once the daemon
hears the model turned busy, and repeated when it turns idle). A model released while idle is placed
again, on the same device, when the next `using` block enters.

Threads: acquires are granted busy, so no release request can arrive before a placement is recorded.
Release requests arrive on the client's push thread and are carried out by this module's own worker
thread, so that a slow device-to-host copy never holds up other pushes; a placement's lock guards its
busy count and its release, and no lock is held while waiting for units. On a simulated device nothing
moves (there is no CUDA; the device copier's stand-in, OVERMIND_DEVICE_COPIER=cpu, fills a copy on the
CPU instead), while the accounting, LRU order and release requests are the same.

# Note [Held placements]
A cached result's own `.to("cuda")` (Note [Moves of cached results] in placement.py) places it `held`: as
torch's `.to` leaves a model on the device until the kernel moves or frees it, the placement counts as busy
from the move on (one of its busy count is its own), so the ledger never asks for its units back and a
model being trained is never moved to the CPU under its optimizer. `release` and the model's collection
give them back; `using` blocks nest on it as on any placement.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernel_server import lifecycle, settings
from kernel_server.client import Client, Response, interrupts_held, shared_client
from kernel_server.errors import DaemonError, DaemonUnavailable, RemoteError
from kernel_server.formats import units_text
from kernel_server.operations import Op
from kernel_server.payloads import Grant

from .._lazy import lazy_instance
from ._errors import (
    ModelBusyError,
    ModelTooLargeError,
    NoDeviceError,
    NotPlacedError,
    UnitsError,
    UnitsTimeout,
)
from .devices import context_units, local_devices, model_label, modules_of, units_for

if TYPE_CHECKING:
    from .transfer import Transfer

__all__ = ["Residency", "instance", "moving", "moving_now"]

log = logging.getLogger("overmind")

# This thread moves a model for the units or the cache now: a `.to` or `.cuda` called meanwhile is the
# library's own, never routed through the ledger again (Note [Moves of cached results] in placement.py).
_moving: contextvars.ContextVar[bool] = contextvars.ContextVar("overmind_moving", default=False)


@contextlib.contextmanager
def moving() -> Iterator[None]:
    """Mark this thread (its context) as moving a model for the units or the cache, for the block: the
    `.to` and `.cuda` called inside reach the library's own method (Note [Moves of cached results] in
    placement.py)."""
    token = _moving.set(True)
    try:
        yield
    finally:
        _moving.reset(token)


def moving_now() -> bool:
    """Whether this thread is inside `moving`."""
    return _moving.get()


_GRACE = 30.0  # seconds past the daemon's own timeout before the client stops waiting for its answer
_TOLD_S = 2.0  # a wait for units this long is told in the cell
_ERRORS: dict[str, type[UnitsError]] = {"units_timeout": UnitsTimeout, "units_too_large": ModelTooLargeError,
                                        "no_device": NoDeviceError, "unknown_device": NoDeviceError}


@dataclass(frozen=True)
class Device:
    """A device as this kernel addresses it, and its ledger entry."""

    id: str
    name: str
    simulated: bool
    capacity: int
    model: str


@dataclass(eq=False)  # one per holding, compared by identity
class Placement:
    """A model's units on a device (one ledger holding) and, on a real device, its transfer."""

    model_ref: weakref.ref[Any]
    holding: int
    device: Device
    units: int
    label: str
    client: Client
    transfer: Transfer | None
    busy: int
    held: bool = False  # one of `busy` is the placement's own, until released (Note [Held placements])
    released: bool = False  # the model was moved back (or collected) and its units given back
    orphaned: bool = False  # the connection that held the units is gone (the daemon restarted); the model
    # is where it was, without units, until it is placed again or released
    placed: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def live(self) -> bool:
        """It holds units now."""
        return not self.released and not self.orphaned

    def describe(self) -> dict[str, Any]:
        return {"holding": self.holding, "model": self.label, "device": self.device.name, "units": self.units,
                "busy": self.busy > 0, "simulated": self.device.simulated, "placed": self.placed,
                "kept_host_tensors": self.transfer.kept if self.transfer else 0}


@dataclass
class _Home:
    """Where a model was last placed, so that `using` can place it again after a release."""

    device: str
    units: int
    label: str
    reuse_host: bool


class Residency:
    """This kernel's placements. One per process (`instance()`); see Note [Residency]."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._devices: list[Device] = []
        self._daemon_only: str | None = None  # what the daemon simulates for itself alone (Note [Simulated here])
        self._by_holding: dict[int, Placement] = {}
        self._by_model: weakref.WeakKeyDictionary[Any, Placement] = weakref.WeakKeyDictionary()
        self._homes: weakref.WeakKeyDictionary[Any, _Home] = weakref.WeakKeyDictionary()
        self._model_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
        # ("asked", holding id) from the daemon, or ("gone", placement) from a collected model's finalizer
        self._work: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)

    # -- the public operations --------------------------------------------------------------

    def place(self, model: Any, device: Any = None, *, units: int | None = None, timeout: float | None = None,
              label: str | None = None, reuse_host: bool = True, held: bool = False) -> str:
        _check_model(model)
        if units is not None and (not isinstance(units, int) or isinstance(units, bool) or units < 1):
            raise UnitsError(f"units must be a positive integer, not {units!r}")
        with self._model_lock(model):
            current = self._by_model.get(model)
            # busy from now on, until released (Note [Held placements]); once, however often it is moved
            own = held and not (current is not None and current.live and current.held)
            placement = self._place(model, device, units, timeout, label, reuse_host, busy=own)
            if own:
                placement.held = True
            return placement.device.name

    @contextlib.contextmanager
    def using(self, model: Any) -> Iterator[Any]:
        placement = self._enter(model)
        try:
            yield model
        finally:
            self._leave(placement)

    def release(self, model: Any) -> bool:
        placement = self._by_model.get(model)
        if placement is None:
            return False
        return self._release(placement, "released", only_if_idle=False)

    def device_of(self, model: Any) -> str | None:
        placement = self._by_model.get(model)
        return placement.device.name if placement is not None and placement.live else None

    def placed(self) -> list[Any]:
        """The models this kernel has placed now."""
        return [model for model, placement in list(self._by_model.items()) if placement.live]

    def grantable(self, device: Any) -> int:
        """The most units one model can hold on `device`: its capacity, less this kernel's CUDA context.

        Raises:
            UnitsError: no ledger, or no such device here.
        """
        _, devices = self._bind()
        found = self._resolve(device, devices)[0]
        return found.capacity - context_units(found.simulated)

    def state(self) -> dict[str, Any]:
        """The ledger seen from this kernel; a read, which starts no daemon (Note [Reads start no daemon]).

        Raises:
            UnitsError: no daemon runs, or the ledger cannot be read.
        """
        client, devices = self._bind(spawn=False)
        try:
            snap: dict[str, Any] = dict(client.request(Op.UNITS_STATE, timeout=30).payload)  # with this kernel's facts
        except RemoteError as exc:
            raise _units_error(exc) from None
        except DaemonError as exc:
            raise UnitsError(f"cannot read the units ledger: {exc}") from exc
        here = {d.id: d.name for d in devices}
        with self._lock:
            mine = dict(self._by_holding)
        for dev in snap["devices"]:
            dev["here"] = here.get(dev["id"])
            for holder in dev["holders"]:
                holder["mine"] = holder["kernel"].get("conn") == client.conn_id
                placement = mine.get(holder["holding"]) if holder["mine"] else None
                if placement is not None:
                    holder["kept_host_tensors"] = placement.transfer.kept if placement.transfer else 0
        snap["kernel"] = {"pid": os.getpid(), "conn": client.conn_id,
                          "placements": [p.describe() for p in mine.values() if p.live],
                          "events": list(self.events)}
        return snap

    # -- connection and devices -------------------------------------------------------------

    # Note [Reads start no daemon]
    # What only reads the ledger (`units.state()`, `%overmind units` with or without --json, the units
    # widget's polls) never starts a daemon, as `%overmind status` and `%overmind evict` start none: a user
    # who stopped the daemon, or never started one, is told that none runs, and its absence is the answer
    # (no kernel holds units). A placement starts one, as a load does.
    def _bind(self, *, spawn: bool = True) -> tuple[Client, list[Device]]:
        """The kernel's connection and the devices it may use; a new connection (the daemon restarted)
        orphans the placements of the old one, whose units the daemon freed with it. Without `spawn`, no
        daemon is started (Note [Reads start no daemon])."""
        try:
            client = shared_client(spawn=spawn)
        except DaemonError as exc:
            if not spawn and isinstance(exc, DaemonUnavailable):
                home = lifecycle.state_dir(create=False)
                raise UnitsError(f"no overmind daemon runs at {home}, so no kernel holds GPU units; it starts "
                                 "with the first `%overmind on` or units.place(model)") from exc
            raise UnitsError(f"GPU units need the overmind daemon, which is not available: {exc}") from exc
        with self._lock:
            if client is self._client:
                return client, self._devices
        devices, daemon_only = self._register(client)
        with self._lock:
            if self._client is not client:
                for placement in list(self._by_holding.values()):
                    with placement.lock:
                        placement.orphaned = True
                self._by_holding.clear()
                self._client = client
                self._devices = devices
                self._daemon_only = daemon_only
                client.on_push("units_release_request", self._on_release_request)
            return client, self._devices

    # Note [Simulated here]
    # A kernel uses simulated devices only when it simulates them itself (OVERMIND_FAKE_GPUS in its own
    # environment). A daemon started with the variable answers every kernel's registration with its
    # simulated devices, and a kernel without it (no CUDA, or real GPUs the daemon then ignores) used to
    # take them: `device_map="cuda:0"` "placed" the model there and returned it on the CPU, where the plain
    # load raises (no CUDA) or puts it on the real GPU (docs/design.md invariant 1). Such a kernel now uses
    # no device of the ledger: a placement raises NoDeviceError, which says that the daemon simulates GPUs
    # and how to restart it without, and a load's placement falls back to the plain move with that notice
    # (placement.place), which raises torch's error or moves the model to the real device, as without us.
    def _register(self, client: Client) -> tuple[list[Device], str | None]:
        """The devices this kernel may use, and the daemon's OVERMIND_FAKE_GPUS when the daemon simulates
        devices that this kernel does not (then none: Note [Simulated here])."""
        mine = local_devices()
        try:
            reply = client.request(Op.UNITS_REGISTER, devices=mine, timeout=30)
        except RemoteError as exc:
            raise _units_error(exc) from None
        except DaemonError as exc:
            raise UnitsError(f"cannot reach the units ledger: {exc}") from exc
        if reply["simulated"] and not any(d["simulated"] for d in mine):
            return [], str(reply["fake_gpus"])
        return [Device(d["id"], d["name"], d["simulated"], d["capacity"], d["model"])
                for d in reply["devices"]], None

    def _resolve(self, device: Any, devices: list[Device]) -> list[Device]:
        if not devices and self._daemon_only is not None:
            spec = self._daemon_only
            raise NoDeviceError(f"the daemon simulates GPUs (OVERMIND_FAKE_GPUS={spec} in its environment) and "
                                "this kernel does not, so it places no model on them: "
                                "restart the daemon without the variable (`overmind-daemon stop`; the next "
                                f"load starts one with this kernel's settings), or set OVERMIND_FAKE_GPUS={spec} "
                                "in this kernel too to try units on simulated devices")
        if not devices:
            raise NoDeviceError("no GPU is visible in this kernel and the daemon simulates none; to try "
                                "units without a GPU, start the kernel with OVERMIND_FAKE_GPUS=2x16 in its "
                                "environment (the daemon it starts inherits it: `overmind-daemon stop` first)")
        if device is None:
            return devices
        name = f"cuda:{device}" if isinstance(device, int) and not isinstance(device, bool) else str(device)
        if name == "cuda":
            name = "cuda:0" if devices[0].simulated else f"cuda:{_current_cuda_device()}"
        found = [d for d in devices if d.name == name]
        if found:
            return found
        if name.startswith("cpu"):
            raise UnitsError("units place models on GPUs; to move one back to the CPU use "
                             "units.release(model)")
        raise NoDeviceError(f"no device {name!r} here; this kernel sees {', '.join(d.name for d in devices)}")

    # -- placing --------------------------------------------------------------------------------

    def _model_lock(self, model: Any) -> threading.RLock:
        with self._lock:
            lock = self._model_locks.get(model)
            if lock is None:
                lock = self._model_locks[model] = threading.RLock()
            return lock

    def _place(self, model: Any, device: Any, units: int | None, timeout: float | None, label: str | None,
               reuse_host: bool, *, busy: bool) -> Placement:
        client, devices = self._bind()
        candidates = self._resolve(device, devices)
        current = self._by_model.get(model)
        if current is not None and current.live:
            if current.device in candidates and (units is None or units == current.units):
                with current.lock:
                    if current.live:
                        current.busy += int(busy)
                        if current.busy == int(busy):  # turned busy, or idle and refreshed
                            self._touch(current, busy)  # most recently used now; nothing moves
                        return current
            elif current.busy > int(current.held):  # a held one counts itself once (Note [Held placements])
                raise ModelBusyError(f"{current.label} is in use on {current.device.name} (inside "
                                     "units.using); move it after the block ends")
        need = units if units is not None else units_for(model)
        label = label or model_label(model)
        grant = self._acquire(client, candidates, need, timeout, label)
        target = next(d for d in devices if d.id == grant["device"])
        transfer: Transfer | None = None
        try:
            if current is not None and current.orphaned and current.device.id == target.id \
                    and not current.released:
                transfer = current.transfer  # still there, since before the daemon went away
                with current.lock:
                    current.released = True
                    if current.finalizer is not None:
                        current.finalizer.detach()
            elif current is not None and not current.released:
                self._release(current, "moved", only_if_idle=False)
            if transfer is None and (not target.simulated or _fills_simulated()):
                from .transfer import to_device

                # a simulated device moves nothing, unless the copier's stand-in fills it on the CPU; its `.to`
                # is torch's, not a cached result's move routed here again
                with moving():
                    transfer = to_device(modules_of(model), "cpu" if target.simulated else target.name,
                                         reuse_host=reuse_host, copy=target.simulated, unit_device=target.id,
                                         simulated=target.simulated, label=label)
        except BaseException:
            self._give_back(client, grant["holding"])
            raise
        placement = Placement(weakref.ref(model), grant["holding"], target, need, label, client, transfer,
                              int(busy))
        self._start_worker()
        placement.finalizer = weakref.finalize(model, self._work.put, ("gone", placement))
        with self._lock:
            self._by_holding[placement.holding] = placement
            self._by_model[model] = placement
            self._homes[model] = _Home(target.name, need, label, reuse_host)
        self._event(placement, "placed", waited_s=grant.get("waited_s"),
                    fill=transfer.fill if transfer is not None else None)
        if not busy:
            self._touch(placement, False)
        return placement

    def _acquire(self, client: Client, candidates: list[Device], units: int, timeout: float | None,
                 label: str) -> dict[str, Any]:
        timeout = settings.get(settings.UNITS_TIMEOUT) if timeout is None else timeout
        daemon_timeout = None if timeout == float("inf") else max(0.0, float(timeout))
        names = ", ".join(d.name for d in candidates)

        def say() -> None:  # a wait for units held elsewhere, out of sight in the cell otherwise
            from ..notices import tell_once

            tell_once(f"units_wait:{label}", f"overmind: {label} waits for {units_text(units)} on {names}, which other "
                      "models hold (`%overmind units` lists them); it waits up to "
                      f"{'ever' if daemon_timeout is None else f'{daemon_timeout:g} s'} (OVERMIND_UNITS_TIMEOUT)")

        # an interrupt while the request is sent is raised inside the wait, which withdraws it (Note
        # [Interrupted waits] in kernel_server/client.py): the daemon would grant units nothing holds
        with interrupts_held() as held:
            try:
                request_id, fut = client.submit(Op.UNITS_ACQUIRE, units=units, devices=[d.id for d in candidates],
                                                timeout_s=daemon_timeout, label=label, busy=True,
                                                context_units=context_units(candidates[0].simulated))
            except DaemonError as exc:
                raise UnitsError(f"cannot ask the daemon for units: {exc}") from exc
        try:
            held.raise_it()
            reply: Response[Grant] = client.wait(request_id, fut,
                                                 None if daemon_timeout is None else daemon_timeout + _GRACE,
                                                 told=(_TOLD_S, say))
        except RemoteError as exc:
            raise _units_error(exc) from None
        except BaseException as exc:  # interrupted, or no answer: withdraw, and give back what may come
            self._cancel(client, request_id)
            if isinstance(exc, DaemonError):
                raise UnitsError(f"lost the daemon while waiting for units ({exc}); the next call starts a new "
                                 f"one ({lifecycle.log_path(client.home)} says why this one went)") from exc
            raise
        if reply.get("status") == "cancelled":  # withdrawn on this connection before it was granted
            raise UnitsError("the units request was withdrawn before it was granted; ask again")
        return reply.payload

    @staticmethod
    def _cancel(client: Client, request_id: int) -> None:
        try:
            client.submit(Op.UNITS_CANCEL, request=request_id)
        except DaemonError:
            pass  # the connection is gone, and its units with it

    @staticmethod
    def _give_back(client: Client, holding: int) -> None:
        try:
            client.request(Op.UNITS_RELEASE, holding=holding, timeout=30)
        except DaemonError:
            pass  # released already (no_holding), or gone with the connection

    @staticmethod
    def _touch(placement: Placement, busy: bool) -> None:
        """Tell the ledger; turning busy waits for the answer (one round trip), so that the daemon's record
        (what `state()` shows, whom it asks) agrees once a `using` block has begun."""
        try:
            if busy:
                placement.client.request(Op.UNITS_TOUCH, holding=placement.holding, busy=True, timeout=30)
            else:
                placement.client.submit(Op.UNITS_TOUCH, holding=placement.holding, busy=False)
        except DaemonError:
            pass  # no_holding (released meanwhile), or the connection is gone: the next _bind orphans it

    # -- busy blocks ------------------------------------------------------------------------------

    def _enter(self, model: Any) -> Placement:
        while True:
            self._bind()
            placement = self._by_model.get(model)
            if placement is not None and placement.live:
                with placement.lock:
                    if placement.live:
                        placement.busy += 1
                        if placement.busy == 1:
                            self._touch(placement, True)
                        return placement
                continue
            home = self._homes.get(model)
            if home is None:
                _check_model(model)
                raise NotPlacedError(f"{model_label(model)} was never placed on a GPU: call "
                                     "units.place(model, 'cuda:0') (or units.place(model) for the first "
                                     "device that fits) before `with units.using(model):`")
            with self._model_lock(model):
                return self._place(model, home.device, home.units, None, home.label, home.reuse_host,
                                   busy=True)

    def _leave(self, placement: Placement) -> None:
        with placement.lock:
            placement.busy -= 1
            if placement.busy == 0 and placement.live:
                self._touch(placement, False)

    # -- releasing --------------------------------------------------------------------------------

    def _release(self, placement: Placement, reason: str, *, only_if_idle: bool) -> bool:
        with placement.lock:
            if placement.released:
                return False
            own = 1 if placement.held and reason != "asked" else 0  # a held one is never given up when asked
            if placement.busy > own:
                if only_if_idle:
                    return False  # see Note [Residency]: the daemon asks again once it is idle
                raise ModelBusyError(f"{placement.label} is in use (inside units.using); release it after "
                                     "the block ends")
            model = placement.model_ref()
            moved = None
            if model is not None and placement.transfer is not None:
                moved = placement.transfer.to_host(modules_of(model))
            placement.released = True
            if placement.finalizer is not None:
                placement.finalizer.detach()
        with self._lock:
            if self._by_holding.get(placement.holding) is placement:
                del self._by_holding[placement.holding]
            if model is not None and self._by_model.get(model) is placement:
                del self._by_model[model]
        self._event(placement, reason, **(moved or {}))
        if not placement.orphaned:
            self._give_back(placement.client, placement.holding)
        return True

    def _on_release_request(self, payload: dict[str, Any]) -> None:
        """A push from the daemon (on the client's push thread): hand it to the worker."""
        self._start_worker()
        self._work.put(("asked", payload.get("holding")))

    def _start_worker(self) -> None:
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work_loop, name="overmind-units", daemon=True)
                self._worker.start()

    def _work_loop(self) -> None:
        while True:
            kind, item = self._work.get()
            if kind == "gone":
                placement: Placement | None = item  # the placement of a collected model
            else:
                with self._lock:
                    placement = self._by_holding.get(item)
            if placement is None:
                continue
            try:
                self._release(placement, "asked" if kind == "asked" else "collected", only_if_idle=True)
            except Exception:  # a failed move keeps the units; the waiter times out with a clear error
                log.exception("overmind: could not move %s off %s to give its units back", placement.label,
                              placement.device.name)

    def _event(self, placement: Placement, event: str, **fields: Any) -> None:
        self.events.append({"time": time.time(), "event": event, "model": placement.label,
                            "device": placement.device.name, "holding": placement.holding,
                            "units": placement.units, "simulated": placement.device.simulated, **fields})


def _fills_simulated() -> bool:
    """Whether the device copier's stand-in fills simulated devices on the CPU (OVERMIND_DEVICE_COPIER=cpu)."""
    return bool(settings.get(settings.DEVICE_COPIER) == "cpu")


def _check_model(model: Any) -> None:
    modules_of(model)  # a model, or a pipeline of them (Note [Pipelines] in devices.py); else UnitsError


def _current_cuda_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def _units_error(exc: RemoteError) -> UnitsError:
    """The units error of a ledger's error code (kernel_server/operations.py lists the codes; a daemon of
    another protocol version is refused at hello, so every code here is the ledger's own)."""
    return _ERRORS.get(exc.code, UnitsError)(str(exc))


# This process's residency (created on first use, again in a forked child: the parent's placements and
# connection are not the child's).
instance = lazy_instance(Residency)
