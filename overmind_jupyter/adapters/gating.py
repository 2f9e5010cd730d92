"""`AdapterGate`: many requests with different adapters on one model, concurrently and correctly.

A request names its adapter per call (`adapter="fr"`) or per row (`adapter=["fr", "de", "__base__"]`). Rows of
routable adapters run routed (see Note [Adapter routing]); the others run switched, one adapter at a time,
under the keyed admission of switching.py (see Note [Keyed admission]). Structural changes go through
`gate.exclusive()` or the gate methods built on it, which hold it while changes.py makes the change; PEFT's
own calls that change the layers take it by themselves, and other changes behind the gate are detected
(guarding.py). `gate.submit(...)` hands a request to the batching engine (batching.py), which coalesces
concurrent requests into mixed batches.

Imports run one way: gating imports batching and splitting, which see the gate only through
`inputs.GateSurface` (its public `resolve`, `admission_key`, `run`, `generate`, `generation_config`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from . import guarding
from ._errors import (
    AdapterChangedError,
    AdapterError,
    AdapterWarning,
    GateClosedError,
    GateDeadlockError,
    RoutingUnavailableError,
    UnknownAdapterError,
)
from .changes import LayerChanges, conforms
from .host import AdapterHost
from .inputs import rows_of
from .routing import BASE, Router, blockers, expect, route
from .switching import ROUTED, KeyedSemaphore

if TYPE_CHECKING:
    from torch import nn

    from .batching import BatchingEngine

__all__ = ["AdapterGate", "gate"]

_MODES = ("auto", "routed", "switched")
_REGISTRY: dict[int, weakref.ref[AdapterGate]] = {}
_REGISTRY_LOCK = threading.Lock()
# The gates (by id) whose own switching runs in this context: their model changes need no exclusive side.
_SWITCHING: ContextVar[frozenset[int]] = ContextVar("overmind_adapter_switching", default=frozenset())


def gate(model: nn.Module, **options: Any) -> AdapterGate:
    """The adapter gate of `model`, created on first use; one open gate per model.

    Args:
        model (`nn.Module`):
            A `peft.PeftModel`, or a transformers model whose adapters were loaded through its PEFT
            integration (`model.load_adapter(path, adapter_name="fr")`).
        **options:
            Passed to `AdapterGate` when the gate is created (`mode`, `default`, `max_wait_s`, `window_s`,
            `max_window_s`, `max_batch`, `max_adapters_per_batch`). Asking an open gate for other options is
            an error.

    Example:

    ```python
    from overmind_jupyter import adapters

    g = adapters.gate(peft_model)
    out = g.generate(**inputs, adapter="fr", max_new_tokens=16)
    out = g.generate(**batch, adapter=["fr", "de", "__base__"], max_new_tokens=16)
    future = g.submit(**inputs, adapter="de", max_new_tokens=16)
    ```
    """
    with _REGISTRY_LOCK:
        ref = _REGISTRY.get(id(model))
        existing = ref() if ref is not None else None
        if existing is not None and existing.model is model and not existing.closed:
            if options:
                differing = {k: v for k, v in options.items() if existing._options.get(k) != v}
                if differing:
                    raise ValueError(
                        f"{type(model).__name__} already has an open gate with other options {differing}: "
                        "close it first (gate.close()) or call adapters.gate(model) without options"
                    )
            return existing
        created = AdapterGate(model, **options)
        _REGISTRY[id(model)] = weakref.ref(created)
        return created


def open_gates() -> list[AdapterGate]:
    """The gates open in this process, one per model."""
    with _REGISTRY_LOCK:
        gates = [ref() for ref in _REGISTRY.values()]
    return [g for g in gates if g is not None and not g.closed]


def _unregister(model_id: int, closing: AdapterGate) -> None:
    with _REGISTRY_LOCK:
        ref = _REGISTRY.get(model_id)
        if ref is not None and ref() in (None, closing):
            del _REGISTRY[model_id]


class AdapterGate:
    """Serves one model to many threads, each request with its own adapter.

    Args:
        model (`nn.Module`):
            See `gate`.
        mode (`str`, *optional*, defaults to `"auto"`):
            `"auto"` routes every adapter PEFT can route per row and switches the rest; `"routed"` raises if
            some adapter cannot be routed; `"switched"` never routes (one adapter at a time, shared by the
            requests that name it).
        default (`str`, *optional*):
            The adapter of requests that name none; defaults to the model's active adapter. `gate.switch`
            changes it.
        max_wait_s (`float`, *optional*, defaults to 0.1):
            Switched mode's aging bound: once a request of another adapter has waited this long, the running
            adapter admits no newcomer, so the model drains and switches (see Note [Keyed admission]).
        window_s (`float`, *optional*, defaults to 0.01):
            The batching engine closes a batch once no request arrived for this long (each arrival extends
            it).
        max_window_s (`float`, *optional*, defaults to 0.05):
            ... or this long after the batch's first request, whichever comes first.
        max_batch (`int`, *optional*, defaults to 64):
            Most rows in one engine batch.
        max_adapters_per_batch (`int`, *optional*, defaults to 4):
            Most distinct adapters (`"__base__"` counts) in one engine batch.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: str = "auto",
        default: str | None = None,
        max_wait_s: float = 0.1,
        window_s: float = 0.01,
        max_window_s: float = 0.05,
        max_batch: int = 64,
        max_adapters_per_batch: int = 4,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if max_adapters_per_batch < 1 or max_batch < 1:
            raise ValueError("max_batch and max_adapters_per_batch must be at least 1")
        self._options = {
            "mode": mode,
            "default": default,
            "max_wait_s": max_wait_s,
            "window_s": window_s,
            "max_window_s": max_window_s,
            "max_batch": max_batch,
            "max_adapters_per_batch": max_adapters_per_batch,
        }
        self._host = AdapterHost(model)
        self._mode = mode
        self._initial = self._host.snapshot()
        self._changes = LayerChanges(self._host)
        self._router = Router(self._host.target)
        self._sem = KeyedSemaphore(self._switch, max_wait_s=max_wait_s)
        self._engine_lock = threading.Lock()
        self._engine: BatchingEngine | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, self._router.remove)
        self._adapters: frozenset[str] = frozenset()
        self._whole: str | None = None
        self._per: dict[str, str] = {}
        self._stale = False  # a change behind the gate was seen: re-read the model before the next request
        self._changes_seen = 0
        self._known: dict[int, tuple[Any, ...]] = {}  # the layers' state the gate last set (after each switch)
        self._resync(initial=True)
        active = [a for a in self._initial.active if a in self._adapters]
        chosen = default if default is not None else (active[0] if active else BASE)
        self._default = self._check_name(chosen)
        guarding.guard(self, self._host.model, self._host.kind, self._host.target, self._host.layers())

    # -- what the gate knows ---------------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The model this gate serves (as given to it)."""
        model: nn.Module = self._host.model
        return model

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def default(self) -> str:
        """The adapter of requests that name none (see `switch`)."""
        return self._default

    @property
    def adapters(self) -> list[str]:
        """The adapters the model carries, sorted (`"__base__"` is always accepted too)."""
        return sorted(self._adapters)

    @property
    def mode(self) -> str:
        """`"routed"` (every adapter per row), `"switched"` (none), or `"hybrid"` (some adapters switched)."""
        if self._whole is not None:
            return "switched"
        return "hybrid" if self._per else "routed"

    def _resync(self, initial: bool = False) -> None:
        """Re-read the model after a structural change: adapters, hooks, what can be routed."""
        host = self._host
        host.watch()
        self._adapters = frozenset(host.adapters())
        if self._mode == "switched":
            whole: str | None = "mode='switched' was asked for"
            per: dict[str, str] = {}
        else:
            whole, per = blockers(host.target, sorted(self._adapters))
        if self._mode == "routed" and (whole or per):
            reasons = whole or "; ".join(f"{k}: {v}" for k, v in sorted(per.items()))
            if initial:
                raise RoutingUnavailableError(
                    f"PEFT cannot route per row here ({reasons}); use mode='auto' to switch those adapters"
                )
            warnings.warn(
                f"the gate was made with mode='routed', but after this change PEFT cannot route per row "
                f"({reasons}); those requests now run switched",
                AdapterWarning,
                stacklevel=4,
            )
        self._whole, self._per = whole, per
        self._stale = False
        self._changes.reread()
        self._router.sync()
        if not initial:
            guarding.guard(self, host.model, host.kind, host.target, host.layers())
        if not initial and self._default != BASE and self._default not in self._adapters:
            warnings.warn(
                f"the default adapter {self._default!r} is gone; requests that name no adapter now get the "
                "base model (gate.switch(...) picks another)",
                AdapterWarning,
                stacklevel=4,
            )
            self._default = BASE

    def _check_name(self, name: object) -> str:
        if not isinstance(name, str):
            raise TypeError(f"an adapter name must be a str, got {type(name).__name__}")
        if name != BASE and name not in self._adapters:
            available = ", ".join(sorted(self._adapters)) or "(none)"
            raise UnknownAdapterError(f"no adapter named {name!r}; available: {available}, and {BASE!r}")
        return name

    def resolve(self, adapter: str | Sequence[str] | None, rows: int | None) -> tuple[str, ...]:
        """The adapter names of a request: one name for every row (a 1-tuple), or one name per row.

        Args:
            adapter (`str`, `list[str]` or `None`):
                As `generate` takes it; `None` is `gate.default`.
            rows (`int`, *optional*):
                The request's number of rows, checked against a per-row list.

        Raises:
            `UnknownAdapterError` for a name the model does not carry, `ValueError` for a list of the wrong
            length.
        """
        if adapter is None:
            return (self._default,)
        if isinstance(adapter, str):
            return (self._check_name(adapter),)
        names = tuple(self._check_name(a) for a in adapter)
        if rows is not None and len(names) != rows:
            raise ValueError(
                f"adapter= names {len(names)} rows, but the inputs have {rows}: pass one per row"
            )
        if not names:
            raise ValueError("adapter= is an empty list")
        return names

    def admission_key(self, name: str) -> str:
        """What a row of adapter `name` waits for: `"<routed>"` (shared by every routed row) or the adapter the
        model must be switched to (see Note [Keyed admission])."""
        if self._whole is not None or name in self._per:
            return name
        return ROUTED

    @property
    def generation_config(self) -> Any:
        """The generation config of the module requests run on (what `generate` starts from)."""
        return getattr(self._host.target, "generation_config", None)

    def changing_here(self) -> bool:
        """Whether the current thread may change the model's adapter layers at once: inside this gate's
        exclusive side, or inside its own switching (see Note [Changes behind the gate] in guarding.py)."""
        return self._sem.exclusive_here() or id(self) in _SWITCHING.get()

    # -- switched mode ---------------------------------------------------------------------------------------

    def _switch(self, previous: str | None, key: str) -> bool:
        """Set the model to `key`, with no request in flight. See Note [Keyed admission].

        Returns:
            Whether the layers changed: False when they already were as `key` needs (the first request, or
            the first after an exclusive section such as a mix, which forgets the key), which
            `state()["switches"]` does not count.
        """
        token = _SWITCHING.set(_SWITCHING.get() | {id(self)})
        try:
            before = self._host.layer_state()
            self._changes.apply(key)
            state = self._host.layer_state()
            if not conforms(key, state):
                # The quick checks read one summary of all layers (the first layer's active adapters, the union
                # of merged ones). Guarded layer-level calls between requests (`peft.functional.set_adapter`
                # walks the layers one exclusive call at a time) can leave the layers disagreeing: set each.
                self._changes.apply(key, every_layer=True)
                state = self._host.layer_state()
        finally:
            _SWITCHING.reset(token)
        # Every request of this key is admitted with, and must end with, this state (Note [Changes behind the
        # gate] in guarding.py). After an exclusive section the key is forgotten, so this runs again. A state that
        # is not what the key needs was changed behind the gate during the switch: no request may take it.
        self._known = state if conforms(key, state) else {}
        return state != before

    # -- requests --------------------------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise GateClosedError("the adapter gate is closed; create a new one with adapters.gate(model)")

    def _recheck(self, names: Sequence[str]) -> None:
        gone = [n for n in set(names) if n != BASE and n not in self._adapters]
        if gone:
            raise UnknownAdapterError(
                f"adapter(s) {sorted(gone)} were deleted while this request waited; available: "
                f"{', '.join(sorted(self._adapters)) or '(none)'}"
            )

    @contextlib.contextmanager
    def _admitted(self, names: tuple[str, ...]) -> Iterator[str]:
        """Hold the model for one request whose rows all have the same key; yields the key.

        The key is computed before the wait; if an exclusive section changed what can be routed meanwhile (a
        merge, say), the request lets go and queues again under its new key. The layers' state must be the one
        the gate set (Note [Changes behind the gate] in guarding.py): a change found at admission makes the gate
        re-read the model first; one made while the request runs fails the request.
        """
        self._ensure_open()
        if self._host.target.training:
            raise AdapterError(
                "the model is in training mode (dropout would make answers random): call model.eval() before "
                "serving it through the gate"
            )
        labels = tuple(sorted(set(names)))
        nested = self._sem.held_here()
        tries = 0
        while True:
            if self._stale and not nested:
                with self.exclusive():  # re-read the model after a change made behind the gate
                    pass
            keys = {self.admission_key(n) for n in names}
            if len(keys) != 1:
                raise _Resplit
            key = keys.pop()
            with contextlib.ExitStack() as held:
                held.enter_context(self._sem.hold(key, labels))
                if {self.admission_key(n) for n in names} != {key}:
                    continue
                self._recheck(names)
                known = self._known
                now = self._host.layer_state()
                if now != known:
                    what = self._host.describe_change(known, now)
                    self._changed_behind(what)
                    tries += 1
                    if nested or tries > 3:
                        raise AdapterChangedError(
                            f"the model's adapter layers were changed without gate.exclusive() ({what}), and keep "
                            "changing: the request did not run. Make such changes inside `with gate.exclusive():`"
                        )
                    continue
                if key == ROUTED:
                    held.enter_context(route(names))
                held.enter_context(expect(known))
                try:
                    yield key
                except Exception as e:
                    self._check_unchanged(known, e)
                    raise
                self._check_unchanged(known, None)
                return

    def _changed_behind(self, what: str) -> None:
        first = not self._stale
        self._stale = True
        self._changes_seen += 1
        if first:
            warnings.warn(
                f"the model's adapter layers were changed without gate.exclusive() ({what}); requests in flight "
                "fail with AdapterChangedError, and the gate re-reads the model before the next one",
                AdapterWarning,
                stacklevel=6,
            )

    def _check_unchanged(self, known: dict[int, tuple[Any, ...]], error: Exception | None) -> None:
        after = self._host.layer_state()
        if after == known and not isinstance(error, AdapterChangedError):
            return
        what = self._host.describe_change(known, after) if after != known else str(error)
        self._changed_behind(what)
        if isinstance(error, AdapterChangedError):
            return
        raise AdapterChangedError(
            f"the model's adapter layers changed while this request ran ({what}): a change made without "
            "gate.exclusive() in another thread; the request failed instead of answering with other adapter "
            "layers. Submit it again, and make such changes inside `with gate.exclusive():`"
        ) from error

    def run(self, kind: str, names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one request whose adapter names are resolved (`resolve`): `"generate"` or `"forward"`, under
        admission; a request whose rows need different keys runs in parts (splitting.py).
        """
        import torch

        try:
            with self._admitted(names), torch.no_grad():
                target = self._host.target
                return target.generate(*args, **kwargs) if kind == "generate" else target(*args, **kwargs)
        except _Resplit:
            pass
        from .splitting import run_split

        return run_split(self, kind, names, args, kwargs)

    def _run(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], adapter: Any) -> Any:
        names = self.resolve(adapter, rows_of(args, kwargs))
        return self.run(kind, names, args, kwargs)

    def generate(self, *args: Any, adapter: str | Sequence[str] | None = None, **kwargs: Any) -> Any:
        """`model.generate(...)` with the given adapter, safe to call from many threads at once.

        Args:
            *args, **kwargs:
                What the model's `generate` takes (`input_ids`, `attention_mask`, `max_new_tokens`, ...).
            adapter (`str` or `list[str]`, *optional*):
                One adapter for the whole call, or one per input row; `"__base__"` is the base model. Defaults
                to `gate.default`.

        Returns:
            What `generate` returns.
        """
        return self._run("generate", args, kwargs, adapter)

    def forward(self, *args: Any, adapter: str | Sequence[str] | None = None, **kwargs: Any) -> Any:
        """One forward of the model (under `torch.no_grad()`) with the given adapter; see `generate`."""
        return self._run("forward", args, kwargs, adapter)

    __call__ = forward

    @contextlib.contextmanager
    def use(self, adapter: str | None = None) -> Iterator[nn.Module]:
        """Hold the model for one request and route direct calls of the model in the block to `adapter`.

        For code that calls the model itself (a pipeline, say). The block counts as one request: exclusive
        operations wait for it, and in switched mode other adapters wait for it.

        Args:
            adapter (`str`, *optional*):
                The adapter for every row of every call in the block; defaults to `gate.default`.
        """
        names = self.resolve(adapter, None)
        with self._admitted(names):
            yield self._host.model

    # -- default adapter and structural changes --------------------------------------------------------------

    def switch(self, adapter: str) -> None:
        """Make `adapter` the default of requests that name none.

        This changes the gate only: requests in flight keep their adapter, and direct calls of the model are
        not affected (the gate never sets global state to choose an adapter).

        Args:
            adapter (`str`):
                An adapter name, or `"__base__"`.
        """
        self._ensure_open()
        self._default = self._check_name(adapter)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[nn.Module]:
        """Hold the model alone: waits for requests in flight, holds new ones, yields the model.

        Changes by hand must run inside: weights or `scaling` written directly, modules replaced or added,
        flags set without PEFT's methods. PEFT's calls that change which adapter layers apply
        (`disable_adapter()`, `set_adapter`, `merge_adapter`, `load_adapter`, `delete_adapter`,
        `add_weighted_adapter`, hot-swap, the layers' `enable_adapters`, `merge`, ...) take this section by
        themselves while the gate is open (Note [Changes behind the gate] in guarding.py), and run as they are
        inside it. On exit, even by an exception, the gate re-reads the model (adapters, hooks on new layers,
        what can be routed) and lets the held requests in. A request of this gate made inside the block, in the
        same thread, raises `GateDeadlockError`.
        """
        self._ensure_open()
        with self._sem.exclusive() as outermost:
            try:
                yield self._host.model
            finally:
                if outermost and not self._closed:
                    self._resync()

    def load_adapter(self, source: Any, adapter_name: str, **kwargs: Any) -> str:
        """Load an adapter (a path, a hub id) under the exclusive side; returns its name.

        Args:
            source (`str` or `os.PathLike`):
                Where the adapter is, as the model's own `load_adapter` takes it.
            adapter_name (`str`):
                The name to load it under.
            **kwargs:
                Passed to the model's `load_adapter`.
        """
        with self.exclusive():
            self._changes.load(source, adapter_name, **kwargs)
        return adapter_name

    def delete_adapter(self, adapter_name: str) -> None:
        """Delete an adapter under the exclusive side. The default adapter cannot be deleted.

        Args:
            adapter_name (`str`):
                The adapter to delete.
        """
        with self.exclusive():
            self._changes.delete(adapter_name, self._default)

    def mix(self, weights: Mapping[str, float], name: str) -> str:
        """Add adapter `name`, a weighted sum of LoRA adapters (exact: ranks are concatenated); returns it.

        Args:
            weights (`Mapping[str, float]`):
                Adapter name to weight, e.g. `{"fr": 0.7, "de": 0.3}`.
            name (`str`):
                The new adapter's name.
        """
        with self.exclusive():
            self._changes.mix(weights, name)
        return name

    def merge(self, adapter: str | None = None) -> None:
        """Merge an adapter into the base weights (faster calls); requests then run switched.

        While merged, a request for another adapter unmerges and merges that one (fp32 rounding of the base
        weights accumulates over many switches). `unmerge()` goes back to routing.

        Args:
            adapter (`str`, *optional*):
                The adapter to merge; defaults to `gate.default`.
        """
        name = self._check_name(adapter if adapter is not None else self._default)
        if name == BASE:
            raise ValueError("the base model has nothing to merge: name an adapter")
        with self.exclusive():
            self._changes.merge(name)

    def unmerge(self) -> None:
        """Take merged adapters out of the base weights again (routing becomes possible again)."""
        with self.exclusive():
            self._changes.unmerge()

    def hotswap(self, adapter_name: str, source: Any, **kwargs: Any) -> None:
        """Replace an adapter's weights in place with those at `source` (same rank and targets), exclusively.

        Args:
            adapter_name (`str`):
                The adapter whose weights are replaced.
            source (`str` or `os.PathLike`):
                Where the new weights are.
            **kwargs:
                Passed to PEFT's `hotswap_adapter` (or the transformers `load_adapter(..., hotswap=True)`).
        """
        with self.exclusive():
            self._changes.hotswap(adapter_name, source, **kwargs)

    # -- batching engine -------------------------------------------------------------------------------------

    def submit(self, *args: Any, adapter: str | Sequence[str] | None = None, **kwargs: Any) -> Future[Any]:
        """Queue a `generate` request for the batching engine; returns a `concurrent.futures.Future`.

        Requests that arrive within `window_s` of each other (for at most `max_window_s`) run as one mixed
        batch (left-padded, at most `max_batch` rows and `max_adapters_per_batch` adapters). The result is
        what `gate.generate` returns for the same request alone: the prompt followed by the new tokens (see
        Note [Batch equality] in batching.py for what is equal).

        Args:
            *args, **kwargs:
                `input_ids` (and `attention_mask`) and generation options, as for `gate.generate`.
            adapter (`str` or `list[str]`, *optional*):
                As for `gate.generate`.
        """
        self._ensure_open()
        with self._engine_lock:
            if self._engine is None:
                from .batching import BatchingEngine

                self._engine = BatchingEngine(
                    self,
                    window_s=float(self._options["window_s"]),  # type: ignore[arg-type]  # numbers, checked in __init__
                    max_window_s=float(self._options["max_window_s"]),  # type: ignore[arg-type]
                    max_batch=int(self._options["max_batch"]),  # type: ignore[arg-type]
                    max_adapters=int(self._options["max_adapters_per_batch"]),  # type: ignore[arg-type]
                )
            engine = self._engine
        return engine.submit(args, kwargs, adapter)

    # -- state and closing -----------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot for status displays.

        Returns:
            `dict` with `mode`, `kind` (peft, transformers, injected), `default`, `adapters`, `routing`
            (adapter to `"routed"` or `"switched"`), `blockers` (why PEFT refuses routing), `active`
            (adapters in flight when routed, the switched adapter otherwise), `in_flight`, `queued`,
            `max_wait_s` and `oldest_wait_s` per adapter, `exclusive`, `switches`, `max_wait_bound_s`,
            `hooks`, `engine`, `changes_behind` (changes of the layers made without the exclusive side, seen by
            requests), `closed`.
        """
        sem = self._sem.state()
        routing = {a: ("switched" if self.admission_key(a) != ROUTED else "routed") for a in sorted(self._adapters)}
        routing[BASE] = "switched" if self.admission_key(BASE) != ROUTED else "routed"
        if self._whole is not None:
            blocked: dict[str, str] = {"*": self._whole}
        else:
            blocked = dict(sorted(self._per.items()))
        routed = sem["applied"] == ROUTED or sem["applied"] is None
        active = sorted(sem["in_flight"]) if routed else [sem["applied"]]  # type: ignore[call-overload]
        engine = self._engine
        return {
            "mode": self.mode,
            "kind": self._host.kind,
            "default": self._default,
            "adapters": sorted(self._adapters),
            "routing": routing,
            "blockers": blocked,
            "active": active,
            "in_flight": sem["in_flight"],
            "queued": sem["queued"],
            "max_wait_s": sem["max_wait_s"],
            "oldest_wait_s": sem["oldest_wait_s"],
            "exclusive": sem["exclusive"],
            "switches": sem["switches"],
            "max_wait_bound_s": self._sem.max_wait_s,
            "hooks": len(self._router),
            "engine": engine.state() if engine is not None else None,
            "changes_behind": self._changes_seen,
            "closed": self._closed,
        }

    def close(self) -> None:
        """Stop the engine (failing its pending futures), wait for requests in flight, remove the hooks, and
        put back the model's active adapter, enabled flag and merged set if switching changed them."""
        if self._closed:
            return
        if self._sem.held_here():
            raise GateDeadlockError(
                "gate.close() was called inside a request of the same gate, and would wait for itself: "
                "close it after the `gate.use(...)` block"
            )
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        with self._sem.exclusive():
            try:
                self._router.remove()
                self._changes.restore(self._initial)
            finally:
                self._closed = True
                self._sem.close()
                self._finalizer.detach()
        _unregister(id(self._host.model), self)
        guarding.release(self)

    def __enter__(self) -> AdapterGate:  # typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        status = "closed" if self._closed else self.mode
        return f"<AdapterGate {status} default={self._default!r} adapters={sorted(self._adapters)}>"


class _Resplit(Exception):
    """A request's rows need more than one key: it runs in parts (splitting.py)."""
