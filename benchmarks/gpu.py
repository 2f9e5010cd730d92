"""A model to the first token on a GPU: plain, miss, hit and warm restart, and probes of faster copies (issue 36).

For each model size (random Llamas saved in bf16 with save_pretrained, built here from a config: no hub), in
one run:
  plain   `LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")`
  miss    the same call with overmind enabled and an empty store (the entry is made before it returns)
  hit     the same call with the entry published (a later kernel's call), the device copier holding no
          copy of it: the copier fills the kernel's memory from the arena through pinned staging, and keeps
          a copy on the device (Note [Device copies] in overmind_jupyter/units/copier.py)
  copy    the same call again: filled from the copier's device copy (the common case after a restart)
each in a fresh process forked from one that imported torch, transformers and the Llama modeling module and
ran no torch operation (a fork of such a process is safe; benchmarks/load.py), in rounds (plain, miss, hit,
then the next round), medians. Each process creates its CUDA context first (`ctx`, timed), then makes the
call (`call`; for the miss and the hit, `copy`: the part of it spent placing the model on the device, Note
[Devices] in overmind_jupyter/placement.py), then generates one token (`first`: greedy, one new token from 16,
synchronised). `total` = ctx + call + first, and its ratio to plain's of the same round set.
  warm    a warm kernel (overmind_jupyter.warm, preloading torch and transformers) restarted as JupyterLab
          does, then `%load_ext` + `%overmind on` and the same call and token in a cell: restart to the
          first token (needs ipykernel and jupyter_client: without them the column is skipped, and says so).
          Each restart waits first until the kernel started ahead has warmed its device (its CUDA context
          and cuBLAS handles, Note [Devices warmed ahead] in overmind_jupyter/warm/warmup.py; `cpu` in a
          dry run), as a restart asked for later than a second after the last one finds it
Then the copy probes (benchmarks/gpu_probes.py): the model's bytes copied into a kernel's device memory by
each candidate path, in GB/s.

The goal's lines (issue 36) are printed with the table: hit <= 0.15 x plain (1B) and <= 0.1 x (7B) to the
first token, miss <= 1.3 x plain, warm restart to the first token of the 8B-class model <= 0.5 s.

    python benchmarks/gpu.py                       # 1.1b and 7b, 2 rounds, within 8 minutes on one H200
    python benchmarks/gpu.py --quick               # 1.1b only
    python benchmarks/gpu.py --sizes 1.1b,8b --rounds 3 --out gpu.json
    python benchmarks/gpu.py --dry-run             # no GPU: a tiny model on "cpu" stand-ins, CUDA-only parts skipped

The JSON goes to --out (default $OUT/gpu.json when $OUT is set, else benchmarks/out/gpu.json), and the table
beside it (gpu.txt), each written again as each size ends. A deadline (--budget, seconds) skips what would not
fit, with a message, and the table is printed whatever ran: also when the run is stopped by SIGTERM (a time
limit's `timeout`), with what ran until then.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT = HERE / "out"
PROMPT = 16  # tokens of the prompt
GOAL_HIT = {"1.1b": 0.15, "7b": 0.1, "8b": 0.1}
GOAL_MISS = 1.3
GOAL_WARM_S = 0.5  # restart to the first token of an 8B-class model
CASES = ("plain", "miss", "hit", "copy")


# -- in the processes forked for each case ---------------------------------------------------------------

def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def case(spec: dict[str, Any]) -> dict[str, Any]:
    """One load to the first token (see the module's docstring), in a process of its own."""
    import torch
    from transformers import LlamaForCausalLM

    device, result = spec["device"], {"copy": None}
    if spec["case"] != "plain":
        import overmind_jupyter
        from overmind_jupyter import loading

        overmind_jupyter.enable()
        place = loading.place  # the patched call's placement (Note [Devices] in placement.py)

        def timed_place(obj: Any, where: Any) -> Any:
            t = time.perf_counter()
            out = place(obj, where)
            _sync(device)
            result["copy"] = time.perf_counter() - t
            return out

        loading.place = timed_place
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, PROMPT))  # within every size's vocabulary
    t0 = time.perf_counter()
    if device == "cuda":
        torch.empty(1, device="cuda")
        _sync(device)
    t1 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16, device_map=device)
    _sync(device)
    t2 = time.perf_counter()
    with torch.inference_mode():
        ids = ids.to(device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                             do_sample=False, pad_token_id=0)
        _sync(device)
        t3 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                       do_sample=False, pad_token_id=0)
        _sync(device)
        t4 = time.perf_counter()
        logits = model(ids).logits
    result.update(ctx=t1 - t0, call=t2 - t1, first=t3 - t2, total=t3 - t0, steady=t4 - t3,
                  token=int(out[0, -1]), checksum=float(logits.double().sum()),
                  on=str(next(model.parameters()).device))
    if device == "cuda" and not result["on"].startswith("cuda"):
        raise RuntimeError(f"the {spec['case']} case's model is on {result['on']}, not the GPU")
    if spec["case"] != "plain":
        from overmind_jupyter.units import filling, residency

        loading.place = place
        result["fallbacks"] = [f["reason"] for f in loading.fallbacks()] + list(filling.reasons())
        placed = [e for e in residency.instance().events if e["event"] == "placed"]
        result["fill"] = placed[-1].get("fill") if placed else None
        expected = "hit" if spec["case"] == "copy" else spec["case"]
        if loading.calls() != {expected: 1}:
            raise RuntimeError(f"the {spec['case']} case was {loading.calls()}: {result['fallbacks']}")
    return result


