"""The cached call: key, daemon, rebuild on a hit, load and publish on a miss, plain load on any failure.

A miss is published inside the call, before it returns (Note [Atomic miss] in publishing.py).

# Note [Never worse]
Every failure on the cache path (no key, no daemon, a daemon that dies mid-call, a full budget, an
unpicklable result, a corrupt entry) ends in the original call, and is recorded with its reason in
`fallbacks()` and warned once per reason (docs/design.md invariant 1). An exception raised by the original
call itself propagates unchanged, and its load is abandoned so that no entry is left.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kernel_server import arena
from kernel_server import settings as declared
from kernel_server.client import ANSWER_TIMEOUT, Client, Response, existing_shared_client, shared_client
from kernel_server.errors import DaemonError, DaemonLost, RemoteError
from kernel_server.operations import Op
from kernel_server.transport import close_fds

from . import keys
from .errors import CorruptEntry, FallbackWarning, OvermindWarning, PackError, PublishError, Uncacheable

__all__ = [
    "Settings",
    "cached",
    "calls",
    "clear_fallbacks",
    "fallbacks",
    "flush_warnings",
    "patched_call",
    "result_key",
    "settings",
]


@dataclass
class Settings:
    """How the cached call behaves: from the environment (kernel_server/settings.py), then from
    `overmind_jupyter.config` when the extension loads."""

    wait_timeout: float = field(default_factory=lambda: declared.get(declared.WAIT_TIMEOUT))
    backing: str = field(default_factory=lambda: declared.get(declared.ARENA))
    populate: bool = field(default_factory=lambda: declared.get(declared.POPULATE))


settings = Settings()


# -- fallbacks --------------------------------------------------------------------------------------

_fallbacks: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
_warned: set[str] = set()
_calls: collections.Counter[str] = collections.Counter()


def calls() -> dict[str, int]:
    """How this process's cached calls went: "hit", "miss" (loaded and published) and "plain"."""
    return dict(_calls)


def fallbacks() -> list[dict[str, Any]]:
    """The calls that went the plain way in this process, newest last: {time, call, reason, kind}."""
    return list(_fallbacks)


_deferred_warnings: collections.deque[str] = collections.deque(maxlen=20)


def _fall_back(label: str, kind: str, reason: str, *, plain: bool = True) -> None:
    if plain:  # the call went the plain way (a move to a device without the ledger does not count)
        _calls["plain"] += 1
    _fallbacks.append({"time": time.time(), "call": label, "kind": kind, "reason": reason})
    _report(label, kind, reason)
    if kind in _warned:
        return
    _warned.add(kind)
    message = f"overmind: {label} loads without the cache: {reason}"
    if threading.current_thread() is threading.main_thread():
        warnings.warn(message, FallbackWarning, stacklevel=_user_frame())
    else:  # a load in a thread of the user's: warn in the main thread, at its next load or cell
        _deferred_warnings.append(message)


def _tell_once(topic: str, message: str) -> None:
    """A notice that is no fallback (the call is cached), once per topic and process."""
    if ("notice", topic) in _told:
        return
    _told.add(("notice", topic))
    if threading.current_thread() is threading.main_thread():
        warnings.warn(message, OvermindWarning, stacklevel=_user_frame())
    else:
        _deferred_warnings.append(message)


_told: set[tuple[str, str]] = set()

# Where the code of the loaders lives: a warning names the first frame outside them, the user's cell.
_LIBRARIES = tuple(os.path.dirname(os.path.dirname(__file__)) + os.sep + name + os.sep
                   for name in ("overmind_jupyter", "kernel_server"))
_LIBRARY_NAMES = ("transformers", "diffusers", "peft", "torch", "huggingface_hub", "accelerate",
                  "sentence_transformers")


def _user_frame() -> int:
    """The `stacklevel` of `warnings.warn`, called by the function calling this, that names the first
    frame outside overmind and the loading libraries: the line of the user's that loaded."""
    frame = sys._getframe(2)
    level = 2
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_LIBRARIES) or any(
            f"{os.sep}{name}{os.sep}" in frame.f_code.co_filename for name in _LIBRARY_NAMES)):
        frame = frame.f_back
        level += 1
    return level


