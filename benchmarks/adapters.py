"""Adapter serving, side by side: a global lock, grouping under a lock, the routed gate, the batching engine,
and one hand-built mixed batch of the same requests.

The model is a 0.1B Llama-shaped model built in code (hidden 768, 12 layers, 12 heads, intermediate 2048,
vocab 32000; no download), with 3 LoRA adapters (r=16, every linear layer, random weights so that each adapter
changes the answers). 48 requests from 12 threads, 16 new tokens each, greedy; in fp32 and bf16.

- `global_lock`: one lock around `set_adapter` + `generate`, one request at a time (mellea's current design).
- `grouped_lock`: a worker takes every pending request, groups them by adapter, and runs one batch per adapter
  under the lock with `set_adapter`.
- `gate_routed`: every thread calls `gate.generate(...)` itself; requests run concurrently, routed per row.
- `engine`: every thread submits its requests to `gate.submit(...)` and waits for the futures.
- `engine_sync`: the same, but each thread waits for one answer before it submits the next.
- `hand_batch`: one `generate` of all the requests at once, left-padded, with PEFT's `adapter_names`.

Tokens/s is wall-clock (each method's fastest run); tok/cpu-s divides by the CPU seconds this process spent
(user + system), which other processes on a shared machine do not inflate. The bench sets
OMP_WAIT_POLICY=PASSIVE (unless set) so that waiting OpenMP threads do not spin.

Every method's tokens are compared with the serial reference (`global_lock`, one request at a time, PEFT's own
switch): `wrong` counts requests whose tokens differ. In bf16 PEFT's mixed path rounds differently from the
switched path, so a few greedy tokens may differ there (measured); fp32 must show 0.

A second part runs the same requests with mixed generation settings (each request one of: none, `min_length`
with an end-of-sequence token, `min_new_tokens`, `max_length` instead of `max_new_tokens`,
`repetition_penalty`, `no_repeat_ngram_size`, `suppress_tokens`, `exponential_decay_length_penalty`, a
logits processor), fp32: the engine against the serial reference with the same settings (`mixed_lock`: the
global lock, one request at a time). `wrong` must be 0; the engine's state says how many batches it made and
which requests ran alone, and why (Note [Settings in a batch] in overmind_jupyter/adapters/batchable.py).

A third part measures starvation: switched mode, 11 threads send forwards for one adapter back to back and
one thread sends one forward for another adapter for every nine (90/10), with aging (`max_wait_s`) and without
it; it reports the minority adapter's longest wait.

Run: `.venv/bin/python benchmarks/adapters.py` (add `--quick` for a small smoke run). Writes
`benchmarks/out/adapters.json` and prints a table with ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import queue
import random
import resource
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

# OpenMP threads that spin while they wait burn the CPU that the other thread of their team (or another
# process on a shared machine) needs; waiting passively keeps runs comparable. Must precede `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overmind_jupyter import adapters

ADAPTERS = ("fr", "de", "es")


def build_model(layers: int, hidden: int, heads: int, intermediate: int, vocab: int, rank: int) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base.generation_config.pad_token_id = 0
    base.generation_config.eos_token_id = None
    model = None
    for i, name in enumerate(ADAPTERS):
        torch.manual_seed(100 + i)
        lora = LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear", init_lora_weights=False)
        if model is None:
            model = get_peft_model(base, lora, adapter_name=name)
        else:
            model.add_adapter(name, lora)
    assert model is not None
    with torch.no_grad():  # PEFT's random B is as large as a base weight: keep the adapters a perturbation
        for module_name, param in model.named_parameters():
            if "lora_B" in module_name:
                param.mul_(0.1)
    model.set_adapter(ADAPTERS[0])
    return model.eval()


def make_requests(n: int, vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, str]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(12, 29, (1,), generator=gen))
        out.append((torch.randint(2, vocab, (1, length), generator=gen), ADAPTERS[i % len(ADAPTERS)]))
    return out


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids = torch.cat([torch.nn.functional.pad(p, (width - p.shape[1], 0), value=0) for p in prompts])
    mask = torch.cat(
        [torch.nn.functional.pad(torch.ones_like(p), (width - p.shape[1], 0), value=0) for p in prompts]
    )
    return ids, mask


class Run:
    """Timings and answers of one run of one method."""

    def __init__(self, n: int) -> None:
        self.latency = [0.0] * n
        self.tokens: list[torch.Tensor | None] = [None] * n
        self.wall = 0.0
        self.cpu = 0.0  # user + system seconds of this process: what the run cost, whatever else ran
        self.extra: dict[str, Any] = {}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def in_threads(n_threads: int, requests: list[Any], client: Any) -> Run:
    """Split the requests over `n_threads` client threads (round robin) and time them all."""
    run = Run(len(requests))
    barrier = threading.Barrier(n_threads + 1)
    errors: list[BaseException] = []

    def body(t: int) -> None:
        mine = list(range(t, len(requests), n_threads))
        barrier.wait()
        try:
            client(mine, run)
        except BaseException as e:  # noqa: BLE001 -- raised again in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    barrier.wait()
    start, cpu = time.perf_counter(), _cpu()
    for th in threads:
        th.join()
    run.wall, run.cpu = time.perf_counter() - start, _cpu() - cpu
    if errors:
        raise errors[0]
    return run


def global_lock(model: Any, requests: list[tuple[torch.Tensor, str]], args: argparse.Namespace,
                settings: list[dict[str, Any]] | None = None) -> Run:
    """One lock around set_adapter + generate (mellea's design); also the serial reference. `settings`:
    each request's generation settings (default: greedy, `args.new_tokens` new tokens)."""
    lock = threading.Lock()
    options = {"max_new_tokens": args.new_tokens, "do_sample": False}

    def client(mine: list[int], run: Run) -> None:
        for i in mine:
            prompt, name = requests[i]
            t0 = time.perf_counter()
            with lock, torch.no_grad():
                model.set_adapter(name)
                out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                     **(options if settings is None else settings[i]))
            run.latency[i] = time.perf_counter() - t0
            run.tokens[i] = out[0, prompt.shape[1] :]

    return in_threads(args.threads, requests, client)


