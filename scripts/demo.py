"""The demo: build a small Llama-shaped model, then load it in two fresh processes through overmind.

The first process misses (it loads the checkpoint and publishes it to the daemon), the second hits
(it maps the published weights zero-copy). Both times are printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "benchmarks" / "out" / "models" / "llama-demo"
SIZE = os.environ.get("OVERMIND_DEMO_SIZE", "0.1b")

LOAD = """
import json, time, torch
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama  # imported before the clock, as in a warm kernel
import overmind_jupyter
t = time.perf_counter()
model = overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, {path!r}, dtype=torch.float32)
loaded = time.perf_counter() - t
with torch.no_grad():
    logits = model(torch.arange(16)[None]).logits
overmind_jupyter.loading.wait_for_publishes()
print(json.dumps({{"load_s": loaded, "checksum": float(logits.double().sum())}}))
"""


def main() -> None:
    from overmind_jupyter.demo_models import build_llama

    print(f"building a {SIZE} Llama-shaped model in {MODEL} (bf16 on disk, loaded as fp32)...")
    build_llama(MODEL, SIZE)
    env = dict(os.environ, OVERMIND_HOME=tempfile.mkdtemp(prefix="om-demo-"), TQDM_DISABLE="1",
               TRANSFORMERS_VERBOSITY="error")
    try:
        results = []
        for run in ("first process (miss: load and publish)", "second process (hit: shared memory)"):
            out = subprocess.run([sys.executable, "-c", LOAD.format(path=str(MODEL))], env=env, check=True,
                                 capture_output=True, text=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(result)
            print(f"{run:42} from_pretrained took {result['load_s'] * 1000:8.1f} ms")
        same = results[0]["checksum"] == results[1]["checksum"]
        print(f"speed-up {results[0]['load_s'] / results[1]['load_s']:.1f}x; outputs identical: {same}")
        subprocess.run([sys.executable, "-m", "kernel_server", "ls"], env=env, check=True)
    finally:
        subprocess.run([sys.executable, "-m", "kernel_server", "stop"], env=env, check=False)


if __name__ == "__main__":
    main()
