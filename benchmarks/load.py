"""Load a Llama-shaped model plain and through overmind, each case in fresh processes.

Cases (each run in a new process with torch, transformers and the Llama modeling module imported
before the clock starts; --repeat rounds of all four cases, medians; the page cache is written back
between processes):
  plain        LlamaForCausalLM.from_pretrained in the stored dtype (bf16) and as fp32
  torch.load   torch.load(mmap=True) of torch.save(model) (bf16 and fp32 files)
  miss         overmind with an empty store: plain load, and the entry made before the call returns
               (Note [Atomic miss] in overmind_jupyter/publishing.py)
  hit          overmind with the entry published (and, for a same-dtype load, compacted by the
               daemon: the round waits for it, and reports how long it took)
Reported: the call, call + first forward (16 tokens), the growth of the process's anonymous
(private) memory, and for the miss the time until the entry can serve the next kernel. Each process
then runs a second forward: plain's is the floor under any hit's call + first forward (the model's
own compute, with no load left in it). Then three processes holding the same fp32 model at once:
their total PSS, plain against overmind.

    .venv/bin/python benchmarks/load.py                 # both models, all cases
    .venv/bin/python benchmarks/load.py --models 0.1b --repeat 3
    .venv/bin/python benchmarks/load.py --arena-study   # memfd vs file, populate on/off (hits)
    .venv/bin/python benchmarks/load.py --keys          # what computing a key costs (Note [Never stale])
    .venv/bin/python benchmarks/load.py --hit-calls     # only the hit call: both models, 30 calls a variant
    .venv/bin/python benchmarks/load.py --hit-calls --quick   # the same, 0.1B model, 8 calls a variant
    .venv/bin/python benchmarks/load.py --miss          # plain, miss, hit: wall, CPU, minor faults (issue 39)
    .venv/bin/python benchmarks/load.py --miss 1.1b:float32 --repeat 1
    .venv/bin/python benchmarks/load.py --pss --pss-table --repeat 3   # 3 kernels' PSS, the 1.1B fp32 cached
    .venv/bin/python benchmarks/load.py --miss 1.1b:bfloat16 --before-tree /tmp/old   # and an old checkout's miss
    .venv/bin/python benchmarks/load.py --miss --pss --hit-calls --quick --variants bytecode,cached
                                        # all of issue 39 in one run: misses, PSS, the first cached() call

--hit-calls times only the first `from_pretrained` hit of a fresh process, after `enable()` (as in a kernel
that ran `%load_ext overmind_jupyter` and `%overmind on`), --calls processes per variant, median, p90 and max,
and call + first forward (with the excess of that first forward over a second one in the same process, the
model's steady forward: what the first forward still pays for the load), in four variants: the package's
bytecode present or not (a copy of overmind_jupyter and kernel_server compiled with compileall, or one never
compiled, run with PYTHONDONTWRITEBYTECODE=1, as on machines that set it), each alone and with a CPU-bound
process running beside it. The plain load's first call in such a process is measured in the same rounds (alone
and beside the CPU-bound process), and the hits' figures are given as ratios of it.
Each process is forked, per call, from a parent that imported torch, transformers and the Llama modeling
module and ran no torch operation (docs: a fork of such a process is safe and takes ~15 ms; a fresh
interpreter takes ~7 s here). The parent imports nothing of overmind_jupyter or kernel_server: each call's
process imports them itself (and, without bytecode, compiles them from source), calls `enable()`, then
makes its first hit; what it imports during the call itself is reported.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
REPO = HERE.parent


def smaps() -> dict[str, int]:
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def pss_of(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Pss line")


# -- the child: one measured load ------------------------------------------------------------------

def child(spec: dict) -> None:
    import torch
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama  # noqa: F401

    # The plain load runs in a process that imports nothing of ours, as in a kernel without overmind:
    # importing the package where torch is imported prepares the hit path (hit_tuning.prepare), whose
    # allocator warm-up took a third of the plain load's page faults off it (RESULTS.md, stop 71).
    ours = spec["case"] not in ("plain", "torch.load")
    if ours:
        from overmind_jupyter import loading, rebuild
    if spec.get("enabled"):  # as a kernel after `%overmind on`: its connection and first-call preparation made
        import overmind_jupyter

        overmind_jupyter.enable()
    torch.manual_seed(0)
    x = torch.randint(0, 32000, (1, 16))
    dtype = getattr(torch, spec["dtype"])
    if spec.get("hold"):
        print("imported", flush=True)
        sys.stdin.readline()
    before = smaps()
    faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
    t0 = time.perf_counter()
    if spec["case"] == "plain" or spec.get("enabled"):  # (the loader is patched after enable())
        model = LlamaForCausalLM.from_pretrained(spec["model"], dtype=dtype)
    elif spec["case"] == "torch.load":
        model = torch.load(spec["file"], mmap=True, weights_only=False)
    else:
        model = loading.cached(LlamaForCausalLM.from_pretrained, spec["model"], dtype=dtype)
    t1 = time.perf_counter()
    call_cpu, call_faults = time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    with torch.inference_mode():
        logits = model(x).logits
    t2 = time.perf_counter()
    after = smaps()
    result = {
        "call": t1 - t0,
        "cpu": call_cpu,
        "minflt": call_faults,
        "first": t2 - t0,
        "anon_growth": after.get("Anonymous", 0) - before.get("Anonymous", 0),
        "rss_growth": after["Rss"] - before["Rss"],
        "checksum": float(logits.double().sum()),
        "fallbacks": loading.fallbacks() if ours else [],
        "code": str(Path(loading.__file__).parent.parent) if ours else "",
    }
    if spec["case"] in ("hit", "miss") and rebuild.entry_of(model.lm_head.weight.data_ptr()) is None:
        raise RuntimeError(f"the {spec['case']}'s model does not lie in the store's entry")
    if spec["case"] == "hit" and loading.calls() != {"hit": 1}:
        raise RuntimeError(f"the hit case was not a hit: {loading.calls()}")
    if spec.get("populate_table"):  # as hits did before Note [Populate what a forward reads] (populating.py)
        from kernel_server import arena

        table = model.get_input_embeddings().weight.untyped_storage()
        arena.populate(table.data_ptr(), table.nbytes())
    if spec["case"] == "miss":
        # ready: when the entry serves the next kernel. It is published before the call returns, so
        # this is the call's time, unless the daemon does not list it (then the run fails).
        from kernel_server.client import shared_client

        listed = {e["key"]: e for e in shared_client().request("status")["entries"]}
        key = rebuild.entry_of(model.lm_head.weight.data_ptr())[0]
        if key not in listed:
            raise RuntimeError("the miss returned before its entry was listed")
        result["published"] = t1 - t0
        result["made"] = listed[key]["meta"].get("made")  # Note [Staged conversions]
        result["load_s"] = listed[key]["load_s"]  # the load inside the miss (Note [Miss times] in progress.py)
    if spec.get("hold"):
        print(json.dumps(result), flush=True)
        sys.stdin.read()  # hold the model until the parent closes our stdin
        return
    t3 = time.perf_counter()
    with torch.inference_mode():
        model(x)
    result["second"] = time.perf_counter() - t3  # the model's steady forward: no load left in it
    print(json.dumps(result), flush=True)


def first_call(call: dict) -> dict:
    """--hit-calls, in a process forked for it: the first `from_pretrained` of the process, a hit through
    the patched loader after `enable()` ("hit"), or the plain load ("plain")."""
    import torch
    from transformers import LlamaForCausalLM

    ours = ("overmind_jupyter", "kernel_server")
    if call["case"] in ("hit", "cached"):
        import overmind_jupyter
        from overmind_jupyter import loading

        if call["case"] == "hit":
            overmind_jupyter.enable()
    torch.manual_seed(0)
    x = torch.randint(0, 32000, (1, 16))
    dtype = getattr(torch, call["dtype"])
    # What the call imports, found after it in sys.modules' order of insertion from the last module before
    # it. Not `set(sys.modules)` before the clock: that set of 3,000 names was young when the call began,
    # and the hit's young collection visited it (Note [Old at birth] in hit_tuning.py): 0.4-0.6 ms of the
    # 0.1B hit was this benchmark's own bookkeeping.
    last = next(reversed(sys.modules))
    cpu = time.process_time()
    t0 = time.perf_counter()
    if call["case"] == "cached":  # the README's patch-free form, with nothing of ours called before
        model = overmind_jupyter.cached(LlamaForCausalLM.from_pretrained, call["model"], dtype=dtype)
    else:
        model = LlamaForCausalLM.from_pretrained(call["model"], dtype=dtype)
    t1 = time.perf_counter()
    cpu = time.process_time() - cpu
    names = list(sys.modules)
    if last not in sys.modules:
        raise RuntimeError(f"the call removed the module {last} from sys.modules: cannot tell what it imported")
    imported = sorted(name for name in names[names.index(last) + 1:] if name.split(".")[0] in ours)
    with torch.inference_mode():
        logits = model(x).logits
        t2 = time.perf_counter()
        model(x)  # the steady forward: the floor under the first (no load and no page fault left in it)
        t3 = time.perf_counter()
    if call["case"] in ("hit", "cached") and loading.calls() != {"hit": 1}:
        raise RuntimeError(f"the hit call was not a hit: {loading.calls()} {loading.fallbacks()}")
    return {"call": t1 - t0, "cpu": cpu, "first": t2 - t0, "second": t3 - t2, "checksum": float(logits.double().sum()),
            "imported": imported}


def fork_parent(spec: dict) -> None:
    """--hit-calls: import what a kernel that loads a Llama model has imported, run no torch operation,
    then fork a process per request line on stdin (a `first_call`), and answer with its result line."""
    import traceback

    sys.path.insert(0, spec["src"])  # this variant's copy of the package (with bytecode or without)
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    ours = sorted(m for m in sys.modules if m.split(".")[0] in ("overmind_jupyter", "kernel_server"))
    if ours:
        raise RuntimeError(f"the parent imported {ours}: each call's process must import them itself")
    print(json.dumps({"ready": os.getpid(), "dont_write_bytecode": sys.dont_write_bytecode}), flush=True)
    for line in sys.stdin:
        call = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                import overmind_jupyter

                result = first_call(call)
                if call["case"] == "hit" and not overmind_jupyter.__file__.startswith(spec["src"]):
                    raise RuntimeError(f"imported {overmind_jupyter.__file__}, not the copy under {spec['src']}")
                print(json.dumps(result), flush=True)
                code = 0
            except BaseException:  # noqa: BLE001 (reported on stderr; the parent answers with an error)
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code:
            print(json.dumps({"error": f"the process of {call} exited with {code}: see its stderr"}), flush=True)


class ForkParent:
    """A `fork_parent` process, for one variant's copy of the package and environment."""

    def __init__(self, src: Path, env: dict[str, str], log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--fork-parent", json.dumps({"src": str(src)})],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork parent ended: see {self.log.name}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{answer['error']} ({self.log.name})")
        return answer

    def call(self, call: dict) -> dict:
        self.proc.stdin.write(json.dumps(call) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)
        self.log.close()