def grouped_lock(model: Any, requests: list[tuple[torch.Tensor, str]], args: argparse.Namespace) -> Run:
    """A worker takes every pending request; one batch per adapter, under the lock, with set_adapter."""
    lock = threading.Lock()
    options = {"max_new_tokens": args.new_tokens, "do_sample": False}
    pending: queue.Queue[tuple[int, Future[torch.Tensor]] | None] = queue.Queue()

    def grouper() -> None:
        while True:
            first = pending.get()
            if first is None:
                return
            batch = [first]
            while True:
                try:
                    item = pending.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    pending.put(None)
                    break
                batch.append(item)
            by_adapter: dict[str, list[tuple[int, Future[torch.Tensor]]]] = {}
            for i, fut in batch:
                by_adapter.setdefault(requests[i][1], []).append((i, fut))
            for name, group in by_adapter.items():
                ids, mask = left_pad([requests[i][0] for i, _ in group])
                with lock, torch.no_grad():
                    model.set_adapter(name)
                    out = model.generate(input_ids=ids, attention_mask=mask, **options)
                for row, (_, fut) in enumerate(group):
                    fut.set_result(out[row, ids.shape[1] :])

    def client(mine: list[int], run: Run) -> None:
        t0 = time.perf_counter()
        futures = []
        for i in mine:
            fut: Future[torch.Tensor] = Future()
            pending.put((i, fut))
            futures.append((i, fut))
        for i, fut in futures:
            run.tokens[i] = fut.result()
            run.latency[i] = time.perf_counter() - t0

    worker = threading.Thread(target=grouper)
    worker.start()
    try:
        return in_threads(args.threads, requests, client)
    finally:
        pending.put(None)
        worker.join()


def gate_routed(model: Any, requests: list[tuple[torch.Tensor, str]], args: argparse.Namespace) -> Run:
    """Every thread calls gate.generate itself; requests run concurrently, routed per row."""
    options = {"max_new_tokens": args.new_tokens, "do_sample": False}
    with adapters.gate(model) as g:

        def client(mine: list[int], run: Run) -> None:
            for i in mine:
                prompt, name = requests[i]
                t0 = time.perf_counter()
                out = g.generate(input_ids=prompt, adapter=name, **options)
                run.latency[i] = time.perf_counter() - t0
                run.tokens[i] = out[0, prompt.shape[1] :]

        return in_threads(args.threads, requests, client)


