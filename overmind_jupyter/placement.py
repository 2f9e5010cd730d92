"""Where a cached result goes: the device a load asked for with `device_map` (Note [Devices])."""

from __future__ import annotations

from typing import Any

from .errors import Uncacheable
from .notices import fall_back

__all__ = ["place", "split_placement"]

# Note [Devices]
# Cached bytes are CPU bytes. A load asked onto one device (`device_map="cuda:0"`, `"cuda"`, `0`,
# `{"": "cuda:1"}`, or `"auto"` where that means a single device) is cached as the CPU load and moved
# after the rebuild, so it lands where it would have landed without overmind. A device map that spreads
# a model over several devices is loaded plainly, and status says so.

def split_placement(kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    if kwargs.get("device_map") is None:
        return kwargs, None
    import torch

    device_map = kwargs["device_map"]
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        count = torch.cuda.device_count()
        if count > 1:
            raise Uncacheable(f"device_map={device_map!r} spreads the model over {count} GPUs")
        device_map = "cuda:0" if count == 1 else "cpu"
    try:
        device = torch.device(device_map) if not isinstance(device_map, int) else torch.device("cuda", device_map)
    except (TypeError, RuntimeError):
        raise Uncacheable(f"device_map={kwargs['device_map']!r} places parts of the model on different "
                          "devices") from None
    rest = {k: v for k, v in kwargs.items() if k != "device_map"}
    return rest, None if device.type == "cpu" else device


def place(obj: Any, device: Any) -> Any:
    """Move a loaded result to `device`: a model through the GPU units ledger (units.place), anything
    else that can move (a pipeline) with `.to`. Units that cannot be had in time leave the move to
    `.to`, as the plain load would have done, and say so."""
    import torch

    if isinstance(obj, torch.nn.Module) and device.type == "cuda":
        from . import units

        try:
            units.place(obj, device)
            return obj
        except units.UnitsError as exc:
            fall_back(f"{type(obj).__name__}.to({device})", "units", f"{exc}; moved without the ledger", plain=False)
    move = getattr(obj, "to", None)
    return move(device) if callable(move) else obj
