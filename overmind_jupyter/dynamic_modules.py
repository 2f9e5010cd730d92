"""Model code that ships with a checkpoint (`trust_remote_code=True`), on a hit.

# Note [Code in the checkpoint]
transformers imports a checkpoint's own code as `transformers_modules.<folder>.<digest>.<file>` (the
digest of its source files; for a hub id, its commit), after copying the checkpoint's .py files into its
modules cache (HF_MODULES_CACHE); the plain load does that at every call. An entry's graph names those
classes by module, and a fresh kernel has neither that package on its path nor, necessarily, the module
(a cleared modules cache, another HF_MODULES_CACHE). So a miss records in the entry's meta the checkpoint
and the dynamic classes its graph names (`describe`), and a hit first has transformers resolve each of
them from the checkpoint, as the plain load does (`prepare`): the code copied and imported. The key holds
the identity of every file of the checkpoint, its .py files included (Note [Never stale] in keys.py), so
the code resolved is the code the entry was made with; a class that resolves to another module than the
one recorded is a CorruptEntry, and the call loads plainly. A module imported already is that very code
(its name holds the digest), and is not resolved again. The entries a hit builds on are prepared first,
so a load over a remote-code model (an adapter) finds its classes there.
"""

from __future__ import annotations

import pickletools
import sys
from typing import Any

from .errors import CorruptEntry

__all__ = ["describe", "prepare"]

_PACKAGE = "transformers_modules"


def describe(graph: bytes, checkpoint: str | None) -> dict[str, Any]:
    """The meta an entry needs for its hit, given its packed graph (rebuild.pack: a format byte, then a
    pickle) and the checkpoint the call read; empty for a graph that names no dynamic class."""
    if _PACKAGE.encode() not in graph or checkpoint is None:
        return {}
    classes: set[tuple[str, str]] = set()
    memo: dict[int, Any] = {}
    recent: list[Any] = []  # the last two values pushed: strings, or None for anything else
    for opcode, arg, _ in pickletools.genops(graph[1:]):
        op = opcode.name
        if op in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            memo[len(memo) if op == "MEMOIZE" else int(arg)] = recent[-1] if recent else None  # type: ignore[arg-type]
            continue
        if op == "STACK_GLOBAL" and len(recent) == 2 and str(recent[0]).startswith(_PACKAGE + "."):
            classes.add((recent[0], recent[1]))
        elif op == "GLOBAL" and str(arg).startswith(_PACKAGE + "."):
            module, name = str(arg).split(" ", 1)
            classes.add((module, name))
        value = memo.get(int(arg)) if op in ("GET", "BINGET", "LONG_BINGET") else arg if "UNICODE" in op else None  # type: ignore[arg-type]
        recent = [*recent, value][-2:]
    if not classes:
        return {}
    return {"dynamic": {"checkpoint": checkpoint, "classes": sorted([m, c] for m, c in classes)}}


def prepare(meta: dict[str, Any]) -> None:
    """Resolve the dynamic classes an entry's graph names, from its checkpoint, as the plain load does
    (Note [Code in the checkpoint]). Raises CorruptEntry when one cannot be had as recorded."""
    dynamic = meta.get("dynamic")
    if not dynamic:
        return
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    for module, name in dynamic["classes"]:
        if hasattr(sys.modules.get(module), name):
            continue  # imported already: its name holds a digest of its code, or its commit
        try:
            cls = get_class_from_dynamic_module(f"{module.rsplit('.', 1)[-1]}.{name}", dynamic["checkpoint"])
        except Exception as exc:
            raise CorruptEntry(f"the model code {module}.{name} cannot be loaded from {dynamic['checkpoint']}: "
                               f"{type(exc).__name__}: {exc}") from exc
        if cls.__module__ != module or sys.modules.get(module) is None:
            raise CorruptEntry(f"the model code {module}.{name} of {dynamic['checkpoint']} resolves to "
                               f"{cls.__module__}.{cls.__qualname__}")
