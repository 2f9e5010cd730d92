"""The per-user daemon that keeps loaded models in shared memory, and its client library.

Importing this package imports neither torch nor IPython (docs/design.md invariant 8).
"""

from __future__ import annotations

from . import errors
from ._version import __version__
from .client import Client, shared_client
from .errors import *  # noqa: F403 (every error class, listed once: in errors.__all__)
from .protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "Client", "__version__", "shared_client"]
__all__ += errors.__all__
