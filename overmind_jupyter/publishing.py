"""Publishing a miss: the loaded result becomes a cache entry inside the loading call, before it returns.

# Note [Atomic miss]
Every byte another kernel will see is fixed before the loading call returns to user code, or comes
from a source user code cannot reach (docs/design.md, invariant 3):
- A storage that lies, unwritten, in a private mapping of a file (a same-dtype safetensors load: its
  parameters are views of `model.safetensors`) is a *piece*: the entry records where in the arena it
  belongs and where in which file it is now, and the kernel hands the daemon a read-only descriptor of
  the file with its identity. Nothing is copied; the daemon checks the identity before every hit and
  copies the pieces into an arena of its own later, reading only the file (kernel_server/compaction.py,
  Note [Pending pieces] in kernel_server/store.py).
- Every other storage (a dtype conversion, a randomly initialised head, buffers computed at init) is
  copied into the new arena here, and its tensors are moved at once onto a private mapping of the arena
  (so that the copy's source is freed while the next pieces are copied: Note [Filling an arena] in
  kernel_server/arena.py).
- The pieces' tensors lie on a private mapping of their file that the registry holds (Note [Mapping
  registry] in mappings.py): the one the load made through us (Note [Files the load maps] in
  load_maps.py), registered as it is; or else they are moved onto this module's own private mapping of
  the file (the same page cache pages: no copy). Either while the daemon takes the publish: every byte
  of the entry is fixed by then.
So when the call returns, the result is backed by private, copy-on-write mappings of the entry or of its
checkpoint files, in this kernel as in every other, and the entry is already servable: no thread reads
the result afterwards, nothing moves a tensor later, and a write by any route (`.data`, a fused
optimizer, numpy, ctypes, `merge_and_unload`) stays in this process. A restart or a kill of this kernel
after the call loses nothing. Nothing here reads tensor version counters.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernel_server import arena, descriptors
from kernel_server.client import ANSWER_TIMEOUT, Client
from kernel_server.errors import DaemonError, RemoteError
from kernel_server.operations import Op
from kernel_server.payloads import MissTimes

from . import mappings, progress, rebuild, staging, threads
from .errors import PublishError
from .load_maps import LoadMap

__all__ = ["publish", "publish_marker"]

_log = logging.getLogger(__name__)

_WRITERS = min(2, os.cpu_count() or 1)
_MAX_SOURCES = 32  # more files than this are copied instead (a reply's descriptors are limited)
_CHUNK = 64 << 20
# What a miss may write before the publish reserves it (Note [Reserved at publish] in kernel_server/store.py):
# into memory (its graph, a memfd arena's copies), and into a file arena (a same-dtype load's buffers: KiB)
_UNRESERVED = 8 << 20
_UNRESERVED_ON_DISK = 1 << 20
_PROGRESS_BYTES = 256 << 20  # copies at least this large show a progress bar
# The fallback kind of a publish the daemon refused, by its error code (any other failure: "publish").
_REFUSALS = {"budget_exceeded": "budget", "descriptors_exhausted": "descriptors"}


@dataclass
class _Source:
    path: str
    fd: int
    identity: dict[str, int]
    mapping: mmap.mmap | None  # the load's own mapping of the file, where it made one through us
    pieces: list[tuple[rebuild.Own, int]] = field(default_factory=list)  # (storage, file offset)


@dataclass
class _Plan:
    copies: list[rebuild.Own]
    sources: list[_Source]
    staged: list[rebuild.Own]  # in the arena already (Note [Staged conversions] in staging.py)

    def made(self) -> dict[str, int]:
        """How the entry's bytes are made, in bytes: written by the load into the arena (`staged`),
        copied here (`copied`), read later from the checkpoint files by the daemon (`pieces`); and, once
        published, in how many files its arena lies (`files`: Note [Arena parts] in kernel_server/arena.py)."""
        return {"staged": sum(own.nbytes for own in self.staged), "copied": sum(own.nbytes for own in self.copies),
                "pieces": sum(own.nbytes for s in self.sources for own, _ in s.pieces)}


def publish(client: Client, key: str, label: str, describe: Callable[[], dict[str, Any]], packed: rebuild.Packed,
            *, backing: str, unpin: Callable[[str], None], clock: progress.MissClock, watch: Sequence[str] = (),
            stage: staging.Stage | None = None, load_maps: Sequence[LoadMap] = (),
            meanwhile: Callable[[], None] | None = None) -> MissTimes:
    """Make `packed` (the graph of a result just loaded) the entry `key`, moving the result's tensors
    onto private mappings of it (Note [Atomic miss]). `describe()` gives the entry's meta; it runs while
    the daemon answers the arena's reservation (Note [Reserved while described]). `watch`: the checkpoint
    paths the load read, for the daemon to drop the entry once they are gone (Note [Orphaned entries] in
    kernel_server/store.py).
    `stage`: the arena the load's conversions were written into, if `packed` was packed with it (Note
    [Staged conversions] in staging.py). `load_maps`: the files the load mapped through us (Note [Files
    the load maps] in load_maps.py). `clock`: the miss's, whose times the publish carries and
    this returns (Note [Miss times] in progress.py). `meanwhile` runs while the daemon answers, last
    (Note [A miss's collections] in loading.py). Raises PublishError
    (with a `kind` for fallbacks): the result is then still correct, only not cached."""
    plan = _plan(packed, load_maps)
    by_storage = _tensors_by_storage(packed)
    made = plan.made()
    pin = mappings.Pin(key, unpin)
    pin.hold()  # until the end of this call: released with no mapping made, it unpins at once
    forget: list[Callable[[], None]] = []
    published = on_disk = False
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())  # for the moves (`_move`)
            for src in plan.sources:
                stack.callback(os.close, src.fd)
            try:
                if stage is not None and not stage.converted:
                    stage = None  # converted nothing: the backing the setting says (Note [Staged conversions])
                staged_arena, staged_parts = stage.finish(packed.arena_bytes) if stage is not None else (None, [])
                if staged_arena is None:  # (nothing written yet: a file takes no disk before it is)
                    staged_arena = staging.new_arena(packed.arena_bytes, key, client.home, backing)
                data = stack.enter_context(contextlib.closing(staged_arena))
                on_disk = data.backing == "file"
                for writer, _ in staged_parts:
                    stack.enter_context(contextlib.closing(writer))
                reserved = _reserve_first(client, key, packed, made["copied"], data.backing,
                                          2 + len(staged_parts) + len(plan.sources))
                meta = _described(describe, reserved) | {"made": made}
                parts = [arena.Part(writer.seal(), at, writer.nbytes) for writer, at in staged_parts]
                meta["made"]["files"] = 1 + len(parts)
                private = (arena.map_private(data.fd, packed.arena_bytes, parts=parts)
                           if packed.arena_bytes else None)
                whole = None
                if private is not None:
                    whole = _storage_of(private)
                    # read-only descriptors: the arena is still being written here (Note [Device copies])
                    read_only = [os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
                                 for fd in (data.fd, *(p.fd for p in parts))]
                    forget.append(mappings.register(private, key, pin, arena_file=mappings.ArenaFile(
                        read_only[0], complete=not plan.sources,
                        parts=tuple(arena.Part(fd, p.offset, p.nbytes) for fd, p in zip(read_only[1:], parts,
                                                                                         strict=True)))))
                    for own in plan.staged:
                        _move_onto(whole, own, by_storage)
                if stage is not None:
                    stage.give_back({own.offset for own in plan.staged})
                # unreserved, the copies' tensors move once the publish is taken (Note [Reserved at publish])
                unmoved = _fill(data, plan.copies, whole if reserved is not None else None, label, by_storage)
                graph = stack.enter_context(contextlib.closing(
                    arena.ArenaWriter(len(packed.graph), name=f"overmind-graph:{key[:12]}")))
                graph.write(0, packed.graph)  # (pwrite: half the time of a copy through a mapping)
                times = clock.times()  # as the publish is sent: the call returns right after
                reply = client.send(
                    Op.PUBLISH, key=key, fds=[graph.seal(), data.seal(), *(p.fd for p in parts),
                                              *(s.fd for s in plan.sources)],
                    times=times, parts=[p.describe() for p in parts],
                    graph_bytes=len(packed.graph), arena_bytes=packed.arena_bytes, meta=meta, deps=packed.deps,
                    sources=[{"path": s.path, **s.identity} for s in plan.sources],
                    pieces=[[own.offset, own.nbytes, i, at]
                            for i, s in enumerate(plan.sources) for own, at in s.pieces],
                    pin=True, watch=_identities(watch), timeout=ANSWER_TIMEOUT)
                try:  # while the daemon takes the entry (every byte of it fixed by now: Note [Atomic miss])
                    for src in plan.sources:
                        try:
                            forget.append(_remap(src, key, pin, by_storage))
                        except OSError as exc:  # no mapping to be had: the tensors stay on the library's own
                            _log.info("cannot map %s again (%s); its tensors stay where the load put them",
                                      src.path, exc)
                    if meanwhile is not None:
                        meanwhile()
                finally:
                    reply()
                published = True
                _move_all(whole, unmoved, by_storage)
            except (DaemonError, OSError) as exc:
                _abandon(client, key)
                kind = _REFUSALS.get(exc.code, "publish") if isinstance(exc, RemoteError) else "publish"
                said = f"{exc}; {descriptors.short_here(exc)}" if descriptors.exhausted(exc) else str(exc)
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) and on_disk:
                    said = (
                        f"no room on the disk for its arena: writing to {arena.arena_directory(client.home)} "
                        f"failed ({exc.strerror}); free disk space there, or put the arenas elsewhere "
                        "(OVERMIND_ARENA_DIR) and restart the daemon (`overmind-daemon stop`)")
                raise PublishError(kind, said) from exc
    finally:
        if not published:
            for undo in forget:
                undo()
        pin.release()
    return times


def _reserve_first(client: Client, key: str, packed: rebuild.Packed, copied: int, backing: str,
                   descriptors: int) -> Callable[[], Any] | None:
    """Send the reservation of the entry's room and `descriptors` (graph, arena, one per part and per
    source: Note [Descriptor budget] in kernel_server/descriptors.py) where the miss writes more than a
    little before its publish; its reply, to wait for. Else None: the publish reserves it all, the few
    KiB or MiB written first (Note [Reserved at publish] in kernel_server/store.py)."""
    written_first = copied if backing == "file" else copied + len(packed.graph)  # (the graph is a memfd's)
    if written_first <= (_UNRESERVED_ON_DISK if backing == "file" else _UNRESERVED):
        return None
    return client.send(Op.RESERVE, key=key, bytes=packed.arena_bytes + len(packed.graph), descriptors=descriptors,
                       backing=backing, timeout=ANSWER_TIMEOUT)


# Note [Reserved while described]
# A miss that writes more than a few MiB into its arena (`_reserve_first`) reserves it with the daemon
# first, one round trip (0.6-0.7 ms for a file arena here), and the entry's meta (the digest of the
# library classes its graph binds, the modules it needs, its spellings: 0.5-1 ms) is the kernel's own
# work: it runs while the daemon answers. Nothing is written into the arena and no tensor moves before the
# answer, so a refused reservation leaves what it left before (Note [Reserved at publish] in
# kernel_server/store.py).
def _described(describe: Callable[[], dict[str, Any]], reserved: Callable[[], Any] | None) -> dict[str, Any]:
    """`describe()`, while the daemon answers `reserved` (if any), whose answer is then waited for: a
    refusal is raised, also where `describe` raised (the reply is never left unread)."""
    try:
        meta = describe()
    except BaseException:
        if reserved is not None:
            with contextlib.suppress(DaemonError):
                reserved()
        raise
    if reserved is not None:
        reserved()
    return meta


def _identities(paths: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.append({"path": path, "dev": st.st_dev, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns})
    return out


def publish_marker(client: Client, key: str, meta: dict[str, Any]) -> None:
    """Make `key` (whose load this connection holds) an entry without bytes, that only says what `meta`
    says (a load whose result depends on the random generators: Note [Random loads] in randomness.py)."""
    try:
        client.request(Op.RESERVE, key=key, bytes=1, backing="memfd", timeout=ANSWER_TIMEOUT)
        graph, data = arena.ArenaWriter(1, name=f"overmind-marker:{key[:12]}"), arena.ArenaWriter(0)
        try:
            graph.view[:] = b"\0"
            client.request(Op.PUBLISH, key=key, fds=[graph.seal(), data.seal()], graph_bytes=1, arena_bytes=0,
                           meta=meta, marker=True, timeout=ANSWER_TIMEOUT)
        finally:
            graph.close()
            data.close()
    except (DaemonError, OSError) as exc:
        raise PublishError("publish", str(exc)) from exc


def _plan(packed: rebuild.Packed, load_maps: Sequence[LoadMap]) -> _Plan:
    """Which storages are pieces of files (unwritten private file mappings, Note [Atomic miss]) and
    which are copied; `load_maps`: the mappings the load made through us, known without asking (those
    still alive: a mapping gone may have left its addresses to another)."""
    live = [(m.file, mapping) for m in load_maps if (mapping := m.mapping()) is not None]
    maps = mappings.ProcessMaps([file for file, _ in live])  # which answers with these very objects
    ours = {id(file): mapping for file, mapping in live}
    written = mappings.WrittenPages()
    sources: dict[tuple[int, int], _Source | None] = {}
    copies: list[rebuild.Own] = []
    staged: list[rebuild.Own] = []
    # the last file mapping found, and whether none of its pages was written: a load's storages lie in
    # a few mappings, one after the other
    last: mappings.FileMapping | None = None
    last_clean = False
    for own in packed.own:
        storage = own.storage
        assert storage is not None
        if own.staged:
            staged.append(own)
            continue
        found = None
        if storage.device.type == "cpu" and own.nbytes:
            address = storage.data_ptr()
            fm = last
            if fm is not None and fm.start <= address and address + own.nbytes <= fm.end:
                if not last_clean and written.any(fm.start, fm.end, address, own.nbytes):
                    fm = None
            else:
                fm = mappings.file_mapping_of(maps, written, address, own.nbytes)
                if fm is not None:
                    last, last_clean = fm, not written.any(fm.start, fm.end, fm.start, fm.end - fm.start)
            if fm is not None:
                if (fm.dev, fm.ino) not in sources:
                    sources[(fm.dev, fm.ino)] = _open_source(fm, len(sources), ours.get(id(fm)))
                src = sources[(fm.dev, fm.ino)]
                at = fm.offset + address - fm.start
                if src is not None and at + own.nbytes <= src.identity["size"]:
                    found = src
                    src.pieces.append((own, at))
        if found is None:
            copies.append(own)
    return _Plan(copies, [s for s in sources.values() if s is not None], staged)


def _open_source(fm: mappings.FileMapping, count: int, mapping: mmap.mmap | None) -> _Source | None:
    """The file of `fm` opened read-only, if it still is the file mapped (not replaced since); `mapping`:
    `fm`'s mmap object, where the load made it through us."""
    if count >= _MAX_SOURCES:
        return None
    try:
        fd = os.open(fm.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (fm.dev, fm.ino):
        os.close(fd)
        return None
    return _Source(fm.path, fd, arena.file_identity(st), mapping)


def _tensors_by_storage(packed: rebuild.Packed) -> dict[int, list[torch.Tensor]]:
    """The graph's tensors by their storage (its `_cdata`): the plain ones as `pack` grouped them, and
    the others."""
    out: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
    for cdata, tensors in packed.by_storage.items():
        out[cdata].extend(tensors)
    for t in packed.tensors:
        out[t.untyped_storage()._cdata].append(t)
    return out


def _move(tensors: list[torch.Tensor], storage: torch.UntypedStorage) -> None:
    """Put `tensors` (all of one storage) onto `storage`, which holds the same bytes. Under
    torch.no_grad() (`publish` holds it), as set_ of a parameter that requires grad must be."""
    for t in tensors:  # set_ takes the untyped storage itself (the offset in elements of t's dtype)
        t.set_(storage, t.storage_offset(), t.size(), t.stride())


def _storage_of(mapping: Any) -> torch.UntypedStorage:
    """One storage over all of `mapping`. Each tensor moved onto the mapping gets a slice of it
    (`_SLICE`: a storage of its own that keeps this one, and so the mapping, alive): a quarter of the
    cost of a `torch.frombuffer` per storage."""
    return torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()


# A slice of a CPU storage, by torch's own C method: UntypedStorage.__getitem__ only asks first whether
# the storage is on the meta device (a `device` object made per call), which `_storage_of`'s are not.
_SLICE = vars(torch._C.StorageBase)["__getitem__"]


def _move_onto(whole: torch.UntypedStorage, own: rebuild.Own, by_storage: dict[int, list[torch.Tensor]]) -> None:
    """Put the tensors of `own` onto its bytes in `whole` (`_storage_of` the arena's private mapping)."""
    assert own.storage is not None
    _move(by_storage.pop(own.storage._cdata, []), _SLICE(whole, slice(own.offset, own.offset + own.nbytes)))
    own.storage = None  # the last reference of ours: the old bytes go now, not at the end


def _move_all(whole: torch.UntypedStorage | None, copies: list[rebuild.Own],
              by_storage: dict[int, list[torch.Tensor]]) -> None:
    """Put the tensors of `copies` onto their bytes in `whole` (the arena's private mapping, if any)."""
    if whole is not None:
        for own in copies:
            _move_onto(whole, own, by_storage)


def _fill(writer: arena.ArenaWriter, copies: list[rebuild.Own], whole: torch.UntypedStorage | None, label: str,
          by_storage: dict[int, list[torch.Tensor]]) -> list[rebuild.Own]:
    """Copy `copies` into the arena; each CPU storage's tensors move onto `whole` (`_storage_of` the
    arena's private mapping, where given) as soon as its bytes are there, and its own memory is freed.
    Returns the copies of CPU storages whose tensors did not move (no `whole`)."""

    def move(own: rebuild.Own) -> None:
        if whole is not None and own.storage is not None and own.storage.device.type == "cpu" and own.nbytes:
            _move_onto(whole, own, by_storage)

    cpu = [own for own in copies if own.storage is not None and own.storage.device.type == "cpu" and own.nbytes]
    others = [own for own in copies if own not in cpu and own.nbytes]
    addresses = [own.storage.data_ptr() for own in cpu if own.storage is not None]
    total = sum(own.nbytes for own in copies)
    with _progress(total, label) as advance:
        if writer.backing == "file" and total > _CHUNK:  # Note [Filling an arena] in kernel_server/arena.py
            writer.copy_from([(own.offset, address, own.nbytes) for own, address in zip(cpu, addresses, strict=True)],
                             threads=_WRITERS if threads.allowed() else 1,  # Note [Helper threads]
                             done=lambda i: move(cpu[i]), progress=advance)
        else:
            for own in cpu:
                assert own.storage is not None
                src = torch.empty(0, dtype=torch.uint8).set_(own.storage)
                writer.write(own.offset, memoryview(src.numpy()))  # type: ignore[arg-type]  # numpy arrays are buffers
                del src
                advance(own.nbytes)
                move(own)
        for own in others:  # a GPU storage: its bytes through the CPU, chunk by chunk
            assert own.storage is not None
            src = torch.empty(0, dtype=torch.uint8, device=own.storage.device).set_(own.storage)
            for start in range(0, own.nbytes, _CHUNK):
                chunk = src[start:start + _CHUNK].cpu().numpy()
                writer.write(own.offset + start, memoryview(chunk))  # type: ignore[arg-type]  # a buffer
                advance(min(_CHUNK, own.nbytes - start))
            del src
    return cpu if whole is None else []


@contextlib.contextmanager
def _progress(total: int, label: str) -> Any:
    """The copy's progress: to the daemon, and as a tqdm bar (as the libraries' own loading bars) for a
    large copy (Note [Load progress] in progress.py). `advance(n)` may be called from the writer threads."""
    reporter = progress.current()
    lock = threading.Lock()
    done = 0

    def report(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            now = done
        if reporter is not None:
            reporter.report("caching", now, total, "B", force=now >= total)

    if total < _PROGRESS_BYTES:
        yield report
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
              desc=f"overmind: caching {progress.model_name(label)}", leave=False) as bar:
        def advance(n: int) -> None:
            bar.update(n)
            report(n)

        yield advance


def _remap(src: _Source, key: str, pin: mappings.Pin,
           by_storage: dict[int, list[torch.Tensor]]) -> Callable[[], None]:
    """Move the pieces of `src` onto a private mapping of the file that the registry knows: the same
    page cache pages the load mapped, so nothing is copied (Note [Atomic miss]); or, where they all lie
    on the load's mapping of the file made through us, register that one and move nothing (Note [Files
    the load maps] in load_maps.py). The load's own storages (torch's mapping of the file) are let go of
    with the new mapping, not now: freeing them took 0.4 ms of the call, which the plain load does not
    spend either. Returns what takes the mapping out of the registry again (a publish the daemon refused)."""
    if not src.pieces:
        return lambda: None
    spans = [(at, own.nbytes, own.offset) for own, at in src.pieces]
    if src.mapping is not None and _all_on(src.mapping, src.pieces):
        for own, _ in src.pieces:
            own.storage = None
        return mappings.register(src.mapping, key, pin, spans,
                                 source=arena.SourceFile(os.dup(src.fd), src.identity, src.path))
    m = arena.map_private(src.fd, src.identity["size"])
    retired: list[torch.UntypedStorage] = []  # the load's own storages, kept while this mapping is
    forget = mappings.register(m, key, pin, spans, source=arena.SourceFile(os.dup(src.fd), src.identity, src.path),
                               keep=retired)
    whole = _storage_of(m)
    for own, at in src.pieces:
        storage = own.storage
        if storage is None:
            continue
        _move(by_storage.pop(storage._cdata, []), _SLICE(whole, slice(at, at + own.nbytes)))
        retired.append(storage)
        own.storage = None
    return forget


def _all_on(mapping: mmap.mmap, pieces: list[tuple[rebuild.Own, int]]) -> bool:
    """Whether every piece's storage lies on `mapping` at its file offset (a file mapped from offset 0)."""
    start = mappings.address_of(mapping)
    return all(own.storage is not None and own.storage.data_ptr() == start + at for own, at in pieces)


def _abandon(client: Client, key: str) -> None:
    try:
        client.request(Op.ABANDON, key=key, timeout=ANSWER_TIMEOUT)
    except DaemonError:
        pass
