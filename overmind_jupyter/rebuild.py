"""Pack an object graph into an arena, and rebuild it from one zero-copy and copy-on-write.

`pack` pickles the graph with a dispatch table that replaces every torch storage by a reference: to a
place in the new arena (publishing.py fills it), or, when the storage already lies in unwritten pages
of another entry's mapping (Note [Mapping registry] in mappings.py), to that entry's bytes (so a base
model inside a PeftModel, or a vae inside a pipeline, is stored once). Storages are
deduplicated by identity, so tied weights stay tied and views keep their storage offsets.
`rebuild` maps the arenas (and the checkpoint files of pieces still pending, Note [Pending pieces] in
kernel_server/store.py) MAP_PRIVATE and creates each storage over its bytes with `torch.frombuffer`:
no tensor is copied, and writes stay in this process (see Note [Copy-on-write mappings] in
kernel_server/arena.py).

Only storages, tensors, modules and OrderedDicts go through Python hooks while pickling (a per-type
dispatch table, looked up in C), so a 1.1B-parameter model's graph pickles in a few milliseconds; and
unpickling a module or a tensor is as few calls as torch allows (Note [Cheap rebuild]).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copyreg
import errno
import functools
import gc
import io
import itertools
import mmap
import operator
import os
import pickle
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kernel_server import arena, descriptors

from . import mappings, populating
from .errors import CorruptEntry, NoRoomHere, PackError
from .keys import GRAPH_FORMAT

if TYPE_CHECKING:
    from .staging import Stage

__all__ = ["ArenaRef", "Packed", "entry_of", "pack", "rebuild", "skeleton"]

entry_of = mappings.entry_of

_FORMAT = GRAPH_FORMAT  # keys.py names it in every key


@dataclass(slots=True)  # one per storage: a plain __init__
class Own:
    storage: torch.UntypedStorage | None  # dropped once its bytes are in the arena (publishing.py)
    offset: int
    nbytes: int
    staged: bool = False  # its bytes are in the arena already (Note [Staged conversions] in staging.py)


@dataclass
class Packed:
    """The result of `pack`: the graph, the storages to copy, and the entries referenced."""

    graph: bytes
    own: list[Own]
    deps: list[str]
    arena_bytes: int
    # the plain tensors and parameters of the graph by their storage (its `_cdata`), and the others
    by_storage: dict[int, list[torch.Tensor]] = field(repr=False)
    tensors: list[torch.Tensor] = field(repr=False)
    pickler: str = "pickle"
    # storages that lie, unwritten, in entries' mappings: (entry key, offset, bytes, device) -> storage
    mapped: dict[tuple[str, int, int, str], torch.UntypedStorage] = field(default_factory=dict, repr=False)
    devices: list[str] = field(default_factory=list)  # the devices but the CPU its storages lie on ("cuda:0")
    next_hook_id: int = 0  # past the ids of the hooks in the graph (Note [Hook ids])
    modules: set[str] = field(default_factory=set)  # of the classes of the graph's objects


@dataclass
class ArenaRef:
    """One entry to map for a rebuild: its key, the arena's descriptor and size, its pending pieces
    ([arena offset, bytes, source index, file offset]) with their source files, and its parts (Note
    [Arena parts] in kernel_server/arena.py)."""

    key: str
    fd: int
    nbytes: int
    pieces: list[list[int]] = field(default_factory=list)
    sources: list[arena.SourceFile] = field(default_factory=list)
    parts: list[arena.Part] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pieces = sorted(self.pieces)
        self._starts = [p[0] for p in self.pieces]

    def piece_at(self, offset: int, nbytes: int) -> list[int] | None:
        """The pending piece that holds [offset, offset + nbytes), if any."""
        i = bisect.bisect(self._starts, offset) - 1
        if i >= 0:
            piece = self.pieces[i]
            if offset + nbytes <= piece[0] + piece[1]:
                return piece
        return None


# -- pack ------------------------------------------------------------------------------------------


class _Placer:
    """Assigns each storage met while pickling its reference, and records tensors' versions."""

    def __init__(self, self_key: str | None, trust_mappings: bool, stage: Stage | None = None) -> None:
        self.self_key = self_key
        self.trust_mappings = trust_mappings
        self.stage = stage
        self.written = mappings.WrittenPages()
        self.intact: dict[int, bool] = {}  # id(source file) -> whether it is unchanged
        self.mapped: dict[tuple[str, int, int, str], torch.UntypedStorage] = {}
        self.offset = stage.top if stage is not None else 0  # the staged ranges come first
        self.staged = stage.placed() if stage is not None else {}  # address -> (arena offset, bytes)
        self.own: list[Own] = []
        # storage -> what unpickles to it (Note [Cheap rebuild]); or the tensor made over it, whose
        # storage it is (a `_Call` of `_STORAGE_OF` made when a second user of the storage asks)
        self.seen: dict[int, _Call | torch.Tensor] = {}
        self.deps: list[str] = []
        self.by_storage: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self.tensors: list[torch.Tensor] = []  # those not plain (Note [Plain tensors])
        self.devices: dict[str, None] = {}  # the devices but the CPU met, in order
        self.hook_ids: list[int] = []  # the highest int key of each non-empty OrderedDict (Note [Hook ids])

    def dispatch_table(self) -> _Dispatch:
        table = _Dispatch(copyreg.dispatch_table)
        table[torch.storage.TypedStorage] = lambda s: (_typed, (self.source(s._untyped_storage), _dtype(s.dtype)))
        table[torch.UntypedStorage] = lambda s: (_typed, (self.source(s), None))
        table[torch.Tensor] = self.tensor
        table[torch.nn.Parameter] = self.tensor
        table[collections.OrderedDict] = functools.partial(_reduce_ordered_dict, self.hook_ids)
        table[_Call] = table[_EmptyHooks] = table[_SetDict] = _reduced
        return table

    def tensor(self, t: torch.Tensor) -> Any:
        """A tensor's reduction (the pickler's dispatch entry of Tensor and Parameter). Met once for each
        tensor of a model, so written for few Python calls: 2-3 us a tensor."""
        kind = type(t)
        if not (t.layout is _STRIDED and not t.is_meta and t.dtype in _PLAIN_DTYPES
                and not t.is_conj() and not t.is_neg()
                and (kind is _PARAMETER or not (t.requires_grad or t._backward_hooks or vars(t)))):
            self.tensors.append(t)
            return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        # Note [Plain tensors]
        untyped = t.untyped_storage()
        self.by_storage[untyped._cdata].append(t)
        attributes = vars(t) or None
        # Attributes that hold objects could lead back to this tensor's storage before the tensor is
        # pickled whole, where the fresh tensor would make them refer to the tensor itself (a recursion).
        if untyped._cdata not in self.seen and (attributes is None or _ATOMIC.issuperset(
                map(type, attributes.values()))):
            # The first tensor met on a storage of this entry's arena on the CPU: a tensor made over the
            # arena's bytes in one call, which makes its storage too (Note [Cheap rebuild]).
            placed = self._place(untyped, t.is_cpu)
            kind_, _, at, nbytes, device = placed
            itemsize = t.dtype.itemsize
            if kind_ != "own" or device != "cpu" or not nbytes or nbytes % itemsize:
                self.seen[untyped._cdata] = _Call(_storage_at, *placed)
            else:
                self.seen[untyped._cdata] = t  # later users of the storage take this tensor's
                count = nbytes // itemsize
                size, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
                shape: _Shape = None  # the whole storage, flat
                if (size, stride, offset) != ((count,), (1,), 0):
                    shape = (size, stride, offset) if offset else (size, stride)  # Note [Cheap rebuild]
                if kind is _PARAMETER:
                    return (_fresh_parameter, (_OWN_MAPPING, at, count, t.dtype, shape, t.requires_grad, attributes))
                return (_fresh_tensor, (_OWN_MAPPING, at, count, t.dtype, shape))
        shape_ = (t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
        if kind is _PARAMETER:
            return (_parameter, (self.source(untyped), *shape_, t.requires_grad, attributes))
        return (_tensor, (self.source(untyped), *shape_))

    def source(self, untyped: torch.UntypedStorage) -> _Call:
        """What unpickles to `untyped`'s storage: one object per storage, so that the pickler's memo
        gives every tensor on it the same storage (tied weights stay tied, views stay views)."""
        found = self.seen.get(untyped._cdata)
        if found is None:
            found = self.seen[untyped._cdata] = _Call(_storage_at, *self._place(untyped))
        elif type(found) is not _Call:  # the fresh tensor made over it: its storage
            found = self.seen[untyped._cdata] = _Call(_STORAGE_OF, found)
        return found

    def _place(self, untyped: torch.UntypedStorage, on_cpu: bool | None = None) -> tuple[Any, ...]:
        """Where `untyped` goes (`on_cpu`: whether it lies on the CPU, where the caller knows):
        ("own", None, arena offset, bytes, device), or ("ref", entry key, offset, bytes, device)."""
        if on_cpu is None:
            on_cpu = untyped.device.type == "cpu"
        if on_cpu:
            device = "cpu"
        else:
            where = untyped.device
            if where.type == "meta":
                raise PackError("a storage on the meta device cannot be cached")
            device = str(where)
            self.devices[device] = None
        nbytes = untyped.nbytes()
        if on_cpu and nbytes:
            address = untyped.data_ptr()
            staged = self.staged.get(address)
            if staged is not None and staged[1] == nbytes:
                self.own.append(Own(untyped, staged[0], nbytes, staged=True))
                return ("own", None, staged[0], nbytes, device)
            span = mappings.span_of(address)
            if span is not None and address + nbytes <= span.end and self._trusted(span, address, nbytes):
                key, offset = span.key, span.offset(address)
                self.mapped[(key, offset, nbytes, device)] = untyped
                if key == self.self_key:
                    return ("own", None, offset, nbytes, device)
                if key not in self.deps:
                    self.deps.append(key)
                return ("ref", key, offset, nbytes, device)
        offset = self.offset
        self.offset = (offset + nbytes + _PAGE - 1) // _PAGE * _PAGE  # arena.align
        self.own.append(Own(untyped, offset, nbytes))
        return ("own", None, offset, nbytes, device)

    def _trusted(self, span: mappings.Span, address: int, nbytes: int) -> bool:
        """Whether a storage in `span` still is its entry's bytes: its pages unwritten here, and the
        checkpoint file under it (if any) unchanged (Note [Mapping registry])."""
        if span.source is not None:
            intact = self.intact.get(id(span.source))
            if intact is None:
                intact = self.intact[id(span.source)] = span.source.intact()
            if not intact:
                return False
        if self.trust_mappings:
            return True
        low, high = span.extent  # asked once per mapping, not per span (Note [Finding written pages] in mappings.py)
        return not self.written.any(low, high, address, nbytes)


def _reduce_ordered_dict(hook_ids: list[int], d: collections.OrderedDict[Any, Any]) -> tuple[Any, ...]:
    """What `OrderedDict.__reduce__` returns, without its call of `copyreg._slotnames`, which a builtin
    type cannot cache (it was half of the Python time of packing a model, when every module's hook
    dicts came this way; now only those `_reduce_module` does not stand in for). The highest int key of
    a non-empty one goes to `hook_ids` (Note [Hook ids])."""
    if not d:  # most of a module's dozen OrderedDicts (hooks) are empty
        return (collections.OrderedDict, (), _attributes(d))
    ids = [k for k in d if type(k) is int]
    if ids:
        hook_ids.append(max(ids))
    return (collections.OrderedDict, (), _attributes(d), None, iter(d.items()))


# Note [Hook ids]
# A module's hooks sit in its hook dicts under the ids of their handles, which torch counts per process
# (`RemovableHandle.next_id`). A hit brings hooks with the ids of the process that loaded them; a hook
# the user then registers takes this process's next id, which may be one of those: it replaced the
# cached hook in the dict (and its handle's remove() would remove that one). torch's own unpickling moves
# the count past a handle it unpickles, but most hooks' handles are not kept. So a pack notes the highest
# int key of each non-empty OrderedDict it meets (hook dicts among them, which the pack never stands in
# for; other OrderedDicts with int keys only make the count skip ids), the entry's meta holds the next
# id ("hook_ids"), and a hit moves this process's count past it.


def _attributes(d: collections.OrderedDict[Any, Any]) -> dict[str, Any] | None:
    """`vars(d) or None`, without making `d` an instance dict where it has none, as `vars` would (Note
    [Empty hook dicts]). The collector visits an OrderedDict's instance dict first, then its keys, of
    which none is a dict (unhashable)."""
    found = gc.get_referents(d)
    return (found[0] or None) if found and type(found[0]) is dict else None


class _Dispatch(dict):  # type: ignore[type-arg]
    """A pickler's dispatch table that gives each module class `_reduce_module` when the pickler first
    meets one (the C pickler looks classes up with `__missing__`; dill's Python pickler asks with `get`,
    and pickles modules the default way), the classes of Note [What a plain pickle loses] their own
    reductions (with either pickler), and every other class the pickler's own way, `__reduce_ex__`, from
    then on without asking again (classes themselves excepted: the pickler saves those by name)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # the empty hook dicts' stand-ins this pack's modules take, each once (Note [Empty hook dicts])
        self.reduce_module = functools.partial(_reduce_module, itertools.chain(
            _HOOK_MARKERS, itertools.starmap(_EmptyHooks, itertools.repeat(()))))
        self.asked: set[type] = set()  # classes `get` found no reduction of its own for
        self.modules: set[str] = set()  # of the classes met (Note [Classes swapped in a library] in library_classes.py)

    def __missing__(self, cls: type) -> Callable[[Any], Any]:
        if issubclass(cls, type):
            raise KeyError(cls)
        self.modules.add(cls.__module__)
        if issubclass(cls, _PARAMETER) and cls.__reduce_ex__ is _PARAMETER.__reduce_ex__:
            raise PackError(f"it holds a parameter of class {cls.__qualname__}, which a pickle brings back as an "
                            "nn.Parameter (torch's reduction of a Parameter keeps no subclass)")
        found = self[cls] = (_kept_reduction(cls) or
                             (self.reduce_module if _plain_module_class(cls) else _REDUCE_EX))
        return found

    def get(self, cls: type, default: Any = None) -> Any:
        found = super().get(cls)
        if found is None and cls not in self.asked:
            self.modules.add(getattr(cls, "__module__", ""))
            found = _kept_reduction(cls) if isinstance(cls, type) and not issubclass(cls, type) else None
            if found is None:
                self.asked.add(cls)
            else:
                self[cls] = found
        return default if found is None else found


# Note [What a plain pickle loses]
# A hit leaves the process as the plain load would (docs/design.md, invariant 1), but two things of a
# loaded model or pipeline do not come through a pickle as they were:
# - transformers' GenerationConfig keeps the hash it had when loaded (`_original_object_hash`), and its
#   `save_pretrained` turns the config's warnings into errors when the hash is no longer its own: a sign
#   the user changed it. It is the hash of a string, so it is the loading process's (PYTHONHASHSEED): a
#   hit's `model.save_pretrained` refused a published config that the plain load saves (any with
#   `temperature` set and sampling off). Unchanged when packed, the config is given its own hash again
#   when rebuilt (`_set_rehashed`); changed, it keeps the old one, which still tells it was changed.
# - An object of an extension type whose state is what a native `__getstate__` gives (`tokenizers`'
#   Rust classes) keeps nothing of its instance dict through a pickle. transformers' CLIPTokenizer sets
#   `decode` on its `tokenizers.Tokenizer` so, a wrapper that strips "</w>": a hit's tokenizer (alone,
#   or in a Stable Diffusion pipeline) decoded "a</w>cat</w>" where the plain load's says "a cat". The
#   rebuild makes such an attribute again as the library makes it (`_REMADE`, by the function's name);
#   any other that would be lost makes the result uncacheable (PackError: the plain load, with the
#   reason said). Classes with a reduction of their own (exceptions, numpy's masked arrays) say what
#   their state is themselves, and are left to it.
# And one thing of the process that a load leaves: transformers' `PreTrainedModel.__init__` registers
# what its class's forward can record (`_CAN_RECORD_REGISTRY`, by class), which `output_hidden_states`,
# `output_attentions` and generate's `return_dict_in_generate` read. A rebuild runs no `__init__`, so a
# hit in a process that had built no model of that class returned None for hidden states and
# attentions, and said nothing. The rebuild registers each such class the graph names, as `__init__`
# would (`_register_recorders`): in a plain dict under `str(cls)` up to transformers 5.24 (5.17 is the GPU
# machine's), through the registry's own `__setitem__`, which takes the model, from 5.25.


def _kept_reduction(cls: type) -> Callable[[Any], Any] | None:
    """The reduction of `cls` that keeps what a plain pickle loses (Note [What a plain pickle loses]),
    where it needs one."""
    generation = getattr(sys.modules.get("transformers.generation.configuration_utils"), "GenerationConfig", None)
    if generation is not None and issubclass(cls, generation):
        return _reduce_generation_config
    # pickled by object's own reduction, with the state a native `__getstate__` gives (a pyo3 class's
    # way); a class with a reduction of its own says what its state is itself
    getstate, reduce_ex, reduce = (getattr(cls, name, None) for name in ("__getstate__", "__reduce_ex__", "__reduce__"))
    if (cls.__dictoffset__ and type(getstate) is _NATIVE_METHOD and getstate is not _OBJECT["__getstate__"]
            and reduce_ex is _OBJECT["__reduce_ex__"] and reduce is _OBJECT["__reduce__"]):
        return _reduce_native
    return None


def _reduce_generation_config(config: Any) -> tuple[Any, ...]:
    reduced: tuple[Any, ...] = config.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    state = reduced[2] if len(reduced) > 2 else None
    if (type(state) is not dict or len(reduced) > 5 or hasattr(config, "__setstate__")
            or state.get("_original_object_hash") != hash(config)):
        return reduced
    return _set_by(reduced, state, _set_rehashed)


def _set_rehashed(config: Any, state: dict[str, Any]) -> None:
    vars(config).update(state)
    config._original_object_hash = hash(config)


def _reduce_native(obj: Any) -> tuple[Any, ...]:
    reduced: tuple[Any, ...] = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    attributes = getattr(obj, "__dict__", None)
    state = reduced[2] if len(reduced) > 2 else None
    if not attributes or state is attributes or (type(state) is tuple and any(s is attributes for s in state)):
        return reduced
    remade = [_REMADE.get((name, getattr(value, "__module__", None), getattr(value, "__qualname__", None)))
              for name, value in attributes.items()]
    if None in remade or len(reduced) > 5 or not hasattr(obj, "__setstate__"):
        raise PackError(f"a {type(obj).__qualname__} holds attributes that pickling it loses ({', '.join(attributes)})")
    return _set_by(reduced, (state, tuple(remade)), _set_state_remade)


def _set_by(reduced: tuple[Any, ...], state: Any, setter: Callable[[Any, Any], None]) -> tuple[Any, ...]:
    """`reduced` (a reduction of at most five items) with `state`, which the unpickler hands to `setter`."""
    fn, args, _, items, dict_items = (*reduced, None, None, None)[:5]
    return (fn, args, state, items, dict_items, setter)


def _set_state_remade(obj: Any, state: tuple[Any, tuple[Callable[[Any], None], ...]]) -> None:
    native, remade = state
    if native is not None:
        obj.__setstate__(native)
    for remake in remade:
        remake(obj)


def _remake_clip_decode(tokenizer: Any) -> None:
    """Wrap `tokenizer.decode` as CLIPTokenizer wraps its backend tokenizer's, by its own method."""
    from transformers.models.clip.tokenization_clip import CLIPTokenizer

    owner: Any = types.SimpleNamespace(backend_tokenizer=tokenizer)  # all the method reads of its tokenizer
    CLIPTokenizer._wrap_decode_method_backend_tokenizer(owner)


_OBJECT = vars(object)
_NATIVE_METHOD = type(_OBJECT["__reduce_ex__"])
# (attribute, module, qualname of the function it holds) -> what makes it again on a rebuilt object
_REMADE: dict[tuple[str, Any, Any], Callable[[Any], None]] = {
    ("decode", "transformers.models.clip.tokenization_clip",
     "CLIPTokenizer._wrap_decode_method_backend_tokenizer.<locals>.new_decode_method"): _remake_clip_decode,
}


_REDUCE_EX = operator.methodcaller("__reduce_ex__", pickle.HIGHEST_PROTOCOL)  # what the pickler calls


def _plain_module_class(cls: type) -> bool:
    """Whether `cls` pickles as an nn.Module does by default: `object.__reduce_ex__` over
    `Module.__getstate__`, and unpickles through `Module.__setstate__`."""
    module = torch.nn.Module
    return (issubclass(cls, module) and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__ and cls.__getstate__ is module.__getstate__
            and cls.__setstate__ is module.__setstate__ and not hasattr(cls, "__getnewargs_ex__")
            and not hasattr(cls, "__getnewargs__"))


# Note [Cheap rebuild]
# A hit unpickles hundreds of modules and tensors; each Python call per object was most of its time.
# So the graph is written for the C unpickler to do nearly all of it:
# - A module is `cls.__new__(cls)` (pickle's NEWOBJ, in C), memoized before its state as pickle does (so
#   cycles through it still unpickle), then its state becomes its __dict__ through the setter of
#   nn.Module's `__dict__` attribute, called by the unpickler (`_SET_DICT`): what `_new` does, without
#   a Python frame. Module.__setstate__ would only add hook dicts that an old checkpoint lacked; a graph
#   is made by this torch (keys name its version), and `_plain_module_class` leaves every class with
#   its own __setstate__ or reduction to pickle's way. The state is a dict of the graph's own
#   (so its key strings are the graph's, as Note [References] in results.py needs), in the module's
#   order.
# - Each empty hook dict (eleven per module) stands in the state as an `_EmptyHooks`, which the
#   unpickler turns into `OrderedDict()` in C: a fresh one per module and name, as nn.Module makes them.
# - The first plain tensor met on a storage of the entry's own arena on the CPU (nearly every parameter
#   and buffer) is one Python call: `torch.frombuffer` over the arena's mapping makes the tensor and its
#   storage at once, `as_strided_` gives it its shape where it is not the whole storage flat (without
#   the storage offset where it is 0: a quarter of its cost), and a parameter is that same tensor given
#   the class Parameter, as torch's own `UninitializedParameter.materialize` turns its object into a
#   Parameter. `nn.Parameter(t)` (`_make_subclass`) would make a detached alias of `t` instead, three
#   times the cost of assigning the class and setting requires_grad; `t` is this rebuild's own, so
#   nothing else sees it change. The mapping is an argument of each call, which the graph fetches once
#   (`_OWN_MAPPING`, memoized), and a parameter's Python attributes become its __dict__ as the graph
#   made them (a dict of its own): 0.3 us less per parameter than asking the rebuild's state for the
#   mapping and copying the dict. Later tensors on that storage (views, a tensor pickled by torch's own
#   reduction) take that tensor's storage (`_STORAGE_OF`, in C); storages in other entries, on other
#   devices or of no bytes go through `_storage_at` and `_Rebuild.storage`.
# Every object the graph needs is still made and given its state: nothing is shared between modules or
# with other rebuilds. CorruptEntry's checks stay where they were (`_Rebuild.locate` for any storage
# not in the own arena's single mapping; `torch.frombuffer` refuses bytes beyond a mapping).


class _Call:
    """Pickles as the call `fn(*args)`, which the unpickler makes in C."""

    __slots__ = ("reduced",)

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.reduced = (fn, args)


class _EmptyHooks:
    """Stands, in a module's pickled state, for one of its empty hook dicts: unpickles as a new one."""

    __slots__ = ()
    reduced = (collections.OrderedDict, ())


class _SetDict:
    """A module's state setter: sets its __dict__. Pickles as the setter of nn.Module's `__dict__`
    attribute, `vars(nn.Module)["__dict__"].__set__`, which the unpickler calls in C."""

    __slots__ = ()
    reduced = (getattr, (_Call(operator.getitem, _Call(vars, torch.nn.Module), "__dict__"), "__set__"))

    def __call__(self, obj: Any, state: dict[str, Any]) -> None:
        object.__setattr__(obj, "__dict__", state)


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # (pickle's NEWOBJ; typeshed lacks it)
_reduced = operator.attrgetter("reduced")  # the dispatch entry of these three: no Python frame while packing
_SET_DICT = _SetDict()
_STORAGE_OF = torch._C.TensorBase.untyped_storage


def _reduce_module(markers: Iterator[_EmptyHooks], module: torch.nn.Module) -> tuple[Any, ...]:
    """What `object.__reduce_ex__` gives for a module, with its empty hook dicts as `_EmptyHooks` (the
    next of `markers`) and its state set by `_SET_DICT` (Note [Cheap rebuild])."""
    state = module.__getstate__()  # a copy
    try:
        hooks = _hook_dicts_of(state)
    except KeyError:
        hooks = ()
    # Note [Empty hook dicts]: all of them at once, in C, nearly always
    if (hooks and not gc.get_referents(*hooks) and not any(map(_weak_references, hooks))
            and set(map(type, hooks)) == _ORDERED_DICT_ONLY):
        state.update(zip(_HOOK_DICTS, markers, strict=False))  # (one marker a name: `markers` never ends)
    else:
        for name in _HOOK_DICTS:
            found = state.get(name)
            if (type(found) is _OrderedDict and not found and not gc.get_referents(found)
                    and not _weak_references(found)):
                state[name] = next(markers)
    return (_NEWOBJ, (type(module),), state, None, None, _SET_DICT)


# Note [Empty hook dicts]
# Eleven per module, 3,200 in a 1.1B model: each is a Python object the pickler meets, so they were half
# of the time a miss's pack spends on modules. So:
# - One stands as an `_EmptyHooks` only when it is an OrderedDict that refers to nothing: no items, and
#   no instance attributes, which would be lost. Its attributes are asked of the collector
#   (`gc.get_referents`: an OrderedDict refers to its instance dict, where it has one), for all of a
#   module's at once, and not of `vars`, which makes an empty instance dict for each OrderedDict it is
#   asked of, to keep: 3,200 dicts left to the next young collection (0.6 ms of a miss, on the clock) and
#   to the heap.
# - Nor when a hook's handle may refer to it: a handle refers to its module's hook dicts weakly
#   (`weakref.getweakrefcount`), and pickles them where it lies in the graph (PEFT's ShadowPEFT keeps its
#   handles). Stood in for, the dict would unpickle as one object in the module and another in the
#   handle, which nothing holds: the hit's handle would refer to no dict. Pickled as itself, it is one
#   object, as in the plain load. (A strong reference to a hook dict from elsewhere in the graph is not
#   looked for: nothing in torch, transformers, diffusers or PEFT keeps one.)
# - No OrderedDict is made an instance dict by a pack (`_reduce_ordered_dict` asks the collector too), so
#   the next pack of the same object stands in for the same dicts: Note [References] in results.py
#   compares the two pickles.
# - The stand-ins are made once, at import (`_HOOK_MARKERS`, enough for 512 modules; a larger model's
#   pack makes the rest), not by each pack: the pickler's memo tells objects apart by identity, so what
#   matters is that no two of one pack's hook dicts share a stand-in (each pack walks the list from its
#   start, with a memo of its own), not which objects they are.


def _new(cls: Any) -> Any:
    """A new instance whose __dict__ is its own, not one of CPython's split dicts, which take their key
    strings from the first instance of the class: so its keys are the strings of the graph, shared as
    the graph shares them, whichever objects this process unpickled or built before (Note [References]
    in results.py compares pickles, memo and all). Modules get theirs from `_SET_DICT`."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", {})
    return obj


_OrderedDict = collections.OrderedDict
_weak_references = weakref.getweakrefcount
_STRIDED, _PARAMETER, _PAGE = torch.strided, torch.nn.Parameter, arena.PAGE
_MODULE_STATE = vars(torch.nn.Module())  # what a new nn.Module holds
# A module's hook dicts: the attributes that a new nn.Module holds as empty OrderedDicts
_HOOK_DICTS = tuple(k for k, v in _MODULE_STATE.items() if type(v) is _OrderedDict and not v)
_hook_dicts_of = operator.itemgetter(*_HOOK_DICTS)  # (several: a tuple)
_ORDERED_DICT_ONLY = {_OrderedDict}
_HOOK_MARKERS = list(itertools.starmap(_EmptyHooks, itertools.repeat((), 512 * len(_HOOK_DICTS))))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Note [Argument replay]
# A load may change its arguments in place: PeftModel.from_pretrained injects LoRA layers into the base
# model it is given, load_adapter adds an adapter to the model it is called on. Such an entry is packed
# with every module of those arguments (`substitutes`: path such as "model/layers.0.mlp" -> module) reduced
# to `_argument(path, cls)` plus its state after the call. A hit rebuilds onto the caller's own argument
# objects (`arguments`: path -> object): each keeps its identity and receives the state the load gave it,
# as the plain call would have done. The tensors of those modules (`_parameters` and `_buffers`, paths
# such as "model/layers.0.mlp#weight") keep theirs too, through `_argument_tensor`: a parameter made anew
# would cut off what holds the old one (an optimizer built before the call, its `.grad`, a hook), and the
# call would train nothing, silently. Each takes the bytes, `requires_grad` and attributes the load left
# it; its own storage stays where it already is the entry's (a base model's weights, unwritten). Their
# previous state is journaled first and put back if the rebuild fails, so a failed hit leaves the
# arguments as they were for the plain load that follows. Components given by value (a scheduler, a
# feature extractor, a processor's image processor: `_COMPONENTS` in keys.py) are arguments too: the result
# holds the caller's object, which takes the state the load left it (a pipeline resets an old scheduler's
# `steps_offset` on the object it is given).


def _substituting(table: dict[type, Callable[[Any], Any]], substitutes: dict[str, Any]) -> None:
    """Make the pickler with dispatch `table` reduce each of `substitutes` (path -> object) as
    `_argument(path, cls)` plus its state. Through the dispatch table of their classes, not a
    `reducer_override`, which would be a Python call for every object of the graph."""
    paths = {id(obj): path for path, obj in substitutes.items()}
    for cls in {type(obj) for obj in substitutes.values()}:
        try:
            otherwise = table[cls]
        except KeyError:
            otherwise = None
        table[cls] = _substitute(paths, otherwise)


def _substitute(paths: dict[int, str], otherwise: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    def reduce(obj: Any) -> Any:
        reduced = otherwise(obj) if otherwise is not None else obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        path = paths.get(id(obj))
        if path is None:
            return reduced
        if isinstance(obj, torch.Tensor):  # its new value made as ever, then given to the caller's tensor
            return (_argument_tensor, (path, type(obj), reduced[0], reduced[1]), *reduced[2:])
        return (_argument, (path, type(obj)), *reduced[2:])

    return reduce


@contextlib.contextmanager
def gc_paused() -> Iterator[bool]:
    """Pickling a model graph allocates many short-lived objects, enough to trigger full collections
    of the whole heap (0.2 s with torch and transformers loaded) though almost nothing survives.
    Yields whether the collector was on (and comes back on after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield enabled
    finally:
        if enabled:
            gc.enable()


def _picklers() -> list[tuple[str, type]]:
    """The C pickler, and dill (slower, for closures and lambdas) when the C pickler fails."""
    import dill

    return [("pickle", pickle.Pickler), ("dill", dill.Pickler)]


def pack(obj: Any, *, self_key: str | None = None, trust_mappings: bool = False,
         substitutes: dict[str, Any] | None = None, stage: Stage | None = None, what: str = "") -> Packed:
    """Pickle `obj`'s graph, placing its storages; nothing is copied yet. Raises PackError.

    Args:
        obj: the object graph.
        self_key: storages inside this entry's arena are placed at their offsets there, as in the
            entry's own graph (for comparing a rebuilt object with its entry, see Note [References]
            in results.py).
        trust_mappings: skip the check that mapped pages were not written (right after a rebuild).
        substitutes: objects to pack as arguments of the call, by their path (see Note [Argument
            replay]).
        stage: the stage of the miss being packed: its ranges keep their offsets (Note [Staged
            conversions] in staging.py).
        what: what `obj` is, for PackError's message (else its type's name).
    """
    errors = []
    for name, cls in _picklers():
        buf = io.BytesIO()
        buf.write(_FORMAT.to_bytes(1, "little"))
        placer = _Placer(self_key, trust_mappings, stage)
        pickler = cls(buf, protocol=pickle.HIGHEST_PROTOCOL)
        table = placer.dispatch_table()
        if substitutes:
            _substituting(table, substitutes)
        pickler.dispatch_table = table
        try:
            with gc_paused():
                pickler.dump(obj)
        except PackError:
            raise
        except Exception as exc:  # noqa: BLE001 (any reason a graph does not pickle: try the next)
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        graph = buf.getvalue()
        if name == "dill":
            _refuse_notebook_classes(graph, what or type(obj).__name__)
        return Packed(graph, placer.own, placer.deps, placer.offset, placer.by_storage, placer.tensors, name,
                      placer.mapped, list(placer.devices), max(placer.hook_ids, default=-1) + 1, table.modules)
    raise PackError(f"{what or type(obj).__name__} cannot be pickled ({'; '.join(errors)})")


# Note [Classes of the notebook]
# dill pickles a class defined in the notebook (`__main__`) by value. A hit in another kernel then holds
# objects of a copy of that class, not of the class the notebook defines: `isinstance(x, Config)` was
# False there, where the plain call's result is a Config. So a result dill had to pack with such a class
# is not cached (PackError: the plain call, with the reason and the fix said). Functions of the notebook
# (a lambda, a closure) pickled by value are kept: nothing asks a function for its identity that way.
def _refuse_notebook_classes(data: bytes, what: str) -> None:
    if b"_create_type" not in data:  # dill's maker of a class pickled by value
        return
    main = vars(sys.modules["__main__"])
    named = sorted(name for name, value in list(main.items()) if isinstance(value, type)
                   and value.__module__ == "__main__" and value.__qualname__.encode() in data)
    if named:
        raise PackError(f"{what} holds objects of a class defined in the notebook ({', '.join(named)}), which a hit "
                        "in another kernel could only copy: isinstance against the notebook's own class would be "
                        "False there. Define the class in a module (a .py file beside the notebook) to have it cached")


# -- rebuild ---------------------------------------------------------------------------------------

_current = threading.local()


def skeleton(graph: bytes, own_key: str) -> tuple[Any, dict[str, Any]]:
    """Unpickle a packed graph over the mappings of its arenas that this process already has: the
    object as its entry holds it, sharing the live objects' bytes, with fresh placeholders for the
    call's arguments (returned as substitutes for `pack`). Packing it and packing a live object in
    this same process pickle alike exactly when the object still is what the entry holds (see Note
    [References] in results.py). Raises CorruptEntry, also when no mapping is alive."""
    state = _Rebuild(None, own_key, lambda key: None, populate=False)
    state.placeholders = {}
    obj = _unpickle(graph, state)
    return obj, state.placeholders


class _Rebuild:
    """The state of one `rebuild`: the arenas, their mappings, and the storages made so far."""

    def __init__(self, arenas: dict[str, ArenaRef] | None, own_key: str, on_unmap: Callable[[str], None],
                 populate: bool) -> None:
        self.arenas = arenas
        self.own_key = own_key
        self.on_unmap = on_unmap
        self.populate = populate
        # (entry key, None for its arena or the index of a source file) -> this rebuild's mapping of it
        self.maps: dict[tuple[str, int | None], mmap.mmap] = {}
        self.pins: dict[str, mappings.Pin] = {}
        # the entries whose pin a registered mapping holds (Note [Pins a Ctrl-C cannot leave] in loading.py)
        self.held: set[str] = set()
        self.storages: dict[tuple[str, int, int, str], torch.UntypedStorage] = {}
        self.arguments: dict[str, Any] = {}
        self.reuse: dict[tuple[str, int, int, str], torch.UntypedStorage] = {}
        # what puts back each argument the graph replays onto as it was, in the order they were met
        self.journal: list[Callable[[], None]] = []
        self.placeholders: dict[str, Any] | None = None  # skeleton mode
        # the mapping of the own arena, when it holds every byte of it (no pending pieces)
        self.own_mapping: mmap.mmap | None = None
        # a skeleton's: where an entry's bytes lie in this process's mappings, by entry key
        self.finders: dict[str, Callable[[int, int], tuple[mmap.mmap, int] | None]] = {}

    def spans(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(address, bytes) of what this rebuild's storages may lie on, and of the holes among them: an
        arena's mapping whole, its pending pieces' ranges there as holes, and the pieces in their
        checkpoint files' mappings (Note [Populate what a forward reads] in populating.py)."""
        spans, holes = [], []
        for (key, source), m in self.maps.items():
            address = mappings.address_of(m)
            pieces = self.arenas[key].pieces if self.arenas else []
            if source is None:
                spans.append((address, len(m)))
                holes += [(address + at, nbytes) for at, nbytes, _, _ in pieces]
            else:
                spans += [(address + at, nbytes) for _, nbytes, i, at in pieces if i == source]
        return spans, holes

    def argument(self, path: str, cls: type) -> Any:
        if self.placeholders is not None:
            obj = self.placeholders[path] = _new(cls)
            return obj
        obj = self._argument(path, cls)
        self.journal.append(functools.partial(_restore_attributes, obj, obj.__dict__, dict(obj.__dict__)))
        obj.__dict__.clear()  # the state after the call replaces it whole (a module's: a new __dict__)
        return obj

    def argument_tensor(self, path: str, cls: type, value: torch.Tensor) -> torch.Tensor:
        """The caller's tensor at `path`, given `value`'s bytes, `requires_grad` and attributes (Note
        [Argument replay]); a skeleton's placeholder is `value` itself."""
        if self.placeholders is not None:
            self.placeholders[path] = value
            return value
        obj: torch.Tensor = self._argument(path, cls)
        self.journal.append(functools.partial(_set_tensor, obj, obj.data, obj.requires_grad, dict(vars(obj))))
        _set_tensor(obj, value.data, value.requires_grad, vars(value))
        return obj

    def _argument(self, path: str, cls: type) -> Any:
        obj = self.arguments.get(path)
        if obj is None or type(obj) is not cls:
            raise CorruptEntry(f"the entry changes argument {path} ({cls.__qualname__}), which this call lacks")
        return obj

    def roll_back(self) -> None:
        for restore in reversed(self.journal):
            restore()

    def locate(self, key: str, offset: int, nbytes: int) -> tuple[mmap.mmap, int]:
        """A mapping that holds bytes [offset, offset + nbytes) of entry `key`, and where they start
        in it: the entry's arena, or the checkpoint file of a pending piece (Note [Pending pieces] in
        kernel_server/store.py); for a skeleton, whatever mapping of this process holds them."""
        if self.arenas is None:
            find = self.finders.get(key)
            if find is None:
                find = self.finders[key] = mappings.finder(key)
            found = find(offset, nbytes)
            if found is None:
                raise CorruptEntry(f"no live mapping of entry {key[:16]} in this process")
            return found
        ref = self.arenas.get(key)
        if ref is None:
            raise CorruptEntry(f"entry references arena {key[:16]} that the daemon did not send")
        piece = ref.piece_at(offset, nbytes)
        if piece is None:
            if offset + nbytes > ref.nbytes:
                raise CorruptEntry(f"storage at {offset}+{nbytes} lies outside arena {key[:16]} ({ref.nbytes} bytes)")
            return self._map(ref, None), offset
        at, _, source, file_offset = piece
        if source >= len(ref.sources):
            raise CorruptEntry(f"entry {key[:16]} names source {source} of {len(ref.sources)}")
        m = self._map(ref, source)
        where = file_offset + offset - at
        if where + nbytes > len(m):
            raise CorruptEntry(f"piece at {file_offset}+{nbytes} lies outside its file ({len(m)} bytes)")
        return m, where

    def _map(self, ref: ArenaRef, source: int | None) -> mmap.mmap:
        m = self.maps.get((ref.key, source))
        if m is not None:
            return m
        # Note [Pins a Ctrl-C cannot leave] in loading.py
        return mappings.uninterrupted(self._map_now, ref, source)

    def _map_now(self, ref: ArenaRef, source: int | None) -> mmap.mmap:
        pin = self.pins.get(ref.key)
        if pin is None:
            pin = self.pins[ref.key] = mappings.Pin(ref.key, self.on_unmap)
        if source is None:
            m = arena.map_private(ref.fd, ref.nbytes, parts=ref.parts)
            mappings.register(m, ref.key, pin, arena_file=mappings.ArenaFile(
                os.dup(ref.fd), not ref.pieces, tuple(p.dup() for p in ref.parts)))
        else:
            src = ref.sources[source]
            m = arena.map_private(src.fd, src.identity["size"])
            mappings.register(m, ref.key, pin, [(file_offset, nbytes, offset) for offset, nbytes, i, file_offset
                                                in ref.pieces if i == source], source=src.dup())
        self.held.add(ref.key)  # its mappings unpin it from here on
        self.maps[(ref.key, source)] = m
        return m

    def storage(self, kind: str, key: str | None, offset: int, nbytes: int, device: str) -> torch.UntypedStorage:
        key = self.own_key if kind == "own" else key
        if not isinstance(key, str):
            raise CorruptEntry(f"bad storage reference {kind!r}, {key!r}")
        ident = (key, offset, nbytes, device)
        found = self.storages.get(ident)
        if found is None and kind == "ref":
            found = self.reuse.get(ident)
        if found is not None:
            return found
        if nbytes:
            m, at = self.locate(key, offset, nbytes)
            untyped = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=at).untyped_storage()
        else:
            untyped = torch.UntypedStorage(0)
        if device != "cpu":
            untyped = untyped.to(device=torch.device(device))
        self.storages[ident] = untyped
        return untyped


def _state() -> _Rebuild:
    state: _Rebuild | None = getattr(_current, "rebuild", None)
    if state is None:
        raise CorruptEntry("an overmind graph can only be loaded by rebuild()")
    return state


def _argument(path: str, cls: type) -> Any:
    """Called by the unpickler for an argument of the call (see Note [Argument replay])."""
    return _state().argument(path, cls)


def _argument_tensor(path: str, cls: type, make: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
    """Called by the unpickler for a tensor of an argument of the call: `make(*args)` is its value after
    the call, which the caller's own tensor takes (see Note [Argument replay])."""
    return _state().argument_tensor(path, cls, make(*args))


def _restore_attributes(obj: Any, attributes: dict[str, Any], saved: dict[str, Any]) -> None:
    attributes.clear()
    attributes.update(saved)
    object.__setattr__(obj, "__dict__", attributes)


def _set_tensor(obj: torch.Tensor, data: torch.Tensor, requires_grad: bool, attributes: dict[str, Any]) -> None:
    """Make `obj`, the very object, hold `data` (kept where it is those elements already), with
    `requires_grad` and `attributes`."""
    if not _same_view(obj, data):
        obj.data = data
    obj.requires_grad_(requires_grad)
    vars(obj).clear()
    vars(obj).update(attributes)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements of the same bytes."""
    return (a.dtype == b.dtype and a.device == b.device and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def _storage_at(kind: str, key: str | None, offset: int, nbytes: int, device: str) -> torch.UntypedStorage:
    """Called by the unpickler for a storage that no fresh tensor made (see `_Placer.source`)."""
    return _state().storage(kind, key, offset, nbytes, device)


def _typed(untyped: torch.UntypedStorage, dtype: str | None) -> torch.storage.TypedStorage:
    """Called by the unpickler for each storage that torch's own reduction of a tensor, or the graph,
    holds. Tensors of the newer dtypes pickle an UntypedStorage, and their rebuild (torch's own
    _rebuild_tensor_v3) expects it wrapped, as torch.load does, as bytes."""
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=getattr(torch, dtype or "uint8"), _internal=True)


def _tensor(untyped: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: tuple[int, ...],
            stride: tuple[int, ...]) -> torch.Tensor:
    """Called by the unpickler for a plain tensor on a storage made before (see Note [Plain tensors])."""
    return torch.empty((0,), dtype=dtype, device=untyped.device).set_(untyped, offset, size, stride)


def _parameter(untyped: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: tuple[int, ...],
               stride: tuple[int, ...], requires_grad: bool, attributes: dict[str, Any] | None) -> torch.nn.Parameter:
    """Called by the unpickler for a parameter on a storage made before (see Note [Plain tensors])."""
    return _as_parameter(_tensor(untyped, dtype, offset, size, stride), requires_grad, attributes)


def _as_parameter(tensor: torch.Tensor, requires_grad: bool, attributes: dict[str, Any] | None) -> torch.nn.Parameter:
    """`tensor`, a new one of this rebuild, made the parameter `nn.Parameter(tensor, requires_grad)` would
    make (Note [Cheap rebuild]), with the parameter's Python attributes."""
    tensor.__class__ = _Parameter
    if requires_grad:
        tensor.requires_grad_()
    if attributes:
        # The graph's own dict, made for this tensor alone; not setattr, which interns each name and so
        # changes which strings the object shares (Note [References] in results.py compares pickles, memo
        # and all)
        tensor.__dict__ = attributes
    return tensor  # type: ignore[return-value]  # (its class is Parameter now)


_Shape = tuple[Any, ...] | None  # size and stride, and the storage offset where it is not 0; or None: flat


def _own_mapping() -> mmap.mmap | None:
    """Called by the unpickler once per graph: the mapping of the own arena, when it holds every byte
    of it, which `_fresh_tensor` and `_fresh_parameter` are then given (Note [Cheap rebuild])."""
    return _state().own_mapping


_OWN_MAPPING = _Call(_own_mapping)


def _fresh_tensor(mapping: mmap.mmap | None, at: int, count: int, dtype: torch.dtype, shape: _Shape) -> torch.Tensor:
    """Called by the unpickler for the first tensor on a storage of the entry's own arena: the tensor
    and its storage of `count` elements at arena offset `at`, in one call (Note [Cheap rebuild])."""
    if mapping is None:  # a skeleton, or an arena with pending pieces
        state = _state()
        mapping, at = state.locate(state.own_key, at, count * dtype.itemsize)
    tensor = _frombuffer(mapping, dtype=dtype, count=count, offset=at)
    if shape is not None:
        tensor.as_strided_(*shape)
    return tensor


def _fresh_parameter(mapping: mmap.mmap | None, at: int, count: int, dtype: torch.dtype, shape: _Shape,
                     requires_grad: bool, attributes: dict[str, Any] | None) -> torch.nn.Parameter:
    """`_fresh_tensor`, as a parameter (`_as_parameter`): written out in this one frame, since nearly
    every tensor of a model comes this way (Note [Cheap rebuild])."""
    if mapping is None:
        state = _state()
        mapping, at = state.locate(state.own_key, at, count * dtype.itemsize)
    tensor = _frombuffer(mapping, dtype=dtype, count=count, offset=at)
    if shape is not None:
        tensor.as_strided_(*shape)
    tensor.__class__ = _Parameter  # as `_as_parameter` does
    if requires_grad:
        tensor.requires_grad_()
    if attributes:
        tensor.__dict__ = attributes  # the graph's, and not setattr: see `_as_parameter`
    return tensor  # type: ignore[return-value]


_frombuffer = torch.frombuffer
_Parameter = torch.nn.Parameter


# Note [Plain tensors]
# A strided tensor of a classic dtype, not on the meta device and without conjugate or negative bit, is
# packed as its storage's placement, dtype, offset, size and stride; a parameter also with requires_grad
# and its Python attributes (transformers sets some). Like torch's own reduction, a parameter's backward
# hooks are not kept. Any other tensor (a subclass, a plain tensor that requires grad or carries
# attributes or hooks, a quantized or sparse one, the newer dtypes) goes through torch's `__reduce_ex__`,
# whose storage is placed by the dispatch table's storage entries. torch's reduction is a dozen Python
# calls per tensor: it was half the time of packing a model.
_ATOMIC = frozenset({bool, int, float, str, type(None)})
_PLAIN_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
})


# Note [Globals]
# The graph names about twenty globals (the model's classes, torch's, this module's functions), and
# pickle's own `find_class` imports each through `__import__`: it asks the module for its `__spec__` and
# whether it is still initializing, every time. In a forked process (a warm kernel, benchmarks/load.py)
# each of those first touches writes a reference count on a page still shared with the parent (perf
# found about a dozen of a 1.1B hit's copy-on-write faults there, 5 us each here), on top of the import
# machinery's calls (0.1 ms of a 0.1B rebuild in a warm process). `_Unpickler` takes a global straight
# from its module in `sys.modules`, and leaves everything else to pickle: a module not imported yet
# (code in the checkpoint, Note [Code in the checkpoint] in dynamic_modules.py), a dotted name, a name
# the module lacks (one still initializing in another thread, where pickle waits for its import).
#
# Note [dill's globals]
# A graph the C pickler could not pickle is pickled by dill (`_picklers`), which names three globals of
# its own: the dict of `__main__` (the globals of a function defined in a notebook, pickled by value),
# NoneType, and its old module name. Only dill's unpickler knew them, so every hit of such an entry
# failed ("No module named '__builtin__'"), was evicted, and the next call missed again. `_Unpickler`
# resolves them as dill's unpickler does: `__main__` is this process's (the kernel's namespace).
_DILLS = {("__builtin__", "NoneType"): type(None)}


class _Unpickler(pickle.Unpickler):
    """pickle's C unpickler, with globals taken from the modules already imported (Note [Globals]), and
    dill's own (Note [dill's globals]). `classes`: the classes the graph named."""

    def __init__(self, source: io.BytesIO) -> None:
        super().__init__(source)
        self.classes: list[type] = []

    def find_class(self, module_name: str, name: str) -> Any:
        found = self._find_class(module_name, name)
        if isinstance(found, type):
            self.classes.append(found)
        return found

    def _find_class(self, module_name: str, name: str) -> Any:
        if module_name == "__builtin__" or module_name == "dill.dill":
            if (module_name, name) == ("__builtin__", "__main__"):
                return sys.modules["__main__"].__dict__
            if (module_name, name) in _DILLS:
                return _DILLS[module_name, name]
            module_name = "dill._dill" if module_name == "dill.dill" else module_name
        module = sys.modules.get(module_name)
        if module is None or "." in name:
            return super().find_class(module_name, name)
        sys.audit("pickle.find_class", module_name, name)  # as pickle's own does, before the lookup
        found = getattr(module, name, _MISSING)
        return found if found is not _MISSING else super().find_class(module_name, name)


_MISSING = object()


def _unpickle(graph: bytes, state: _Rebuild) -> Any:
    if not graph or graph[0] != _FORMAT:
        raise CorruptEntry(f"graph format {graph[:1]!r} is not {_FORMAT}; evict the entry")
    outer = getattr(_current, "rebuild", None)
    _current.rebuild = state
    try:
        with gc_paused():
            source = io.BytesIO(graph)  # shares the bytes (read-only), no copy
            source.seek(1)
            unpickler = _Unpickler(source)
            rebuilt = unpickler.load()
        _register_recorders(unpickler.classes)
        return rebuilt
    except (CorruptEntry, NoRoomHere):
        state.roll_back()
        raise
    except BaseException as exc:
        state.roll_back()
        if not isinstance(exc, Exception):
            raise
        raise _failure(exc, "cannot rebuild the cached object") from exc
    finally:
        _current.rebuild = outer


def _register_recorders(classes: list[type]) -> None:
    """Register the transformers models among `classes` as their `__init__` would (Note [What a plain
    pickle loses])."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    model = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if not isinstance(registry, dict) or not isinstance(model, type):
        return
    for cls in classes:
        if issubclass(cls, model) and str(cls) not in registry:
            recorded = getattr(cls, "_can_record_outputs", None)
            if type(registry).__setitem__ is dict.__setitem__:
                registry[str(cls)] = recorded  # transformers < 5.25: a plain dict, keyed by str(cls) by hand
            else:  # its own registry, which keys a model by str(model.__class__): an object never initialised
                registry[cls.__new__(cls)] = recorded


# What this process ran short of, not what the entry holds: the entry stays (NoRoomHere)
_SHORTAGES = (errno.ENOMEM, errno.EMFILE, errno.ENFILE)


def _failure(exc: Exception, what: str) -> CorruptEntry | NoRoomHere:
    """What a rebuild that raised `exc` raises: NoRoomHere where this process ran short of memory,
    address space (a mapping refused under `ulimit -v`), descriptors or a device's memory; else
    CorruptEntry, which evicts the entry."""
    message = f"{what}: {type(exc).__name__}: {exc}"
    if descriptors.exhausted(exc):  # Note [Descriptor budget] in kernel_server/descriptors.py
        return NoRoomHere(f"{message}; {descriptors.short_here(exc)}")
    if (isinstance(exc, MemoryError | torch.OutOfMemoryError)
            or (isinstance(exc, OSError) and exc.errno in _SHORTAGES)):
        return NoRoomHere(message)
    return CorruptEntry(message)


def rebuild(graph: bytes, arenas: dict[str, ArenaRef], own_key: str, *,
            on_unmap: Callable[[str], None] = lambda key: None, held: set[str] | None = None,
            populate: bool = True, arguments: dict[str, Any] | None = None,
            reuse: dict[tuple[str, int, int, str], torch.UntypedStorage] | None = None) -> Any:
    """Unpickle a packed graph over private mappings of `arenas` (keyed by entry key; `own_key` is the
    entry's own). `on_unmap(key)` runs once per entry when the last storage over its mappings is gone;
    the keys of those entries are added to `held` as each is mapped, and the caller unpins the others,
    however the rebuild ends (Note [Pins a Ctrl-C cannot leave] in loading.py). `arguments` are the
    call's objects by path (see Note [Argument replay]); `reuse` are storages of other entries this
    process holds unwritten (`Packed.mapped`), taken instead of mapping their arenas again. Raises
    CorruptEntry, also when a checkpoint file of a pending piece is no longer the one the entry was made
    from, and NoRoomHere where this process ran short of what the rebuild takes."""
    for ref in arenas.values():
        for src in ref.sources:
            if not src.intact():
                raise CorruptEntry(f"checkpoint file {src.path} changed since it was cached, or cannot be read")
    state = _Rebuild(arenas, own_key, on_unmap, populate)
    if held is not None:
        state.held = held
    state.arguments = arguments or {}
    state.reuse = reuse or {}
    own = arenas.get(own_key)
    if own is not None and own.nbytes and not own.pieces:
        try:
            state.own_mapping = state._map(own, None)
        except (OSError, ValueError) as exc:  # an arena shorter than the entry says, unreadable, or no room
            raise _failure(exc, f"cannot map the arena of entry {own_key[:16]}") from exc
    obj = _unpickle(graph, state)
    if populate and state.maps:  # in the background (Note [Populate what a forward reads] in populating.py)
        spans, holes = state.spans()
        populating.populate_ahead(spans, obj, holes)
    return obj