def fork_parent() -> None:
    """Import what a kernel that loads a Llama model has imported, run no torch operation, then for each
    JSON request on stdin fork a process that runs it (a `case` or the probes) and writes its result to
    the request's file; answer with a line {"code": exit code}."""
    import torch
    import torch.multiprocessing
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before the fork: the forked processes could not use it")
    sys.path.insert(0, str(HERE))
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            log = os.open(request["result"] + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(log, 1)  # stdout is the orchestrator's pipe: what the libraries print goes to the job's log
            os.dup2(log, 2)
            try:
                if request["job"] == "probes":
                    import gpu_probes

                    gpu_probes.run(request)
                elif request["job"] == "sleep":  # a job that hangs, for the test of the timeout
                    Path(request["result"]).write_text(json.dumps({"partial": True}))
                    time.sleep(request["seconds"])
                else:
                    Path(request["result"]).write_text(json.dumps(case(request)))
                code = 0
            except BaseException:  # noqa: BLE001 (on stderr, the parent's log; the orchestrator reports it)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        print(json.dumps({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)


class JsonLines:
    """The JSON lines a process writes to a pipe, each awaited at most a timeout. It reads the pipe itself:
    a buffered file's readline may take two lines at once, and a select() on the pipe then waits for the
    second, which has already come (a job that ends at once: its "pid" and "code" lines together)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending = fd, b""

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next line, or None if none came in `timeout` seconds. Raises EOFError at the pipe's end."""
        import select

        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            if not select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise EOFError
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer


class ForkParent:
    """A `fork_parent` process; `run` forks a job from it and waits for it, at most a timeout."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log_path = env, log
        self._start()

    def _start(self) -> None:
        self.log = self.log_path.open("a")
        self.proc = subprocess.Popen([sys.executable, __file__, "--fork-parent"], env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines = JsonLines(self.proc.stdout.fileno())
        if self._line(600) is None:
            raise RuntimeError(f"the fork parent did not start in 600 s: see {self.log_path}")

    def _line(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.lines.next(timeout)
        except EOFError:
            raise RuntimeError(f"the fork parent ended: see {self.log_path}") from None

    def run(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run `request` in a forked process; its result, or {"error": ...} (the partial result kept)."""
        result = Path(tempfile.mktemp(prefix="om-gpu-", suffix=".json"))
        self.proc.stdin.write(json.dumps(request | {"result": str(result)}) + "\n")
        self.proc.stdin.flush()
        started = self._line(60)
        if started is None:
            raise RuntimeError(f"the fork parent did not fork in 60 s: see {self.log_path}")
        done = self._line(timeout)
        if done is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(started["pid"], signal.SIGKILL)
            error = f"timed out after {timeout:.0f} s"
            if self._line(60) is None:  # the job is stuck in the kernel (a driver call): leave it, and
                self.proc.kill()  # start another parent, since this one waits for it
                self.proc.wait()
                self.log.close()
                self._start()
                error += " (not ended by SIGKILL within 60 s: left behind, the fork parent restarted)"
        else:
            error = f"exited with {done['code']}" if done["code"] else ""
        log = Path(f"{result}.log")
        if error and log.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-12:]
            error += ":\n    " + "\n    ".join(tail)
        try:
            out: dict[str, Any] = json.loads(result.read_text())
        except (OSError, ValueError):  # none written, or cut short by the kill
            out = {}
        result.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        return out | ({"error": error} if error else {})

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -- building the models (a process of its own, which may use the GPU) ------------------------------------

def build(spec: dict[str, Any]) -> None:
    """Build each size's checkpoint (weights drawn on the GPU where there is one) and print what the
    machine has: torch, transformers, the device."""
    import torch
    import transformers

    from overmind_jupyter.demo_models import build_llama

    cuda = torch.cuda.is_available() and not spec["dry_run"]
    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": cuda,
                            "cpus": os.cpu_count(), "models": {}}
    if cuda:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    for size in spec["sizes"]:
        t0 = time.perf_counter()
        path = build_llama(Path(spec["root"]) / f"llama-{size}", size, device="cuda" if cuda else "cpu")
        info["models"][size] = {"path": str(path), "built_s": time.perf_counter() - t0,
                                "bytes": sum(f.stat().st_size for f in path.glob("*.safetensors"))}
    print(json.dumps(info), flush=True)


# -- the warm restart column ------------------------------------------------------------------------------

