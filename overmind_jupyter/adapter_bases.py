"""The base model a PEFT adapter folder names, for the loads that read it (Note [An adapter's base model]).

# Note [An adapter's base model]
A PEFT adapter folder holds adapter_config.json and the adapter's weights, and names the model it adapts
in the config's `base_model_name_or_path`. Two loaders given such a folder load that base first, then the
adapter onto it:
- transformers' model loaders (`AutoModelForCausalLM.from_pretrained(adapter)`, a model class's own),
  through its PEFT integration: the adapter_config.json at the top of the folder or in `adapter_kwargs`'
  subfolder (an Auto class), or in the call's `subfolder` (a model class; the key looks in all three for
  either: a config the load does not read only adds to the key), of a hub id, or of a local folder without
  a config.json at its top (one with it is a full model that carries an adapter, loaded from itself). The
  base is read at the call's own `revision` (transformers resolves it again for the base). A hub adapter
  read at another revision (`adapter_kwargs`' own) is one the key does not hold: Uncacheable;
- peft's `AutoPeftModel*.from_pretrained(adapter)`: the adapter_config.json in the call's `subfolder`,
  whatever else the folder holds, and the base at the config's own `revision` field; the base is loaded
  with an Auto class of transformers, so a base that is itself such an adapter folder is followed again,
  by the first rule.
The key of such a load holds the base as a checkpoint argument is held (Note [Never stale] in keys.py), as
the loader resolves it: a local folder relative to the process's working directory (not to the adapter's
folder: transformers and peft open the name as written), by its files' identities; else a hub id, by the
commit the local HF cache resolves the revision to, read offline. So a base deleted and rebuilt under an
untouched adapter is a miss, where the adapter folder alone keyed a hit of the old base's weights. A base
that cannot be keyed (a hub id not in the local cache, a config that names none) makes the call
Uncacheable, as a checkpoint argument that cannot be keyed does: it loads plainly, and says why. The base's
own files then count as the load's (its config.json's `quantization_config`, its `auto_map`'s code in
another folder, the files a miss watches).
`PeftModel.from_pretrained(model, adapter)` and `load_adapter` read no base: they are given one, keyed as
an argument (its entry, or its whole state). transformers' `pipeline(model=adapter)` follows the base too,
but a pipeline call has no key (its module's globals hold classes as dict keys), and under `%overmind on`
its model load is transformers' own loader, keyed by the base it is given.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import Uncacheable

__all__ = ["Base", "follows", "named"]

_CONFIG = "adapter_config.json"
TRANSFORMERS, PEFT = "transformers", "peft"


@dataclass(frozen=True)
class Base:
    """A base model an adapter config names: `name` as written, in the adapter config at `config` (a path;
    `rel`: the same under its checkpoint's folder or snapshot); `arguments`: the hub arguments it is read
    with (`revision`, `cache_dir`) and, where its own load follows an adapter's base again, `subfolder` and
    `adapter_kwargs`; `then`: that loader's rule, or None."""

    config: str
    rel: str
    name: str
    arguments: dict[str, Any]
    then: str | None


def follows(fn: Callable[..., Any]) -> str | None:
    """The rule by which `fn`, a loader, follows an adapter folder to its base (TRANSFORMERS, PEFT), or None
    for a callable that reads no base (Note [An adapter's base model]). A few attribute reads: it runs in
    every key."""
    owner = getattr(fn, "__self__", None)
    if not isinstance(owner, type) or getattr(fn, "__name__", None) != "from_pretrained":
        return None
    for module, name, rule in _LOADERS:  # a class of the user's or of remote code derives from one too
        loader = getattr(sys.modules.get(module), name, None)
        if isinstance(loader, type) and issubclass(owner, loader):
            return rule
    return None


# the classes whose `from_pretrained` follows an adapter folder to its base, where their libraries define them
_LOADERS = (("transformers.modeling_utils", "PreTrainedModel", TRANSFORMERS),
            ("transformers.models.auto.auto_factory", "_BaseAutoModelClass", TRANSFORMERS),
            ("peft.auto", "_BaseAutoPeftModel", PEFT))


def named(rule: str, arguments: dict[str, Any], root: str, rows: list[list[Any]], local: bool) -> list[Base]:
    """The bases a load by `rule` with `arguments` reads, of the checkpoint whose files lie under `root`
    (`rows`: its fingerprint, Note [Never stale] in keys.py; `local`: a local folder, not a hub id's
    snapshot). Raises Uncacheable where an adapter config the load reads names no base."""
    configs = {row[0]: tuple(row[2:]) for row in rows if row[0].endswith(_CONFIG) and row[2] is not None}
    if not configs:  # the common case, a checkpoint that is no adapter: one pass over the names
        return []
    adapter_kwargs = arguments.get("adapter_kwargs")
    adapter_kwargs = adapter_kwargs if isinstance(adapter_kwargs, dict) else {}
    subfolder, adapter_subfolder = arguments.get("subfolder") or "", adapter_kwargs.get("subfolder") or ""
    if not isinstance(subfolder, str) or not isinstance(adapter_subfolder, str):
        raise Uncacheable(f"subfolder={subfolder!r} (or adapter_kwargs' {adapter_subfolder!r}) is not a string")
    if rule == TRANSFORMERS:
        if local and any(row[0] == "config.json" and row[2] is not None for row in rows):
            return []
        if not local and adapter_kwargs.get("revision") not in (None, arguments.get("revision")):
            raise Uncacheable(f"adapter_kwargs' revision={adapter_kwargs['revision']!r} reads the adapter at "
                              "another revision than the call's, which the cache does not key; pass it as "
                              "`revision`")
        wheres = {"", subfolder, adapter_subfolder}
    else:
        wheres = {subfolder}
    out = []
    for where in sorted(wheres):
        rel = os.path.normpath(os.path.join(where, _CONFIG))
        if rel not in configs:
            continue
        path = os.path.join(root, rel)
        name, revision = _names(path, configs[rel])
        if not isinstance(name, str) or not name:
            raise Uncacheable(f"{path} names no base model (base_model_name_or_path={name!r}), which the load of "
                              "the adapter reads")
        if rule == TRANSFORMERS:
            out.append(Base(path, rel, name, {"revision": arguments.get("revision"),
                                         "cache_dir": arguments.get("cache_dir")}, None))
            continue
        if revision is not None and not isinstance(revision, str):
            raise Uncacheable(f"{path} names the base's revision as {revision!r}, not a string")
        out.append(Base(path, rel, name, {"revision": revision, "cache_dir": arguments.get("cache_dir"),
                                     "subfolder": subfolder, "adapter_kwargs": adapter_kwargs}, TRANSFORMERS))
    return out


@functools.lru_cache(maxsize=256)
def _names(path: str, identity: tuple[Any, ...]) -> tuple[Any, Any]:
    """(`base_model_name_or_path`, `revision`) of the adapter config at `path`, read once per `identity`
    of the file (the one the key holds: a hit keys the call again)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise Uncacheable(f"cannot read the adapter config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise Uncacheable(f"the adapter config {path} holds no JSON object")
    return config.get("base_model_name_or_path"), config.get("revision")
