"""The cached call: key, daemon, rebuild on a hit, load and publish on a miss, plain load on any failure.

A miss is published inside the call, before it returns (Note [Atomic miss] in publishing.py). What the
call uses lives beside it, a module each: what it tells (`notices`: fallbacks, counts, warnings, which
this module passes on), the results it got from the cache (`results`: `result_key`, the unpinning), the
random generators' state (`randomness`), what a load logged (`load_log`), where a result goes
(`placement`) and the collector's and allocators' tuning around a hit (`hit_tuning`).

# Note [Never worse]
Every failure on the cache path (no key, no daemon, a daemon that dies mid-call, a full budget, an
unpicklable result, a corrupt entry) ends in the original call, and is recorded with its reason in
`fallbacks()` and warned once per label and reason (the label names the model, the reason the argument or
the result it is about: a loop over one call is told once, a load of another model again; docs/design.md
invariant 1). An exception raised by the
original call itself propagates unchanged, and its load is abandoned so that no entry is left.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernel_server import arena, descriptors
from kernel_server import settings as declared
from kernel_server.client import ANSWER_TIMEOUT, Client, Response, shared_client
from kernel_server.errors import DaemonError, DaemonLost, RemoteError, WaitTimeout
from kernel_server.operations import Op
from kernel_server.payloads import LookupReply
from kernel_server.transport import close_fds

from . import (
    dynamic_modules,
    hit_tuning,
    keys,
    library_classes,
    load_maps,
    notices,
    progress,
    randomness,
    results,
    spellings,
    targets,
    threads,
)
from .errors import CorruptEntry, EntryElsewhere, NoRoomHere, PackError, PublishError, RefusedByLibrary, Uncacheable
from .load_log import load_log, log_again, warn_again
from .notices import calls, clear_fallbacks, count, fall_back, fallbacks, tell_once
from .placement import (
    device_identities,
    elsewhere,
    place,
    plain_only,
    quantized,
    quantized_checkpoint,
    split_placement,
    too_large,
)
from .results import NO_REPLAY, Replay, remember, result_key, spellings_of

if TYPE_CHECKING:
    from .load_maps import LoadMap
    from .staging import Stage

__all__ = [
    "LoadOptions",
    "cached",
    "calls",
    "clear_fallbacks",
    "fallbacks",
    "flush_warnings",
    "options",
    "patched_call",
    "result_key",
]


@dataclass
class LoadOptions:
    """The options of the cached call: this process's values of the settings `wait_timeout`, `arena` (as
    `backing`) and `populate` (kernel_server/settings.py says what each means), read from the environment,
    then set from `overmind_jupyter.config` when the extension loads."""

    wait_timeout: float = field(default_factory=lambda: declared.get(declared.WAIT_TIMEOUT))
    backing: str = field(default_factory=lambda: declared.get(declared.ARENA))
    populate: bool = field(default_factory=lambda: declared.get(declared.POPULATE))


options = LoadOptions()


def flush_warnings(at_call: bool = False) -> None:
    """Emit the warnings of loads in other threads, and import what a hit imports once torch is imported
    (called at each load, `at_call`, and after each cell)."""
    notices.emit_deferred()
    unmapped = sys.modules.get(f"{__package__}.mappings")  # (imported by the first hit or miss)
    if unmapped is not None:
        unmapped.finish_unmapped()  # Note [Cleanup that Ctrl-C cannot cut short] in mappings.py
    results.send_unpins()  # those waiting for no helper thread (Note [Helper threads] in threads.py)
    hit_tuning.prepare(ahead=not at_call)  # Note [Imports ahead of the hit] in hit_tuning.py


# -- the cached call -------------------------------------------------------------------------------------

def cached(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn(*args, **kwargs)` through the cache: the patch-free form of what `%overmind on` does.

    Args:
        fn: a loader, typically a `from_pretrained` classmethod (`AutoModel.from_pretrained`).
        *args, **kwargs: its arguments.

    Returns:
        What `fn` returns: rebuilt from the daemon's shared memory on a hit, or loaded and then
        published for the next kernel on a miss. A `device_map` is read as the patched loaders read it
        (Note [Devices] in placement.py): the CPU load is cached and then placed on the one device
        asked for; a placement the cache cannot reproduce runs the call as made.
    """
    __tracebackhide__ = True  # Note [Our frames hidden]
    return patched_call(fn, args, kwargs)


