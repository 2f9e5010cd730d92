"""What a load did with the draws of torch's generator, for a load whose result does not depend on them
(Note [Replayed draws])."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .randomness import Scratch, replay

__all__ = ["Draws", "following", "replays"]

# Note [Replayed draws]
# PEFT draws from torch's generator for every LoRA layer it creates, then overwrites each one with the
# adapter's weights; and torch seeds its generator anew in every process. Keyed by the generators' state
# (Note [Random loads] in randomness.py), such a load missed after every restart of a kernel that did not
# seed torch, though only the generator's state after it depends on the draws, not the result.
#
# So a load whose call is marked as drawing from torch's CPU generator alone runs, the next time it misses,
# under `Draws`; PEFT's loaders, known to draw, already on their first miss (it costs about 1.6 x the
# plain load, once). `Draws` follows every operation torch dispatches in the loading thread:
# - Taint, by storage: a random operation taints what it writes; any operation with a tainted input
#   taints what it writes or returns; copy_, fill_ and zero_ of a whole storage from untainted inputs
#   clear it.
# - Escape: a tainted value that reaches Python (item(), a comparison's bool, a shape that depends on
#   values, tolist(), numpy(), a pointer to the bytes) could decide anything; so could a draw from a
#   generator the load made itself, a random operation this module cannot replay, or a thread the load
#   started (its operations are not followed).
# - The random operations in order, with their shapes and arguments: each one of a kind whose use of the
#   generator depends on nothing else (uniform_, normal_, bernoulli_ with a number, ...).
# The result does not depend on the draws when nothing escaped, no tainted storage is alive when the load
# has returned (everything random was overwritten or freed), and replaying the recorded operations from
# the generator's state before the load gives its state after, byte for byte (an operation not followed
# would leave them apart). Then the entry is published under a key without the state (`replayed` in
# randomness.py), with the recorded operations where a state-keyed entry holds the state after. A hit
# replays them (`replay` in randomness.py): the generator ends where the plain load would leave it from
# this kernel's state, and the next random number is the plain run's. Otherwise the replayed key becomes a
# marker that sends lookups to the state's key, as before. A call's marker sends lookups to the replayed
# key first; where that is still missing, a kernel whose state has its entry (a seeded one) maps that
# instead of loading.
#
# transformers loads a checkpoint in worker threads by default (HF_DEACTIVATE_ASYNC_LOAD), so its loads that
# draw stay keyed by the state; they draw for weights the checkpoint lacks, which stay in the result anyway.
# A thread started meanwhile is told last, as the least telling reason.
#
# Limits: a load that reads the generator's state itself (torch.initial_seed()) rather than drawing from
# it, or that reads a tensor's bytes through its storage (pickle, torch.save) and loads them back, is not
# seen; the loaders of transformers, diffusers and PEFT do neither.

# random operations whose use of the generator depends only on their shapes, dtypes and arguments
_REPLAYABLE = frozenset({
    "aten.uniform_.default", "aten.normal_.default", "aten.bernoulli_.float", "aten.random_.default",
    "aten.random_.from", "aten.random_.to", "aten.exponential_.default", "aten.cauchy_.default",
    "aten.log_normal_.default", "aten.geometric_.default", "aten.rand.default", "aten.randn.default",
    "aten.randint.default", "aten.randint.low", "aten.randperm.default",
})
# random factories whose schema has no generator argument
_FACTORIES = frozenset({"aten.rand.default", "aten.randn.default", "aten.randint.default", "aten.randint.low",
                        "aten.randperm.default", "aten.rand_like.default", "aten.randn_like.default",
                        "aten.randint_like.default", "aten.randint_like.low_dtype"})
_OVERWRITE = frozenset({"aten.copy_.default", "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default"})
_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
# operations that answer about tensors' types and layouts, never their values (PEFT's `.data =` under
# `torch.inference_mode()` asks the first of a weight drawn at random)
_METADATA = frozenset({"aten._has_compatible_shallow_copy_type.default", "aten.is_same_size.default",
                       "aten.is_set_to.default", "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
                       "aten.sym_storage_offset.default"})
_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__dlpack__,
          torch.Tensor.data_ptr}


class _Op:
    """What `Draws` needs to know of an operator, worked out once."""

    __slots__ = ("generator", "name", "overwrite", "random", "reads", "written")

    def __init__(self, func: torch._ops.OpOverload) -> None:
        self.name = str(func)
        arguments = func._schema.arguments
        self.generator = next((i for i, a in enumerate(arguments) if a.name == "generator"), None)
        self.random = self.generator is not None or self.name in _FACTORIES
        # the arguments it writes: (position, name)
        self.written = [(i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None
                        and a.alias_info.is_write]
        self.overwrite = self.name in _OVERWRITE
        self.reads = any(tag in func.tags for tag in _TAGS)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


def _whole(t: torch.Tensor) -> bool:
    """Whether `t` covers every byte of its storage."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


