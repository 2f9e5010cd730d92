"""What `%overmind on` patches: a table of loaders, and the import hook for libraries imported later.

Every loader is a classmethod (`from_pretrained`, diffusers' `from_single_file`) of a base class;
subclasses inherit the patched one, so `LlamaForCausalLM.from_pretrained` and
`AutoModelForCausalLM.from_pretrained` both go through it, keyed by the class they were called on.
Beside them, the methods that move a loaded object to a device (`torch.nn.Module.to` and `.cuda`,
`DiffusionPipeline.to`), which take a cached result to a GPU through the units ledger (Note [Moves of
cached results] in placement.py).
"""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FunctionType, MethodType, ModuleType
from typing import Any

from . import keys, patching, placement

__all__ = ["TARGETS", "Target", "install", "prepare_signatures", "uninstall"]


@dataclass(frozen=True)
class Target:
    """`owner.method` in `module`; with `owner="*"`, every class of `module` that derives from
    `subclasses_of` (a class name of another target) and defines `method` itself. A `move` is no loader:
    a method that moves an object to a device (Note [Moves of cached results] in placement.py)."""

    module: str
    owner: str
    method: str = "from_pretrained"
    subclasses_of: str | None = None
    move: bool = False


TARGETS: tuple[Target, ...] = (
    Target("transformers.modeling_utils", "PreTrainedModel"),
    Target("transformers.models.auto.auto_factory", "_BaseAutoModelClass"),
    # Each Auto model class carries its own copy of the method (transformers' auto_class_update).
    Target("transformers.models.auto.modeling_auto", "*", subclasses_of="_BaseAutoModelClass"),
    Target("transformers.tokenization_utils_base", "PreTrainedTokenizerBase"),
    Target("transformers.models.auto.tokenization_auto", "AutoTokenizer"),
    Target("transformers.processing_utils", "ProcessorMixin"),
    Target("transformers.models.auto.processing_auto", "AutoProcessor"),
    Target("diffusers.pipelines.pipeline_utils", "DiffusionPipeline"),
    Target("diffusers.models.modeling_utils", "ModelMixin"),
    Target("diffusers.schedulers.scheduling_utils", "SchedulerMixin"),
    # A checkpoint in its original layout (one .safetensors or .ckpt file), converted at every load.
    Target("diffusers.loaders.single_file", "FromSingleFileMixin", method="from_single_file"),
    Target("diffusers.loaders.single_file_model", "FromOriginalModelMixin", method="from_single_file"),
    Target("peft.peft_model", "PeftModel"),
    # A method of a loaded model that loads more into it: cached when the model is a cached result,
    # and replayed onto the caller's model on a hit (see Note [Argument replay] in rebuild.py).
    Target("peft.peft_model", "PeftModel", method="load_adapter"),
    # A cached result's own moves to a GPU, through the units ledger (Note [Moves of cached results] in
    # placement.py); transformers' and diffusers' model classes override them and call these through super().
    Target("torch.nn.modules.module", "Module", method="to", move=True),
    Target("torch.nn.modules.module", "Module", method="cuda", move=True),
    # and back: a placed result's move to the CPU gives its units back (Note [Moves back to the CPU])
    Target("torch.nn.modules.module", "Module", method="cpu", move=True),
    Target("diffusers.pipelines.pipeline_utils", "DiffusionPipeline", method="to", move=True),
)
_BY_MODULE: dict[str, list[Target]] = {}
for _t in TARGETS:
    _BY_MODULE.setdefault(_t.module, []).append(_t)

# Note [Outermost call only]
# A patched loader that runs inside another (an Auto class calling the concrete class, a pipeline
# loading its components, PeftModel loading its base) passes straight through: only the outermost call
# is cached, and the entry holds the whole result. The flag is a ContextVar, so loads in other threads
# are independent.
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("overmind_inside_loader", default=False)

_call: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None
_lock = threading.Lock()


