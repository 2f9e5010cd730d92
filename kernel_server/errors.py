"""One exception class per failure mode of the daemon and its client. Each message says what to do."""

from __future__ import annotations

__all__ = [
    "BudgetExceeded",
    "DaemonError",
    "DaemonHung",
    "DaemonLost",
    "DaemonUnavailable",
    "DaemonUntrusted",
    "DescriptorsExhausted",
    "DescriptorsLost",
    "PeerRefused",
    "ProtocolError",
    "ProtocolMismatch",
    "RemoteError",
    "StateDirError",
    "WaitTimeout",
]


class DaemonError(Exception):
    """Base class of everything kernel_server raises."""


class StateDirError(DaemonError):
    """The state directory (OVERMIND_HOME) is missing, unsafe or unusable."""


class DaemonUnavailable(DaemonError):
    """No daemon answers and none could be started, or the daemon went away mid-call."""


class DaemonHung(DaemonUnavailable):
    """The daemon holds its socket but answers nothing (stopped, or stuck): the load does not wait."""


class DaemonUntrusted(DaemonError):
    """The socket is served or owned by another user: the client sends and reads nothing there."""


class DaemonLost(DaemonUnavailable):
    """The connection to a daemon that was there broke (it was killed, or it was exiting when we
    connected). Asking again reaches its successor."""


class ProtocolError(DaemonError):
    """A frame that cannot be accepted. `fatal` means the stream lost its framing."""

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class DescriptorsLost(ProtocolError):
    """A frame arrived whole, but the kernel could not give this process the descriptors attached to
    it: its descriptor table was full (EMFILE; Note [Descriptor budget] in descriptors.py). Not fatal:
    `payload` is the frame's payload, so that its request can be answered."""

    def __init__(self, message: str, payload: dict[str, object]) -> None:
        super().__init__(message)
        self.payload = payload


class ProtocolMismatch(DaemonError):
    """The daemon and this client speak different protocol versions."""


class PeerRefused(DaemonError):
    """The daemon refused this connection (another user's daemon, or a bad hello)."""


class RemoteError(DaemonError):
    """The daemon answered a request with an error; `code` names the failure."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class BudgetExceeded(RemoteError):
    """The store cannot make room for an entry within its byte budget."""


class DescriptorsExhausted(RemoteError):
    """The daemon has no file descriptor to spare for an entry or a reply (Note [Descriptor budget] in
    descriptors.py); the load runs plainly. Its code is "descriptors_exhausted"."""


class WaitTimeout(DaemonError):
    """A request waited longer than its timeout."""