_STORAGE = torch._C.TensorBase.untyped_storage


def _leaves(value: Any, into: list[Any] | None = None) -> list[Any]:
    """`value` flattened through its lists and tuples (named ones included): what an operator takes or
    returns holds nothing else that can hold a tensor (a schema's Tensor[] and Tensor?[]; a tuple of
    results, of lists at most). Met on every operation of a followed load, so not pytree's `tree_leaves`,
    which asks each value its node type: half of following's own time (benchmarks/following.py)."""
    if into is None:
        into = []
    if isinstance(value, list | tuple):
        for v in value:
            _leaves(v, into)
    else:
        into.append(value)
    return into


def _tensors(arguments: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors among an operator's arguments: each one a tensor, or a list or tuple of them (a
    schema's Tensor[] and Tensor?[]), as `_leaves` finds them, in one loop."""
    found = [a for a in arguments if isinstance(a, torch.Tensor)]
    for a in arguments:
        if isinstance(a, list | tuple):
            found += [t for t in _leaves(a) if isinstance(t, torch.Tensor)]
    return found


def _spec(value: Any) -> Any:
    """`value` with its tensors as `Scratch`."""
    if isinstance(value, torch.Tensor):
        return Scratch(tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, list | tuple):
        return type(value)(_spec(v) for v in value)
    return value


class Draws:
    """Follows a load in this thread (see `following`): `verdict` says why its result may depend on the
    draws (None: nothing seen so far), `ops` are the random operations to replay."""

    def __init__(self) -> None:
        self.verdict: str | None = None
        self.thread: str | None = None  # the first thread started meanwhile (told last: the least telling)
        self.ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._tainted: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._operators: dict[Any, _Op] = {}  # what is known of each operator seen

    def independent(self) -> str | None:
        """Why the result may depend on the draws, after the load returned; None: it does not (the
        replay is checked apart, by `replays`)."""
        if self.verdict is None and self._tainted:
            import gc

            gc.collect()  # random bytes in garbage that a cycle keeps are not the result's
            if self._tainted:
                n = len(self._tainted)
                self.verdict = f"random values outlive the load in {n} storage{'s' * (n != 1)}"
        if self.verdict is None and self.thread is not None:
            self.verdict = f"the load started a thread ({self.thread}), whose operations are not followed"
        return self.verdict

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        op = self._operators.get(func)
        if op is None:
            op = self._operators[func] = _Op(func)
        if not op.random and not self._tainted:
            return  # nothing random yet: nothing to follow
        written = [t for i, name in op.written if isinstance(t := _argument(args, kwargs, i, name), torch.Tensor)]
        if op.random:
            self._draw(op, args, kwargs, written, out)
            return
        inputs = _tensors((*args, *kwargs.values()))
        if op.overwrite:
            dst = written[0]
            from_tainted = any(self._holds(t) for t in inputs if t is not dst)
            if from_tainted:
                self._taint(dst)
            elif _whole(dst):
                self._tainted.pop(_STORAGE(dst)._cdata, None)
            return
        if op.name in _METADATA or not any(map(self._holds, inputs)):
            return
        if op.reads:
            self.verdict = f"{op.name} read values drawn at random"
            return
        results = _leaves(out)
        if any(r is not None and not isinstance(r, torch.Tensor) for r in results):
            self.verdict = f"{op.name} turned values drawn at random into a Python value"
            return
        for t in (*written, *results):
            if isinstance(t, torch.Tensor):
                self._taint(t)

    def read(self, func: Any, args: tuple[Any, ...]) -> None:
        """A Python-level read of a tensor's values (`func`, one of `_READS`: tolist(), numpy(), ...)."""
        if self._tainted and any(map(self._holds, _tensors(args))):
            self.verdict = f"{getattr(func, '__name__', func)}() read values drawn at random"

    def _draw(self, op: _Op, args: tuple[Any, ...], kwargs: dict[str, Any], written: list[torch.Tensor],
              out: Any) -> None:
        made = [t for t in (*written, *_leaves(out)) if isinstance(t, torch.Tensor)]
        if made and all(t.device.type == "meta" for t in made):
            return  # nothing drawn
        if op.generator is not None and _argument(args, kwargs, op.generator, "generator") is not None:
            self.verdict = f"{op.name} drew from a generator of the load's own"
            return
        if op.name not in _REPLAYABLE:
            self.verdict = f"{op.name} draws in a way that is not replayed"
            return
        if any(t.device.type != "cpu" for t in made):
            self.verdict = f"{op.name} drew on {made[0].device}"
            return
        self.ops.append((op.name, _spec(args), {k: _spec(v) for k, v in kwargs.items() if k != "generator"}))
        for t in made:
            self._taint(t)

    def _holds(self, t: torch.Tensor) -> bool:
        return not t.is_meta and _STORAGE(t)._cdata in self._tainted

    def _taint(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._tainted:
            tainted = self._tainted

            def forget(_: object, key: int = key) -> None:  # the storage is gone: so are its random bytes
                tainted.pop(key, None)

            self._tainted[key] = weakref.ref(storage, forget)


class _Dispatch(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ to keep torch.compile out of it, which imports torch._dynamo
        # on the first operation: a second or more, once per process. A load compiles nothing.
        return False

    def __init__(self, draws: Draws) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.draws = draws

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.draws.verdict is None:
            try:
                self.draws.follow(func, args, kwargs, out)
            except Exception as exc:  # noqa: BLE001 (following must never break the load)
                self.draws.verdict = f"{type(exc).__name__} while following {func}: {exc}"
        return out


class _Function(TorchFunctionMode):
    def __init__(self, draws: Draws) -> None:
        super().__init__()
        self.draws = draws

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if self.draws.verdict is None and func in _READS:
            try:
                self.draws.read(func, args)
            except Exception as exc:  # noqa: BLE001
                self.draws.verdict = f"{type(exc).__name__} while following {func}: {exc}"
        return func(*args, **(kwargs or {}))


@contextmanager
def following() -> Iterator[Draws]:
    """Follow what runs inside, in this thread (Note [Replayed draws]); a thread started meanwhile, by
    anyone, makes the result depend on the draws."""
    draws = Draws()
    start = threading.Thread.start

    def started(thread: threading.Thread) -> None:
        draws.thread = draws.thread or thread.name
        start(thread)

    threading.Thread.start = started  # type: ignore[method-assign,assignment]
    try:
        with _Function(draws), _Dispatch(draws):
            yield draws
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]


def replays(ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]], before: bytes, after: bytes) -> bool:
    """Whether replaying `ops` from torch's generator state `before` gives `after` (the generator is left
    as it was)."""
    now = torch.random.get_rng_state()
    try:
        torch.random.set_rng_state(torch.frombuffer(bytearray(before), dtype=torch.uint8))
        replay(ops)
        return bool(torch.random.get_rng_state().numpy().tobytes() == after)
    finally:
        torch.random.set_rng_state(now)
