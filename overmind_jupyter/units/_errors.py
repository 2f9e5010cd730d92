"""Exceptions of GPU residency. Messages say what happened and what to do."""

from __future__ import annotations

from overmind_jupyter.errors import OvermindError

__all__ = [
    "ModelBusyError",
    "ModelTooLargeError",
    "NoDeviceError",
    "NotPlacedError",
    "UnitsError",
    "UnitsTimeout",
]


class UnitsError(OvermindError):
    """Base class of the errors raised by `overmind_jupyter.units`."""


class UnitsTimeout(UnitsError, TimeoutError):
    """The units a model needs did not become free within the timeout (other kernels' models are busy)."""


class NoDeviceError(UnitsError, LookupError):
    """No GPU is known, or the device named is not one this kernel sees."""


class ModelTooLargeError(UnitsError, ValueError):
    """The model needs more units than the largest acceptable device has."""


class ModelBusyError(UnitsError, RuntimeError):
    """The model is inside a `units.using` block, so it cannot be moved now."""


class NotPlacedError(UnitsError, LookupError):
    """`units.using` was given a model that was never placed with `units.place`."""
