"""Cache keys: the real class, the canonical arguments, and a fingerprint of what the call reads.

# Note [Never stale]
A key is the SHA-256 of a JSON document holding (docs/design.md invariant 2):
- the callable: `module.qualname` of the class a classmethod was called on, with the method's name, and
  each class of the user's own in its MRO (defined in the notebook, or in a module beside it that no
  installed distribution provides: `class Pruned(LlamaForCausalLM)`) by what it does: its methods by their
  code, its class attributes, its bases; a plain function (a notebook's `load`) by what it does: its code
  (bytecode, constants, names, nested code), its defaults, the values of its closure and of the globals
  it reads (functions among them by their own code), the module attributes, environment variables and
  literal paths it reads (Note [What a function reads] in reads.py), the files of the user's modules it
  imports in its body, imported yet or not (Note [Modules found by their file] in module_files.py), and the
  identity of its module's file; a function or class of a module of the user's that it reaches, by that
  file's identity and what the module holds that the file does not bind (a value set at run time, a
  function replaced: Note [What a module holds that its file does not bind]); a `functools.partial` is
  keyed as the call it makes; a callable object is uncacheable, since its state is not known;
- the arguments bound to the callable's signature (so positional and keyword spellings agree), each in
  a canonical form; an argument without one makes the call uncacheable (`Uncacheable`), never guessed.
  Objects with a `to_dict` (configs) are keyed by their whole state, every attribute, private ones
  included (`to_dict` drops some, such as the attention implementation asked for); an Enum, an object, a
  wrapper, a bound method or a module of the user's by what it does (Note [The user's values by what they
  do]);
- for every argument naming a local path (any spelling: relative in the caller's cwd, with or without a
  slash, `~`, `os.PathLike`), the identity of every file under it: device, inode, size, mtime_ns and
  ctime_ns, taken through symlinks, with each link's own target; so a file rewritten in any way (its
  size and mtime restored, replaced by rename, a link pointed elsewhere) is another key. For a hub id,
  the commit the local Hugging Face cache resolves the revision to, read offline, and its snapshot's
  files (links to blobs) the same way;
- for diffusers' `from_single_file`, its `config` and `original_config` (a folder, or a hub id) as a
  checkpoint argument: by their files or their commit, never by their name;
- for a load of a PEFT adapter folder that loads the base model its adapter_config.json names
  (transformers' model loaders, peft's AutoPeftModel*), that base, as the loader resolves it, keyed as a
  checkpoint is (Note [An adapter's base model] in adapter_bases.py);
- for a call with `trust_remote_code`, the code that its checkpoint's configs (the base's among them) name
  in another folder or hub repo (auto_map's "<folder>--modeling_x.Class"), keyed as a checkpoint is
  (Note [Code in another folder] in dynamic_modules.py);
- for an argument that is itself a cached result, the key of its entry (see `references`);
- the versions of torch, of the library that owns the callable, and of the pack format.
Anything that changes what the call would return changes the key, so a rewritten checkpoint is a miss.
A checkpoint rewritten while it loads is read again after the load (`changed_since`), and the result is
then not published: it may hold the new bytes, and its key names the old ones.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import io
import json
import math
import os
import re
import stat
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path, PurePath
from typing import Any

from . import adapter_bases
from .dynamic_modules import elsewhere
from .errors import Uncacheable
from .module_files import Finder, named
from .reads import code_digest, import_statements, is_users_module, path_constants, reads
from .user_modules import (
    CLASS_BOOKKEEPING,
    GONE,
    cell_contents,
    check_runs_its_file,
    file_bindings,
    held_otherwise,
    module_file,
    read_at_import,
    stat_identity,
    users_file,
    users_imports,
)

__all__ = ["GRAPH_FORMAT", "SOURCE_PARAMS", "CallKey", "Resolve", "changed_since", "files_named", "fingerprint",
           "make_key", "owner_name", "signature"]

_KEY_FORMAT = 4  # bump on any change to what a key holds: old entries then simply miss
# The format of the graphs rebuild.py packs, named by every key: an entry packed in another format is a miss
# (a daemon that outlived an upgrade keeps such entries), not a corrupt entry with a fallback warning.
# Bump when the storage or tensor references, or what a graph holds, change.
GRAPH_FORMAT = 9
SOURCE_PARAMS = ("pretrained_model_name_or_path", "model_id", "pretrained_model_link_or_path", "repo_id",
                  "pretrained_model_link_or_path_or_dict")
# diffusers' `from_single_file` reads the layout of the model from these when given (a local folder or
# a hub id): keyed as checkpoints are, by their files or the commit they resolve to, never by the name.
_CONFIG_SOURCES = {"from_single_file": ("config", "original_config")}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_MAX_ITEMS = 10_000
_MAX_VALUES = 100_000  # in all the arguments of one call: a list that holds one big list many times
_MAX_DEPTH = 32
_MAX_STRING = 64 * 1024
_MAX_ARRAY = 64 * 1024 * 1024  # bytes of one array in a scheduler's state (Note [Schedulers given to a load])
_MAX_FILES = 100_000
_OPAQUE_STRINGS = ("cache_dir", "offload_folder", "local_dir")  # where to look, not what is read
# Note [Hub arguments left at their default]
# The libraries' loaders take the hub's arguments as keywords whose default is None or False, and a
# loader that calls another passes them on as it got them: diffusers' `AutoModel.from_pretrained(path,
# subfolder="unet")` calls `UNet2DConditionModel.from_pretrained` with `cache_dir=None`, `token=None`,
# `force_download=False`, ... where the user's own call of it leaves them out. Both loads read the same
# files the same way, but the two keys differed, and the one model took the budget twice. Such an argument
# at its default is keyed as left out, of the libraries' own loaders only: a function of the user's may take
# a `revision=None` that means something else than its own default ("best"), and its two calls are two
# loads.
_HUB_LOADERS = ("transformers", "diffusers", "peft")
_HUB_DEFAULTS = {"cache_dir": None, "force_download": False, "local_files_only": False, "proxies": None,
                 "revision": None, "token": None, "resume_download": None}

# The entry an argument stands for (a model rebuilt from an entry, unchanged since: Note [References]
# in results.py), or None: the caller of `make_key` knows its results, this module does not.
Resolve = Callable[[Any], "str | None"]


@dataclass
class CallKey:
    key: str
    label: str
    meta: dict[str, Any]
    references: dict[str, Any] = field(default_factory=dict, repr=False)  # argument name -> cached result or component
    # what the call reads, as (label, how to read its fingerprint again, the fingerprint in the key)
    sources: list[tuple[str, Callable[[], Any], Any]] = field(default_factory=list, repr=False)
    # where the files of each source lie, by its label: the path itself, or a hub id's snapshot folder
    roots: dict[str, str] = field(default_factory=dict, repr=False)
    # what to tell the user once this key's entry is published (loading.py's `_tell_seed`): not before, since
    # a result that cannot be cached is not "cached for the state" of anything
    notice: tuple[str, list[str], str, int | None] | None = field(default=None, repr=False)
    # the auto_map references, as written, to code in another folder (Note [Code in another folder] in
    # dynamic_modules.py)
    code: list[str] = field(default_factory=list, repr=False)
    # the local paths of the call as it spelled them, by real path (Note [Spellings] in spellings.py)
    spellings: dict[str, str] = field(default_factory=dict, repr=False)


def changed_since(ck: CallKey) -> str | None:
    """The first source of `ck` (a checkpoint path, a hub snapshot) whose fingerprint is no longer the
    one in the key, or None. A load that read a source changed under it is not cached: its result may
    hold the new bytes, and the key names the old ones (see Note [Never stale])."""
    for label, read, seen in ck.sources:
        try:
            now = read()
        except (OSError, Uncacheable):
            return label
        if now != seen:
            return label
    return None


def owner_name(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """(qualified name, short name, top-level package) of a callable. For a classmethod the class is
    the one it was called on, not the one that defines it: `transformers.models.llama.modeling_llama.
    LlamaForCausalLM.from_pretrained`, `LlamaForCausalLM.from_pretrained`, `transformers`."""
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if owner is not None:
        cls = owner if isinstance(owner, type) else type(owner)
        return (f"{cls.__module__}.{cls.__qualname__}.{name}", f"{cls.__qualname__}.{name}",
                cls.__module__.split(".")[0])
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", name)
    return f"{module}.{qualname}", f"{module.rsplit('.', 1)[-1]}.{qualname}", module.split(".")[0]


def make_key(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
             resolve: Resolve | None = None) -> CallKey:
    """The key of `fn(*args, **kwargs)` called from this process's working directory; `resolve` names
    the entry an argument stands for. Raises Uncacheable, naming the argument, when the call has no
    canonical form."""
    while isinstance(fn, functools.partial):  # partial(f, a, k=1)(b) is the call f(a, b, k=1)
        args, kwargs = (*fn.args, *args), {**fn.keywords, **kwargs}
        fn = fn.func
    _check_named(fn)
    qualified, short, package = owner_name(fn)
    arguments = _bind(fn, args, kwargs)
    if package in _HUB_LOADERS:  # Note [Hub arguments left at their default]
        for name, default in _HUB_DEFAULTS.items():
            if name in arguments and (arguments[name] is None or arguments[name] is default):
                del arguments[name]
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        arguments["self"] = owner  # a method of a loaded object (load_adapter): the object is an input
    canon = _Canonical(os.getcwd(), resolve)
    classes = []
    if owner is not None:  # the class a method was called on, and the user's classes it derives from
        cls = owner if isinstance(owner, type) else type(owner)
        classes = [canon.cls(f"class {c.__qualname__}", c, 0) for c in cls.__mro__ if is_users_module(c.__module__)]
        registered = _registered(cls)
        if registered:  # Note [Classes registered with an Auto class]
            classes.append({"registered": [[canon._global(f"registered {getattr(x, '__qualname__', x)}", x, 0)
                                            for x in pair] for pair in registered]})
    doc_args = {}
    config_sources = _CONFIG_SOURCES.get(getattr(fn, "__name__", ""), ())
    for name in sorted(arguments, key=lambda n: (n not in SOURCE_PARAMS, n)):  # the checkpoint labels the call
        if name in SOURCE_PARAMS or (name in config_sources and isinstance(arguments[name], (str, PurePath))):
            doc_args[name] = canon.source(name, arguments[name], arguments)
        elif name in _OPAQUE_STRINGS and isinstance(arguments[name], (str, PurePath)):
            doc_args[name] = os.fspath(arguments[name])
        else:
            doc_args[name] = canon.value(name, arguments[name], 0)
    called = _called(canon, fn)
    if called is not None:
        doc_args["<function>"] = called
    rule = adapter_bases.follows(fn)
    bases = canon.bases(rule, arguments, canon.checkpoint) if rule is not None and canon.checkpoint else {}
    code = canon.code(arguments) if arguments.get("trust_remote_code") else {}
    document = {
        "format": [_KEY_FORMAT, GRAPH_FORMAT],
        "callable": qualified,
        "arguments": doc_args,
        "classes": classes,
        "versions": {"torch": _version("torch"), package: _version(package)},
    }
    default_dtype = _default_dtype()
    if default_dtype != "torch.float32":  # Note [Torch's default dtype]
        document["default_dtype"] = default_dtype
    if bases:
        document["bases"] = bases  # Note [An adapter's base model] in adapter_bases.py
    if code:
        document["code"] = code  # Note [Code in another folder] in dynamic_modules.py
    text = json.dumps(document, sort_keys=True, separators=(",", ":"))
    key = hashlib.sha256(text.encode()).hexdigest()
    named, dtype = canon.source_label or _plain_arguments(arguments), _dtype_label(arguments)
    if canon.source_label:  # the checkpoint, then what else tells this call's entry from another's of it
        # (its subfolder first: Note [Labels tell entries apart])
        rest = sorted((k for k in arguments if k not in SOURCE_PARAMS), key=lambda k: k != "subfolder")
        more = _plain_arguments({k: arguments[k] for k in rest})
        named += f", {more}" if more else ""
    given = _given_models(canon.references)
    named += f", {given}" if named and given else given
    meta = {
        "label": f"{short}({named}{dtype if named else dtype.removeprefix(', ')})",
        "class": qualified.rsplit(".", 1)[0] if getattr(fn, "__self__", None) is not None else None,
        "source": canon.source_label,
        "dtype": dtype.removeprefix(", dtype=") or None,
    }
    return CallKey(key, str(meta["label"]), meta, canon.references, canon.sources, canon.roots, code=canon.code_refs,
                   spellings=canon.spellings)


def _called(canon: _Canonical, fn: Callable[..., Any]) -> Any:
    """What the key holds of the callable itself beyond its name: a function by its code; a wrapper, a class,
    a callable object of the user's by what it does (Note [The user's values by what they do]); nothing for a
    method, whose class is keyed (None)."""
    if getattr(fn, "__self__", None) is not None:
        return None
    return canon.function("the function", fn, 0) if isinstance(fn, types.FunctionType) else canon.called(fn)


# Note [Torch's default dtype]
# A kernel may call `torch.set_default_dtype(torch.float64)`: every floating tensor made without a dtype is
# then a float64 one, the weights of a module built in a cached function included (transformers' own loads
# take their dtype from the checkpoint or the call). So a key holds the default dtype where it is not
# torch's own float32 (keys made under float32 stay what they were): a hit of an entry made under another
# default would return other weights than the plain call makes. Where torch is not imported, nothing has
# changed it.
def _default_dtype() -> str:
    torch = sys.modules.get("torch")
    return str(torch.get_default_dtype()) if torch is not None else "torch.float32"


def files_named(ck: CallKey, name: str) -> list[tuple[str, tuple[Any, ...]]]:
    """The files called `name`, at any depth, among the files `ck`'s sources read, as (path, identity):
    the identity (device, inode, size, mtime_ns, ctime_ns) the key holds, found without reading a
    directory again."""
    out = []
    for label, _, seen in ck.sources:
        root = ck.roots.get(label)
        rows = seen.get("files") if isinstance(seen, dict) else seen
        if root is None or not isinstance(rows, list):
            continue
        for rel, _link, *identity in rows:
            path = root if rel == "." else os.path.join(root, rel)
            if os.path.basename(path) == name and identity[0] is not None:
                out.append((path, tuple(identity)))
    return out


def _check_named(fn: Callable[..., Any]) -> None:
    """Refuse the callables a key cannot say what they do of: a callable object (its state is not
    known). Methods are keyed by their class (or object), plain functions by their code."""
    if getattr(fn, "__self__", None) is not None or isinstance(fn, types.FunctionType):
        return
    if not callable(fn):
        raise Uncacheable(f"{type(fn).__qualname__} is not callable: cache a function or a method")
    if not isinstance(getattr(fn, "__qualname__", None), str):
        raise Uncacheable(f"{type(fn).__qualname__} is a callable object, whose state is not part of a cache "
                          "key; cache a function or a method instead")


def _bind(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by parameter name, with **kwargs flattened, so that every spelling of one call agrees."""
    try:
        sig = signature(fn)
        bound = sig.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    arguments = dict(bound.arguments)
    for name, param in sig.parameters.items():
        if name in arguments:
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name))
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                rest = list(arguments.pop(name))
                # from_pretrained(*model_args, **kwargs) (the Auto classes): the first positional
                # argument is the checkpoint, as in the concrete classes' signatures.
                if rest and not any(p in arguments for p in SOURCE_PARAMS) and next(iter(sig.parameters)) == name:
                    arguments[SOURCE_PARAMS[0]] = rest.pop(0)
                arguments.update({f"{name}[{i}]": a for i, a in enumerate(rest)})
    return arguments