WARM_CELL = """
import json, time, torch
from transformers import LlamaForCausalLM
t0 = time.perf_counter()
if {device!r} == "cuda":
    torch.empty(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
model = LlamaForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16, device_map={device!r})
if {device!r} == "cuda":
    torch.cuda.synchronize()
t2 = time.perf_counter()
torch.manual_seed(0)
ids = torch.randint(0, 256, (1, {prompt})).to({device!r})
with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                         do_sample=False, pad_token_id=0)
if {device!r} == "cuda":
    torch.cuda.synchronize()
t3 = time.perf_counter()
import overmind_jupyter, overmind_jupyter.warm
print(json.dumps({{"ctx": t1 - t0, "call": t2 - t1, "first": t3 - t2, "cell": t3 - t0, "token": int(out[0, -1]),
                  "calls": overmind_jupyter.loading.calls(), "warmed": overmind_jupyter.warm.warmed(),
                  "fallbacks": [f["reason"] for f in overmind_jupyter.loading.fallbacks()]}}))
del model
"""


def importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def cache_missing() -> str | None:
    """Why the miss and the hit cannot run here, if they cannot: `enable()` reads its settings with traitlets,
    and a miss pickles the model's graph with dill's pickler at hand."""
    missing = [m for m in ("traitlets", "dill") if not importable(m)]
    if missing:
        return (f"{', '.join(missing)} not importable here: the miss and hit cases are skipped (carry the wheels: "
                "scripts/device_wheels.sh, then benchmarks/gpu_run.sh installs them)")
    return None


def last_line(error: str) -> str:
    return error.strip().splitlines()[-1].strip() if error.strip() else error


def warm_missing() -> str | None:
    missing = [m for m in ("ipykernel", "jupyter_client", "IPython", "traitlets", "zmq", "psutil")
               if not importable(m)]
    if missing:
        return (f"{', '.join(missing)} not importable here: the warm restart column is skipped (carry the wheels: "
                "scripts/device_wheels.sh, then benchmarks/gpu_run.sh installs them)")
    return None


def provisioner_entry_point(root: Path) -> None:
    """jupyter_client finds the warm provisioner by its entry point, which an installed overmind_jupyter
    declares; on a machine where the package only lies on PYTHONPATH (the device), declare it here."""
    from importlib.metadata import entry_points

    if entry_points(group="jupyter_client.kernel_provisioners", name="overmind-warm"):
        return
    info = root / "overmind_jupyter_entry-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: overmind-jupyter-entry\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[jupyter_client.kernel_provisioners]\n"
                                           "overmind-warm = overmind_jupyter.warm.provisioner:WarmProvisioner\n")
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    importlib.invalidate_caches()


def warmed_ahead(timeout: float) -> list[dict[str, Any]] | None:
    """What the kernel started ahead warmed, once it has said so to its spare (Note [Devices warmed ahead] in
    overmind_jupyter/warm/warmup.py); None if no kernel started ahead said so within `timeout` s."""
    from overmind_jupyter.warm import describe_spares

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for spare in describe_spares():
            if spare["ahead"] and all(pid in spare["warmed"] for pid in spare["ahead"]):
                devices: list[dict[str, Any]] = spare["warmed"][spare["ahead"][-1]]
                return devices
        time.sleep(0.02)
    return None


def warm(paths: dict[str, str], device: str, env: dict[str, str], restarts: int, work: Path,
         deadline: float, sizes: dict[str, int]) -> dict[str, Any]:
    """Per size: a warm kernel, the cell once (the entry is already there: a hit), then `restarts`
    restarts, each followed by the setup and the cell; medians of restart, setup, ctx, call, first and
    ready (restart + setup + cell: the restart to the first token)."""
    sys.path.insert(0, str(HERE))
    from jupyter_client.manager import start_new_kernel
    from restart import LabClient, Parts  # restart.py's client and timing of a restart, as JupyterLab makes it

    os.environ.update(env)
    if device == "cpu":  # a dry run: the kernel started ahead runs the warm-up's steps on the CPU
        os.environ.setdefault("OVERMIND_WARM_DEVICES", "cpu")
    provisioner_entry_point(work / "entry")
    from overmind_jupyter import warm as warm_kernels

    name = "om-gpu-warm"
    warm_kernels.install(name, preload=["torch", "transformers", "transformers.models.llama.modeling_llama"],
                         prefix=str(work / "jupyter"))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        p for p in (str(work / "jupyter" / "share" / "jupyter"), os.environ.get("JUPYTER_PATH", "")) if p)
    rows: dict[str, Any] = {}
    for size, path in paths.items():
        if time.monotonic() + 20 + 2 * sizes[size] / 1e9 > deadline:  # a kernel's start and 1 + restarts cells
            rows[size] = {"skipped": "the run's budget was spent"}
            print(f"warm restart, {size}: skipped, the run's budget was spent", flush=True)
            continue
        cell = WARM_CELL.format(path=path, device=device, prompt=PROMPT)
        km, kc = start_new_kernel(kernel_name=name, env=dict(os.environ), startup_timeout=300)
        lab, parts, runs = LabClient(km), Parts(km), []
        try:
            lab.nudge()
            lab.kernel_info()
            setup = "%load_ext overmind_jupyter\n%overmind on"
            lab.execute(setup)
            lab.execute(cell)
            for _ in range(restarts):
                if time.monotonic() + 5 + sizes[size] / 1e9 > deadline:  # the wait for the kernel ahead, the cell
                    break
                ahead = warmed_ahead(60)  # not timed: the kernel started ahead has warmed its device
                run = parts.restart(km, kc, lab)
                run["warmed_ahead"] = ahead
                t = time.perf_counter()
                lab.execute(setup)
                run["setup"] = time.perf_counter() - t
                run.update(json.loads(lab.execute(cell).strip().splitlines()[-1]))
                run["ready"] = run["restart"] + run["setup"] + run["cell"]
                runs.append(run)
        finally:
            lab.close()
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        fields = ("restart", "setup", "ctx", "call", "first", "cell", "ready")
        rows[size] = {f: statistics.median(r[f] for r in runs) for f in fields} if runs else {}
        rows[size].update(runs=runs, hits=sum(r["calls"] == {"hit": 1} for r in runs),
                          warmed=[w for r in runs for w in r["warmed"]])
    return rows