def clear_fallbacks() -> None:
    """Forget this process's fallbacks, and warn again for every reason."""
    _fallbacks.clear()
    _warned.clear()
    _deferred_warnings.clear()


def flush_warnings() -> None:
    """Emit the warnings of loads in other threads (called at each load and after each cell)."""
    while _deferred_warnings:
        message = _deferred_warnings.popleft()
        category = FallbackWarning if "loads without the cache" in message else OvermindWarning
        warnings.warn(message, category, stacklevel=3)
    prepare()


# Note [Imports ahead of the hit]
# A hit imports `rebuild` (and `mappings`): 1 ms with bytecode, 5-9 ms without (PYTHONDONTWRITEBYTECODE=1
# and a checkout without __pycache__). `prepare` imports them as soon as torch is imported: at `enable()`
# (api.py) and after each cell (flush_warnings, from the extension's post_run_cell), so the cell after
# the one that imported transformers pays nothing. Never before torch is imported (docs/design.md,
# invariant 8: nothing heavy at import, and `rebuild` imports torch).
_prepared = False


def prepare() -> None:
    """Import what a hit imports, once torch is imported (Note [Imports ahead of the hit])."""
    global _prepared
    if _prepared or "torch" not in sys.modules:
        return
    _prepared = True
    try:
        from . import rebuild  # noqa: F401
    except Exception:  # noqa: BLE001 (the hit imports it again, and falls back there: Note [Never worse])
        pass


def _report(label: str, kind: str, reason: str) -> None:
    """Tell the daemon too (for `overmind-daemon status` and the side panel), without waiting."""
    client = existing_shared_client()
    if client is None or kind == "daemon":
        return
    try:
        client.submit(Op.FALLBACK, call=label, kind=kind, reason=reason)
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
    pickled_here: bool  # `graph` was pickled from these very objects (a miss this process published)
    result: Callable[[], Any]  # a weak reference, or a strong one for a small unweakrefable result
    roots: list[weakref.ref[Any]]
    paths: dict[str, weakref.ref[Any]]
    random_after: tuple[Any, ...] | None = None  # what the graph holds besides (Note [Random loads])
    expected: bytes | None = None  # the entry's graph packed here, once computed

    def live(self) -> tuple[Any, _Replay] | None:
        result = self.result()
        roots = [r() for r in self.roots]
        paths = {p: r() for p, r in self.paths.items()}
        if (result is None and self.roots == []) or any(o is None for o in [*roots, *paths.values()]):
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


def _remember(obj: Any, key: str, graph: bytes, replay: _Replay, *, pickled_here: bool,
              random_after: tuple[Any, ...] | None = None) -> None:
    if not all(_weakable(o) for o in replay.paths.values()):
        return
    result = _reference(obj, replay)
    if result() is None and obj is not None:
        return
    info = _Result(key, graph, pickled_here, result, [weakref.ref(o) for o in replay.roots],
                   {p: weakref.ref(o) for p, o in replay.paths.items()}, random_after)
    for member in [obj, *replay.roots]:
        if _weakable(member):
            _results[member] = info


def result_key(obj: Any, mapped: dict[tuple[str, int, int, str], Any] | None = None) -> str | None:
    """The entry `obj` belongs to (it was rebuilt from it, published as it, or changed by the call it
    holds), if it is unchanged since; else None. See Note [References]. `mapped` receives its storages
    that lie in the entry's mappings, for the rebuild of the call it is passed to, to reuse."""
    from . import rebuild

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
            packed = rebuild.pack((result, replay.roots, info.random_after), self_key=info.key,
                                  substitutes=replay.paths)
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
    if mapped is not None:
        mapped.update(packed.mapped)
    return info.key


