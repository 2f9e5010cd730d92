"""One of several processes that acquire, touch and release GPU units at random (tests/test_units.py).

    python -m tests.helpers.units_worker SEED STEPS BELIEF_FILE

Besides checking the ledger's own record after every step (no device over capacity, its used units the
sum of its holders', this process's holdings exactly the ones it was granted), it keeps an independent
tally of the units all workers believe they hold, in BELIEF_FILE under flock: a worker adds a grant
after the ledger granted it and subtracts a holding before it gives it back, so the tally never exceeds
what the ledger holds, and a ledger that over-committed would show as a tally above capacity.
Idle holdings are given back when the daemon asks. Exits 0, or 1 with the broken invariant on stderr.
"""

from __future__ import annotations

import fcntl
import json
import random
import sys
import threading

from kernel_server import Client
from kernel_server.errors import DaemonError, RemoteError

DEVICE_CHOICES = [None, ["sim:0"], ["sim:1"], ["sim:1", "sim:0"]]


class Broken(Exception):
    pass


def main() -> None:  # noqa: C901 (its closures, which count in, share the worker's state: read as one script)
    seed, steps, belief_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    client = Client(role="test", label=f"worker-{seed}")
    capacity = {d["id"]: d["capacity"] for d in client.request("units_register", devices=[])["devices"]}
    lock = threading.Lock()
    held: dict[int, tuple[str, int]] = {}
    busy: set[int] = set()
    failures: list[str] = []

    def believe(device: str, delta: int) -> None:
        with open(belief_path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            tally = json.loads(f.read() or "{}")
            tally[device] = tally.get(device, 0) + delta
            if tally[device] > capacity[device]:
                raise Broken(f"workers hold {tally[device]} units of {device}, capacity {capacity[device]}")
            f.seek(0)
            f.truncate()
            f.write(json.dumps(tally))

    def give_back(holding: int) -> None:
        device, units = held.pop(holding)
        busy.discard(holding)
        believe(device, -units)
        client.request("units_release", holding=holding, timeout=30)

    def on_release_request(payload: dict) -> None:
        try:
            with lock:
                holding = payload["holding"]
                if holding in held and holding not in busy:  # a busy one ignores it, as a kernel does
                    give_back(holding)
        except (Broken, DaemonError) as exc:  # reported by the main loop
            failures.append(f"release on request: {exc!r}")

    client.on_push("units_release_request", on_release_request)

    def check() -> None:
        state = client.request("units_state", timeout=30).payload
        mine = set()
        for dev in state["devices"]:
            used = sum(h["units"] for h in dev["holders"])
            if used != dev["used"] or used > dev["capacity"]:
                raise Broken(f"{dev['id']}: holders hold {used}, ledger says used {dev['used']}, "
                             f"capacity {dev['capacity']}")
            mine |= {h["holding"] for h in dev["holders"] if h["kernel"]["conn"] == client.conn_id}
        if mine != set(held):
            raise Broken(f"the ledger says this worker holds {sorted(mine)}, it was granted {sorted(held)}")

    try:
        for _ in range(steps):
            op = rng.choices(["acquire", "release", "touch"], [5, 2, 2])[0]
            if op == "acquire":
                want_busy = rng.random() < 0.3
                try:
                    grant = client.request("units_acquire", units=rng.randint(1, 4),
                                           devices=rng.choice(DEVICE_CHOICES),
                                           timeout_s=rng.choice([0, 0.02, 0.2]), label=f"m{seed}",
                                           busy=want_busy, timeout=30)
                except RemoteError as exc:
                    if exc.code != "units_timeout":
                        raise
                else:
                    with lock:
                        held[grant["holding"]] = (grant["device"], grant["units"])
                        if want_busy:
                            busy.add(grant["holding"])
                        believe(grant["device"], grant["units"])
            elif op == "release":
                with lock:
                    if held:
                        give_back(rng.choice(sorted(held)))
            else:
                with lock:
                    if held:
                        holding = rng.choice(sorted(held))
                        now_busy = holding not in busy
                        (busy.add if now_busy else busy.discard)(holding)
                        client.request("units_touch", holding=holding, busy=now_busy, timeout=30)
            with lock:
                check()
            if failures:
                raise Broken(failures[0])
        with lock:
            for holding in sorted(held):
                give_back(holding)
            check()
    except Broken as exc:
        print(f"invariant broken: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    client.close()


if __name__ == "__main__":
    main()
