"""A LoRA adapter after a kernel restart that did not seed torch: `PeftModel.from_pretrained` draws from
torch's generator, so it was keyed by the generator's state and missed after every restart; now its
entry holds the draws to replay (Note [Replayed draws] in overmind_jupyter/draws.py).

Every case is a fresh process, as a restarted kernel is, that seeds nothing: the base model through the
cache, then the timed `PeftModel.from_pretrained` call, wall and CPU time. A first process only loads the
base model, and the run waits until the daemon has copied its pieces into its arena: a load right after
that shares the two cores with the copy, which is not what this measures. The next process is the
adapter's miss, followed (it runs under `draws.following`); then plain and cached processes alternate, in
rounds.

    .venv/bin/python benchmarks/replayed_draws.py [SIZE] [ROUNDS] [RANK]     # 1.1b 6 4

The model is benchmarks/load.py's (built there on first use: benchmarks/out/models/llama-SIZE); the
adapter, all linear layers at rank RANK with random weights, is built beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHILD = """
import json, sys, time, torch
import overmind_jupyter
from overmind_jupyter import loading
cached = sys.argv[3] in ("cached", "base")
if cached:
    overmind_jupyter.enable()
from transformers import AutoModelForCausalLM
from peft import PeftModel
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
if sys.argv[3] == "base":
    raise SystemExit(print(json.dumps({"calls": loading.calls()})))
wall, cpu = time.perf_counter(), time.process_time()
model = PeftModel.from_pretrained(base, sys.argv[2])
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"wall": wall, "cpu": cpu, "calls": loading.calls()}))
"""


def base_and_adapter(default_rounds: int) -> tuple[str, int, int, Path, Path]:
    """SIZE, ROUNDS and RANK from the command line, and the base model and the adapter they name (each
    built on first use)."""
    from benchmarks.load import build
    from overmind_jupyter import demo_models

    size = sys.argv[1] if len(sys.argv) > 1 else "1.1b"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else default_rounds
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    base = build([size], torch_files=False)[size]
    adapter = demo_models.build_lora_adapters(base, base.parent.parent / f"adapters-{size}-r{rank}", ("fr",),
                                              rank=rank)["fr"]
    return size, rounds, rank, base, adapter


def main() -> None:
    from benchmarks.load import daemon, scratch_dir

    size, rounds, rank, base, adapter = base_and_adapter(6)
    env = dict(os.environ, OVERMIND_HOME=scratch_dir("om-draws-"), TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")

    def run(case: str) -> dict:
        out = subprocess.run([sys.executable, "-c", CHILD, str(base), str(adapter), case], env=env,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    daemon(env, "start")
    try:
        run("base")
        for _ in range(600):  # its pieces copied (Note [Pending pieces] in kernel_server/store.py)
            if all(not e.get("pending") for e in json.loads(daemon(env, "ls", "--json"))["entries"]):
                break
            time.sleep(0.1)
        followed = run("cached")
        runs: dict[str, list[dict]] = {"plain": [], "hit": []}
        for i in range(rounds):
            for case in ("plain", "cached") if i % 2 == 0 else ("cached", "plain"):
                got = run(case)
                runs["plain" if case == "plain" else "hit"].append(got)
    finally:
        daemon(env, "stop")
    assert followed["calls"] == {"hit": 1, "miss": 1}, followed
    assert all(r["calls"] == {"hit": 2} for r in runs["hit"]), runs["hit"]

    def median(case: list[dict], what: str) -> float:
        return statistics.median(r[what] for r in case)

    plain_wall, plain_cpu = median(runs["plain"], "wall"), median(runs["plain"], "cpu")
    print(f"PeftModel.from_pretrained, {size} base, all-linear rank {rank} adapter, fresh unseeded processes "
          f"({rounds} rounds; bytecode {'absent' if os.environ.get('PYTHONDONTWRITEBYTECODE') else 'present'})")
    print(f"{'case':<34}{'wall ms':>10}{'cpu ms':>10}{'x plain wall':>14}")
    rows = [("plain (median)", plain_wall, plain_cpu), ("followed miss (once)", followed["wall"], followed["cpu"]),
            ("after a restart: hit (median)", median(runs["hit"], "wall"), median(runs["hit"], "cpu"))]
    for name, wall, cpu in rows:
        print(f"{name:<34}{wall * 1e3:>10.1f}{cpu * 1e3:>10.1f}{wall / plain_wall:>14.3f}")
    print("hit walls, ms:", " ".join(f"{r['wall'] * 1e3:.1f}" for r in runs["hit"]))


if __name__ == "__main__":
    main()
