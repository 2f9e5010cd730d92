"""Soak: the load test of tests/test_load.py for N minutes, and its counts.

Kernel processes (4 by default) load 5 tiny models at random through one daemon whose budget holds about
60% of them, each load bit-compared with a plain load of the same model, some hits written in place
(copy-on-write), some results kept alive (pinned) across later loads, while a sampler polls the daemon's
status (used + reserved against the budget). With --kill-every the daemon is SIGKILLed every so many
seconds, and the kernels fall back and start the next one.

    .venv/bin/python benchmarks/soak.py --minutes 2
    .venv/bin/python benchmarks/soak.py --minutes 2 --kill-every 10

Prints a table and writes benchmarks/out/soak.json (or --out). Exits 1 if a load was lost or wrong, the
budget was exceeded, or (without --kill-every) the daemon restarted or logged a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long the kernels load (default 2)")
    parser.add_argument("--workers", type=int, default=4, help="kernel processes (default 4)")
    parser.add_argument("--kill-every", type=float, default=None, metavar="SECONDS",
                        help="SIGKILL the daemon every SECONDS (default: never)")
    parser.add_argument("--out", type=Path, default=HERE / "out" / "soak.json")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="om-soak-", dir="/tmp"))
    os.chmod(home, 0o700)
    os.environ["OVERMIND_HOME"] = str(home)

    from kernel_server import Client
    from kernel_server.lifecycle import process_gone
    from tests.helpers import faults_load
    from tests.helpers.faults_helpers import daemon_pid

    refs = faults_load.references()
    budget = faults_load.budget_for(refs)
    os.environ["OVERMIND_BUDGET"] = str(budget)
    try:
        with Client(home, role="test", label="soak") as client:
            assert client.budget == budget
        result = faults_load.run_load(home, refs, workers=args.workers, loads=None, seconds=args.minutes * 60,
                                      timeout=args.minutes * 60 + 300, kill_every=args.kill_every)
    finally:
        pid = daemon_pid(home)
        if pid is not None and not process_gone(pid):
            os.kill(pid, signal.SIGTERM)  # the daemon stops gracefully on SIGTERM
            deadline = time.monotonic() + 10
            while not process_gone(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        shutil.rmtree(home, ignore_errors=True)

    stats = result["store"]["stats"]
    result |= {"command": " ".join(["benchmarks/soak.py", *sys.argv[1:]]),
               "models": {name: refs[name]["entry_bytes"] for name in refs}, "budget": budget}
    rows = [
        ("kernel processes", args.workers),
        ("minutes", args.minutes),
        ("loads", result["loads"]),
        ("  served from the cache (hits)", result["hits"]),
        ("  loaded plainly (misses and fallbacks)", result["plain"]),
        ("  hits then written in place", result["writes_in_place"]),
        ("fallbacks, by reason", ", ".join(f"{k} {v}" for k, v in sorted(result["fallbacks"].items())) or "none"),
        ("daemon: lookups that missed / entries published", f"{stats.get('misses', 0)} / {stats.get('published', 0)}"),
        ("daemon: evictions", stats.get("evicted", 0)),
        ("daemon: SIGKILLs sent / restarts", f"{result['daemon']['killed']} / {result['daemon']['restarts']}"),
        ("daemon: tracebacks in the log", result["daemon"]["tracebacks"]),
        ("budget samples", result["budget_samples"]),
        ("max used + reserved / budget (bytes)", f"{result['max_used_plus_reserved']} / {budget}"),
        ("samples over the budget", len(result["over_budget"])),
        ("wrong tensors", len(result["wrong"])),
        ("lost loads", len(result["lost"])),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"soak: {result['seconds']} s, {result['loads'] / max(result['seconds'], 1e-9):.0f} loads/s")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")

    failed = result["wrong"] or result["lost"] or result["over_budget"] or result["sampler_error"]
    if not args.kill_every:
        failed = failed or result["daemon"]["restarts"] or result["daemon"]["tracebacks"]
    if failed:
        print(json.dumps({k: result[k] for k in ("wrong", "lost", "over_budget", "sampler_error", "daemon")}, indent=1),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
