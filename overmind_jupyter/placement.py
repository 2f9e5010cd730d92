"""Where a cached result goes: the device a load asked for with `device_map` (Note [Devices]), and the
device its own `.to("cuda")` asks for later (Note [Moves of cached results]); the loads the cache cannot
reproduce, which run as called: those that build their modules off the CPU (Note [Meta loads]) and
quantized ones (Note [Quantized loads]); and the kernels that can rebuild an entry whose tensors lie on a
device (Note [Tensors on a device])."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from kernel_server import settings
from kernel_server.formats import units_text

from . import keys, results
from .errors import PackError, RefusedByLibrary, Uncacheable
from .notices import fall_back

__all__ = ["Split", "device_identities", "elsewhere", "move", "ours", "place", "plain_only", "quantized",
           "quantized_checkpoint", "split_placement", "too_large"]

# Note [Devices]
# Cached bytes are CPU bytes. A load asked onto one device (`device_map="cuda:0"`, `"cuda"`, `0`,
# `{"": "cuda:1"}`, or `"auto"` where that means a single device) is cached as the CPU load and moved
# after the rebuild, so it lands where it would have landed without overmind: "cuda" is the device of
# `LOCAL_RANK`, and an int the current accelerator's, as transformers reads them. A device map that
# names no device (`"bogus"`, an int without an accelerator) runs as made, without a notice, and the
# library raises its own error. Any other placement is loaded plainly, and status says why: a device
# map that spreads a model over several devices or parts, one that offloads ("disk", "meta",
# `max_memory`, `offload_folder`: accelerate decides what goes where, by sizes the cache does not see),
# and a load run where torch builds modules off the CPU (Note [Meta loads]). Where OVERMIND_FAKE_GPUS
# stands in for devices, "auto" counts the simulated ones, as it counts real ones: the stand-in places
# (and leaves on the CPU) what a machine with those devices would place.
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
        count = _gpus()[0]  # the simulated ones where OVERMIND_FAKE_GPUS is set, else CUDA's
        if count > 1:
            raise Uncacheable(f"device_map={device_map!r} spreads the model over {count} GPUs")
        device_map = "cuda:0" if count == 1 else "cpu"
    if isinstance(device_map, dict):
        raise Uncacheable(f"device_map={kwargs['device_map']!r} places parts of the model on different "
                          "devices, or on disk")
    try:
        if kwargs["device_map"] == "cuda":  # as transformers reads it: the device of the process's rank
            device_map = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        device = torch.device(device_map)  # an int: the current accelerator's device of that index
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RefusedByLibrary(f"device_map={kwargs['device_map']!r}: {exc}") from None
    if device.type == "meta":
        raise Uncacheable(f"device_map={kwargs['device_map']!r} asks for a model without weights")
    rest = {k: v for k, v in kwargs.items() if k != "device_map"}
    return Split(rest, None, False) if device.type == "cpu" else Split(rest, device, by_sizes)


def _gpus() -> tuple[int, bool]:
    """The CUDA devices this kernel has, and whether they are simulated (OVERMIND_FAKE_GPUS)."""
    spec = settings.get(settings.FAKE_GPUS)  # a bad list is reported once and simulates nothing
    if spec:
        return len(settings.parse_fake_gpus(spec)), True
    import torch

    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), False


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
        return (f"it needs {units_text(need)} of {device} and the ledger can grant {units_text(grantable)} there, "
                "so the plain load puts part of it on the CPU or disk")
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
    """Where torch's own `nn.Module` methods are compiled from: told by a function of that file no one
    replaces (torch.compile's dynamo replaces `nn.Module.__init__` itself: every load then ran plainly)."""
    import torch.nn.modules.module

    return torch.nn.modules.module.register_module_forward_hook.__code__.co_filename


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


def place(obj: Any, device: Any, *, plain: Callable[[], Any] | None = None, held: bool = False) -> Any:
    """Move a loaded result to `device`: a model or a pipeline through the GPU units ledger (units.place,
    Note [Pipelines] in units/devices.py), anything else that can move with `.to`. Where the ledger cannot
    place it (units not granted in time, no daemon, any failure of ours) it moves the plain way, as the
    plain load would have, and says so. Every `.to` inside is the library's own (`moving`).

    Args:
        obj: the result.
        device: a `torch.device`.
        plain: the plain move, whose return value is returned (a move of Note [Moves of cached results]:
            the library's own method as it was called); default `obj.to(device)`.
        held: the placement stays until released, as torch's own `.to` would leave it (Note [Held
            placements] in units/residency.py); a load's `device_map` is placed lazily released.
    """
    from .units.devices import placeable
    from .units.residency import moving

    with moving():
        if device.type == "cuda" and placeable(obj):
            from . import units

            try:
                units.place(obj, device, held=held)
                return obj
            except Exception as exc:  # noqa: BLE001 (the plain move below, and why: docs/design.md invariant 1)
                why = str(exc) if isinstance(exc, units.UnitsError) else f"{type(exc).__name__}: {exc}"
                fall_back(f"{type(obj).__name__}.to({device})", "units", f"{why}; moved without the ledger",
                          plain=False)
        if plain is not None:
            return plain()
        to = getattr(obj, "to", None)
        return to(device) if callable(to) else obj


# Note [Moves of cached results]
# Besides `device_map`, a researcher puts a cached result on a GPU with its own method: `model.to("cuda")`,
# `.to("cuda:1")`, `.to(0)`, `.to(torch.device("cuda"))`, `.cuda()`, a pipeline's `pipe.to("cuda")` (which
# moves each component with its `.to`), or a library's `model.to(device)` (transformers' `pipeline(...,
# device=0)`, accelerate's `prepare`). With the cache on, such a move of a result of a cached call (a hit or
# a miss: `results.holds`), or of a PeftModel wrapping one (`get_peft_model(base)`, a PeftModel loaded
# plainly onto a cached base), goes the way of `device_map`: `place`, the units ledger and
# `units/transfer.to_device`, which fills the device from the cached bytes; it returns what the method
# returns (the module, the pipeline). The placement is held (Note [Held placements] in units/residency.py):
# as after torch's own `.to`, the model stays on the device until the kernel releases or frees it, and the
# ledger counts its units but never asks for them back (a model being trained is never moved under its
# optimizer). A load's `device_map` is placed as before, given back lazily when another kernel waits.
# The hook is `torch.nn.Module.to` and `.cuda` and `DiffusionPipeline.to`,
# patched at enable() (targets.py's table, restored at disable()); a library's override (transformers',
# diffusers') runs its own checks first and reaches it through `super()`. Its first check is one weak
# membership, so the `.to` of any other module costs a dictionary lookup more.
#
# Only a pure move of the whole result to a CUDA device this kernel has, or simulates, is routed; every other
# call is the library's own method, untouched, so its result and its errors are the library's: a dtype
# (`.to(torch.float16)`, `.to("cuda", torch.float16)`, a tensor), `non_blocking=True` or a `memory_format`;
# a target that is not CUDA, or that torch cannot address here (no CUDA: `.to("cuda")` raises as torch
# raises); a submodule or a pipeline's component, unless a cached result itself (part of a result: a holding
# of its own would split it, Note [Pipelines] in units/devices.py); a module from no cached call; a result
# already on that device (its live holding there, or every tensor there; on a simulated device, where its
# tensors stay on the CPU, such a move returns it, as the no-op it is on a real one); one under accelerate's
# or diffusers' hooks or with a device map (offloading, group offloading: those libraries decide where its
# weights go); a move inside a cached load (Note [Outermost call only] in targets.py); and any move while
# this thread moves a model for the units or the cache (`units.residency.moving`: to_device's own `.to`,
# the plain move of a fallback), so that nothing recurses. That mark is a ContextVar: a move of ours in one
# thread leaves the moves of other threads routed, and moves of one result in several threads at once make
# one placement (the residency's lock of the model). A failure on our path (units not granted in time, no
# daemon, any exception of ours) makes the library's own move, as called, and says why once (`place`, kind
# "units"). On simulated devices (OVERMIND_FAKE_GPUS) the ledger records the placement and the result
# stays on the CPU, as with `device_map`.
def ours(obj: Any) -> bool:
    """Whether a move of `obj` to a GPU is one of Note [Moves of cached results]: a result of a cached call,
    or a PeftModel wrapping one. A weak membership first: any other module pays little more."""
    if results.holds(obj):
        return True
    peft = sys.modules.get("peft.peft_model")
    wrapper = getattr(peft, "PeftModel", None) if peft is not None else None
    if wrapper is None or not isinstance(obj, wrapper):
        return False
    try:
        return results.holds(obj.get_base_model())
    except Exception:  # noqa: BLE001 (a PeftModel in a state we do not know: not ours, its own `.to` runs)
        return False


def move(original: Callable[..., Any], method: str, obj: Any, args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> Any:
    """`obj.<method>(*args, **kwargs)` for a result `ours`: through the ledger when it is a pure move of the
    whole result to a CUDA device, else `original` as called (Note [Moves of cached results]).

    Args:
        original: the library's own method (`torch.nn.Module.to`, `.cuda`, `DiffusionPipeline.to`).
        method: its name, "to" or "cuda".
        obj: the object it is called on.
        args: its positional arguments.
        kwargs: its keyword arguments.
    """
    from .units.residency import moving_now

    def plain() -> Any:
        return original(obj, *args, **kwargs)

    if moving_now():
        return plain()
    placed = _placed_with(obj)
    if placed is not None and _to_the_cpu(method, obj, args, kwargs):
        _give_units_back(placed, method)
        return plain()
    found = _destination(method, obj, args, kwargs)
    if found is None:
        return plain()
    device, simulated = found
    try:
        way = _way(obj, device, simulated)
    except Exception as exc:  # noqa: BLE001 (the library's move, and why: docs/design.md invariant 1)
        fall_back(f"{type(obj).__name__}.{method}({device})", "units",
                  f"{type(exc).__name__}: {exc}; moved without the ledger", plain=False)
        return plain()
    if way == "ledger":
        return place(obj, device, plain=plain, held=True)
    return obj if way == "there" else plain()


# Note [Moves back to the CPU]
# A placed result's own `.to("cpu")` or `.cpu()` (with a dtype too) moved it back with torch, and its
# placement stayed: a held one is never asked back, so its units stayed counted for good, `units.device_of`
# named the GPU, and other kernels waited for units that nothing used. Such a move now releases the
# placement first (`units.release`: the way back onto the cached weights where their bytes allow, the units
# given back), then runs the library's method, which has nothing left to move (or converts the dtype). A
# PeftModel and its base are two objects over one set of weights: the move of either releases the one
# placed. A model inside `units.using` keeps its units until the block ends; its move is torch's, and said.
def _placed_with(obj: Any) -> Any:
    """The placed model whose weights are `obj`'s: `obj`, the PeftModel over it, or its base; or None."""
    from .units.residency import instance

    residency = instance()
    if residency.device_of(obj) is not None:
        return obj
    wrapper = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    if wrapper is None:
        return None
    if isinstance(obj, wrapper):
        base = obj.get_base_model()
        return base if residency.device_of(base) is not None else None
    return next((m for m in residency.placed() if isinstance(m, wrapper) and m.get_base_model() is obj), None)


def _to_the_cpu(method: str, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call of `method` moves `obj` to the CPU (Note [Moves back to the CPU])."""
    parsed = _parsed_move(method, obj, args, kwargs)
    return parsed is not None and parsed[0] is not None and parsed[0].type == "cpu"


def _parsed_move(method: str, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a call of `.to`, `.cuda` or `.cpu` asks, each read as torch reads a `.to`: (device, dtype,
    non_blocking, memory_format); None where torch would not read it so (the library's call raises what
    it raises)."""
    import torch

    if method == "cpu":
        return torch.device("cpu"), None, False, None
    if not isinstance(obj, torch.nn.Module):  # a pipeline's `.to` takes this too; it changes no move
        kwargs = {k: v for k, v in kwargs.items() if k != "silence_dtype_warnings"}
    try:
        # an ordinal names a device of the current accelerator: CUDA's here, or a simulated one
        if args and _is_index(args[0]):
            args = (_cuda(args[0]), *args[1:])
        elif _is_index(kwargs.get("device")):
            kwargs = {**kwargs, "device": _cuda(kwargs["device"])}
        return tuple(torch._C._nn._parse_to(*args, **kwargs))
    except (TypeError, ValueError, RuntimeError):
        return None


def _give_units_back(obj: Any, method: str) -> None:
    from . import units

    try:
        units.release(obj)
    except Exception as exc:  # noqa: BLE001 (torch's move goes on, and why: docs/design.md invariant 1)
        fall_back(f"{type(obj).__name__}.{method}(cpu)", "units", f"{exc}; its units stay held until then",
                  plain=False)


def _destination(method: str, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool] | None:
    """The CUDA device a call of `method` moves `obj` to, and whether it is simulated, when the call is a
    pure move (no dtype, no `non_blocking`, no `memory_format`) to a device this kernel has or simulates;
    else None, and the call is the library's (Note [Moves of cached results])."""
    import torch

    count, simulated = _gpus()
    if not count:
        return None  # the library's call raises what torch raises here
    if method == "cuda":
        if len(args) + len(kwargs) > 1 or set(kwargs) - {"device"}:
            return None
        where = args[0] if args else kwargs.get("device")
        try:
            device = torch.device("cuda") if where is None else _cuda(where)
        except (TypeError, ValueError, RuntimeError):
            return None  # not a device torch reads so: the library's call raises what it raises
    else:
        parsed = _parsed_move(method, obj, args, kwargs)
        if parsed is None:
            return None
        device, dtype, non_blocking, memory_format = parsed
        if device is None or dtype is not None or non_blocking or memory_format is not None:
            return None
    if device.type != "cuda" or not (device.index is None or device.index < count):
        return None
    return device, simulated


def _cuda(where: Any) -> Any:
    """`where` ("cuda:1", 1, a `torch.device`) as a `torch.device`, an ordinal read as CUDA's."""
    import torch

    return torch.device("cuda", where) if _is_index(where) else torch.device(where)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _way(obj: Any, device: Any, simulated: bool) -> str:
    """How a pure move of `obj` to `device` goes (Note [Moves of cached results]): "ledger"; "library" (its
    own method: it is there already, under accelerate's or diffusers' hooks or a device map, or no model
    units can place); or "there", on a simulated device that holds it already, where the move is the no-op
    it is on a real device, and returns `obj` (torch's own would raise: the model is on the CPU)."""
    import torch

    from . import units
    from .units.devices import modules_of, placeable

    if not placeable(obj) or getattr(obj, "hf_device_map", None):
        return "library"
    index = device.index if device.index is not None else (0 if simulated else torch.cuda.current_device())
    if units.device_of(obj) == f"cuda:{index}":
        return "there" if simulated else "library"
    modules = list(modules_of(obj).modules())
    if any("_hf_hook" in m.__dict__ or "_diffusers_hook" in m.__dict__ for m in modules):
        return "library"
    if simulated:
        return "ledger"
    here = torch.device("cuda", index)
    tensors = [t for m in modules for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    return "library" if tensors and all(t.device == here for t in tensors) else "ledger"