# -- the orchestrator --------------------------------------------------------------------------------------

def daemon(env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kernel_server", *args], env=env, capture_output=True, text=True,
                          check=True).stdout


def wait_compacted(env: dict[str, str], timeout: float) -> float:
    """Until the daemon copied every entry's pending pieces (Note [Pending pieces] in kernel_server/store.py)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if all(e.get("pending") is None for e in json.loads(daemon(env, "ls", "--json"))["entries"]):
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise RuntimeError(f"the daemon did not compact the entry in {timeout:.0f} s")


def read_through(path: Path) -> None:
    for file in path.glob("*.safetensors"):
        with open(file, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def source_file(path: Path, n: int, directory: str) -> Path:
    """The model's bytes in one file in `directory` (/dev/shm: shared memory, as a memfd arena's pages; a
    directory on a disk: page cache, as a file arena's), or in the temporary directory when `directory` is
    missing or has too little room."""
    shm = Path(directory)
    where = shm if shm.is_dir() and shutil.disk_usage(shm).free > n + (4 << 30) else None
    fd, name = tempfile.mkstemp(prefix="om-gpu-probe-", dir=where)
    with os.fdopen(fd, "wb") as out:
        for file in sorted(path.glob("*.safetensors")):
            with open(file, "rb") as f:
                shutil.copyfileobj(f, out, 64 << 20)
    return Path(name)


def copier_request(env: dict[str, str], message: dict[str, Any], wait: float = 0.0) -> dict[str, Any] | None:
    """One request to the device copier of the run's OVERMIND_HOME (its protocol: overmind_jupyter/units/
    copier.py); None when none answers within `wait` seconds."""
    import socket

    path = str(Path(env["OVERMIND_HOME"]) / "copier.sock")
    deadline = time.monotonic() + wait
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(path)
            conn.send(json.dumps(message).encode())
            answer: dict[str, Any] = json.loads(conn.recv(1 << 16))
            return answer
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        finally:
            conn.close()


def start_copier(env: dict[str, str], log: Path) -> dict[str, Any] | None:
    """Start the device copier before the rounds (a kernel starts it at its first move, which then copies the
    plain way: Note [Filling a model on a device] in overmind_jupyter/units/filling.py); its hello, or None."""
    with log.open("ab") as out:
        subprocess.Popen([sys.executable, "-m", "overmind_jupyter.units.copier"], env=env, stdout=out, stderr=out,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    return copier_request(env, {"kind": "hello", "version": 1}, wait=120)


def median_rows(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {"runs": runs, "errors": [r["error"] for r in runs if "error" in r]}
    for field in ("ctx", "call", "copy", "first", "total", "steady"):
        values = [r[field] for r in ok if r.get(field) is not None]
        row[field] = statistics.median(values) if values else None
    row["fallbacks"] = sorted({f for r in ok for f in r.get("fallbacks", [])})
    row["fills"] = sorted({source for r in ok for source in ((r.get("fill") or {}).get("sources") or {"plain": 1})})
    row["tokens"] = sorted({r["token"] for r in ok})
    row["checksums"] = sorted({r["checksum"] for r in ok if r.get("checksum") is not None})
    return row


def summarize(runs: dict[str, list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    """The table's rows of a size from the cases' runs so far (a case with none has no row), with the
    tokens and the logits' checksums that differ between cases: a hit's weights are the plain load's, byte
    for byte, so its logits should be too (a kernel that picks another algorithm for another address
    could round differently in the last place: flagged, not failed)."""
    rows = {name: median_rows(r) for name, r in runs.items() if r}
    plain = rows.get("plain")
    for row in rows.values():
        if plain and row["total"] and plain["total"]:
            row["x_plain"] = row["total"] / plain["total"]
            row["x_plain_without_ctx"] = (row["total"] - row["ctx"]) / (plain["total"] - plain["ctx"])
        if row["copy"]:
            row["copy_gbps"] = nbytes / row["copy"] / 1e9
    tokens = {t for row in rows.values() for t in row["tokens"]}
    if len(tokens) > 1:
        rows["tokens_differ"] = sorted(tokens)
    if plain and plain["checksums"]:
        differ = {name: row["checksums"] for name, row in rows.items()
                  if name != "plain" and isinstance(row, dict) and row.get("checksums")
                  and row["checksums"] != plain["checksums"]}
        if differ:
            rows["checksums_differ"] = {"plain": plain["checksums"], **differ}
    return rows


def round_seconds(nbytes: int, cases: tuple[str, ...]) -> float:
    """About what a round of `cases` takes on an H200: each case a process's CUDA context, call and first
    token (~4 s) and the model's bytes at pageable speed (~3 GB/s), and after the miss the daemon's copy of
    its pending pieces (`wait_compacted`, ~2 GB/s)."""
    gb = nbytes / 1e9
    return len(cases) * (4 + gb / 3) + (gb / 2 if "miss" in cases else 0)


def measure_cases(parent: ForkParent, size: str, model: dict[str, Any], device: str, env: dict[str, str],
                  rounds: int, deadline: float, cases: tuple[str, ...], slot: dict[str, Any]) -> None:
    """The cases' rounds of one size, their rows in `slot["cases"]`: also those that ran before a failure or a
    SIGTERM stopped the rounds."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    per_gb = max(20.0, 8.0 * model["bytes"] / 1e9)  # seconds a case may take before it is killed, 7B: ~110 s
    expected = round_seconds(model["bytes"], cases)
    try:
        for k in range(rounds):
            if time.monotonic() + expected > deadline:
                print(f"{size}: round {k + 1} skipped, the run's budget is nearly spent", flush=True)
                break
            daemon(env, "evict", "--all")
            for name in cases:
                if name in ("miss", "hit") and device == "cuda":
                    copier_request(env, {"kind": "drop"})  # the hit fills from the arena, and keeps a copy
                spec = {"job": "case", "case": name, "model": model["path"], "device": device}
                runs[name].append(parent.run(spec, per_gb))
                print(f"{size} round {k + 1} {name}: " + ", ".join(
                    f"{f} {runs[name][-1][f]:.3f} s" for f in ("ctx", "call", "copy", "first", "total")
                    if runs[name][-1].get(f) is not None) + (f"  ERROR {last_line(runs[name][-1]['error'])}"
                                                             if "error" in runs[name][-1] else ""), flush=True)
                if name == "miss" and "error" not in runs[name][-1]:
                    runs[name][-1]["compacted"] = wait_compacted(env, per_gb)
    finally:
        slot["cases"] = summarize(runs, model["bytes"])


