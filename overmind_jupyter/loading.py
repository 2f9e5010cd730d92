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
import os
import queue
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from kernel_server import arena
from kernel_server.client import Client, Response, shared_client
from kernel_server.errors import DaemonError, RemoteError
from kernel_server.transport import close_fds

from . import keys, rebuild
from .errors import CorruptEntry, FallbackWarning, PackError, Uncacheable

__all__ = [
    "Settings",
    "adopt_published",
    "cached",
    "fallbacks",
    "result_key",
    "settings",
    "wait_for_publishes",
]


@dataclass
class Settings:
    """How the cached call behaves; `overmind_jupyter.config` fills it from traitlets and the env."""

    wait_timeout: float = float(os.environ.get("OVERMIND_WAIT_TIMEOUT", 600))
    backing: str = os.environ.get("OVERMIND_ARENA", "memfd")
    populate: bool = os.environ.get("OVERMIND_POPULATE", "1") != "0"
    background_publish: bool = os.environ.get("OVERMIND_PUBLISH", "background") != "sync"
    adopt: bool = os.environ.get("OVERMIND_ADOPT", "1") != "0"
    exit_publish_timeout: float = float(os.environ.get("OVERMIND_EXIT_PUBLISH_TIMEOUT", 30))


settings = Settings()


# -- fallbacks --------------------------------------------------------------------------------------

_fallbacks: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
_warned: set[str] = set()


def fallbacks() -> list[dict[str, Any]]:
    """The calls that went the plain way in this process, newest last: {time, call, reason, kind}."""
    return list(_fallbacks)


def _fall_back(label: str, kind: str, reason: str) -> None:
    _fallbacks.append({"time": time.time(), "call": label, "kind": kind, "reason": reason})
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"overmind: {label} loads without the cache: {reason}", FallbackWarning, stacklevel=4)


# -- results this process got from the cache ----------------------------------------------------------

@dataclass
class _Result:
    key: str
    graph: bytes
    pickled_here: bool  # `graph` was pickled from this very object (a published and adopted miss)


_results: weakref.WeakKeyDictionary[Any, _Result] = weakref.WeakKeyDictionary()


def _remember(obj: Any, key: str, graph: bytes, *, pickled_here: bool) -> None:
    if _weakable(obj):
        _results[obj] = _Result(key, graph, pickled_here)


def result_key(obj: Any) -> str | None:
    """The entry `obj` was rebuilt from (or published and adopted as), if it is unchanged since; else
    None. See Note [References]."""
    try:
        info = _results.get(obj)
    except TypeError:
        return None
    if info is None:
        return None
    try:
        live = rebuild.pack(obj, self_key=info.key)
        if live.own:
            return None  # a storage is not, or no longer, the entry's bytes
        if info.pickled_here:
            expected = info.graph
        else:
            expected = rebuild.pack(rebuild.skeleton(info.graph, info.key), self_key=info.key,
                                    trust_mappings=True).graph
    except (PackError, CorruptEntry):
        return None
    return info.key if live.graph == expected else None


# Note [References]
# A cached result passed into another load (a base model into PeftModel.from_pretrained, a vae into a
# pipeline) enters that load's key as the key of its entry, but only while it is unchanged: a model
# written in place, or one whose Python state changed, is no longer what its entry holds, and the call
# that receives it is uncacheable. Unchanged is checked when the object is passed, not when it is
# loaded (hits stay cheap): every storage must still lie in unwritten pages of the entry's arenas, and
# the object must pickle exactly as the entry's graph does: for a hit, a skeleton unpickled from that
# graph in this process and packed here (two unpickled copies share string objects alike, while a
# pickle made in another process differs in memo layout); for a miss this process published and
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
    label = _label(fn)
    try:
        ck = keys.make_key(fn, args, kwargs, signature_of=signature_of)
    except Uncacheable as exc:
        _fall_back(label, "uncacheable", str(exc))
        return fn(*args, **kwargs)
    except Exception as exc:  # a bug in keying must not break a load
        _fall_back(label, "key_error", f"{type(exc).__name__}: {exc}")
        return fn(*args, **kwargs)
    label = ck.label
    try:
        client = shared_client()
        reply = client.request("lookup", key=ck.key, wait=True, timeout=settings.wait_timeout)
    except DaemonError as exc:
        _fall_back(label, "daemon", str(exc))
        return fn(*args, **kwargs)
    if reply["status"] == "hit":
        try:
            return _from_hit(client, ck, reply)
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
    _start_publish(client, ck, obj)
    return obj


