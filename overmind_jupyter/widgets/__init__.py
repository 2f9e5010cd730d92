"""Live notebook widgets: the cache table, the GPU units bar, the adapter panel.

```python
from overmind_jupyter import widgets

widgets.status_panel()                 # what `%overmind status` shows in a notebook: cache table + units bar
widgets.units_bar()                    # `%overmind units`: a bar per GPU, a segment per holder
widgets.adapter_panel(model, tok)      # `%overmind adapters model --tokenizer tok`: switch, mix, compare
```

Each widget updates itself from the daemon and from the gate on one background thread of the kernel
(see Note [Widget polling] in polling.py), never blocks the kernel, and stops with `widget.close()`. What the
browser runs is TypeScript beside the side panel's, in labextension/src/widgets/, built into widgets/static/
by `pip install -e .` (see live.py).
Importing this package imports neither ipywidgets nor anywidget (docs/design.md invariant 8); they load with the
first widget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .cache import CacheTable
    from .devices import UnitsBar
    from .gate import AdapterPanel, GateView, Outputs
    from .status import StatusPanel

__all__ = [
    "AdapterPanel",
    "CacheTable",
    "GateView",
    "Outputs",
    "StatusPanel",
    "UnitsBar",
    "adapter_panel",
    "cache_table",
    "status_panel",
    "units_bar",
]

_WHERE = {
    "AdapterPanel": ".gate",
    "GateView": ".gate",
    "Outputs": ".gate",
    "CacheTable": ".cache",
    "StatusPanel": ".status",
    "UnitsBar": ".devices",
}


def status_panel() -> StatusPanel:
    """The cache table (entries, evict buttons, gates, fallbacks) over the GPU units bar, kept live."""
    from .status import StatusPanel

    return StatusPanel()


def cache_table() -> CacheTable:
    """The cache table alone, kept live."""
    from .cache import CacheTable

    return CacheTable()


def units_bar() -> UnitsBar:
    """The GPU units of every device as bars, kept live from `overmind_jupyter.units.state()`."""
    from .devices import UnitsBar

    return UnitsBar()


def adapter_panel(model: Any, tokenizer: Any = None) -> AdapterPanel:
    """The adapter panel of `model`'s gate (`adapters.gate(model)`, created if needed), kept live.

    Args:
        model: a PEFT model (or a transformers model with adapters loaded), or an `AdapterGate`.
        tokenizer: encodes prompts and decodes outputs; default: one saved next to the model's checkpoint.
    """
    from .. import adapters
    from .gate import AdapterPanel

    gate = model if isinstance(model, adapters.AdapterGate) else adapters.gate(model)
    return AdapterPanel(gate, tokenizer)


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
