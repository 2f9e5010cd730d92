"""Per-request adapter routing: one pre-forward hook per LoRA layer, reading a `ContextVar`.

# Note [Adapter routing]

PEFT's `set_adapter` is global state, and PEFT's per-call `adapter_names` registers hooks on the shared model
for the length of one call: two threads serving two adapters corrupt each other either way (measured). The
gate routes instead (docs/design.md invariant 7):

- Each routable layer (a LoRA layer with a mixed-batch path, or an auxiliary wrapper such as
  `modules_to_save`) gets ONE forward pre-hook, `_inject_adapter_names`, when the gate is created or when a
  structural change adds a layer. The hooks are removed by `gate.close()`. Nothing is registered, and no
  attribute is set, per call.
- A request sets `_ROUTE`, a module-level `ContextVar`, to its per-row adapter names for the length of the
  call (`route(...)`, reset in `finally`). A `ContextVar` belongs to the thread (and asyncio task) that set
  it, and a forward runs in the caller's thread, so concurrent requests never see each other's names.
- The hook hands the names to the layer as PEFT's own `adapter_names` keyword, so the row math is PEFT's
  `_mixed_batch_forward`: rows of one adapter go through that adapter's A and B, `"__base__"` rows through the
  base layer only. That path reads neither the active adapter nor any other mutable state of the layer, so
  requests run truly in parallel; the weights are only read.
- Outside a request the hooks do nothing (`_ROUTE` is `None`): a direct call of the model behaves as without
  us. Inside one (routed or switched), each hook first checks that its layer is still disabled, merged and
  set to the adapters the request was admitted with (`expect`), and fails the request otherwise (Note
  [Changes behind the gate] in guarding.py).
- When the hidden batch is a multiple of the request's rows (beam search, `num_return_sequences`), the names
  are repeated row by row, as transformers repeats the inputs (`repeat_interleave`).

What PEFT refuses in mixed batches (merged layers, DoRA, some layer types) is found by asking PEFT's own check
(`_check_forward_args`) in `blockers(...)`; such adapters are served by switching (see switching.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ._errors import AdapterChangedError
from .inputs import rows_of

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle

__all__ = ["BASE", "Router", "blockers", "current_route", "expect", "route"]

#: The row name that means "no adapter": the base model. It is PEFT's own placeholder.
BASE = "__base__"

# See Note [Adapter routing].
_ROUTE: ContextVar[tuple[str, ...] | None] = ContextVar("overmind_adapter_route", default=None)
# The layers' state the running request was admitted with (`AdapterHost.layer_state`); see Note [Changes behind
# the gate] in guarding.py.
_EXPECTED: ContextVar[dict[int, tuple[Any, ...]] | None] = ContextVar("overmind_adapter_expected", default=None)


@contextlib.contextmanager
def route(names: Sequence[str]) -> Iterator[None]:
    """Route every hooked layer called in this context to `names`, one name per row (or one name for all).

    Args:
        names (`Sequence[str]`):
            One adapter name per batch row, or a single name for every row. `"__base__"` means the base model.
    """
    token = _ROUTE.set(tuple(names))
    try:
        yield
    finally:
        _ROUTE.reset(token)


@contextlib.contextmanager
def expect(state: dict[int, tuple[Any, ...]]) -> Iterator[None]:
    """Make every hooked layer called in this context check that its disabled flag, merged and active adapters
    are still those of `state` (`AdapterHost.layer_state()`), and raise `AdapterChangedError` if not."""
    token = _EXPECTED.set(state)
    try:
        yield
    finally:
        _EXPECTED.reset(token)


def current_route() -> tuple[str, ...] | None:
    """The adapter names routed in the current context, or `None` outside a request."""
    return _ROUTE.get()


def _names_for(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str] | None:
    names = _ROUTE.get()
    if names is None:
        return None
    rows = rows_of(args, kwargs)
    if rows is not None and rows != len(names):
        if len(names) == 1:
            names = names * rows
        elif rows % len(names) == 0:
            per_row = rows // len(names)
            names = tuple(name for name in names for _ in range(per_row))
        else:
            raise ValueError(
                f"the request routes {len(names)} rows, but {type(module).__name__} was called with {rows}: "
                "pass one adapter name per input row"
            )
    return list(names)


def _check(module: Any) -> None:
    """Raise if the layer's state is not the one the running request was admitted with."""
    expected = _EXPECTED.get()
    if expected is None:
        return
    state = expected.get(id(module))
    if state is None:
        return
    disabled, merged, active = state[:3]
    now = (bool(module.disable_adapters), tuple(getattr(module, "merged_adapters", ())), tuple(module.active_adapters))
    if now == (disabled, merged, active):
        return
    what = (
        "disabled" if now[0] and not disabled else
        "enabled" if disabled and not now[0] else
        f"merged ({', '.join(now[1]) or 'none'})" if now[1] != merged else
        f"set to adapters {list(now[2])}"
    )  # fmt: skip
    raise AdapterChangedError(
        f"a {type(module).__name__} layer was {what} while a request of the gate ran: the model's adapters were "
        "changed without gate.exclusive() (see AdapterChangedError); this request failed instead of answering "
        "with other adapter layers"
    )


