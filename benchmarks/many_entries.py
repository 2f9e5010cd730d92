"""Many small entries: filling, hits, status, `ls` and eviction with up to 10,000 entries (issue 38).

For each count of --entries, a daemon on a temporary OVERMIND_HOME is filled with small entries (a page
each, as tokenizers, processors and schedulers are), and then measured:
- another kernel's hits at rest: the lookup's time, median and longest;
- `status`: its time and the bytes of its reply (a frame holds at most 1 MiB), and `ls` paged through
  every entry;
- one reserve that needs the room of every entry: the time it takes to evict them all, and the longest
  another kernel's hit waited on the store meanwhile (a kernel gives up on a daemon after 3 s).
A count is capped by the descriptors the daemon may hold (two per entry: Note [Descriptor budget] in
kernel_server/descriptors.py); the table says which count ran. The cost per entry across counts shows
whether it grows with the store (Note [Eviction in O(log n)] in kernel_server/catalogue.py). Then the
store's bookkeeping alone (kernel_server/catalogue.py, no daemon and no descriptors) for --catalogue
counts: adding every entry, status's choice of entries, and evicting them all.

    .venv/bin/python benchmarks/many_entries.py
    .venv/bin/python benchmarks/many_entries.py --entries 1000 4000 10000 --catalogue 10000 100000

Prints a table and writes benchmarks/out/many_entries.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO)]
# the daemon it starts runs this checkout's kernel_server, as the tests' do (tests/conftest.py)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def daemon_figures(wanted: int) -> dict[str, Any]:
    """Fill a fresh daemon with up to `wanted` small entries and measure it (see the module's docstring)."""
    from kernel_server import Client
    from kernel_server.lifecycle import kill_daemon
    from tests.helpers.many_entries import ENTRY_BYTES, HitTimer, fits_descriptors, publish_many

    home = Path(tempfile.mkdtemp(prefix="om-many-", dir="/tmp"))
    os.chmod(home, 0o700)
    os.environ["OVERMIND_HOME"] = str(home)
    budget = (wanted + 2) * ENTRY_BYTES
    os.environ["OVERMIND_BUDGET"] = str(budget)
    out: dict[str, Any] = {"wanted": wanted}
    try:
        with Client(home, role="test", label="loader") as loader, Client(home, role="kernel", label="other") as other:
            count = out["entries"] = fits_descriptors(loader, wanted)
            publish_many(loader, 1, "hot")
            started = time.perf_counter()
            publish_many(loader, count, "small")
            out["fill_s"] = time.perf_counter() - started

            with HitTimer(other, "hot-000000") as rest:
                time.sleep(1.0)
            out["hit_median_ms"] = 1000 * statistics.median(rest.times)
            out["hit_max_ms"] = 1000 * max(rest.times)

            times = []
            for _ in range(5):
                started = time.perf_counter()
                status = loader.request("status", timeout=60)
                times.append(time.perf_counter() - started)
            out["status_ms"] = 1000 * statistics.median(times)
            out["status_bytes"] = len(json.dumps(status.payload, separators=(",", ":")))
            out["status_entries"] = len(status["entries"])
            out["status_entries_more"] = status["entries_more"]

            started, listed, after, pages = time.perf_counter(), 0, "", 0
            while True:
                page = loader.request("ls", after=after, timeout=60)
                listed, pages = listed + len(page["entries"]), pages + 1
                if page["next"] is None:
                    break
                after = page["next"]
            out["ls_all_ms"], out["ls_pages"], out["ls_listed"] = 1000 * (time.perf_counter() - started), pages, listed

            with HitTimer(other, "hot-000000") as during:
                time.sleep(0.3)
                before = len(during.times)
                started = time.perf_counter()
                assert loader.request("lookup", key="big", wait=False)["status"] == "load"
                evicted = loader.request("reserve", key="big", bytes=budget - 2 * ENTRY_BYTES, timeout=600)["evicted"]
                out["evict_s"] = time.perf_counter() - started
                time.sleep(0.3)
            out["evicted"] = len(evicted)
            out["evict_us_per_entry"] = 1e6 * out["evict_s"] / max(1, len(evicted))
            out["hit_max_while_evicting_ms"] = 1000 * max(during.times[before:] or [0.0])
            out["hit_errors"] = [repr(e) for e in rest.errors + during.errors]
    finally:
        kill_daemon(home)
        shutil.rmtree(home, ignore_errors=True)
    return out


def catalogue_figures(count: int) -> dict[str, Any]:
    """The store's bookkeeping alone for `count` entries: add them, choose status's entries, evict them all
    the way the store does (least recently used first, with what builds on each)."""
    from kernel_server.catalogue import Catalogue, Entry

    cat = Catalogue()
    started = time.perf_counter()
    for i in range(count):
        cat.add(Entry(f"small-{i:07d}", -1, -1, 16, 4096 * (1 + i % 7), "memfd", {}, [], 1, last_used=float(i)))
    added = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(10):
        cat.shown(50)
    shown = (time.perf_counter() - started) / 10
    started = time.perf_counter()
    held = cat.held_by_pins()
    for key in cat.by_use():
        if key not in held and key in cat:
            for k in [*cat.dependents(key), key]:
                cat.remove(k)
    evicted = time.perf_counter() - started
    return {"entries": count, "add_us_per_entry": 1e6 * added / count, "shown_ms": 1000 * shown,
            "evict_s": evicted, "evict_us_per_entry": 1e6 * evicted / count}


def table(title: str, columns: list[dict[str, Any]], rows: list[tuple[str, Callable[[dict[str, Any]], str]]]) -> None:
    """A column per run (headed by its entry count), a row per figure."""
    print(f"{title:<36}" + "".join(f"{c['entries']:>14}" for c in columns))
    for name, cell in rows:
        print(f"  {name:<34}" + "".join(f"{cell(c):>14}" for c in columns))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[1000, 10_000],
                        help="entry counts to fill a daemon with (default 1000 10000)")
    parser.add_argument("--catalogue", type=int, nargs="*", default=[10_000, 100_000],
                        help="entry counts for the bookkeeping alone (default 10000 100000)")
    parser.add_argument("--out", type=Path, default=HERE / "out" / "many_entries.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    daemons = [daemon_figures(n) for n in args.entries]
    catalogues = [catalogue_figures(n) for n in args.catalogue]
    table("daemon", daemons, [
        ("entries wanted", lambda d: f"{d['wanted']}"),
        ("fill (s)", lambda d: f"{d['fill_s']:.2f}"),
        ("hit at rest, median (ms)", lambda d: f"{d['hit_median_ms']:.2f}"),
        ("hit at rest, max (ms)", lambda d: f"{d['hit_max_ms']:.1f}"),
        ("status (ms)", lambda d: f"{d['status_ms']:.1f}"),
        ("status reply (bytes)", lambda d: f"{d['status_bytes']}"),
        ("status entries / more", lambda d: f"{d['status_entries']} / {d['status_entries_more']}"),
        ("ls, every page (ms)", lambda d: f"{d['ls_all_ms']:.0f}"),
        ("ls pages / entries", lambda d: f"{d['ls_pages']} / {d['ls_listed']}"),
        ("evicted by one reserve", lambda d: f"{d['evicted']}"),
        ("eviction (s)", lambda d: f"{d['evict_s']:.3f}"),
        ("eviction per entry (us)", lambda d: f"{d['evict_us_per_entry']:.1f}"),
        ("hit while evicting, max (ms)", lambda d: f"{d['hit_max_while_evicting_ms']:.1f}"),
    ])
    table("catalogue alone", catalogues, [
        ("add per entry (us)", lambda c: f"{c['add_us_per_entry']:.1f}"),
        ("status's choice of entries (ms)", lambda c: f"{c['shown_ms']:.2f}"),
        ("evict all (s)", lambda c: f"{c['evict_s']:.3f}"),
        ("evict per entry (us)", lambda c: f"{c['evict_us_per_entry']:.1f}"),
    ])
    errors = [e for d in daemons for e in d["hit_errors"]]
    result = {"command": " ".join(["benchmarks/many_entries.py", *sys.argv[1:]]), "daemon": daemons,
              "catalogue": catalogues}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    if errors:
        print(f"the other kernel's hits failed: {errors}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
