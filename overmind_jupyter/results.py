"""Results this process got from the cache: the registry behind `result_key` (Note [References]), the
arguments an entry replays onto, and the unpinning of an entry once its result is gone.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernel_server import helper_threads
from kernel_server.client import Client, interrupts_held
from kernel_server.errors import DaemonError
from kernel_server.operations import Op

from . import threads
from .errors import CorruptEntry, PackError

if TYPE_CHECKING:
    from .spellings import Found

__all__ = ["NO_REPLAY", "Replay", "holds", "remember", "result_key", "send_unpins", "spellings_of", "unpin"]


@dataclass
class Replay:
    """The arguments of a call that its entry replays onto (see Note [Argument replay] in rebuild.py):
    the cached results it was given, and every module inside them and every module's tensor by path."""

    roots: list[Any]
    paths: dict[str, Any]

    @classmethod
    def of(cls, references: dict[str, Any]) -> Replay:
        """The replay of a call given its referenced arguments (keys.CallKey.references)."""
        paths: dict[str, Any] = {}
        for name, obj in references.items():
            modules = getattr(obj, "named_modules", None)
            if not callable(modules):
                paths.setdefault(f"{name}/", obj)
                continue
            for sub, module in modules():
                paths.setdefault(f"{name}/{sub}", module)
                for tensors in (getattr(module, "_parameters", None), getattr(module, "_buffers", None)):
                    for tensor_name, tensor in (tensors or {}).items():
                        if tensor is not None:
                            paths.setdefault(f"{name}/{sub}#{tensor_name}", tensor)
        return cls(list(references.values()), paths)


NO_REPLAY = Replay([], {})


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
    # the paths of its call and of the results that call was given, as they wrote them (Note [Spellings])
    spellings: dict[str, str] = field(default_factory=dict)
    respelled: Found | None = None  # how its hit changed the entry's spellings

    def live(self) -> tuple[Any, Replay] | None:
        result = self.result()
        roots = [r() for r in self.roots]
        paths = {p: r() for p, r in self.paths.items()}
        if (result is None and self.roots == []) or any(o is None for o in [*roots, *paths.values()]):
            return None
        return result, Replay(roots, paths)


_results: weakref.WeakKeyDictionary[Any, _Result] = weakref.WeakKeyDictionary()


@dataclass
class _Part:
    """A component of an entry's result (a pipeline's vae), keyed as that entry's part while unchanged
    (Note [References])."""

    whole: _Result
    name: str  # the result's attribute that holds it
    expected: bytes | None = None  # what it packs to while unchanged, once computed
    pickled_here: bool = False  # `expected` was packed from this very object (a miss of this process)


# Components of results, by their own object: apart from `_results`, which `holds` (every `.to`) asks.
_parts: weakref.WeakKeyDictionary[Any, _Part] = weakref.WeakKeyDictionary()


def _reference(obj: Any, replay: Replay) -> Callable[[], Any]:
    """A weak reference to a call's result; a strong one to the small return value of a method that
    loads into its object (load_adapter), which nothing else would keep for the next reference check."""
    if _weakable(obj):
        return weakref.ref(obj)
    if replay.roots:
        return lambda: obj
    return lambda: None


