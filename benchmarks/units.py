"""The GPU-units ledger through the daemon: acquisitions per second, and release latency after a SIGKILL.

Cases (an isolated daemon on a temporary OVERMIND_HOME, with simulated devices):
  ping                  one request through the daemon: the floor for everything below
  1 client              units_acquire then units_release of 1 unit (two round trips), alternating with
                        the pings so that both see the same load
  N clients, room       N processes doing the same at once on one device with room for all
  N clients, handoff    N processes each taking the whole device: every grant waits for a release
  kill -> free          a process holds a whole device busy, the benchmark waits in units_acquire, the
                        holder is SIGKILLed: time from the kill to the waiter's grant (median and max)

    .venv/bin/python benchmarks/units.py
    .venv/bin/python benchmarks/units.py --seconds 3 --clients 4 --kills 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from kernel_server import Client  # noqa: E402 (after the repository is put on the path)

# -- children -------------------------------------------------------------------------------------------

def child_loop(units: int, seconds: float) -> None:
    """Wait for "go" on stdin, then acquire and release `units` for `seconds`; print the count."""
    client = Client(role="bench")
    print("ready", flush=True)
    sys.stdin.readline()
    count = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        grant = client.request("units_acquire", units=units, timeout_s=30, timeout=60)
        client.request("units_release", holding=grant["holding"])
        count += 1
    print(json.dumps({"count": count}), flush=True)
    client.close()


def child_hold(units: int) -> None:
    """Hold `units` busy until killed."""
    client = Client(role="bench")
    client.request("units_acquire", units=units, busy=True, timeout_s=0)
    print("holding", flush=True)
    sys.stdin.read()


# -- measurements -----------------------------------------------------------------------------------------

def paired_rates(client: Client, seconds: float) -> dict[str, float]:
    """Alternate a `ping` and an acquire + release of 1 unit for `seconds`, timing each: both see the
    same load on a shared machine. Rates are per second of time spent in that operation."""
    ping: list[float] = []
    pair: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        client.request("ping")
        t1 = time.perf_counter()
        grant = client.request("units_acquire", units=1)
        client.request("units_release", holding=grant["holding"])
        t2 = time.perf_counter()
        ping.append(t1 - t0)
        pair.append(t2 - t1)
    return {"ping_per_s": len(ping) / sum(ping), "ping_median_us": statistics.median(ping) * 1e6,
            "acquire_release_per_s_1_client": len(pair) / sum(pair),
            "acquire_release_median_us_1_client": statistics.median(pair) * 1e6}


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, "--child", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def clients_rate(n: int, units: int, seconds: float) -> float:
    procs = [spawn("loop", str(units), str(seconds)) for _ in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    counts = [json.loads(p.stdout.readline())["count"] for p in procs]
    for p in procs:
        p.wait()
    return sum(counts) / seconds


def kill_to_free(client: Client, capacity: int, kills: int) -> list[float]:
    times = []
    for _ in range(kills):
        holder = spawn("hold", str(capacity))
        assert holder.stdout.readline().strip() == "holding"
        request_id, waiting = client.submit("units_acquire", units=capacity, timeout_s=30)
        while not client.request("units_state")["waiters"]:
            time.sleep(0.001)
        killed = time.perf_counter()
        os.kill(holder.pid, signal.SIGKILL)
        grant = client.wait(request_id, waiting, 10)
        times.append(time.perf_counter() - killed)
        client.request("units_release", holding=grant["holding"])
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each rate measurement")
    parser.add_argument("--clients", type=int, default=4, help="processes in the concurrent cases")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs for the release latency")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, *rest = args.child
        child_loop(int(rest[0]), float(rest[1])) if mode == "loop" else child_hold(int(rest[0]))
        return

    home = Path(tempfile.mkdtemp(prefix="om-bench-", dir="/tmp"))
    os.chmod(home, 0o700)
    os.environ.update(OVERMIND_HOME=str(home), OVERMIND_FAKE_GPUS="1x65", OVERMIND_GPU_RESERVE="1")
    client = Client(home, role="bench")
    try:
        capacity = client.request("units_register", devices=[])["devices"][0]["capacity"]
        results = {
            **paired_rates(client, args.seconds),
            f"acquire_release_per_s_{args.clients}_clients_room": clients_rate(args.clients, 1, args.seconds),
            f"acquire_release_per_s_{args.clients}_clients_handoff": clients_rate(args.clients, capacity,
                                                                                  args.seconds),
        }
        latencies = kill_to_free(client, capacity, args.kills)
        results |= {"kill_to_free_median_ms": statistics.median(latencies) * 1e3,
                    "kill_to_free_max_ms": max(latencies) * 1e3, "kill_to_free_samples": len(latencies)}
        stats = client.request("units_state")["stats"]
    finally:
        try:
            client.request("shutdown")
        finally:
            client.close()
        time.sleep(0.2)
        shutil.rmtree(home, ignore_errors=True)

    ping_rate = results["ping_per_s"]
    print(f"GPU units ledger: simulated device of {capacity} units, {args.seconds:g} s per rate, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<46}{'per s':>10}{'vs ping':>10}")
    for name, value in results.items():
        if "_per_s" in name:
            print(f"{name:<46}{value:>10.0f}{value / ping_rate:>10.2f}")
    print(f"{'ping, median round trip':<46}{results['ping_median_us']:>10.0f} us")
    pair = results["acquire_release_median_us_1_client"]
    print(f"{'acquire + release, median (1 client)':<46}{pair:>10.0f} us")
    kills = f"kill -> free, median of {len(latencies)}"
    print(f"{kills:<46}{results['kill_to_free_median_ms']:>10.2f} ms")
    print(f"{'kill -> free, max':<46}{results['kill_to_free_max_ms']:>10.2f} ms")
    OUT.mkdir(exist_ok=True)
    doc = {"results": results, "ledger_stats": stats, "args": vars(args) | {"child": None},
           "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
                       "python": platform.python_version(), "platform": platform.platform()}}
    (OUT / "units.json").write_text(json.dumps(doc, indent=2))
    print(f"wrote {OUT / 'units.json'}")


if __name__ == "__main__":
    main()
