"""Model code that ships with a checkpoint (`trust_remote_code=True`), on a hit.

# Note [Code in the checkpoint]
transformers imports a checkpoint's own code as `transformers_modules.<folder>.<digest>.<file>` (the
digest of its source files; for a hub id, its commit), after copying the checkpoint's .py files into its
modules cache (HF_MODULES_CACHE); the plain load does that at every call. An entry's graph names those
classes by module, and a fresh kernel has neither that package on its path nor, necessarily, the module
(a cleared modules cache, another HF_MODULES_CACHE). So a miss records in the entry's meta the checkpoint
and the dynamic classes its graph names (`describe`), and a hit first has transformers resolve each of
them from the checkpoint, as the plain load does (`prepare`): the code copied and imported. The key holds
the identity of every file of the checkpoint, its .py files included (Note [Never stale] in keys.py), and
of the code it names in another folder (Note [Code in another folder]), so the code resolved is the code
the entry was made with; a class that resolves to another module than the one recorded is a CorruptEntry,
and the call loads plainly. A module imported already is that very code (its name holds the digest), and
is not resolved again. The entries a hit builds on are prepared first, so a load over a remote-code model
(an adapter) finds its classes there.

# Note [Code in another folder]
A config's `auto_map` may name code that lies elsewhere: "<folder or hub id>--modeling_x.Class", which
transformers resolves from that folder (relative to the process's working directory) or hub repo (at the
call's `code_revision`), not from the checkpoint; its module is `transformers_modules.<that folder's
name>.<digest>.modeling_x`. So a call with `trust_remote_code` is keyed by the files of every folder (or
the commit of every hub repo) that the auto_map of its checkpoint's configs names (`elsewhere`; keys.py),
as a checkpoint is: an edit of that code is another key. And a miss records, for each package of its
graph's dynamic classes that such a reference imported, the reference as written (`describe`), which
the hit resolves as the plain load does, then imports the modules of the package it needs (`prepare`).
"""

from __future__ import annotations

import importlib
import pickletools
import sys
from collections.abc import Sequence
from typing import Any

from .errors import CorruptEntry

__all__ = ["describe", "elsewhere", "prepare"]

_PACKAGE = "transformers_modules"


def elsewhere(config: Any) -> list[str]:
    """The class references of a config's `auto_map` (a parsed config.json, tokenizer_config.json, ...)
    whose code lies in another folder or hub repo: "<folder or hub id>--modeling_x.Class" (Note [Code in
    another folder])."""
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict):
        return []
    out = []
    for value in auto_map.values():  # a tokenizer's is a pair [slow, fast], either may be None
        for ref in value if isinstance(value, list | tuple) else [value]:
            if isinstance(ref, str) and "--" in ref:
                out.append(ref)
    return out


def describe(graph: bytes, checkpoint: str | None, refs: Sequence[str] = ()) -> dict[str, Any]:
    """The meta an entry needs for its hit, given its packed graph (rebuild.pack: a format byte, then a
    pickle), the checkpoint the call read, and the references to code in another folder its configs
    hold (Note [Code in another folder]); empty for a graph that names no dynamic class."""
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
    dynamic: dict[str, Any] = {"checkpoint": checkpoint, "classes": sorted([m, c] for m, c in classes)}
    code = {}
    for ref in refs:  # the package each imported: its module defines the class the reference names
        stem, _, name = ref.split("--", 1)[1].rpartition(".")
        for module, _ in classes:
            package, _, file = module.rpartition(".")
            found = getattr(sys.modules.get(module), name, None)
            if file == stem and isinstance(found, type) and found.__module__ == module:
                code[package] = ref
    if code:
        dynamic["code"] = code
    return {"dynamic": dynamic}


def prepare(meta: dict[str, Any]) -> None:
    """Resolve the dynamic classes an entry's graph names, from its checkpoint, as the plain load does
    (Note [Code in the checkpoint]). Raises CorruptEntry when one cannot be had as recorded."""
    dynamic = meta.get("dynamic")
    if not dynamic:
        return
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    code = dynamic.get("code") or {}
    for module, name in dynamic["classes"]:
        if hasattr(sys.modules.get(module), name):
            continue  # imported already: its name holds a digest of its code, or its commit
        package, _, file = module.rpartition(".")
        ref = code.get(package)  # Note [Code in another folder]
        where = ref.split("--", 1)[0] if ref else dynamic["checkpoint"]
        try:
            if ref:
                get_class_from_dynamic_module(ref, dynamic["checkpoint"])  # copies and imports the package's code
                cls = getattr(importlib.import_module(module), name)
            else:
                cls = get_class_from_dynamic_module(f"{file}.{name}", dynamic["checkpoint"])
        except Exception as exc:
            raise CorruptEntry(f"the model code {module}.{name} cannot be loaded from {where}: "
                               f"{type(exc).__name__}: {exc}") from exc
        if cls.__module__ != module or sys.modules.get(module) is None:
            raise CorruptEntry(f"the model code {module}.{name} of {where} resolves to "
                               f"{cls.__module__}.{cls.__qualname__}")