def package_copy(root: Path, bytecode: bool) -> Path:
    """A copy of overmind_jupyter and kernel_server under `root`, compiled or never compiled."""
    import compileall
    import shutil

    for name in ("overmind_jupyter", "kernel_server"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        if bytecode:
            compileall.compile_dir(root / name, quiet=1)
    return root


_HOG = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


class CpuHog:
    """A CPU-bound process, running only while a call of a "+cpu" variant is measured."""

    def __init__(self) -> None:
        # It ends when this process is gone, however it ends: one left spinning after a killed run took a
        # core from every later measurement on the machine.
        self.proc = subprocess.Popen([sys.executable, "-c", _HOG])
        self.proc.send_signal(signal.SIGSTOP)

    @contextlib.contextmanager
    def running(self, on: bool) -> Iterator[None]:
        if on:
            self.proc.send_signal(signal.SIGCONT)
        try:
            yield
        finally:
            if on:
                self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


HIT_VARIANTS = ["bytecode", "bytecode+cpu", "no-bytecode", "no-bytecode+cpu", "cached"]
PLAIN_VARIANTS = ["plain", "plain+cpu"]  # the baselines, run in the same rounds


def hit_call_study(paths: dict[str, Path], env: dict[str, str], calls: int, variants: list[str]) -> dict:
    """--hit-calls: see the module's docstring. Rounds of one call of each variant, so that the
    machine's drift reaches every variant alike."""
    work = Path(tempfile.mkdtemp(prefix="om-bench-src-"))
    sources = {True: package_copy(work / "bytecode", True), False: package_copy(work / "source", False)}
    parents: dict[bool, ForkParent] = {}
    hog = CpuHog()
    report: dict = {"method": "each call forked from a parent that imported torch, transformers and the Llama "
                              "modeling module (no torch operation, nothing of overmind_jupyter or kernel_server); "
                              "the child imports the package and calls enable() before the clock",
                    "models": {}}
    try:
        for bytecode in (True, False):
            e = dict(env)
            if bytecode:
                e.pop("PYTHONDONTWRITEBYTECODE", None)
            else:
                e["PYTHONDONTWRITEBYTECODE"] = "1"
            parents[bytecode] = ForkParent(sources[bytecode], e, work / f"parent-{bytecode}.log")
        for size, path in paths.items():
            spec = {"case": "miss", "model": str(path), "dtype": "bfloat16"}
            daemon(env, "evict", "--all")
            run_child(spec, env)
            wait_compacted(env)
            runs: dict[str, list[dict]] = {v: [] for v in [*variants, *PLAIN_VARIANTS]}
            for _ in range(calls):
                for variant in runs:
                    case = "plain" if variant.startswith("plain") else "cached" if variant == "cached" else "hit"
                    parent = parents[not variant.startswith("no-bytecode")]
                    with hog.running(variant.endswith("+cpu")):
                        runs[variant].append(parent.call({"case": case, "model": str(path), "dtype": "bfloat16"}))
            report["models"][size] = summarize_calls(runs)
    finally:
        hog.close()
        for parent in parents.values():
            parent.close()
    shutil.rmtree(work, ignore_errors=True)  # the package copies (kept, with the parents' logs, on a failure)
    return report


def summarize_calls(runs: dict[str, list[dict]]) -> dict:
    rows = {}
    for variant, results in runs.items():
        ms = [r["call"] * 1000 for r in results]
        first = [r["first"] for r in results]
        # what the first forward costs beyond the same process's steady forward: page faults, lazy setup
        excess = [(r["first"] - r["call"] - r["second"]) * 1000 for r in results]
        rows[variant] = {"calls": len(results), "median_ms": statistics.median(ms), "p90_ms": percentile(ms, 0.9),
                         "cpu_median_ms": statistics.median(r["cpu"] * 1000 for r in results),
                         "max_ms": max(ms), "first_median_s": statistics.median(first),
                         "first_p90_s": percentile(first, 0.9), "call_ms": ms,
                         "second_median_s": statistics.median(r["second"] for r in results),
                         "first_excess_median_ms": statistics.median(excess),
                         "imported_in_call": sorted({m for r in results for m in r["imported"]})}
    for variant, row in rows.items():
        plain = rows["plain+cpu" if variant.endswith("+cpu") else "plain"]
        row["call_x_plain"] = row["median_ms"] / plain["median_ms"]
        row["first_x_plain"] = row["first_median_s"] / plain["first_median_s"]
        checksums = {r["checksum"] for r in runs[variant]} | {r["checksum"] for r in runs["plain"]}
        row["checksums_agree"] = max(checksums) - min(checksums) <= 1e-3 * max(abs(c) for c in checksums)
    return rows


def print_hit_calls(report: dict) -> None:
    print(f"\n{report['method']}")
    for size, rows in report["models"].items():
        print(f"\n{size} model, bf16: the first from_pretrained of a fresh process")
        print(f"{'variant':17} {'calls':>5} {'median ms':>10} {'CPU ms':>7} {'p90 ms':>8} {'max ms':>8} {'x plain':>8} "
              f"{'call+fwd s (median/p90)':>24} {'x plain':>8} {'fwd s':>6} {'1st fwd excess ms':>17}")
        for name, r in rows.items():
            flag = "" if r["checksums_agree"] else "  CHECKSUM MISMATCH"
            print(f"{name:17} {r['calls']:5d} {r['median_ms']:10.2f} {r['cpu_median_ms']:7.2f} {r['p90_ms']:8.2f} "
                  f"{r['max_ms']:8.2f} "
                  f"{r['call_x_plain']:8.3f} {r['first_median_s']:12.3f} / {r['first_p90_s']:.3f} "
                  f"{r['first_x_plain']:8.2f} {r['second_median_s']:6.3f} {r['first_excess_median_ms']:17.1f}{flag}")
        lazy = sorted({m for name, r in rows.items() if not name.startswith("plain") for m in r["imported_in_call"]})
        print(f"  imported during the hit call: {', '.join(lazy) or 'nothing of overmind_jupyter or kernel_server'}")


# -- the parent -----------------------------------------------------------------------------------

def run_child(spec: dict, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def scratch_dir(prefix: str) -> str:
    """A new directory in the temporary directory (a run's OVERMIND_HOME, a package copy), removed when
    the run ends: after its `finally` blocks have stopped the daemon that used it."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def daemon(env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kernel_server", *args], env=env, capture_output=True,
                          text=True, check=True).stdout


def median_of(runs: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in runs)


def wait_compacted(env: dict[str, str], timeout: float = 300) -> float:
    """Seconds until the daemon has copied every entry's pending pieces into its own arena (Note
    [Pending pieces] in kernel_server/store.py): what a same-dtype miss leaves for after its call."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        entries = json.loads(daemon(env, "ls", "--json"))["entries"]
        if all(e.get("pending") is None for e in entries):
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise RuntimeError("the daemon did not compact the entry in time")


def settle() -> None:
    """Between two measured processes: write back what the last one left dirty (a miss leaves its
    arena's 2-4 GB of page cache to be written back), so that no case pays for the one before it."""
    os.sync()


def read_through(file: Path) -> None:
    with open(file, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def summarize(runs: list[dict]) -> dict:
    fields = ["call", "first", "second", "anon_growth", "rss_growth"] + [
        f for f in ("published", "compacted", "cpu", "minflt", "load_s") if f in runs[0]]
    summary = {f: median_of(runs, f) for f in fields}
    summary["checksum"] = runs[0]["checksum"]
    summary["code"] = sorted({r.get("code", "") for r in runs})
    if "made" in runs[0]:
        summary["made"] = runs[0]["made"]
    summary["fallbacks"] = [f for r in runs for f in r["fallbacks"]]
    summary["runs"] = [{f: r[f] for f in fields} for r in runs]
    return summary


def measure(spec: dict, env: dict[str, str], repeat: int) -> dict:
    runs = []
    for _ in range(repeat):
        settle()
        runs.append(run_child(spec, env))
    return summarize(runs)


def build(models: list[str], torch_files: bool = True) -> dict[str, Path]:
    """The checkpoints of `models`, and (`torch_files`) their torch.save files for the torch.load case."""
    import torch

    from overmind_jupyter.demo_models import build_llama

    paths = {}
    for size in models:
        path = build_llama(OUT / "models" / f"llama-{size}", size)
        for dtype in ("bfloat16", "float32") if torch_files else ():
            file = OUT / "models" / f"llama-{size}-{dtype}.pt"
            if not file.exists():
                from transformers import LlamaForCausalLM

                model = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
                torch.save(model, file)
                del model
        paths[size] = path
    return paths


def model_bytes(path: Path, dtype: str) -> int:
    stored = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return stored * (2 if dtype == "float32" else 1)


def pss_study(path: Path, env: dict[str, str]) -> dict:
    """Three processes holding the fp32 model at once: the growth of their total PSS from before any
    of them loaded (the libraries' pages count the same in both readings)."""
    results = {}
    for case in ("plain", "ours"):
        daemon(env, "evict", "--all")
        settle()
        procs = []
        try:
            for i in range(3):
                kind = "plain" if case == "plain" else ("miss" if i == 0 else "hit")
                spec = {"case": kind, "model": str(path), "dtype": "float32", "hold": True}
                p = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert p.stdout.readline().strip() == "imported"
                procs.append(p)
            baseline = sum(pss_of(p.pid) for p in procs)
            for p in procs:  # one after the other, so the first one publishes for the others
                p.stdin.write("go\n")
                p.stdin.flush()
                json.loads(p.stdout.readline())  # loaded and forwarded (the miss: published too)
            time.sleep(0.5)
            results[case] = sum(pss_of(p.pid) for p in procs) - baseline
        finally:
            for p in procs:
                p.stdin.close()
                p.wait()
    return results


def held_pss(spec: dict, env: dict[str, str], count: int) -> dict:
    """`count` processes that each load `spec` and run a forward, all held at once: the growth of their
    total PSS and private memory from before any of them loaded, once the pages their hits populate
    in the background are mapped (the total stops changing)."""
    procs = []
    try:
        for _ in range(count):
            p = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec | {"hold": True})], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "imported"
            procs.append(p)
        before = [rollup(p.pid) for p in procs]
        results = []
        for p in procs:  # one after the other
            p.stdin.write("go\n")
            p.stdin.flush()
            results.append(json.loads(p.stdout.readline()))
        last, t0 = -1, time.perf_counter()
        while time.perf_counter() - t0 < 60:
            time.sleep(0.5)
            now = sum(rollup(p.pid)["Pss"] for p in procs)
            if abs(now - last) < 1 << 20:
                break
            last = now
        after = [rollup(p.pid) for p in procs]
        growth = {f: sum(a.get(f, 0) - b.get(f, 0) for a, b in zip(after, before, strict=True))
                  for f in ("Pss", "Rss", "Private_Clean", "Private_Dirty", "Anonymous")}
        return growth | {"checksum": results[0]["checksum"], "fallbacks": [f for r in results for f in r["fallbacks"]]}
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()


