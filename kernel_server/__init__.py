"""The per-user daemon that keeps loaded models in shared memory, and its client library.

Importing this package imports neither torch nor IPython (docs/design.md invariant 8).
"""

from __future__ import annotations

from ._version import __version__
from .client import Client, shared_client
from .errors import (
                     BudgetExceeded,
                     DaemonError,
                     DaemonUnavailable,
                     DescriptorsExhausted,
                     PeerRefused,
                     ProtocolError,
                     ProtocolMismatch,
                     RemoteError,
                     StateDirError,
                     WaitTimeout,
)
from .protocol import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "BudgetExceeded",
    "Client",
    "DaemonError",
    "DaemonUnavailable",
    "DescriptorsExhausted",
    "PeerRefused",
    "ProtocolError",
    "ProtocolMismatch",
    "RemoteError",
    "StateDirError",
    "WaitTimeout",
    "__version__",
    "shared_client",
]
