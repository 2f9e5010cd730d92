"""The cached call: key, daemon, rebuild on a hit, load and publish on a miss, plain load on any failure.

# Note [Never worse]
Every failure on the cache path (no key, no daemon, a daemon that dies mid-call, a full budget, an
unpicklable result, a corrupt entry) ends in the original call, and is recorded with its reason in
`fallbacks()` and warned once per reason (DESIGN.md invariant 1). An exception raised by the original
call itself propagates unchanged, and its load is abandoned so that no entry is left.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernel_server import arena
from kernel_server.client import Client, Response, existing_shared_client, shared_client
from kernel_server.errors import DaemonError, DaemonLost, RemoteError
from kernel_server.transport import close_fds

from . import keys
from .errors import CorruptEntry, FallbackWarning, PackError, Uncacheable

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from . import rebuild  # imports torch: loaded on first use, so that %overmind on stays light

__all__ = [
    "Settings",
    "adopt_published",
    "cached",
    "clear_fallbacks",
    "fallbacks",
    "flush_warnings",
    "has_adoptable",
    "patched_call",
    "publishing",
    "result_key",
    "settings",
    "wait_for_publishes",
]


@dataclass
class Settings:
    """How the cached call behaves; `overmind_jupyter.config` fills it from traitlets and the env."""

    wait_timeout: float = float(os.environ.get("OVERMIND_WAIT_TIMEOUT", "600"))
    backing: str = os.environ.get("OVERMIND_ARENA", "auto")
    populate: bool = os.environ.get("OVERMIND_POPULATE", "1") != "0"
    background_publish: bool = os.environ.get("OVERMIND_PUBLISH", "background") != "sync"
    adopt: bool = os.environ.get("OVERMIND_ADOPT", "1") != "0"
    exit_publish_timeout: float = float(os.environ.get("OVERMIND_EXIT_PUBLISH_TIMEOUT", "30"))
    publish_idle: bool = os.environ.get("OVERMIND_PUBLISH_IDLE", "1") != "0"


settings = Settings()


# -- fallbacks --------------------------------------------------------------------------------------

_fallbacks: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
_warned: set[str] = set()


def fallbacks() -> list[dict[str, Any]]:
    """The calls that went the plain way in this process, newest last: {time, call, reason, kind}."""
    return list(_fallbacks)


_deferred_warnings: collections.deque[str] = collections.deque(maxlen=20)


def _fall_back(label: str, kind: str, reason: str) -> None:
    _fallbacks.append({"time": time.time(), "call": label, "kind": kind, "reason": reason})
    _report(label, kind, reason)
    if kind in _warned:
        return
    _warned.add(kind)
    message = f"overmind: {label} loads without the cache: {reason}"
    if threading.current_thread() is threading.main_thread():
        warnings.warn(message, FallbackWarning, stacklevel=4)
    else:  # a background publish: warn in the user's thread, at its next load or cell
        _deferred_warnings.append(message)


def clear_fallbacks() -> None:
    """Forget this process's fallbacks, and warn again for every reason."""
    _fallbacks.clear()
    _warned.clear()
    _deferred_warnings.clear()


def flush_warnings() -> None:
    """Emit the warnings of background publishes (called at each load and after each cell)."""
    while _deferred_warnings:
        warnings.warn(_deferred_warnings.popleft(), FallbackWarning, stacklevel=3)


def _report(label: str, kind: str, reason: str) -> None:
    """Tell the daemon too (for `overmind-daemon status` and the side panel), without waiting."""
    client = existing_shared_client()
    if client is None or kind == "daemon":
        return
    try:
        client.submit("fallback", call=label, kind=kind, reason=reason)
    except DaemonError:
        pass


# -- results this process got from the cache ----------------------------------------------------------

