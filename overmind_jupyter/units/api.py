"""The public functions of `overmind_jupyter.units`: thin wrappers over this kernel's residency."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .residency import instance

__all__ = ["device_of", "place", "release", "using"]


def place(model: Any, device: Any = None, *, units: int | None = None, timeout: float | None = None,
          label: str | None = None, reuse_host: bool = True, held: bool = False) -> str:
    """Acquire GPU units for `model`, move it to the device, and leave it there (see Note [Residency]).

    A model already placed on an acceptable device stays where it is (it only becomes the most recently
    used). Its units are given back lazily: when another holder needs them and the model is idle, on
    `release`, when the model is garbage-collected, or when the kernel ends.

    Args:
        model: a `torch.nn.Module`, or a pipeline of them (a diffusers pipeline: one holding for all its
            modules, see Note [Pipelines] in units/devices.py).
        device: "cuda:1", 1 or a `torch.device`, or None for the first device (in index order) that fits.
        units: 1 GiB units to take; default ceil(bytes of parameters and buffers / GiB). Give more to keep
            room for activations and caches.
        timeout: seconds to wait for units held by busy models elsewhere; default OVERMIND_UNITS_TIMEOUT
            (600); `float("inf")` waits for ever, 0 not at all.
        label: the name shown in `units.state()`; default the model's class and checkpoint.
        reuse_host: on the way back to the CPU, put the cached CPU weights back where the device tensor's
            bytes are still theirs instead of copying (see Note [Lazy release to the cached weights] in
            units/transfer.py); False copies every tensor back.
        held: keep it there, as torch's own `.to("cuda")` would, until `release` or collection: the ledger
            counts its units but never asks for them back (what a cached result's own `.to("cuda")` does:
            Note [Moves of cached results] in placement.py).

    Returns:
        The device the model is on, as this kernel names it ("cuda:0"). On a simulated device
        (OVERMIND_FAKE_GPUS) the model stays on the CPU.

    Raises:
        UnitsTimeout: the units were not free in time; the message lists who holds them.
        ModelTooLargeError: the model needs more units than the device has.
        NoDeviceError: no GPU is known, or `device` is not one this kernel sees.
        ModelBusyError: the model is inside `using` and would have to move to another device.
    """
    return instance().place(model, device, units=units, timeout=timeout, label=label, reuse_host=reuse_host,
                            held=held)


@contextlib.contextmanager
def using(model: Any) -> Iterator[Any]:
    """Mark `model` busy for the block: it is never moved off its device while inside. A model whose units
    were given back since it was placed is placed again (on the same device) first, waiting for units if
    needed. Nested and concurrent blocks are counted; the mark is undone however the block ends.

    Args:
        model: a model placed before with `place`.

    Raises:
        NotPlacedError: the model was never placed.
    """
    with instance().using(model) as placed:
        yield placed


def release(model: Any) -> bool:
    """Move `model` back to the CPU now and give its units back.

    Args:
        model: a placed model.

    Returns:
        True if it held units; False if it held none (never placed, or already released).

    Raises:
        ModelBusyError: the model is inside a `using` block.
    """
    return instance().release(model)


def device_of(model: Any) -> str | None:
    """The device `model` holds units on ("cuda:0"), or None if it holds none now.

    Args:
        model: any model.
    """
    return instance().device_of(model)