def _runs_plainly(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `fn` must run plainly where it is called (Note [Meta loads] in placement.py), said once."""
    reason = plain_only()
    if reason is None:
        return False
    fall_back(_label(fn, args, kwargs), "empty_init", reason)
    return True


# What `_cached_call` returns for a call that must run as it was made, device map included (its reason
# told, the generators as the call found them): the caller makes it.
_AS_CALLED = object()
# What it returns for a call that falls back (its reason told): the caller makes the call it was given,
# outside any `except` of ours (Note [Our frames hidden]).
_PLAIN = object()


def _cached_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: Any = None) -> Any:
    """`fn(*args, **kwargs)` through the cache, for a result that goes to `device` next (None: it stays
    on the CPU); or `_AS_CALLED`, or `_PLAIN`."""
    __tracebackhide__ = True  # Note [Our frames hidden]
    started = time.perf_counter()  # a hit's or a miss's wait starts here (Note [Miss times] in progress.py)
    flush_warnings(at_call=True)
    label = _label(fn, args, kwargs)
    # storages of the references found unchanged (Note [References] in results.py)
    reuse: dict[tuple[str, int, int, str], Any] = {}
    try:
        with _library_held(None):  # the key reads torch's default dtype (Note [One library load at a time])
            ck = keys.make_key(fn, args, kwargs, resolve=lambda obj: result_key(obj, reuse))
    except Uncacheable as exc:
        fall_back(label, "uncacheable", str(exc))
        return _PLAIN
    except Exception as exc:  # noqa: BLE001 (a bug in keying must not break a load: never worse)
        fall_back(label, "key_error", f"{type(exc).__name__}: {exc}")
        return _PLAIN
    label = ck.label
    quantization = quantized_checkpoint(ck)
    if quantization is not None:  # Note [Quantized loads] in placement.py
        fall_back(label, "quantized", quantization)
        return _AS_CALLED
    replay = Replay.of(ck.references) if ck.references else NO_REPLAY
    client, reply = None, None
    try:
        shared_client()  # a daemon started by this call is not a wait for another load (Note [Miss times])
        asked = time.perf_counter()
        client, reply = _lookup(ck.key)
        queued = time.perf_counter() - asked
        drawn = reply["entries"][0]["meta"].get("random") if reply["status"] == "hit" else None
        # Note [Random loads] in randomness.py: the result depends on these generators' state
        called = ck
        if isinstance(drawn, list):
            _release_hit(client, reply)
            if _draws_on_device(label, drawn, device):
                return _AS_CALLED
            ck, client, reply = _random_lookup(ck, drawn)
        if reply["status"] == "hit":  # Note [Classes swapped in a library] in library_classes.py
            ck, client, reply = _bound_lookup(ck, client, reply)
    except DaemonError as exc:
        full = isinstance(exc, RemoteError) and exc.code == "descriptors_exhausted"  # Note [Descriptor budget]
        fall_back(label, "descriptors" if full else "daemon", str(exc))
        return _PLAIN
    except BaseException:
        _give_back(client, ck.key, reply)
        raise
    try:  # a Ctrl-C before `_hit`'s own `try` (Note [Pins a Ctrl-C cannot leave])
        if reply["status"] == "hit":
            return _hit(client, ck, reply, replay, reuse, device, started)
    except BaseException:
        _give_back(client, ck.key, reply)
        raise
    if reply["status"] != "load":
        fall_back(label, "daemon", f"unexpected lookup answer {reply['status']!r}")
        return _PLAIN
    try:
        from . import staging

        # a load followed for its draws (Note [Replayed draws] in draws.py): the replayed key's, or PEFT's first
        followed = ck.meta.get("random") == "replayed" or (ck is called and keys.owner_name(fn)[2] == "peft")
        with _loading_here(ck.key) as alone:
            if not alone:  # another thread of this kernel loaded it meanwhile: ask again (a hit, most likely)
                return _cached_call(fn, args, kwargs, device)
            clock = progress.MissClock(started, queued_s=queued)
            # Note [Staged conversions]
            with staging.staged(client, ck.key, client.home, options.backing,
                                clock if _an_auto_model(fn) else None) as stage:
                return _miss(client, ck, fn, args, kwargs, replay, device, stage, clock, called if followed else None)
    except BaseException:
        _give_back(client, ck.key, reply)
        raise


def _hit(client: Client, ck: keys.CallKey, reply: Response[LookupReply], replay: Replay,
         reuse: dict[tuple[str, int, int, str], Any], device: Any, started: float) -> Any:
    """The result rebuilt from the hit `reply`, or `_PLAIN` where it cannot be (said why)."""
    __tracebackhide__ = True  # Note [Our frames hidden]
    try:
        obj = _from_hit(client, ck, reply, replay, reuse, device)
        progress.hit(ck.key, time.perf_counter() - started, client)
        return obj
    except CorruptEntry as exc:
        _evict_quietly(client, ck.key)
        fall_back(ck.label, "corrupt", f"{exc}; the entry was evicted")
        return _PLAIN
    except EntryElsewhere as exc:  # Note [Tensors on a device] in placement.py
        fall_back(ck.label, "device", f"{exc}; the entry stays for the kernels that see that device")
        return _PLAIN
    except NoRoomHere as exc:
        fall_back(ck.label, "no_room", f"{exc}; the entry stays for the kernels that have room")
        return _PLAIN
    except BaseException:
        _give_back(client, ck.key, reply)  # where `_from_hit` had not taken it yet
        raise


# Note [Hits inside inference_mode]
# A model loaded inside `torch.inference_mode()` is trained in a later cell: the plain load's parameters
# are ordinary tensors there (transformers assigns the checkpoint's tensors, made outside the mode), and
# only buffers computed while the model is built (rotary frequencies) are inference tensors. A hit made
# every tensor inside the mode, so backward and in-place updates raised "Inference tensors cannot be saved
# for backward". The rebuild runs outside it: all its tensors are ordinary ones, buffers included (an
# ordinary buffer does all an inference one does, and more).


def _give_back(client: Client | None, key: str, reply: Response[LookupReply] | None) -> None:
    """What the daemon's answer to a lookup of `key` holds, where the call ends before the code that takes
    it (Note [Interrupted caching]): a hit's pins and descriptors (none once `_from_hit` took them), or the
    load (unless another thread of this kernel loads it: the connection is theirs too)."""
    if client is None or reply is None:
        return
    if reply["status"] == "hit":
        if reply.fds:
            _release_hit(client, reply)
    elif reply["status"] == "load":
        with _loads_here_lock:
            held = _loads_here.get(key)
        if held is None or held[0] == threading.get_ident():
            _abandon(client, key)


# Note [Our frames hidden]
# An exception of the load itself goes through the cached call's frames (the patched loader, the cached
# call, the miss) on its way to the cell: frames of ours that a plain load's traceback does not show,
# between the user's line and the library's. Each sets `__tracebackhide__`, which IPython's tracebacks
# honour ("[... skipping hidden 6 frame]"; `%config InteractiveTB.skip_hidden = False` shows them). A
# load that falls back is called where no exception of ours is being handled (`_PLAIN`), so that its
# own exception does not carry ours as its context. A bug of ours is raised by a frame of ours, the
# last one, which IPython never hides.


# Note [One library load at a time]
# transformers' `from_pretrained` is not safe in threads: while it builds a model it sets state of the
# whole process and puts back what it found after: torch's default dtype (`local_torch_dtype`) and
# `PreTrainedModel.tie_weights` (a no-op, `initialization.no_tie_weights`); diffusers patches
# `nn.Module.register_parameter` the same way (accelerate's `init_empty_weights`). Two loads in two
# threads build with each other's settings and may leave them set for good. Measured (transformers
# 5.25): two threads loading a tied bf16 and fp16 checkpoint three times each got models with
# parameters of both dtypes and `lm_head` apart from the embeddings, and left the process's default
# dtype fp16. With the cache on, such a miss was published, and every later hit in every kernel was
# served the wrong model. So a library's loader (a method of a class of transformers, diffusers or
# peft, or of a class derived from one: `from_pretrained`, patched or given to `cached`) makes its
# whole cached call (key, lookup, hit or load and publish, placement) holding one reentrant lock of
# the process. The key takes it too, for every call, since it reads torch's default dtype (Note
# [Torch's default dtype] in keys.py), which another thread's load sets while it builds. A function of
# the user's (or a method of another class) given to `cached` runs without it, and its own loads take
# it: so one that starts a thread loading a model, and waits for that thread, waits for nothing it
# holds. What it costs: a hit waits for another thread's load to end, and loads in threads take the
# sum of their times rather than overlapping (wrongly). A thread that waits more than `_WAIT_TOLD_S`
# is told why, once. A library's own code that started a thread loading through the cache and waited
# for it would wait forever; no library does. Loads that do not go through the cache still race among
# themselves, as without it (Note [Tying switched off]).
_library = threading.RLock()
_WAIT_TOLD_S = 2.0
_LIBRARIES = frozenset(t.module.split(".")[0] for t in targets.TARGETS if not t.move)


def _library_loader(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is a method of a library's class, or of a class derived from one."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", None) if inspect.ismethod(fn) else None
    cls = owner if isinstance(owner, type) else type(owner)
    return owner is not None and any(c.__module__.split(".")[0] in _LIBRARIES for c in cls.__mro__)


@contextlib.contextmanager
def _library_held(fn: Callable[..., Any] | None) -> Iterator[None]:
    """Hold the lock of Note [One library load at a time] for a call of `fn`, if it is a library's
    loader (None: for any call, as the key does)."""
    if fn is not None and not _library_loader(fn):
        yield
        return
    if not _library.acquire(timeout=_WAIT_TOLD_S):
        tell_once("one_load", f"overmind: {_label(fn) if fn is not None else 'a load'} waits for a load in "
                  "another thread of this kernel to end: transformers and diffusers cannot build two models "
                  "at once in one process, so loads here run one at a time")
        _library.acquire()
    try:
        yield
    finally:
        _library.release()


# Note [Loads in the user's threads]
# A kernel's threads share its connection, and the daemon tells a connection that loads a key to load it
# (its own retry), so threads of one kernel that asked for one model at once each loaded it, and all but
# the first fell back at the publish, with a warning each. The daemon cannot tell the threads apart; this
# process can. A thread told to load a key that another of its threads loads waits for that load to end,
# as another kernel would, then asks again: a hit, or the load itself where that one failed. A thread
# asking again inside its own load of that key (a loader that calls itself) loads it, as before. (Two
# threads calling one library loader never get here at once: Note [One library load at a time]; this
# is for the user's functions given to `cached`.)
_loads_here: dict[str, tuple[int, threading.Event]] = {}  # key -> (its loading thread, set at the load's end)
_loads_here_lock = threading.Lock()


def _forget_loads_here() -> None:
    global _loads_here_lock, _library
    _loads_here.clear()  # a forked child has none of its parent's threads, whose loads would never end here
    _loads_here_lock = threading.Lock()
    _library = threading.RLock()


os.register_at_fork(after_in_child=_forget_loads_here)


@contextlib.contextmanager
def _loading_here(key: str) -> Iterator[bool]:
    """While this thread loads `key`; False where another thread of this process loaded it meanwhile and
    this one waited for it to end (Note [Loads in the user's threads])."""
    me = threading.get_ident()
    with _loads_here_lock:
        held = _loads_here.get(key)
        if held is None:
            done = threading.Event()
            _loads_here[key] = (me, done)
    if held is not None:
        if held[0] != me:
            held[1].wait(options.wait_timeout)
        yield held[0] == me
        return
    try:
        yield True
    finally:
        with _loads_here_lock:
            _loads_here.pop(key, None)  # (gone already in a child forked during the load)
        done.set()


def _random_lookup(ck: keys.CallKey, drawn: list[str]) -> tuple[keys.CallKey, Client, Response[LookupReply]]:
    """The key to load or map for a call whose marker says that its load draws from the generators
    `drawn`, with the connection and the lookup's answer (Note [Random loads] in randomness.py): the key
    of a result that does not depend on the draws (Note [Replayed draws] in draws.py), else that of the
    generators' state, which a seeded kernel finds first."""
    if randomness.replayable(drawn):
        followed = randomness.replayed(ck)
        client, reply = _lookup(followed.key)
        if reply["status"] == "hit":
            if not isinstance(reply["entries"][0]["meta"].get("random"), list):
                return followed, client, reply
            _release_hit(client, reply)  # a marker: the result depends on the draws
        elif reply["status"] == "load":  # this connection loads it, unless this state's entry is there
            keyed = _state_key(ck, drawn)
            state = client.request(Op.LOOKUP, key=keyed.key, wait=False, timeout=ANSWER_TIMEOUT)
            if state["status"] == "hit":
                _abandon(client, followed.key)
                return keyed, client, state
            if state["status"] == "load":
                _abandon(client, keyed.key)
            return followed, client, reply
    now = randomness.only(randomness.random_state(), drawn)  # (read once: a millisecond)
    keyed = randomness.under_random_state(ck, now)
    client, reply = _lookup(keyed.key)
    if reply["status"] == "load":
        keyed.notice = (ck.label, drawn, "", randomness.just_seeded(now))
    return keyed, client, reply


def _bound_lookup(ck: keys.CallKey, client: Client,
                  reply: Response[LookupReply]) -> tuple[keys.CallKey, Client, Response[LookupReply]]:
    """The hit `reply` of `ck` where the library modules of its graph bind the classes they bound when it
    was cached; else the key of `ck` for the classes bound here, with its lookup's answer (Note [Classes
    swapped in a library] in library_classes.py)."""
    bound = reply["entries"][0]["meta"].get("bindings")
    if not isinstance(bound, dict):
        return ck, client, reply
    now = library_classes.bindings(bound)
    if now == bound:
        return ck, client, reply
    _release_hit(client, reply)
    ck = library_classes.under_bindings(ck, now)
    client, reply = _lookup(ck.key)
    return ck, client, reply


def _state_key(ck: keys.CallKey, drawn: list[str]) -> keys.CallKey:
    """The key of `ck` for the current state of the generators `drawn` (read only where it is needed: a
    millisecond, Note [Random loads] in randomness.py)."""
    return randomness.under_random_state(ck, randomness.only(randomness.random_state(), drawn))


def _tell_seed(label: str, drawn: list[str], why: str, seed: int | None) -> None:
    """Say that `label` is cached per state of the generators `drawn`: because its result depends on what
    it draws (`why`: what showed it), or else because this kernel's state has no entry yet. `seed`: the
    load started from `torch.manual_seed(seed)`, nothing drawn since (seeding is then no advice)."""
    cause = f" and its result depends on them ({why})" if why else ""
    cached = f"overmind: {label} draws random numbers while it loads{cause}, so it is cached for the state of the " \
             f"{' and '.join(drawn)} generator it starts from"
    if seed is not None:
        tell_once(label, f"{cached}: here torch.manual_seed({seed}), nothing drawn since. A kernel that seeds it "
                         "so before this load (after a restart too) shares this entry")
        return
    missed = "" if why else ", and this kernel's is another one"
    tell_once(label, f"{cached}{missed}: seed it (torch.manual_seed) before the load to share one entry across "
                     "restarts")


def _miss(client: Client, ck: keys.CallKey, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          replay: Replay, device: Any, stage: Stage | None, clock: progress.MissClock,
          called: keys.CallKey | None = None) -> Any:
    """Load `ck` (this connection is its loader) and publish it before returning; or `_AS_CALLED`.
    `called`: the call's own key (`ck` itself, or `ck` is the key of its result without the draws) where
    the load is followed (Note [Replayed draws] in draws.py)."""
    __tracebackhide__ = True  # Note [Our frames hidden]
    young = hit_tuning.LoadCollections()  # Note [A miss's load born old] in hit_tuning.py
    try:
        return _load_and_publish(client, ck, fn, args, kwargs, replay, device, stage, clock, called, young)
    finally:
        young.end()


def _load_and_publish(client: Client, ck: keys.CallKey, fn: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any], replay: Replay, device: Any, stage: Stage | None,
                      clock: progress.MissClock, called: keys.CallKey | None,
                      young: hit_tuning.LoadCollections) -> Any:
    """`_miss`'s work, with the collector's tuning `young` entered around the load."""
    __tracebackhide__ = True  # Note [Our frames hidden]
    label = ck.label
    following: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if called is not None:
        from . import draws

        following = draws.following()
    try:  # this connection is the loader now: whatever ends the call abandons the load
        # The generators' state as the load starts: a plain hit needs none (nothing since the call began
        # drew a random number), and reading them all costs a millisecond (Note [Random loads]).
        before = randomness.random_state()
        progress.flush_hit_times(client)
        loaded = time.perf_counter()
        with (load_log() as said, progress.loading(client, ck.key, ck.label),  # Note [Load progress]
              load_maps.files_mapped() as maps,  # Note [Files the load maps] in load_maps.py
              following as drew, young):
            obj = fn(*args, **kwargs)
        clock.load_s += time.perf_counter() - loaded  # Note [Miss times] in progress.py
    except BaseException:
        _abandon(client, ck.key)
        raise
    keyed: keys.CallKey | None = ck
    try:  # whatever ends the caching gives the load up too (Note [Interrupted caching])
        told = {name: what for name, what in (("log", said.log), ("warned", said.warned)) if what}
        ck.meta |= told  # Note [What the load said] in load_log.py
        changed = keys.changed_since(ck)
        if changed is not None:  # the load may have read the new files: never publish them under the old key
            _abandon(client, ck.key)
            fall_back(label, "changed", f"{changed} changed while it was loading; the result is not cached")
            return obj
        apart = _ties_apart(obj)  # Note [Tying switched off]
        if apart is not None:
            _abandon(client, ck.key)
            fall_back(label, "untied", f"{apart} should be tied and is not: transformers' `tie_weights` does "
                      "nothing in this process (two `from_pretrained` calls in two threads at once leave it so). "
                      "The result is not cached; restart the kernel, and load one model at a time")
            return obj
        after = randomness.random_state()
        drawn = randomness.drawn(before, after)
        state = randomness.only(after, drawn) if drawn else None
        # a followed load's: "" when its result does not depend on the draws (Note [Replayed draws] in draws.py)
        why = _why_dependent(drew, drawn, before, after) if called is not None and drawn else None
        if why == "":
            state = (("torch-draws", drew.ops),)
            if ck is called:  # on the call's first miss its key becomes the marker that sends lookups on
                keyed = _mark_random(client, ck, randomness.replayed(ck), drawn)
        elif why or (drawn and not ck.meta.get("random")):  # it drew random numbers: Note [Random loads]
            keyed = _mark_random(client, ck, randomness.under_random_state(called or ck,
                                                                           randomness.only(before, drawn)), drawn)
            if keyed is not None and why:
                keyed.notice = (label, drawn, why, randomness.just_seeded(randomness.only(before, drawn)))
        if keyed is not None:
            keyed.meta |= told  # a key of the state, or of the result without the draws, says it too
            _publish(client, keyed, obj, replay, state, stage, maps, clock)
        if drawn and _draws_on_device(ck.label, drawn, device):
            randomness.set_random_state(randomness.only(before, drawn))  # the call as made starts where it did
            return _AS_CALLED
        return obj
    except BaseException:
        _abandon(client, ck.key)
        if keyed is not None and keyed is not ck:
            _abandon(client, keyed.key)
        raise


# Note [Tying switched off]
# While transformers builds a model, `from_pretrained` puts a no-op in the place of
# `PreTrainedModel.tie_weights` and puts back what it found after (`initialization.no_tie_weights`): a
# class attribute, for every thread. Two loads in two threads at once can each put back the other's
# no-op, and then `tie_weights` does nothing in that process for good. Every later load of a model with
# tied embeddings has them apart, and where the checkpoint leaves the tied copy out (most do), the copy
# is drawn at random: the model is wrong, and nothing says so. So a miss that finds the no-op in place
# when its load returns checks the ties its transformers models expect (`get_expanded_tied_weights_keys`);
# one found apart keeps the result out of the cache, so that no other kernel is served it, and the
# user is told why. A model without ties is cached as ever. Loads through the cache run one at a time
# (Note [One library load at a time]), so the no-op left in place comes from loads that went past it:
# before `%overmind on`, under `%overmind off`, or of a class the cache does not patch.
def _ties_apart(obj: Any) -> str | None:
    """The first tie that a transformers model in `obj` expects and lacks, where transformers' tying is
    switched off in this process (Note [Tying switched off]); None otherwise."""
    modeling = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling, "PreTrainedModel", None)
    if not isinstance(pretrained, type) or getattr(vars(pretrained).get("tie_weights"), "__qualname__", "") != \
            "no_tie_weights.<locals>.empty_func":
        return None
    model_class: Any = pretrained
    components = getattr(obj, "components", None)  # a diffusers pipeline's models
    for root in (obj, *(components.values() if isinstance(components, dict) else ())):
        modules: list[Any] = list(root.modules()) if callable(getattr(root, "modules", None)) else []
        for module in modules:
            if not isinstance(module, model_class):
                continue
            try:
                for target, source in module.get_expanded_tied_weights_keys().items():
                    if module.get_parameter(target) is not module.get_parameter(source):
                        return f"{type(module).__name__}.{target}"
            except Exception:  # noqa: BLE001 (a model whose ties cannot be read: not cached either)
                return f"{type(module).__name__}'s tied weights"
    return None


# Note [Interrupted caching]
# A KeyboardInterrupt (the user stops the cell) can come after the load, while its result is cached: the
# pack, or the copy of a large model into its arena, seconds long; or before it, between the lookup that
# made this connection the loader and the load (the stage's arena is made there). The kernel lives on with
# its connection, so the daemon would keep the load in flight, with the arena's bytes reserved out of the
# budget, and every other kernel asking for the model would wait for it for as long as that kernel lives
# (and then say that the load was still running). So whatever ends the caching abandons the load (each key
# this connection loads: the call's, and the one its result goes under where it drew random numbers)
# before the exception goes on; an entry already published is no load, and its abandon does nothing. A
# hit's answer holds the entries' pins and descriptors until `_from_hit` takes them: an interrupt before
# that gives them back (`_give_back`), or the entry could never be evicted while the kernel lives.


# Note [Draws on a device]
# A load that draws random numbers (weights the checkpoint lacks: a new head) draws them where the
# weights are made. With a device map transformers makes the missing weights on the device the map
# names and initialises them there, from that device's generator; the cache loads on the CPU, from the
# CPU's generator: other weights, and another generator advanced than the plain load's. So a load onto a
# device that draws from torch's generator runs as called. That it draws is known from the entry's
# marker (Note [Random loads] in randomness.py) before anything is loaded; on a miss, only after the CPU
# load, which is published (a CPU load of that state is a hit) before the generators are put back where
# the call found them and the call runs as made.
def _why_dependent(drew: Any, drawn: list[str], before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """Why the result of a load followed by `drew` (draws.Draws) may depend on what it drew from the
    generators `drawn`; "": it does not (Note [Replayed draws] in draws.py)."""
    from . import draws

    why = drew.independent() or ("" if randomness.replayable(drawn) else
                                 f"it drew from the {' and '.join(drawn)} generators")
    if not why and not draws.replays(drew.ops, dict(before)["torch"], dict(after)["torch"]):
        why = "replaying its draws did not give the generator's state after it"
    return why


def _draws_on_device(label: str, drawn: list[str], device: Any) -> bool:
    """Whether a load that drew from the generators `drawn` and goes to `device` must run as called
    (Note [Draws on a device]); the reason is told."""
    if device is None or "torch" not in drawn:
        return False
    fall_back(label, "random_device", f"it initialises weights the checkpoint lacks at random, which a load "
                                      f"onto {device} draws from that device's generator and the cache from "
                                      "the CPU's: load it without device_map to cache it and move it after, "
                                      "or save_pretrained the model once and load that")
    return True


def _mark_random(client: Client, marker: keys.CallKey, keyed: keys.CallKey, drawn: list[str]) -> keys.CallKey | None:
    """Turn `marker` (whose load this connection holds) into a marker of a load that drew from the
    generators `drawn`, which sends lookups on (Note [Random loads] in randomness.py), and return `keyed`,
    where they go, if this connection may load it; None leaves the result uncached (another kernel holds
    or loads that key, or the daemon went away)."""
    from . import publishing

    try:
        reply = client.request(Op.LOOKUP, key=keyed.key, wait=False, timeout=ANSWER_TIMEOUT)
        if reply["status"] == "hit":
            _release_hit(client, reply)
        publishing.publish_marker(client, marker.key, marker.meta | {"random": drawn})
    except (DaemonError, PublishError) as exc:
        _abandon(client, marker.key)
        fall_back(marker.label, "publish", str(exc), loaded=True)
        return None
    return keyed if reply["status"] == "load" else None


def _release_hit(client: Client, reply: Response[LookupReply]) -> None:
    """A hit that this process will not map (a marker's) pinned its entries and sent their descriptors:
    give both back now."""
    reply.close()
    for e in reply["entries"]:
        results.unpin(client, e["key"])


# Note [A miss's collections]
# A load leaves thousands of young objects (its modules, their dicts, tensors); the publish that follows
# allocated enough to trigger two young collections, which traverse them all, and one of the middle
# generation: about 0.8 ms of a same-dtype 1.1B miss. The plain load leaves those objects to the user's
# next allocations. The collector now pauses while the miss packs and publishes (what it allocates is
# freed as it goes, by reference counts). The one young collection due when it resumes (0.4 ms) runs
# instead while the daemon answers the publish, when the thread would only wait; where the user turned
# the collector off, none runs.
def _publish(client: Client, ck: keys.CallKey, obj: Any, replay: Replay, random_after: tuple[Any, ...] | None,
             stage: Stage | None, maps: list[LoadMap], clock: progress.MissClock) -> None:
    """Make `obj` the entry of `ck` before the call returns (Note [Atomic miss] in publishing.py), with
    the generators' state after the call for a load that drew random numbers (Note [Random loads]);
    `stage`: where the load's conversions were written (Note [Staged conversions] in staging.py); `maps`:
    the files it mapped through us (Note [Files the load maps] in load_maps.py). The collector pauses
    meanwhile (Note [A miss's collections]). Then what `ck.notice` holds is said."""
    from . import publishing, rebuild

    kept = _kept(ck)  # before the pack and publish move anything (Note [References] in results.py)
    with rebuild.gc_paused() as collecting:
        try:
            packed = rebuild.pack((obj, replay.roots, random_after), substitutes=replay.paths, stage=stage,
                                  what=f"the result ({type(obj).__name__})")
            devices = device_identities(packed.devices)  # Note [Tensors on a device] in placement.py
        except PackError as exc:
            _abandon(client, ck.key)
            fall_back(ck.label, "unpicklable", f"{exc}; it was loaded normally and will not be cached")
            return
        spelled = _spellings(ck)

        def describe() -> dict[str, Any]:  # the entry's meta, made while the daemon reserves its arena
            meta = ck.meta | dynamic_modules.describe(packed.graph, ck.sources[0][0] if ck.sources else None,
                                                      ck.code)
            # Note [Classes swapped in a library] in library_classes.py
            bound = library_classes.bindings(packed.modules)
            if bound:
                meta["bindings"] = bound
            if devices:
                meta["devices"] = devices
            if packed.next_hook_id:
                meta["hook_ids"] = packed.next_hook_id  # Note [Hook ids] in rebuild.py
            if spelled:
                meta["spellings"] = spelled  # Note [Spellings] in spellings.py
            if kept:
                meta["kept"] = kept  # Note [References] in results.py
            return meta

        try:
            with progress.loading(client, ck.key, ck.label):  # the copy reports too (Note [Load progress])
                times = publishing.publish(client, ck.key, ck.label, describe, packed, backing=options.backing,
                                           watch=[path for path, _, _ in ck.sources if os.path.isabs(path)],
                                           unpin=lambda key: results.unpin(client, key), stage=stage,
                                           load_maps=maps, clock=clock,
                                           meanwhile=_collect_young if collecting else None)
        except PublishError as exc:
            fall_back(ck.label, exc.kind, str(exc), loaded=True)
            return
        except Exception as exc:  # noqa: BLE001 (a bug in publishing must not break a load: never worse)
            _abandon(client, ck.key)  # the result is still the plain load's bytes, wherever they lie now
            said = f"{type(exc).__name__}: {exc}" + (f"; {descriptors.short_here(exc)}" if descriptors.exhausted(exc)
                                                      else "")
            fall_back(ck.label, "publish", said, loaded=True)
            return
        count("miss")
        remember(obj, ck.key, packed.graph, replay, pickled_here=True, random_after=random_after,
                 spellings=_every_spelling(spelled), kept=[ck.references[name] for name in kept])
        progress.tell_miss(ck.label, times, clock.queued_s)
        if ck.notice is not None:
            _tell_seed(*ck.notice)


def _kept(ck: keys.CallKey) -> list[str]:
    """The arguments of `ck`'s call, just loaded, that are still their entries' (the call only holds
    them): they stay registered as those entries' (Note [References] in results.py)."""
    try:
        return sorted(name for name, given in ck.references.items() if result_key(given) is not None)
    except Exception:  # noqa: BLE001 (a bug here must not break a load: every argument registered, as before)
        return []


def _kept_by(ck: keys.CallKey, meta: dict[str, Any]) -> list[Any]:
    """The arguments of `ck`'s call that the miss of its entry found still their entries' (`_kept`)."""
    kept = meta.get("kept")
    if not isinstance(kept, list):
        return []
    return [ck.references[name] for name in kept if isinstance(name, str) and name in ck.references]


def _an_auto_model(fn: Callable[..., Any]) -> bool:
    """Whether `fn` is a loader of one of transformers' Auto model classes (AutoModelForCausalLM, ...)."""
    owner = getattr(fn, "__self__", None)
    return isinstance(owner, type) and any(c.__name__ == "_BaseAutoModelClass" for c in owner.__mro__)


def _spellings(ck: keys.CallKey) -> dict[str, dict[str, str]]:
    """The paths of the call as it wrote them (`""`), and of each cached result it is given, by argument
    name, as that result's own call wrote them (Note [Spellings] in spellings.py)."""
    out = {"": ck.spellings} if ck.spellings else {}
    for name, obj in ck.references.items():
        given = spellings_of(obj)
        if given:
            out[name] = given
    return out


def _every_spelling(spelled: dict[str, dict[str, str]]) -> dict[str, str]:
    """What a result's call and the results it was given wrote, by real path: its own first."""
    out: dict[str, str] = {}
    for paths in spelled.values():
        for real, written in paths.items():
            out.setdefault(real, written)
    return out


def _collect_young() -> None:
    gc.collect(0)


def _label(fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> str:
    """A call that has no key (yet) by its function, and by its checkpoint (and subfolder) where it names
    one: its first positional argument that is a path or a name (the second of `PeftModel.from_pretrained(
    base, "adapters/fr")`), else a checkpoint keyword: the model a fallback is about (Note [Never worse])."""
    kwargs = kwargs or {}
    named = [a for a in args if isinstance(a, str | os.PathLike)][:1] or \
        [kwargs[p] for p in keys.SOURCE_PARAMS if isinstance(kwargs.get(p), str | os.PathLike)][:1]
    shown = [repr(os.fspath(v)) for v in named]
    if isinstance(kwargs.get("subfolder"), str):
        shown.append(f"subfolder={kwargs['subfolder']!r}")
    return f"{keys.owner_name(fn)[1]}({', '.join([*shown, '...'])})"


def _to_a_real_gpu(device: Any) -> bool:
    """Whether a result goes to a CUDA device next (a simulated one, OVERMIND_FAKE_GPUS, leaves it here)."""
    return getattr(device, "type", None) == "cuda" and not declared.get(declared.FAKE_GPUS)


def _from_hit(client: Client, ck: keys.CallKey, reply: Response[LookupReply], replay: Replay,
              reuse: dict[tuple[str, int, int, str], Any], device: Any = None) -> Any:
    import torch

    from . import mappings, rebuild

    def unpin(key: str) -> None:
        results.unpin(client, key)

    entries = reply["entries"]
    taken = _Taken(client, entries)
    # taken, with the pins: given back from here on by the `finally` (Note [Pins a Ctrl-C cannot leave])
    taken.fds, reply.fds = reply.fds, []
    try:
        fds = taken.fds
        cannot = elsewhere(entries[0]["meta"].get("devices") or {})
        if cannot is not None:  # before anything is mapped (Note [Tensors on a device] in placement.py)
            raise EntryElsewhere(cannot)
        for e in reversed(entries):  # the entries it builds on first: Note [Code in the checkpoint]
            dynamic_modules.prepare(e["meta"])
        expected = 1 + sum(1 + len(e.get("parts", [])) + len(e.get("sources", [])) for e in entries)
        if len(fds) != expected:
            raise CorruptEntry(f"the daemon sent {len(fds)} descriptors for {len(entries)} entries, not {expected}")
        graph = arena.read_all(fds[0])
        arenas = {}
        at = 1
        for e in entries:
            parts = [arena.Part(fd, offset, nbytes) for (offset, nbytes), fd in zip(e.get("parts", []), fds[at + 1:],
                                                                                   strict=False)]
            sources = [arena.SourceFile(fd, {k: s[k] for k in ("dev", "ino", "size", "mtime_ns", "ctime_ns")},
                                        s.get("path", ""))
                       for s, fd in zip(e.get("sources", []), fds[at + 1 + len(parts):], strict=False)]
            arenas[e["key"]] = rebuild.ArenaRef(e["key"], fds[at], e["arena_bytes"], e.get("pieces", []), sources,
                                                parts)
            at += 1 + len(parts) + len(sources)

        born_old = hit_tuning.born_old()
        with rebuild.gc_paused(), torch.inference_mode(False):  # Note [Hits inside inference_mode]
            # a result bound for a GPU leaves the arena's pages at once: mapping them ahead would be for nothing
            rebuilt = rebuild.rebuild(graph, arenas, ck.key, on_unmap=unpin, held=taken.held,
                                      populate=options.populate and threads.allowed()  # Note [Helper threads]
                                      and not _to_a_real_gpu(device),
                                      arguments=replay.paths, reuse=reuse)
            if born_old:
                hit_tuning.promote()  # Note [Old at birth] in hit_tuning.py
        if not (isinstance(rebuilt, tuple) and len(rebuilt) == 3 and isinstance(rebuilt[1], list)
                and (rebuilt[2] is None or isinstance(rebuilt[2], tuple))):
            raise CorruptEntry(f"the entry holds a {type(rebuilt).__name__}, not (result, arguments, random state)")
        obj, _roots, random_after = rebuilt
    finally:
        try:
            mappings.uninterrupted(taken.give_back)
        except KeyboardInterrupt:  # it may have landed before SIGINT was held, with nothing given back yet
            taken.give_back()
            raise
    meta, spelled = entries[0]["meta"], _spellings(ck)
    respelled = spellings.found(meta.get("spellings"), spelled, list(ck.references))
    if respelled:  # this call spells a path otherwise than the entry's (Note [Spellings] in spellings.py)
        spellings.respell(obj, _roots, respelled)
    remember(obj, ck.key, graph, replay, pickled_here=False, random_after=random_after,
             spellings=_every_spelling(spelled), respelled=respelled, kept=_kept_by(ck, meta))
    _hooks_after(meta.get("hook_ids"))
    log_again(spellings.respell_said(meta.get("log") or [], respelled))  # Note [What the load said] in load_log.py
    warn_again(spellings.respell_said(meta.get("warned") or [], respelled))
    if random_after is not None:
        randomness.set_random_state(random_after)  # as the plain load leaves the generators (Note [Random loads])
    count("hit")
    return obj


# Note [Pins a Ctrl-C cannot leave]
# A hit's answer pins its entries at the daemon and carries their descriptors. `_from_hit` takes both
# from the reply in one step (`_Taken`: before it, `_give_back` gives them back; no instruction between
# the two can raise) and gives back, in its `finally`, whatever a registered mapping does not hold by
# then: the descriptors all (each mapping holds its own duplicates), and the pin of each entry not in
# `held`. An entry's key goes into `held` in the same uninterrupted step (`mappings.uninterrupted`) that
# maps it and registers the mapping, whose death unpins it from then on: a Ctrl-C landing before that
# step leaves the pin to the `finally`, one landing inside it is raised at its end. The giving back
# itself runs with SIGINT held, and runs again where the Ctrl-C landed before the hold (it is done once:
# a descriptor closed twice may be another's by then, a pin released twice another holder's). A Ctrl-C
# anywhere in a hit (measured: 1 in 40 interrupted `from_pretrained` hits of a 114 MiB model landed in
# the closing of the descriptors) thus leaves no pin and no descriptor once the hit's objects are gone;
# before, it could leave the entry pinned for as long as the kernel lived (never evicted for the budget)
# and the descriptors open.
class _Taken:
    """A hit's descriptors and pins, taken from its reply by `_from_hit` (Note [Pins a Ctrl-C cannot leave])."""

    __slots__ = ("client", "done", "fds", "held", "keys")

    def __init__(self, client: Client, entries: list[Any]) -> None:
        self.client = client
        self.keys = [e["key"] for e in entries]
        self.fds: list[int] = []
        self.held: set[str] = set()  # the entries whose pins registered mappings hold now
        self.done = False

    def give_back(self) -> None:
        """Close the descriptors and unpin the entries no mapping holds; once."""
        if self.done:
            return
        self.done = True
        try:
            close_fds(self.fds)
        finally:
            for key in self.keys:
                if key not in self.held:
                    results.unpin(self.client, key)


def _hooks_after(next_id: Any) -> None:
    """Hooks registered from now on take ids past the hit's (Note [Hook ids] in rebuild.py)."""
    if type(next_id) is int:
        from torch.utils.hooks import RemovableHandle

        RemovableHandle.next_id = max(RemovableHandle.next_id, next_id)


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

def _lookup(key: str) -> tuple[Client, Response[LookupReply]]:
    """Ask the daemon for `key` (waiting while another kernel loads it). When the connection breaks
    (the daemon was killed since the last request, or while we waited for another kernel's load), ask
    once more: the shared client starts the next daemon, and the load is cached there instead of
    falling back. A daemon lost twice in a row is a fallback."""
    for attempt in (1, 2):
        try:
            client = shared_client()
            # a long wait for another kernel's load, a short one for the daemon (Note [Two kinds of waiting]);
            # the young generation is collected while the daemon answers (Note [Old at birth] in hit_tuning.py)
            return client, client.request_alive(Op.LOOKUP, options.wait_timeout, meanwhile=hit_tuning.collect_young,
                                                key=key, wait=True)
        except WaitTimeout:  # the daemon answered all along: what ran out is the wait for the other load
            raise WaitTimeout(f"another kernel's load of it was still running after {options.wait_timeout:g} s, "
                              "the longest this call waits (OVERMIND_WAIT_TIMEOUT, or c.Overmind.wait_timeout: "
                              "raise it to wait longer)") from None
        except DaemonLost:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


# -- the patched loaders' entry point --------------------------------------------------------------------

def patched_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a patched `from_pretrained` does, and `cached`: the cached call on CPU, then the placement
    the caller asked for with `device_map` (see Note [Devices] in placement.py); the call as made where
    the cache cannot reproduce it. A library's loader runs one at a time in this process (Note [One
    library load at a time])."""
    __tracebackhide__ = True  # Note [Our frames hidden]
    with _library_held(fn):
        return _patched_call(fn, args, kwargs)


def _patched_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    __tracebackhide__ = True  # Note [Our frames hidden]
    if _runs_plainly(fn, args, kwargs):
        return fn(*args, **kwargs)
    quantization = quantized(kwargs)
    if quantization is not None:  # Note [Quantized loads] in placement.py
        fall_back(_label(fn, args, kwargs), "quantized", quantization)
        return fn(*args, **kwargs)
    try:
        split = split_placement(kwargs)
    except Uncacheable as exc:
        if not isinstance(exc, RefusedByLibrary):
            fall_back(_label(fn, args, kwargs), "uncacheable", str(exc))
        split = None
    if split is None:  # called outside the `except` (Note [Our frames hidden])
        return fn(*args, **kwargs)
    obj = _cached_call(fn, args, split.kwargs, split.device)
    if obj is _AS_CALLED:
        return fn(*args, **kwargs)
    if obj is _PLAIN:
        obj = fn(*args, **split.kwargs)
    if split.device is None:
        return obj
    too_big = too_large(obj, split.device) if split.by_sizes else None
    if too_big is not None:  # Note [Auto on one device] in placement.py
        fall_back(_label(fn, args, kwargs), "too_large", too_big)
        del obj
        return fn(*args, **kwargs)
    return place(obj, split.device)
