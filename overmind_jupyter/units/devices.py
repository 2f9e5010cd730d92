"""The devices this kernel reports to the ledger, and how many units a model needs.

A kernel reports what it sees: simulated devices when OVERMIND_FAKE_GPUS is set (no torch import, no
CUDA), else every visible CUDA device by its UUID, so that kernels with different CUDA_VISIBLE_DEVICES
still share one ledger entry per physical device. The daemon answers with the devices to use; a daemon
that simulates devices overrides what the kernel reports (see kernel_server/ledger.py), and a kernel that
simulates none uses none of them (Note [Simulated here] in residency.py).
"""

from __future__ import annotations

import math
from pathlib import PurePath
from typing import Any

from kernel_server import settings
from kernel_server.settings import GiB

from ._errors import UnitsError

__all__ = ["CONTEXT_UNITS", "GiB", "context_units", "cuda_identity", "local_devices", "model_bytes", "model_label",
           "modules_of", "placeable", "units_for"]

# Note [Context units]
# A kernel's CUDA context on a device is memory no model's units cover, held until the kernel ends; the
# ledger counts it as a holding of the kernel's from its first units on the device (Note [CUDA contexts]
# in kernel_server/ledger.py). Its size (the context, torch's kernels as they load, lazily by default
# since CUDA 11.7, and cuBLAS's handle and workspace) is well under 1 GiB on current GPUs, so one unit
# covers it. Not measured on this project's device machines yet: tests/test_units.py's
# `test_gpu_a_cuda_context_fits_its_units` measures it (another process's context, as
# `torch.cuda.mem_get_info` sees it) and fails if one unit does not cover it. A simulated device has no
# context, and none is counted there.
CONTEXT_UNITS = 1


def local_devices() -> list[dict[str, Any]]:
    """The devices of this process, as `units_register` takes them. A bad OVERMIND_FAKE_GPUS is reported
    once and simulates nothing, as if unset (Note [Bad settings] in kernel_server/settings.py)."""
    spec = settings.get(settings.FAKE_GPUS)
    if spec:
        sizes = settings.parse_fake_gpus(spec)
        return [{"id": f"sim:{i}", "name": f"cuda:{i}", "total_bytes": int(gib * GiB), "model": "simulated",
                 "simulated": True} for i, gib in enumerate(sizes)]
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append({"id": _identity(props), "name": f"cuda:{i}", "total_bytes": int(props.total_memory),
                    "model": str(props.name), "simulated": False})
    return out


def cuda_identity(index: int) -> str:
    """The physical identity of this process's CUDA device `index`: the same under any CUDA_VISIBLE_DEVICES.

    Args:
        index: the device's ordinal here (`cuda:1` is 1).
    """
    import torch

    return _identity(torch.cuda.get_device_properties(index))


def _identity(props: Any) -> str:
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    # older torch: the PCI address is as stable across CUDA_VISIBLE_DEVICES
    parts = (getattr(props, f"pci_{n}_id", "?") for n in ("domain", "bus", "device"))
    return "pci-{}:{}:{}".format(*parts)


def context_units(simulated: bool) -> int:
    """The units to count for this kernel's CUDA context on a device (Note [Context units]).

    Args:
        simulated: whether the device is simulated (OVERMIND_FAKE_GPUS).
    """
    return 0 if simulated else CONTEXT_UNITS


# Note [Pipelines]
# A pipeline (diffusers' DiffusionPipeline: an object whose `components` hold its modules, a unet, a vae,
# text encoders, beside a tokenizer and a scheduler) is placed as one model: one holding for all its
# modules, moved together and given back together, so that a release never leaves a pipeline split over
# two devices. Units see its modules as one `nn.ModuleList` made for each move, which holds them without
# changing them; the pipeline itself is what the residency keeps (weakly) and what `using` and `release`
# take. A load asked onto a device is placed through the ledger (loading.patched_call), and so is a cached
# pipeline's own `pipe.to("cuda")` with the cache on (Note [Moves of cached results] in placement.py), while
# a component's `.to` is torch's: a holding of its own would split the pipeline. `units.place(pipe)` places
# any pipeline.
def modules_of(obj: Any) -> Any:
    """What units move for `obj`, as one `torch.nn.Module`: a model itself, or a pipeline's modules
    (Note [Pipelines]).

    Raises:
        UnitsError: `obj` is neither.
    """
    import torch

    if isinstance(obj, torch.nn.Module):
        return obj
    components = getattr(obj, "components", None)
    modules = [m for m in components.values() if isinstance(m, torch.nn.Module)] if isinstance(components, dict) else []
    if not modules:
        raise UnitsError(f"units place torch.nn.Module objects (a model) and pipelines of them (a diffusers "
                         f"pipeline); got {type(obj).__name__}")
    return torch.nn.ModuleList(modules)


def placeable(obj: Any) -> bool:
    """Whether units can place `obj`: a model, or a pipeline of them (Note [Pipelines])."""
    try:
        modules_of(obj)
    except UnitsError:
        return False
    return True


def model_bytes(model: Any) -> int:
    """Bytes the model's (or the pipeline's) parameters and buffers take once moved to a device (tied
    tensors once)."""
    model = modules_of(model)
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for t in tensors:
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        total += t.nelement() * t.element_size()
    return total


def units_for(model: Any) -> int:
    """The units (1 GiB each) a model needs on a device: ceil(bytes / GiB), at least 1.

    Args:
        model: a `torch.nn.Module`, or a pipeline of them (Note [Pipelines]).
    """
    return max(1, math.ceil(model_bytes(model) / GiB))


def model_label(model: Any) -> str:
    """A short name for ledgers and tables: the class, and the checkpoint it came from if known."""
    name = type(model).__name__
    path = getattr(getattr(model, "config", None), "name_or_path", "") or getattr(model, "name_or_path", "") or ""
    return f"{name}({PurePath(str(path)).name})" if path else name