def engine(
    model: Any, requests: list[tuple[torch.Tensor, str]], args: argparse.Namespace, sync: bool = False
) -> Run:
    """Every thread submits its requests to the batching engine (all at once, or one by one with `sync`)."""
    options = {"max_new_tokens": args.new_tokens, "do_sample": False}
    with adapters.gate(model, window_s=args.window, max_batch=64, max_adapters_per_batch=4) as g:

        def client(mine: list[int], run: Run) -> None:
            t0 = time.perf_counter()
            futures = [
                (i, g.submit(input_ids=requests[i][0], adapter=requests[i][1], **options)) for i in mine
            ]
            for i, fut in futures:
                out = fut.result()
                run.latency[i] = time.perf_counter() - t0
                run.tokens[i] = out[0, requests[i][0].shape[1] :]

        def sync_client(mine: list[int], run: Run) -> None:
            for i in mine:
                t0 = time.perf_counter()
                out = g.submit(input_ids=requests[i][0], adapter=requests[i][1], **options).result()
                run.latency[i] = time.perf_counter() - t0
                run.tokens[i] = out[0, requests[i][0].shape[1] :]

        run = in_threads(args.threads, requests, sync_client if sync else client)
        run.extra = g.state()["engine"]
        return run


def hand_batch(model: Any, requests: list[tuple[torch.Tensor, str]], args: argparse.Namespace) -> Run:
    """One generate of all the requests, left-padded, with PEFT's own adapter_names (one thread)."""
    options = {"max_new_tokens": args.new_tokens, "do_sample": False}
    ids, mask = left_pad([p for p, _ in requests])
    names = [name for _, name in requests]
    run = Run(len(requests))
    t0, cpu = time.perf_counter(), _cpu()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, **options)
    run.wall, run.cpu = time.perf_counter() - t0, _cpu() - cpu
    for i in range(len(requests)):
        run.latency[i] = run.wall
        run.tokens[i] = out[i, ids.shape[1] :]
    return run


METHODS: dict[str, Any] = {
    "global_lock": global_lock,
    "grouped_lock": grouped_lock,
    "gate_routed": gate_routed,
    "engine": engine,
    "engine_sync": lambda m, r, a: engine(m, r, a, sync=True),
    "hand_batch": hand_batch,
}


