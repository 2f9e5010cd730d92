"""Moving a placed model to its device, and back to the host onto the cached weights where its bytes allow.

# Note [Lazy release to the cached weights]
A model rebuilt from the cache holds its CPU weights in private mappings of the daemon's arena (see
Note [Copy-on-write mappings] in kernel_server/arena.py). When `to_device` moves such a model, it keeps
a reference to every CPU tensor that lies in an arena mapping (they cost no memory: the pages are the
daemon's shared ones). `Transfer.to_host` compares each device tensor, byte for byte, with the CPU tensor
it was made from, and puts the kept CPU tensor back where they are equal: a model used for inference
comes back onto the shared pages, with no memory of its own. Every other tensor (written, replaced, of
another dtype or shape) is copied from the device, so every write the kernel made is kept, by whatever
route it was made.

A kept CPU tensor goes back only where nothing but this transfer holds its storage (`_alone`): a
`state_dict()` taken before the move, or a view of a weight, holds it too, and after a plain round trip
through a device the model has storages of its own, which a write to the model leaves that copy apart
from. Put back under such a holder, a write to the model reached the user's copy, and the other way
round; so those tensors are copied from the device instead. The storage's use count says which tensors
hold it, and its Python object's reference count who holds that object (`untyped_storage()`, `storage()`);
both are compared with what they read for a storage held by one tensor alone (`_LONE`).

Version counters decide nothing here (docs/design.md invariant 3): writes through `.data` (PEFT's
`merge_adapter` and `merge_and_unload` write `weight.data += delta`), numpy or ctypes leave them where they
were, and an in-place no-op moves them. The comparison reads the device tensor once, through one staging
buffer (pinned for CUDA, so the read runs at the link's speed), chunk by chunk against the kept tensor in
8-byte words, stopping at the first difference: it costs a device-to-host read of the model, as copying
it back would, but writes no new host memory (fresh pages fault at 2.8 GB/s here, docs/design.md section
5), and the model keeps sharing the daemon's pages. Measured on the CPU stand-in (benchmarks/release.py,
a 7B Llama's 13.5 GB of bf16, 8 of its 32 layers measured and scaled, 2 shared cores): comparing an
unchanged model 3.5 s (3.9 GB/s), copying it back 6.0-6.9 s (1.9-2.2 GB/s), a model written everywhere
(compared to its last chunk, then copied) 1.45 times the copy. Deciding by version counters cost nothing,
and lost writes. `reuse_host=False` skips the comparison and copies everything back.

# Note [Cached blocks of a released device]
The units a release gives back are the device's memory only once this process lets go of it: torch's
caching allocator keeps freed blocks reserved for the process until `torch.cuda.empty_cache()`. So the way
back empties the cache of the device it left, before the units go back to the ledger (residency.py), and
reports what that returned.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import rebuild

__all__ = ["Reader", "Transfer", "to_device"]

# Bytes of the staging buffer: 16 MiB copies from a GPU run at the link's speed (a copy's fixed cost is
# some microseconds); from the CPU (the tests' stand-in device) 256 KiB stay in the core's cache, which
# compared at 3.8-3.9 GB/s here against 2.2 GB/s for 64 MiB (benchmarks/release.py's tensors).
_CHUNK = {"cpu": 256 << 10}
_DEVICE_CHUNK = 16 << 20


@dataclass
class Transfer:
    """A model's move to `device`: what to put back on the host, and how it went."""

    device: str
    # id of each device tensor -> (the tensor, the CPU tensor it was made from when that lies in an arena)
    slots: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor | None]] = field(repr=False)
    kept: int  # device tensors with a kept host tensor
    fill: dict[str, Any] | None = None  # how the device copier filled it (filling.Filled), if it did

    def to_host(self, model: Any) -> dict[str, int]:
        """Move `model` back to the CPU: the kept host tensor where the bytes are the same, a copy elsewhere
        (see Note [Lazy release to the cached weights]); then give the device's cached blocks back (Note
        [Cached blocks of a released device]).

        Returns:
            Counts and bytes of tensors `reused` (the kept host tensor) and `copied` (from a device), and
            `freed_cache_bytes`, what the device's caching allocator gave back.
        """
        reused: dict[int, int] = {}
        copied: dict[int, int] = {}
        reader = Reader()
        alone = _alone([host for _, host in self.slots.values() if host is not None])

        def back(t: torch.Tensor) -> torch.Tensor:
            entry = self.slots.get(id(t))
            host = entry[1] if entry is not None and entry[0]() is t else None
            if host is not None and id(host) in alone and reader.same_bytes(t, host):
                reused[id(t)] = t.nelement() * t.element_size()
                return host
            if t.device.type != "cpu":
                copied[id(t)] = t.nelement() * t.element_size()
            return t.to("cpu")

        with torch.no_grad():
            model._apply(back)
        return {"reused": len(reused), "reused_bytes": sum(reused.values()), "copied": len(copied),
                "copied_bytes": sum(copied.values()), "freed_cache_bytes": _empty_cache(self.device)}


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """Who holds `t`'s storage, as read here: its use count (the tensors on it, and its Python object) and
    the references to its Python object (a `untyped_storage()` or `storage()` kept by the user)."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


# what `_holders` reads of a storage that one tensor holds and nothing else, read the same way
_LONE = _holders(torch.empty(1))


def _alone(hosts: list[torch.Tensor]) -> set[int]:
    """The ids of the `hosts` whose storages nothing else holds (Note [Lazy release to the cached weights])."""
    ours: dict[int, list[torch.Tensor]] = {}
    for host in hosts:
        ours.setdefault(host.untyped_storage()._cdata, []).append(host)
    alone: set[int] = set()
    for kept in ours.values():
        if _holders(kept[0]) == (_LONE[0] + len(kept) - 1, _LONE[1]):  # the kept tensors, and nothing else
            alone.update(map(id, kept))
    return alone


class Reader:
    """Reads tensors of a device to the host through one staging buffer, made at the first read (pinned
    for CUDA), to compare them with host tensors (Note [Lazy release to the cached weights])."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None

    def same_bytes(self, t: torch.Tensor, host: torch.Tensor) -> bool:
        """Whether `t` holds the same dtype, shape and bytes as the CPU tensor `host`; reads `t` up to the
        first difference.

        Args:
            t: a tensor on any device.
            host: a CPU tensor.
        """
        if t.dtype != host.dtype or t.shape != host.shape or not (_plain(t) and _plain(host)):
            return False
        src, ref = _as_bytes(t), _as_bytes(host)
        # in 8-byte words where both allow: torch.equal compares those about 4 times faster than bytes
        word = torch.int64 if _aligned(src) and _aligned(ref) else torch.uint8
        src, ref = src.view(word), ref.view(word)
        if self._staging is None:
            self._staging = torch.empty(_CHUNK.get(src.device.type, _DEVICE_CHUNK), dtype=torch.uint8,
                                        pin_memory=src.device.type == "cuda")
        staging = self._staging.view(word)
        for start in range(0, src.numel(), staging.numel()):
            part = src[start:start + staging.numel()]
            n = part.numel()
            staging[:n].copy_(part)  # synchronous: the bytes are on the host when it returns
            if not torch.equal(staging[:n], ref[start:start + n]):
                return False
        return True


