"""Pack an object graph into an arena, and rebuild it from one zero-copy and copy-on-write.

`pack` pickles the graph with a dispatch table that replaces every torch storage by a reference: to a
place in the new arena (the bytes are copied there by `write_arena`), or, when the storage already is
a mapping of another entry's arena whose pages this process has not written, to that entry's bytes
(so a base model inside a PeftModel, or a vae inside a pipeline, is stored once). Storages are
deduplicated by identity, so tied weights stay tied and views keep their storage offsets.
`rebuild` maps the arenas MAP_PRIVATE and creates each storage over its bytes with `torch.frombuffer`:
no tensor is copied, and writes stay in this process (see Note [Copy-on-write mappings] in
kernel_server/arena.py).

Only storages, tensors, modules and OrderedDicts go through Python hooks while pickling (a per-type
dispatch table, looked up in C), so a 1.1B-parameter model's graph pickles in a few milliseconds.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copyreg
import gc
import io
import mmap
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kernel_server import arena

from .errors import CorruptEntry, PackError

__all__ = ["ArenaRef", "Packed", "entry_of", "map_storages", "pack", "rebuild", "skeleton", "write_arena"]

_FORMAT = 3  # bump when the storage or tensor references change


@dataclass
class _Own:
    storage: torch.UntypedStorage
    offset: int
    nbytes: int


@dataclass
class Packed:
    """The result of `pack`: the graph, the storages to copy, and the entries referenced."""

    graph: bytes
    own: list[_Own]
    deps: list[str]
    arena_bytes: int
    tensors: list[tuple[torch.Tensor, int]] = field(repr=False)
    pickler: str = "pickle"
    # storages that lie, unwritten, in entries' arenas: (entry key, offset, bytes, device) -> storage
    mapped: dict[tuple[str, int, int, str], torch.UntypedStorage] = field(default_factory=dict, repr=False)

    def unchanged(self) -> bool:
        """True if no tensor of the graph was written in place since `pack` (version counters)."""
        return all(t._version == v for t, v in self.tensors)


@dataclass
class ArenaRef:
    """One arena to map for a rebuild: its entry key, descriptor and size."""

    key: str
    fd: int
    nbytes: int


# -- the registry of live arena mappings ---------------------------------------------------------

# Note [Mapping registry]
# Every private mapping this process made of an entry's arena is recorded as (start address, end,
# entry key). `pack` uses it to recognise storages that already live in an entry; `rebuild` adds to
# it; a mapping leaves it when its last storage dies (the finalizer of the mmap object).
_registry_lock = threading.Lock()
_starts: list[int] = []
_spans: list[tuple[int, int, str]] = []
_by_key: dict[str, list[weakref.ref[mmap.mmap]]] = {}


def _register(mapping: mmap.mmap, key: str, on_release: Callable[[], None]) -> int:
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    span = (start, start + len(mapping), key)
    ref = weakref.ref(mapping)
    with _registry_lock:
        i = bisect.bisect(_starts, start)
        _starts.insert(i, start)
        _spans.insert(i, span)
        _by_key.setdefault(key, []).append(ref)

    def release() -> None:
        with _registry_lock:
            if span in _spans:
                i = _spans.index(span)
                del _starts[i]
                del _spans[i]
            refs = _by_key.get(key, [])
            if ref in refs:
                refs.remove(ref)
            if not refs:
                _by_key.pop(key, None)
        on_release()

    weakref.finalize(mapping, release)
    return start


def _live_mapping(key: str) -> mmap.mmap | None:
    with _registry_lock:
        for ref in _by_key.get(key, []):
            m = ref()
            if m is not None:
                return m
    return None


def _span_of(address: int) -> tuple[int, int, str] | None:
    with _registry_lock:
        i = bisect.bisect(_starts, address) - 1
        if i < 0:
            return None
        span = _spans[i]
    return span if span[0] <= address < span[1] else None


def entry_of(address: int) -> tuple[str, int] | None:
    """(entry key, offset in its arena) of an address inside a registered mapping."""
    span = _span_of(address)
    return None if span is None else (span[2], address - span[0])


class _WrittenPages:
    """Which pages of registered mappings this process wrote (private copies), read from
    /proc/self/pagemap once per mapping: present pages that are no longer the file's."""

    def __init__(self) -> None:
        self._sums: dict[int, Any] = {}  # numpy arrays, or None for a mapping without a written page

    def any(self, span: tuple[int, int, str], address: int, nbytes: int) -> bool:
        start, end, _ = span
        try:
            sums = self._sums[start]
        except KeyError:
            page = arena.PAGE
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                raw = os.pread(f.fileno(), (end - start) // page * 8, start // page * 8)
            entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
            written = ((entries >> 63) & 1) & (1 - ((entries >> 61) & 1))
            # numpy, not torch, for the lookups below: indexing a tensor costs ~20 us, an array ~0.1 us
            sums = torch.cat([torch.zeros(1, dtype=torch.int64), written.cumsum(0)]).numpy()
            sums = self._sums[start] = sums if sums[-1] else None
        if sums is None:
            return False
        first = (address - start) // arena.PAGE
        last = (address + nbytes - 1 - start) // arena.PAGE
        return bool(sums[last + 1] - sums[first])


# -- pack ------------------------------------------------------------------------------------------


class _Placer:
    """Assigns each storage met while pickling its reference, and records tensors' versions."""

    def __init__(self, self_key: str | None, trust_mappings: bool) -> None:
        self.self_key = self_key
        self.trust_mappings = trust_mappings
        self.written = _WrittenPages()
        self.mapped: dict[tuple[str, int, int, str], torch.UntypedStorage] = {}
        self.offset = 0
        self.own: list[_Own] = []
        self.seen: dict[int, tuple[Any, ...]] = {}
        self.deps: list[str] = []
        self.tensors: list[tuple[torch.Tensor, int]] = []

    def dispatch_table(self) -> dict[type, Callable[[Any], Any]]:
        table = _Dispatch(copyreg.dispatch_table)
        table[torch.storage.TypedStorage] = lambda s: (_storage, (*self.place(s._untyped_storage), _dtype(s.dtype)))
        table[torch.UntypedStorage] = lambda s: (_storage, (*self.place(s), None))
        table[torch.Tensor] = self.tensor
        table[torch.nn.Parameter] = self.tensor
        table[collections.OrderedDict] = _reduce_ordered_dict
        return table

    def tensor(self, t: torch.Tensor) -> Any:
        self.tensors.append((t, t._version))
        kind = type(t)
        if (t.layout is torch.strided and not t.is_meta and t.dtype in _PLAIN_DTYPES and not t.is_conj() and not t.is_neg()
                and (kind is torch.nn.Parameter or not (t.requires_grad or t._backward_hooks or vars(t)))):
            # Note [Plain tensors]
            placed = self.place(t.untyped_storage())
            shape = (t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
            if kind is torch.nn.Parameter:
                return (_parameter, (*placed, *shape, t.requires_grad, vars(t) or None))
            return (_tensor, (*placed, *shape))
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)

    def place(self, untyped: torch.UntypedStorage) -> tuple[Any, ...]:
        ident = untyped._cdata
        found = self.seen.get(ident)
        if found is None:
            found = self.seen[ident] = self._place(untyped)
        return found

    def _place(self, untyped: torch.UntypedStorage) -> tuple[Any, ...]:
        if untyped.device.type == "meta":
            raise PackError("a storage on the meta device cannot be cached")
        nbytes = untyped.nbytes()
        device = str(untyped.device)
        if untyped.device.type == "cpu" and nbytes:
            address = untyped.data_ptr()
            span = _span_of(address)
            if span is not None and (self.trust_mappings or not self.written.any(span, address, nbytes)):
                key, offset = span[2], address - span[0]
                self.mapped[(key, offset, nbytes, device)] = untyped
                if key == self.self_key:
                    return ("own", None, offset, nbytes, device)
                if key not in self.deps:
                    self.deps.append(key)
                return ("ref", key, offset, nbytes, device)
        offset = self.offset
        self.offset = arena.align(offset + nbytes)
        self.own.append(_Own(untyped, offset, nbytes))
        return ("own", None, offset, nbytes, device)


def _reduce_ordered_dict(d: collections.OrderedDict[Any, Any]) -> tuple[Any, ...]:
    """What `OrderedDict.__reduce__` returns, without its call of `copyreg._slotnames`, which a builtin
    type cannot cache (it was half of the Python time of packing a model, when every module's hook
    dicts came this way; now those of modules `_reduce_module` does not take)."""
    if not d:  # most of a module's dozen OrderedDicts (hooks) are empty
        return (collections.OrderedDict, (), vars(d) or None)
    return (collections.OrderedDict, (), vars(d) or None, None, iter(d.items()))


class _Dispatch(dict):  # type: ignore[type-arg]
    """A pickler's dispatch table that gives each module class `_reduce_module` when the pickler first
    meets one (the C pickler looks classes up with `__missing__`; dill's Python pickler does not, and
    pickles modules the default way)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.others: set[type] = set()

    def __missing__(self, cls: type) -> Callable[[Any], Any]:
        if cls not in self.others and _plain_module_class(cls):
            self[cls] = _reduce_module
            return _reduce_module
        self.others.add(cls)
        raise KeyError(cls)


def _plain_module_class(cls: type) -> bool:
    """Whether `cls` pickles as an nn.Module does by default: `object.__reduce_ex__` over
    `Module.__getstate__`, and unpickles through `Module.__setstate__`."""
    module = torch.nn.Module
    return (issubclass(cls, module) and cls.__reduce_ex__ is object.__reduce_ex__
            and cls.__reduce__ is object.__reduce__ and cls.__getstate__ is module.__getstate__
            and cls.__setstate__ is module.__setstate__ and not hasattr(cls, "__getnewargs_ex__")
            and not hasattr(cls, "__getnewargs__"))


def _reduce_module(module: torch.nn.Module) -> tuple[Any, ...]:
    """What `object.__reduce_ex__` gives for a module, except that its empty hook dicts (eleven
    OrderedDicts per module) are named instead of pickled: each was a Python call while packing."""
    full = module.__getstate__()
    state = {k: v for k, v in full.items() if not (type(v) is _OrderedDict and not v and k in _HOOKS and not vars(v))}
    dropped = len(full) - len(state)
    empty = _HOOK_DICTS if dropped == len(_HOOK_DICTS) else tuple(k for k in full if k not in state)
    return (_module, (type(module), empty), state)


def _module(cls: Any, empty: tuple[str, ...]) -> Any:
    """Called by the unpickler for each module: a new one with its empty hook dicts (its state follows),
    in a __dict__ of its own (see `_new`). Set there directly: through Module.__setattr__ they cost more
    to unpickle than they saved to pickle."""
    return _new(cls, {name: _OrderedDict() for name in empty})


def _new(cls: Any, attributes: dict[str, Any] | None = None) -> Any:
    """A new instance whose __dict__ (`attributes`, else empty) is its own, not one of CPython's split
    dicts, which take their key strings from the first instance of the class: so its keys are the
    strings of the graph, shared as the graph shares them, whichever objects this process unpickled or
    built before (Note [References] in loading.py compares pickles, memo and all)."""
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", {} if attributes is None else attributes)
    return obj


_OrderedDict = collections.OrderedDict
# A module's hook dicts: the attributes that a new nn.Module holds as empty OrderedDicts
_HOOK_DICTS = tuple(k for k, v in vars(torch.nn.Module()).items() if type(v) is _OrderedDict and not v)
_HOOKS = frozenset(_HOOK_DICTS)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Note [Argument replay]
# A load may change its arguments in place: PeftModel.from_pretrained injects LoRA layers into the base
# model it is given, load_adapter adds an adapter to the model it is called on. Such an entry is packed
# with every module of those arguments (`substitutes`: path such as "model/layers.0.mlp" -> module) reduced
# to `_argument(path, cls)` plus its state after the call. A hit rebuilds onto the caller's own argument
# objects (`arguments`: path -> object): each keeps its identity and receives the state the load gave it,
# as the plain call would have done. Their previous state is journaled first and put back if the
# rebuild fails, so a failed hit leaves the arguments as they were for the plain load that follows.


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
        empty = reduced[1][1] if reduced[0] is _module else ()
        return (_argument, (path, type(obj), empty), *reduced[2:])

    return reduce


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pickling a model graph allocates many short-lived objects, enough to trigger full collections
    of the whole heap (0.2 s with torch and transformers loaded) though almost nothing survives."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _picklers() -> list[tuple[str, type]]:
    """The C pickler, and dill (slower, for closures and lambdas) when the C pickler fails."""
    import dill

    return [("pickle", pickle.Pickler), ("dill", dill.Pickler)]


def pack(obj: Any, *, self_key: str | None = None, trust_mappings: bool = False,
         substitutes: dict[str, Any] | None = None) -> Packed:
    """Pickle `obj`'s graph, placing its storages; nothing is copied yet. Raises PackError.

    Args:
        obj: the object graph.
        self_key: storages inside this entry's arena are placed at their offsets there, as in the
            entry's own graph (for comparing a rebuilt object with its entry, see Note [References]
            in loading.py).
        trust_mappings: skip the check that mapped pages were not written (right after a rebuild).
        substitutes: objects to pack as arguments of the call, by their path (see Note [Argument
            replay]).
    """
    errors = []
    for name, cls in _picklers():
        buf = io.BytesIO()
        buf.write(_FORMAT.to_bytes(1, "little"))
        placer = _Placer(self_key, trust_mappings)
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
        return Packed(buf.getvalue(), placer.own, placer.deps, placer.offset, placer.tensors, name, placer.mapped)
    raise PackError(f"{type(obj).__name__} cannot be pickled ({'; '.join(errors)})")


_CHUNK = 64 << 20


_WRITERS = min(4, os.cpu_count() or 1)


def _main_thread_idle(quiet: float = 0.05) -> Callable[[], bool]:
    """A test for `ArenaWriter.copy_from`'s helpers: true once the main thread has used no CPU time for
    `quiet` seconds, however many helpers ask and however often. A kernel's main thread runs its cells,
    and each fill thread stalls a core on every fresh page it touches (SCHED_IDLE does not help while
    the core waits on the host): with two fill threads from the start, a 1.1B bf16 miss took 4.9-8.1 s
    for its call + first forward instead of about 1.5 s in 4 of 8 runs (benchmarks/RESULTS.md). So the
    first thread starts at once, the others when the kernel is idle (between cells, or waiting)."""
    path = f"/proc/self/task/{threading.main_thread().native_id}/stat"
    last: tuple[int, float] | None = None  # the main thread's CPU time, and since when it has not moved

    def idle() -> bool:
        nonlocal last
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            used = int(fields[11]) + int(fields[12])  # utime and stime, in clock ticks
        except (OSError, IndexError, ValueError):
            return True  # no main thread any more, or no /proc: nothing to protect
        now = time.monotonic()
        if last is None or last[0] != used:
            last = (used, now)
            return False
        return now - last[1] >= quiet

    return idle


def write_arena(packed: Packed, writer: arena.ArenaWriter, stop: threading.Event | None = None) -> None:
    """Copy the packed storages into the new arena; raises PackError if `stop` is set meanwhile (the
    process is exiting). CPU bytes go straight from the storages, without torch (no parallel region
    competing with the kernel's own work, Note [Publishing yields]): into a file arena from several
    threads through a mapping, into a memfd by pwrite (Note [Filling an arena] in kernel_server/arena.py)."""
    rest = packed.own
    if writer.backing == "file":
        rest = [own for own in packed.own if own.storage.device.type != "cpu"]
        try:
            writer.copy_from([(own.offset, own.storage.data_ptr(), own.nbytes) for own in packed.own
                              if own.nbytes and own.storage.device.type == "cpu"],
                             threads=_WRITERS, helpers_may_start=_main_thread_idle(), stop=stop)
        except InterruptedError:
            raise PackError("the process is exiting") from None
    for own in rest:
        if not own.nbytes:
            continue
        src = torch.empty(0, dtype=torch.uint8, device=own.storage.device).set_(own.storage)
        whole = memoryview(src.numpy()) if src.device.type == "cpu" else None
        for start in range(0, own.nbytes, _CHUNK):
            if stop is not None and stop.is_set():
                raise PackError("the process is exiting")
            chunk = whole[start:start + _CHUNK] if whole is not None else memoryview(
                src[start:start + _CHUNK].cpu().numpy())
            writer.write(own.offset + start, chunk)
        del whole, src


def map_storages(packed: Packed, ref: ArenaRef, on_unmap: Callable[[str], None]) -> dict[int, torch.UntypedStorage]:
    """Storages over a private mapping of the arena `packed` was published to, by the identity
    (`_cdata`) of the storage each replaces."""
    if not ref.nbytes:
        return {}
    m = arena.map_private(ref.fd, ref.nbytes)
    _register(m, ref.key, lambda: on_unmap(ref.key))
    return {
        own.storage._cdata: torch.frombuffer(m, dtype=torch.uint8, count=own.nbytes, offset=own.offset).untyped_storage()
        for own in packed.own if own.nbytes
    }


# -- rebuild ---------------------------------------------------------------------------------------

_current = threading.local()


def skeleton(graph: bytes, own_key: str) -> tuple[Any, dict[str, Any]]:
    """Unpickle a packed graph over the mappings of its arenas that this process already has: the
    object as its entry holds it, sharing the live objects' bytes, with fresh placeholders for the
    call's arguments (returned as substitutes for `pack`). Packing it and packing a live object in
    this same process pickle alike exactly when the object still is what the entry holds (see Note
    [References] in loading.py). Raises CorruptEntry, also when no mapping is alive."""
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
        self.maps: dict[str, mmap.mmap] = {}
        self.starts: dict[str, int] = {}
        self.storages: dict[tuple[str, int, int, str], torch.UntypedStorage] = {}
        self.arguments: dict[str, Any] = {}
        self.reuse: dict[tuple[str, int, int, str], torch.UntypedStorage] = {}
        self.journal: list[tuple[Any, dict[str, Any]]] = []
        self.placeholders: dict[str, Any] | None = None  # skeleton mode

    def argument(self, path: str, cls: type) -> Any:
        if self.placeholders is not None:
            obj = self.placeholders[path] = _new(cls)
            return obj
        obj = self.arguments.get(path)
        if obj is None or type(obj) is not cls:
            raise CorruptEntry(f"the entry changes argument {path} ({cls.__qualname__}), which this call lacks")
        self.journal.append((obj, dict(obj.__dict__)))
        obj.__dict__.clear()  # the state after the call replaces it whole
        return obj

    def roll_back(self) -> None:
        for obj, saved in reversed(self.journal):
            obj.__dict__.clear()
            obj.__dict__.update(saved)

    def mapping(self, key: str) -> mmap.mmap:
        m = self.maps.get(key)
        if m is None and self.arenas is None:
            m = _live_mapping(key)
            if m is None:
                raise CorruptEntry(f"no live mapping of arena {key[:16]} in this process")
            self.maps[key] = m
        if m is None:
            ref = self.arenas.get(key)
            if ref is None:
                raise CorruptEntry(f"entry references arena {key[:16]} that the daemon did not send")
            m = arena.map_private(ref.fd, ref.nbytes)
            # The finalizer must not reach `self`, which holds the mapping: it would never run, and the
            # entry would stay pinned and mapped after the last of its tensors is gone.
            on_unmap = self.on_unmap
            self.starts[key] = _register(m, key, lambda: on_unmap(key))
            self.maps[key] = m
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
            m = self.mapping(key)
            if offset + nbytes > len(m):
                raise CorruptEntry(f"storage at {offset}+{nbytes} lies outside arena {key[:16]} ({len(m)} bytes)")
            untyped = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()
        else:
            untyped = torch.UntypedStorage(0)
        if device != "cpu":
            untyped = untyped.to(device=torch.device(device))
        self.storages[ident] = untyped
        return untyped


def _argument(path: str, cls: type, empty: tuple[str, ...]) -> Any:
    """Called by the unpickler for an argument of the call (see Note [Argument replay]); `empty`
    names its empty hook dicts, as for `_module`."""
    state: _Rebuild | None = getattr(_current, "rebuild", None)
    if state is None:
        raise CorruptEntry("an overmind graph can only be loaded by rebuild()")
    obj = state.argument(path, cls)
    obj.__dict__.update({name: _OrderedDict() for name in empty})
    return obj


def _storage(kind: str, key: str | None, offset: int, nbytes: int, device: str, dtype: str | None) -> Any:
    """Called by the unpickler for each storage reference (see `_Placer`)."""
    state: _Rebuild | None = getattr(_current, "rebuild", None)
    if state is None:
        raise CorruptEntry("an overmind graph can only be loaded by rebuild()")
    untyped = state.storage(kind, key, offset, nbytes, device)
    # Tensors of the newer dtypes pickle an UntypedStorage, and their rebuild (torch's own
    # _rebuild_tensor_v3) expects it wrapped, as torch.load does, as bytes.
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=getattr(torch, dtype or "uint8"), _internal=True)


def _tensor(kind: str, key: str | None, at: int, nbytes: int, device: str, dtype: torch.dtype, offset: int,
            size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """Called by the unpickler for each plain tensor (see Note [Plain tensors])."""
    state: _Rebuild | None = getattr(_current, "rebuild", None)
    if state is None:
        raise CorruptEntry("an overmind graph can only be loaded by rebuild()")
    untyped = state.storage(kind, key, at, nbytes, device)
    return torch.empty((0,), dtype=dtype, device=untyped.device).set_(untyped, offset, size, stride)


def _parameter(kind: str, key: str | None, at: int, nbytes: int, device: str, dtype: torch.dtype, offset: int,
               size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool,
               attributes: dict[str, Any] | None) -> torch.nn.Parameter:
    """Called by the unpickler for each parameter (see Note [Plain tensors])."""
    param = torch.nn.Parameter(_tensor(kind, key, at, nbytes, device, dtype, offset, size, stride), requires_grad)
    if attributes:
        # Not setattr, which interns each name and so changes which strings the object shares
        # (Note [References] in loading.py compares pickles, memo and all)
        param.__dict__.update(attributes)
    return param


# Note [Plain tensors]
# A strided tensor of a classic dtype, not on the meta device and without conjugate or negative bit, is
# packed as its storage's placement, dtype, offset, size and stride; a parameter also with requires_grad
# and its Python attributes (transformers sets some). Like torch's own reduction, a parameter's backward
# hooks are not kept. Any other tensor (a subclass, a plain tensor that requires grad or carries
# attributes or hooks, a quantized or sparse one, the newer dtypes) goes through torch's `__reduce_ex__`,
# whose storage is placed by the dispatch table's storage entries. torch's reduction is a dozen Python
# calls per tensor: it was half the time of packing a model.
_PLAIN_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
})


def _unpickle(graph: bytes, state: _Rebuild) -> Any:
    if not graph or graph[0] != _FORMAT:
        raise CorruptEntry(f"graph format {graph[:1]!r} is not {_FORMAT}; evict the entry")
    outer = getattr(_current, "rebuild", None)
    _current.rebuild = state
    try:
        with gc_paused():
            return pickle.loads(graph[1:])
    except CorruptEntry:
        state.roll_back()
        raise
    except BaseException as exc:
        state.roll_back()
        if not isinstance(exc, Exception):
            raise
        raise CorruptEntry(f"cannot rebuild the cached object: {type(exc).__name__}: {exc}") from exc
    finally:
        _current.rebuild = outer


def rebuild(graph: bytes, arenas: dict[str, ArenaRef], own_key: str, *,
            on_unmap: Callable[[str], None] = lambda key: None, populate: bool = True,
            arguments: dict[str, Any] | None = None,
            reuse: dict[tuple[str, int, int, str], torch.UntypedStorage] | None = None) -> Any:
    """Unpickle a packed graph over private mappings of `arenas` (keyed by entry key; `own_key` is the
    entry's own). `on_unmap(key)` runs once per mapping when its last storage is gone; for arenas the
    graph does not use, at once. `arguments` are the call's objects by path (see Note [Argument
    replay]); `reuse` are storages of other entries this process holds unwritten (`Packed.mapped`),
    taken instead of mapping their arenas again."""
    state = _Rebuild(arenas, own_key, on_unmap, populate)
    state.arguments = arguments or {}
    state.reuse = reuse or {}
    obj = _unpickle(graph, state)
    for key in arenas:
        if key not in state.maps:
            on_unmap(key)
        elif populate:
            arena.populate(state.starts[key], len(state.maps[key]))
    return obj
