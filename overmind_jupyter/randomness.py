"""The global random generators' states, for loads that draw random numbers (Note [Random loads])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from . import keys

if TYPE_CHECKING:
    import torch

__all__ = ["Scratch", "drawn", "just_seeded", "only", "random_state", "replay", "replayable", "replayed",
           "set_random_state", "under_random_state"]

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
# is keyed as it is. A load whose result does not depend on what it draws from torch's generator (PEFT's)
# is shared across states too: Note [Replayed draws] in draws.py.

def under_random_state(ck: keys.CallKey, state: tuple[Any, ...]) -> keys.CallKey:
    """The key of `ck` for the generators' `state` (Note [Random loads])."""
    import dataclasses
    import hashlib
    import pickle

    digest = hashlib.sha256(ck.key.encode() + pickle.dumps(state, protocol=4)).hexdigest()
    return dataclasses.replace(ck, key=digest, meta=ck.meta | {"random": "state"})


def replayed(ck: keys.CallKey) -> keys.CallKey:
    """The key of `ck` for a result that does not depend on the draws, which a hit replays (Note
    [Replayed draws] in draws.py)."""
    import dataclasses
    import hashlib

    digest = hashlib.sha256(ck.key.encode() + b"\0draws replayed").hexdigest()
    return dataclasses.replace(ck, key=digest, meta=ck.meta | {"random": "replayed"})


def replayable(drawn: list[str]) -> bool:
    """Whether a load that drew from the generators `drawn` may be followed to replay its draws: torch's
    CPU generator alone (Note [Replayed draws] in draws.py)."""
    return drawn == ["torch"]


def drawn(before: tuple[Any, ...], after: tuple[Any, ...]) -> list[str]:
    """The generators a call drew from (one that the call imported first has no state to key by)."""
    was = dict(before)
    return [name for name, now in after if name in was and was[name] != now]


def only(states: tuple[Any, ...], names: list[str]) -> tuple[Any, ...]:
    """The states of the generators `names` (those a load drew from): the others, such as Python's
    own generator that every process seeds anew, play no part in what it returns."""
    return tuple((name, state) for name, state in states if name in names)


def random_state() -> tuple[Any, ...]:
    """The global random generators' states (of the libraries already imported), as comparable and
    picklable values that `set_random_state` puts back."""
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


def just_seeded(states: tuple[Any, ...]) -> int | None:
    """The seed of torch's generator where `states` (`random_state`'s, of the generators a load drew from)
    are torch's alone and what the user's `torch.manual_seed` of it makes, nothing drawn since; else None.
    torch seeds each process itself with a random 64-bit number (as `torch.seed()` does), which leaves the
    same kind of state: a seed below 2**32 is taken for the user's (people seed with 0, 42, 1234, a date;
    numpy's and Python's seeds are 32-bit), one above for torch's own, which falls below once in 2**32."""
    import torch

    if [name for name, _ in states] != ["torch"]:
        return None
    seed = torch.initial_seed()
    if seed >= 1 << 32:
        return None
    fresh = torch.Generator().manual_seed(seed).get_state().numpy().tobytes()
    return seed if states[0][1] == fresh else None


def set_random_state(states: tuple[Any, ...]) -> None:
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
        elif name == "torch-draws":  # Note [Replayed draws] in draws.py
            replay(state)


class Scratch(NamedTuple):
    """A tensor a random operation wrote, as `replay` makes it: uninitialised, of this layout (Note
    [Replayed draws] in draws.py; here, beside `set_random_state`, so that a hit imports nothing more)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def replay(ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> None:
    """Draw from torch's generator as the recorded operations did, into scratch tensors (Note [Replayed
    draws] in draws.py)."""
    import torch

    def make(spec: Any) -> Any:
        if isinstance(spec, Scratch):
            return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype)
        if isinstance(spec, list | tuple):
            return type(spec)(make(v) for v in spec)
        return spec

    for name, args, kwargs in ops:
        namespace, op, overload = name.split(".")
        func = getattr(getattr(getattr(torch.ops, namespace), op), overload)
        func(*make(args), **{k: make(v) for k, v in kwargs.items()})
