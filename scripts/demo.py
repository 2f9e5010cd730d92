"""`make demo`: build the demo model, then open JupyterLab on 127.0.0.1 with the quickstart notebook.

    python scripts/demo.py              # JupyterLab (foreground; Ctrl-C stops it)
    python scripts/demo.py --headless   # no browser: load the model in two fresh processes, print both times

The notebooks build their models under notebooks/models/ (git-ignored); the demo builds the quickstart's
model first so that the notebook's first cell finds it. OVERMIND_DEMO_MODEL picks its size ("tiny",
"0.1b", "1.1b"); the default is 0.1b.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SIZE = os.environ.get("OVERMIND_DEMO_MODEL", "0.1b")

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
print(json.dumps({{"load_s": loaded, "checksum": float(logits.double().sum())}}))
"""


def build() -> Path:
    from overmind_jupyter.demo_models import build_llama

    path = NOTEBOOKS / "models" / f"llama-{SIZE}"
    print(f"building a {SIZE} Llama-shaped model in {path.relative_to(ROOT)} (once)...", flush=True)
    return build_llama(path, SIZE)


def headless(path: Path) -> None:
    env = dict(os.environ, OVERMIND_HOME=tempfile.mkdtemp(prefix="om-demo-"), TQDM_DISABLE="1",
               TRANSFORMERS_VERBOSITY="error")
    try:
        results = []
        for run in ("first process (miss: load and publish)", "second process (hit: shared memory)"):
            out = subprocess.run([sys.executable, "-c", LOAD.format(path=str(path))], env=env, check=True,
                                 capture_output=True, text=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(result)
            print(f"{run:42} from_pretrained took {result['load_s'] * 1000:8.1f} ms")
        same = results[0]["checksum"] == results[1]["checksum"]
        print(f"speed-up {results[0]['load_s'] / results[1]['load_s']:.1f}x; outputs identical: {same}")
    finally:
        subprocess.run([sys.executable, "-m", "kernel_server", "stop"], env=env, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lab() -> int:
    port, token = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}/lab/tree/quickstart.ipynb?token={token}"
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={NOTEBOOKS}"]
    if os.getuid() == 0:
        command.append("--allow-root")
    print(f"\nJupyterLab with the quickstart notebook:\n\n    {url}\n\n(Ctrl-C stops it)\n", flush=True)
    proc = subprocess.Popen(command, cwd=NOTEBOOKS)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # stop what we started, also when killed
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headless", action="store_true", help="no JupyterLab: two processes, two loads")
    args = parser.parse_args()
    path = build()
    if args.headless:
        headless(path)
        return 0
    return lab()


if __name__ == "__main__":
    sys.exit(main())
