"""GPU units: models placed on GPUs under a per-device ledger of 1 GiB units, shared by the user's kernels.

```python
from overmind_jupyter import units

units.place(model, "cuda:0")     # acquire ceil(bytes / GiB) units, move the model, leave it there
with units.using(model):         # busy: never moved while inside; placed again if it was released
    model.generate(**inputs)
units.release(model)             # back to the CPU now (rebuilt weights come back without a copy)
print(units.format_state(units.state()))   # per device: capacity; each holder: kernel, model, units, busy
```

When another kernel needs units, the daemon asks idle holders, least recently used first, to release;
their kernels move those models back to the CPU. `OVERMIND_FAKE_GPUS=2x16` (in the kernel's environment,
which the daemon it starts inherits) simulates two devices of 16 GiB: everything is accounted for as on
real devices and labelled "simulated", while models stay on the CPU. Importing this package imports
neither torch nor CUDA (docs/design.md invariant 8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes
from ._errors import __all__ as _error_names

if TYPE_CHECKING:
    from ._errors import *  # noqa: F403 (the error classes, listed once: in _errors.__all__)
    from .api import device_of, place, release, using
    from .devices import units_for
    from .report import format_state, state

__all__ = ["device_of", "format_state", "place", "release", "state", "units_for", "using"]
__all__.extend(_error_names)

_WHERE = {
    **dict.fromkeys(["place", "using", "release", "device_of"], ".api"),
    **dict.fromkeys(["state", "format_state"], ".report"),
    **dict.fromkeys(_error_names, "._errors"),
    "units_for": ".devices",
}


__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__)
