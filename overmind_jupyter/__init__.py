"""overmind_jupyter: Hugging Face models that survive kernel restarts, shared between kernels.

`%load_ext overmind_jupyter` then `%overmind on` routes `from_pretrained` through a per-user daemon
that keeps loaded weights in shared memory. Importing this package is cheap: it imports neither torch,
transformers, diffusers, peft nor IPython (docs/design.md invariant 8); everything heavy loads on use.
"""

from __future__ import annotations

import sys

from ._lazy import lazy_attributes
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

_WHERE = {
    **dict.fromkeys(["enable", "disable", "is_enabled", "status", "evict"], ".api"),
    **dict.fromkeys(["load_ipython_extension", "unload_ipython_extension"], ".extension"),
    "cached": ".loading",
    "preload": ".preloading",
}
_SUBMODULES = ("adapters", "units", "widgets", "warm", "loading", "rebuild", "keys", "demo_models", "extension",
               "api", "config", "patching", "targets")

__getattr__, __dir__ = lazy_attributes(__name__, _WHERE, __all__, _SUBMODULES)

# Imported where torch already is (a kernel's imports cell), the package prepares the hit path now rather
# than in the first patch-free `cached()` call (Note [Imports ahead of the hit] in hit_tuning.py), and
# imports the cached call itself.
if "torch" in sys.modules:
    from . import hit_tuning, loading  # noqa: F401 (loading: imported here, not by the first call)

    hit_tuning.prepare()


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """The Jupyter server extension of the side panel; its module is imported only by the server."""
    return [{"module": "overmind_jupyter.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The built side panel, for `jupyter labextension develop`."""
    return [{"src": "labextension", "dest": "overmind-jupyter"}]
