"""What an entry's graph needs of the library modules its classes come from, as this process has them:
the classes their names bind and the methods patched into their classes (Notes [Classes swapped in a
library] and [Methods patched into a library's classes]). Not part of a key, which is made before the
graph is known: an entry records the digests (`bindings`) at its miss, and a hit compares them with this
process's, keying the call again where they differ (`under_bindings`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

from .keys import CallKey
from .reads import code_digest

__all__ = ["bindings", "under_bindings"]


# Note [Classes swapped in a library]
# A kernel may put a class of its own in a library's module before loading (liger-kernel's way:
# `modeling_llama.LlamaRMSNorm = FastRMSNorm`), and the library's code then builds that class wherever it
# named the old one. The key does not see it (the callable, the arguments and the versions are the same),
# and the graph names classes by module and name: an entry made without the swap would come back in the
# kernel that swapped as the library's classes (where a name now finds the new class, unpickled into it
# without its `__init__`), and one made with it, in a kernel without it, as the swapped class. So an entry
# records, for each module of the cached libraries (and of torch.nn) whose classes its graph holds, a
# digest of the names of the module that bind a class from outside its library (what it imports from
# torch, and what was put there), and of the methods patched into its classes (Note [Methods patched
# into a library's classes]); a hit compares it with the module as this process has it now. The
# library's own classes are left out: it binds some of them lazily (the first
# `CLIPProcessor.from_pretrained` makes `tokenization_clip.CLIPTokenizerFast` an alias of
# `CLIPTokenizer`), and a swap for another class of the same library is not looked for. Where any
# differs, the call is keyed again with this process's digests (`under_bindings`): its own entry, made by
# the first kernel with the same classes in place. Not seen: a class put elsewhere than a module's name
# (an entry of `transformers.activations.ACT2FN`, a package's namespace that an Auto mapping reads,
# `torch.nn.Linear` itself); README's Limits say so. A module's names are read again only where its
# namespace changed since (a compare of its dict with a copy, in C); a module the hit's graph needs and
# this process has not imported yet is imported first (the rebuild would import it).
_BOUND = ("transformers", "diffusers", "peft")


def bindings(modules: Any) -> dict[str, str]:
    """The digest of the classes from outside its library that each of `modules` (names) of the cached
    libraries and of torch.nn binds, and of the methods patched into the classes it defines and their
    bases (Note [Classes swapped in a library]); "" for one that cannot be imported."""
    out = {}
    for name in sorted(modules):
        if not isinstance(name, str) or not (name.split(".")[0] in _BOUND or name.startswith("torch.nn.")):
            continue
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 (a module gone: the rebuild would fail; a key of its own)
                out[name] = ""
                continue
        held = _module_views.get(name)
        if held is None or held.module is not module or not _same(vars(module), held.snapshot):
            held = _module_views[name] = _module_view(name, module)
        elif not _same(held.namespaces, held.copies):  # a class's namespace changed (a patch; a load's first caches)
            held = _module_views[name] = _module_view(name, module, held)
        out[name] = held.digest
    return out


class _View(NamedTuple):
    """What `bindings` read of a module: the module, a copy of its namespace, the namespaces of the classes
    whose methods its digest covers (those it defines and the classes of the cached libraries and torch.nn
    they derive from: Note [Methods patched into a library's classes]) and copies of them, its digest, the
    names it binds from outside its library, and those classes."""

    module: types.ModuleType
    snapshot: dict[str, Any]
    namespaces: tuple[Any, ...]  # (live views: compared with their copies at each call)
    copies: tuple[dict[str, Any], ...]
    digest: str
    bound: list[tuple[str, Any, Any]]
    classes: tuple[type, ...]


def _module_view(name: str, module: types.ModuleType, before: _View | None = None) -> _View:
    """`module`'s view; `before`: its view when its namespace was the same, whose names and classes stay
    (only the classes' methods are read again, where they changed)."""
    if before is not None:
        snapshot, bound, classes = before.snapshot, before.bound, before.classes
    else:
        snapshot = dict(vars(module))
        top = name.partition(".")[0]
        bound = [(k, v.__module__, v.__qualname__) for k, v in snapshot.items()
                 if isinstance(v, type) and str(v.__module__).partition(".")[0] != top]
        classes = tuple(dict.fromkeys(base for v in snapshot.values()
                                      if isinstance(v, type) and getattr(v, "__module__", None) == name
                                      for base in v.__mro__ if _methods_read(base)))
    namespaces = tuple(vars(cls) for cls in classes)
    patched = sorted(found for cls, namespace in zip(classes, namespaces, strict=True)
                     for found in _patched_methods(cls, namespace))
    copies = tuple(_class_methods[cls][0] for cls in classes)  # (one copy of a class's for every module)
    text = repr((bound, patched)) if patched else repr(bound)  # (none: as entries made before methods were read)
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return _View(module, snapshot, namespaces, copies, digest, bound, classes)


def _methods_read(cls: type) -> bool:
    """Whether the methods of `cls` are read: a class of the cached libraries or of torch.nn."""
    owner = getattr(cls, "__module__", None)
    return isinstance(owner, str) and (owner.partition(".")[0] in _BOUND or owner.startswith("torch.nn."))


def _same(now: Any, copy: Any) -> bool:
    try:
        return bool(now == copy)
    except Exception:  # noqa: BLE001 (a value whose == raises or is ambiguous: read it again)
        return False


_module_views: dict[str, _View] = {}


# Note [Methods patched into a library's classes]
# A kernel may replace a method of a library's class before loading: an `__init__` that sets another
# `eps` on every RMSNorm, an `_init_weights` that fills a new head otherwise or skips it,
# `torch.nn.Linear.reset_parameters = lambda self: None`. What runs at load time decides the result,
# and neither the key nor the classes' names see it. So the digest of a module (Note [Classes swapped in
# a library]) also covers the methods of the classes it defines and of the classes of the cached
# libraries and torch.nn they derive from (`PreTrainedModel._init_weights` and `nn.Module`'s methods are
# in modules the graph does not name), as they stand in this process: each function in a class's
# `__dict__` (a staticmethod's, classmethod's or property's own, and the functions it wraps through
# `__wrapped__`) whose code is not library code, by class, attribute, the function's module and qualname
# and the digest of its code, so an edited patch is another digest. torch.nn's modules whose classes the
# graph holds are read as the libraries' are: `nn.Linear` and `nn.Embedding` are most of a model, and a
# patch of theirs (`reset_parameters`, `__init__`) is in a module no library class derives from; torch's
# other modules are not (tensors, dtypes, devices). Where a code object was compiled,
# not `__module__`, decides: `functools.wraps` copies the name and module of what it wraps. Library code
# is the standard library's and that of the packages the libraries build their classes with: the cached
# libraries, torch, huggingface_hub (strict dataclasses), kernels (hub kernels' `forward` and
# `__init__`), accelerate, typing_extensions, and ours (`%overmind on`'s wrappers). Not the class's own
# library only: transformers' first `initialize_weights` puts `smart_apply` on `nn.Module`, so a rule of
# one library would key a process by its history. A dataclass's generated methods (`__init__`, `__eq__`
# compiled from "<string>") are the library's too. With none patched, a module's digest is that of its
# names alone, as before (entries made before still hit). Not seen: a function of the library's put on
# another class or attribute, a patch compiled from a string into a dataclass method of the same name, a
# callable that is no function (a `functools.partialmethod`), a patch's closure or the globals it reads
# (the same code with another value), a class attribute that is no function (`_keep_in_fp32_modules`), a
# module's functions (`modeling_llama.apply_rotary_pos_emb`), an instance's attributes, and the classes
# of other packages a class derives from. Another installed package's patches (liger-kernel's `forward`)
# are seen. A class's methods are read again only where its `__dict__` changed since (a compare with a
# copy, in C): a Llama's hit compares 7 modules' and 65 classes' namespaces in 40-70 us (2 shared cores),
# less than reading its 4 modules' names in Python took before (65-85 us there). A module's names and
# classes are read again only where its own namespace changed: transformers' first load of a process
# changes three classes' (`smart_apply` on nn.Module, a model class's and a config class's caches), and
# a first miss then read all 7 modules of a Llama's graph again (0.55-0.97 ms); now those three classes
# (0.36-0.6 ms), each class's copy held once for every module that reads it.
_LIBRARY_CODE = (*_BOUND, "torch", "huggingface_hub", "kernels", "accelerate", "typing_extensions",
                 "overmind_jupyter", "kernel_server")
_GENERATED = frozenset(("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__", "__lt__",
                        "__le__", "__gt__", "__ge__", "__getstate__", "__setstate__", "__replace__"))


def _patched_methods(cls: type, namespace: Any) -> tuple[tuple[str, ...], ...]:
    """(class, attribute, module, qualname, code digest) of each function in `namespace`, `cls`'s, whose
    code is not library code (Note [Methods patched into a library's classes]). Holds a copy of the
    namespace read, in `_class_methods`."""
    held = _class_methods.get(cls)
    if held is not None and _same(namespace, held[0]):
        return held[1]
    namespace = dict(namespace)
    owner = f"{cls.__module__}.{cls.__qualname__}"
    dataclass_ = "__dataclass_fields__" in namespace
    found = tuple((owner, attr, str(fn.__module__), str(fn.__qualname__), code_digest(fn.__code__))
                  for attr, value in namespace.items() if _runs_code(value) and not _plain_library_function(value)
                  for fn in _functions(value) if not _library_function(fn, attr, dataclass_))
    _class_methods[cls] = (namespace, found)
    return found


_class_methods: dict[type, tuple[dict[str, Any], tuple[tuple[str, ...], ...]]] = {}


def _runs_code(value: Any) -> bool:
    """Whether a class attribute may run a function: not a constant, a string, a dict (most of the rest)."""
    return callable(value) or isinstance(value, (staticmethod, classmethod, property))


def _plain_library_function(value: Any) -> bool:
    """Whether `value` is a function of library code that wraps nothing: most of a class's attributes, told
    without a generator's frame (`_functions`)."""
    return type(value) is types.FunctionType and not value.__dict__ and _library_file(value.__code__.co_filename)


def _functions(value: Any) -> Iterator[types.FunctionType]:
    """The functions a class attribute runs: a staticmethod's, classmethod's or property's, and those
    each wraps (`__wrapped__`, as `functools.wraps` and torch's `no_grad` leave it)."""
    value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    for outer in (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,):
        fn = outer
        for _ in range(8):  # (a chain of wrappers; a cycle ends here)
            if isinstance(fn, types.FunctionType):
                yield fn
            try:
                fn = vars(fn).get("__wrapped__")  # (not getattr: no `__getattr__` of an object runs)
            except TypeError:
                break


def _library_function(fn: types.FunctionType, attr: str, dataclass_: bool) -> bool:
    """Whether `fn`, found under `attr` of a class (a dataclass if `dataclass_`), is library code."""
    code = fn.__code__
    if code.co_filename == "<string>" and dataclass_ and attr in _GENERATED and code.co_name == attr:
        return True  # (what dataclasses compile)
    return _library_file(code.co_filename)


@functools.lru_cache(maxsize=1024)
def _library_file(filename: str) -> bool:
    """Whether code compiled from `filename` is library code: the standard library's (frozen or not) or
    that of a package of `_LIBRARY_CODE` (Note [Methods patched into a library's classes])."""
    if filename.startswith("<frozen "):
        return True
    places, stdlib = _library_places()
    return _in_places(filename, places, stdlib) or _in_places(os.path.realpath(filename), places, stdlib)


def _in_places(file: str, places: tuple[str, ...], stdlib: tuple[str, ...]) -> bool:
    if any(file == place or (place.endswith(os.sep) and file.startswith(place)) for place in places):
        return True
    rest = next((file[len(folder):] for folder in stdlib if file.startswith(folder)), None)
    # (the standard library's folder, not the site-packages inside it)
    return rest is not None and not {"site-packages", "dist-packages"} & set(rest.split(os.sep))


@functools.cache
def _library_places() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The folders (ending in a separator) and files of the packages of `_LIBRARY_CODE`, as found and as
    real paths, and the standard library's folders."""
    import sysconfig
    from importlib.util import find_spec

    places: list[str] = []
    for name in _LIBRARY_CODE:
        try:
            spec = find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            places += [os.path.join(folder, "") for folder in spec.submodule_search_locations]
        elif spec is not None and spec.origin:
            places.append(spec.origin)
    places += [os.path.join(os.path.realpath(place), "") if place.endswith(os.sep) else os.path.realpath(place)
               for place in places]
    stdlib = {os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib")}
    return tuple(dict.fromkeys(places)), tuple(stdlib)


def under_bindings(ck: CallKey, now: dict[str, str]) -> CallKey:
    """The key of `ck` in a process whose library modules bind the classes `now` says (Note [Classes
    swapped in a library])."""
    digest = hashlib.sha256(ck.key.encode() + json.dumps(now, sort_keys=True).encode()).hexdigest()
    return dataclasses.replace(ck, key=digest)
