"""An object graph written out line by line, to compare a hit with the plain load in another process.

Each object becomes one line under the path it was first reached by: its class, and its attributes in
order; an object met again is a reference to that path; a tensor is its class, dtype, shape, stride,
requires_grad, a digest of its bytes, and the earlier tensor whose bytes it overlaps (a view, or a tied
weight), if any. Where the bytes lie (a checkpoint's mapping, an arena) is left out: that differs by design.
Two things differ between any two loads, cached or not, and are written so that they compare equal:
- a GenerationConfig's `_original_object_hash`, a hash of a string, which each process hashes its own
  way: written as whether it is the config's own hash (Note [What a plain pickle loses] in rebuild.py);
- the order of a diffusers FrozenDict's attributes, which pickle itself changes: written sorted.
"""

from __future__ import annotations

import enum
import hashlib
import sys
import types
import weakref
from typing import Any

import torch

_ATOMS = (int, float, complex, str, bytes, bool, type(None))
_NAMED = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodWrapperType)


def describe(root: Any) -> list[str]:
    """The lines of `root`'s graph (see the module's docstring)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        graph = _Graph()
        graph.walk(root, "root")
        return graph.lines
    finally:
        sys.setrecursionlimit(limit)


class _Graph:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.seen: dict[int, str] = {}  # id -> the path it was first reached by
        self.kept: list[Any] = []  # what `seen` names by id stays alive while walking
        self.spans: list[tuple[int, int, str]] = []  # the byte ranges of the tensors met, and their paths

    def walk(self, obj: Any, path: str) -> None:
        leaf = _leaf(obj)
        if leaf is not None:
            self.lines.append(f"{path}: {leaf}"[:300])
            return
        if id(obj) in self.seen:
            self.lines.append(f"{path}: the object at {self.seen[id(obj)]}")
            return
        self.seen[id(obj)] = path
        self.kept.append(obj)
        if isinstance(obj, weakref.ref):
            target = obj()
            self.lines.append(f"{path}: weakref to " + (
                "nothing" if target is None else self.seen.get(id(target), "an object not met")))
        elif isinstance(obj, types.MethodType):
            self.lines.append(f"{path}: method {obj.__func__.__qualname__}")
            self.walk(obj.__self__, f"{path}.__self__")
        else:
            self._object(obj, path)

    def _object(self, obj: Any, path: str) -> None:
        cls = type(obj)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if isinstance(obj, torch.Tensor):
            self.lines.append(f"{path}: {name} {self._tensor(obj, path)}")
        elif isinstance(obj, (list, tuple, dict)):
            self.lines.append(f"{path}: {name} of {len(obj)}")
            for key, item in obj.items() if isinstance(obj, dict) else enumerate(obj):
                self.walk(item, f"{path}[{key!r}]")
        else:
            self.lines.append(f"{path}: {name}")
        attributes = getattr(obj, "__dict__", None)
        if isinstance(attributes, dict):
            items = list(attributes.items())
            if name == "diffusers.configuration_utils.FrozenDict":
                items.sort(key=lambda kv: kv[0])
            for key, value in items:
                if key == "_original_object_hash":
                    self.lines.append(f"{path}.{key}: the config's own hash: {value == hash(obj)}")
                else:
                    self.walk(value, f"{path}.{key}")
        for slot in [s for c in cls.__mro__ for s in getattr(c, "__slots__", ()) if isinstance(s, str)]:
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                self.walk(getattr(obj, slot), f"{path}.{slot}")

    def _tensor(self, t: torch.Tensor, path: str) -> str:
        text = f"{t.dtype} {tuple(t.shape)} {t.stride()} requires_grad={t.requires_grad} {t.device.type}"
        if t.device.type == "meta" or not t.numel():
            return text
        if t.device.type == "cpu":
            data = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
            text += " " + hashlib.sha256(data).hexdigest()[:16]
        low = t.data_ptr()
        high = low + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)))
        for start, end, other in self.spans:
            if start < high and low < end:
                text += f" overlaps {other} at {low - start:+d}"
                break
        self.spans.append((low, high, path))
        return text


def _leaf(obj: Any) -> str | None:
    """How `obj` is written where it is a value, not an object with an identity of its own to compare."""
    if isinstance(obj, (enum.Enum, torch.dtype, torch.device)):
        return f"{type(obj).__qualname__} {obj}"
    if isinstance(obj, _ATOMS):
        return repr(obj)
    if isinstance(obj, _NAMED):
        return (f"{type(obj).__name__} {getattr(obj, '__module__', '')}."
                f"{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}")
    if isinstance(obj, (set, frozenset)):
        return f"{type(obj).__qualname__} {sorted(map(repr, obj))}"
    return None