# Note [References]
# A cached result passed into another load (a base model into PeftModel.from_pretrained, a vae into a
# pipeline) enters that load's key as the key of its entry, but only while it is unchanged: a model
# written in place, or one whose Python state changed, is no longer what its entry holds, and the call
# that receives it is uncacheable. Unchanged is checked when the object is passed, not when it is
# loaded (hits stay cheap): every storage must still lie in unwritten pages of the entry's mappings
# (Note [Mapping registry] in mappings.py), and
# the object must pickle exactly as the entry's graph does: for a hit, a skeleton unpickled from that
# graph in this process and packed here (two unpickled copies share string objects alike, as long as
# the rebuild takes its strings from the graph: see `rebuild._new`; a pickle made in another process
# differs in memo layout and in the order of its sets); for a miss this process published, the graph
# it pickled from this very object.


# -- unpinning, off the finalizer's thread -------------------------------------------------------------

_unpins: queue.SimpleQueue[tuple[Client, str]] = queue.SimpleQueue()
_unpinner: threading.Thread | None = None
_unpinner_lock = threading.Lock()


def _unpin(client: Client, key: str) -> None:
    """Unpin `key` for `client` soon, from a thread of ours: this runs in finalizers, which must not
    wait for the daemon. The thread starts with the first unpin, never at import."""
    global _unpinner
    _unpins.put((client, key))
    if _unpinner is None:
        with _unpinner_lock:
            if _unpinner is None:
                _unpinner = threading.Thread(target=_unpin_loop, name="overmind-unpin", daemon=True)
                _unpinner.start()


def _forget_unpinner() -> None:
    global _unpinner
    _unpinner = None  # a forked child (a warm kernel) has none of its parent's threads


os.register_at_fork(after_in_child=_forget_unpinner)


def _unpin_loop() -> None:
    while True:
        client, key = _unpins.get()
        if client.closed:
            continue
        try:
            client.request(Op.UNPIN, key=key, timeout=10)
        except DaemonError:
            pass


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
    return _cached_call(fn, args, kwargs)


def _cached_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    flush_warnings()
    label = _label(fn)
    reuse: dict[tuple[str, int, int, str], Any] = {}  # storages of the references found unchanged (Note [References])
    try:
        ck = keys.make_key(fn, args, kwargs, resolve=lambda obj: result_key(obj, reuse))
    except Uncacheable as exc:
        _fall_back(label, "uncacheable", str(exc))
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 (a bug in keying must not break a load: never worse)
        _fall_back(label, "key_error", f"{type(exc).__name__}: {exc}")
        return fn(*args, **kwargs)
    label = ck.label
    replay = _Replay.of(ck.references) if ck.references else _NO_REPLAY
    try:
        client, reply = _lookup(ck.key)
        drawn = reply["entries"][0]["meta"].get("random") if reply["status"] == "hit" else None
        if isinstance(drawn, list):  # Note [Random loads]: the result depends on these generators' state
            _release_hit(client, reply)
            ck = _under_random_state(ck, _only(_random_state(), drawn))
            client, reply = _lookup(ck.key)
            if reply["status"] == "load":
                _tell_once(label, f"overmind: {label} draws random numbers while it loads, so it is cached for "
                                  f"the state of the {' and '.join(drawn)} generator it starts from, and this "
                                  "kernel's is another one: seed it (torch.manual_seed) before the load to share "
                                  "one entry across restarts")
    except DaemonError as exc:
        full = isinstance(exc, RemoteError) and exc.code == "descriptors_exhausted"  # Note [Descriptor budget]
        _fall_back(label, "descriptors" if full else "daemon", str(exc))
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
    # The generators' state as the load starts: a plain hit needs none (nothing since the call began
    # drew a random number), and reading them all costs a millisecond (Note [Random loads]).
    before = _random_state()
    try:
        with _load_log() as said:
            obj = fn(*args, **kwargs)
    except BaseException:
        _abandon(client, ck.key)
        raise
    if said:
        ck.meta["log"] = said  # Note [What the load said]
    changed = keys.changed_since(ck)
    if changed is not None:  # the load may have read the new files: never publish them under the old key
        _abandon(client, ck.key)
        _fall_back(label, "changed", f"{changed} changed while it was loading; the result is not cached")
        return obj
    after = _random_state()
    drawn = _drawn(before, after)
    if drawn and not ck.meta.get("random"):  # it drew random numbers: Note [Random loads]
        keyed = _mark_random(client, ck, _only(before, drawn), drawn)
        if keyed is None:
            return obj
        ck = keyed
    _publish(client, ck, obj, replay, _only(after, drawn) if drawn else None)
    return obj


