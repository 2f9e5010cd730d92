"""Moving a placed model to its device, and back to the host without copies where the weights allow.

# Note [Lazy release without copies]
A model rebuilt from the cache holds its CPU weights in private mappings of the daemon's arena (see
Note [Copy-on-write mappings] in kernel_server/arena.py). When `to_device` moves such a model, it keeps
a reference to every CPU tensor that lies in an arena mapping (they cost no memory: the pages are the
daemon's shared ones) and records, for every tensor the model holds on the device, its storage address,
layout and version counter. `Transfer.to_host` puts the kept CPU tensor back for each device tensor that
is still the same (same storage, dtype, shape, strides and offset, same version: nothing wrote to it in
place and nothing replaced it), and copies the others from the device. So a model used for inference
comes back with no device-to-host copy, and a fine-tuned one brings its new weights back.

Version counters see in-place writes made through the tensor itself (optimizer steps, `load_state_dict`,
`add_` under `no_grad`), but not writes through `.data`, which bypass autograd's bookkeeping; code that
writes that way should place the model with `reuse_host=False`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import rebuild

__all__ = ["Transfer", "to_device"]


@dataclass
class _Slot:
    host: torch.Tensor | None  # the CPU tensor before the move, when it lies in an arena mapping
    ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    version: int

    @classmethod
    def of(cls, t: torch.Tensor, host: torch.Tensor | None) -> _Slot:
        return cls(host, t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape), t.stride(),
                   int(t.storage_offset()), t._version)

    def unchanged(self, t: torch.Tensor) -> bool:
        return (t._version == self.version and t.untyped_storage().data_ptr() == self.ptr
                and t.dtype == self.dtype and tuple(t.shape) == self.shape and t.stride() == self.stride
                and t.storage_offset() == self.offset)


@dataclass
class Transfer:
    """A model's move to `device`: what to put back on the host, and how it went."""

    device: str
    slots: dict[int, tuple[weakref.ref[torch.Tensor], _Slot]] = field(repr=False)
    kept: int  # device tensors with a kept host tensor
    moved_bytes: int

    def to_host(self, model: Any) -> dict[str, int]:
        """Move `model` back to the CPU: kept host tensors where unchanged, copies elsewhere.

        Returns:
            Counts and bytes of tensors `reused` (no copy) and `copied`.
        """
        reused: dict[int, int] = {}
        copied: dict[int, int] = {}

        def back(t: torch.Tensor) -> torch.Tensor:
            entry = self.slots.get(id(t))
            if entry is not None and entry[0]() is t and entry[1].host is not None and entry[1].unchanged(t):
                reused[id(t)] = t.nelement() * t.element_size()
                return entry[1].host
            if t.device.type != "cpu":
                copied[id(t)] = t.nelement() * t.element_size()
            return t.to("cpu")

        with torch.no_grad():
            model._apply(back)
        return {"reused": len(reused), "reused_bytes": sum(reused.values()), "copied": len(copied),
                "copied_bytes": sum(copied.values())}


def _slots(model: Any) -> dict[tuple[int, str, str], torch.Tensor]:
    out = {}
    for module in model.modules():
        for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in tensors.items():
                if t is not None:
                    out[(id(module), kind, name)] = t
    return out


def to_device(model: Any, device: str, *, reuse_host: bool = True, copy: bool = False) -> Transfer:
    """Move `model` to `device`, keeping its arena-backed CPU tensors for a copy-free way back.

    Args:
        model: a `torch.nn.Module`.
        device: where to ("cuda:0").
        reuse_host: keep host tensors that lie in an arena mapping (see Note [Lazy release without copies]).
        copy: copy every tensor even where `device` is where it already is (the tests move to "cpu"
            this way to exercise the way back without a GPU).
    """
    hosts: dict[tuple[int, str, str], torch.Tensor] = {}
    if reuse_host:
        for where, t in _slots(model).items():
            if t.device.type == "cpu" and t.numel() and rebuild.entry_of(t.untyped_storage().data_ptr()):
                hosts[where] = t.detach()
    with torch.no_grad():
        if copy:
            model._apply(lambda t: t.to(device, copy=True))
        else:
            model.to(device)
    slots: dict[int, tuple[weakref.ref[torch.Tensor], _Slot]] = {}
    moved = 0
    for where, t in _slots(model).items():
        if id(t) in slots:
            continue
        slots[id(t)] = (weakref.ref(t), _Slot.of(t, hosts.get(where)))
        moved += t.nelement() * t.element_size()
    return Transfer(device, slots, sum(1 for _, s in slots.values() if s.host is not None), moved)
