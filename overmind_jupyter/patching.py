"""A reversible patch engine: it remembers the original of every attribute it replaces.

# Note [Reversible patches]
Each patch is recorded once as (owner, name) -> the original descriptor as the owner held it, and
whether the owner defined it itself (restore by setting it back) or inherited it (restore by deleting
ours, so the inherited one shows through again). The first original wins: patching a patched
attribute again is a no-op, which makes `%reload_ext` idempotent. `unpatch_all` restores in reverse
order and keeps going past a failure (DESIGN.md invariant 6).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["get_original", "is_patched", "patch", "patched", "unpatch", "unpatch_all"]


@dataclass(frozen=True)
class _Record:
    owner: type
    name: str
    original: Any
    local: bool
    replacement: Any


_lock = threading.RLock()
_records: dict[tuple[type, str], _Record] = {}


def patch(owner: type, name: str, make: Callable[[Any], Any]) -> bool:
    """Replace `owner.name` by `make(original_descriptor)`; False if it is patched already."""
    with _lock:
        if (owner, name) in _records:
            return False
        local = name in owner.__dict__
        original = owner.__dict__[name] if local else inspect.getattr_static(owner, name)
        replacement = make(original)
        setattr(owner, name, replacement)
        _records[(owner, name)] = _Record(owner, name, original, local, replacement)
        return True


def unpatch(owner: type, name: str) -> None:
    with _lock:
        record = _records.pop((owner, name), None)
        if record is None:
            return
        if record.local:
            setattr(owner, name, record.original)
        elif owner.__dict__.get(name) is record.replacement:
            delattr(owner, name)


def unpatch_all() -> list[BaseException]:
    """Restore every patch, newest first; returns the errors met (each restore is still tried)."""
    errors: list[BaseException] = []
    with _lock:
        for owner, name in reversed(list(_records)):
            try:
                unpatch(owner, name)
            except BaseException as exc:  # noqa: BLE001 (keep restoring the others; reported at the end)
                errors.append(exc)
    return errors


def is_patched(owner: type, name: str) -> bool:
    return (owner, name) in _records


def get_original(owner: type, name: str) -> Any:
    """The descriptor `owner.name` had before it was patched."""
    record = _records.get((owner, name))
    if record is None:
        raise KeyError(f"{owner.__qualname__}.{name} is not patched")
    return record.original


def patched() -> list[str]:
    with _lock:
        return [f"{r.owner.__module__}.{r.owner.__qualname__}.{r.name}" for r in _records.values()]
