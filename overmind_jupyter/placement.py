"""Where a cached result goes: the device a load asked for with `device_map` (Note [Devices]); the loads
the cache cannot reproduce, which run as called: those that build their modules off the CPU (Note [Meta
loads]) and quantized ones (Note [Quantized loads]); and the kernels that can rebuild an entry whose
tensors lie on a device (Note [Tensors on a device])."""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, NamedTuple

from kernel_server import settings

from . import keys
from .errors import PackError, Uncacheable
from .notices import fall_back

__all__ = ["Split", "device_identities", "elsewhere", "place", "plain_only", "quantized", "quantized_checkpoint",
           "split_placement", "too_large"]

# Note [Devices]
# Cached bytes are CPU bytes. A load asked onto one device (`device_map="cuda:0"`, `"cuda"`, `0`,
# `{"": "cuda:1"}`, or `"auto"` where that means a single device) is cached as the CPU load and moved
# after the rebuild, so it lands where it would have landed without overmind. Any other placement is
# loaded plainly, and status says why: a device map that spreads a model over several devices or parts,
# one that offloads ("disk", "meta", `max_memory`, `offload_folder`: accelerate decides what goes where,
# by sizes the cache does not see), and a load run where torch builds modules off the CPU (Note [Meta
# loads]). Where OVERMIND_FAKE_GPUS stands in for devices, "auto" counts the simulated ones, as it counts
# real ones: the stand-in places (and leaves on the CPU) what a machine with those devices would place.
_OFFLOADING = ("max_memory", "offload_folder", "offload_state_dict", "offload_buffers")
_BY_SIZES = ("auto", "balanced", "balanced_low_0", "sequential")  # maps accelerate fills by the devices' memory


class Split(NamedTuple):
    """A load's placement split from it: the arguments of the CPU load, the device to move its result to
    (None: it stays on the CPU), and whether that device was chosen by sizes (`"auto"`: Note [Auto on one
    device])."""

    kwargs: dict[str, Any]
    device: Any
    by_sizes: bool = False


def split_placement(kwargs: dict[str, Any]) -> Split:
    """Split the placement a load asks for from it (Note [Devices]).

    Args:
        kwargs: the load's keyword arguments.

    Raises:
        Uncacheable: the placement asked for is not one device.
    """
    offloading = [k for k in _OFFLOADING if kwargs.get(k) not in (None, False)]
    if offloading:
        raise Uncacheable(f"{', '.join(f'{k}={kwargs[k]!r}' for k in offloading)} lets accelerate offload "
                          "parts of the model, which the cache cannot reproduce")
    if kwargs.get("device_map") is None:
        return Split(kwargs, None)
    import torch

    device_map = kwargs["device_map"]
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    by_sizes = device_map in _BY_SIZES
    if by_sizes:
        count = _gpu_count()
        if count > 1:
            raise Uncacheable(f"device_map={device_map!r} spreads the model over {count} GPUs")
        device_map = "cuda:0" if count == 1 else "cpu"
    try:
        device = torch.device(device_map) if not isinstance(device_map, int) else torch.device("cuda", device_map)
    except (TypeError, RuntimeError):
        raise Uncacheable(f"device_map={kwargs['device_map']!r} places parts of the model on different "
                          "devices, or on disk") from None
    if device.type == "meta":
        raise Uncacheable(f"device_map={kwargs['device_map']!r} asks for a model without weights")
    rest = {k: v for k, v in kwargs.items() if k != "device_map"}
    return Split(rest, None, False) if device.type == "cpu" else Split(rest, device, by_sizes)


def _gpu_count() -> int:
    """The GPUs a map by sizes may use: the simulated ones where OVERMIND_FAKE_GPUS is set, else CUDA's."""
    try:
        spec = settings.FAKE_GPUS.read()
        if spec:
            return len(settings.parse_fake_gpus(spec))
    except (settings.SettingError, ValueError):
        pass  # reported where the units read it; here it simulates nothing
    import torch

    return torch.cuda.device_count()