@dataclass
class _Replay:
    """The arguments of a call that its entry replays onto (see Note [Argument replay] in rebuild.py):
    the cached results it was given, and every module inside them by path."""

    roots: list[Any]
    paths: dict[str, Any]

    @classmethod
    def of(cls, references: dict[str, Any]) -> _Replay:
        """The replay of a call given its referenced arguments (keys.CallKey.references)."""
        paths: dict[str, Any] = {}
        for name, obj in references.items():
            modules = getattr(obj, "named_modules", None)
            pairs = modules() if callable(modules) else [("", obj)]
            for sub, module in pairs:
                paths.setdefault(f"{name}/{sub}", module)
        return cls(list(references.values()), paths)


_NO_REPLAY = _Replay([], {})


@dataclass
class _Result:
    """What an entry holds, as live objects of this process: the call's result and the arguments it
    replayed onto. Every one of them is registered as belonging to the entry."""

    key: str
    graph: bytes
    pickled_here: bool  # `graph` was pickled from these very objects (a published and adopted miss)
    result: Callable[[], Any]  # a weak reference, or a strong one for a small unweakrefable result
    roots: list[weakref.ref[Any]]
    paths: dict[str, weakref.ref[Any]]
    expected: bytes | None = None  # the entry's graph packed here, once computed

    def live(self) -> tuple[Any, _Replay] | None:
        result = self.result()
        roots = [r() for r in self.roots]
        paths = {p: r() for p, r in self.paths.items()}
        if result is None and self.roots == [] or any(o is None for o in [*roots, *paths.values()]):
            return None
        return result, _Replay(roots, paths)


_results: weakref.WeakKeyDictionary[Any, _Result] = weakref.WeakKeyDictionary()


def _reference(obj: Any, replay: _Replay) -> Callable[[], Any]:
    """A weak reference to a call's result; a strong one to the small return value of a method that
    loads into its object (load_adapter), which nothing else would keep for the next reference check."""
    if _weakable(obj):
        return weakref.ref(obj)
    if replay.roots:
        return lambda: obj
    return lambda: None


def _remember(obj: Any, key: str, graph: bytes, replay: _Replay, *, pickled_here: bool) -> None:
    if not all(_weakable(o) for o in replay.paths.values()):
        return
    result = _reference(obj, replay)
    if result() is None and obj is not None:
        return
    info = _Result(key, graph, pickled_here, result, [weakref.ref(o) for o in replay.roots],
                   {p: weakref.ref(o) for p, o in replay.paths.items()})
    for member in [obj, *replay.roots]:
        if _weakable(member):
            _results[member] = info


def result_key(obj: Any) -> str | None:
    """The entry `obj` belongs to (it was rebuilt from it, published and adopted as it, or changed by
    the call it holds), if it is unchanged since; else None. See Note [References]."""
    from . import rebuild

    _settle(obj)
    try:
        info = _results.get(obj)
    except TypeError:
        return None
    live = info.live() if info is not None else None
    if info is None or live is None:
        return None
    result, replay = live
    try:
        # One pause for the whole check: the skeleton's objects die before any collection sees them.
        # Collected between the steps, they were promoted and counted toward the next full collection
        # of the whole heap (0.2 s in a kernel with torch and transformers imported), for garbage.
        with rebuild.gc_paused():
            packed = rebuild.pack((result, replay.roots), self_key=info.key, substitutes=replay.paths)
            if packed.own:
                return None  # a storage is not, or no longer, the entry's bytes
            if info.expected is None:
                if info.pickled_here:
                    info.expected = info.graph
                else:
                    as_stored, placeholders = rebuild.skeleton(info.graph, info.key)
                    info.expected = rebuild.pack(as_stored, self_key=info.key, trust_mappings=True,
                                                 substitutes=placeholders).graph
                    del as_stored, placeholders
    except (PackError, CorruptEntry):
        return None
    if packed.graph != info.expected:
        return None
    reuse = getattr(_verified, "mapped", None)
    if reuse is not None:
        reuse.update(packed.mapped)
    return info.key


# The storages of the references the current call's key found unchanged, for its rebuild to reuse.
_verified = threading.local()


