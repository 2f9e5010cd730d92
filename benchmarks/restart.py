"""Kernel restarts: one cell loads a model, the kernel restarts, the same cell runs again.

Each case runs in a real kernel (jupyter_client), plain and with `%overmind on`:
  (a) the 1.1B Llama-shaped model of load.py, loaded as fp32 from its bf16 checkpoint
  (b) a Stable-Diffusion-shaped pipeline built locally (width 64)
  (c) a PeftModel with 3 LoRA adapters on the 0.1B model (from_pretrained + 2 load_adapter), fp32
Reported, after the restart: the load inside the cell (the modules it needs are imported first and
timed separately) and the whole cell (imports + load), overmind against plain, in the same run.

    .venv/bin/python benchmarks/restart.py [--cases a,b,c] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"

CASES = {
    "a": {
        "imports": "import torch\nfrom transformers import AutoModelForCausalLM\n"
                   "from transformers.models.llama import modeling_llama",
        "load": "obj = AutoModelForCausalLM.from_pretrained({llama11!r}, dtype=torch.float32)",
        "what": "1.1B Llama as fp32",
    },
    "b": {
        "imports": "import torch\nfrom diffusers import DiffusionPipeline, StableDiffusionPipeline\n"
                   "from diffusers.models import UNet2DConditionModel, AutoencoderKL\n"
                   "from transformers import CLIPTextModel, CLIPTokenizer",
        "load": "obj = DiffusionPipeline.from_pretrained({sd!r})",
        "what": "SD-shaped pipeline",
    },
    "c": {
        "imports": "import torch\nfrom transformers import AutoModelForCausalLM\n"
                   "from transformers.models.llama import modeling_llama\nfrom peft import PeftModel",
        "load": "base = AutoModelForCausalLM.from_pretrained({llama01!r}, dtype=torch.float32)\n"
                "obj = PeftModel.from_pretrained(base, {a0!r}, adapter_name='a0')\n"
                "obj.load_adapter({a1!r}, adapter_name='a1')\n"
                "obj.load_adapter({a2!r}, adapter_name='a2')",
        "what": "PeftModel, 3 adapters",
    },
}

CELL = """
import time as _t, json as _j
_t0 = _t.perf_counter()
{imports}
_t1 = _t.perf_counter()
{load}
_t2 = _t.perf_counter()
print(_j.dumps({{"imports": _t1 - _t0, "load": _t2 - _t1, "cell": _t2 - _t0}}))
"""


def build(paths: dict[str, str]) -> None:
    from overmind_jupyter import demo_models

    models = OUT / "models"
    paths["llama11"] = str(demo_models.build_llama(models / "llama-1.1b", "1.1b"))
    paths["llama01"] = str(demo_models.build_llama(models / "llama-0.1b", "0.1b"))
    paths["sd"] = str(demo_models.build_sd_pipeline(models / "sd-64", width=64))
    adapters = demo_models.build_lora_adapters(paths["llama01"], models / "lora-0.1b", ("a0", "a1", "a2"), rank=16)
    paths.update({name: str(p) for name, p in adapters.items()})


def execute(kc, code: str) -> str:  # type: ignore[no-untyped-def]
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=600)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out)


def measure(case: str, mode: str, paths: dict[str, str], env: dict[str, str], repeat: int) -> list[dict]:
    from jupyter_client.manager import start_new_kernel

    spec = CASES[case]
    cell = CELL.format(imports=spec["imports"], load=spec["load"].format(**paths))
    setup = "%load_ext overmind_jupyter\n%overmind on" if mode == "overmind" else "pass"
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    runs = []
    try:
        execute(kc, setup)
        execute(kc, cell)  # the first run of the day: for overmind a miss that publishes
        if mode == "overmind":
            execute(kc, "import overmind_jupyter; overmind_jupyter.loading.wait_for_publishes()")
        for _ in range(repeat):
            km.restart_kernel(now=True)
            kc.wait_for_ready(timeout=120)
            execute(kc, setup)
            runs.append(json.loads(execute(kc, cell).strip().splitlines()[-1]))
        if mode == "overmind":
            status = execute(kc, "import overmind_jupyter, json; print(json.dumps(overmind_jupyter.loading.fallbacks()))")
            runs[-1]["fallbacks"] = json.loads(status.strip().splitlines()[-1])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="a,b,c")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    paths: dict[str, str] = {}
    build(paths)
    home = tempfile.mkdtemp(prefix="om-restart-")
    env = dict(os.environ, OVERMIND_HOME=home, TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    report = {}
    try:
        for case in args.cases.split(","):
            report[case] = {mode: measure(case, mode, paths, env, args.repeat) for mode in ("plain", "overmind")}
    finally:
        subprocess.run([sys.executable, "-m", "kernel_server", "stop"], env=env, check=False, capture_output=True)
    (OUT / "restart.json").write_text(json.dumps(report, indent=2))
    print(f"{'case':26} {'plain load s':>12} {'ours load s':>11} {'load ratio':>10} {'plain cell s':>12} "
          f"{'ours cell s':>11} {'cell ratio':>10}")
    for case, modes in report.items():
        med = {m: {f: statistics.median(r[f] for r in runs) for f in ("load", "cell")} for m, runs in modes.items()}
        fb = " FALLBACKS: " + str(modes["overmind"][-1].get("fallbacks")) if modes["overmind"][-1].get("fallbacks") else ""
        print(f"({case}) {CASES[case]['what']:22} {med['plain']['load']:12.3f} {med['overmind']['load']:11.3f} "
              f"{med['overmind']['load'] / med['plain']['load']:10.3f} {med['plain']['cell']:12.3f} "
              f"{med['overmind']['cell']:11.3f} {med['overmind']['cell'] / med['plain']['cell']:10.3f}{fb}")


if __name__ == "__main__":
    main()