# Note [What the load said]
# A hit shows what the plain load would have logged: the libraries' warnings during the miss (transformers'
# load report of weights newly initialized, a deprecated argument) are kept in the entry's meta, at most
# _MAX_SAID bytes, and logged again, through the same loggers, on every hit. Only the loading thread's
# records count: other threads' loads log for themselves.
_LIBRARY_LOGGERS = ("transformers", "diffusers", "peft")
_MAX_SAID = 8 * 1024


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.records: list[list[Any]] = []
        self.size = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread:
            return
        message = record.getMessage()[:_MAX_SAID // 2]
        if self.size + len(message) <= _MAX_SAID:
            self.records.append([record.name, record.levelno, message])
            self.size += len(message)


@contextlib.contextmanager
def _load_log() -> Iterator[list[list[Any]]]:
    """The library warnings logged by this thread inside the block: [logger, level, message] each."""
    said = _Said()
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    for logger in loggers:
        logger.addHandler(said)
    try:
        yield said.records
    finally:
        for logger in loggers:
            logger.removeHandler(said)


# Note [Random loads]
# A hit must leave the process as the plain load would (docs/design.md, invariant 2), random numbers
# included. Some loads draw from the global generators: one that initialises weights the checkpoint lacks
# (a classification head on a causal-LM checkpoint) gets them from the caller's seed, and PEFT draws for
# the LoRA layers it then overwrites; either leaves the generators advanced. Such a result is cached
# under a key that also holds the generators' state before the call (torch's, numpy's and Python's global
# ones, the CUDA ones where CUDA is up), with the state after the call in its graph, which a hit puts back.
# Only the generators the load drew from count (Python's own is seeded anew in every process). The
# call's own key then holds a marker (an entry without bytes, `meta["random"]` naming those generators)
# that sends the next lookup to the key of their current state. So two kernels with different seeds get
# their own weights, a restarted kernel that runs the same cells from the same seed is a hit, and the next
# random number after a hit is the one a plain run would draw. A full checkpoint's load draws nothing and
# is keyed as it is.

def _under_random_state(ck: keys.CallKey, state: tuple[Any, ...]) -> keys.CallKey:
    """The key of `ck` for the generators' `state` (Note [Random loads])."""
    import dataclasses
    import hashlib
    import pickle

    digest = hashlib.sha256(ck.key.encode() + pickle.dumps(state, protocol=4)).hexdigest()
    return dataclasses.replace(ck, key=digest, meta=ck.meta | {"random": "state"})


def _drawn(before: tuple[Any, ...], after: tuple[Any, ...]) -> list[str]:
    """The generators a call drew from (one that the call imported first has no state to key by)."""
    was = dict(before)
    return [name for name, now in after if name in was and was[name] != now]


def _mark_random(client: Client, ck: keys.CallKey, state: tuple[Any, ...], drawn: list[str]) -> keys.CallKey | None:
    """Turn `ck` (whose load this connection holds) into a marker that sends lookups to the key of the
    generators' state, and return that key if this connection may load it; None leaves the result
    uncached (another kernel holds or loads that key, or the daemon went away)."""
    from . import publishing

    keyed = _under_random_state(ck, state)
    try:
        reply = client.request(Op.LOOKUP, key=keyed.key, wait=False, timeout=ANSWER_TIMEOUT)
        if reply["status"] == "hit":
            _release_hit(client, reply)
        publishing.publish_marker(client, ck.key, ck.meta | {"random": drawn})
    except (DaemonError, PublishError) as exc:
        _abandon(client, ck.key)
        _fall_back(ck.label, "publish", f"it was loaded normally but not cached: {exc}")
        return None
    return keyed if reply["status"] == "load" else None


def _only(states: tuple[Any, ...], names: list[str]) -> tuple[Any, ...]:
    """The states of the generators `names` (those a load drew from): the others, such as Python's
    own generator that every process seeds anew, play no part in what it returns."""
    return tuple((name, state) for name, state in states if name in names)


def _release_hit(client: Client, reply: Response) -> None:
    """A hit that this process will not map (a marker's) pinned its entries and sent their descriptors:
    give both back now."""
    reply.close()
    for e in reply["entries"]:
        _unpin(client, e["key"])


def _random_state() -> tuple[Any, ...]:
    """The global random generators' states (of the libraries already imported), as comparable and
    picklable values that `_set_random_state` puts back."""
    import sys

    states: list[Any] = []
    torch = sys.modules.get("torch")
    if torch is not None:
        states.append(("torch", torch.random.get_rng_state().numpy().tobytes()))
        if torch.cuda.is_initialized():
            states.append(("cuda", tuple(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all())))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys_, pos, has_gauss, gauss = numpy.random.get_state()
        states.append(("numpy", (kind, keys_.tobytes(), int(pos), int(has_gauss), float(gauss))))
    random = sys.modules.get("random")
    if random is not None:
        states.append(("python", random.getstate()))
    return tuple(states)


def _set_random_state(states: tuple[Any, ...]) -> None:
    import random
    import sys

    import torch

    for name, state in states:
        if name == "torch":
            torch.random.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        elif name == "cuda":
            torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state])
        elif name == "numpy" and "numpy" in sys.modules:
            import numpy

            kind, keys_, pos, has_gauss, gauss = state
            numpy.random.set_state((kind, numpy.frombuffer(keys_, dtype=numpy.uint32).copy(), pos, has_gauss, gauss))
        elif name == "python":
            random.setstate(state)


