"""A local checkpoint's path as this call spelled it, in a hit's result (Note [Spellings])."""

from __future__ import annotations

import enum
import logging
import os
import re
import sys
import types
from collections.abc import Iterable
from typing import Any

__all__ = ["Found", "found", "respell", "respell_said"]

# Note [Spellings]
# A key holds a local checkpoint by its real path and its files, so every spelling of one folder finds one
# entry: "models/llama" from the notebook's folder, "../models/llama" from another, "./llama/", the
# absolute path. The plain load keeps the spelling it was given: `model.name_or_path` and
# `config._name_or_path`, a tokenizer's `name_or_path` and the paths of its files joined onto it, a
# pipeline's `_name_or_path` and its components' folders, what the load said ("... from: models/llama").
# A hit returned the spelling of the call that made the entry: from another folder
# `AutoTokenizer.from_pretrained(model.name_or_path)` then failed (or found another folder), and a LoRA
# adapter saved on the model named a base that is not there.
#
# So an entry keeps the spellings of its call (`meta["spellings"][""]`: real path -> as written) and of
# each cached result the call was given (`meta["spellings"][name]`, what that result's own call wrote:
# Note [References] in results.py). A hit whose call, or a result it is given, spells a path otherwise
# puts the new spelling back (`respell`), before the user sees it:
# - the result, with the call's own spellings, but never the objects the call was given (Note [Argument
#   replay] in rebuild.py): a pipeline's `unet=unet` keeps what the user's own load of it named, as
#   plainly;
# - each object given, with the spellings of the call that loaded it, since its state comes from the
#   entry: a base model given to PeftModel names the folder as the user's own load of the base did. Only
#   where a load names its checkpoint (`name_or_path`, `_name_or_path`): the call adds to that object what
#   is its own (PEFT sets `model.peft_config`, whose `base_model_name_or_path` adapter_config.json says,
#   and may say as the base's first load spelled it).
# In those objects:
# - a string that is the entry's spelling, where that spelling holds a separator ("models/llama",
#   "./llama"), or where the attribute or key holding it is a path's (`name_or_path`, `*_path`, `*_dir`,
#   `*_file`, `*_folder`): a bare "llama" or "." is also a word a model holds (a label of `id2label`, the
#   name of a submodule), which stays;
# - a string under the entry's spelling ("models/llama/tokenizer.json"), in the same places: the same file
#   under this call's.
# So a string of the checkpoint's own files that happens to equal the base's spelling (PEFT's
# `base_model_name_or_path`, read from adapter_config.json) stays as the file says, unless it also equals
# this call's own path's. The walk goes through dicts, lists, tuples, sets and objects with a `__dict__`,
# never into classes, functions, modules, tensors, enum members or loggers, which a graph names as globals.
# Strings in tuples and sets, and paths held as `Path` objects, stay as the entry has them. Where one string
# object was shared, its respelling is shared too, so a respelled hit still pickles as its respelled entry
# does (Note [References] in results.py). What the load said is respelled where the entry's spelling holds a
# separator, as a whole path. The walk costs a few ms for a 1B model (3.4 ms for a 1.1B Llama's shape), and
# only a hit spelled otherwise pays it.
_PATH_NAMES = ("name_or_path", "_path", "_dir", "_file", "_folder")
_CHECKPOINT_NAMES = ("name_or_path", "_name_or_path")  # where a load names its checkpoint
_ATOMS = (str, bytes, int, float, bool, complex, type(None), type, enum.Enum, types.ModuleType, types.FunctionType,
          types.MethodType, types.BuiltinFunctionType, logging.Logger, logging.Manager)
_SCALARS = frozenset({bytes, int, float, bool, complex, type(None)})  # never walked: not even put on the stack

Pairs = list[tuple[str, str]]
# how a hit's spellings differ from its entry's: (the result's, each given object's in the call's order)
Found = tuple[Pairs, list[Pairs]]


def found(entry: Any, call: dict[str, dict[str, str]], given: list[str]) -> Found | None:
    """How this call's spellings (`""`: its own; a name of `given`: the object given by that name) differ
    from its entry's `meta["spellings"]`; None where they do not."""
    if not isinstance(entry, dict):
        return None
    own = _pairs(entry.get(""), call.get(""))
    each = [_pairs(entry.get(name), call.get(name)) for name in given]
    return (own, each) if own or any(each) else None


def _pairs(entry: Any, call: dict[str, str] | None) -> Pairs:
    """(the entry's spelling, this call's) of each path the two spell otherwise, the longest first."""
    if not isinstance(entry, dict) or not call:
        return []
    out = [(old, new) for real, new in call.items() if isinstance(old := entry.get(real), str) and old != new]
    return sorted(out, key=lambda pair: -len(pair[0]))


def _has_separator(spelling: str) -> bool:
    return os.sep in spelling.rstrip(os.sep)


class _Respelling:
    def __init__(self, pairs: Pairs, given: bool) -> None:
        """`given`: for an object the call was given, whose own load's spelling is only where that load
        named its checkpoint (Note [Spellings])."""
        self.pairs = [(old, new, old if old.endswith(os.sep) else old + os.sep, _has_separator(old) and not given)
                      for old, new in pairs]
        self.given = given
        # (id of a string met, whether its place is a path's) -> (the string, kept alive; what it became)
        self.done: dict[tuple[int, bool], tuple[str, str]] = {}

    def string(self, value: str, name: Any) -> str:
        a_paths = isinstance(name, str) and (name in _CHECKPOINT_NAMES if self.given else name.endswith(_PATH_NAMES))
        done = self.done.get((id(value), a_paths))
        if done is not None:
            return done[1]
        made = value
        for old, new, under, separated in self.pairs:
            if not (separated or a_paths):
                continue
            if value == old:
                made = new
                break
            if value.startswith(under) and under != os.sep:
                made = os.path.join(new, value[len(under):])
                break
        self.done[id(value), a_paths] = (value, made)
        return made


def respell(result: Any, given: list[Any], how: Found) -> None:
    """Put this call's spellings in a hit's result and the objects it was given (Note [Spellings])."""
    own, each = how
    fence = {id(obj) for obj in given}
    if own:
        _walk(result, _Respelling(own, given=False), fence)
    for obj, pairs in zip(given, each, strict=True):
        if pairs:
            _walk(obj, _Respelling(pairs, given=True), fence - {id(obj)})


def _walk(root: Any, respelling: _Respelling, fence: set[int]) -> None:
    torch = sys.modules.get("torch")
    skip: tuple[type, ...] = (*_ATOMS, torch.Tensor) if torch is not None else _ATOMS
    seen = set(fence)
    stack = [root]
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
        try:
            state = getattr(obj, "__dict__", None)  # a module's, a config's, a user's object's; a FrozenDict's too
        except Exception:  # noqa: BLE001 (an object that will not say: it keeps what it holds)
            continue
        if state and type(state) is dict:
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


def respell_said(said: list[list[Any]], how: Found | None) -> list[list[Any]]:
    """What a load said (`meta["log"]`, `meta["warned"]`), with this call's own spellings of the paths
    whose entry's spelling holds a separator (Note [Spellings])."""
    subs = [(re.compile(rf"(?<![\w.~/-]){re.escape(old)}(?![\w-]|\.\w)"), new.replace("\\", "\\\\"))
            for old, new in (how[0] if how else []) if _has_separator(old)]
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
