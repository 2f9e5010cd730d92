"""Warm kernels: Restart Kernel hands out a kernel that has already imported torch and transformers.

`python -m overmind_jupyter.warm install` writes a kernelspec whose provisioner (`WarmProvisioner`, entry
point `overmind-warm`) keeps one spare process per kernelspec in the Jupyter server. The spare imports the
configured modules once, runs no torch operation, and forks a fresh kernel on every start or restart;
the kernel started ahead for the next restart warms its devices while it waits (`warmed()`, Note [Devices
warmed ahead] in warmup.py). See docs/warm-kernels.md. Importing this package imports nothing beyond it;
the parts load on use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DEFAULT_PRELOAD", "WarmProvisioner", "describe_spares", "install", "stop_spares", "uninstall", "warmed"]

_LAZY = {
    "WarmProvisioner": "provisioner", "install": "kernelspec", "uninstall": "kernelspec",
    "stop_spares": "spares", "describe_spares": "spares", "DEFAULT_PRELOAD": "zygote", "warmed": "warmup",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