def _plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of `t` in order, as a flat uint8 tensor (a view where `t` is contiguous)."""
    return t.reshape(-1).view(torch.uint8)


def _aligned(flat: torch.Tensor) -> bool:
    return flat.numel() % 8 == 0 and flat.storage_offset() % 8 == 0


def _empty_cache(device: str) -> int:
    """Give the cached blocks of a CUDA `device` back to the driver; the bytes given back (0 elsewhere)."""
    where = torch.device(device)
    if where.type != "cuda":
        return 0
    with torch.cuda.device(where):
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        return max(0, before - torch.cuda.memory_reserved())


def _slots(model: Any) -> dict[tuple[int, str, str], torch.Tensor]:
    out = {}
    for module in model.modules():
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in tensors.items():
                if t is not None:
                    out[(id(module), kind, name)] = t
    return out


def to_device(model: Any, device: str, *, reuse_host: bool = True, copy: bool = False,
              unit_device: str | None = None, simulated: bool = False, label: str = "") -> Transfer:
    """Move `model` to `device`, keeping its arena-backed CPU tensors for the way back.

    Args:
        model: a `torch.nn.Module`.
        device: where to ("cuda:0").
        reuse_host: keep host tensors that lie in an arena mapping, to put back where the device tensor's
            bytes are the same (see Note [Lazy release to the cached weights]); False copies everything back.
        copy: copy every tensor even where `device` is where it already is (the tests move to "cpu"
            this way to exercise the way back without a GPU).
        unit_device: the units ledger's id of the device: given, the arena-backed tensors are filled by
            the device copier where it is enabled (Note [Filling a model on a device] in filling.py).
        simulated: the device is simulated (OVERMIND_FAKE_GPUS), and `device` the CPU that stands in.
        label: the model's name, for the copier's records.
    """
    from . import filling

    before = _slots(model)
    hosts: dict[tuple[int, str, str], torch.Tensor] = {}
    if reuse_host:
        for where, t in before.items():
            if t.device.type == "cpu" and t.numel() and rebuild.entry_of(t.untyped_storage().data_ptr()):
                hosts[where] = t.detach()
    filled = None
    if unit_device is not None and filling.enabled(torch.device(device), simulated):
        filled = filling.fill(before.values(), torch.device(device), unit_device, label or type(model).__name__)
    with torch.no_grad():
        if filled is not None:
            views = filled.views

            def move(t: torch.Tensor) -> torch.Tensor:
                found = views.get(id(t))
                return found[1] if found is not None and found[0] is t else t.to(device, copy=copy)

            model._apply(move)
        elif copy:
            model._apply(lambda t: t.to(device, copy=True))
        else:
            model.to(device)
    slots: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor | None]] = {}
    for where, t in _slots(model).items():
        if id(t) not in slots:
            slots[id(t)] = (weakref.ref(t), hosts.get(where))
    fill = None if filled is None else {"filled_bytes": filled.bytes, "sources": filled.sources,
                                        "seconds": round(filled.seconds, 6)}
    return Transfer(device, slots, sum(1 for _, host in slots.values() if host is not None), fill)
