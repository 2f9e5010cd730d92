"""The key of a cached model passed to another cached call (a base model given to
PeftModel.from_pretrained): `result_key` packs it to check that it still is its entry (Note [References]
in overmind_jupyter/results.py), and asks the kernel which of its pages were written (Note [Finding
written pages] in overmind_jupyter/mappings.py). Timed in a fresh process right after a same-dtype miss,
and after a hit whose pieces are still pending (compaction off, so the hit maps the checkpoint), three
keys each; with the number of times /proc/self/pagemap was opened for them.

    .venv/bin/python benchmarks/reference_key.py [SIZE] [ROUNDS]     # 1.1b 5

The model is benchmarks/load.py's (built there on first use: benchmarks/out/models/llama-SIZE).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHILD = """
import json, sys, time, torch
from transformers import LlamaForCausalLM
import overmind_jupyter
from overmind_jupyter import loading
opens = []
sys.addaudithook(lambda event, args: opens.append(args[0]) if event == "open" else None)
overmind_jupyter.enable()
m = LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
times, asked = [], []
for _ in range(3):
    del opens[:]
    start = time.perf_counter()
    assert loading.result_key(m) is not None
    times.append(time.perf_counter() - start)
    asked.append(sum(path == "/proc/self/pagemap" for path in opens))
print(json.dumps({"calls": loading.calls(), "times": times, "asked": asked}))
"""


def main() -> None:
    from benchmarks.load import build, daemon, scratch_dir

    size = sys.argv[1] if len(sys.argv) > 1 else "1.1b"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    path = str(build([size], torch_files=False)[size])
    env = dict(os.environ, OVERMIND_HOME=scratch_dir("om-refkey-"), OVERMIND_COMPACT="0",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    runs: dict[str, list[dict]] = {"miss": [], "hit": []}
    daemon(env, "start")
    try:
        for _ in range(rounds):
            daemon(env, "evict", "--all")
            for case in ("miss", "hit"):
                out = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True,
                                     check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                assert result["calls"] == {case: 1}, result["calls"]
                runs[case].append(result)
    finally:
        daemon(env, "stop")
    print(f"{size} bfloat16, {rounds} rounds, a process per call, medians (ms) of each of its three keys")
    for case, results in runs.items():
        keys = [statistics.median(r["times"][i] for r in results) * 1000 for i in range(3)]
        asked = sorted({n for r in results for n in r["asked"]})
        print(f"after a {case:4}  keys {keys[0]:6.2f} {keys[1]:6.2f} {keys[2]:6.2f} ms   pagemap opened {asked} "
              "times a key")


if __name__ == "__main__":
    main()
