"""Exceptions and the warning category of overmind_jupyter. Messages say what happened and what to do."""

from __future__ import annotations

from kernel_server.errors import (
    BudgetExceeded,
    DaemonError,
    DaemonUnavailable,
    PeerRefused,
    ProtocolMismatch,
    RemoteError,
    StateDirError,
    WaitTimeout,
)

__all__ = [
    "BudgetExceeded",
    "CorruptEntry",
    "DaemonError",
    "DaemonUnavailable",
    "EntryElsewhere",
    "FallbackWarning",
    "NoRoomHere",
    "OvermindError",
    "OvermindWarning",
    "PackError",
    "PeerRefused",
    "PreloadError",
    "ProtocolMismatch",
    "PublishError",
    "RemoteError",
    "StateDirError",
    "Uncacheable",
    "WaitTimeout",
    "WidgetsNotBuilt",
]


class OvermindError(Exception):
    """Base class of the errors raised inside the kernel."""


class Uncacheable(OvermindError):
    """A call cannot be cached (an argument has no canonical form, say); it runs as a plain load."""


class RefusedByLibrary(Uncacheable):
    """The call's arguments are ones the library refuses with an error of its own (a device map that names
    no device): the call runs as made, without a notice, and raises it."""


class PackError(OvermindError):
    """A loaded object cannot be packed into an arena (unpicklable, or changed while packing)."""


class PublishError(OvermindError):
    """A result was loaded but could not be made an entry; `kind` names the fallback ("budget",
    "publish"). The result the caller gets is still the plain load's."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class CorruptEntry(OvermindError):
    """A cache entry could not be rebuilt; it is evicted and the call runs as a plain load."""


class EntryElsewhere(OvermindError):
    """A cache entry this kernel cannot rebuild though others can (its tensors lie on a device this kernel
    does not see as the one they were on); the call runs as a plain load and the entry stays."""


class NoRoomHere(OvermindError):
    """This kernel ran short of what rebuilding a cache entry takes (memory for a mapping, address space
    under `ulimit -v`, descriptors, a device's memory): the call runs as a plain load, and the entry, which
    is sound, stays for the kernels that have room."""


class PreloadError(OvermindError):
    """A preload worker failed; the message holds the end of its log."""


class WidgetsNotBuilt(OvermindError, FileNotFoundError):
    """The notebook widgets' front end (overmind_jupyter/widgets/static, bundled from labextension/src/widgets
    by the package's build) is missing: a checkout that was never installed with `pip install -e .`."""


class OvermindWarning(UserWarning):
    """Category of every warning overmind_jupyter emits."""


class FallbackWarning(OvermindWarning):
    """A call went the plain way instead of through the cache; the message names why."""
