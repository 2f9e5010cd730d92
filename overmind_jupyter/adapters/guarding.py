"""The guard: while a gate serves a model, PEFT's own calls that change which adapter layers apply wait for the
requests in flight, as `gate.exclusive()` does.

# Note [Changes behind the gate]

A routed request reads no global state (Note [Adapter routing]), but the layers still obey their own flags: a
disabled layer computes the base model for every row, a merged one refuses or double-counts, a deleted adapter's
rows pass through, a layer injected or re-weighted mid-request answers with something else. A change like `with
peft_model.disable_adapter():` in another thread would so turn routed requests into base-model answers.

1. PEFT's calls that change the layers are made exclusive. While some gate is open, these methods are patched
   (through patching.py, layer `LAYER`, outside `%overmind on`'s own patch of `load_adapter`): on a
   `PeftModel`, `disable_adapter` (a context manager: exclusive for the whole `with` block), `set_adapter`,
   `load_adapter`, `add_adapter`, `delete_adapter`; on its tuner (`peft_model.base_model`, also reached as
   `peft_model.merge_adapter` and so on), `set_adapter`, `delete_adapter`, `enable_adapter_layers`,
   `disable_adapter_layers`, `merge_adapter`, `unmerge_adapter`, `add_weighted_adapter`, `merge_and_unload`,
   `unload`, `inject_adapter`; on a transformers model with PEFT integration, `load_adapter`, `add_adapter`,
   `set_adapter`, `enable_adapters`, `disable_adapters`, `delete_adapter`; on every tuner layer and auxiliary
   wrapper, `enable_adapters`, `set_adapter`, `merge`, `unmerge`, `delete_adapter`, `set_scale`,
   `scale_layer`, `unscale_layer` (so `peft.functional.set_adapter` and the like are covered too); and PEFT's
   hot-swap (`peft.utils.hotswap.hotswap_adapter_from_state_dict`, which `hotswap_adapter` calls). Called on
   an object of a model a gate serves, each takes the gate's exclusive side: it waits for the requests in
   flight, holds new ones, runs, and lets them in after the gate re-read the model. Inside
   `gate.exclusive()`, or inside the gate's own switching, they run as they are. Called inside a request of
   the same gate (`gate.use(...)`, a streamer's callback), they raise `GateDeadlockError` instead of waiting
   for themselves. The patches are removed when the last gate closes.
2. Anything else that changes the layers' state (a flag written by hand, a call of a layer type's own method
   this list does not name) is detected. The gate records the layers' state (`AdapterHost.layer_state`:
   disabled, merged and active adapters of every tuner layer and wrapper) after each switch, and only a
   state that is right for the key it switched to; a request compares it at admission (a change made
   between requests: the gate re-reads the model first), every hooked layer compares its own entry when it
   runs (routing.py), and the request compares it again at its end. A difference during the request fails
   it with `AdapterChangedError`, warns once, and makes the gate re-read the model before the next request.
   What cannot be seen this way needs `gate.exclusive()`: weights or `scaling` written by hand, modules
   replaced or added by hand, and a flag written and written back within one layer's forward (between the
   check and the layer's read of it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .. import patching
from ._errors import GateClosedError

__all__ = ["LAYER", "Guarded", "guard", "guarded_gate", "release"]

#: The patch layer of the guard: outside `%overmind on`'s patches (layer 0) of the same methods.
LAYER = 1

_PEFT_MODEL = ("set_adapter", "load_adapter", "add_adapter", "delete_adapter")
_PEFT_CONTEXTS = ("disable_adapter",)
_TUNER = (
    "set_adapter",
    "delete_adapter",
    "enable_adapter_layers",
    "disable_adapter_layers",
    "merge_adapter",
    "unmerge_adapter",
    "add_weighted_adapter",
    "merge_and_unload",
    "unload",
    "inject_adapter",
)
_TRANSFORMERS = ("load_adapter", "add_adapter", "set_adapter", "enable_adapters", "disable_adapters", "delete_adapter")
_LAYERS = (
    "enable_adapters",
    "set_adapter",
    "merge",
    "unmerge",
    "delete_adapter",
    "set_scale",
    "scale_layer",
    "unscale_layer",
)
_FUNCTIONS = (("peft.utils.hotswap", "hotswap_adapter_from_state_dict"),)


class Guarded(Protocol):
    """What the guard needs of a gate."""

    @property
    def closed(self) -> bool: ...

    def exclusive(self) -> contextlib.AbstractContextManager[Any]: ...

    def changing_here(self) -> bool: ...


_lock = threading.Lock()
_objects: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}  # id(obj) -> (obj, gate)
_installed: list[tuple[Any, str]] = []


def guarded_gate(obj: Any) -> Guarded | None:
    """The open gate serving the model `obj` belongs to (the model, its tuner, the module requests run on)."""
    for candidate in (obj, getattr(obj, "_orig_mod", None)):  # _orig_mod: a torch.compile wrapper
        if candidate is None:
            continue
        entry = _objects.get(id(candidate))
        if entry is None or entry[0]() is not candidate:
            continue
        gate = entry[1]()
        if gate is not None and not gate.closed:
            return gate  # type: ignore[no-any-return]
    return None


@contextlib.contextmanager
def _exclusive_for(obj: Any) -> Iterator[None]:
    gate = guarded_gate(obj)
    with contextlib.ExitStack() as stack:
        if gate is not None and not gate.changing_here():
            with contextlib.suppress(GateClosedError):  # closed meanwhile: there is nothing left to protect
                stack.enter_context(gate.exclusive())
        yield


def _method(original: Any) -> Any:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _exclusive_for(self):
            return original.__get__(self, type(self))(*args, **kwargs)

    return method


def _context(original: Any) -> Any:
    @functools.wraps(original)
    @contextlib.contextmanager
    def context(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with _exclusive_for(self), original.__get__(self, type(self))(*args, **kwargs) as value:
            yield value

    return context


def _function(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def function(*args: Any, **kwargs: Any) -> Any:
        with _exclusive_for(kwargs["model"] if "model" in kwargs else (args[0] if args else None)):
            return original(*args, **kwargs)

    return function


def _install(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    if patching.patch(owner, name, make, layer=LAYER):
        _installed.append((owner, name))


def _install_methods(cls: type, names: tuple[str, ...], make: Callable[[Any], Any]) -> None:
    for name in names:
        owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
        if owner is not None and callable(owner.__dict__[name]):
            _install(owner, name, make)


def guard(gate: Guarded, model: Any, kind: str, target: Any, layers: list[Any]) -> None:
    """Guard the model of a gate (see Note [Changes behind the gate]); called again after each exclusive
    section, for the layers that appeared.

    Args:
        gate: the gate.
        model: what the gate serves (`gate.model`).
        kind: `"peft"`, `"transformers"` or `"injected"` (see host.py).
        target: the module requests run on.
        layers: its tuner layers and auxiliary wrappers (`AdapterHost.layers()`).
    """
    with _lock:
        _prune()
        objects = [model, target, *layers]
        if kind == "peft":
            tuner = model.base_model
            objects.append(tuner)
            _install_methods(type(model), _PEFT_MODEL, _method)
            _install_methods(type(model), _PEFT_CONTEXTS, _context)
            _install_methods(type(tuner), _TUNER, _method)
        elif kind == "transformers":
            _install_methods(type(model), _TRANSFORMERS, _method)
        for cls in {type(layer) for layer in layers}:
            _install_methods(cls, _LAYERS, _method)
        for module_name, name in _FUNCTIONS:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # pragma: no cover - a PEFT without hot-swapping
                continue
            if callable(getattr(module, name, None)):
                _install(module, name, _function)
        reference = weakref.ref(gate)
        for obj in objects:
            _objects[id(obj)] = (weakref.ref(obj), reference)


def release(gate: Guarded) -> None:
    """Forget a closed gate; the last one removes the patches."""
    with _lock:
        for key in [k for k, (_, g) in _objects.items() if g() is gate]:
            del _objects[key]
        _prune()
        if not _objects:
            while _installed:
                owner, name = _installed.pop()
                patching.unpatch(owner, name, layer=LAYER)


def _prune() -> None:
    for key in [k for k, (o, g) in _objects.items() if o() is None or g() is None or g().closed]:  # type: ignore[union-attr]
        del _objects[key]