def probe(parent: ForkParent, size: str, model: dict[str, Any], device: str, args: argparse.Namespace,
          deadline: float, skip: dict[str, str]) -> dict[str, Any]:
    """The copy probes (gpu_probes.py) of one model's bytes; `skip` gathers the probes that did not finish,
    so that a larger model does not wait for them again."""
    if time.monotonic() + 30 + 10 * model["bytes"] / 1e9 > deadline:
        print(f"probes, {size}: skipped, the run's budget was spent", flush=True)
        return {"skipped": "the run's budget was spent"}
    source = source_file(Path(model["path"]), model["bytes"], args.probe_dir)
    try:
        n = source.stat().st_size
        timeout = min(deadline - time.monotonic(), 60 + 3 * args.register_timeout + 10 * n / 1e9)
        print(f"probes, {size}: {n / 1e9:.2f} GB from {source} ...", flush=True)
        probes = parent.run({"job": "probes", "source": str(source), "bytes": n, "device": device,
                             "register_timeout": args.register_timeout, "skip": skip}, timeout)
    finally:
        source.unlink()
    for name, row in probes.get("probes", {}).items():
        if "did not finish" in row.get("skipped", "") and name not in skip:
            skip[name] = f"the {size} model's registration did not finish in time"
            if name == "pinned":  # the helper was killed: pinned-ro did not run
                skip.setdefault("pinned-ro", skip[name])
    if probes.get("running") and "error" in probes:  # the job was killed during this probe
        skip[probes["running"]] = f"it did not finish for the {size} model"
    return probes | {"source": str(source.parent)}


