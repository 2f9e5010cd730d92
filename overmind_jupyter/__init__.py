"""overmind_jupyter: Hugging Face models that survive kernel restarts, shared between kernels.

`%load_ext overmind_jupyter` then `%overmind on` routes `from_pretrained` through a per-user daemon
that keeps loaded weights in shared memory. Importing this package is cheap: it imports neither torch,
transformers, diffusers, peft nor IPython (DESIGN.md invariant 8); everything heavy loads on use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__

__all__ = [
    "__version__",
    "cached",
    "disable",
    "enable",
    "evict",
    "is_enabled",
    "load_ipython_extension",
    "preload",
    "status",
    "unload_ipython_extension",
]

_LAZY = {
    "enable": "extension", "disable": "extension", "is_enabled": "extension", "status": "extension",
    "evict": "extension", "load_ipython_extension": "extension", "unload_ipython_extension": "extension",
    "cached": "loading", "preload": "preload",
}
_SUBMODULES = ("adapters", "units", "widgets", "warm", "loading", "rebuild", "keys", "demo_models", "extension", "config",
               "patching", "targets")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_SUBMODULES))


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """The Jupyter server extension of the side panel; its module is imported only by the server."""
    return [{"module": "overmind_jupyter.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The built side panel, for `jupyter labextension develop`."""
    return [{"src": "labextension", "dest": "overmind-jupyter"}]
