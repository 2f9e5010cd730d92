"""Kernel restarts: one cell loads a model, the kernel restarts, the same cell runs again.

Each case runs in a real kernel (jupyter_client) in up to three modes, in the same run:
  plain     the python3 kernelspec, plain `from_pretrained`
  overmind  the python3 kernelspec with `%overmind on` (a cached load after the restart)
  warm      a warm kernelspec (overmind_jupyter.warm, preloading the case's libraries) with `%overmind on`
Cases:
  (a) the 1.1B Llama-shaped model of load.py, loaded as fp32 from its bf16 checkpoint (`--llama 0.1b`: the
      0.1B one)
  (b) a Stable-Diffusion-shaped pipeline built locally (width 64)
  (c) a PeftModel with 3 LoRA adapters on the 0.1B model (from_pretrained + 2 load_adapter), fp32
Reported, after the restart: the load inside the cell (the modules it needs are imported first and
timed separately) and the whole cell (imports + load), overmind against plain; then, per mode, medians over
the restarts of the restart's parts, measured inside the kernel manager, the same way for every mode:
  shutdown    from `restart_kernel` (the graceful one, JupyterLab's restart button) until the old kernel is
              gone (the manager cleans up after it)
  hand-over   from there until the new kernel is launched (`provisioner.launch_kernel` returned)
  kernel_info from there until the kernel answers `kernel_info` on a new shell socket (what jupyter_server
              waits for before it answers JupyterLab's restart request)
  reconnect   from there until the client connected before the restart works again, the way JupyterLab's
              does through jupyter_server (`LabClient`): its channels, made by the kernel manager before the
              restart, get an iopub message (jupyter_server's `nudge`) and a `kernel_info` reply on its shell;
              zmq reconnects them 100-200 ms after the old kernel went away, unless the kernel manager's
              sockets were told to try sooner (a warm kernelspec does: Note [Reconnecting clients])
  kc_reconnect  (not in "ready", for comparison) from `kernel_info` until jupyter_client's own client
              (`KernelManager.client()`, a zmq context of its own, zmq's default reconnect) passes
              `wait_for_ready`: what "reconnect" measured before
  restart     the four together
  kernel_cpu  the CPU seconds the new kernel process used until it answered (from its exec, or its fork;
              for a kernel started ahead, with what it did before the restart)
then, run through the JupyterLab-like client, the setup cell (`%load_ext` + `%overmind on`, or nothing for
plain), the imports, the load
(`from_pretrained`, cached or not), "ready" (from the restart call to the end of the load: restart + setup +
imports + load, model-ready), its ratio to plain's, and the first forward after the load (cases a and c).

    .venv/bin/python benchmarks/restart.py [--cases a,b,c] [--modes plain,overmind,warm] [--repeat 5]
                                           [--llama 1.1b|0.1b] [--quick]

`--quick`: case a with the 0.1B model, plain and warm, 3 restarts each.
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
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"

CASES = {
    "a": {
        "imports": "import torch\nfrom transformers import AutoModelForCausalLM\n"
                   "from transformers.models.llama import modeling_llama",
        "load": "obj = AutoModelForCausalLM.from_pretrained({llama!r}, dtype=torch.float32)",
        "forward": "with torch.no_grad():\n    obj(torch.arange(16)[None])",
        "what": "{size} Llama as fp32",
        "preload": ["torch", "transformers", "transformers.models.llama.modeling_llama"],
    },
    "b": {
        "imports": "import torch\nfrom diffusers import DiffusionPipeline, StableDiffusionPipeline\n"
                   "from diffusers.models import UNet2DConditionModel, AutoencoderKL\n"
                   "from transformers import CLIPTextModel, CLIPTokenizer",
        "load": "obj = DiffusionPipeline.from_pretrained({sd!r})",
        "what": "SD-shaped pipeline",
        "preload": ["torch", "transformers", "diffusers"],
    },
    "c": {
        "imports": "import torch\nfrom transformers import AutoModelForCausalLM\n"
                   "from transformers.models.llama import modeling_llama\nfrom peft import PeftModel",
        "load": "base = AutoModelForCausalLM.from_pretrained({llama01!r}, dtype=torch.float32)\n"
                "obj = PeftModel.from_pretrained(base, {a0!r}, adapter_name='a0')\n"
                "obj.load_adapter({a1!r}, adapter_name='a1')\n"
                "obj.load_adapter({a2!r}, adapter_name='a2')",
        "forward": "with torch.no_grad():\n    obj(torch.arange(16)[None])",
        "what": "PeftModel, 3 adapters",
        "preload": ["torch", "transformers", "transformers.models.llama.modeling_llama", "peft"],
    },
}

CELL = """
import time as _t, json as _j
_t0 = _t.perf_counter()
{imports}
_t1 = _t.perf_counter()
{load}
_t2 = _t.perf_counter()
{forward}
_t3 = _t.perf_counter()
print(_j.dumps({{"imports": _t1 - _t0, "load": _t2 - _t1, "cell": _t2 - _t0, "forward": _t3 - _t2}}))
"""


def build(cases: list[str], llama: str) -> dict[str, str]:
    from overmind_jupyter import demo_models

    models = OUT / "models"
    paths = {}
    if "a" in cases:
        paths["llama"] = str(demo_models.build_llama(models / f"llama-{llama}", llama))
    if "b" in cases:
        paths["sd"] = str(demo_models.build_sd_pipeline(models / "sd-64", width=64))
    if "c" in cases:
        paths["llama01"] = str(demo_models.build_llama(models / "llama-0.1b", "0.1b"))
        adapters = demo_models.build_lora_adapters(paths["llama01"], models / "lora-0.1b", ("a0", "a1", "a2"),
                                                   rank=16)
        paths.update({name: str(p) for name, p in adapters.items()})
    return paths


class LabClient:
    """What JupyterLab's kernel connection is at the kernel's ports: jupyter_server's zmq channels for one
    websocket (`ZMQChannelsWebsocketConnection`), made with the kernel manager's `connect_*` and the
    session's identity, kept across a restart while the browser reconnects its websocket, and reused then
    (the ports did not change). After the restart jupyter_server opens the websocket once its `nudge` got
    a `kernel_info` reply on a new shell or control socket and any message on the reused iopub channel
    (requests repeated every 0.5 s); the browser then asks `kernel_info` on the reused shell channel and
    sends its cells there."""

    def __init__(self, km) -> None:  # type: ignore[no-untyped-def]
        from jupyter_client.session import Session

        self.km, self.session = km, Session(key=km.session.key)  # its own, as jupyter_server's: the shell's
        # identity is the session's, and the kernel routes replies by it
        self.channels = {name: getattr(km, f"connect_{name}")(identity=self.session.bsession)
                         for name in ("iopub", "shell", "control", "stdin")}

    def _recv(self, sock, timeout: float):  # type: ignore[no-untyped-def]
        if not sock.poll(int(timeout * 1000)):
            return None
        return self.session.recv(sock)[1]

    def nudge(self, timeout: float = 120) -> None:
        """jupyter_server's `nudge`: kernel_info on new shell and control sockets every 0.5 s until one of
        them replied and the reused iopub channel got a message."""
        import zmq

        shell, control, iopub = self.km.connect_shell(), self.km.connect_control(), self.channels["iopub"]
        replied = heard = False
        deadline = time.monotonic() + timeout
        try:
            while not (replied and heard):
                if time.monotonic() > deadline:
                    raise RuntimeError("the nudge got no answer")
                for sock in (shell, control):
                    self.session.send(sock, "kernel_info_request")
                again = time.monotonic() + 0.5
                poller = zmq.Poller()
                for sock in (shell, control, iopub):
                    poller.register(sock, zmq.POLLIN)
                while not (replied and heard) and (left := again - time.monotonic()) > 0:
                    for sock, _ in poller.poll(int(left * 1000) + 1):
                        self.session.recv(sock)
                        replied |= sock is not iopub
                        heard |= sock is iopub
        finally:
            shell.close(linger=0)
            control.close(linger=0)

    def kernel_info(self, timeout: float = 120) -> None:
        """The browser's `kernel_info` on the reused shell channel, once the websocket is open."""
        msg_id = self.session.send(self.channels["shell"], "kernel_info_request")["header"]["msg_id"]
        self._reply(msg_id, timeout)

    def _reply(self, msg_id: str, timeout: float):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while (msg := self._recv(self.channels["shell"], max(0.0, deadline - time.monotonic()))) is not None:
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg
        raise RuntimeError(f"no reply to {msg_id} in {timeout} s")

    def execute(self, code: str) -> str:
        """Run `code` on the reused shell channel; its stdout (iopub read until the cell's idle)."""
        msg_id = self.session.send(self.channels["shell"], "execute_request",
                                   {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                                    "allow_stdin": False, "stop_on_error": True})["header"]["msg_id"]
        out = []
        while (msg := self._recv(self.channels["iopub"], 600)) is not None:
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        reply = self._reply(msg_id, 600)
        if reply["content"]["status"] != "ok":
            raise RuntimeError("\n".join(reply["content"].get("traceback", [])) or str(reply["content"]))
        return "".join(out)

    def close(self) -> None:
        for sock in self.channels.values():
            sock.close(linger=0)