def _label(fn: Callable[..., Any]) -> str:
    return f"{keys.owner_name(fn)[1]}(...)"


def _from_hit(client: Client, ck: keys.CallKey, reply: Response) -> Any:
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
            obj = rebuild.rebuild(graph, arenas, ck.key, on_unmap=unpin, populate=settings.populate)
        except BaseException:
            for e in entries:
                unpin(e["key"])
            raise
    finally:
        close_fds(fds)
    _remember(obj, ck.key, graph, pickled_here=False)
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

_publishes: set[threading.Thread] = set()
_exiting = threading.Event()
_adoptable: list[tuple[rebuild.Packed, str, Any]] = []
_publish_lock = threading.Lock()


def _start_publish(client: Client, ck: keys.CallKey, obj: Any) -> None:
    try:
        packed = rebuild.pack(obj)
    except PackError as exc:
        _abandon(client, ck.key)
        _fall_back(ck.label, "unpicklable", f"{exc}; it was loaded normally and will not be cached")
        return
    if not settings.background_publish:
        _publish(client, ck, obj, packed)
        return
    thread = threading.Thread(target=_publish, args=(client, ck, obj, packed), name="overmind-publish",
                              daemon=True)
    with _publish_lock:
        _publishes.add(thread)
    thread.start()


def _publish(client: Client, ck: keys.CallKey, obj: Any, packed: rebuild.Packed) -> None:
    writers: list[arena.ArenaWriter] = []
    try:
        total = packed.arena_bytes + len(packed.graph)
        client.request("reserve", key=ck.key, bytes=total, timeout=30)
        home = client.home
        data = arena.ArenaWriter(packed.arena_bytes, name=f"overmind:{ck.key[:12]}", backing=settings.backing,
                                 directory=home)
        writers.append(data)
        rebuild.write_arena(packed, data.mapping, _exiting)
        if not packed.unchanged():
            raise PackError("it was written in place while being published")
        graph = arena.ArenaWriter(len(packed.graph), name=f"overmind-graph:{ck.key[:12]}")
        writers.append(graph)
        graph.view[:] = packed.graph
        client.request("publish", key=ck.key, fds=[graph.seal(), data.seal()], graph_bytes=len(packed.graph),
                       arena_bytes=packed.arena_bytes, meta=ck.meta, deps=packed.deps, timeout=30)
        if settings.adopt and packed.own:
            with _publish_lock:
                _adoptable.append((packed, ck.key, weakref.ref(obj) if _weakable(obj) else (lambda: None)))
            packed = None  # type: ignore[assignment]  # the adopt list holds it now
    except (DaemonError, PackError, OSError) as exc:
        _abandon(client, ck.key)
        kind = "budget" if isinstance(exc, RemoteError) and exc.code == "budget_exceeded" else "publish"
        _fall_back(ck.label, kind, f"it was loaded normally but not cached: {exc}")
    finally:
        for w in writers:
            w.close()
        with _publish_lock:
            _publishes.discard(threading.current_thread())


def _weakable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


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
    while True:
        with _publish_lock:
            threads = list(_publishes)
        if not threads:
            return True
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if deadline is not None and time.monotonic() >= deadline:
            with _publish_lock:
                return not _publishes


def adopt_published() -> int:
    """Move the results this process loaded and published onto the published copy, so that their
    memory is shared with every other kernel; returns how many objects moved.

    Only call it where no other thread can be running an operation on those objects (the extension
    calls it between cells). A tensor written in place since the load keeps its private copy, and the
    object is then not adopted at all."""
    with _publish_lock:
        pending, _adoptable[:] = list(_adoptable), []
    moved = 0
    for packed, key, ref in pending:
        obj = ref()
        if obj is None or not packed.unchanged():
            continue
        try:
            _adopt(packed, key, obj)
            moved += 1
        except (DaemonError, CorruptEntry, OSError):
            continue
    return moved


def _adopt(packed: rebuild.Packed, key: str, obj: Any) -> None:
    import torch

    client = shared_client()
    reply = client.request("lookup", key=key, wait=False, timeout=30)
    if reply["status"] != "hit":
        reply.close()
        return
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
        _remember(obj, key, packed.graph, pickled_here=True)
    finally:
        reply.close()
