"""One kernel of the descriptor test (tests/test_descriptors.py): many distinct entries through a daemon
whose descriptor limit holds only some of them, while this kernel holds a GPU units lease.

    python -m tests.helpers.descriptors_worker SEED ENTRIES CHECKPOINT

It takes one unit of the simulated ledger, then makes ENTRIES distinct entries through the real cached
call: tiny models, and every 25th a load of the safetensors file CHECKPOINT (an entry that refers to
the file, so it holds a descriptor of it). Between them it loads recent keys again (a hit, or a miss
when the entry was evicted meanwhile) and keeps its last three results alive, so that their entries
stay pinned and eviction must pass them over. Every result is compared with a plain load. At the end it
asks the ledger whether its lease is still there, and prints one JSON line of counts.
"""

from __future__ import annotations

import collections
import json
import random
import sys
from typing import Any

import safetensors.torch
import torch

from kernel_server.client import shared_client
from overmind_jupyter import loading, notices
from tests.helpers import tiny_modules
from tests.helpers.faults_helpers import digest

CHECKPOINT_EVERY = 25


def load_checkpoint(path: str, variant: int) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, as views of its mapping (`variant` only makes another key)."""
    return safetensors.torch.load_file(path)


def main() -> None:
    seed, entries, checkpoint = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    client = shared_client(label=f"descriptors-{seed}")
    conn, daemon_pid = client.conn_id, client.daemon_pid
    client.request("units_register", devices=[], timeout=30)
    lease = client.request("units_acquire", units=1, devices=None, timeout_s=30, label=f"worker-{seed}",
                           busy=True, timeout=60)["holding"]
    plain_checkpoint = safetensors.torch.load_file(checkpoint)
    held: collections.deque[Any] = collections.deque(maxlen=3)
    counts: collections.Counter[str] = collections.Counter()
    wrong: list[str] = []
    fallbacks: collections.Counter[str] = collections.Counter()
    reasons: set[str] = set()

    def drain_fallbacks() -> None:
        while notices._fallbacks:  # loading.fallbacks() keeps the last 200: take them as they come
            f = notices._fallbacks.popleft()
            fallbacks[f["kind"]] += 1
            reasons.add(f"{f['kind']}: {f['reason'][:200]}")

    def load(i: int) -> None:
        hits = loading.calls().get("hit", 0)
        if i % CHECKPOINT_EVERY == 0:
            result = loading.cached(load_checkpoint, checkpoint, seed * 1_000_000 + i)
            same = result.keys() == plain_checkpoint.keys() and all(
                torch.equal(result[k], plain_checkpoint[k]) for k in result)
        else:
            result = loading.cached(tiny_modules.build, "mlp", seed=seed * 1_000_000 + i, width=4, depth=1)
            same = digest(result) == digest(tiny_modules.build("mlp", seed=seed * 1_000_000 + i, width=4, depth=1))
        counts["loads"] += 1
        counts["hits" if loading.calls().get("hit", 0) > hits else "not_hits"] += 1
        if not same:
            wrong.append(f"load {i}: differs from a plain load")
        if rng.random() < 0.3:
            held.append(result)  # pinned until three later loads replace it

    for i in range(entries):
        load(i)
        if i and rng.random() < 0.5:
            load(rng.randrange(max(0, i - 40), i))  # a recent key: a hit, or a miss when it was evicted
        drain_fallbacks()
    held.clear()
    drain_fallbacks()

    state = client.request("units_state", timeout=30).payload
    leases = [h["holding"] for dev in state["devices"] for h in dev["holders"] if h["kernel"]["conn"] == conn]
    now = shared_client()
    print(json.dumps({
        "seed": seed, **counts, "wrong": wrong, "fallbacks": dict(fallbacks), "reasons": sorted(reasons)[:20],
        "lease_held": leases == [lease], "same_connection": now is client and now.conn_id == conn and not now.closed,
        "daemon_pid": now.daemon_pid, "daemon_pid_before": daemon_pid, "calls": loading.calls(),
    }), flush=True)


if __name__ == "__main__":
    main()