# Note [Auto on one device]
# `device_map="auto"` (or "balanced", "sequential") with one GPU puts the model there whole only if it
# fits: accelerate fills the device up to 90% of what is free on it now and puts the rest on the CPU or
# disk. The cache moves the model whole, so first it checks that it fits: in what the ledger can grant on
# the device (its capacity, less this kernel's CUDA context), and on a real device in what accelerate
# would give it (90% of the free memory and of what the allocator holds unused, as transformers counts).
# A model that does not fit loads as called, and spills as it would have. The decision is accelerate's
# only to that approximation: a model that fits by under its largest layer's size may still be split by
# the plain load, which keeps that much free for offloaded layers.
_AUTO_SHARE = 0.9  # transformers' share of one device's free memory that `"auto"` fills


def too_large(obj: Any, device: Any) -> str | None:
    """Why `obj`, placed on `device` by a map by sizes, must load as called (Note [Auto on one device]),
    or None: it fits."""
    from .units import UnitsError
    from .units.devices import GiB, model_bytes, placeable, units_for
    from .units.residency import instance

    if not placeable(obj):
        return None
    try:
        grantable = instance().grantable(device)
    except UnitsError:
        grantable = None  # no ledger: `place` moves it with `.to` and says why
    need = units_for(obj)
    if grantable is not None and need > grantable:
        return (f"it needs {need} unit{'s' * (need != 1)} of {device} and the ledger can grant {grantable} units "
                "there, so the plain load puts part of it on the CPU or disk")
    free = _free_for_auto(device)
    size = model_bytes(obj)
    if free is not None and size > free:
        return (f"its {size / GiB:.2f} GiB exceed the {free / GiB:.2f} GiB device_map='auto' may fill on {device} "
                "now, so the plain load puts part of it on the CPU or disk")
    return None


def _free_for_auto(device: Any) -> int | None:
    """What `"auto"` may fill of a real CUDA device now (Note [Auto on one device]); None elsewhere."""
    import torch

    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, _total = torch.cuda.mem_get_info(index)
    unused = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    return int((free + unused) * _AUTO_SHARE)


# Note [Meta loads]
# Under `with torch.device("meta")` (or any default device but the CPU: `torch.set_default_device`) and
# under accelerate's `init_empty_weights()`, which replaces `nn.Module.register_parameter` for the block,
# a load builds its modules elsewhere than on the CPU: transformers refuses the first (RuntimeError) and
# fails on the second (ValueError), and a load to another default device lands there. A hit would return
# the CPU model of the entry instead, so such a call runs plainly, as it would without overmind.
def plain_only() -> str | None:
    """Why a load must run plainly where it is called (Note [Meta loads]), or None."""
    torch = sys.modules.get("torch")
    if torch is None:  # nothing can have changed where modules are built, and torch is not ours to import
        return None
    # a default device is a mode on torch's function-mode stack: none there, none to ask for (5 us saved)
    modes = getattr(torch._C, "_len_torch_function_stack", None)
    default = torch.get_default_device() if modes is None or modes() else None
    if default is not None and default.type != "cpu":
        return (f"torch's default device is {default.type} here (a `with torch.device(...)` block or "
                "torch.set_default_device), where the load builds its modules")
    register = torch.nn.Module.register_parameter
    code = getattr(register, "__code__", None)
    if code is None or code.co_filename != _module_file():
        where = f"{getattr(register, '__module__', '?')}.{getattr(register, '__qualname__', '?')}"
        return (f"nn.Module.register_parameter is replaced by {where} (accelerate's init_empty_weights or "
                "init_on_device), so the load builds modules without weights")
    return None


@functools.cache
def _module_file() -> str:
    """Where torch's own `nn.Module` methods are compiled from."""
    import torch.nn.modules.module

    return torch.nn.modules.module.Module.__init__.__code__.co_filename


# Note [Quantized loads]
# A load asked to quantize (a `quantization_config=` argument, or a checkpoint whose config.json carries
# one: a pre-quantized model, a pipeline's component) runs as called. bitsandbytes quantizes while it
# loads onto the GPU, and `.to()` of its 8-bit and 4-bit models raises; the other methods (GPTQ, AWQ,
# torchao, fp8, ...) place and pack their weights their own way. The cache's CPU load and move reproduces
# none of it. The checkpoint's configs are found among the files its key fingerprinted, and each is read
# once per identity (device, inode, size, mtime_ns, ctime_ns), so a hit reads none again.
_QUANTIZING = ("quantization_config", "load_in_8bit", "load_in_4bit")