# Note [References]
# A cached result passed into another load (a base model into PeftModel.from_pretrained, a vae into a
# pipeline) enters that load's key as the key of its entry, but only while it is unchanged: a model
# written in place, or one whose Python state changed, is no longer what its entry holds, and the call
# that receives it is uncacheable. Unchanged is checked when the object is passed, not when it is
# loaded (hits stay cheap): every storage must still lie in unwritten pages of the entry's arenas, and
# the object must pickle exactly as the entry's graph does: for a hit, a skeleton unpickled from that
# graph in this process and packed here (two unpickled copies share string objects alike, as long as
# the rebuild takes its strings from the graph: see `rebuild._new`; a pickle made in another process
# differs in memo layout and in the order of its sets); for a miss this process published and
# adopted, the graph it pickled from this very object.
keys.register_reference(lambda obj: (k, "") if (k := result_key(obj)) is not None else None)


# -- unpinning, off the finalizer's thread -------------------------------------------------------------

_unpins: queue.SimpleQueue[tuple[Client, str]] = queue.SimpleQueue()


def _unpin_loop() -> None:
    while True:
        client, key = _unpins.get()
        if client.closed:
            continue
        try:
            client.request("unpin", key=key, timeout=10)
        except DaemonError:
            pass


threading.Thread(target=_unpin_loop, name="overmind-unpin", daemon=True).start()


# -- the cached call -------------------------------------------------------------------------------------

