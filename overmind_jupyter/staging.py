"""Converted weights written once, straight into the new entry's arena.

# Note [Staged conversions]
A load that converts dtypes (a bf16 checkpoint loaded as fp32 or fp16) writes every converted byte into
fresh memory; publishing then copied it into the arena, so each byte was written and faulted twice and the
miss cost 2.1-2.7x the plain load (benchmarks/RESULTS.md, issue 39). Instead, while a miss loads, each
conversion is written into the new arena (the *stage*) and the tensor the library gets is a private
mapping of what was written; publishing only moves those tensors onto the arena's own private mapping
(Note [Atomic miss] in publishing.py), and copies nothing of them:
- Where: transformers (5.x) makes every checkpoint tensor in `core_model_loading.spawn_materialize`, in the
  loading thread (the conversion itself may run in its thread pool). While a miss loads, a wrapper of it
  stages a conversion on the CPU of a tensor that goes to the model as it is (no `tensor_idx`: no
  WeightConverter merges it with others). Everything else goes the library's way: same-dtype tensors
  (pieces of the checkpoint, nothing written; told by the slice's dtype, before it is read), devices,
  sharding, merged weights. A library without that function (diffusers, transformers 4) stages nothing:
  its converted weights are copied at publish.
- How: a chunk at a time (8 MiB) into a buffer each converting thread reuses, then `pwrite` into the file
  (page cache; for a memfd, shmem). Measured against a shared writable mapping of the file, which takes a
  write fault per page or folio (0.2-1.7 s for 512 MiB on these VMs against 0.15 s for pwrite, RESULTS.md).
  No writable shared mapping of the arena ever exists in the kernel: a tensor of the load that user code
  keeps outside the result (a `.data` alias) is a private mapping, whose writes stay in this process.
- Into a memfd per converting thread (up to four, transformers' pool), laid out one after the other in
  the arena once the load is done: the first is the arena's own file, the others its parts (Note [Arena
  parts] in kernel_server/arena.py). A write into a memfd holds its lock, and the write (allocating the
  shmem pages) is most of the work: 1 GiB of bf16 -> fp32 took 0.35 s by one thread's pwrites against
  0.07 s for the conversion alone, so two threads writing into one memfd took 0.32-0.36 s, into two
  memfds 0.20-0.24 s, into anonymous memory (the plain load) 0.23-0.28 s (benchmarks/stage_writes.py,
  RESULTS.md issue 39). A file arena (the user's `OVERMIND_ARENA=file`) stays one file.
- Which backing: a memfd (shmem), unless the user chose `OVERMIND_ARENA=file`. A file arena on a disk
  filesystem takes the converted gigabytes as dirty page cache, and past the kernel's dirty limits
  (vm.dirty_ratio: 20% of memory) the writer is throttled to the disk's speed: a 1.1B fp32 miss took
  10.5 s against plain's 1.3 s into a file, 2.0 s into a memfd. The price is the hit's first forward,
  which takes 4 KiB shmem pages instead of a file's large folios (0.77 s against 0.60 s for call and
  first forward of that model: Note [Arena backing] in kernel_server/arena.py; RESULTS.md, issue 39).
  So a miss that converted nothing (a load in the stored dtype) lets the stage go, and its arena is any
  other miss's, as the setting says: a file where "auto" finds a disk.
- Every load alike: transformers imports `core_model_loading` with `modeling_utils`, which an Auto class
  imports only inside its first `from_pretrained`. Without it there is nothing to wrap, and a process's
  first converting miss went into a file, its later ones into a memfd. So the miss of an Auto model class
  that finds transformers imported and not that module imports it before the load; its time counts as the
  load's (Note [Miss times] in progress.py), which would have spent it. No other miss imports it: a
  tokenizer's, a pipeline's or a function's of the user's would not (0.6 s here).
- Whose load: a context variable set by the miss and read in the thread that calls `spawn_materialize`, so
  a load in another thread of the user meanwhile goes the library's way.
- Room: the stage grows in ranges, each reserved with the daemon first (the budget, and the disk where the
  stage is a file, as a publish's reservation: Note [Disk room] in kernel_server/disk.py) and, for a file
  arena, with fallocate.
  A refusal stages nothing more: the rest of the load converts into fresh memory and is copied at publish.
- A staged range the entry does not hold, and no tensor refers to any more, is given back as a hole
  (FALLOC_FL_PUNCH_HOLE); one still referred to stays, unused, in the arena.
- A load that raises, or a result that is not published, keeps its tensors on the stage's file, which
  only this process holds: memory of this process alone, as the plain load's would be, freed with its last
  tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kernel_server import arena
from kernel_server.client import ANSWER_TIMEOUT, Client
from kernel_server.errors import DaemonError
from kernel_server.operations import Op

if TYPE_CHECKING:
    from .progress import MissClock

__all__ = ["Stage", "new_arena", "staged"]

_log = logging.getLogger(__name__)

_GRANULE = 256 << 20  # the stage is reserved with the daemon this much ahead
_CHUNK = 8 << 20  # converted into a reused buffer this much at a time, then written
_FILES = 4  # files a stage writes into at most, one per converting thread (transformers runs up to 4)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

_ACTIVE: ContextVar[Stage | None] = ContextVar("overmind_stage", default=None)
_MATERIALIZE_PARAMETERS = ("thread_pool", "tensor", "device", "dtype", "sharding_op", "tensor_idx")


def new_arena(nbytes: int, key: str, home: str | os.PathLike[str], backing: str) -> arena.ArenaWriter:
    """The arena of a new entry, backed as `backing` says (Note [Arena backing] in kernel_server/arena.py);
    a file arena that cannot be made (no O_TMPFILE there, a full disk) falls back to a memfd."""
    name = f"overmind:{key[:12]}"
    if backing != "memfd":
        directory = arena.arena_directory(home)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if arena.choose_backing(backing, directory) == "file":
                return arena.ArenaWriter(nbytes, name=name, backing="file", directory=directory)
        except OSError as exc:
            if backing == "file":
                raise
            _log.info("file arena in %s failed (%s); using a memfd", directory, exc)
    return arena.ArenaWriter(nbytes, name=name, backing="memfd")


class _File:
    """One file of a stage: its writer, and how much of it the stage handed out (page-aligned)."""

    def __init__(self, writer: arena.ArenaWriter) -> None:
        self.writer = writer
        self.top = 0


class Stage:
    """The arena of the entry a miss is loading, written by the load's conversions (Note [Staged
    conversions]): a file per converting thread, each sparse and as large as the physical memory
    (nothing is taken until written). Once the load is done, `top` lays the files out one after the other
    in the arena (the first is the arena's own file, the others its parts: Note [Arena parts] in
    kernel_server/arena.py) and `finish` cuts each to its size."""

    def __init__(self, client: Client, key: str, home: str | os.PathLike[str], backing: str) -> None:
        self._client, self._key = client, key
        self.capacity = arena.align(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        first = new_arena(self.capacity, key, home, backing)
        self._files = [_File(first)]
        # a file per thread where the arena is a memfd; a file arena (the user's choice) stays one file
        self._most_files = _FILES if first.backing == "memfd" else 1
        self._lock = threading.Lock()
        self._threads = threading.local()  # each converting thread's chunk buffer and file, reused
        self._seen = 0  # converting threads so far
        self._used = 0  # the sum of the files' tops
        self._reserved = 0  # what the daemon (and fallocate) reserved
        self._stopped = False
        self.converted = False  # whether the load converted a tensor on the CPU (staged or not)
        self._starts_in_arena: list[int] | None = None  # where each file lies in the arena, once laid out
        # (file, offset) -> (bytes, the view its tensor is made on: alive while any tensor of the range is)
        self._ranges: dict[tuple[_File, int], tuple[int, weakref.ref[memoryview]]] = {}
        self._starts: dict[int, tuple[_File, int]] = {}  # the address of each range's mapping -> where it is

    @property
    def writer(self) -> arena.ArenaWriter:
        """The arena's own file."""
        return self._files[0].writer

    @property
    def top(self) -> int:
        """The end of the staged ranges in the arena. The first look lays the files out and stops the
        stage: the load is done."""
        return self._layout()[-1] + self._files[-1].top

    def _layout(self) -> list[int]:
        """Where each file lies in the arena: one after the other, in the order they were made."""
        with self._lock:
            self._stopped = True
            if self._starts_in_arena is None:
                self._starts_in_arena, at = [], 0
                for f in self._files:
                    self._starts_in_arena.append(at)
                    at += f.top
            return self._starts_in_arena

    def convert(self, tensor: Any, dtype: torch.dtype,
                fallback: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`tensor` (a checkpoint slice) as `dtype` on the CPU, written into the stage if it has room;
        else `fallback(tensor)` (the library's own conversion)."""
        src = tensor[...]
        if src.device.type != "cpu" or src.dtype == dtype or not src.is_contiguous():
            return fallback(src)
        self.converted = True
        try:
            out = self._write(src, dtype)
            if out is not None:
                return out
        except Exception as exc:  # noqa: BLE001 (never worse: the library's own conversion instead)
            _log.info("staging a tensor of %s failed (%s); it converts as the library does", self._key[:12], exc)
        return fallback(src)

    def _write(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Convert `src` a chunk at a time into this thread's buffer and write each chunk into this
        thread's file; the result is a private mapping of what was written (None: no room)."""
        nbytes = dtype.itemsize * src.numel()
        file = self._file()
        at = self._take(file, nbytes)
        if at is None:
            return None
        buffer: torch.Tensor = self._threads.chunk
        flat, step = src.reshape(-1), _CHUNK // dtype.itemsize
        for start in range(0, flat.numel(), step):
            part = flat[start:start + step]
            converted = buffer[:part.numel() * dtype.itemsize].view(dtype)
            converted.copy_(part)
            chunk = memoryview(converted.view(torch.uint8).numpy())  # type: ignore[arg-type]  # a buffer
            _pwrite_all(file.writer.fd, chunk, at + start * dtype.itemsize)
        mapping = arena.map_private(file.writer.fd, arena.align(nbytes), offset=at)
        view = memoryview(mapping)[:nbytes]
        out = torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(src.shape)
        with self._lock:
            self._ranges[(file, at)] = (nbytes, weakref.ref(view))
            self._starts[out.data_ptr()] = (file, at)
        return out

    def _file(self) -> _File:
        """This thread's file: the arena's own for the first converting thread, a new one for each
        next, up to `_FILES` (then they take turns)."""
        file: _File | None = getattr(self._threads, "file", None)
        if file is not None:
            return file
        with self._lock:
            self._seen += 1
            seen = self._seen
            if seen == 1 or len(self._files) >= self._most_files:
                file = self._files[(seen - 1) % len(self._files)]
            else:
                writer = arena.ArenaWriter(self.capacity, name=f"overmind:{self._key[:12]}:{seen - 1}")
                file = _File(writer)
                self._files.append(file)
        self._threads.file = file
        self._threads.chunk = torch.empty(_CHUNK, dtype=torch.uint8)
        return file

    def _take(self, file: _File, nbytes: int) -> int | None:
        """The offset in `file` of a new range of `nbytes`, reserved; None once the stage stopped."""
        with self._lock:
            if self._stopped or not nbytes:
                return None
            at = file.top
            end = arena.align(at + nbytes)
            used = self._used + end - at
            if used > self._reserved and not self._reserve(used):
                return None
            file.top, self._used = end, used
            return at

    def _reserve(self, end: int) -> bool:
        """Reserve the stage up to at least `end` bytes (lock held), a granule ahead where that fits without
        evicting an entry (Note [Reserving ahead] in kernel_server/store.py); False stops the staging."""
        ahead = min(self.capacity, max(end, self._reserved + _GRANULE))
        for want, evict in ((ahead, False), (end, True)) if ahead > end else ((end, True),):
            if end > self.capacity:
                break
            try:
                self._client.request(Op.RESERVE, key=self._key, bytes=want, descriptors=1 + len(self._files),
                                     backing=self.writer.backing, evict=evict, timeout=ANSWER_TIMEOUT)
                if self.writer.backing == "file":  # one file: Note [Staged conversions]
                    os.posix_fallocate(self.writer.fd, self._reserved, want - self._reserved)
            except (DaemonError, OSError) as exc:
                _log.info("the stage of %s cannot grow to %d bytes: %s", self._key[:12], want, exc)
                continue
            self._reserved = want
            return True
        self._stopped = True
        return False

    def placed(self) -> dict[int, tuple[int, int]]:
        """Where each range this stage wrote lies in the arena, by the address of its tensors' mapping:
        (arena offset, bytes). The files are laid out by then: the load is done."""
        starts = dict(zip(self._files, self._layout(), strict=True))
        with self._lock:
            return {address: (starts[file] + at, self._ranges[(file, at)][0])
                    for address, (file, at) in self._starts.items()}

    def finish(self, nbytes: int) -> tuple[arena.ArenaWriter, list[tuple[arena.ArenaWriter, int]]]:
        """The arena's writer, cut to the entry's `nbytes` (the staged ranges first, then what
        publishing copies), and each further file's writer, cut to its size, with where it lies in the
        arena (its parts: Note [Arena parts] in kernel_server/arena.py)."""
        assert nbytes >= self.top
        first = self._files[0].writer
        os.ftruncate(first.fd, nbytes)
        first.nbytes = nbytes
        parts = []
        for file, at in zip(self._files[1:], self._layout()[1:], strict=True):
            if file.top:
                os.ftruncate(file.writer.fd, file.top)
                file.writer.nbytes = file.top
                parts.append((file.writer, at))
        return first, parts

    def give_back(self, kept: set[int]) -> None:
        """Free the ranges the entry does not hold (`kept`: arena offsets) and no tensor refers to any
        more (an intermediate of a weight conversion): holes in the files."""
        starts = dict(zip(self._files, self._layout(), strict=True))
        for (file, at), (nbytes, view) in self._ranges.items():
            if starts.get(file, -1) + at not in kept and view() is None and _libc.fallocate(
                    file.writer.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, at, nbytes):
                _log.info("cannot punch a hole in the arena: %s", os.strerror(ctypes.get_errno()))

    def close(self) -> None:
        """Let go of the stage's files; tensors still on them keep their mappings (and its memory) alive."""
        for file in self._files:
            file.writer.close()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = data.cast("B")
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


@contextlib.contextmanager
def staged(client: Client, key: str, home: str | Path, backing: str,
           clock: MissClock | None = None) -> Iterator[Stage | None]:
    """While the body loads the miss of `key` in this thread (and publishes it), conversions on the CPU
    write into a `Stage` (yielded; None where the loader has no place to stage: Note [Staged
    conversions]). The stage is let go of at the end; its tensors keep what they need of it. `clock`: for
    the miss of an Auto model class, whose load would import transformers' loading module: it is imported
    first, and that load gets its time (same Note)."""
    module = _loading_module(clock)
    if module is None or not _wrappable(module):
        yield None
        return
    try:
        stage = Stage(client, key, home, "memfd" if backing == "auto" else backing)
    except OSError as exc:
        _log.info("no stage for %s: %s", key[:12], exc)
        yield None
        return
    token = _ACTIVE.set(stage)
    try:
        with _wrapped(module):
            yield stage
    finally:
        _ACTIVE.reset(token)
        stage.close()


def _loading_module(clock: MissClock | None) -> Any:
    """transformers' module that makes checkpoint tensors; imported first for the miss of an Auto model
    class (`clock` given) where transformers is imported and it is not (Note [Staged conversions]: every
    load alike); None where there is none."""
    module = sys.modules.get("transformers.core_model_loading")
    if module is not None or clock is None or "transformers" not in sys.modules:
        return module
    started = time.perf_counter()
    try:
        module = importlib.import_module("transformers.core_model_loading")
    except Exception as exc:  # noqa: BLE001 (transformers 4 has none; nothing is staged then, as ever)
        _log.info("no transformers.core_model_loading to stage conversions in: %s", exc)
        return None
    finally:
        if clock is not None:
            clock.load_s += time.perf_counter() - started
    return module


_wrap_lock = threading.Lock()
_wrap_users = 0


def _wrappable(module: Any) -> bool:
    function = getattr(module, "spawn_materialize", None)
    if getattr(function, "__overmind_original__", None) is not None:
        return True
    if not callable(function) or not callable(getattr(module, "_materialize_copy", None)):
        return False
    return tuple(inspect.signature(function).parameters) == _MATERIALIZE_PARAMETERS


@contextlib.contextmanager
def _wrapped(module: Any) -> Iterator[None]:
    """`module.spawn_materialize` wrapped while any staged load runs; the original afterwards."""
    global _wrap_users
    with _wrap_lock:
        if not _wrap_users:
            module.spawn_materialize = _wrapper(module, module.spawn_materialize)
        _wrap_users += 1
    try:
        yield
    finally:
        with _wrap_lock:
            _wrap_users -= 1
            if not _wrap_users:
                module.spawn_materialize = module.spawn_materialize.__overmind_original__


# safetensors' names of the dtypes a load converts to
_SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64"}


def _of_dtype(tensor: Any, dtype: torch.dtype) -> bool:
    """Whether `tensor` (a checkpoint slice, not read yet, or a tensor) is of `dtype` already, so that
    the library's own way takes it as it is (a same-dtype load: the stage has nothing to write)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype == dtype
    get_dtype = getattr(tensor, "get_dtype", None)  # safetensors' slice
    return get_dtype is not None and get_dtype() == _SAFETENSORS_NAMES.get(dtype)


def _wrapper(module: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    def spawn_materialize(thread_pool: Any, tensor: Any, device: Any = None, dtype: Any = None,
                          sharding_op: Any = None, tensor_idx: Any = None) -> Any:
        stage = _ACTIVE.get()
        if (stage is None or sharding_op is not None or dtype is None or not (device is None or str(device) == "cpu")
                or _of_dtype(tensor, dtype)):
            return original(thread_pool, tensor, device, dtype, sharding_op=sharding_op, tensor_idx=tensor_idx)

        def job() -> torch.Tensor:
            return stage.convert(tensor, dtype, lambda src: module._materialize_copy(src, device, dtype))

        return thread_pool.submit(job) if thread_pool is not None else job

    spawn_materialize.__overmind_original__ = original  # type: ignore[attr-defined]
    return spawn_materialize
