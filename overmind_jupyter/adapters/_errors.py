"""Exceptions and the warning category of the adapter gate. Messages say what happened and what to do."""

from __future__ import annotations

from overmind_jupyter.errors import OvermindError, OvermindWarning

__all__ = [
    "AdapterChangedError",
    "AdapterError",
    "AdapterExistsError",
    "AdapterWarning",
    "GateClosedError",
    "GateDeadlockError",
    "NoAdaptersError",
    "RoutingUnavailableError",
    "UnknownAdapterError",
    "UnsupportedModelError",
]


class AdapterError(OvermindError):
    """Base class of the errors raised by the adapter gate."""


class NoAdaptersError(AdapterError, TypeError):
    """The model given to `adapters.gate` carries no PEFT adapter."""


class UnsupportedModelError(AdapterError, TypeError):
    """The model carries adapters the gate cannot serve (prompt learning, say)."""


class UnknownAdapterError(AdapterError, KeyError):
    """A request named an adapter the model does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AdapterExistsError(AdapterError, ValueError):
    """A structural operation would create an adapter whose name is taken."""


class RoutingUnavailableError(AdapterError, ValueError):
    """`mode="routed"` was asked for, but PEFT refuses per-row routing for this model."""


class GateClosedError(AdapterError, RuntimeError):
    """The gate was closed; requests can no longer run through it."""


class GateDeadlockError(AdapterError, RuntimeError):
    """An exclusive operation was started from inside a request of the same gate, which would wait forever."""


class AdapterChangedError(AdapterError, RuntimeError):
    """The model's adapter layers changed while a request ran, by a change made without `gate.exclusive()`
    (a layer's `enable_adapters`, `merge`, `set_adapter`, ... called by hand): the request failed instead of
    giving an answer computed with some other adapter. Submit it again; make such changes inside
    `with gate.exclusive():`."""


class AdapterWarning(OvermindWarning):
    """Warnings of the adapter gate."""