def cached(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn(*args, **kwargs)` through the cache: the patch-free form of what `%overmind on` does.

    Args:
        fn: a loader, typically a `from_pretrained` classmethod (`AutoModel.from_pretrained`).
        *args, **kwargs: its arguments.

    Returns:
        What `fn` returns: rebuilt from the daemon's shared memory on a hit, or loaded and then
        published for the next kernel on a miss.
    """
    return _cached_call(fn, args, kwargs, signature_of=None)


def _cached_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 signature_of: Callable[..., Any] | None) -> Any:
    flush_warnings()
    label = _label(fn)
    _verified.mapped = {}
    try:
        ck = keys.make_key(fn, args, kwargs, signature_of=signature_of)
    except Uncacheable as exc:
        _fall_back(label, "uncacheable", str(exc))
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 (a bug in keying must not break a load: never worse)
        _fall_back(label, "key_error", f"{type(exc).__name__}: {exc}")
        return fn(*args, **kwargs)
    finally:
        reuse, _verified.mapped = _verified.mapped, None
    label = ck.label
    replay = _Replay.of(ck.references) if ck.references else _NO_REPLAY
    for thread in _running(ck.key):  # this process publishes this very key: the daemon would answer
        thread.join()                # "load" again (its own load), so wait and take the entry instead
    try:
        client, reply = _lookup(ck.key)
    except DaemonError as exc:
        _fall_back(label, "daemon", str(exc))
        return fn(*args, **kwargs)
    if reply["status"] == "hit":
        try:
            return _from_hit(client, ck, reply, replay, reuse)
        except CorruptEntry as exc:
            _evict_quietly(client, ck.key)
            _fall_back(label, "corrupt", f"{exc}; the entry was evicted")
            return fn(*args, **kwargs)
    if reply["status"] != "load":
        _fall_back(label, "daemon", f"unexpected lookup answer {reply['status']!r}")
        return fn(*args, **kwargs)
    try:
        obj = fn(*args, **kwargs)
    except BaseException:
        _abandon(client, ck.key)
        raise
    changed = keys.changed_since(ck)
    if changed is not None:  # the load may have read the new files: never publish them under the old key
        _abandon(client, ck.key)
        _fall_back(label, "changed", f"{changed} changed while it was loading; the result is not cached")
        return obj
    _start_publish(client, ck, obj, replay)
    return obj


def _label(fn: Callable[..., Any]) -> str:
    return f"{keys.owner_name(fn)[1]}(...)"


def _from_hit(client: Client, ck: keys.CallKey, reply: Response, replay: _Replay,
              reuse: dict[tuple[str, int, int, str], Any]) -> Any:
    from . import rebuild

    entries = reply["entries"]
    fds = reply.fds
    reply.fds = []
    try:
        if len(fds) != len(entries) + 1:
            raise CorruptEntry(f"the daemon sent {len(fds)} descriptors for {len(entries)} arenas")
        graph = arena.read_all(fds[0])
        arenas = {e["key"]: rebuild.ArenaRef(e["key"], fd, e["arena_bytes"]) for e, fd in zip(entries, fds[1:])}

        def unpin(key: str) -> None:
            _unpins.put((client, key))

        try:
            obj, _roots = rebuild.rebuild(graph, arenas, ck.key, on_unmap=unpin, populate=settings.populate,
                                          arguments=replay.paths, reuse=reuse)
        except BaseException:
            for e in entries:
                unpin(e["key"])
            raise
    finally:
        close_fds(fds)
    _remember(obj, ck.key, graph, replay, pickled_here=False)
    return obj


def _abandon(client: Client, key: str) -> None:
    try:
        client.request("abandon", key=key, timeout=10)
    except DaemonError:
        pass


def _evict_quietly(client: Client, key: str) -> None:
    try:
        client.request("evict", key=key, timeout=10)
    except DaemonError:
        pass


# -- publishing ------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Publication:
    """One result of this process on its way into the cache, then waiting to be adopted."""

    key: str
    packed: rebuild.Packed | None
    obj: Callable[[], Any]  # a weak reference
    replay: _Replay
    thread: threading.Thread | None = None
    published: bool = False


_publications: list[_Publication] = []
# Every publishing thread with its key, until it has ended entirely: a publication leaves
# `_publications` before its thread does, and the thread's last step (threading.Thread.run dropping
# its arguments) may free the last references to the published tensors. torch lets go of the GIL to
# free a tensor, and a thread that takes it back while the interpreter exits is ended by pthread_exit,
# whose unwinding through torch's C++ frames aborts the process ("terminate called without an active
# exception"). So `wait_for_publishes`, and the exit, wait for the threads themselves.
_threads: list[tuple[str, threading.Thread]] = []
_exiting = threading.Event()
_publish_lock = threading.Lock()


def _start_publish(client: Client, ck: keys.CallKey, obj: Any, replay: _Replay) -> None:
    from . import rebuild

    try:
        packed = rebuild.pack((obj, replay.roots), substitutes=replay.paths)
    except PackError as exc:
        _abandon(client, ck.key)
        _fall_back(ck.label, "unpicklable", f"{exc}; it was loaded normally and will not be cached")
        return
    pub = _Publication(ck.key, packed, _reference(obj, replay), replay)
    with _publish_lock:
        _publications.append(pub)
    if not settings.background_publish:
        _publish(client, ck, pub)
        return
    pub.thread = threading.Thread(target=_publish, args=(client, ck, pub), name="overmind-publish", daemon=True)
    with _publish_lock:
        pub.thread.start()
        _threads.append((ck.key, pub.thread))


def _publish(client: Client, ck: keys.CallKey, pub: _Publication) -> None:
    from . import rebuild

    packed = pub.packed
    assert packed is not None
    writers: list[arena.ArenaWriter] = []
    if pub.thread is not None and settings.publish_idle:
        _yield_the_cores()
    try:
        total = packed.arena_bytes + len(packed.graph)
        client.request("reserve", key=ck.key, bytes=total, timeout=30)
        data = _new_arena(packed.arena_bytes, f"overmind:{ck.key[:12]}", client.home)
        writers.append(data)
        rebuild.write_arena(packed, data, _exiting)
        if not packed.unchanged():
            raise PackError("it was written in place while being published")
        graph = arena.ArenaWriter(len(packed.graph), name=f"overmind-graph:{ck.key[:12]}")
        writers.append(graph)
        graph.view[:] = packed.graph
        client.request("publish", key=ck.key, fds=[graph.seal(), data.seal()], graph_bytes=len(packed.graph),
                       arena_bytes=packed.arena_bytes, meta=ck.meta, deps=packed.deps, timeout=30)
        pub.published = True
    except (DaemonError, PackError, OSError) as exc:
        _abandon(client, ck.key)
        kind = "budget" if isinstance(exc, RemoteError) and exc.code == "budget_exceeded" else "publish"
        _fall_back(ck.label, kind, f"it was loaded normally but not cached: {exc}")
    finally:
        for w in writers:
            w.close()
        with _publish_lock:
            if not (pub.published and settings.adopt and packed.own) and pub in _publications:
                _publications.remove(pub)  # nothing left to do for it


def _lookup(key: str) -> tuple[Client, Response]:
    """Ask the daemon for `key` (waiting while another kernel loads it). When the connection breaks
    (the daemon was killed since the last request, or while we waited for another kernel's load), ask
    once more: the shared client starts the next daemon, and the load is cached there instead of
    falling back. A daemon lost twice in a row is a fallback."""
    try:
        client = shared_client()
        return client, client.request("lookup", key=key, wait=True, timeout=settings.wait_timeout)
    except DaemonLost:
        client = shared_client()
        return client, client.request("lookup", key=key, wait=True, timeout=settings.wait_timeout)


def _yield_the_cores() -> None:
    """Note [Publishing yields]: the kernel's own first forward, right after the load, matters more than
    the entry being ready a moment earlier. The publishing thread runs under SCHED_IDLE: it gets a core
    only when nothing else of this machine wants it, and any waking thread preempts it at once. (With a
    nice of 10 and torch's parallel copy instead of pwrite, the first forward after a miss of the 1.1B
    bf16 model took 1.5-1.7 x plain's; now about 1.05 x, benchmarks/RESULTS.md.)"""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


def _new_arena(nbytes: int, name: str, home: str | os.PathLike[str]) -> arena.ArenaWriter:
    """The arena of a new entry, backed as `settings.backing` says (Note [Arena backing]); a file arena
    that cannot be made (no O_TMPFILE there, a full disk) falls back to a memfd."""
    if settings.backing != "memfd":
        directory = arena.arena_directory(home)
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if arena.choose_backing(settings.backing, directory) == "file":
                return arena.ArenaWriter(nbytes, name=name, backing="file", directory=directory)
        except OSError as exc:
            if settings.backing == "file":
                raise
            _log.info("file arena in %s failed (%s); using a memfd", directory, exc)
    return arena.ArenaWriter(nbytes, name=name, backing="memfd")


def _weakable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


def _running(key: str | None = None) -> list[threading.Thread]:
    with _publish_lock:
        _threads[:] = [(k, t) for k, t in _threads if t.is_alive()]
        return [t for k, t in _threads if key in (None, k)]


def publishing() -> int:
    """How many publishes of this process run in the background now."""
    return len(_running())


def has_adoptable() -> bool:
    with _publish_lock:
        return any(p.published for p in _publications)


@atexit.register
def _finish_publishes() -> None:
    """At exit, let running publishes finish (they take about a second per GiB), then stop the rest:
    a thread still copying tensors while the interpreter tears down would abort the process."""
    if not wait_for_publishes(timeout=settings.exit_publish_timeout):
        _exiting.set()
        wait_for_publishes(timeout=5)


def wait_for_publishes(timeout: float | None = None) -> bool:
    """Wait until this process's background publishes end; True if none is left."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in _running():
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not _running()


def adopt_published(obj: Any = None) -> int:
    """Move results this process loaded and published (all, or just `obj`) onto the published copy, so
    that their memory is shared with every other kernel; returns how many objects moved.

    Only call it where no other thread can be running an operation on those objects (the extension
    calls it between cells). An object written in place since the load keeps its private copy."""
    with _publish_lock:
        chosen = [p for p in _publications if p.published and (
            obj is None or p.obj() is obj or any(r is obj for r in p.replay.roots))]
        for p in chosen:
            _publications.remove(p)
    moved = 0
    for pub in chosen:
        target = pub.obj()
        if target is None or pub.packed is None or not pub.packed.unchanged():
            continue
        try:
            moved += _adopt(pub.packed, pub.key, target, pub.replay)
        except (DaemonError, CorruptEntry, OSError):
            continue
    return moved


def _settle(obj: Any) -> None:
    """If `obj` is a result of this process still being published, wait for it and adopt it, so that it
    can enter another load's key (a base model passed to PeftModel.from_pretrained in the same cell)."""
    with _publish_lock:
        pubs = [p for p in _publications if p.obj() is obj or any(r is obj for r in p.replay.roots)]
    for pub in pubs:
        if pub.thread is not None:
            pub.thread.join()
    if pubs:
        adopt_published(obj)


def _adopt(packed: rebuild.Packed, key: str, obj: Any, replay: _Replay) -> bool:
    """Move `obj` onto the entry it was published as; False if the entry is gone (evicted meanwhile)."""
    import torch

    from . import rebuild

    client = shared_client()
    reply = client.request("lookup", key=key, wait=False, adopt=True, timeout=30)
    status = reply["status"]
    if status != "hit":
        reply.close()
        if status == "load":  # the daemon took us for its loader now: we are not
            _abandon(client, key)
        return False
    arena_fd = reply.fds[1]
    try:
        entry = reply["entries"][0]

        def unpin(k: str) -> None:
            _unpins.put((client, k))

        for e in reply["entries"][1:]:
            unpin(e["key"])
        storages = rebuild.map_storages(packed, rebuild.ArenaRef(key, arena_fd, entry["arena_bytes"]), unpin)
        with torch.no_grad():
            for t, _ in packed.tensors:
                new = storages.get(t.untyped_storage()._cdata)
                if new is not None and t.device.type == "cpu":
                    typed = torch.storage.TypedStorage(wrap_storage=new, dtype=t.dtype, _internal=True)
                    t.set_(typed, t.storage_offset(), t.size(), t.stride())
        _remember(obj, key, packed.graph, replay, pickled_here=True)
    finally:
        reply.close()
    return True


# -- the patched loaders' entry point --------------------------------------------------------------------

def patched_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a patched `from_pretrained` does: the cached call on CPU, then the placement the caller
    asked for with `device_map` (see Note [Devices])."""
    try:
        cpu_kwargs, device = _split_placement(kwargs)
    except Uncacheable as exc:
        _fall_back(_label(fn), "uncacheable", str(exc))
        return fn(*args, **kwargs)
    obj = _cached_call(fn, args, cpu_kwargs, signature_of=None)
    if device is not None:
        obj = _place(obj, device)
    return obj


# Note [Devices]
# Cached bytes are CPU bytes. A load asked onto one device (`device_map="cuda:0"`, `"cuda"`, `0`,
# `{"": "cuda:1"}`, or `"auto"` where that means a single device) is cached as the CPU load and moved
# after the rebuild, so it lands where it would have landed without overmind. A device map that spreads
# a model over several devices is loaded plainly, and status says so.

def _split_placement(kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    if kwargs.get("device_map") is None:
        return kwargs, None
    import torch

    device_map = kwargs["device_map"]
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
        count = torch.cuda.device_count()
        if count > 1:
            raise Uncacheable(f"device_map={device_map!r} spreads the model over {count} GPUs")
        device_map = "cuda:0" if count == 1 else "cpu"
    try:
        device = torch.device(device_map) if not isinstance(device_map, int) else torch.device("cuda", device_map)
    except (TypeError, RuntimeError):
        raise Uncacheable(f"device_map={kwargs['device_map']!r} places parts of the model on different "
                          "devices") from None
    rest = {k: v for k, v in kwargs.items() if k != "device_map"}
    return rest, None if device.type == "cpu" else device


def _place(obj: Any, device: Any) -> Any:
    """Move a loaded result to `device`: a model through the GPU units ledger (units.place), anything
    else that can move (a pipeline) with `.to`. Units that cannot be had in time leave the move to
    `.to`, as the plain load would have done, and say so."""
    import torch

    if isinstance(obj, torch.nn.Module) and device.type == "cuda":
        from . import units

        try:
            units.place(obj, device)
            return obj
        except units.UnitsError as exc:
            _fall_back(f"{type(obj).__name__}.to({device})", "units", f"{exc}; moved without the ledger")
    move = getattr(obj, "to", None)
    return move(device) if callable(move) else obj
