"""Lazy attributes for the packages of overmind_jupyter, so that importing them stays cheap
(docs/design.md invariant 8): a name is imported from its module on first access, then kept."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, where: dict[str, str], names: Iterable[str],
                    submodules: Iterable[str] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`.

    Args:
        package: the package's `__name__`.
        where: attribute name -> the module (relative, like ".api") that defines it.
        names: what `dir()` lists besides the package's own globals (its `__all__`).
        submodules: names of submodules to import on access (`package.units`).
    """
    listed = set(names)
    modules = set(submodules)

    def __getattr__(name: str) -> Any:
        if name in modules:
            value = importlib.import_module(f".{name}", package)
        elif name in where:
            value = getattr(importlib.import_module(where[name], package), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | listed | set(where) | modules)

    return __getattr__, __dir__