def _publish(client: Client, ck: keys.CallKey, obj: Any, replay: _Replay, random_after: tuple[Any, ...] | None) -> None:
    """Make `obj` the entry of `ck` before the call returns (Note [Atomic miss] in publishing.py), with
    the generators' state after the call for a load that drew random numbers (Note [Random loads])."""
    from . import publishing, rebuild

    try:
        packed = rebuild.pack((obj, replay.roots, random_after), substitutes=replay.paths)
    except PackError as exc:
        _abandon(client, ck.key)
        _fall_back(ck.label, "unpicklable", f"{exc}; it was loaded normally and will not be cached")
        return
    try:
        publishing.publish(client, ck.key, ck.label, ck.meta, packed, backing=settings.backing,
                           watch=[path for path, _, _ in ck.sources if os.path.isabs(path)],
                           unpin=lambda key: _unpin(client, key))
    except PublishError as exc:
        _fall_back(ck.label, exc.kind, str(exc))
        return
    except Exception as exc:  # noqa: BLE001 (a bug in publishing must not break a load: never worse)
        _abandon(client, ck.key)  # the result is still the plain load's bytes, wherever they lie now
        _fall_back(ck.label, "publish", f"it was loaded normally but not cached: {type(exc).__name__}: {exc}")
        return
    _calls["miss"] += 1
    _remember(obj, ck.key, packed.graph, replay, pickled_here=True, random_after=random_after)


def _label(fn: Callable[..., Any]) -> str:
    return f"{keys.owner_name(fn)[1]}(...)"