# Note [Signatures]
# `inspect.signature` builds a Signature of `from_pretrained`'s dozen parameters anew on each call: half
# of a key's time (0.1-0.3 ms). A function's signature is its code's, and a bound method's is its
# function's less the first parameter, whatever it is bound to (inspect's own rule), so they are kept
# by function, bound or not (weakly: a function defined in a cell goes away with it). Other callables
# are not kept. The patched loaders' are built when they are patched (targets.py, at `enable()`), not
# in the first load.
_signatures: dict[bool, weakref.WeakKeyDictionary[types.FunctionType, inspect.Signature]] = {
    False: weakref.WeakKeyDictionary(), True: weakref.WeakKeyDictionary()}


def signature(fn: Callable[..., Any]) -> inspect.Signature:
    """`inspect.signature(fn)`, kept for a function or a bound method (Note [Signatures])."""
    bound = isinstance(fn, types.MethodType)
    func = fn.__func__ if bound else fn  # type: ignore[attr-defined]
    if not isinstance(func, types.FunctionType):
        return inspect.signature(fn)
    sig = _signatures[bound].get(func)
    if sig is None:
        sig = _signatures[bound][func] = inspect.signature(fn)
    return sig


def fingerprint(path: str) -> list[list[Any]]:
    """Every file of `path` (a file, or a directory walked through its links), sorted by relative name:
    [name, link target or None, device, inode, size, mtime_ns, ctime_ns] of what the name resolves to."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        return [[".", None, *stat_identity(st)]]
    out: list[list[Any]] = []
    stack = [("", path)]
    seen = {(st.st_dev, st.st_ino)}
    while stack:
        rel, directory = stack.pop()
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            name = f"{rel}{entry.name}"
            link = os.readlink(entry.path) if entry.is_symlink() else None
            try:
                est = entry.stat()  # through links
            except FileNotFoundError:
                out.append([name, link, None, None, None, None, None])  # a dangling link is read as absent
                continue
            if stat.S_ISDIR(est.st_mode):
                if (est.st_dev, est.st_ino) not in seen:  # a link back up would loop
                    seen.add((est.st_dev, est.st_ino))
                    stack.append((f"{name}/", entry.path))
                if link is not None:
                    out.append([name + "/", link, None, None, None, None, None])
                continue
            out.append([name, link, *stat_identity(est)])
            if len(out) > _MAX_FILES:
                raise Uncacheable(f"{path} holds more than {_MAX_FILES} files; load it without the cache")
    out.sort(key=lambda row: row[0])
    return out



@functools.cache
def _version(package: str) -> str | None:
    """The installed version of `package`, once per process: the imported module's `__version__` (a
    loader's library is imported by the time its call is keyed), else the distribution's metadata,
    whose lookup scans every entry of sys.path (about a millisecond a package)."""
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str):  # torch's is a TorchVersion, a str
        return str(version)
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _plain_arguments(arguments: dict[str, Any]) -> str:
    """A call labelled by its arguments of plain values, so that entries of one function (or of one
    checkpoint) tell apart in `ls`: `make(kind='mlp', seed=3)`, cut at _LABEL_ARGUMENTS characters."""
    text = ", ".join(f"{name}={value!r}" for name, value in arguments.items()
                     if type(value) in _PLAIN_VALUES and name not in ("self", "dtype", "torch_dtype")
                     and not (type(value) is str and _SECRET.search(name)))
    return text if len(text) <= _LABEL_ARGUMENTS else text[:_LABEL_ARGUMENTS - 3] + "..."


_PLAIN_VALUES = (int, float, bool, str)
# A string argument a label never shows, since `ls`, status, the panel and warnings print labels: a hub
# token (`token`, `use_auth_token`) and anything named like a credential
_SECRET = re.compile(r"token|auth|secret|password|passwd|credential|api_?key", re.IGNORECASE)
_LABEL_ARGUMENTS = 60


def _dtype_label(arguments: dict[str, Any]) -> str:
    for name in ("dtype", "torch_dtype"):
        if name in arguments and arguments[name] is not None:
            return f", dtype={str(arguments[name]).removeprefix('torch.')}"
    return ""


# Note [Labels tell entries apart]
# `ls`, status, the panel and the miss line name an entry by its label, so two entries of one checkpoint
# should read apart where that is cheap to say. After the checkpoint come its subfolder (the miss line then
# names "sd/unet", where the pipeline, its UNet and its scheduler all read "sd"), its other plain arguments,
# and each cached model the call was given, short: the folder or hub name it was loaded from and its dtype
# (`PeftModel.from_pretrained('/m/adapters/fr', model=<llama bfloat16>)`: one adapter over a float32 and
# over a bfloat16 base read alike). The rest of what a key holds is not shown (a value's whole state), so
# two entries can still read alike; `ls --json` has their keys and dependencies.
def _given_models(references: dict[str, Any]) -> str:
    """The cached models among a call's arguments (a base model, load_adapter's object), each short."""
    return ", ".join(f"{name}=<{_model_short(v)}>" for name, v in references.items()
                     if callable(getattr(v, "parameters", None)))


def _model_short(model: Any) -> str:
    """"llama bfloat16": the last part of the folder or hub id a model was loaded from (its class's name
    without one), and its dtype: its first floating parameter's, as transformers' `dtype` says (which
    raises for a model without one)."""
    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    # "." and "..": the folder's own name, as the call's cwd has it (keys are made in the caller's cwd)
    name = os.path.basename(os.path.abspath(source)) if isinstance(source, str) and source.strip("/") else \
        type(model).__name__
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return f"{name} {str(dtype).removeprefix('torch.')}" if dtype is not None else name


# Note [The user's values by what they do]
# A value of the user's is keyed by what it does, as a function of the notebook is: keyed by its name or its
# state alone, an edit of what it does between two kernels (a kernel restarted on an edited notebook or
# file) left its key as it was, and the second kernel got the first one's result (a stale hit). So:
# - an Enum member of the user's Enum class: by its value too, and its class (below);
# - an object of the user's class keyed by its state (a dataclass, an object with `to_dict`, a scheduler):
#   its class too, as a global class is (`_global`: the notebook's by what it does, `cls`; one of a module
#   beside the notebook by its file's identity and the user's modules it imports). `cls` keys an Enum class
#   by its members' values and its own methods, and a dataclass by its parameters and fields (defaults and
#   factories) and the code of the methods `dataclass` wrote, leaving out what `enum` and `dataclass` put in
#   the namespace (`_made_by_enum_or_dataclass`); a slot of a class is an object's state, not the class's;
# - a wrapper (`functools.cache`, `lru_cache`, anything with `__wrapped__`) of the user's function or class,
#   a global or the cached callable itself: by the function it wraps, followed through `__wrapped__` (a chain
#   that loops is uncacheable); the user's class as the cached callable by what it does; the user's callable
#   object by its class and state, as a value (uncacheable where that has no canonical form);
# - a bound method (`scale = Scaler(2).apply`): by its function and its object, keyed as a global (a value
#   without a canonical form makes the call uncacheable); a classmethod of the user's class by its function
#   and its class. A method of a module (`math.sin`), of a library's class (`AutoModel.from_pretrained`)
#   and of the global generators of `random` and numpy (whose state is keyed where a load draws: Note
#   [Random loads] in randomness.py) keeps its name: those have no state a key misses; so does one of a
#   library's object whose state has no canonical form (`torch.no_grad()`'s `clone`, which a function
#   decorated with `@torch.no_grad()` closes over), which made such a function uncacheable. A string's
#   (`", ".join`) is keyed by the string's text;
# - a module of the user's with a file (`import helpers`) that a function uses whole (`getattr(helpers,
#   name)`, `vars(helpers)`, handed to a call): by that file's identity and the user's modules it imports
#   (Note [The user's modules a module imports]). One the function reads through its attributes alone stays
#   keyed by its name, those attributes by their values (Note [What a function reads] in reads.py), so a
#   file edited and edited back is a hit again.
# What a library's values key to is unchanged (a config, a dtype, a library's Enum, wrapper or method), and so
# are the keys of calls that reach no such value of the user's.
class _Canonical:
    def __init__(self, cwd: str, resolve: Resolve | None) -> None:
        self.cwd = cwd
        self.resolve = resolve
        self.references: dict[str, Any] = {}
        self.source_label: str | None = None
        # the checkpoint argument's source: (its label in `sources` and `roots`, whether a local path)
        self.checkpoint: tuple[str, bool] | None = None
        self.sources: list[tuple[str, Callable[[], Any], Any]] = []
        self.roots: dict[str, str] = {}
        self.code_refs: list[str] = []
        self.spellings: dict[str, str] = {}  # real path -> as the call wrote it (Note [Spellings])
        self._imports: dict[str, dict[str, Any]] = {}  # module -> `users_imports`, once per call
        self._differs: dict[str, dict[str, Any]] = {}  # module -> its `_differences`, once per call
        self._finder = Finder()  # (Note [Modules found by their file])
        self._active: set[int] = set()
        self._functions: set[int] = set()
        self._values = 0

    def source(self, name: str, value: Any, arguments: dict[str, Any]) -> Any:
        if isinstance(value, (str, PurePath)):
            text = os.fspath(value)
            # as the loaders read it: "~/m" is no folder to them (transformers takes it for a hub id, and
            # fails), so a hit of its folder's entry would answer a call the plain load fails
            path = os.path.join(self.cwd, text)
            if os.path.exists(path):
                self.source_label = self.source_label or repr(text)
                keyed = self._path(name, path, text)
                self.checkpoint = self.checkpoint or (keyed["path"], True)
                return keyed
            if isinstance(value, str) and _HUB_ID.match(value):
                self.source_label = self.source_label or repr(value)
                self.checkpoint = self.checkpoint or (value, False)
                return self._hub(value, arguments)
            raise Uncacheable(f"argument {name}={text!r} is neither a local path nor a hub id")
        return self.value(name, value, 0)

    def _hub(self, repo_id: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Hub id `repo_id` at the commit the local HF cache resolves `arguments`' revision to, with its
        snapshot's files."""
        commit = _hub_commit(repo_id, arguments)
        self.sources.append((repo_id, functools.partial(_hub_commit, repo_id, arguments), commit))
        self.roots[repo_id] = str(_hub_folder(repo_id, arguments) / "snapshots" / commit["commit"])
        return {"hub": repo_id, **commit}

    def bases(self, rule: str, arguments: dict[str, Any], checkpoint: tuple[str, bool]) -> dict[str, Any]:
        """The base models the adapter configs of `checkpoint` (its source's label, whether a local path)
        name, where a load by `rule` reads them, keyed as checkpoints: {adapter config: the base's
        fingerprint} (Note [An adapter's base model] in adapter_bases.py). Raises Uncacheable for a base
        that is neither a local path nor a hub id."""
        keyed: dict[str, Any] = {}
        todo = [(rule, arguments, checkpoint)]
        while todo:
            rule, arguments, checkpoint = todo.pop()
            label, local = checkpoint
            root = self.roots[label]
            seen = next(seen for source, _, seen in reversed(self.sources) if source == label)
            rows: list[list[Any]] = seen["files"] if isinstance(seen, dict) else seen
            for base in adapter_bases.named(rule, arguments, root, rows, local):
                named = f"{label}/{base.rel}"  # the folder or hub id, not where a hub's snapshot lies
                path = os.path.join(self.cwd, base.name)  # as the loaders open it: from the working directory
                if os.path.exists(path):
                    keyed[named] = self._path(f"the base model {base.name!r} that {base.config} names", path)
                    checkpoint = (keyed[named]["path"], True)
                elif _HUB_ID.match(base.name):
                    keyed[named] = self._hub(base.name, base.arguments)
                    checkpoint = (base.name, False)
                else:
                    raise Uncacheable(f"the base model {base.name!r} that {base.config} names is neither a local "
                                      f"path here ({self.cwd}) nor a hub id")
                if base.then is not None:
                    todo.append((base.then, base.arguments, checkpoint))
        return keyed

    def code(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The code the configs of the folders read so far name in another folder or hub repo, keyed as
        a checkpoint: {folder or hub id: its fingerprint}; the references, as written, in `code_refs`
        (Note [Code in another folder] in dynamic_modules.py)."""
        refs: set[str] = set()
        for label, _, seen in list(self.sources):
            root = self.roots.get(label)
            rows = seen.get("files") if isinstance(seen, dict) else seen
            if root is None or not isinstance(rows, list):
                continue
            for rel, _link, *identity in rows:
                if rel.endswith("config.json") and identity[0] is not None:
                    refs.update(elsewhere(_read_json(root if rel == "." else os.path.join(root, rel))))
        keyed: dict[str, Any] = {}
        for ref in sorted(refs):
            where = ref.split("--", 1)[0]
            if where not in keyed:
                path = os.path.join(self.cwd, where)  # as transformers finds it: from the working directory
                if os.path.isdir(path):
                    keyed[where] = self._path(f"the model code {ref}", path)
                elif where in self.roots:  # the hub checkpoint itself, keyed at the revision its code is read at
                    keyed[where] = "the checkpoint"
                elif _HUB_ID.match(where):
                    hub = {"revision": arguments.get("code_revision"), "cache_dir": arguments.get("cache_dir")}
                    commit = _hub_commit(where, hub)
                    self.sources.append((where, functools.partial(_hub_commit, where, hub), commit))
                    keyed[where] = {"hub": where, **commit}
                else:
                    raise Uncacheable(f"the model code {ref} that the checkpoint's auto_map names is neither a "
                                      "local folder nor a hub id")
        self.code_refs = sorted(refs)
        return keyed

    def _path(self, name: str, path: str, spelled: str | None = None) -> Any:
        real = os.path.realpath(path)
        if spelled is not None:
            self.spellings.setdefault(real, spelled)
        try:
            files = fingerprint(real)
        except OSError as exc:
            raise Uncacheable(f"cannot fingerprint {name}={path!r}: {exc}") from exc
        self.sources.append((real, functools.partial(fingerprint, real), files))
        self.roots[real] = real
        return {"path": real, "files": files}

    def value(self, name: str, v: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise Uncacheable(f"argument {name} nests deeper than {_MAX_DEPTH} levels")
        self._values += 1
        if self._values > _MAX_VALUES:
            raise Uncacheable(f"the arguments hold more than {_MAX_VALUES} values (at {name}); at most that "
                              "many can be keyed")
        if v is None or isinstance(v, bool) or (isinstance(v, int) and type(v) is int):
            return v
        if isinstance(v, float):
            if not math.isfinite(v):
                return {"float": repr(v)}
            return v
        if isinstance(v, str):
            if len(v) > _MAX_STRING:
                raise Uncacheable(f"argument {name} is a string of {len(v)} characters")
            path = os.path.join(self.cwd, os.path.expanduser(v)) if v else ""
            if path and os.path.exists(path):  # any spelling of a path: "cfgdir", "./m", "~/m", "/abs"
                return self._path(name, path, v)
            return v
        if isinstance(v, (PurePath, os.PathLike)):
            spelled = os.fspath(v)
            return self._path(name, os.path.join(self.cwd, os.path.expanduser(spelled)), str(spelled))
        if isinstance(v, enum.Enum):
            form = {"enum": f"{type(v).__qualname__}.{v.name}"}
            if is_users_module(type(v).__module__):  # Note [The user's values by what they do]
                form |= {"value": self.value(name, v.value, depth + 1), **self._class_of(name, v, depth)}
            return form
        torch = _torch()
        if torch is not None:
            if isinstance(v, torch.dtype):
                return {"dtype": str(v).removeprefix("torch.")}
            if isinstance(v, torch.device):
                return {"device": str(v)}
        if id(v) in self._active:
            raise Uncacheable(f"argument {name} contains itself")
        self._active.add(id(v))
        try:
            return self._container(name, v, depth)
        finally:
            self._active.discard(id(v))

    def function(self, name: str, fn: types.FunctionType, depth: int) -> Any:
        """A plain function by what it does (see Note [Never stale]); Uncacheable when something it
        reads has no canonical form."""
        if id(fn) in self._functions:
            return {"recursive": fn.__qualname__}
        if depth > _MAX_DEPTH:
            raise Uncacheable(f"{name}: functions call functions deeper than {_MAX_DEPTH} levels")
        self._functions.add(id(fn))
        try:
            code = fn.__code__
            # (not the names only its imports use: `from mymodels import build` reads no global `mymodels`)
            names = sorted(_global_names(code) - import_statements(code)[1])
            read = {}
            for g in names:
                if g not in fn.__globals__:
                    continue  # a builtin, or an attribute name that is no global
                x = fn.__globals__[g]
                if x is os.environ or x is os.getenv:
                    continue  # keyed by the variables read (Note [What a function reads])
                if isinstance(x, types.ModuleType) and g not in _used_whole(code):
                    read[g] = {"module": x.__name__}  # what it reads of it is keyed by `_code_reads`, by value
                    continue
                read[g] = self._global(f"{fn.__qualname__}: global {g}", x, depth)
            closure = [self._global(f"{fn.__qualname__}: closure {v}", cell_contents(c), depth)
                       for v, c in zip(code.co_freevars, fn.__closure__ or (), strict=True)]
            out = {
                "qualname": f"{fn.__module__}.{fn.__qualname__}",
                "code": code_digest(code),
                "defaults": self.value(f"{fn.__qualname__}: defaults", list(fn.__defaults__ or ()), depth + 1),
                "kwdefaults": self.value(f"{fn.__qualname__}: defaults", dict(fn.__kwdefaults__ or {}), depth + 1),
                "closure": closure,
                "globals": read,
                **self._code_reads(fn, depth),
            }
            # A library's function also by its file (its code is its version); the user's by its code alone,
            # so that a module beside the notebook edited and edited back is a hit again.
            file = None if is_users_module(fn.__module__) else module_file(fn.__module__)
            if file is not None:
                out["file"] = stat_identity(os.stat(file))
            return out
        finally:
            self._functions.discard(id(fn))

    def _global(self, name: str, x: Any, depth: int) -> Any:
        """A global a function reads. Functions and classes of a module with a file are keyed by name
        and that file's identity (a library's code is its version); those of the notebook itself
        (`__main__`, no file) by their code; a module of the user's by its file, other callables and the
        rest as Note [The user's values by what they do] says."""
        if isinstance(x, types.ModuleType):  # a user's by its file (Note [The user's values by what they do])
            users = sys.modules.get(x.__name__) is x and is_users_module(x.__name__)
            file = module_file(x.__name__) if users else None
            if file is None:
                return {"module": x.__name__}
            identity = stat_identity(os.stat(file))
            return {"module": x.__name__, "file": identity, **self._users_part(x.__name__, identity, depth)}
        if isinstance(x, (types.FunctionType, type)):
            if id(x) in self._functions:  # a method's `__class__` cell: the class being keyed
                return {"recursive": x.__qualname__}
            file = module_file(x.__module__)
            if file is not None:
                out: dict[str, Any] = {"name": f"{x.__module__}.{x.__qualname__}", "file": stat_identity(os.stat(file))}
                if is_users_module(x.__module__):  # Note [The user's modules a module imports]
                    out.update(self._users_part(x.__module__, out["file"], depth))
                return out
            if isinstance(x, types.FunctionType):
                return {"function": self.function(name, x, depth + 1)}
            return self.cls(name, x, depth)
        if callable(x) and hasattr(x, "__qualname__"):  # builtins, bound methods, functools wrappers
            return self._callable(name, x, depth)
        return self.value(name, x, depth + 1)

    def _module_differences(self, modules: dict[str, list[int]], depth: int) -> dict[str, Any]:
        """What each of `modules` (of the user's, by their files' identity) holds now that its file does not
        bind, by module; those that hold what their files bind are left out (Note [What a module holds that
        its file does not bind])."""
        out = {}
        for module, identity in modules.items():
            differs = self._differs.get(module)
            if differs is None:
                # while its values are keyed, a function of it that one of them reaches is keyed without them:
                # they are in this key once, where it first reaches the module
                self._differs[module] = {}
                differs = self._differs[module] = self._differences(module, identity, depth + 1)
            if differs:
                out[module] = differs
        return out

    def _differences(self, module: str, identity: list[int], depth: int) -> dict[str, Any]:
        """The names of `module` whose value is not what its file (at `identity`) binds them to, each keyed
        by the value it has now; Uncacheable for one that cannot be keyed."""
        mod = sys.modules.get(module)
        file = getattr(mod, "__file__", None)  # (found by `module_file` where its identity was taken)
        bound = file_bindings(file, tuple(identity)) if isinstance(file, str) else None
        if mod is None or bound is None or not isinstance(file, str):
            return {}
        changed: dict[str, Any] = {}
        for name, now in held_otherwise(mod, file, bound):
            if now is GONE:
                changed[name] = {"missing": True}
                continue
            try:
                changed[name] = self._global(f"{module}.{name}", now, depth)
            except Uncacheable as exc:
                if name.partition(".")[0] not in bound.read:
                    continue  # no code of the module reads it: it changes nothing the module does
                raise Uncacheable(
                    f"{module}.{name} holds {type(now).__module__}.{type(now).__qualname__}, put there since the "
                    f"module was imported (its file binds it otherwise), and a cache key cannot hold that "
                    f"({exc}); to cache this load, leave it as {os.path.basename(file)} binds it, or change "
                    "that file") from None
        for name, now, read_later in read_at_import(mod, bound):  # Note [What a module reads when it is imported]
            try:
                if isinstance(now, io.IOBase):
                    handle = _file_handle(now)
                    if handle is not None:
                        changed[name] = handle
                    continue
                changed[name] = {"missing": True} if now is GONE else self._global(f"{module}.{name}", now, depth)
            except Uncacheable as exc:
                if not read_later:
                    continue  # (read at the top level alone: the file a `with` opened)
                raise Uncacheable(
                    f"{module}.{name} holds {type(now).__module__}.{type(now).__qualname__}, which "
                    f"{os.path.basename(file)} read from the environment or a file when it was imported, and a "
                    f"cache key cannot hold that ({exc}); to cache this load, bind it to values a key can hold "
                    "(numbers, strings, lists, dicts)") from None
        return changed

    def cls(self, name: str, x: type, depth: int) -> Any:
        """A class of the user's by what it does: its methods by their code, its class attributes, its bases
        (those of the user's are keyed where they stand in the MRO of the class a loader is called on)."""
        if id(x) in self._functions:  # a method's `__class__` cell: the class being keyed
            return {"recursive": x.__qualname__}
        self._functions.add(id(x))
        try:
            methods, attributes, made = {}, {}, _made_by_enum_or_dataclass(x)
            for k, attr in sorted(vars(x).items()):
                if k in CLASS_BOOKKEEPING or k in made or isinstance(attr, types.MemberDescriptorType):
                    continue  # (a slot's value is an object's state)
                v = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
                if isinstance(v, property):
                    methods[k] = [None if f is None else self._global(f"{name}.{k}", f, depth + 1)
                                  for f in (v.fget, v.fset, v.fdel)]
                elif isinstance(v, types.FunctionType):
                    methods[k] = self.function(f"{name}.{k}", v, depth + 1)
                else:
                    attributes[k] = self._global(f"{name}.{k}", v, depth + 1)
            out: dict[str, Any] = {"class": f"{x.__module__}.{x.__qualname__}", "methods": methods,
                                   "bases": [_qualname_of(b) for b in x.__mro__[1:]], "attributes": attributes}
            if issubclass(x, enum.Enum):  # Note [The user's values by what they do]
                out["members"] = [[k, self.value(f"{name}.{k}", m.value, depth + 1)] for k, m in x.__members__.items()]
            if "__dataclass_fields__" in vars(x):  # (made a dataclass here, not only derived from one)
                out["dataclass"] = self._dataclass(name, x, made, depth)
        finally:
            self._functions.discard(id(x))
        return out

    def _dataclass(self, name: str, x: type, made: dict[str, Any], depth: int) -> Any:
        """What the methods `dataclass` wrote in `x` are made of: its parameters, its fields (with their
        defaults and factories), and the code of those methods (their closures hold the defaults)."""
        def default(field: str, v: Any) -> Any:
            if v is dataclasses.MISSING:
                return None
            if isinstance(v, type) and v.__module__ == "builtins":  # a factory: list, dict
                return {"builtin": v.__qualname__}
            return self._global(f"{name}.{field}", v, depth + 1)

        fields = [[f.name, str(getattr(f, "_field_type", None)), default(f.name, f.default),
                   default(f.name, f.default_factory),
                   *(None if y is dataclasses.MISSING else y for y in (f.init, f.repr, f.compare, f.hash, f.kw_only))]
                  for f in getattr(x, "__dataclass_fields__", {}).values()]
        written = {k: code_digest(inspect.unwrap(f).__code__) for k, f in sorted(made.items())
                   if isinstance(f, types.FunctionType)}
        return {"params": repr(getattr(x, "__dataclass_params__", None)), "fields": fields, "written": written}

    def _code_reads(self, fn: types.FunctionType, depth: int) -> dict[str, Any]:
        """The module attributes, environment variables and literal paths `fn`'s code reads (Note [What a
        function reads]); Uncacheable, naming the read, for one that cannot be keyed."""
        where = fn.__qualname__
        attributes: dict[str, Any] = {}
        environment: dict[str, str | None] = {}
        modules = self._imported_by(fn, depth)
        for r in reads(fn.__code__):
            if r.imported and (r.root in modules or any(m.startswith(f"{r.root}.") for m in modules)):
                continue  # a module of the user's the function imports itself: keyed by its file, in `modules`
            # Another module the function imports itself (the standard library's, a library's, one made in
            # memory) that is not imported yet is imported by the call: its attributes are no user's values.
            obj: Any = sys.modules.get(r.root) if r.imported else fn.__globals__.get(r.root)
            name, rest = r.root, list(r.attrs)
            while obj is not None:
                if obj is os.environ or obj is os.getenv:
                    if r.constant is None:
                        raise Uncacheable(
                            f"{where} reads the environment in a way a cache key cannot follow ({r.text} with a "
                            "name computed when it runs, or all of it); write the name out, as "
                            "os.environ['NAME'], os.environ.get('NAME') or os.getenv('NAME')")
                    environment[r.constant] = os.environ.get(r.constant)
                    break
                if not isinstance(obj, types.ModuleType):
                    break
                if not rest:  # the module itself is used (`getattr(helpers, name)`, `vars(helpers)`); a global
                    # one is keyed as a global (Note [The user's values by what they do])
                    if (r.imported or r.attrs) and is_users_module(obj.__name__):
                        attributes[name] = self._global(f"{where}: {name}", obj, depth)
                    break
                attr = rest.pop(0)
                nxt = getattr(obj, attr, _MISSING)
                name = f"{name}.{attr}"
                if is_users_module(obj.__name__) and not isinstance(nxt, types.ModuleType) and \
                        nxt is not os.environ and nxt is not os.getenv:
                    attributes[name] = ({"missing": True} if nxt is _MISSING
                                        else self._global(f"{where}: {name}", nxt, depth))
                    break
                obj = None if nxt is _MISSING else nxt
        paths = {text: self._path(f"{where}: {text!r}", real)
                 for text, real in sorted(path_constants(fn.__code__, self.cwd).items())}
        out = {"attributes": attributes, "environment": environment, "paths": paths}
        if modules:
            out["modules"] = modules
        return out

    def _imported_by(self, fn: types.FunctionType, depth: int) -> dict[str, Any]:
        """The modules of the user's that `fn`'s code imports itself (relative imports against its package),
        each by its file whether imported yet or not, or as missing (Note [Modules found by their file] in
        module_files.py)."""
        statements, _ = import_statements(fn.__code__)
        if not statements:
            return {}
        scope = fn.__globals__
        package = scope.get("__package__") or getattr(scope.get("__spec__"), "parent", None) or ""
        out: dict[str, Any] = {}
        for module, level, names in statements:
            for name in named(package if isinstance(package, str) else "", module, level, names):
                if name not in out:
                    part = self._users_module(name, depth)
                    if part is not None:
                        out[name] = part
        return out

    def _users_module(self, name: str, depth: int) -> Any:
        """A module an import names, where it is the user's: its file's identity and the user's modules it
        imports (Note [The user's modules a module imports]), as a name of it reached as a global is keyed
        beside its own name; {"missing": True}, or None where it is not the user's."""
        part = users_file(name, self._finder)
        if not isinstance(part, tuple):
            return part
        return {"file": part[1], **self._users_part(name, part[1], depth)}

    def _users_part(self, module: str, identity: list[int], depth: int) -> dict[str, Any]:
        """What a module of the user's is keyed by beside its file's `identity`: the user's modules it imports
        (Note [The user's modules a module imports]), checked to run their files (Note [A module that is not
        its file]), and what they hold that their files do not bind (Note [What a module holds that its file
        does not bind])."""
        found = self._imports.get(module)
        if found is None:
            found = self._imports[module] = users_imports(module, self._finder)
            for name, seen in {module: identity, **found}.items():
                if isinstance(seen, list):
                    check_runs_its_file(name, seen)
        out: dict[str, Any] = {"imports": found}
        differs = self._module_differences({module: identity, **found}, depth)
        if differs:
            out["differs"] = differs
        return out

    def _callable(self, name: str, x: Any, depth: int) -> Any:
        """A callable global that is no function, class or module (Note [The user's values by what they do]):
        a wrapper of the user's function or class by what it wraps, a bound method by its function and its
        object (a library's object whose state has no key by its name), the user's callable object by its
        class and state; any other (a builtin, a library's function or wrapper) by its name, its library's
        version being in the key."""
        owner = getattr(x, "__self__", None)
        where = _qualname(owner) if owner is not None and not isinstance(owner, types.ModuleType) else ""
        named = {"callable": f"{where}{getattr(x, '__module__', '')}.{x.__qualname__}"}
        if owner is None or isinstance(owner, types.ModuleType):
            called = self.called(x, name, depth)
            return named if called is None else called
        if isinstance(owner, type) and not is_users_module(owner.__module__):
            return named  # a classmethod of a library's class: its version says what it does
        if owner is getattr(sys.modules.get("random"), "_inst", None) or \
                owner is getattr(sys.modules.get("numpy.random.mtrand"), "_rand", None):
            return named  # the global generators: their state is keyed where a load draws (Note [Random loads])
        func = getattr(x, "__func__", None)  # (a builtin's method has none: its name says what it does)
        method = named if func is None else self._global(name, func, depth)
        if isinstance(owner, type):  # a classmethod of the user's class
            return {"method": method, "class": self._global(f"{name}.__self__", owner, depth)}
        if type(owner) in (str, bytes):  # `", ".join`: the string's text, not the file it may name
            if len(owner) > _MAX_STRING:
                raise Uncacheable(f"{name} is a method of a string of {len(owner)} characters")
            return {"method": method, "self": repr(owner)}
        try:
            return {"method": method, "self": self._global(f"{name}.__self__", owner, depth)}
        except Uncacheable:
            if is_users_module(type(owner).__module__):
                raise
            return named  # a library's object whose state has no key (`torch.no_grad()`'s `clone`, in the
            # closure of a function it decorates): by its name, as before

    def called(self, fn: Any, name: str = "the function", depth: int = 0) -> Any:
        """A callable that is no function nor bound method, by what it does where it is the user's (Note [The
        user's values by what they do]): a wrapper (`functools.cache`, anything with `__wrapped__`) of the
        user's function or class by that function or class, the user's class by what it does, the user's
        callable object by its class and state; None for any other."""
        try:
            inner = inspect.unwrap(fn)
        except ValueError as exc:  # a `__wrapped__` chain that comes back to itself
            raise Uncacheable(f"{name}: {exc}; cache the function it wraps") from exc
        kind = type(fn).__module__
        if is_users_module(kind) and (kind == "__main__" or module_file(kind) is not None):  # (not compiled code)
            if not (dataclasses.is_dataclass(fn) or callable(getattr(fn, "to_dict", None))):
                raise Uncacheable(f"{name} is a callable object of {_qualname(fn)}, whose state is not part of a "
                                  "cache key; cache a function or a method instead")
            return self.value(name, fn, depth + 1)  # an object of the user's class, by its class and state
        if not (isinstance(inner, (types.FunctionType, type)) and is_users_module(inner.__module__)):
            return None
        return self._global(name, fn, depth) if inner is fn else \
            {"wrapper": _qualname(fn), "of": self._global(name, inner, depth)}

    def _class_of(self, name: str, v: Any, depth: int) -> dict[str, Any]:
        """{"class": ...} for an object of the user's class, keyed as a global class is; {} for a library's
        (Note [The user's values by what they do])."""
        cls = type(v)
        return {"class": self._global(f"{name}.__class__", cls, depth)} if is_users_module(cls.__module__) else {}

    def _container(self, name: str, v: Any, depth: int) -> Any:  # noqa: C901 (one case per kind of value, in order)
        if isinstance(v, (list, tuple)):
            if len(v) > _MAX_ITEMS:
                raise Uncacheable(f"argument {name} has {len(v)} items; at most {_MAX_ITEMS} can be keyed")
            return {type(v).__name__: [self.value(f"{name}[{i}]", x, depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, dict):
            if len(v) > _MAX_ITEMS:
                raise Uncacheable(f"argument {name} has {len(v)} items; at most {_MAX_ITEMS} can be keyed")
            items = []
            for k, x in v.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise Uncacheable(f"argument {name} has a key of type {type(k).__name__}")
                items.append([str(k), self.value(f"{name}[{k!r}]", x, depth + 1)])
            return {"dict": sorted(items, key=lambda kv: kv[0])}
        key = self.resolve(v) if self.resolve is not None else None
        if depth == 0 and (key is not None or _a_component(v)):
            self.references[name] = v  # replayed onto on a hit (Note [Argument replay] in rebuild.py)
        if key is not None:
            return {"entry": key}
        if isinstance(v, (set, frozenset)):
            if len(v) > _MAX_ITEMS:
                raise Uncacheable(f"argument {name} has {len(v)} items; at most {_MAX_ITEMS} can be keyed")
            items = [self.value(f"{name}{{}}", x, depth + 1) for x in v]
            return {type(v).__name__: sorted(items, key=lambda x: json.dumps(x, sort_keys=True))}
        if isinstance(v, types.FunctionType):
            return {"function": self.function(name, v, depth + 1)}
        to_dict = getattr(v, "to_dict", None)
        if callable(to_dict) and not isinstance(v, type):
            # A config: what `to_dict()` says, and its whole state besides: `to_dict` drops private
            # fields such as the attention implementation asked for (`_attn_implementation`).
            try:
                data = to_dict()
            except Exception as exc:
                raise Uncacheable(f"argument {name}: {type(v).__name__}.to_dict() failed: {exc}") from exc
            out = {"object": _qualname(v), "dict": self.value(name, data, depth + 1), **self._class_of(name, v, depth)}
            if hasattr(v, "__dict__"):
                state = dict(vars(v))
                if "_original_object_hash" in state:  # a GenerationConfig's hash as loaded is this process's:
                    # whether it is still its own is what the load depends on (Note [What a plain pickle
                    # loses] in rebuild.py)
                    state["_original_object_hash"] = state["_original_object_hash"] == hash(v)
                out["state"] = self.value(name, state, depth + 1)
            return out
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            # A value object (PEFT's LoraRuntimeConfig inside a LoraConfig): its class and its whole state.
            state = vars(v) if hasattr(v, "__dict__") else {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
            return {"object": _qualname(v), "state": self.value(name, dict(state), depth + 1),
                    **self._class_of(name, v, depth)}
        config = getattr(v, "config", None)
        if _is_scheduler(v) and isinstance(config, dict):  # Note [Schedulers given to a load]
            state = {k: x for k, x in vars(v).items() if k != "_internal_dict"}
            return {"object": _qualname(v), "config": self.value(name, _as_set_sorted(dict(config)), depth + 1),
                    "state": self.state(name, state, depth + 1), **self._class_of(name, v, depth)}
        if callable(getattr(v, "named_modules", None)) or callable(getattr(v, "save_pretrained", None)):
            if _gated(v):
                raise Uncacheable(f"argument {name} ({_qualname(v)}) has an adapter gate open on it, whose hooks "
                                  "change the model while it is open; load adapters before adapters.gate(model), "
                                  "or gate.close() first, to cache them")
            raise Uncacheable(f"argument {name} ({_qualname(v)}) was changed since it was loaded or made "
                              "(its weights written in place: training, .data or numpy writes; set_adapter, "
                              "requires_grad_, train() or eval(), an edit of its config or generation_config, "
                              "get_peft_model), or was built in the notebook or loaded without the "
                              "cache, so no cache entry holds it as it is now; to cache this load, pass a model as "
                              "the cache loaded it: load adapters right after loading the base model, before "
                              "changing it")
        raise Uncacheable(f"argument {name} of type {_qualname(v)} has no canonical form for a cache key")


    def state(self, name: str, v: Any, depth: int) -> Any:
        """A scheduler's attribute values: as `value` keys them, and its arrays (timesteps, sigmas, the
        model outputs of a multistep solver) by their bytes."""
        torch = _torch()
        numpy = sys.modules.get("numpy")
        array = None
        if torch is not None and isinstance(v, torch.Tensor):
            array = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            kind = ["tensor", str(v.dtype).removeprefix("torch."), list(v.shape)]
        elif numpy is not None and isinstance(v, numpy.ndarray) and v.dtype != object:
            array, kind = numpy.ascontiguousarray(v), ["array", v.dtype.str, list(v.shape)]
        elif numpy is not None and isinstance(v, numpy.generic) and not isinstance(v, numpy.object_):
            return {"numpy": [v.dtype.str, repr(v.item())]}
        if array is not None:
            if array.nbytes > _MAX_ARRAY:
                raise Uncacheable(f"argument {name} holds an array of {array.nbytes} bytes; at most {_MAX_ARRAY} "
                                  "can be keyed")
            return {kind[0]: [*kind[1:], hashlib.sha256(array.tobytes()).hexdigest()]}
        if depth > _MAX_DEPTH:
            raise Uncacheable(f"argument {name} nests deeper than {_MAX_DEPTH} levels")
        if isinstance(v, (list, tuple)) and len(v) <= _MAX_ITEMS:
            return {type(v).__name__: [self.state(f"{name}[{i}]", x, depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, dict) and len(v) <= _MAX_ITEMS and all(isinstance(k, str) for k in v):
            return {"dict": [[k, self.state(f"{name}.{k}", v[k], depth + 1)] for k in sorted(v)]}
        return self.value(name, v, depth)


# Note [Schedulers given to a load]
# A scheduler given to a load is keyed by its whole state: its config, and every attribute besides (the
# timesteps `set_timesteps` made, an attribute of the user's), arrays by their bytes. A hit gives the
# caller's scheduler the state the entry's scheduler had after the call (Note [Argument replay] in
# rebuild.py), which is what the plain call leaves in it only where the two started alike: keyed by its
# config alone, a fresh scheduler took another kernel's 7 timesteps and lost the attribute its user set.


@functools.lru_cache(maxsize=1024)
def _used_whole(code: types.CodeType) -> frozenset[str]:
    """The globals `code` uses otherwise than through their attributes: handed on (`getattr(helpers, name)`,
    `vars(helpers)`), stored, returned (Note [The user's values by what they do])."""
    return frozenset(r.root for r in reads(code) if not r.imported and not r.attrs)


_DATACLASS_MADE = ("__dataclass_fields__", "__dataclass_params__", "__match_args__")


def _made_by_enum_or_dataclass(cls: type) -> dict[str, Any]:
    """What `enum` or `dataclass` put in `cls`'s namespace, by name (Note [The user's values by what they do]):
    an Enum's members and its machinery (any _sunder_ or __dunder__ name but the functions of `cls`'s own
    module), a dataclass's fields and the methods it wrote from them (their code is `__create_fn__`'s, or
    `dataclasses`')."""
    made: dict[str, Any] = {}
    if issubclass(cls, enum.Enum):
        for k, v in vars(cls).items():
            f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
            if k in cls.__members__ or (k[:1] == "_" and k[-1:] == "_" and not (
                    isinstance(f, types.FunctionType) and f.__module__ == cls.__module__)):
                made[k] = v
    if "__dataclass_fields__" in vars(cls):
        for k, v in vars(cls).items():
            inner = inspect.unwrap(v) if isinstance(v, types.FunctionType) else None  # (`__repr__` is wrapped)
            code = getattr(inner, "__code__", None)
            if k in _DATACLASS_MADE or (code is not None and (code.co_qualname.startswith("__create_fn__.") or
                                                              getattr(inner, "__module__", None) == "dataclasses")):
                made[k] = v
    return made


def _gated(model: Any) -> bool:
    """Whether an adapter gate of this process is open on `model` (nothing is imported for it)."""
    gating = sys.modules.get("overmind_jupyter.adapters.gating")
    return gating is not None and any(g.model is model for g in gating.open_gates())


_MISSING = object()
# What Python keeps in every class's namespace, not what the class does.
def _qualname(v: Any) -> str:
    cls = type(v)
    return f"{cls.__module__}.{cls.__qualname__}"


def _as_set_sorted(config: dict[str, Any]) -> dict[str, Any]:
    """A diffusers config with `_use_default_values` sorted: diffusers makes that list from a set, so its
    order is each process's string hashing (a scheduler made by `from_config` was a miss after every restart)."""
    defaults = config.get("_use_default_values")
    if isinstance(defaults, list) and all(isinstance(x, str) for x in defaults):
        config["_use_default_values"] = sorted(defaults)
    return config


# A component given to a load, by value or as a cached result, which its result holds as given (a pipeline's
# scheduler or feature extractor, a processor's image processor) and which the load may change: a hit gives
# the caller's own object back, with the state the load left it in (Note [Argument replay] in rebuild.py), as
# the plain call does. Configs are not components: transformers copies a config it is given.
_COMPONENTS = frozenset({"SchedulerMixin", "FeatureExtractionMixin", "ImageProcessingMixin", "ProcessorMixin"})


def _a_component(v: Any) -> bool:
    return any(c.__name__ in _COMPONENTS for c in type(v).__mro__)


def _is_scheduler(v: Any) -> bool:
    return any(c.__name__ == "SchedulerMixin" for c in type(v).__mro__)


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")


def _hub_commit(repo_id: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The commit the local HF cache resolves `revision` of `repo_id` to, read offline."""
    revision = arguments.get("revision") or "main"
    if not isinstance(revision, str):
        raise Uncacheable(f"revision={revision!r} is not a string")
    cache_dir = arguments.get("cache_dir") or _hub_cache()
    folder = _hub_folder(repo_id, arguments)
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        commit = revision
    else:
        try:
            commit = (folder / "refs" / revision).read_text().strip()
        except OSError:
            raise Uncacheable(
                f"{repo_id!r} is no directory here ({os.getcwd()}) and {repo_id}@{revision} is not in the "
                "local Hugging Face cache yet: if it is a hub model, this first load downloads it the plain "
                "way and the next one is cached; if it is a local path, check its spelling"
            ) from None
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        raise Uncacheable(f"{repo_id}@{commit[:8]} has no snapshot in {cache_dir}")
    return {"commit": commit, "files": fingerprint(str(snapshot))}


def _read_json(path: str) -> Any:
    """The parsed JSON file `path`, or None where it is no JSON."""
    try:
        with open(path, "rb") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _hub_folder(repo_id: str, arguments: dict[str, Any]) -> Path:
    """The local Hugging Face cache's folder of model `repo_id` (its refs and snapshots)."""
    from huggingface_hub.file_download import repo_folder_name

    return Path(arguments.get("cache_dir") or _hub_cache()) / repo_folder_name(repo_id=repo_id, repo_type="model")


# Note [Classes registered with an Auto class]
# `AutoModelForCausalLM.register(LlamaConfig, MyLlama, exist_ok=True)` (or `AutoConfig.register("mine",
# MyConfig)`) changes which class an Auto class's `from_pretrained` builds, for the same checkpoint and
# arguments: the key of a call on an Auto class names every registration made in the process, each class
# as a global a function reads is named (Note [The user's modules a module imports]). So a kernel that
# registers its own class, or an edited one, does not get the entry of the library's class, and the other
# way round. The registrations are read from transformers' mappings (`_extra_content`, where `register`
# puts them); none made, the key is as before. Those transformers makes itself, as a `trust_remote_code`
# load registers the checkpoint's own classes (`transformers_modules.*`), are left out: that code is keyed
# with the checkpoint (Note [Code in the checkpoint] in dynamic_modules.py), and the first such load of a
# process would otherwise have a key of its own.
def _registered(cls: type) -> list[tuple[Any, Any]]:
    """The (config, model) classes registered with the Auto class `cls`, and the (model type, config
    class) pairs registered with AutoConfig, in the order made (Note [Classes registered with an Auto
    class]); none for any other class."""
    mapping = getattr(cls, "_model_mapping", None)
    extra = getattr(mapping, "_extra_content", None)
    if not isinstance(extra, dict):
        return []
    configs = getattr(sys.modules.get("transformers.models.auto.configuration_auto"), "CONFIG_MAPPING", None)
    pairs = [*extra.items(), *((getattr(configs, "_extra_content", None) or {}).items())]
    return [pair for pair in pairs if not str(getattr(pair[1], "__module__", "")).startswith("transformers_modules.")]


def _file_handle(handle: io.IOBase) -> dict[str, Any] | None:
    """A file a module opened at import (Note [What a module reads when it is imported]) as a key holds it:
    one it can read from, by its file's identity and its position; None for one it cannot read from (a log
    it writes, a closed file), which changes nothing a load reads. Raises Uncacheable for one that is no
    file of a path (a pipe, a socket, a buffer in memory)."""
    try:
        readable = not handle.closed and handle.readable()
    except (OSError, ValueError):
        return None
    if not readable:
        return None
    path = getattr(handle, "name", None)
    if not isinstance(path, str):
        raise Uncacheable("a handle of no file")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise Uncacheable("a handle of no file")
        return {"file": stat_identity(st), "at": handle.tell()}
    except OSError as exc:
        raise Uncacheable(f"a handle of {path!r}, which cannot be read ({exc})") from None


def _qualname_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _global_names(code: types.CodeType) -> set[str]:
    """The names `code` and the code nested in it (inner functions, comprehensions) look up."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _global_names(const)
    return out