def rollup(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def pss_rounds(size: str, dtype: str, env: dict[str, str], repeat: int, table: bool) -> dict:
    """--pss: in rounds, one plain process holding the model (one copy), then a miss (in its own process,
    which exits), then three processes holding the model from the cache at once (and, with
    --pss-table, three more that also map the whole input embedding table, as every hit did before
    Note [Populate what a forward reads] in populating.py); the PSS each group adds, and the entry's arena
    (memory the daemon holds, counted in no kernel's PSS while unmapped)."""
    path = build([size], torch_files=False)[size]
    for file in path.glob("*.safetensors"):
        read_through(file)
    base = {"model": str(path), "dtype": dtype}
    groups = {"plain x1": (base | {"case": "plain"}, env, 1), "hits x3": (base | {"case": "hit"}, env, 3)}
    if table:
        groups["hits x3, table populated"] = (base | {"case": "hit", "populate_table": True}, env, 3)
    runs: dict[str, list[dict]] = {name: [] for name in groups}
    for _ in range(repeat):
        daemon(env, "evict", "--all")
        settle()
        runs["plain x1"].append(held_pss(*groups["plain x1"]))
        settle()
        run_child(base | {"case": "miss"}, env)
        wait_compacted(env)
        arena_bytes = sum(e["arena_bytes"] for e in json.loads(daemon(env, "ls", "--json"))["entries"])
        for name in groups:
            if name != "plain x1":
                settle()
                runs[name].append(held_pss(*groups[name]) | {"arena": arena_bytes})
    daemon(env, "evict", "--all")
    out = {"model": f"{size} {dtype}", "one_copy": model_bytes(path, dtype), "groups": {}}
    for name, rs in runs.items():
        out["groups"][name] = {f: statistics.median(r[f] for r in rs) for f in rs[0] if isinstance(rs[0][f], int)}
        out["groups"][name]["runs"] = rs
    return out


def print_pss(report: dict) -> None:
    one, plain = report["one_copy"], report["groups"]["plain x1"]["Pss"]
    print(f"{report['model']}: the model's bytes {one / 2**20:.0f} MiB; medians of the PSS each group adds")
    print(f"{'group':26} {'PSS MiB':>9} {'x plain PSS':>12} {'x model':>8} {'private MiB':>12} {'arena MiB':>10}")
    for name, g in report["groups"].items():
        private = g["Private_Clean"] + g["Private_Dirty"]
        arena = f"{g['arena'] / 2**20:10.0f}" if "arena" in g else f"{'':>10}"
        print(f"{name:26} {g['Pss'] / 2**20:9.0f} {g['Pss'] / plain:12.3f} {g['Pss'] / one:8.3f} "
              f"{private / 2**20:12.0f} {arena}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--models", default="1.1b,0.1b")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--arena-study", action="store_true", help="compare arena backings on 1.1B bf16 hits")
    parser.add_argument("--no-pss", action="store_true")
    parser.add_argument("--keys", action="store_true", help="only the cost of computing keys")
    parser.add_argument("--hit-calls", action="store_true",
                        help="only the first hit call of fresh processes: median and p90, with and without "
                             "bytecode, with and without a CPU-bound process beside it")
    parser.add_argument("--calls", type=int, help="--hit-calls: processes per variant (30; --quick: 8)")
    parser.add_argument("--variants", default=",".join(HIT_VARIANTS),
                        help=f"--hit-calls: which of {','.join(HIT_VARIANTS)} (the plain load always runs)")
    parser.add_argument("--quick", action="store_true",
                        help="the 0.1B model only (with --hit-calls: and 8 calls a variant)")
    parser.add_argument("--miss", nargs="?", const=MISS_CASES, metavar="SIZE:DTYPE,...",
                        help=f"plain, miss and hit with CPU time and minor faults (default {MISS_CASES})")
    parser.add_argument("--pss", nargs="?", const="1.1b:float32", metavar="SIZE:DTYPE",
                        help="PSS of three kernels holding the model from the cache, against one plain copy")
    parser.add_argument("--before-tree", help="--miss: also the miss of the overmind_jupyter at this path")
    parser.add_argument("--bytecode", action="store_true",
                        help="--miss: run the package from a compiled copy, as a user's install has it (the "
                             "libraries' bytecode is there either way; without this, a miss compiles what it "
                             "imports lazily when PYTHONDONTWRITEBYTECODE is set)")
    parser.add_argument("--patch-free", action="store_true",
                        help="--miss: the miss and hit through overmind_jupyter.cached(...) with nothing of ours "
                             "called before (its connection made in the call), not the patched loader after "
                             "enable()")
    parser.add_argument("--pss-table", action="store_true",
                        help="--pss: also three hits that map the whole input embedding table, as hits did before")
    parser.add_argument("--fork-parent", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.fork_parent:
        fork_parent(json.loads(args.fork_parent))
        return
    if args.quick:
        args.models = "0.1b"
    calls = args.calls or (8 if args.quick else 30)
    OUT.mkdir(exist_ok=True)
    if args.keys:
        report = key_study(build(["1.1b"])["1.1b"])
        (OUT / "load_keys.json").write_text(json.dumps(report, indent=2))
        for name, r in report["cases"].items():
            print(f"key of {name} ({r['files']} files): median {r['median_ms']:.3f} ms, p90 {r['p90_ms']:.3f} ms")
        print(f"bytecode present: {report['bytecode']}")
        return
    home = scratch_dir("om-bench-")
    env = dict(os.environ, OVERMIND_HOME=home, PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1")
    # --miss, --pss and --hit-calls run one after the other in one run, each printing its table
    if args.miss:
        cases = [tuple(case.split(":")) for case in args.miss.split(",")]
        try:
            daemon(env, "start")
            tree = package_copy(Path(scratch_dir("om-bytecode-")), bytecode=True) if args.bytecode else None
            rows = miss_study(cases, env | ({"OVERMIND_BENCH_TREE": str(tree)} if tree else {}), args.repeat,
                              args.before_tree, args.patch_free)
        finally:
            daemon(env, "stop")
        (OUT / "load_miss.json").write_text(json.dumps(rows, indent=2))
        print_miss_study(rows)
    if args.pss:
        size, dtype = args.pss.split(":")
        try:
            daemon(env, "start")
            pss_report = pss_rounds(size, dtype, env, args.repeat, args.pss_table)
        finally:
            daemon(env, "stop")
        (OUT / "load_pss.json").write_text(json.dumps(pss_report, indent=2))
        print_pss(pss_report)
    if (args.miss or args.pss) and not args.hit_calls:
        return
    paths = build(args.models.split(","), torch_files=not args.hit_calls)
    report: dict = {"models": {}, "cpu_count": os.cpu_count()}
    try:
        daemon(env, "start")  # a miss is measured against a running daemon, not its start
        if args.hit_calls:
            report["hit_calls"] = hit_call_study(paths, env, calls, args.variants.split(","))
        elif args.arena_study:
            report["arena_study"] = arena_study(paths["1.1b"], env, args.repeat)
        else:
            for size, path in paths.items():
                report["models"][size] = study(size, path, env, args.repeat)
            if not args.no_pss:
                size = args.models.split(",")[0]
                report["pss"] = pss_study(paths[size], env) | {"one_copy": model_bytes(paths[size], "float32"),
                                                                "model": size}
    finally:
        daemon(env, "stop")
    name = "load_hits.json" if args.hit_calls else "load_arena.json" if args.arena_study else "load.json"
    (OUT / name).write_text(json.dumps(report, indent=2))
    if args.hit_calls:
        print_hit_calls(report["hit_calls"])
        return
    print_report(report)


def key_study(path: Path, calls: int = 300) -> dict:
    """The time `keys.make_key` takes for the 1.1B model's directory and for a 60-file directory of a
    model with its tokenizer (torch and transformers imported first, as in a kernel that loads)."""
    import torch
    from transformers import AutoModelForCausalLM

    from overmind_jupyter import demo_models, keys

    many = OUT / "models" / "tokenizer-plus-model"
    if not many.exists():
        demo_models.build_llama(many, "tiny")
        demo_models.build_tokenizer(many)
        present = sum(1 for _ in many.rglob("*") if _.is_file())
        for i in range(60 - present):  # the rest of a real snapshot: vocab files, readme, extra configs
            (many / f"extra-{i:02d}.json").write_text(json.dumps({"part": i}))
    cases = {}
    for name, directory in (("the 1.1B model", path), ("a model with its tokenizer", many)):
        fn, args = AutoModelForCausalLM.from_pretrained, (str(directory),)
        for _ in range(30):
            keys.make_key(fn, args, {"dtype": torch.bfloat16})
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            keys.make_key(fn, args, {"dtype": torch.bfloat16})
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        cases[name] = {"files": sum(1 for f in directory.rglob("*") if f.is_file()),
                       "median_ms": statistics.median(times), "p90_ms": times[int(0.9 * len(times))]}
    bytecode = (REPO / "overmind_jupyter" / "__pycache__").is_dir()
    return {"cases": cases, "bytecode": bytecode}


def study(size: str, path: Path, env: dict[str, str], repeat: int) -> dict:
    """The cases of one dtype in rounds (miss, hit, plain, torch.load, then the next round), so that
    the machine's drift over the minutes of a run reaches every case alike; each miss starts from an
    empty store and publishes the entry its round's hit uses."""
    rows = {}
    for dtype in ("bfloat16", "float32"):
        base = {"model": str(path), "dtype": dtype}
        specs = {"miss": base | {"case": "miss"}, "hit": base | {"case": "hit"}, "plain": base | {"case": "plain"},
                 "torch.load": base | {"case": "torch.load", "file": str(OUT / "models" / f"llama-{size}-{dtype}.pt")}}
        runs: dict[str, list[dict]] = {case: [] for case in specs}
        for file in [*path.glob("*.safetensors"), Path(specs["torch.load"]["file"])]:
            read_through(file)  # every case starts from files in the page cache, round 1 too
        for _ in range(repeat):
            daemon(env, "evict", "--all")
            for case, spec in specs.items():
                settle()
                runs[case].append(run_child(spec, env))
                if case == "miss":
                    runs[case][-1]["compacted"] = wait_compacted(env)
        for case in ("plain", "torch.load", "miss", "hit"):
            rows[f"{case} {dtype}"] = summarize(runs[case])
        plain = rows[f"plain {dtype}"]["checksum"]
        for case in ("torch.load", "miss", "hit"):
            r = rows[f"{case} {dtype}"]
            if abs(r["checksum"] - plain) > 1e-3 * abs(plain):
                r["checksum_mismatch"] = True
    return {"bytes": {d: model_bytes(path, d) for d in ("bfloat16", "float32")}, "rows": rows}


MISS_CASES = "1.1b:bfloat16,1.1b:float16,1.1b:float32,3b:bfloat16,3b:float32"


def miss_study(cases: list[tuple[str, str]], env: dict[str, str], repeat: int,
               before_tree: str | None = None, patch_free: bool = False) -> dict:
    """--miss: plain, miss and hit of each (model, dtype) in rounds, each in a fresh process from an empty
    store (the round's miss publishes its hit's entry), the checkpoint in the page cache: the call's wall
    and CPU time (the process's, all its threads) and minor faults, and how the miss made its entry's
    bytes (Note [Staged conversions] in overmind_jupyter/staging.py). The miss and the hit are the
    patched `from_pretrained` after `enable()`, as in a kernel after `%overmind on` (`patch_free`:
    `overmind_jupyter.cached(...)` with nothing of ours called before, its connection made in the
    call). With `before_tree`, also the miss of that checkout's overmind_jupyter (another PYTHONPATH),
    in the same rounds. Every other round runs the plain load last instead of first (and that checkout's
    miss first instead of last): on a VM that hands memory freed by one process back to its host, the
    next process's first touches of fresh pages cost what the host makes them cost, and which case comes
    after which large free is then the same for both."""
    from kernel_server.settings import flag

    compacting = flag(env.get("OVERMIND_COMPACT", "1"))  # else the hit maps the miss's pieces in place
    rows = {}
    for size, dtype in cases:
        path = build([size], torch_files=False)[size]
        base = {"model": str(path), "dtype": dtype}
        ours = {"enabled": not patch_free}
        cases = ("plain", "miss", "hit") + (("miss before",) if before_tree else ())
        runs: dict[str, list[dict]] = {case: [] for case in cases}
        for file in path.glob("*.safetensors"):
            read_through(file)
        for r in range(repeat):
            for case in (cases if r % 2 == 0 else (*cases[3:], *cases[1:3], "plain")):
                if case != "hit":
                    daemon(env, "evict", "--all")  # plain runs beside no entry: the memory is the machine's
                settle()
                if case == "miss before":
                    runs[case].append(run_child(base | ours | {"case": "miss"},
                                                env | {"OVERMIND_BENCH_TREE": before_tree}))
                    continue
                runs[case].append(run_child(base | (ours if case != "plain" else {}) | {"case": case}, env))
                if case == "miss" and compacting:
                    runs[case][-1]["compacted"] = wait_compacted(env)
        daemon(env, "evict", "--all")
        rows[f"{size} {dtype}"] = {case: summarize(r) for case, r in runs.items()}
    return rows


def paired(case: dict, plain: dict, field: str) -> tuple[float, float, float]:
    """The ratios of `case` to plain round by round (each round's two processes ran one after the other,
    so a machine that slows for a while slows both): their median, lowest and highest."""
    ratios = [r[field] / p[field] for r, p in zip(case["runs"], plain["runs"], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def print_miss_study(rows: dict) -> None:
    print(f"{'model dtype':18} {'case':11} {'call s':>8} {'CPU s':>8} {'minflt k':>9} {'x plain wall':>13} "
          f"{'x plain CPU':>12} {'call+fwd s':>11}  made (MiB staged/copied/pieces)")
    for name, cases in rows.items():
        plain = cases["plain"]
        for case, r in cases.items():
            made = r.get("made")
            made_text = "/".join(f"{made[k] / 2**20:.0f}" for k in ("staged", "copied", "pieces")) if made else ""
            flag = "  FALLBACK" if r["fallbacks"] else ""
            print(f"{name:18} {case:11} {r['call']:8.3f} {r['cpu']:8.3f} {r['minflt'] / 1000:9.1f} "
                  f"{r['call'] / plain['call']:13.3f} {r['cpu'] / plain['cpu']:12.3f} {r['first']:11.3f}  "
                  f"{made_text}{flag}  {','.join(r['code'])}")
    print("\nround by round, x plain: median [lowest, highest] (wall; CPU)")
    for name, cases in rows.items():
        for case, r in cases.items():
            if case != "plain" and len(r["runs"]) == len(cases["plain"]["runs"]):
                (wall, lo, hi), (cpu, clo, chi) = (paired(r, cases["plain"], f) for f in ("call", "cpu"))
                print(f"{name:18} {case:11} {wall:6.3f} [{lo:.3f}, {hi:.3f}]; {cpu:6.3f} [{clo:.3f}, {chi:.3f}]")
    print("\nthe miss's own part (its call less the load inside it, one process), and plain with it added")
    for name, cases in rows.items():
        for case, r in cases.items():
            if "load_s" in r:
                own = [run["call"] - run["load_s"] for run in r["runs"]]
                plain = cases["plain"]["call"]
                print(f"{name:18} {case:11} own {statistics.median(own) * 1e3:5.1f} ms [{min(own) * 1e3:.1f}, "
                      f"{max(own) * 1e3:.1f}]; the load in it {r['load_s']:.3f} s, plain {plain:.3f} s; "
                      f"1 + own / plain = {1 + statistics.median(own) / plain:.3f}")


def arena_study(path: Path, env: dict[str, str], repeat: int) -> dict:
    out = {}
    base = {"model": str(path), "dtype": "bfloat16"}
    out["plain"] = measure(base | {"case": "plain"}, env, repeat)
    for backing in ("memfd", "file"):
        for populate in ("1", "0"):
            e = env | {"OVERMIND_ARENA": backing, "OVERMIND_POPULATE": populate}
            daemon(e, "evict", "--all")
            run_child(base | {"case": "miss"}, e)
            out[f"hit {backing} populate={populate}"] = measure(base | {"case": "hit"}, e, repeat)
    return out


def print_report(report: dict) -> None:
    if "arena_study" in report:
        rows = report["arena_study"]
        plain = rows["plain"]["first"]
        print(f"{'case (1.1B bf16)':34} {'call s':>8} {'call+fwd s':>11} {'x plain':>8}")
        for name, r in rows.items():
            print(f"{name:34} {r['call']:8.3f} {r['first']:11.3f} {r['first'] / plain:8.2f}")
        return
    for size, m in report["models"].items():
        rows = m["rows"]
        print(f"\n{size} model ({m['bytes']['bfloat16'] / 2**30:.2f} GiB bf16)")
        print(f"{'case':22} {'call s':>8} {'call+fwd s':>11} {'x plain':>8} {'anon MiB':>9} {'% model':>8} "
              f"{'ready s':>8}")
        for name, r in rows.items():
            dtype = name.split()[-1]
            plain = rows[f"plain {dtype}"]
            pct = 100 * r["anon_growth"] / m["bytes"][dtype]
            ready = f"{r['published']:8.2f}" if "published" in r else " " * 8
            flag = "  CHECKSUM MISMATCH" if r.get("checksum_mismatch") else ""
            flag += "  FALLBACK" if r["fallbacks"] else ""
            print(f"{name:22} {r['call']:8.3f} {r['first']:11.3f} {r['first'] / plain['first']:8.2f} "
                  f"{r['anon_growth'] / 2**20:9.1f} {pct:8.1f} {ready}{flag}")
        for dtype in ("bfloat16", "float32"):
            plain, miss = rows[f"plain {dtype}"], rows[f"miss {dtype}"]
            print(f"  {dtype}: miss ready for the next kernel after {miss['published']:.2f} s = its call "
                  f"({miss['published'] / miss['call']:.2f} x the call; {miss['published'] / plain['first']:.2f} x "
                  f"plain call+first forward); compacted by the daemon {miss.get('compacted', 0):.2f} s after "
                  "the miss's process ended")
            print(f"  {dtype}: floor for any hit (plain's second forward / its call+first forward): "
                  f"{plain['second'] / plain['first']:.2f} x; the hit's call+first forward is "
                  f"{rows[f'hit {dtype}']['first'] / plain['second']:.2f} x plain's second forward")
    if "pss" in report:
        p = report["pss"]
        print(f"\n3 processes holding the {p['model']} fp32 model, growth of their total PSS: plain "
              f"{p['plain'] / 2**30:.2f} GiB ({p['plain'] / p['one_copy']:.2f} x one copy), overmind "
              f"{p['ours'] / 2**30:.2f} GiB ({p['ours'] / p['one_copy']:.2f} x one copy)")


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("OVERMIND_BENCH_TREE") or str(REPO))  # --before-tree: that checkout's code
    main()
