"""Tiny modules named after what they test, and loaders for them, importable by every test process."""

from __future__ import annotations

import collections
import os
import time

import torch
from torch import nn


class TiedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


class NonContiguous(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(6, 4)
        self.register_buffer("base", base)
        self.register_buffer("transposed", base.t())  # a non-contiguous view of the same storage
        self.register_buffer("tail", base[3:])  # a view at a storage offset
        self.register_buffer("strided", torch.randn(5, 5)[::2, 1::2])


class Dtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bf16", torch.randn(7, dtype=torch.bfloat16))
        self.register_buffer("fp16", torch.randn(7, dtype=torch.float16))
        self.register_buffer("int8", torch.randint(-128, 127, (9,), dtype=torch.int8))
        self.register_buffer("flags", torch.rand(5) > 0.5)
        self.register_buffer("u16", torch.randint(0, 60000, (3,), dtype=torch.int32).to(torch.uint16))
        self.register_buffer("on_meta", torch.empty(4, 4, device="meta"))
        self.register_buffer("empty", torch.empty(0))
        # Tensors the fast reduction leaves to torch's own, and a parameter's extras it must keep
        self.register_buffer("conj", torch.randn(3, dtype=torch.complex64).conj())
        self.register_buffer("grad", torch.ones(2, requires_grad=True))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.frozen.tag = "kept"


class Bf16(nn.Module):
    """bf16 parameters and buffers, a frozen parameter, a non-persistent buffer, a submodule in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8).to(torch.bfloat16)
        self.norm = nn.LayerNorm(8).to(torch.bfloat16).eval()
        self.norm.weight.requires_grad_(False)
        self.register_buffer("scale", torch.randn(8, dtype=torch.bfloat16))
        self.register_buffer("cache", torch.arange(8, dtype=torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)) * self.scale + self.cache


class Stateful(nn.Module):
    """A module subclass whose __init__ keeps state of its own: numbers, a list, a plain object, and a
    reference back to itself from inside a submodule (a cycle through the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 3
        self.names = ["a", "b"]
        self.options = collections.Counter(x=1)
        self.block = nn.Linear(4, 4)
        self.block.owners = [self]  # not a submodule: a plain attribute that leads back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) * self.steps


class Mlp(nn.Module):
    def __init__(self, width: int = 256, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Wrapper(nn.Module):
    """Holds another module, as a PeftModel holds its base model."""

    def __init__(self, inner: nn.Module, extra: int = 4) -> None:
        super().__init__()
        self.inner = inner
        self.extra = nn.Linear(extra, extra)


class Unpicklable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.lock = __import__("threading").Lock()
        self.gen = (i for i in range(3))


class Tagged(collections.OrderedDict):  # type: ignore[type-arg]
    """An OrderedDict subclass: packed by its own reduce, not the fast path of plain OrderedDicts."""


class OrderedState(nn.Module):
    """OrderedDicts beyond a module's own: one with attributes, one shared, one empty, a subclass."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        table = collections.OrderedDict(b=torch.ones(2), a=[1, 2])
        table.note = "kept"
        self.tables = [table, table, collections.OrderedDict()]
        self.tagged = Tagged(z=1, y=2)


def doubled(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    return output * 2


def hooked() -> nn.Module:
    """A module with a forward hook (a non-empty hook dict) and compiled (state torch does not pickle)."""
    model = Mlp(width=8, depth=1)
    model.register_forward_hook(doubled)
    model.compile()
    return model


def handled() -> nn.Module:
    """A module that keeps the handle of a hook it registered, as PEFT's ShadowPEFT does: the handle
    refers (weakly) to its module's hook dicts, two of which stay empty."""
    model = Mlp(width=8, depth=1)
    model.handle = model.layers[0].register_forward_hook(doubled)
    return model


def _seeded(seed: int) -> None:
    """Seed the CPU generator only, inside `fork_rng(devices=[])`, which restores that one alone:
    `torch.manual_seed` seeds every CUDA generator too (at once where CUDA is initialised, at its
    initialisation otherwise), which would leave the CUDA generators changed by the load."""
    torch.random.default_generator.manual_seed(seed)


class TaggedParameter(nn.Parameter):
    """A parameter of a class of its own (a library's quantized or sharded parameter)."""


class TaggedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = TaggedParameter(torch.randn(4, 4))


def build(kind: str, seed: int = 0, **kwargs: object) -> nn.Module:
    """The loader the tests cache: deterministic for (kind, seed, kwargs), and like a full checkpoint's
    load it leaves every global generator as it found it, the CUDA ones included (loads that draw from one
    are keyed by its state: Note [Random loads] in overmind_jupyter/randomness.py, tested in
    test_never_stale.py)."""
    with torch.random.fork_rng(devices=[]):
        _seeded(seed)
        return {"tied": TiedWeights, "noncontig": NonContiguous, "dtypes": Dtypes, "mlp": Mlp,
                "unpicklable": Unpicklable, "ordered": OrderedState, "hooked": hooked, "handled": handled,
                "bf16": Bf16, "stateful": Stateful, "tagged_weight": TaggedWeight}[kind](**kwargs)


def build_on(kind: str, device: str) -> nn.Module:
    """`build`, moved to `device` by the loader itself: a cached function whose result lies on a device."""
    return build(kind).to(device)


def wrap(inner: nn.Module, seed: int = 0) -> Wrapper:
    with torch.random.fork_rng(devices=[]):
        _seeded(seed)
        return Wrapper(inner)


def counted_build(kind: str, delay: float = 0.0, seed: int = 0) -> nn.Module:
    """`build`, appending a line to the file named by $LOAD_COUNTER for each real load, after `delay`
    seconds."""
    with open(os.environ["LOAD_COUNTER"], "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(delay)
    return build(kind, seed)


def load_on_a_worker(path: str) -> nn.Module:
    """A bf16 transformers load run on a worker thread, as a library that reads its checkpoint there
    would: the file is mapped outside the caller's context, by torch's own `from_file`."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    with ThreadPoolExecutor(1) as pool:
        model: nn.Module = pool.submit(AutoModelForCausalLM.from_pretrained, path, dtype=torch.bfloat16).result()
    return model


def failing_build(kind: str) -> nn.Module:
    raise FileNotFoundError(f"no checkpoint for {kind}")


def attach(model: nn.Module, width: int = 4, seed: int = 0) -> nn.Module:
    """Loads more into `model` in place, as PeftModel.from_pretrained does with its base model."""
    with torch.random.fork_rng(devices=[]):
        _seeded(seed)
        model.extra = nn.Linear(width, width)
    model.layers[0] = nn.Sequential(model.layers[0], nn.ReLU())
    return model.extra
