"""The adapter gate: many requests with different LoRA adapters on one model, concurrently and correctly.

```python
from overmind_jupyter import adapters

g = adapters.gate(peft_model)                    # or a transformers model with model.load_adapter(...)
g.generate(**inputs, adapter="fr", max_new_tokens=16)
g.generate(**batch, adapter=["fr", "de", "__base__"], max_new_tokens=16)   # one adapter per row
g(**inputs, adapter="de")                        # a forward
g.submit(**inputs, adapter="fr").result()        # through the batching engine
with g.exclusive():                              # structural changes
    peft_model.load_adapter(path, adapter_name="es")
g.state()                                        # mode, active set, in-flight and queued per adapter
```

Importing this package imports neither torch nor PEFT (docs/design.md invariant 8): the names below load on first
use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes
from ._errors import __all__ as _error_names

if TYPE_CHECKING:
    from ._errors import *  # noqa: F403 (the error classes, listed once: in _errors.__all__)
    from .gating import AdapterGate, gate, open_gates
    from .routing import BASE

__all__ = ["BASE", "AdapterGate", "gate", "open_gates"]
__all__.extend(_error_names)

_WHERE = {
    **dict.fromkeys(["gate", "open_gates", "AdapterGate"], ".gating"),
    **dict.fromkeys(_error_names, "._errors"),
    "BASE": ".routing",
}


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