def remember(obj: Any, key: str, graph: bytes, replay: Replay, *, pickled_here: bool,
             random_after: tuple[Any, ...] | None = None, spellings: dict[str, str] | None = None,
             respelled: Found | None = None, kept: Collection[Any] = ()) -> None:
    """Register `obj`, the result of the call of entry `key`, and the arguments it replayed onto as that
    entry's; not those of them in `kept`, which the call left their own entries' (Note [References])."""
    if not all(_weakable(o) for o in replay.paths.values()):
        return
    result = _reference(obj, replay)
    if result() is None and obj is not None:
        return
    info = _Result(key, graph, pickled_here, result, [weakref.ref(o) for o in replay.roots],
                  {p: weakref.ref(o) for p, o in replay.paths.items()}, random_after,
                  spellings=spellings or {}, respelled=respelled)
    left = {id(o) for o in kept}
    for member in [obj, *(o for o in replay.roots if id(o) not in left)]:
        if _weakable(member):
            _results[member] = info
    arguments = {id(o) for o in replay.roots}
    for name, component in _components(obj):
        if id(component) not in arguments:  # an argument is its own entry's, or this one's as a root
            part = _Part(info, name)
            if pickled_here:  # as it is now, which is what the entry's graph was just pickled from
                part.expected, part.pickled_here = _pack_part(component, info), True
                if part.expected is None:
                    continue
            _parts[component] = part
    if not pickled_here:  # a hit, which gave the arguments it kept their state anew
        for given in kept:
            own = _results.get(given) if _weakable(given) else None
            if own is not None and own.pickled_here:  # its pickle's strings are no longer its own
                own.pickled_here, own.expected = False, None
            held = _parts.get(given) if _weakable(given) else None
            if held is not None and held.pickled_here:
                held.pickled_here, held.expected = False, None


def spellings_of(obj: Any) -> dict[str, str]:
    """The paths of the call `obj` came from and of the results it was given, as those calls wrote them
    (Note [Spellings] in spellings.py)."""
    try:
        info = _results.get(obj)
        if info is None:
            part = _parts.get(obj)
            info = part.whole if part is not None else None
    except TypeError:
        return {}
    return info.spellings if info is not None else {}


def holds(obj: Any) -> bool:
    """Whether `obj` came from a cached call of this process (its result, or an argument the call replayed
    onto), changed since or not: one weak membership, cheap enough for every `Module.to` (Note [Moves of
    cached results] in placement.py). Whether it is still the entry's is `result_key`'s question."""
    try:
        return obj in _results
    except TypeError:  # unhashable: never registered
        return False


def result_key(obj: Any, mapped: dict[tuple[str, int, int, str], Any] | None = None) -> str | None:
    """The entry `obj` belongs to (it was rebuilt from it, published as it, or changed by the call it
    holds), if it is unchanged since; else None. See Note [References]. `mapped` receives its storages
    that lie in the entry's mappings, for the rebuild of the call it is passed to, to reuse."""
    from . import rebuild

    try:
        info = _results.get(obj)
        if info is None:
            part = _parts.get(obj)
            return _part_key(obj, part, mapped) if part is not None else None
    except TypeError:
        return None
    live = info.live()
    if live is None:
        return None
    result, replay = live

    def expected() -> bytes:
        if info.expected is None:
            if info.pickled_here:
                info.expected = info.graph
            else:
                as_stored, placeholders = _skeleton(info)
                info.expected = rebuild.pack(as_stored, self_key=info.key, trust_mappings=True,
                                             substitutes=placeholders).graph
        return info.expected

    unchanged = _unchanged((result, replay.roots, info.random_after), info.key, replay.paths, expected, mapped)
    return info.key if unchanged else None


def _components(obj: Any) -> list[tuple[str, Any]]:
    """The components a result holds as its attributes (a pipeline's vae, text encoder, scheduler; a
    processor's tokenizer): the models and savable objects of its `__dict__`, by attribute name. A model
    has none: its modules are not attributes, and its config and generation config are keyed by value
    (nor is a miss of one to pack them again)."""
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict) or callable(getattr(obj, "named_modules", None)):
        return []
    found = []
    for name, value in state.items():
        if isinstance(name, str) and not isinstance(value, type) and \
                (callable(getattr(value, "named_modules", None)) or callable(getattr(value, "save_pretrained", None))) \
                and _weakable(value):
            found.append((name, value))
    return found


def _substitutes(whole: _Result) -> dict[str, Any]:
    # (an argument gone since is in no part: a part holds what it holds)
    return {p: o for p, r in whole.paths.items() if (o := r()) is not None}


