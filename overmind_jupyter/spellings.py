"""A local checkpoint's path as this call spelled it, in a hit's result (Note [Spellings])."""

from __future__ import annotations

import enum
import os
import re
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["pairs", "respell", "respell_said"]

# Note [Spellings]
# A key holds a local checkpoint by its real path and its files, so every spelling of one folder finds one
# entry: "models/llama" from the notebook's folder, "../models/llama" from another, "./llama/", the
# absolute path. The plain load keeps the spelling it was given: `model.name_or_path` and
# `config._name_or_path`, a tokenizer's `name_or_path` and the paths of its files joined onto it, a
# pipeline's `_name_or_path` and its components' folders, what the load said ("... from the model
# checkpoint at models/llama"). A hit returned the spelling of the call that made the entry: from another
# folder `AutoTokenizer.from_pretrained(model.name_or_path)` then failed (or found another folder), and a
# LoRA adapter saved on the model named a base that is not there.
#
# So an entry keeps its call's spellings (`meta["spellings"]`: real path -> as written; those of the cached
# results the call was given too, Note [References] in results.py), and a hit whose call spells a path
# otherwise puts its own spelling in the result and the arguments it replays onto (`respell`), before the
# user sees them:
# - a string that is the entry's spelling, where that spelling names a path by its form (it holds a
#   separator or starts with "." or "~"), or where the attribute or key holding it is a path's
#   (`name_or_path`, `*_path`, `*_dir`, `*_file`, `*_folder`): a bare "llama" is also a word of a config,
#   the name of a submodule or a dict key, which stay;
# - a string under the entry's spelling ("models/llama/tokenizer.json"): the same file under this call's.
# The walk goes through dicts, lists and tuples, modules and the objects of the libraries that load
# (transformers, diffusers, peft, and classes that hold a `name_or_path`), never into classes, functions,
# tensors or enum members, so a global the graph names (a logger, a registry) is never changed. Strings
# in tuples and sets, and paths held as `Path` objects, stay as the entry has them. Where one string object
# was shared, its respelling is shared too, so a respelled hit still pickles as its respelled entry does
# (Note [References] in results.py). What the load said is respelled where the entry's spelling has a
# path's form, as a whole path. The walk costs a few ms for a 1B model, and only a hit spelled otherwise
# pays it.
_PATH_NAMES = ("name_or_path", "_path", "_dir", "_file", "_folder")
_LIBRARIES = ("transformers", "diffusers", "peft")
_ATOMS = (str, bytes, int, float, bool, complex, type(None), type, enum.Enum)
_SCALARS = frozenset({bytes, int, float, bool, complex, type(None)})  # never walked: not even put on the stack


def pairs(entry: Any, call: dict[str, str]) -> list[tuple[str, str]]:
    """(the entry's spelling, this call's) of each path the two spell otherwise, the longest first."""
    if not isinstance(entry, dict) or not call:
        return []
    found = [(old, new) for real, new in call.items() if isinstance(old := entry.get(real), str) and old != new]
    return sorted(found, key=lambda pair: -len(pair[0]))


def _has_path_form(spelling: str) -> bool:
    return os.sep in spelling or spelling.startswith((".", "~"))


class _Respelling:
    def __init__(self, found: list[tuple[str, str]]) -> None:
        self.found = [(old, new, old if old.endswith(os.sep) else old + os.sep, _has_path_form(old))
                      for old, new in found]
        # (id of a string met, whether its place is a path's) -> (the string, kept alive; what it became)
        self.done: dict[tuple[int, bool], tuple[str, str]] = {}

    def string(self, value: str, name: Any) -> str:
        a_paths = isinstance(name, str) and name.endswith(_PATH_NAMES)
        done = self.done.get((id(value), a_paths))
        if done is not None:
            return done[1]
        made = value
        for old, new, under, has_form in self.found:
            if value == old:
                made = new if has_form or a_paths else value
                break
            if value.startswith(under) and under != os.sep:
                made = os.path.join(new, value[len(under):])
                break
        self.done[id(value), a_paths] = (value, made)
        return made


def respell(roots: Iterable[Any], found: list[tuple[str, str]]) -> None:
    """Put this call's spellings in the objects of a hit (Note [Spellings]); `found` from `pairs`."""
    torch = sys.modules.get("torch")
    skip: tuple[type, ...] = (*_ATOMS, torch.Tensor) if torch is not None else _ATOMS
    module = torch.nn.Module if torch is not None else ()
    respelling = _Respelling(found)
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, skip) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if isinstance(obj, dict):
            if obj:
                _respell_items(obj, dict.__setitem__, obj.items(), respelling, stack)
        elif isinstance(obj, list):
            _respell_items(obj, list.__setitem__, enumerate(obj), respelling, stack, named=False)
        state = getattr(obj, "__dict__", None)  # a module's, a config's; a FrozenDict's attributes
        if state and type(state) is dict and (isinstance(obj, (dict, module))
                                              or type(obj).__module__.startswith(_LIBRARIES)
                                              or "name_or_path" in state or "_name_or_path" in state):
            _respell_items(state, dict.__setitem__, state.items(), respelling, stack)


def _respell_items(container: Any, put: Any, items: Iterable[tuple[Any, Any]], respelling: _Respelling,
                   stack: list[Any], named: bool = True) -> None:
    changed = []
    for name, value in items:
        kind = type(value)
        if kind is str:
            made = respelling.string(value, name if named else None)
            if made is not value:
                changed.append((name, made))
        elif kind not in _SCALARS:
            stack.append(value)
    for name, made in changed:
        put(container, name, made)


def respell_said(said: list[list[Any]], found: list[tuple[str, str]]) -> list[list[Any]]:
    """What a load said (`meta["log"]`, `meta["warned"]`), with this call's spellings of the paths whose
    entry's spelling has a path's form (Note [Spellings])."""
    subs = [(re.compile(rf"(?<![\w.~/-]){re.escape(old)}(?![\w-]|\.\w)"), new.replace("\\", "\\\\"))
            for old, new in found if _has_path_form(old)]
    if not subs:
        return said

    def text(value: Any) -> Any:
        if isinstance(value, str):
            for pattern, new in subs:
                value = pattern.sub(new, value)
        elif isinstance(value, list):
            value = [text(v) for v in value]
        return value

    return [[text(v) for v in record] for record in said]
