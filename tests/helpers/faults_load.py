"""The load test, shared by tests/test_load.py and benchmarks/soak.py: kernel processes load tiny models
at random through one daemon whose budget is too small for all of them, each load bit-compared with a
plain load, while a sampler checks the budget from outside.

    python -m tests.helpers.faults_load worker SEED (--loads N | --seconds S) REFS.json

A worker is one kernel: it calls `loading.cached(tiny_modules.build, ...)` for a random model, checks
the result's `digest` against the reference, keeps its last few results alive (so their entries stay
pinned, and eviction must pass them over), and now and then writes a hit in place (copy-on-write: no
other load may see it). It prints one JSON line of counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# name -> (args, kwargs) of tiny_modules.build; five models of different shapes (tied weights, views at
# storage offsets, non-contiguous buffers, plain layers of three sizes).
MODELS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "tied": (("tied",), {"seed": 1}),
    "noncontig": (("noncontig",), {"seed": 2}),
    "mlp96": (("mlp",), {"seed": 3, "width": 96}),
    "mlp128": (("mlp",), {"seed": 4, "width": 128, "depth": 3}),
    "mlp160": (("mlp",), {"seed": 5, "width": 160}),
}


def references() -> dict[str, dict[str, Any]]:
    """Per model: the digest of a plain load, and the bytes its entry takes in the store."""
    from overmind_jupyter import rebuild
    from tests.helpers import tiny_modules
    from tests.helpers.faults_helpers import digest

    out = {}
    for name, (args, kwargs) in MODELS.items():
        model = tiny_modules.build(*args, **kwargs)
        packed = rebuild.pack((model, []))
        out[name] = {"digest": digest(model), "entry_bytes": packed.arena_bytes + len(packed.graph)}
    return out


def budget_for(refs: dict[str, dict[str, Any]]) -> int:
    """Room for about 60% of the models' entries: every round of loads evicts."""
    sizes = sorted(r["entry_bytes"] for r in refs.values())
    return max(int(0.6 * sum(sizes)), sizes[-1] + sizes[-2])


# -- one kernel ---------------------------------------------------------------------------------------

