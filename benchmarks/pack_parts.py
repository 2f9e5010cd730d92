"""Where a same-dtype miss's pack goes, and what a fork of the loading process would cost (issue 39).

    .venv/bin/python benchmarks/pack_parts.py [SIZE] [ROUNDS]        # 1.1b 30

In one process that loaded the model plainly (benchmarks/load.py's checkpoint, built there on first use:
benchmarks/out/models/llama-SIZE, as bf16), the collector frozen and off, medians of ROUNDS:
- `pack`: rebuild.pack of the model, as a miss packs it;
- the reductions it calls in Python: every module's (`_reduce_module`) and every tensor's (`_Placer.tensor`);
- the C pickler's own walk: the same graph pickled with every reduction computed beforehand;
- `os.fork()` of this process (the parent's side), the price of packing a snapshot in a child instead.
"""

from __future__ import annotations

import gc
import io
import itertools
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def median_ms(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def fork_ms(rounds: int) -> float:
    """The parent's side of `os.fork()`: page tables copied, and the pages made copy-on-write."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        times.append(time.perf_counter() - start)
        os.waitpid(pid, 0)
    return statistics.median(times) * 1e3


def main() -> None:
    size = sys.argv[1] if len(sys.argv) > 1 else "1.1b"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.load import build
    from overmind_jupyter import rebuild

    model = LlamaForCausalLM.from_pretrained(build([size], torch_files=False)[size], dtype=torch.bfloat16)
    gc.collect()
    gc.freeze()
    gc.disable()
    modules = list(model.modules())
    tensors = [t for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]

    def markers() -> Any:
        return itertools.chain(rebuild._HOOK_MARKERS, itertools.starmap(rebuild._EmptyHooks, itertools.repeat(())))

    def reduce_modules() -> None:
        made = markers()
        for m in modules:
            rebuild._reduce_module(made, m)

    def reduce_tensors() -> None:
        placer = rebuild._Placer(None, False)
        for t in tensors:
            placer.tensor(t)

    made = markers()
    module_reductions = {id(m): rebuild._reduce_module(made, m) for m in modules}
    placer = rebuild._Placer(None, False)
    tensor_reductions = {id(t): placer.tensor(t) for t in tensors}

    class Precomputed(dict):  # type: ignore[type-arg]
        def __missing__(self, cls: type) -> Callable[[Any], Any]:
            if issubclass(cls, type):
                raise KeyError(cls)
            if rebuild._plain_module_class(cls):
                found = self[cls] = lambda m: module_reductions.get(id(m)) or rebuild._reduce_module(made, m)
            else:
                found = self[cls] = rebuild._REDUCE_EX
            return found

    def c_pickler() -> None:
        pickler = pickle.Pickler(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        table = Precomputed(placer.dispatch_table())
        table[torch.nn.Parameter] = table[torch.Tensor] = lambda t: tensor_reductions[id(t)]
        pickler.dispatch_table = table
        pickler.dump(model)

    print(f"llama-{size} bf16: {len(modules)} modules, {len(tensors)} tensors; medians of {rounds}, ms")
    print(f"  pack                                   {median_ms(lambda: rebuild.pack(model), rounds):6.2f}")
    print(f"  the modules' reductions                {median_ms(reduce_modules, rounds):6.2f}")
    print(f"  the tensors' reductions                {median_ms(reduce_tensors, rounds):6.2f}")
    print(f"  the C pickler, reductions computed     {median_ms(c_pickler, rounds):6.2f}")
    print(f"  os.fork() of this process              {fork_ms(min(rounds, 10)):6.2f}")


if __name__ == "__main__":
    main()