@contextlib.contextmanager
def reported(slot: dict[str, Any], key: str) -> Iterator[None]:
    """A step that fails leaves its error in `slot[key]` and the run goes on to the next step and the table."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 (reported in the table and the JSON)
        error = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        slot[key] = slot[key] | error if isinstance(slot.get(key), dict) else error  # what ran before it stays
        print(f"{key}: ERROR {type(exc).__name__}: {last_line(str(exc))}", flush=True)


def run_all(args: argparse.Namespace, report: dict[str, Any], start: float) -> None:
    """The whole run, into `report` as it goes (main writes it whatever happens, Note [A report that
    survives the time limit])."""
    deadline = start + args.budget
    root = Path(args.models_dir)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="om-gpu-"))
    home = tempfile.mkdtemp(prefix="om-gpu-home-")
    env = dict(os.environ, OVERMIND_HOME=home, PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OVERMIND_DISK_RESERVE", "1G")  # as the suite's daemons: 10% of a large, full disk may be all
    # The store's default budget is half of MemTotal, and a lent machine's MemTotal starts far below the memory
    # it grows to (H200.md): a 7B entry might not fit, and its miss would run plainly. (A size above MemTotal
    # is refused; a share of it never is.)
    env.setdefault("OVERMIND_BUDGET", "90%")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    parent, device, daemon_started = None, "cpu", False
    try:
        sizes = args.sizes.split(",")
        print(f"building {', '.join(sizes)} under {root} ...", flush=True)
        built = subprocess.run([sys.executable, __file__, "--build", json.dumps(
            {"sizes": sizes, "root": str(root), "dry_run": args.dry_run})], env=env, capture_output=True, text=True,
            check=False)
        if built.returncode:
            raise RuntimeError(f"building the models failed:\n{built.stderr[-3000:]}")
        report.update(json.loads(built.stdout.strip().splitlines()[-1]))
        device = "cuda" if report["cuda"] else "cpu"
        report.update(device=device)
        if device == "cpu":
            note = ("no CUDA device" + (" (--dry-run)" if args.dry_run else "") + ": device_map='cpu' stands in for "
                    "'cuda', no CUDA context is made, and the probes run with CPU stand-ins (registrations skipped); "
                    "the figures check the script's logic, they are not the GPU's")
            report["notes"].append(note)
            print(note, flush=True)
        need = 2 * sum(m["bytes"] for m in report["models"].values()) + (10 << 30)
        if "OVERMIND_ARENA" not in os.environ and shutil.disk_usage(home).free < need:
            env["OVERMIND_ARENA"] = "memfd"  # the entries' arenas in memory: the disk cannot hold them beside the files
            report["notes"].append(f"{shutil.disk_usage(home).free / 2**30:.0f} GiB free on the disk of {home}: the "
                                   "arenas are memfds (OVERMIND_ARENA=memfd), not files")
            print(report["notes"][-1], flush=True)
        cases = CASES
        if (why := cache_missing()) is not None:
            report["notes"].append(why)
            print(why, flush=True)
            cases = ("plain",)
        print(f"built in {time.monotonic() - start:.1f} s: " + ", ".join(
            f"{s} {m['bytes'] / 1e9:.2f} GB" for s, m in report["models"].items()), flush=True)
        daemon_started = True  # (stopped at the end whether or not it came up)
        daemon(env, "start")
        if device == "cuda" and "hit" in cases:
            hello = start_copier(env, work / "copier.log")
            report["copier"] = hello or {"error": "the device copier did not answer in 120 s: "
                                         + (work / "copier.log").read_text(errors="replace")[-2000:]}
            print(f"device copier: {report['copier']}", flush=True)
        parent = ForkParent(env, work / "fork-parent.log")
        skip: dict[str, str] = {}  # registrations that timed out for a smaller model are not tried again
        for size, model in report["models"].items():  # the smaller model's cases and probes first
            if time.monotonic() > deadline:
                report["sizes"][size] = {"skipped": "the run's budget was spent"}
                print(f"{size}: skipped, the run's budget was spent", flush=True)
                continue
            read_through(Path(model["path"]))  # every case starts from files in the page cache
            report["sizes"][size] = {"bytes": model["bytes"]}
            with reported(report["sizes"][size], "cases"):
                measure_cases(parent, size, model, device, env, args.rounds, deadline, cases, report["sizes"][size])
            if not args.no_probes:
                with reported(report["sizes"][size], "probes"):
                    report["sizes"][size]["probes"] = probe(parent, size, model, device, args, deadline, skip)
            save(report, args.out, start)  # a size's figures are kept whatever happens to the next
        if args.no_warm:
            report["warm"] = {"skipped": "--no-warm"}
        elif (why := warm_missing()) is not None:
            report["warm"] = {"skipped": why}
            print(why, flush=True)
        else:
            paths = {s: m["path"] for s, m in report["models"].items()}
            with reported(report, "warm"):
                report["warm"] = warm(paths, device, env, args.restarts, work, deadline,
                                      {s: m["bytes"] for s, m in report["models"].items()})
    finally:
        if parent is not None:
            parent.close()
        if device == "cuda" and daemon_started:
            report["copier_state"] = copier_request(env, {"kind": "state"})
        if daemon_started:
            with contextlib.suppress(subprocess.CalledProcessError):
                daemon(env, "stop")  # the copier exits with it
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# -- the table ---------------------------------------------------------------------------------------------

def _s(value: Any, width: int = 7) -> str:
    return f"{value:{width}.3f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def goals(report: dict[str, Any]) -> list[str]:
    lines = []
    for size, data in report["sizes"].items():
        cases = data.get("cases")
        if not cases:
            continue
        miss = cases.get("miss", {}).get("x_plain")
        line = GOAL_HIT.get(size)
        for name, what in (("hit", "hit from the arena"), ("copy", "hit from the device copy")):
            hit = cases.get(name, {}).get("x_plain")
            if line is not None and hit is not None:
                lines.append(f"{size}: {what} {hit:.3f} x plain to the first token (goal <= {line}): "
                             f"{'MET' if hit <= line else 'NOT MET'}")
        if miss is not None:
            lines.append(f"{size}: miss {miss:.3f} x plain (goal <= {GOAL_MISS}): "
                         f"{'MET' if miss <= GOAL_MISS else 'NOT MET'}")
    for size, row in (report.get("warm") or {}).items():
        if isinstance(row, dict) and row.get("ready") is not None and size in ("7b", "8b"):
            lines.append(f"{size}: warm restart to the first token {row['ready']:.3f} s (goal <= {GOAL_WARM_S} s): "
                         f"{'MET' if row['ready'] <= GOAL_WARM_S else 'NOT MET'}")
    return lines


def table(report: dict[str, Any]) -> str:
    """The report as the table printed at the end (and written beside the JSON)."""
    lines: list[str] = []
    say = lines.append
    say(f"\n{report.get('gpu', 'no GPU')}; torch {report.get('torch', '?')}, transformers "
        f"{report.get('transformers', '?')}, device {report.get('device', '?')}"
        f"{' (DRY RUN)' if report['dry_run'] else ''}; {report['wall_s']:.0f} s in all")
    for note in report["notes"]:
        say(f"NOTE: {note}")
    for size, data in report["sizes"].items():
        if "skipped" in data:
            say(f"\n{size}: skipped: {data['skipped']}")
            continue
        say(f"\n{size} Llama, bf16, {data['bytes'] / 1e9:.2f} GB, device_map={report['device']!r}: "
            "seconds to the first token (medians)")
        say(f"{'case':6} {'ctx':>7} {'call':>7} {'copy':>7} {'GB/s':>7} {'first':>7} {'total':>7} "
            f"{'x plain':>8} {'x w/o ctx':>9}  notes")
        if "error" in data.get("cases", {}):
            say(f"  ERROR {data['cases']['error']}")
        for name in CASES:
            r = data.get("cases", {}).get(name)
            if r is None:
                continue
            notes = "; ".join([*(f"ERROR {last_line(e)}" for e in r["errors"]),
                               *(f"fallback: {f}" for f in r["fallbacks"]),
                               *([f"filled from: {', '.join(r['fills'])}"] if name != "plain" else [])])
            say(f"{name:6} {_s(r['ctx'])} {_s(r['call'])} {_s(r['copy'])} {_s(r.get('copy_gbps'), 7)} "
                f"{_s(r['first'])} {_s(r['total'])} {_s(r.get('x_plain'), 8)} "
                f"{_s(r.get('x_plain_without_ctx'), 9)}  {notes}")
        if "tokens_differ" in data.get("cases", {}):
            say(f"  TOKENS DIFFER between cases: {data['cases']['tokens_differ']}")
        if "checksums_differ" in data.get("cases", {}):
            say("  LOGITS' CHECKSUMS DIFFER from plain's: " + "; ".join(
                f"{name} {values}" for name, values in data["cases"]["checksums_differ"].items()))
        warm_row = (report.get("warm") or {}).get(size)
        if isinstance(warm_row, dict) and warm_row.get("ready") is not None:
            say(f"warm restart: restart {warm_row['restart']:.3f} + setup {warm_row['setup']:.3f} + ctx "
                f"{warm_row['ctx']:.3f} + call {warm_row['call']:.3f} + first {warm_row['first']:.3f} = ready "
                f"{warm_row['ready']:.3f} s ({warm_row['hits']}/{len(warm_row['runs'])} hits)")
            say("  warmed ahead of the restart: " + ("; ".join(
                f"{w['device']} " + (f"ERROR {w['error']}" if w["error"] else f"{w['seconds']:.3f} s")
                for w in warm_row.get("warmed", [])) or "nothing"))
        probes = data.get("probes")
        if probes:
            lines.extend(probe_lines(probes))
    if isinstance(report.get("warm"), dict) and "skipped" in report["warm"]:
        say(f"\nwarm restart: skipped: {report['warm']['skipped']}")
    if isinstance(report.get("warm"), dict) and "error" in report["warm"]:
        say(f"\nwarm restart: ERROR {report['warm']['error']}")
    for size, row in (report.get("warm") or {}).items():
        if isinstance(row, dict) and "skipped" in row:
            say(f"warm restart, {size}: skipped: {row['skipped']}")
    met = goals(report)
    if met:
        say("\ngoal (issue 36):" + "".join(f"\n  {line}" for line in met))
    return "\n".join(lines)


def probe_lines(probes: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    say = lines.append
    if "skipped" in probes:
        say(f"probes: skipped: {probes['skipped']}")
        return lines
    say(f"copy probes ({probes.get('bytes', 0) / 1e9:.2f} GB from {probes.get('source')}; context + "
        f"buffer {probes.get('context_and_alloc_s', 0):.3f} s)"
        + (f"  ERROR {probes['error']}" + (f" during {probes['running']}" if probes.get("running") else "")
             if "error" in probes else ""))
    say(f"  {'probe':17} {'GB/s':>7} {'copy s':>7} {'open s':>7} {'reg s':>8}  notes")
    for name, p in probes.get("probes", {}).items():
        if "skipped" in p or "error" in p:
            say(f"  {name:17} {'-':>7} {'-':>7} {'-':>7} {'-':>8}  "
                f"{p.get('skipped') or 'ERROR ' + last_line(p['error'])}")
            continue
        notes = [] if p.get("checked") else ["BYTES DIFFER"]
        if "first_gbps" in p:
            notes.append(f"first copy {p['first_gbps']:.1f} GB/s")
        if "pinned_alloc_s" in p:
            notes.append(f"pinned alloc {p['pinned_alloc_s']:.3f} s")
        if "helper_fill_s" in p:
            notes.append(f"helper's fill {p['helper_fill_s']:.3f} s")
        if p.get("note"):
            notes.append(p["note"])
        say(f"  {name:17} {p['gbps']:7.1f} {p['copy_s']:7.3f} {_s(p.get('open_s'))} {_s(p.get('register_s'), 8)}"
            f"  {'; '.join(notes)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", help="model sizes, of overmind_jupyter.demo_models.LLAMA_SIZES (default 1.1b,7b; "
                                         "--dry-run: tiny)")
    parser.add_argument("--quick", action="store_true", help="the 1.1b model only")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of plain, miss, hit and copy")
    parser.add_argument("--restarts", type=int, default=2, help="warm restarts per size")
    parser.add_argument("--budget", type=float, default=450, help="seconds the whole run may take")
    parser.add_argument("--register-timeout", type=float, default=30,
                        help="seconds a cudaHostRegister probe may take")
    parser.add_argument("--probe-dir", default="/dev/shm",
                        help="where the probes' file lies: /dev/shm (as a memfd arena) or a disk (as a file arena)")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm restart column")
    parser.add_argument("--no-probes", action="store_true", help="skip the copy probes")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the script without a GPU: the tiny model on 'cpu', CUDA-only parts skipped")
    parser.add_argument("--models-dir", default=str(OUT / "models"), help="where the checkpoints are built")
    default_out = Path(os.environ["OUT"]) / "gpu.json" if os.environ.get("OUT") else OUT / "gpu.json"
    parser.add_argument("--out", default=str(default_out))
    parser.add_argument("--fork-parent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--build", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fork_parent:
        fork_parent()
        return
    if args.build:
        build(json.loads(args.build))
        return
    if args.dry_run:
        args.sizes, args.rounds, args.restarts = args.sizes or "tiny", 1, 1
        args.probe_dir = tempfile.gettempdir()
    args.sizes = "1.1b" if args.quick else args.sizes or "1.1b,7b"
    start = time.monotonic()
    report: dict[str, Any] = {"dry_run": args.dry_run, "sizes": {}, "notes": []}
    signal.signal(signal.SIGTERM, _terminated)
    try:
        run_all(args, report, start)
    except SystemExit:
        report["notes"].append(f"stopped by SIGTERM after {time.monotonic() - start:.0f} s (the run's time limit): "
                               "what ran until then is below")
        raise
    finally:
        save(report, args.out, start)
        print(table(report))
        print(f"\nwritten: {args.out} and {Path(args.out).with_suffix('.txt')}", flush=True)


# Note [A report that survives the time limit]
# gpu_run.sh runs this under `timeout`, within a lent machine's few minutes: a run that overruns its --budget
# (a step slower than its estimate) gets SIGTERM, and before, that lost every figure, since the report was
# written only once the run returned. So the report is kept as it grows: SIGTERM raises SystemExit, whose
# way out stops the daemon, the copier and the kernels (the `finally` blocks) and writes the JSON and the
# table with what ran; and both are written again as each size ends, so even a SIGKILL keeps the sizes done.
def _terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the way out runs to its end
    raise SystemExit(128 + signum)


def save(report: dict[str, Any], out: str, start: float) -> None:
    """Write the report's JSON to `out` and its table beside it (.txt), each replacing the last whole."""
    report["wall_s"] = time.monotonic() - start
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, text in ((path, json.dumps(report, indent=2, default=str)), (path.with_suffix(".txt"), table(report))):
        partial = target.with_name(target.name + ".partial")
        partial.write_text(text)
        os.replace(partial, target)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