def worker(seed: int, loads: int | None, seconds: float | None, refs_path: str) -> dict[str, Any]:
    import torch

    from overmind_jupyter import loading, notices, rebuild
    from tests.helpers import tiny_modules
    from tests.helpers.faults_helpers import digest

    refs = json.loads(Path(refs_path).read_text())
    rng = random.Random(seed)
    names = sorted(MODELS)
    held: collections.deque[Any] = collections.deque(maxlen=1)
    counts: collections.Counter[str] = collections.Counter()
    wrong: list[str] = []
    errors: list[str] = []
    deadline = None if seconds is None else time.monotonic() + seconds
    fallbacks: collections.Counter[str] = collections.Counter()
    reasons: set[str] = set()

    def drain_fallbacks() -> None:
        # loading.fallbacks() keeps the last 200; take them as they come, to count them all
        while True:
            try:
                f = notices._fallbacks.popleft()
            except IndexError:
                return
            fallbacks[f["kind"]] += 1
            reasons.add(f"{f['kind']}: {f['reason'][:160]}")

    while (loads is None or counts["loads"] < loads) and (deadline is None or time.monotonic() < deadline):
        name = rng.choice(names)
        args, kwargs = MODELS[name]
        counts["loads"] += 1
        hits_before = loading.calls().get("hit", 0)
        try:
            model = loading.cached(tiny_modules.build, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (counted: a lost load fails the test)
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        storages = [t for t in model.state_dict().values() if t.device.type == "cpu" and t.numel()]
        hit = loading.calls().get("hit", 0) > hits_before
        if hit and not all(rebuild.entry_of(t.untyped_storage().data_ptr()) is not None for t in storages):
            wrong.append(f"load {counts['loads']}: {name}: a hit not backed by its entry")
        counts["hits" if hit else "plain"] += 1
        if digest(model) != refs[name]["digest"]:
            wrong.append(f"load {counts['loads']}: {name} ({'hit' if hit else 'plain'})")
        if hit and rng.random() < 0.25:  # a write in place; copy-on-write keeps it in this process
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            counts["writes"] += 1
        if rng.random() < 0.3:  # kept alive until a later load: its entry stays pinned meanwhile
            held.append(model)
        del model
        drain_fallbacks()
    drain_fallbacks()
    return {"seed": seed, **counts, "wrong": wrong, "errors": errors, "fallbacks": dict(fallbacks),
            "reasons": sorted(reasons)[:10]}


# -- the whole load, from outside ---------------------------------------------------------------------------

class Sampler(threading.Thread):
    """Polls the daemon's status through its own connection: used + reserved never above the budget. When
    the daemon is gone (the soak's --kill-every), it connects to the next one, which a kernel or it starts."""

    def __init__(self, home: Path, every: float = 0.005) -> None:
        super().__init__(name="budget-sampler", daemon=True)
        from kernel_server import Client

        self.home = home
        self.client = Client(home, role="test", label="budget sampler")
        self.every = every
        self.stop = threading.Event()
        self.samples = 0
        self.max_held = 0
        self.over: list[dict[str, int]] = []
        self.stats: dict[int, dict[str, int]] = {}  # the last store stats seen, per daemon pid
        self.budgets: set[int] = set()
        self.failure: BaseException | None = None

    def run(self) -> None:
        from kernel_server import Client
        from kernel_server.errors import DaemonError

        try:
            while not self.stop.is_set():
                try:
                    status = self.client.request("status", timeout=30)
                except DaemonError:
                    self.client.close()
                    try:
                        self.client = Client(self.home, role="test", label="budget sampler")
                    except DaemonError:  # killed again while it started: try once more
                        time.sleep(0.01)
                    continue
                held = status["used"] + status["reserved"]
                self.samples += 1
                self.max_held = max(self.max_held, held)
                self.budgets.add(status["budget"])
                self.stats[status["daemon"]["pid"]] = status["stats"]
                if held > status["budget"]:
                    self.over.append({"used": status["used"], "reserved": status["reserved"]})
                self.stop.wait(self.every)
        except BaseException as exc:  # noqa: BLE001 (reported by the caller)
            self.failure = exc

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        self.client.close()


def _kill_daemons(home: Path, every: float, stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL whatever daemon serves `home`, every `every` seconds."""
    import signal

    from tests.helpers.faults_helpers import daemon_pid

    while not stop.wait(every):
        pid = daemon_pid(home)
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass


def run_load(home: Path, refs: dict[str, dict[str, Any]], *, workers: int = 4, loads: int | None = 200,
             seconds: float | None = None, timeout: float = 600.0, kill_every: float | None = None) -> dict[str, Any]:
    """Run `workers` kernel processes against the daemon of `home` (started by the caller, with the budget
    it wants) and return the counts. The caller asserts on them. `kill_every` SIGKILLs the daemon every so
    many seconds (the kernels start the next one)."""
    from kernel_server import Client
    from tests.helpers.faults_helpers import daemon_log, daemon_pid

    refs_path = home / "refs.json"
    refs_path.write_text(json.dumps(refs))
    pid_before = daemon_pid(home)
    sampler = Sampler(home)
    sampler.start()
    stop_killing, killed = threading.Event(), []
    if kill_every:
        threading.Thread(target=_kill_daemons, args=(home, kill_every, stop_killing, killed), daemon=True).start()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OVERMIND_HOME=str(home), PYTHONFAULTHANDLER="1")  # a worker that crashes shows its threads
    limit = ["--loads", str(loads)] if loads is not None else ["--seconds", str(seconds)]
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.faults_load", "worker", str(seed), *limit,
                               str(refs_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in range(workers)]
    results, failures = [], []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0 or not out.strip():
            finished = "after its counts" if out.strip() else "before its counts"
            failures.append(f"worker exit {proc.returncode} {finished}: {err[-3000:]}")
            continue
        results.append(json.loads(out.strip().splitlines()[-1]))
    elapsed = time.monotonic() - started
    stop_killing.set()
    sampler.finish()
    with Client(home, role="test") as probe:
        status = probe.request("status")
    log = daemon_log(home)
    total: collections.Counter[str] = collections.Counter()
    fallbacks: collections.Counter[str] = collections.Counter()
    for r in results:
        total.update({k: v for k, v in r.items() if isinstance(v, int) and k != "seed"})
        fallbacks.update(r["fallbacks"])
    sampler.stats[status["daemon"]["pid"]] = status["stats"]
    stats: collections.Counter[str] = collections.Counter()
    for per_daemon in sampler.stats.values():
        stats.update(per_daemon)
    pids = set(sampler.stats)
    return {
        "workers": workers,
        "seconds": round(elapsed, 1),
        "loads": total["loads"],
        "hits": total["hits"],
        "plain": total["plain"],
        "writes_in_place": total["writes"],
        "wrong": [w for r in results for w in r["wrong"]],
        "lost": [e for r in results for e in r["errors"]] + failures,
        "fallbacks": dict(fallbacks),
        "fallback_reasons": sorted({reason for r in results for reason in r["reasons"]})[:20],
        "daemon": {"pid_before": pid_before, "pid_after": status["daemon"]["pid"],
                   "pids_seen": len(pids | {pid_before}),
                   "restarts": len(pids | {pid_before}) - 1, "killed": len(killed),
                   "tracebacks": log.count("Traceback")},
        "store": {"budget": status["budget"], "stats": dict(stats), "entries": len(status["entries"])},
        "budget_samples": sampler.samples,
        "max_used_plus_reserved": sampler.max_held,
        "budgets_seen": sorted(sampler.budgets),
        "over_budget": sampler.over,
        "sampler_error": None if sampler.failure is None else repr(sampler.failure),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("seed", type=int)
    group = w.add_mutually_exclusive_group(required=True)
    group.add_argument("--loads", type=int)
    group.add_argument("--seconds", type=float)
    w.add_argument("refs")
    args = parser.parse_args()
    print(json.dumps(worker(args.seed, args.loads, args.seconds, args.refs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
