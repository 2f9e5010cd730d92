"""Lazy attributes for the packages of overmind_jupyter, so that importing them stays cheap
(DESIGN.md invariant 8): a name is imported from its module on first access, then kept."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, where: dict[str, str],
                    names: Iterable[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`.

    Args:
        package: the package's `__name__`.
        where: attribute name -> the module (relative, like ".api") that defines it; a name that maps to
            itself prefixed with a dot is a submodule.
        names: what `dir()` lists besides the package's own globals (its `__all__`).
    """
    listed = set(names)

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = importlib.import_module(module, package)
        value = imported if module == f".{name}" else getattr(imported, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | listed | set(where))

    return __getattr__, __dir__