def warm_kernelspec(case: str, root: str) -> str:
    """Install the warm kernelspec of `case` (preloading its libraries) under `root`; returns its name."""
    from overmind_jupyter import warm

    name = f"om-bench-warm-{case}"
    warm.install(name, preload=CASES[case]["preload"], prefix=root)
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        p for p in (str(Path(root) / "share" / "jupyter"), os.environ.get("JUPYTER_PATH", "")) if p)
    return name


class Parts:
    """Marks the restart's parts from inside a kernel manager: when it starts cleaning up after the old
    kernel (the old kernel has exited) and when the provisioner has launched the new one. The same two
    methods run for every provisioner, so plain and warm kernels are timed alike."""

    def __init__(self, km) -> None:  # type: ignore[no-untyped-def]
        self.marks: dict[str, float] = {}
        cleanup, launch = km._async_cleanup_resources, km._async_launch_kernel

        async def cleanup_resources(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.marks.setdefault("old_gone", time.perf_counter())
            return await cleanup(*args, **kwargs)

        async def launch_kernel(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = await launch(*args, **kwargs)
            self.marks["launched"] = time.perf_counter()
            return result

        km._async_cleanup_resources, km._async_launch_kernel = cleanup_resources, launch_kernel

    def restart(self, km, kc, lab: LabClient) -> dict[str, float]:  # type: ignore[no-untyped-def]
        """Restart as JupyterLab's button does and wait until the kernel answers; the parts, in seconds."""
        self.marks.clear()
        started = time.perf_counter()
        km.restart_kernel(now=False)
        shell = km.connect_shell()  # what jupyter_server does before it answers the restart request
        try:
            km.session.send(shell, "kernel_info_request")
            if not shell.poll(120_000):
                raise RuntimeError("the restarted kernel did not answer kernel_info in 120 s")
            km.session.recv(shell)
        finally:
            shell.close(linger=0)
        answered = time.perf_counter()
        times = psutil.Process(km.provisioner.pid).cpu_times()  # a forked child's count starts at 0
        lab.nudge()
        lab.kernel_info()
        reconnected = time.perf_counter()
        kc.wait_for_ready(timeout=120)
        kc_ready = time.perf_counter()
        gone, launched = self.marks["old_gone"], self.marks["launched"]
        return {"shutdown": gone - started, "hand-over": launched - gone, "kernel_info": answered - launched,
                "reconnect": reconnected - answered, "restart": reconnected - started,
                "kc_reconnect": kc_ready - answered, "kernel_cpu": times.user + times.system}


def measure(case: str, mode: str, paths: dict[str, str], env: dict[str, str], repeat: int,
            kernel_name: str = "python3") -> list[dict]:
    from jupyter_client.manager import start_new_kernel

    spec = CASES[case]
    cell = CELL.format(imports=spec["imports"], load=spec["load"].format(**paths),
                       forward=spec.get("forward", "pass"))
    cached = mode in ("overmind", "warm")
    setup = "%load_ext overmind_jupyter\n%overmind on" if cached else "pass"
    km, kc = start_new_kernel(kernel_name=kernel_name, env=env, startup_timeout=300)
    lab = LabClient(km)
    parts = Parts(km)
    runs = []
    try:
        lab.nudge()
        lab.kernel_info()
        lab.execute(setup)
        lab.execute(cell)  # the first run of the day: for overmind a miss, published before it returns
        for _ in range(repeat):
            run = parts.restart(km, kc, lab)
            restarted = time.perf_counter()
            lab.execute(setup)
            set_up = time.perf_counter()
            run.update(json.loads(lab.execute(cell).strip().splitlines()[-1]))
            run.update(setup=set_up - restarted, ready=run["restart"] + set_up - restarted + run["cell"])
            runs.append(run)
        if cached:
            status = lab.execute("import overmind_jupyter, json; "
                                 "print(json.dumps(overmind_jupyter.loading.fallbacks()))")
            runs[-1]["fallbacks"] = json.loads(status.strip().splitlines()[-1])
    finally:
        lab.close()
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return runs


FIELDS = ("shutdown", "hand-over", "kernel_info", "reconnect", "restart", "kc_reconnect", "kernel_cpu", "setup",
          "imports", "load", "ready", "forward")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="a,b,c")
    parser.add_argument("--modes", default="plain,overmind,warm",
                        help="comma-separated, among plain, overmind, warm (plain is always run: the baseline)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--llama", choices=("1.1b", "0.1b"), default="1.1b", help="case a's model")
    parser.add_argument("--quick", action="store_true", help="case a, 0.1B model, plain and warm, 3 restarts")
    args = parser.parse_args()
    if args.quick:
        args.cases, args.modes, args.repeat, args.llama = "a", "plain,warm", 3, "0.1b"
    cases = args.cases.split(",")
    modes = ["plain", *[m for m in args.modes.split(",") if m in ("overmind", "warm")]]
    OUT.mkdir(exist_ok=True)
    paths = build(cases, args.llama)
    home = tempfile.mkdtemp(prefix="om-restart-")
    env = dict(os.environ, OVERMIND_HOME=home, TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    report = {}
    specs = tempfile.mkdtemp(prefix="om-restart-specs-")
    try:
        for case in cases:
            report[case] = {}
            for mode in modes:
                name = warm_kernelspec(case, specs) if mode == "warm" else "python3"
                report[case][mode] = measure(case, mode, paths, env, args.repeat, kernel_name=name)
    finally:
        if "warm" in modes:
            from overmind_jupyter.warm import stop_spares

            stop_spares()
        subprocess.run([sys.executable, "-m", "kernel_server", "stop"], env=env, check=False, capture_output=True)
        for scratch in (home, specs):
            shutil.rmtree(scratch, ignore_errors=True)
    (OUT / "restart.json").write_text(json.dumps(report, indent=2))
    what = {case: CASES[case]["what"].format(size=args.llama.upper()) for case in cases}
    if "overmind" in modes:
        print(f"{'case':26} {'plain load s':>12} {'ours load s':>11} {'load ratio':>10} {'plain cell s':>12} "
              f"{'ours cell s':>11} {'cell ratio':>10}")
        for case, runs_of in report.items():
            med = {m: {f: statistics.median(r[f] for r in runs) for f in ("load", "cell")}
                   for m, runs in runs_of.items()}
            fallbacks = runs_of["overmind"][-1].get("fallbacks")
            fb = f" FALLBACKS: {fallbacks}" if fallbacks else ""
            print(f"({case}) {what[case]:22} {med['plain']['load']:12.3f} {med['overmind']['load']:11.3f} "
                  f"{med['overmind']['load'] / med['plain']['load']:10.3f} {med['plain']['cell']:12.3f} "
                  f"{med['overmind']['cell']:11.3f} {med['overmind']['cell'] / med['plain']['cell']:10.3f}{fb}")
    print(f"\nthe restart's parts and model-ready, s (medians of {args.repeat} restarts; ratio: ready / plain's "
          "ready; forward: the first one after the load)")
    print(f"{'case':26} {'mode':9} " + " ".join(f"{f:>11}" for f in FIELDS[:-1]) + f" {'ratio':>6} {'forward':>8}")
    for case, runs_of in report.items():
        plain_ready = statistics.median(r["ready"] for r in runs_of["plain"])
        for mode, runs in runs_of.items():
            med = {f: statistics.median(r[f] for r in runs) for f in FIELDS}
            fb = " FALLBACKS: " + str(runs[-1]["fallbacks"]) if runs[-1].get("fallbacks") else ""
            print(f"({case}) {what[case]:22} {mode:9} " + " ".join(f"{med[f]:11.3f}" for f in FIELDS[:-1])
                  + f" {med['ready'] / plain_ready:6.3f} {med['forward']:8.3f}{fb}")


if __name__ == "__main__":
    main()
