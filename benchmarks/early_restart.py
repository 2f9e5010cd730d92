"""A restart right after a miss: the next kernel's hit comes while the daemon still copies the model's
weights from its checkpoint into an arena of its own (Note [Pending pieces] in kernel_server/store.py).

Each round starts a daemon on a fresh OVERMIND_HOME, loads the 1.1B bf16 model in a first process (the
miss), and then, in fresh processes, as restarted kernels:
  during  right after the miss's process ends: a hit while the pieces are pending
  after   once the daemon has compacted the entry: a hit on its own arena
  plain   the plain load, no daemon
Each measured process times one of two things after its base model load (the --case argument):
  forward  the first forward (16 tokens, inference mode)
  peft     `PeftModel.from_pretrained` of an all-linear rank-4 adapter on the model (a miss of its own in
           "during" and "after": the adapter is new to each round's daemon)
and reports its RSS once the hit's populate thread is done (a second after the timed part). Printed: the
medians over the rounds, and their ratios to plain.

    .venv/bin/python benchmarks/early_restart.py [--case forward,peft] [--rounds 3] [--size 1.1b]

The model is benchmarks/load.py's (built there on first use: benchmarks/out/models/llama-SIZE).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHILD = """
import json, resource, sys, time, torch
import overmind_jupyter
path, adapter, case, cached = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if cached:
    overmind_jupyter.enable()
from transformers import AutoModelForCausalLM
from peft import PeftModel
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
wall, cpu = time.perf_counter(), time.process_time()
if case == "forward":
    with torch.inference_mode():
        base(torch.arange(16)[None])
else:
    PeftModel.from_pretrained(base, adapter)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
time.sleep(1)
rss = sum(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("Rss:")) << 10
print(json.dumps({"wall": wall, "cpu": cpu, "rss": rss}))
"""


MISS = """
import sys, torch, overmind_jupyter
overmind_jupyter.enable()
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
"""


def main() -> None:
    from benchmarks.load import build, daemon, wait_compacted
    from overmind_jupyter import demo_models

    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="forward,peft")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="1.1b")
    args = parser.parse_args()
    base = build([args.size], torch_files=False)[args.size]
    adapter = demo_models.build_lora_adapters(base, base.parent.parent / f"adapters-{args.size}-r4", ("fr",),
                                              rank=4)["fr"]
    quiet = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")

    def run(case: str, env: dict[str, str], cached: bool) -> dict:
        out = subprocess.run([sys.executable, "-c", CHILD, str(base), str(adapter), case, str(int(cached))],
                             env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    got: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for case in args.case.split(","):
            for when in ("during", "after"):  # a daemon of its own each, so that the adapter is a miss in both
                env = dict(quiet, OVERMIND_HOME=tempfile.mkdtemp(prefix="om-early-"))
                daemon(env, "start")
                try:
                    subprocess.run([sys.executable, "-c", MISS, str(base)], env=env, capture_output=True, check=True)
                    if when == "after":
                        got.setdefault((case, "compacted"), []).append({"s": wait_compacted(env)})
                    got.setdefault((case, when), []).append(run(case, env, True))
                    entries = json.loads(daemon(env, "ls", "--json"))["entries"]
                    got[(case, when)][-1]["pending"] = any(e.get("pending") is not None for e in entries)
                finally:
                    daemon(env, "stop")
                    shutil.rmtree(env["OVERMIND_HOME"], ignore_errors=True)
            got.setdefault((case, "plain"), []).append(run(case, quiet, False))

    print(f"{args.size} bf16, {args.rounds} rounds, medians; bytecode "
          f"{'absent' if os.environ.get('PYTHONDONTWRITEBYTECODE') else 'present'} for the package")
    print(f"{'case':<10}{'when':<10}{'wall s':>9}{'cpu s':>9}{'x plain':>9}{'RSS GiB':>9}")
    for case in args.case.split(","):
        plain = statistics.median(r["wall"] for r in got[(case, "plain")])
        for when in ("plain", "during", "after"):
            runs = got[(case, when)]
            wall = statistics.median(r["wall"] for r in runs)
            print(f"{case:<10}{when:<10}{wall:>9.3f}{statistics.median(r['cpu'] for r in runs):>9.3f}"
                  f"{wall / plain:>9.2f}{statistics.median(r['rss'] for r in runs) / 2**30:>9.2f}")
        during = " ".join(f"{r['wall']:.2f}" for r in got[(case, "during")])
        pending = sum(r["pending"] for r in got[(case, "during")])
        print(f"{'':<10}walls during: {during}; the base still pending after it: {pending} of {args.rounds}; "
              f"compacted {statistics.median(r['s'] for r in got[(case, 'compacted')]):.1f} s after the miss")


if __name__ == "__main__":
    main()
