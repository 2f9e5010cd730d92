"""Where a miss's time goes: the plain load and the miss of one model alternate (the store emptied before
each miss, compaction off), and the miss's own functions are timed by perf_counter spans around them.
Prints the medians of the calls and of every span.

    .venv/bin/python benchmarks/miss_spans.py [SIZE] [DTYPE] [ROUNDS]            # 1.1b bfloat16 11
    .venv/bin/python benchmarks/miss_spans.py [SIZE] [DTYPE] [ROUNDS] --fresh    # each call in a process

In one process (the first round left out: its imports), both loads are on the same footing as to imports
and the library's first calls. With --fresh each call runs in a process of its own, as
benchmarks/load.py --miss runs them: the miss in the kernel form (`enable()` before the clock, then the
patched `from_pretrained`), with "ours" the call less the load inside it. On a VM that hands freed memory
back to its host, a load's fresh pages still cost what the host makes them cost (benchmarks/RESULTS.md,
issue 39). The model is benchmarks/load.py's (built there on first use: benchmarks/out/models/llama-SIZE).
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
spans: dict[str, list[float]] = collections.defaultdict(list)
IGNORED = ("request evict", "request shutdown", "request hello", "request unpin")  # not the call's
OURS = "ours: the miss less its load"


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


def instrument() -> None:
    """Time the miss's own functions, its requests, and the load inside it ("the load, in the miss")."""
    from kernel_server.client import Client as ClientClass
    from overmind_jupyter import keys, loading, progress, publishing, randomness, rebuild, staging

    for owner, name in ((rebuild, "pack"), (publishing, "publish"), (publishing, "_plan"),
                        (publishing, "_remap"), (publishing, "_fill"), (keys, "make_key"),
                        (loading, "_lookup"), (loading, "_publish"), (randomness, "random_state"),
                        (keys, "changed_since"), (progress, "tell_miss"), (publishing, "_described"),
                        (staging.Stage, "__init__"), (staging.Stage, "close"), (loading, "_cached_call")):
        timed(owner, name, f"{owner.__name__.rsplit('.', 1)[-1]}.{name}")
    send = ClientClass.send

    def timed_send(self: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        """A request sent now and waited for later (`Client.send`): its sending, and the wait for its reply."""
        name = getattr(op, "value", op)
        start = time.perf_counter()
        reply = send(self, op, *args, **kwargs)
        spans[f"send {name}"].append(time.perf_counter() - start)

        def timed_reply() -> Any:
            waited = time.perf_counter()
            try:
                return reply()
            finally:
                spans[f"wait for {name}"].append(time.perf_counter() - waited)

        return timed_reply

    ClientClass.send = timed_send  # type: ignore[method-assign]
    request = ClientClass.request

    def timed_request(self: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return request(self, op, *args, **kwargs)
        finally:
            spans[f"request {getattr(op, 'value', op)}"].append(time.perf_counter() - start)

    ClientClass.request = timed_request  # type: ignore[method-assign]
    miss = loading._miss
    loading_now: list[bool] = []

    def timed_miss(client: Any, ck: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def load(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            loading_now.append(True)
            try:
                return fn(*a, **k)
            finally:
                loading_now.clear()
                spans["the load, in the miss"].append(time.perf_counter() - start)

        start = time.perf_counter()
        try:
            return miss(client, ck, load, *args, **kwargs)
        finally:
            spans["loading._miss"].append(time.perf_counter() - start)

    loading._miss = timed_miss
    time_collections(lambda: "in the load" if loading_now else "ours")


def time_collections(where: Callable[[], str]) -> None:
    """Add the collector's own time to `spans`, by `where()` it ran and generation."""
    started: list[float] = []

    def collections(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            spans[f"gc {where()}: generation {info['generation']}"].append(time.perf_counter() - started.pop())

    gc.callbacks.append(collections)


def child(case: str, path: str, dtype_name: str) -> None:
    """One call in this fresh process: the plain load, or the miss after `enable()`; prints its JSON."""
    import torch
    from transformers import LlamaForCausalLM  # as benchmarks/load.py calls it (the Auto class reads the
    # config before the concrete class's patched loader runs: time that is neither the load's nor ours)

    if case == "miss":
        import overmind_jupyter

        overmind_jupyter.enable()  # a kernel after `%overmind on`: the loader patched
        instrument()
    else:
        time_collections(lambda: "in plain")
    dtype = getattr(torch, dtype_name)
    start, cpu = time.perf_counter(), time.process_time()
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    call = time.perf_counter() - start  # (the model still held: its end is not the call's)
    spans[f"{case}: CPU"] = [time.process_time() - cpu]
    spans[f"the collector, in the {case}'s call"] = [sum(sum(v) for k, v in spans.items() if k.startswith("gc "))]
    print(json.dumps({"call": call, "spans": {k: sum(v) for k, v in spans.items()}}))
    del model


def fresh_rounds(path: str, dtype_name: str, rounds: int) -> dict[str, list[float]]:
    """Rounds of a plain and a miss process (in turns first), against one daemon."""
    from benchmarks.load import daemon, scratch_dir

    env = dict(os.environ, OVERMIND_HOME=scratch_dir("om-spans-"), OVERMIND_COMPACT="0",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    runs: dict[str, list[float]] = collections.defaultdict(list)
    daemon(env, "start")
    try:
        for r in range(rounds):
            for case in ("plain", "miss") if r % 2 == 0 else ("miss", "plain"):
                daemon(env, "evict", "--all")
                out = subprocess.run([sys.executable, __file__, "--child", case, path, dtype_name], env=env,
                                     capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                runs[case].append(result["call"])
                for label, seconds in result["spans"].items():
                    runs[label].append(seconds)
                if case == "miss":
                    runs[OURS].append(result["call"] - result["spans"]["the load, in the miss"])
    finally:
        daemon(env, "stop")
    return runs


def in_process(path: str, dtype_name: str, rounds: int) -> dict[str, list[float]]:
    from benchmarks.load import scratch_dir

    os.environ.update(OVERMIND_HOME=scratch_dir("om-spans-"), OVERMIND_COMPACT="0",
                      TRANSFORMERS_VERBOSITY="error")
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401 (imported before the clock, as in a kernel)
    from transformers import AutoModelForCausalLM

    from kernel_server import Client
    from overmind_jupyter import loading

    instrument()
    dtype = getattr(torch, dtype_name)
    client = Client(Path(os.environ["OVERMIND_HOME"]), role="bench")
    calls: dict[str, list[float]] = {"plain": [], "miss": []}
    cases: dict[str, Callable[[], Any]] = {
        "plain": lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype),
        "miss": lambda: loading.cached(AutoModelForCausalLM.from_pretrained, path, dtype=dtype),
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
    # the first round left out: its imports
    return {label: values[1:] or values for label, values in (calls | spans).items()}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5])
        return
    args = [a for a in sys.argv[1:] if a != "--fresh"]
    size = args[0] if args else "1.1b"
    dtype_name = args[1] if len(args) > 1 else "bfloat16"
    rounds = int(args[2]) if len(args) > 2 else 11
    fresh = "--fresh" in sys.argv
    from benchmarks.load import build

    path = str(build([size], torch_files=False)[size])
    runs = fresh_rounds(path, dtype_name, rounds) if fresh else in_process(path, dtype_name, rounds)

    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1000

    print(f"{size} {dtype_name}, {rounds} rounds, {'a process per call' if fresh else 'in one process'}, "
          "medians (and the highest)")
    for case in ("plain", "miss", OURS):
        if case in runs:
            print(f"{case:34} {median_ms(runs[case]):9.2f} ms ({max(runs[case]) * 1000:.2f})")
    others = [label for label in runs if label not in ("plain", "miss", OURS, *IGNORED)]
    for label in sorted(others, key=lambda label: -median_ms(runs[label])):
        print(f"  {label:32} {median_ms(runs[label]):9.2f} ms ({max(runs[label]) * 1000:.2f})")


if __name__ == "__main__":
    main()