def bench_dtype(
    model: Any, requests: list[tuple[torch.Tensor, str]], args: argparse.Namespace
) -> dict[str, Any]:
    """Every method `args.repeats` times (in turn), then the engine and the hand-built batch
    `args.pair_repeats` more times, alternately (their ratio is the close one, and other processes on a
    shared machine make single runs noisy). Each method's fastest run counts; every run is checked."""
    runs: dict[str, list[Run]] = {name: [] for name in METHODS}
    for _ in range(args.repeats):
        for name, method in METHODS.items():
            model.set_adapter(ADAPTERS[0])
            runs[name].append(method(model, requests, args))
    for _ in range(args.pair_repeats):
        for name in ("engine", "hand_batch"):
            model.set_adapter(ADAPTERS[0])
            runs[name].append(METHODS[name](model, requests, args))
    reference = runs["global_lock"][0].tokens
    total_tokens = len(requests) * args.new_tokens
    table: dict[str, Any] = {}
    for name, method_runs in runs.items():
        best = min(method_runs, key=lambda r: r.wall)
        wrong = max(sum(not torch.equal(a, b) for a, b in zip(r.tokens, reference, strict=True)) for r in method_runs)
        lat = sorted(best.latency)
        cheapest = min(r.cpu for r in method_runs)
        table[name] = {
            "tokens_per_s": total_tokens / best.wall,
            "wall_s": best.wall,
            "walls_s": [r.wall for r in method_runs],
            "p50_s": statistics.median(lat),
            "p95_s": lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))],
            "wrong": wrong,
            "cpu_s": cheapest,
            "cpus_s": [r.cpu for r in method_runs],
            "tokens_per_cpu_s": total_tokens / cheapest,
        }
    base = table["global_lock"]
    hand = table["hand_batch"]
    for row in table.values():
        row["x_global_lock"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["x_hand_batch"] = row["tokens_per_s"] / hand["tokens_per_s"]
        row["x_global_lock_cpu"] = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        row["x_hand_batch_cpu"] = row["tokens_per_cpu_s"] / hand["tokens_per_cpu_s"]
    engine_state = min(runs["engine"], key=lambda r: r.wall).extra
    return {"methods": table, "engine": engine_state}


class BanAtEvenLengths:
    """A user's logits processor: it reads the current length, so a request with it runs alone."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] % 2 == 0:
            scores = scores.clone()
            scores[:, self.token] = -float("inf")
        return scores


def mixed_settings(
    requests: list[tuple[torch.Tensor, str]], args: argparse.Namespace, eos: int
) -> list[dict[str, Any]]:
    """One set of generation settings per request, in turn (see the module docstring)."""
    from transformers import LogitsProcessorList

    n = args.new_tokens
    longest = max(p.shape[1] for p, _ in requests)
    table: list[dict[str, Any]] = [
        {"max_new_tokens": n},
        {"max_new_tokens": n, "min_length": longest + n // 2, "eos_token_id": eos},
        {"max_new_tokens": n, "min_new_tokens": n // 2, "eos_token_id": eos},
        {"max_length": longest + n // 2},
        {"max_new_tokens": n, "repetition_penalty": 1.3},
        {"max_new_tokens": n, "no_repeat_ngram_size": 2},
        {"max_new_tokens": n, "suppress_tokens": [eos]},
        {"max_new_tokens": n, "exponential_decay_length_penalty": (n // 2, 1.5), "eos_token_id": eos},
        {"max_new_tokens": n, "logits_processor": LogitsProcessorList([BanAtEvenLengths(eos)])},
    ]
    return [dict(table[i % len(table)], do_sample=False) for i in range(len(requests))]


def mixed_lock(
    model: Any, requests: list[tuple[torch.Tensor, str]], settings: list[dict[str, Any]], args: argparse.Namespace
) -> Run:
    """The serial reference of the mixed run: one lock around set_adapter + generate, each with its settings."""
    return global_lock(model, requests, args, settings)


def mixed_engine(
    model: Any, requests: list[tuple[torch.Tensor, str]], settings: list[dict[str, Any]], args: argparse.Namespace
) -> Run:
    """Every thread submits its requests, each with its settings, to the batching engine."""
    with adapters.gate(model, window_s=args.window, max_batch=64, max_adapters_per_batch=4) as g:

        def client(mine: list[int], run: Run) -> None:
            t0 = time.perf_counter()
            futures = [(i, g.submit(input_ids=requests[i][0], adapter=requests[i][1], **settings[i])) for i in mine]
            for i, fut in futures:
                out = fut.result()
                run.latency[i] = time.perf_counter() - t0
                run.tokens[i] = out[0, requests[i][0].shape[1] :]

        run = in_threads(args.threads, requests, client)
        run.extra = g.state()["engine"]
        return run


def bench_mixed(model: Any, requests: list[tuple[torch.Tensor, str]], args: argparse.Namespace) -> dict[str, Any]:
    """The mixed-settings run (fp32): the engine against the serial reference with the same settings."""
    model.set_adapter(ADAPTERS[0])
    with torch.no_grad():  # an end-of-sequence token the model does produce: the most common early token
        probe = [
            model.generate(input_ids=p, max_new_tokens=4, do_sample=False)[0, p.shape[1] :] for p, _ in requests[:6]
        ]
    eos = int(torch.cat(probe).mode().values)
    settings = mixed_settings(requests, args, eos)
    runs: dict[str, list[Run]] = {"mixed_lock": [], "mixed_engine": []}
    for _ in range(args.repeats):
        for name, method in (("mixed_lock", mixed_lock), ("mixed_engine", mixed_engine)):
            model.set_adapter(ADAPTERS[0])
            runs[name].append(method(model, requests, settings, args))
    reference = runs["mixed_lock"][0].tokens
    total_tokens = sum(int(t.shape[0]) for t in reference if t is not None)
    table: dict[str, Any] = {}
    for name, method_runs in runs.items():
        best = min(method_runs, key=lambda r: r.wall)
        lat = sorted(best.latency)
        table[name] = {
            "tokens_per_s": total_tokens / best.wall,
            "wall_s": best.wall,
            "p50_s": statistics.median(lat),
            "p95_s": lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))],
            "wrong": max(
                sum(not torch.equal(a, b) for a, b in zip(r.tokens, reference, strict=True)) for r in method_runs
            ),
            "cpu_s": min(r.cpu for r in method_runs),
        }
    for row in table.values():
        row["x_lock"] = row["tokens_per_s"] / table["mixed_lock"]["tokens_per_s"]
    engine_state = min(runs["mixed_engine"], key=lambda r: r.wall).extra
    return {
        "eos_token_id": eos,
        "settings": [{k: repr(v) for k, v in s.items()} for s in settings[:9]],
        "new_tokens": total_tokens,
        "methods": table,
        "engine": engine_state,
    }


def skew_run(g: Any, prompts: list[torch.Tensor], majority_threads: int, per_thread: int) -> dict[str, Any]:
    """`majority_threads` threads send fr forwards back to back; one thread sends de forwards, one for every
    nine fr ones (a 90/10 mix), until the fr traffic ends. Returns the waits the gate saw."""
    done = threading.Event()
    durations: list[float] = []
    counts = {"fr": 0, "de": 0}

    def majority(t: int) -> None:
        rng = random.Random(t)
        for _ in range(per_thread):
            t0 = time.perf_counter()
            g(input_ids=prompts[rng.randrange(len(prompts))], adapter="fr")
            durations.append(time.perf_counter() - t0)
            counts["fr"] += 1

    def minority() -> None:
        rng = random.Random(99)
        while not done.is_set():
            if counts["de"] * 9 >= counts["fr"]:
                time.sleep(0.001)
                continue
            g(input_ids=prompts[rng.randrange(len(prompts))], adapter="de")
            counts["de"] += 1

    threads = [threading.Thread(target=majority, args=(t,)) for t in range(majority_threads)]
    side = threading.Thread(target=minority)
    t0 = time.perf_counter()
    side.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    done.set()
    side.join()
    state = g.state()
    return {
        "minority_longest_wait_s": state["max_wait_s"].get("de"),
        "majority_longest_wait_s": state["max_wait_s"].get("fr"),
        "switches": state["switches"],
        "requests": dict(counts),
        "longest_request_s": max(durations),
        "majority_wall_s": wall,
    }


def bench_skew(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Switched mode, a 90/10 mix of forwards: the minority adapter's longest wait, with and without aging."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, model.config.vocab_size, (1, 16), generator=gen) for _ in range(8)]
    out: dict[str, Any] = {}
    for label, bound in (("aging", args.max_wait), ("no_aging", 1e9)):
        model.set_adapter(ADAPTERS[0])
        with adapters.gate(model, mode="switched", max_wait_s=bound) as g:
            row = skew_run(g, prompts, args.threads - 1, args.skew_requests)
        out[label] = {"max_wait_bound_s": bound if bound < 1e9 else None, **row}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model and workload (smoke run)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--threads", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--window", type=float, default=0.01, help="engine coalescing window (s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per method; the fastest counts")
    parser.add_argument(
        "--pair-repeats", type=int, default=3, help="extra alternating runs of engine and hand_batch"
    )
    parser.add_argument("--max-wait", type=float, default=0.25, help="aging bound of the skew part (s)")
    parser.add_argument(
        "--skew-requests", type=int, default=20, help="fr forwards per thread in the skew part"
    )
    parser.add_argument("--no-skew", action="store_true")
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed generation settings run")
    parser.add_argument("--torch-threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "adapters.json"))
    args = parser.parse_args()
    shape = {
        "layers": args.layers,
        "hidden": 768,
        "heads": 12,
        "intermediate": 2048,
        "vocab": 32000,
        "rank": args.rank,
    }
    if args.quick:
        shape.update(layers=2, hidden=256, heads=4, intermediate=512, vocab=4096)
        args.requests, args.new_tokens, args.skew_requests = (
            min(args.requests, 24),
            min(args.new_tokens, 8),
            5,
        )
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    from transformers.utils import logging

    logging.set_verbosity_error()
    model = build_model(**shape)
    params = sum(p.numel() for p in model.get_base_model().parameters())
    requests = make_requests(args.requests, shape["vocab"])
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": {**shape, "params": params},
        "workload": {
            "requests": args.requests,
            "threads": args.threads,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "pair_repeats": args.pair_repeats,
            "prompt_tokens": [int(p.shape[1]) for p, _ in requests][:8],
            "engine_window_s": args.window,
        },
        "machine": {
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_before": os.getloadavg(),
        },
        "dtypes": {},
    }
    for dtype_name in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        subject = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        print(f"[{dtype_name}] running ...", flush=True)
        report["dtypes"][dtype_name] = bench_dtype(subject, requests, args)
        if subject is not model:
            del subject
    if not args.no_mixed:
        print("[mixed settings, fp32] running ...", flush=True)
        report["mixed_settings"] = bench_mixed(model, requests, args)
    if not args.no_skew:
        print("[skew] running ...", flush=True)
        report["skew_90_10"] = bench_skew(model, args)
    report["machine"]["loadavg_after"] = os.getloadavg()

    print()
    print(
        f"model: {params / 1e6:.0f}M params, {shape['layers']} layers; {args.requests} requests from "
        f"{args.threads} threads, {args.new_tokens} new tokens, 3 LoRA adapters r={args.rank}"
    )
    header = (
        f"{'dtype':5} {'method':13} {'tok/s':>7} {'p50 s':>6} {'p95 s':>6} {'wrong':>5} {'x lock':>6} "
        f"{'x hand':>6} | {'tok/cpu-s':>9} {'x lock':>6} {'x hand':>6}"
    )
    print(header)
    print("-" * len(header))
    for dtype_name, res in report["dtypes"].items():
        for method, row in res["methods"].items():
            print(
                f"{dtype_name:5} {method:13} {row['tokens_per_s']:7.1f} {row['p50_s']:6.2f} "
                f"{row['p95_s']:6.2f} {row['wrong']:5d} {row['x_global_lock']:6.2f} "
                f"{row['x_hand_batch']:6.2f} | {row['tokens_per_cpu_s']:9.1f} "
                f"{row['x_global_lock_cpu']:6.2f} {row['x_hand_batch_cpu']:6.2f}"
            )
        engine = res["engine"]
        print(
            f"{'':5} engine batches: {engine['batches']}, mean rows {engine['mean_batch_rows']:.1f}, "
            f"largest {engine['largest_batch_rows']}"
        )
    if "mixed_settings" in report:
        mixed = report["mixed_settings"]
        print()
        print(f"mixed generation settings (fp32, {mixed['new_tokens']} new tokens, eos {mixed['eos_token_id']}):")
        for method, row in mixed["methods"].items():
            print(
                f"  {method:13} {row['tokens_per_s']:7.1f} tok/s  p50 {row['p50_s']:6.2f}  p95 {row['p95_s']:6.2f}  "
                f"wrong {row['wrong']:3d}  x lock {row['x_lock']:5.2f}"
            )
        engine = mixed["engine"]
        print(
            f"  engine batches: {engine['batches']}, mean rows {engine['mean_batch_rows']:.1f}, largest "
            f"{engine['largest_batch_rows']}, alone {engine['alone']}: {engine['alone_why']}"
        )
    if "skew_90_10" in report:
        print()
        print(
            f"90/10 skew, switched mode: {args.threads - 1} threads of fr forwards, 1 thread of de forwards:"
        )
        for label, row in report["skew_90_10"].items():
            bound = row["max_wait_bound_s"]
            print(
                f"  {label:9} bound {bound if bound is not None else 'none':>5}  minority longest wait "
                f"{row['minority_longest_wait_s'] or 0:.3f}s  "
                f"majority {row['majority_longest_wait_s'] or 0:.3f}s  "
                f"switches {row['switches']}  requests {row['requests']}  longest fr request "
                f"{row['longest_request_s']:.3f}s  fr traffic {row['majority_wall_s']:.1f}s"
            )
    fp32 = report["dtypes"].get("fp32")
    if fp32:
        m = fp32["methods"]
        checks = {
            "fp32 wrong outputs == 0": all(row["wrong"] == 0 for row in m.values()),
            "fp32 engine >= 3x global lock": m["engine"]["x_global_lock"] >= 3.0,
            "fp32 engine >= 0.95x hand-built batch": m["engine"]["x_hand_batch"] >= 0.95,
            "fp32 engine >= 3x global lock (per CPU-second)": m["engine"]["x_global_lock_cpu"] >= 3.0,
            "fp32 engine >= 0.95x hand-built batch (per CPU-second)": m["engine"]["x_hand_batch_cpu"] >= 0.95,
        }
        if "mixed_settings" in report:
            checks["fp32 mixed settings: wrong outputs == 0"] = all(
                row["wrong"] == 0 for row in report["mixed_settings"]["methods"].values()
            )
        report["checks"] = checks
        print()
        for name, ok in checks.items():
            print(f"  {'PASS' if ok else 'MISS'}  {name}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