def _pack_part(component: Any, whole: _Result) -> bytes | None:
    """`component` of the result of `whole` packed as `result_key` packs it; None where it cannot be."""
    from . import rebuild

    try:
        with rebuild.gc_paused():
            packed = rebuild.pack(component, self_key=whole.key, substitutes=_substitutes(whole))
    except (PackError, CorruptEntry):
        return None
    return None if packed.own else packed.graph


def _part_key(obj: Any, part: _Part, mapped: dict[tuple[str, int, int, str], Any] | None) -> str | None:
    """`result_key` of a component of an entry's result: "<entry key>/<attribute>" while it still is what
    the entry's graph holds there (Note [References])."""
    from . import rebuild

    whole = part.whole

    def expected() -> bytes | None:
        if part.expected is None:
            as_stored, placeholders = _skeleton(whole)
            state = getattr(as_stored[0], "__dict__", None)
            if not isinstance(state, dict) or part.name not in state:
                return None
            part.expected = rebuild.pack(state[part.name], self_key=whole.key, trust_mappings=True,
                                         substitutes=placeholders).graph
        return part.expected

    unchanged = _unchanged(obj, whole.key, _substitutes(whole), expected, mapped)
    return f"{whole.key}/{part.name}" if unchanged else None


def _skeleton(whole: _Result) -> tuple[Any, dict[str, Any]]:
    """The entry's graph unpickled here as its hit was (respelled: Note [Spellings] in spellings.py), with
    placeholders for the arguments it replayed onto."""
    from . import rebuild, spellings

    as_stored, placeholders = rebuild.skeleton(whole.graph, whole.key)
    if whole.respelled:
        spellings.respell(as_stored[0], as_stored[1], whole.respelled)
    return as_stored, placeholders


def _unchanged(obj: Any, key: str, substitutes: dict[str, Any], expected: Callable[[], bytes | None],
               mapped: dict[tuple[str, int, int, str], Any] | None) -> bool:
    """Whether `obj` is still what the entry `key` holds: every storage of it the entry's bytes, and its
    pickle what `expected()` says (computed once, by the caller); its storages go to `mapped` if so."""
    from . import rebuild

    try:
        # One pause for the whole check: the skeleton's objects die before any collection sees them.
        # Collected between the steps, they were promoted and counted toward the next full collection
        # of the whole heap (0.2 s in a kernel with torch and transformers imported), for garbage.
        with rebuild.gc_paused():
            packed = rebuild.pack(obj, self_key=key, substitutes=substitutes)
            if packed.own:
                return False  # a storage is not, or no longer, the entry's bytes
            want = expected()
    except (PackError, CorruptEntry):
        return False
    if want is None or packed.graph != want:
        return False
    if mapped is not None:
        mapped.update(packed.mapped)
    return True


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
# Each live object is registered as ONE entry's (`_results`): the entry of the call that made it, or of
# the last call that changed it in place (a base model PeftModel.from_pretrained injects layers into, the
# model load_adapter adds one to), whose check then covers the object's new state with the rest of that
# call's result. A cached result that a call only holds (a vae or UNet given to a pipeline) keeps its own
# entry's registration. Registered as the pipeline's, it was keyed by the pipeline's entry while that
# pipeline lived (a key that a process which had not made that pipeline computed otherwise: a miss and
# a second entry for one call) and by no entry once it was collected (the next load it was given to
# fell back, told it was changed). Whether the call changed an argument is asked once, by the miss,
# after the load (`result_key` of each argument, a pack each): the entry's meta names those still
# their entries' ("kept"), and every hit of it, in any process, reads the names instead of asking
# (`result_key` is as cheap on a hit as before). An entry whose meta names none registers them all,
# as it did before. A hit gives the arguments it replays onto their state anew, strings made by its own
# graph's unpickling included, which share otherwise than those of the graph a miss of this process
# pickled from the argument: a kept argument published here is compared with a skeleton from then on.
# A component of a result (`_components`: a pipeline's vae, text encoder, tokenizer or scheduler, an
# attribute of the result that is a model or savable) is registered apart (`_parts`, which `holds` never
# reads) as that entry's part, unless the call was given it (it is then its own entry's, or the call's
# root). It is keyed "<entry key>/<attribute>", the same in every process, while unchanged: its storages
# still the entry's and its pickle equal to the part of the entry's graph it came from, that attribute of
# a skeleton packed alone (the whole need not live). A miss of this process packs each component once
# after its publish, since the live objects share strings otherwise than a skeleton; a hit that replays
# onto a kept part makes it compared with a skeleton from then on, as above. Before, such a component was
# no entry's: `vae=p1.vae`, the common way to share components between pipelines, fell back, told the
# vae was changed.


