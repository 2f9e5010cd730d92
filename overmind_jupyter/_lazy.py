"""What overmind_jupyter makes on first use, so that importing it stays cheap (docs/design.md invariant
8): a package's attributes (a name is imported from its module on first access, then kept), and a
process's one instance of a class (`lazy_instance`)."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["lazy_attributes", "lazy_instance"]

T = TypeVar("T")


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


def lazy_instance(make: Callable[[], T]) -> Callable[[], T]:
    """A function that returns this process's one `make()`: made on the first call, under a lock, and
    made again in a forked child, which has none of its parent's threads and connections."""
    made: list[T] = []
    lock = threading.Lock()

    def instance() -> T:
        with lock:
            if not made:
                made.append(make())
            return made[0]

    def forget() -> None:
        nonlocal lock
        made.clear()
        lock = threading.Lock()  # perhaps held by a thread of the parent's, which the child lacks

    os.register_at_fork(after_in_child=forget)
    return instance