def _from_hit(client: Client, ck: keys.CallKey, reply: Response, replay: _Replay,
              reuse: dict[tuple[str, int, int, str], Any]) -> Any:
    from . import rebuild

    entries = reply["entries"]
    fds = reply.fds
    reply.fds = []

    def unpin(key: str) -> None:
        _unpin(client, key)

    try:
        expected = 1 + sum(1 + len(e.get("sources", [])) for e in entries)
        if len(fds) != expected:
            for e in entries:
                unpin(e["key"])
            raise CorruptEntry(f"the daemon sent {len(fds)} descriptors for {len(entries)} entries, not {expected}")
        graph = arena.read_all(fds[0])
        arenas = {}
        at = 1
        for e in entries:
            sources = [arena.SourceFile(fd, {k: s[k] for k in ("dev", "ino", "size", "mtime_ns", "ctime_ns")},
                                        s.get("path", ""))
                       for s, fd in zip(e.get("sources", []), fds[at + 1:], strict=False)]
            arenas[e["key"]] = rebuild.ArenaRef(e["key"], fds[at], e["arena_bytes"], e.get("pieces", []), sources)
            at += 1 + len(sources)

        rebuilt = rebuild.rebuild(graph, arenas, ck.key, on_unmap=unpin, populate=settings.populate,
                                  arguments=replay.paths, reuse=reuse)
        if not (isinstance(rebuilt, tuple) and len(rebuilt) == 3 and isinstance(rebuilt[1], list)
                and (rebuilt[2] is None or isinstance(rebuilt[2], tuple))):
            raise CorruptEntry(f"the entry holds a {type(rebuilt).__name__}, not (result, arguments, random state)")
        obj, _roots, random_after = rebuilt
    finally:
        close_fds(fds)
    _remember(obj, ck.key, graph, replay, pickled_here=False, random_after=random_after)
    for name, level, message in entries[0]["meta"].get("log") or ():
        logging.getLogger(name).log(level, message)  # Note [What the load said]
    if random_after is not None:
        _set_random_state(random_after)  # as the plain load leaves the generators (Note [Random loads])
    _calls["hit"] += 1
    return obj


def _abandon(client: Client, key: str) -> None:
    try:
        client.request(Op.ABANDON, key=key, timeout=ANSWER_TIMEOUT)
    except DaemonError:
        pass


def _evict_quietly(client: Client, key: str) -> None:
    try:
        client.request(Op.EVICT, key=key, timeout=ANSWER_TIMEOUT)
    except DaemonError:
        pass


# -- the daemon ------------------------------------------------------------------------------------------

def _lookup(key: str) -> tuple[Client, Response]:
    """Ask the daemon for `key` (waiting while another kernel loads it). When the connection breaks
    (the daemon was killed since the last request, or while we waited for another kernel's load), ask
    once more: the shared client starts the next daemon, and the load is cached there instead of
    falling back. A daemon lost twice in a row is a fallback."""
    for attempt in (1, 2):
        try:
            client = shared_client()
            # a long wait for another kernel's load, a short one for the daemon (Note [Two kinds of waiting])
            return client, client.wait_alive(*client.submit(Op.LOOKUP, key=key, wait=True), settings.wait_timeout)
        except DaemonLost:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _weakable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


# -- the patched loaders' entry point --------------------------------------------------------------------

def patched_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a patched `from_pretrained` does: the cached call on CPU, then the placement the caller
    asked for with `device_map` (see Note [Devices])."""
    try:
        cpu_kwargs, device = split_placement(kwargs)
    except Uncacheable as exc:
        _fall_back(_label(fn), "uncacheable", str(exc))
        return fn(*args, **kwargs)
    obj = _cached_call(fn, args, cpu_kwargs)
    if device is not None:
        obj = _place(obj, device)
    return obj


# Note [Devices]
# Cached bytes are CPU bytes. A load asked onto one device (`device_map="cuda:0"`, `"cuda"`, `0`,
# `{"": "cuda:1"}`, or `"auto"` where that means a single device) is cached as the CPU load and moved
# after the rebuild, so it lands where it would have landed without overmind. A device map that spreads
# a model over several devices is loaded plainly, and status says so.

def split_placement(kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
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
            _fall_back(f"{type(obj).__name__}.to({device})", "units", f"{exc}; moved without the ledger", plain=False)
    move = getattr(obj, "to", None)
    return move(device) if callable(move) else obj