def quantized(kwargs: dict[str, Any]) -> str | None:
    """Why a call's arguments ask for a quantized load (Note [Quantized loads]), or None."""
    asked = [k for k in _QUANTIZING if kwargs.get(k) not in (None, False)]
    if not asked:
        return None
    method = getattr(kwargs.get("quantization_config"), "quant_method", None)
    named = f" ({getattr(method, 'value', method)})" if method is not None else ""
    return f"{', '.join(f'{k}=' for k in asked)}{named} asks for a quantized load, {_QUANTIZED}"


def quantized_checkpoint(ck: keys.CallKey) -> str | None:
    """Why the checkpoint a call reads is quantized (a config.json with a `quantization_config`), or None."""
    for path, identity in keys.files_named(ck, "config.json"):
        method = _quant_method(path, identity)
        if method is not None:
            return f"{path} has a quantization_config ({method}), {_QUANTIZED}"
    return None


_QUANTIZED = ("which the cache's CPU load and move cannot reproduce (bitsandbytes quantizes while it loads onto "
              "the GPU, and its models refuse .to())")


@functools.lru_cache(maxsize=256)
def _quant_method(path: str, identity: tuple[Any, ...]) -> str | None:
    """The `quant_method` of the `quantization_config` in config.json `path` ("unnamed" without one), or
    None; cached by the file's identity, which the call's key holds."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # not a config this cache can read: the load reads it, and says what is wrong
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quantization, dict):
        return None
    return str(quantization.get("quant_method") or "unnamed")


# Note [Tensors on a device]
# A cached function may return tensors on a CUDA device (its own `.to("cuda")`; a load asked onto a device
# with `device_map` is cached as the CPU load). Its graph names their device by ordinal, "cuda:1", which is
# another physical device under another CUDA_VISIBLE_DEVICES, and none in a kernel without CUDA. So the
# entry holds the physical identity (the UUID, units/devices.py) of each device its storages lie on, and
# a hit checks first that this kernel's device of that ordinal is that one; where it is not (another
# order, another device, no CUDA) the call loads plainly and the entry stays for the kernels that can
# rebuild it, where the rebuild used to fail and evict it, as corrupt, for everyone. The ordinal must name
# that same device, not merely the device be visible: the call named the ordinal, which a plain run here
# would read as this kernel's. Storages on a device without such an identity (anything but the CPU and
# CUDA) are not cached.
def device_identities(devices: list[str]) -> dict[str, str]:
    """The physical identity of each device a graph's storages lie on ("cuda:0" -> "GPU-<uuid>"), for
    its entry (Note [Tensors on a device]).

    Raises:
        PackError: a storage lies on a device other than a CUDA one.
    """
    if not devices:  # a CPU result: no import of the units (about 1.5 ms of a miss)
        return {}
    from .units.devices import cuda_identity

    out = {}
    for name in devices:
        if not name.startswith("cuda:"):
            raise PackError(f"a storage on {name} cannot be cached: only CPU and CUDA storages are")
        out[name] = cuda_identity(int(name.removeprefix("cuda:")))
    return out


def elsewhere(identities: dict[str, str]) -> str | None:
    """Why this kernel cannot rebuild an entry whose storages lie on the devices `identities` (by ordinal,
    with the identity each had where the entry was made), or None (Note [Tensors on a device])."""
    if not identities:
        return None
    import torch

    from .units.devices import cuda_identity

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name, identity in identities.items():
        index = int(name.removeprefix("cuda:")) if name.startswith("cuda:") else -1
        here = cuda_identity(index) if 0 <= index < count else None
        if here != identity:
            where = f"{here} here" if here is not None else (
                "absent here" if count else "on no device here: this kernel has no CUDA")
            return f"the entry's tensors lie on {name}, which was {identity} where it was cached and is {where}"
    return None


def place(obj: Any, device: Any) -> Any:
    """Move a loaded result to `device`: a model or a pipeline through the GPU units ledger (units.place,
    Note [Pipelines] in units/devices.py), anything else that can move with `.to`. Units that cannot be
    had in time leave the move to `.to`, as the plain load would have done, and say so."""
    from .units.devices import placeable

    if device.type == "cuda" and placeable(obj):
        from . import units

        try:
            units.place(obj, device)
            return obj
        except units.UnitsError as exc:
            fall_back(f"{type(obj).__name__}.to({device})", "units", f"{exc}; moved without the ledger", plain=False)
    move = getattr(obj, "to", None)
    return move(device) if callable(move) else obj