def _weakable(obj: Any) -> bool:
    """Whether `obj` can be a key of `_results` (a transformers config defines __eq__: no hash)."""
    try:
        weakref.ref(obj)
        hash(obj)
        return True
    except TypeError:
        return False


# -- unpinning, off the finalizer's thread -------------------------------------------------------------

_unpins: queue.SimpleQueue[tuple[Client, str]] = queue.SimpleQueue()
_unpinner: threading.Thread | None = None
_unpinner_lock = threading.Lock()


def unpin(client: Client, key: str) -> None:
    """Unpin `key` for `client` soon, from a thread of ours: this runs in finalizers, which must not
    wait for the daemon. The thread starts with the first unpin, never at import; where no helper
    thread may or can start, the loading thread sends the unpins at its next load or cell (`send_unpins`,
    Note [Helper threads] in threads.py)."""
    global _unpinner
    _unpins.put((client, key))
    if _unpinner is None and threads.allowed():
        with _unpinner_lock:
            if _unpinner is None:  # None where no thread starts: as without helpers
                _unpinner = helper_threads.start(_unpin_loop, name="overmind-unpin")


def _forget_unpinner() -> None:
    global _unpinner, _unpinner_lock
    _unpinner = None  # a forked child (a warm kernel) has none of its parent's threads,
    _unpinner_lock = threading.Lock()  # nor one that holds the lock


os.register_at_fork(after_in_child=_forget_unpinner)


def _unpin_loop() -> None:
    while True:
        _answered(_send_unpin(*_unpins.get()))


def send_unpins() -> None:
    """Send the unpins that wait for no thread of ours, from this thread (never from a finalizer). Each is
    taken from the queue and sent with SIGINT held: a Ctrl-C between the two lost it, and the entry stayed
    pinned for as long as the kernel lived. The Ctrl-C is raised once the unpin is sent and answered (Note
    [Interrupted waits] in kernel_server/client.py). (Taken without waiting: another thread may have
    emptied the queue since it was looked at, and a wait there would hold the Ctrl-C.)"""
    while _unpinner is None and not _unpins.empty():  # (a hit's call looks: nothing held for an empty queue)
        with interrupts_held() as held:
            try:
                reply = _send_unpin(*_unpins.get_nowait())
            except queue.Empty:  # taken since by another thread: the loop ends at the empty queue
                reply = _no_reply
        try:
            held.raise_it()
        finally:
            _answered(reply)


def _no_reply() -> None:
    """The wait for an unpin that was not sent."""


def _send_unpin(client: Client, key: str) -> Callable[[], Any]:
    """Send the unpin of `key`; returns the wait for its reply (nothing to wait for without a daemon)."""
    if client.closed:
        return _no_reply
    try:
        return client.send(Op.UNPIN, key=key, timeout=10)
    except DaemonError:
        return _no_reply


def _answered(reply: Callable[[], Any]) -> None:
    """Wait for the reply of an unpin `_send_unpin` sent."""
    try:
        reply()
    except DaemonError:
        pass
