"""Where a miss's time goes: in one process, the plain load and the miss of one model alternate (the store
emptied before each miss, compaction off), and the miss's own functions are timed by perf_counter spans
around them. Prints the medians of the calls and of every span (the first round left out: its imports).

    .venv/bin/python benchmarks/miss_spans.py [SIZE] [DTYPE] [ROUNDS]     # 1.1b bfloat16 11

The model is benchmarks/load.py's (built there on first use: benchmarks/out/models/llama-SIZE). One process
for both loads puts them on the same footing as to imports and the library's first calls; on a VM that
hands freed memory back to its host, a converting load's fresh pages still cost what the host makes them
cost (benchmarks/RESULTS.md, issue 39).
"""

from __future__ import annotations

import collections
import functools
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
spans: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner: Any, name: str, label: str) -> None:
    """Replace `owner.name` by a wrapper that adds each call's duration to `spans[label]`."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spans[label].append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def main() -> None:
    size = sys.argv[1] if len(sys.argv) > 1 else "1.1b"
    dtype_name = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 11
    os.environ.update(OVERMIND_HOME=tempfile.mkdtemp(prefix="om-spans-"), OVERMIND_COMPACT="0",
                      TRANSFORMERS_VERBOSITY="error")
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401 (imported before the clock, as in a kernel)
    from transformers import AutoModelForCausalLM

    from benchmarks.load import build
    from kernel_server import Client
    from kernel_server.client import Client as ClientClass
    from overmind_jupyter import keys, loading, publishing, rebuild

    path = str(build([size], torch_files=False)[size])
    dtype = getattr(torch, dtype_name)
    for owner, name in ((rebuild, "pack"), (publishing, "publish"), (publishing, "_plan"),
                        (publishing, "_remap"), (publishing, "_fill"), (keys, "make_key"),
                        (loading, "_lookup"), (loading, "_publish")):
        timed(owner, name, f"{owner.__name__.rsplit('.', 1)[-1]}.{name}")
    request = ClientClass.request

    def timed_request(self: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return request(self, op, *args, **kwargs)
        finally:
            spans[f"request {getattr(op, 'value', op)}"].append(time.perf_counter() - start)

    ClientClass.request = timed_request  # type: ignore[method-assign]

    def load(checkpoint: str, dtype: torch.dtype) -> Any:
        start = time.perf_counter()
        try:
            return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        finally:
            spans["the load, in the miss"].append(time.perf_counter() - start)

    client = Client(Path(os.environ["OVERMIND_HOME"]), role="bench")
    calls: dict[str, list[float]] = {"plain": [], "miss": []}
    cases: dict[str, Callable[[], Any]] = {
        "plain": lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype),
        "miss": lambda: loading.cached(load, path, dtype=dtype),
    }
    try:
        for _ in range(rounds):
            for case, call in cases.items():
                gc.collect()
                if case == "miss":
                    client.request("evict", all=True)
                start = time.perf_counter()
                model = call()
                calls[case].append(time.perf_counter() - start)
                del model
    finally:
        client.request("shutdown")
        client.close()

    def median_ms(values: list[float]) -> float:
        return statistics.median(values[1:] or values) * 1000

    print(f"{size} {dtype_name}, {rounds} rounds, medians (the first round left out)")
    for case, values in calls.items():
        print(f"{case:34} {median_ms(values):9.2f} ms")
    for label, values in sorted(spans.items(), key=lambda kv: -median_ms(kv[1])):
        if label not in ("request evict", "request shutdown", "request hello", "request unpin"):  # not the call's
            print(f"  {label:32} {median_ms(values):9.2f} ms  ({len(values) / rounds:.0f} a miss)")


if __name__ == "__main__":
    main()
