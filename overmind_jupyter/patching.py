"""A reversible patch engine: it remembers the original of every attribute it replaces.

# Note [Reversible patches]
Each patch is recorded once as (owner, name, layer), and the attribute's original as (owner, name) -> the
descriptor as the owner held it before any patch, and
whether the owner defined it itself (restore by setting it back) or inherited it (restore by deleting
ours, so the inherited one shows through again). The first original wins: patching a patched
attribute again is a no-op, which makes `%reload_ext` idempotent. `unpatch_all` restores in reverse
order and keeps going past a failure (docs/design.md invariant 6).

# Note [Patch layers]
Two parts of the package may need the same attribute: `%overmind on` caches `PeftModel.load_adapter`,
and an adapter gate makes the same method wait for the requests in flight. Each patch has a `layer`
(0 by default); the patches of one attribute stack by layer, the higher one outside, whatever order
they were made in, and each is removed on its own: the layers above it are made again, by their own
`make`, over what is left below. An owner may be a class or a module (for a module-level function).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["is_patched", "patch", "patched", "unpatch", "unpatch_all"]


@dataclass
class _Record:
    owner: Any
    name: str
    layer: int
    make: Callable[[Any], Any]
    replacement: Any


@dataclass(frozen=True)
class _Base:
    original: Any
    local: bool


_lock = threading.RLock()
_records: dict[tuple[Any, str, int], _Record] = {}  # in the order the patches were made
_bases: dict[tuple[Any, str], _Base] = {}  # the attribute before any layer


def _stack(owner: Any, name: str) -> list[_Record]:
    return sorted((r for r in _records.values() if r.owner is owner and r.name == name), key=lambda r: r.layer)


def _rebuild(owner: Any, name: str, above: int) -> None:
    """Make again every layer of `owner.name` higher than `above`, over what lies below it, and set the top."""
    base = _bases[(owner, name)]
    current = base.original
    for record in _stack(owner, name):
        if record.layer > above:
            record.replacement = record.make(current)
        current = record.replacement
    setattr(owner, name, current)


def patch(owner: Any, name: str, make: Callable[[Any], Any], *, layer: int = 0, original: Any = None) -> bool:
    """Replace `owner.name` by `make(what it wraps)`; False if this layer of it is patched already.

    `layer` (see Note [Patch layers]): a higher layer wraps the lower ones of the same attribute.
    `original`: what `owner` defines there had nothing been patched, where its own attribute is not that
    (a library copied a patched attribute of a base class when it made `owner`); restored on unpatch.
    """
    with _lock:
        if (owner, name, layer) in _records:
            return False
        key = (owner, name)
        if key not in _bases:
            local = original is not None or name in owner.__dict__
            if original is None:
                original = owner.__dict__[name] if local else inspect.getattr_static(owner, name)
            _bases[key] = _Base(original, local)
        try:
            below = [r for r in _stack(owner, name) if r.layer < layer]
            wrapped = below[-1].replacement if below else _bases[key].original
            _records[(owner, name, layer)] = _Record(owner, name, layer, make, make(wrapped))
            _rebuild(owner, name, layer)
        except BaseException:
            failed = _records.pop((owner, name, layer), None)
            _settle(owner, name, layer, failed.replacement if failed is not None else None)
            raise
        return True


def _settle(owner: Any, name: str, layer: int, top: Any) -> None:
    """After the record of `layer` left: make the layers above it again, or put back the original (`top`: what
    the record had set, the last layer)."""
    if _stack(owner, name):
        _rebuild(owner, name, layer)
        return
    base = _bases.pop((owner, name), None)
    if base is None:
        return
    if base.local:
        setattr(owner, name, base.original)
    elif top is not None and owner.__dict__.get(name) is top:
        delattr(owner, name)


def unpatch(owner: Any, name: str, *, layer: int = 0) -> None:
    with _lock:
        record = _records.pop((owner, name, layer), None)
        if record is not None:
            try:
                _settle(owner, name, layer, record.replacement)
            except BaseException:  # (an interrupt, say) still patched: the next unpatch tries again
                _records[(owner, name, layer)] = record
                raise


def unpatch_all() -> list[BaseException]:
    """Restore every patch, newest first; returns the errors met (each restore is still tried: Note
    [Reversible patches])."""
    errors: list[BaseException] = []
    with _lock:
        for owner, name, layer in reversed(list(_records)):
            try:
                unpatch(owner, name, layer=layer)
            except BaseException as exc:  # noqa: BLE001 (keep restoring the others; reported at the end)
                errors.append(exc)
    return errors


def is_patched(owner: Any, name: str, *, layer: int = 0) -> bool:
    return (owner, name, layer) in _records


def _label(owner: Any) -> str:
    if inspect.ismodule(owner):
        return owner.__name__
    return f"{owner.__module__}.{owner.__qualname__}"


def patched() -> list[str]:
    with _lock:
        return [
            f"{_label(r.owner)}.{r.name}" + (f" (layer {r.layer})" if r.layer else "") for r in _records.values()
        ]