def _inject_adapter_names(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The one pre-forward hook of a routable layer. See Note [Adapter routing].

    Inside a request it also checks the layer's state against the state the request was admitted with: a layer
    disabled, merged or switched behind the gate would compute another adapter (Note [Changes behind the gate]
    in guarding.py).
    """
    _check(module)
    names = _names_for(module, args, kwargs)
    if names is None:
        return None
    return args, {**kwargs, "adapter_names": names}


def _is_routable_layer(module: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    if isinstance(module, AuxiliaryTrainingWrapper):
        return True
    return isinstance(module, BaseTunerLayer) and hasattr(module, "_mixed_batch_forward")


class Router:
    """Installs the routing hook once on every routable layer of a model, and removes it again.

    Args:
        model (`nn.Module`):
            The module whose forward the gate calls (a transformers model carrying LoRA layers).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._handles: dict[int, tuple[nn.Module, RemovableHandle]] = {}

    def sync(self) -> int:
        """Hook the layers that appeared since the last call, forget the ones that left; returns the count.

        Called at gate creation and after every exclusive section, never per request.
        """
        present: dict[int, nn.Module] = {}
        for module in self._model.modules():
            if _is_routable_layer(module):
                present[id(module)] = module
        for key in [key for key in self._handles if key not in present]:
            _, handle = self._handles.pop(key)
            handle.remove()
        for key, module in present.items():
            if key not in self._handles:
                handle = module.register_forward_pre_hook(_inject_adapter_names, with_kwargs=True)
                self._handles[key] = (module, handle)
        return len(self._handles)

    def remove(self) -> None:
        """Remove every hook this router installed."""
        while self._handles:
            _, (_, handle) = self._handles.popitem()
            handle.remove()

    def __len__(self) -> int:
        return len(self._handles)


def blockers(model: nn.Module, adapters: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """Why PEFT would refuse to route rows, for the whole model and per adapter.

    Args:
        model (`nn.Module`):
            The module carrying the tuner layers.
        adapters (`Sequence[str]`):
            The adapter names to check.

    Returns:
        `(whole, per_adapter)`: `whole` is a reason that blocks every adapter and the base rows (merged
        layers, disabled adapters, a layer type without a mixed-batch path) or `None`; `per_adapter` maps an
        adapter name to the reason it alone cannot be routed (DoRA, say).
    """
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    probe = torch.zeros(1)
    per_adapter: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            whole = _wrapper_blocker(name, module, adapters, per_adapter)
        elif isinstance(module, BaseTunerLayer):
            whole = _layer_blocker(name, module, adapters, per_adapter, probe)
        else:
            continue
        if whole is not None:
            return whole, {}
    return None, per_adapter


def _wrapper_blocker(name: str, module: Any, adapters: Sequence[str], per_adapter: dict[str, str]) -> str | None:
    """What blocks routing at an auxiliary wrapper (`modules_to_save`), for every adapter; or None, with the
    adapters it holds no entry for added to `per_adapter` (see `blockers`)."""
    import torch

    kind = type(module).__name__
    if module.disable_adapters:
        return f"adapters are disabled on {name}; enable them to route per request"
    if not isinstance(module.original_module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d,
                                               torch.nn.Conv2d, torch.nn.Conv3d)):
        return f"{name} ({kind} of {type(module.original_module).__name__}) has no mixed-batch path"
    own = set(module._adapters)
    if any(active not in own for active in module.active_adapters):
        return f"{name} ({kind}) does not hold the active adapter, so PEFT passes every row through"
    for adapter in adapters:
        if adapter not in own:
            per_adapter.setdefault(adapter, f"{name} ({kind}) has no entry for it")
    return None


def _layer_blocker(name: str, module: Any, adapters: Sequence[str], per_adapter: dict[str, str],
                   probe: torch.Tensor) -> str | None:
    """What blocks routing at a tuner layer, for every adapter; or None, with the adapters PEFT refuses to
    route there added to `per_adapter` (see `blockers`)."""
    kind = type(module).__name__
    if module.merged:
        merged = ", ".join(module.merged_adapters)
        return f"adapters are merged into the base weights ({merged}); call gate.unmerge() to route"
    if module.disable_adapters:
        return f"adapters are disabled on {name}; enable them to route per request"
    if not hasattr(module, "_mixed_batch_forward"):
        return f"{name} ({kind}) has no mixed-batch path in PEFT"
    check = getattr(module, "_check_forward_args", None)
    if check is None:
        return None
    try:
        check(probe, adapter_names=[BASE])
    except (ValueError, TypeError) as e:
        return f"{name}: PEFT refuses mixed batches here ({e})"
    own = module._get_available_adapters()
    for adapter in adapters:
        if adapter not in own or adapter in per_adapter:
            continue
        try:
            check(probe, adapter_names=[adapter])
        except (ValueError, TypeError) as e:
            per_adapter[adapter] = f"{name}: {e}"
    return None