def _through_cache(bound: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    __tracebackhide__ = True  # Note [Our frames hidden] in loading.py
    call = _call
    if call is None or _inside.get():
        return bound(*args, **kwargs)
    token = _inside.set(True)
    try:
        return call(bound, args, kwargs)
    finally:
        _inside.reset(token)


def _cached_loader(original: Any, owner: type) -> Any:
    """A replacement with the original's name, docstring and signature, for a classmethod (called on a
    class) or a plain function (a method called on a loaded object of `owner`). A method called unbound
    on an object of another class (PeftMixedModel.load_adapter calls `PeftModel.load_adapter(self, ...)`)
    is not a target: it runs as it is, with no fallback to report."""
    _build_signature(original, owner)
    if isinstance(original, classmethod):
        @functools.wraps(original.__func__)
        def loader(cls: type, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # Note [Our frames hidden] in loading.py
            return _through_cache(original.__get__(None, cls), args, kwargs)

        return classmethod(loader)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # Note [Our frames hidden] in loading.py
        if not isinstance(self, owner):
            return original(self, *args, **kwargs)
        return _through_cache(original.__get__(self, type(self)), args, kwargs)

    return method


def _routed_move(original: Any, method: str) -> Any:
    """A replacement with the original's name, docstring and signature, for a method that moves an object to
    a device: the original itself, unless the object is a cached result (Note [Moves of cached results] in
    placement.py). After `%overmind off`, a reference kept to it passes every call to the original."""

    @functools.wraps(original)
    def move(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _call is None or not placement.ours(self) or _inside.get():
            return original(self, *args, **kwargs)
        return placement.move(original, method, self, args, kwargs)

    return move


# The code of `_cached_loader`'s classmethod wrapper, which a copy of it shares (Note [Copied wrappers]).
_LOADER = next(c for c in _cached_loader.__code__.co_consts if isinstance(c, CodeType) and c.co_name == "loader")


def _build_signature(original: Any, owner: type) -> None:
    """Build the signature a load's key uses now rather than in the first load (Note [Signatures] in keys.py)."""
    try:
        keys.signature(MethodType(getattr(original, "__func__", original), owner))
    except (TypeError, ValueError):
        pass  # the load's key falls back to positional names, as it would then


def prepare_signatures() -> None:
    """Build the signatures `install` builds, for the targets whose modules are imported, patching nothing:
    a warm kernels' spare runs this once, and every kernel forked from it finds them built."""
    with _lock:
        for name, targets in _BY_MODULE.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            for target in targets:
                if target.move:
                    continue
                for owner in _owners(module, target):
                    original = owner.__dict__.get(target.method)
                    if isinstance(original, (classmethod, FunctionType)):
                        _build_signature(original, owner)


def _owners(module: ModuleType, target: Target) -> list[type]:
    if target.owner != "*":
        owner = getattr(module, target.owner, None)
        return [owner] if isinstance(owner, type) else []
    return [cls for cls in vars(module).values()
            if isinstance(cls, type) and cls.__module__ == module.__name__
            and any(base.__name__ == target.subclasses_of for base in cls.__mro__[1:])]


def _patch_module(module: ModuleType) -> None:
    for target in _BY_MODULE.get(module.__name__, ()):
        for owner in _owners(module, target):
            current = owner.__dict__.get(target.method)
            if target.move and isinstance(current, FunctionType):
                patching.patch(owner, target.method, functools.partial(_routed_move, method=target.method))
            elif not target.move and isinstance(current, (classmethod, FunctionType)):
                patching.patch(owner, target.method, functools.partial(_cached_loader, owner=owner),
                               original=_uncopied(current))


# Note [Copied wrappers]
# transformers gives each Auto model class a copy of `_BaseAutoModelClass.from_pretrained` when the class
# is made (auto_class_update: a new function over the same code and closure, with a docstring of its own).
# An Auto class made while `%overmind on` holds the base class patched copies our wrapper, and restoring
# "its own" attribute at `%overmind off` would leave the wrapper there: a plain load's traceback would pass
# through this module. So a copy of our wrapper found on a class is recorded with the original it would
# have copied instead: the same copy made of the function our wrapper wraps, with the copy's docstring.
def _uncopied(descriptor: Any) -> Any:
    """What a library's copy of our `loader` wrapper (Note [Copied wrappers]) copied had nothing been
    patched, or None for any other descriptor."""
    func = getattr(descriptor, "__func__", None)
    if not isinstance(descriptor, classmethod) or not isinstance(func, FunctionType) or func.__code__ is not _LOADER:
        return None
    original = _wrapped(func).__func__
    copy = FunctionType(original.__code__, original.__globals__, original.__name__, original.__defaults__,
                        original.__closure__)
    functools.update_wrapper(copy, original)
    copy.__kwdefaults__, copy.__doc__ = original.__kwdefaults__, func.__doc__
    return classmethod(copy)


def _wrapped(loader: FunctionType) -> Any:
    """The classmethod our `loader` wrapper `loader` calls."""
    cells = dict(zip(loader.__code__.co_freevars, loader.__closure__ or (), strict=True))
    return cells["original"].cell_contents


def unpatched(fn: Any) -> Any:
    """`fn`, or the library's own loader where `fn` is our wrapper of it bound to a class (a
    `from_pretrained` read while `%overmind on` holds), for a call that must name the library's: a
    worker's job pickled by reference (`preload`)."""
    func, owner = getattr(fn, "__func__", None), getattr(fn, "__self__", None)
    if not isinstance(func, FunctionType) or func.__code__ is not _LOADER or not isinstance(owner, type):
        return fn
    return _wrapped(func).__get__(None, owner)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a target module right after it is first executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _BY_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader = spec.loader
                spec.loader = _PatchingLoader(loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        if _call is not None:
            _patch_module(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_source, ... of the real loader
        return getattr(self.loader, name)


_finder = _Finder()


def install(call: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> list[str]:
    """Patch every target whose module is imported, and the others when they are; loads then go to
    `call(bound_loader, args, kwargs)`. Returns what is patched now."""
    global _call
    with _lock:
        _call = call
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        for name in _BY_MODULE:
            module = sys.modules.get(name)
            if module is not None:
                _patch_module(module)
    return patching.patched()


def uninstall() -> list[BaseException]:
    """Remove the import hook and restore every patched loader."""
    global _call
    with _lock:
        _call = None
        try:
            if _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
        finally:
            errors = patching.unpatch_all()
    return errors
