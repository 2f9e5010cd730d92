"""GPU units: the daemon's ledger and the kernels' residency, with real processes and simulated devices.

Devices are simulated with OVERMIND_FAKE_GPUS, set before the daemon starts (it inherits the test's
environment); tests marked `gpu` move real models and compare the accounting with `torch.cuda.mem_get_info`.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kernel_server import Client
from kernel_server.errors import RemoteError
from kernel_server.ledger import Ledger
from kernel_server.settings import GiB, parse_fake_gpus
from overmind_jupyter import units
from overmind_jupyter.errors import OvermindWarning
from overmind_jupyter.units.devices import CONTEXT_UNITS
from overmind_jupyter.units.transfer import Reader, to_device
from tests.helpers import tiny_modules
from tests.helpers.cached_modules import arena_backed, in_arena
from tests.helpers.faults_helpers import wait_until
from tests.helpers.snippets import run_py, start_py


@pytest.fixture
def fake_gpus(overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Client]]:
    """Start the daemon with simulated devices: `fake_gpus("1x16", reserve=1)` returns a test client."""
    clients: list[Client] = []

    def start(spec: str = "1x16", reserve: float = 1) -> Client:
        monkeypatch.setenv("OVERMIND_FAKE_GPUS", spec)
        monkeypatch.setenv("OVERMIND_GPU_RESERVE", str(reserve))
        clients.append(Client(overmind_home, role="test"))
        return clients[-1]

    yield start
    for c in clients:
        c.close()


class Peer:
    """Another kernel: tests/helpers/units_peer.py in its own process, sending the requests it is given."""

    def __init__(self, label: str = "peer") -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.units_peer", label],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        hello = self._read()
        self.conn, self.pid = hello["ready"], hello["pid"]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"peer died: {self.proc.stderr.read()}")
        return json.loads(line)

    def __call__(self, op: str, **fields: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


@pytest.fixture
def peers() -> Iterator[Callable[..., Peer]]:
    started: list[Peer] = []

    def make(label: str = "peer") -> Peer:
        started.append(Peer(label))
        return started[-1]

    yield make
    for p in started:
        p.close()


def holders(client: Client, device: int = 0) -> list[dict[str, Any]]:
    return client.request("units_state")["devices"][device]["holders"]


def linear() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


# -- configuration and wire -------------------------------------------------------------------------

def test_fake_gpus_spec_reads_counts_and_sizes() -> None:
    assert parse_fake_gpus("2x16") == [16.0, 16.0]
    assert parse_fake_gpus("24") == [24.0]
    assert parse_fake_gpus("1x80, 2x16GiB") == [80.0, 16.0, 16.0]
    for bad in ("lots", "0x16", "2x0", "2x", "x16", ""):
        with pytest.raises(ValueError, match="COUNTxGiB"):
            parse_fake_gpus(bad)
    ledger = Ledger(fake_gpus="1x16.5", reserve_gib=1.5, timers=False)
    assert ledger.snapshot()["devices"][0]["capacity"] == 15, "whole GiB units, after the reserve"


def test_bad_reserve_answers_errors_and_keeps_the_daemon(fake_gpus: Callable[..., Client]) -> None:
    client = fake_gpus("2x16", reserve=-1)
    with pytest.raises(RemoteError, match="OVERMIND_GPU_RESERVE='-1'") as info:
        client.request("units_acquire", units=1)
    assert info.value.code == "bad_config" and "overmind-daemon stop" in str(info.value)
    assert client.request("status")["units"]["config_error"]
    assert client.request("ping")["pong"]


def test_a_bad_device_list_is_said_once_and_simulates_nothing(fake_gpus: Callable[..., Client],
                                                              overmind_home: Path) -> None:
    """A bad OVERMIND_FAKE_GPUS is reported once, "using the default (none)", and the default is what the
    kernel and the daemon it started use: no simulated device, no error of the value from the units (Note
    [Bad settings] in kernel_server/settings.py)."""
    client = fake_gpus("2x0")  # in this process's environment and the daemon's
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state = units.state()
        units.state()
        text = units.format_state(state)
    assert [str(w.message) for w in said] == [
        "OVERMIND_FAKE_GPUS='2x0' is not a device list (COUNTxGiB, as in 2x16 for two devices of 16 GiB, or "
        "several joined by commas, as in 1x80,2x16): write e.g. OVERMIND_FAKE_GPUS=2x16; using the default "
        "(none) meanwhile"]
    assert not state["simulated"] and not state["config_error"], state
    assert "ledger disabled" not in text and "OVERMIND_FAKE_GPUS" not in text, text
    if not torch.cuda.is_available():
        assert state["devices"] == []
        with pytest.raises(units.NoDeviceError, match="no GPU is visible in this kernel"):
            units.place(linear(), "cuda:0")
    assert client.request("units_state")["fake_gpus"] is None
    assert (overmind_home / "daemon.log").read_text().count("OVERMIND_FAKE_GPUS='2x0'") == 1


def test_bad_requests_get_error_replies(fake_gpus: Callable[..., Client]) -> None:
    client = fake_gpus("2x4", reserve=0)
    bad = [
        ({"units": -1}, "bad_request"), ({"units": "x"}, "bad_request"), ({"units": True}, "bad_request"),
        ({"units": 0}, "bad_request"), ({"units": 1, "devices": "sim:0"}, "bad_request"),
        ({"units": 1, "devices": []}, "bad_request"), ({"units": 1, "devices": [1]}, "bad_request"),
        ({"units": 1, "devices": ["sim:9"]}, "unknown_device"),
        ({"units": 1, "timeout_s": -1}, "bad_request"),
        ({"units": 1, "timeout_s": "soon"}, "bad_request"), ({"units": 5}, "units_too_large"),
    ]
    for fields, code in bad:
        with pytest.raises(RemoteError) as info:
            client.request("units_acquire", **fields)
        assert info.value.code == code, (fields, info.value)
    with pytest.raises(RemoteError, match=r"largest of cuda:0, cuda:1 has 4 units: 4.0 GiB minus the 0 GiB "
                                          r"reserve \(simulated by the daemon's OVERMIND_FAKE_GPUS=2x4\)\. Use"):
        client.request("units_acquire", units=5)
    for op, fields, code in [("units_release", {"holding": "x"}, "bad_request"),
                             ("units_release", {"holding": 99}, "no_holding"),
                             ("units_touch", {"holding": 1, "busy": "yes"}, "bad_request"),
                             ("units_cancel", {"request": None}, "bad_request"),
                             ("units_register", {"devices": [{"id": 3}]}, "bad_request"),
                             ("units_register", {"devices": "gpu"}, "bad_request")]:
        with pytest.raises(RemoteError) as info:
            client.request(op, **fields)
        assert info.value.code == code, (op, fields)
    assert client.request("units_state")["devices"][0]["used"] == 0
    assert client.request("ping")["pong"]


def test_real_devices_are_recorded_from_the_first_report(overmind_home: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without OVERMIND_FAKE_GPUS the daemon learns devices from kernels, by id; the first report fixes
    the capacity, and each kernel gets back its own names."""
    monkeypatch.delenv("OVERMIND_FAKE_GPUS", raising=False)
    monkeypatch.setenv("OVERMIND_GPU_RESERVE", "1")
    a, b = Client(overmind_home), Client(overmind_home)
    try:
        with pytest.raises(RemoteError, match=r"knows no GPU.*OVERMIND_FAKE_GPUS") as info:
            a.request("units_acquire", units=1)
        assert info.value.code == "no_device"
        gpu = {"id": "GPU-aaaa", "name": "cuda:0", "total_bytes": 80 * GiB + 5, "model": "H100"}
        assert a.request("units_register", devices=[gpu])["devices"][0]["capacity"] == 79
        other = {"id": "GPU-bbbb", "name": "cuda:0", "total_bytes": 40 * GiB, "model": "A100"}
        again = dict(gpu, name="cuda:1", total_bytes=GiB)
        seen = b.request("units_register", devices=[other, again])["devices"]
        assert [(d["id"], d["name"], d["capacity"]) for d in seen] == [("GPU-bbbb", "cuda:0", 39),
                                                                         ("GPU-aaaa", "cuda:1", 79)]
        assert not a.request("units_state")["simulated"]
        # a device a kernel simulates with its own OVERMIND_FAKE_GPUS, the daemon simulating none: its too large
        # request names where the simulation came from (not the daemon's unset setting) and counts units in English
        sims = [{"id": f"sim:{i}", "name": f"cuda:{i}", "total_bytes": (2 - i) * GiB, "model": "simulated",
                 "simulated": True} for i in (0, 1)]
        a.request("units_register", devices=sims)
        for units_, device, said in ((2, "sim:0", "2 units requested but the largest of cuda:0 has 1 unit: 2.0 GiB"),
                                     (1, "sim:1", "1 unit requested but the largest of cuda:1 has 0 units: 1.0 GiB")):
            with pytest.raises(RemoteError) as info:
                a.request("units_acquire", units=units_, devices=[device])
            assert info.value.code == "units_too_large" and said in str(info.value), info.value
            assert " minus the 1 GiB reserve (simulated by the OVERMIND_FAKE_GPUS of the kernel that first reported " \
                   "it). Use a larger device" in str(info.value), info.value
    finally:
        a.close()
        b.close()


# -- the ledger's rules, explored in one process --------------------------------------------------------

class LedgerMachine(RuleBasedStateMachine):
    """Random acquires, releases, touches, cancels, disconnections and timeouts against a `Ledger`, with
    a model of what each connection was granted. Checked after every step: no device over capacity and
    the ledger's holdings exactly the grants; no waiting request fits a device that no earlier request
    waits for; release requests go to idle holders only, least recently used first."""

    DEVICES = (None, ["sim:0"], ["sim:1"], ["sim:1", "sim:0"])

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.ledger = Ledger(fake_gpus="2x6", reserve_gib=0, clock=lambda: self.now, timers=False,
                             ask_patience=5)
        self.held: dict[int, dict[str, Any]] = {}  # holding -> conn, device, units, busy, used
        self.asked: set[int] = set()
        self.pending: dict[tuple[int, int], str] = {}  # (conn, request) -> state
        self.requests = iter(range(1, 10**6))
        self.busy_flags: dict[tuple[int, int], bool] = {}
        self.tick = 0

    def _answer(self, conn: int, request: int) -> Callable[[Any], None]:
        def answer(result: Any) -> None:
            assert self.pending.get((conn, request)) == "waiting", "answered twice"
            if isinstance(result, RemoteError):
                assert result.code == "units_timeout", result
                self.pending[(conn, request)] = "timeout"
            elif result.get("status") == "cancelled":
                self.pending[(conn, request)] = "cancelled"
            else:
                self.tick += 1
                self.held[result["holding"]] = {
                    "conn": conn, "device": result["device"], "units": result["units"],
                    "busy": self.busy_flags[(conn, request)], "used": self.tick, "request": request}
                self.pending[(conn, request)] = "granted"
        return answer

    def _push(self, conn: int) -> Callable[[str, dict[str, Any]], bool]:
        def push(op: str, payload: dict[str, Any]) -> bool:
            assert op == "units_release_request"
            h = self.held[payload["holding"]]
            assert h["conn"] == conn and not h["busy"], "a busy holder is never asked"
            older = [k for k, g in self.held.items() if g["device"] == h["device"] and not g["busy"]
                     and k not in self.asked and k != payload["holding"] and g["used"] < h["used"]]
            assert not older, f"holding {payload['holding']} asked before the less recently used {older}"
            self.asked.add(payload["holding"])
            return True
        return push

    @rule(conn=st.integers(1, 3), units=st.integers(1, 7), devices=st.sampled_from(DEVICES),
          timeout=st.sampled_from([None, 0, 1.0, 5.0]), busy=st.booleans())
    def acquire(self, conn: int, units: int, devices: list[str] | None, timeout: float | None,
                busy: bool) -> None:
        request = next(self.requests)
        self.pending[(conn, request)] = "waiting"
        self.busy_flags[(conn, request)] = busy
        try:
            self.ledger.acquire(conn, conn, request, units=units, devices=devices, timeout=timeout, label="m",
                                busy=busy, answer=self._answer(conn, request), push=self._push(conn))
        except RemoteError as exc:
            assert exc.code == "units_too_large" and units > 6
            del self.pending[(conn, request)]

    @rule(data=st.data(), honour=st.booleans())
    def release(self, data: st.DataObject, honour: bool) -> None:
        choices = sorted(self.asked & set(self.held)) if honour else sorted(self.held)
        if not choices:
            return
        holding = data.draw(st.sampled_from(choices))
        h = self.held.pop(holding)
        self.asked.discard(holding)
        assert self.ledger.release(h["conn"], holding) == h["units"]

    @rule(data=st.data(), busy=st.booleans())
    def touch(self, data: st.DataObject, busy: bool) -> None:
        if not self.held:
            return
        holding = data.draw(st.sampled_from(sorted(self.held)))
        h = self.held[holding]
        h["busy"] = busy
        self.tick += 1
        h["used"] = self.tick
        if busy:
            self.asked.discard(holding)
        self.ledger.touch(h["conn"], holding, busy)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        waiting = sorted(k for k, v in self.pending.items() if v in ("waiting", "granted"))
        if not waiting:
            return
        conn, request = data.draw(st.sampled_from(waiting))
        was = self.pending[(conn, request)]
        cancelled, revoked = self.ledger.cancel(conn, request)
        if was == "waiting":
            assert cancelled and revoked is None and self.pending[(conn, request)] == "cancelled"
        else:
            gone = [k for k, h in self.held.items() if h["conn"] == conn and h["request"] == request]
            assert (revoked is not None) == bool(gone)
            for k in gone:
                del self.held[k]
                self.asked.discard(k)
            self.pending[(conn, request)] = "revoked"

    @rule(conn=st.integers(1, 3))
    def disconnect(self, conn: int) -> None:
        self.ledger.release_connection(conn)
        for k in [k for k, h in self.held.items() if h["conn"] == conn]:
            del self.held[k]
            self.asked.discard(k)
        for key in [k for k, v in self.pending.items() if k[0] == conn and v == "waiting"]:
            self.pending[key] = "gone"

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.ledger.expire()

    @invariant()
    def accounting(self) -> None:
        snap = self.ledger.snapshot()
        for dev in snap["devices"]:
            assert dev["used"] <= dev["capacity"], dev
            recorded = {h["holding"]: h["units"] for h in dev["holders"]}
            expected = {k: h["units"] for k, h in self.held.items() if h["device"] == dev["id"]}
            assert recorded == expected and dev["used"] == sum(expected.values())

    @invariant()
    def no_waiter_skipped(self) -> None:
        snap = self.ledger.snapshot()
        free = {d["id"]: d["free"] for d in snap["devices"]}
        earlier: set[str] = set()
        for w in snap["waiters"]:
            for d in w["device_ids"]:
                assert free[d] < w["units"] or d in earlier, f"{w} fits {d} ({free[d]} free), nobody ahead"
            earlier |= set(w["device_ids"])
        live = {k for k, v in self.pending.items() if v == "waiting"}
        assert len(live) == len(snap["waiters"]), "every waiting request is answered exactly once"


TestLedgerRules = LedgerMachine.TestCase
TestLedgerRules.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_a_holder_that_does_not_answer_is_passed_over_after_the_patience() -> None:
    now = [0.0]
    ledger = Ledger(fake_gpus="1x6", reserve_gib=0, clock=lambda: now[0], timers=False, ask_patience=5)
    asked: list[int] = []
    grants: list[Any] = []

    def push(op: str, payload: dict[str, Any]) -> bool:
        asked.append(payload["holding"])
        return True

    def acquire(conn: int, units: int) -> None:
        ledger.acquire(conn, conn, len(grants) + 100, units=units, devices=None, timeout=60, label="",
                       busy=False, answer=grants.append, push=push)

    acquire(1, 3)
    acquire(2, 3)
    hung, responsive = grants[0]["holding"], grants[1]["holding"]
    acquire(3, 3)
    assert asked == [hung], "the least recently used idle holder is asked, just enough of them"
    now[0] = 4.0
    ledger.expire()
    assert asked == [hung], "within the patience, the asked holder counts as making room"
    now[0] = 5.5
    ledger.expire()
    assert asked == [hung, responsive], "then the next one is asked"
    ledger.release(2, responsive)
    assert grants[-1]["units"] == 3 and ledger.snapshot()["devices"][0]["used"] == 6


def test_waiters_are_served_in_arrival_order(fake_gpus: Callable[..., Client], overmind_home: Path) -> None:
    """A small request that would fit now waits behind an earlier large one (no barging)."""
    holder = fake_gpus("1x16")  # 15 units
    held = holder.request("units_acquire", units=14, busy=True)["holding"]
    first, second = Client(overmind_home), Client(overmind_home)
    try:
        rid1, fut1 = first.submit("units_acquire", units=10, timeout_s=10)
        wait_until(lambda: len(holder.request("units_state")["waiters"]) == 1)
        rid2, fut2 = second.submit("units_acquire", units=1, timeout_s=10)
        time.sleep(0.2)
        assert not fut1.done() and not fut2.done(), "the small request does not overtake the large one"
        assert [w["units"] for w in holder.request("units_state")["waiters"]] == [10, 1]
        holder.request("units_release", holding=held)
        large, small = first.wait(rid1, fut1, 5), second.wait(rid2, fut2, 5)
        assert large["units"] == 10 and small["units"] == 1
        assert large["holding"] < small["holding"], "granted in arrival order (holding ids count up)"
    finally:
        first.close()
        second.close()


def test_a_kernels_cuda_context_is_counted_once_per_device(fake_gpus: Callable[..., Client],
                                                           peers: Callable[..., Peer]) -> None:
    """A kernel on a real device asks for its CUDA context's units with its first model there: held by its
    connection, once per device, never asked back, freed with the kernel (Note [CUDA contexts])."""
    client = fake_gpus("2x8", reserve=0)  # 8 units each
    kernel = peers("kernel")
    first = kernel("units_acquire", units=3, context_units=1, devices=["sim:0"], label="first")
    assert first["units"] == 3 and first["context"] == 1
    kernel("units_acquire", units=2, context_units=1, devices=["sim:0"], label="second")
    context, *models = holders(client)
    assert context["context"] and context["units"] == 1 and context["pid"] == kernel.pid and context["busy"]
    assert [(h["model"], h["units"]) for h in models] == [("first", 3), ("second", 2)], "one context"
    assert client.request("units_state")["devices"][0]["used"] == 6
    for h in models:
        kernel("units_release", holding=h["holding"])
    assert [h["units"] for h in holders(client)] == [1], "the context stays while the kernel lives"
    with pytest.raises(RemoteError, match="CUDA context") as info:
        client.request("units_acquire", units=8, devices=["sim:0"], timeout_s=0.2)
    assert info.value.code == "units_timeout"
    too_large = kernel("units_acquire", units=8, context_units=1, devices=["sim:1"], timeout_s=0)
    assert too_large["code"] == "units_too_large", too_large
    assert "8 units requested and 1 for this kernel's CUDA context" in too_large["message"]
    kernel.close()
    wait_until(lambda: not holders(client), 2.0)
    assert client.request("units_acquire", units=8, devices=["sim:0"], timeout_s=1)["units"] == 8


# -- several processes -------------------------------------------------------------------------------

def test_processes_acquiring_at_random_never_exceed_capacity(fake_gpus: Callable[..., Client],
                                                             tmp_path: Path) -> None:
    client = fake_gpus("2x6", reserve=0)
    belief = tmp_path / "belief.json"
    belief.write_text("{}")
    worker = [sys.executable, "-m", "tests.helpers.units_worker"]
    workers = [subprocess.Popen([*worker, str(seed), "80", str(belief)], stderr=subprocess.PIPE, text=True)
               for seed in range(4)]
    checks = 0
    while any(w.poll() is None for w in workers):
        for dev in client.request("units_state")["devices"]:
            assert dev["used"] == sum(h["units"] for h in dev["holders"]) <= dev["capacity"], dev
        checks += 1
        time.sleep(0.005)
    errors = [w.stderr.read() for w in workers]
    assert [w.returncode for w in workers] == [0] * 4, errors
    state = client.request("units_state")
    assert all(not d["holders"] for d in state["devices"]) and not state["waiters"]
    assert json.loads(belief.read_text()) in ({}, {"sim:0": 0, "sim:1": 0}, {"sim:0": 0}, {"sim:1": 0})
    stats = state["stats"]
    assert stats["granted"] > 50 and stats.get("release_requests", 0) > 0 and checks > 10, stats


def test_sigkilled_kernel_frees_its_units_within_1s(fake_gpus: Callable[..., Client]) -> None:
    client = fake_gpus("1x16")
    victim = start_py("""
        import sys, torch
        from overmind_jupyter import units
        model = torch.nn.Linear(4, 4)
        units.place(model, units=15)
        with units.using(model):  # busy: it would never give its units back by itself
            print(units.device_of(model), flush=True)
            sys.stdin.read()
    """)
    try:
        assert victim.stdout.readline().strip() == "cuda:0", victim.stderr.read() if victim.poll() else ""
        assert holders(client)[0]["busy"] and holders(client)[0]["pid"] == victim.pid
        request_id, waiting = client.submit("units_acquire", units=15, timeout_s=10)
        time.sleep(0.1)
        assert not waiting.done()
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        grant = client.wait(request_id, waiting, 1.0)
        assert time.monotonic() - killed < 1.0 and grant["units"] == 15
        assert [h["pid"] for h in holders(client)] == [os.getpid()]
    finally:
        victim.kill()
        victim.wait()


# -- residency in a kernel -------------------------------------------------------------------------------

def test_model_reused_without_contention_is_not_moved(fake_gpus: Callable[..., Client]) -> None:
    client = fake_gpus("1x16")
    model = linear()
    assert units.place(model, label="reused") == "cuda:0"
    holding = holders(client)[0]["holding"]
    for _ in range(5):
        with units.using(model) as m:
            assert m is model and holders(client)[0]["busy"]
        assert units.place(model) == "cuda:0"
    state = units.state()
    assert [h["holding"] for h in state["devices"][0]["holders"]] == [holding]
    events = [e["event"] for e in state["kernel"]["events"] if e["model"] == "reused"]
    assert events == ["placed"], "placed once, never released"
    assert state["stats"]["granted"] == 1 and not state["stats"].get("release_requests")
    assert state["devices"][0]["holders"][0]["units"] == units.units_for(model) == 1


def test_lru_idle_holder_is_evicted_and_a_busy_one_never(fake_gpus: Callable[..., Client],
                                                         peers: Callable[..., Peer]) -> None:
    client = fake_gpus("1x16")  # 15 units
    oldest, middle, newest = linear(), linear(), linear()
    for name, model in (("oldest", oldest), ("middle", middle), ("newest", newest)):
        units.place(model, units=5, label=name)
    peer = peers()
    with units.using(oldest):  # least recently used, but busy
        assert peer("units_acquire", units=5, timeout_s=5, busy=True)["units"] == 5
        assert units.device_of(middle) is None, "the least recently used idle model went"
        assert units.device_of(oldest) == units.device_of(newest) == "cuda:0"
        assert peer("units_acquire", units=5, timeout_s=5, busy=True)["units"] == 5
        assert units.device_of(newest) is None
        timed_out = peer("units_acquire", units=5, timeout_s=0.3)
        assert timed_out["code"] == "units_timeout"
        assert "busy" in timed_out["message"] and "units.using" in timed_out["message"]
        assert units.device_of(oldest) == "cuda:0", "a busy model is never moved"
        events = units.state()["kernel"]["events"]
        names = ("oldest", "middle", "newest")
        asked = [e["model"] for e in events if e["event"] == "asked" and e["model"] in names]
        assert asked == ["middle", "newest"]
    grant = peer("units_acquire", units=5, timeout_s=5)
    assert grant["units"] == 5 and units.device_of(oldest) is None, "idle now, so it goes"
    assert sum(h["units"] for h in holders(client)) == 15


def test_waiter_that_times_out_gets_a_clear_error(fake_gpus: Callable[..., Client],
                                                  peers: Callable[..., Peer]) -> None:
    client = fake_gpus("1x16")
    peer = peers("trainer")
    peer("units_acquire", units=15, busy=True, label="Llama(7b)")
    model = linear()
    started = time.monotonic()
    with pytest.raises(units.UnitsTimeout) as info:
        units.place(model, timeout=0.3)
    assert 0.25 < time.monotonic() - started < 5
    message = str(info.value)
    assert "1 unit for Linear was not free within 0.3 s" in message, message
    assert f"pid {peer.pid} Llama(7b) 15 (busy)" in message
    assert "units.using" in message and "longer timeout" in message and "model.to('cpu')" in message
    assert isinstance(info.value, TimeoutError)
    state = client.request("units_state")
    assert not state["waiters"] and [h["pid"] for h in state["devices"][0]["holders"]] == [peer.pid]
    assert units.device_of(model) is None
    # a wait longer than two seconds is told in the cell while it lasts, once per model
    for _ in range(2):
        with warnings.catch_warnings(record=True) as told, pytest.raises(units.UnitsTimeout):
            warnings.simplefilter("always")
            units.place(model, timeout=2.5, label="mine")
        said = [str(w.message) for w in told if issubclass(w.category, OvermindWarning)]
        assert said == ([] if _ else ["overmind: mine waits for 1 unit on cuda:0, which other models hold "
                                      "(`%overmind units` lists them); it waits up to 2.5 s "
                                      "(OVERMIND_UNITS_TIMEOUT)"]), said


def test_using_is_counted_and_undone_when_the_block_raises(fake_gpus: Callable[..., Client]) -> None:
    client = fake_gpus("1x16")
    model = linear()
    with pytest.raises(units.NotPlacedError, match=r"units.place\(model"), units.using(model):
        pass
    units.place(model)
    with pytest.raises(KeyError, match="boom"), units.using(model):
        with units.using(model):
            assert holders(client)[0]["busy"]
        assert holders(client)[0]["busy"], "still inside the outer block"
        raise KeyError("boom")
    assert not units.state()["devices"][0]["holders"][0]["busy"], "idle (told on the kernel's connection)"
    with units.using(model), pytest.raises(units.ModelBusyError, match="after the block"):
        units.release(model)
    assert units.release(model) and not units.release(model)
    assert holders(client) == []
    with units.using(model):  # placed again where it was
        assert units.device_of(model) == "cuda:0" and holders(client)[0]["busy"]


def test_first_device_that_fits_or_the_one_named(fake_gpus: Callable[..., Client]) -> None:
    client = fake_gpus("2x8", reserve=0)
    a, b, c = linear(), linear(), linear()
    assert units.place(a, units=6) == "cuda:0"
    assert units.place(b, units=6) == "cuda:1", "cuda:0 has 2 free: the next device that fits, no eviction"
    assert units.place(c, units=2, device="cuda:1") == "cuda:1"
    assert units.place(c, units=2, device=0) == "cuda:0", "moved to the device named"
    assert [sum(h["units"] for h in d["holders"]) for d in client.request("units_state")["devices"]] == [8, 6]
    with pytest.raises(units.NoDeviceError, match="no device 'cuda:5' here; this kernel sees cuda:0, cuda:1"):
        units.place(linear(), device="cuda:5")
    with pytest.raises(units.ModelTooLargeError, match=r"9 units requested.*8 units"):
        units.place(linear(), units=9)
    with pytest.raises(units.UnitsError, match=r"units.release\(model\)"):
        units.place(linear(), device="cpu")
    with pytest.raises(units.UnitsError, match=r"torch\.nn\.Module"):
        units.place("not a model")


def test_collected_model_gives_its_units_back(fake_gpus: Callable[..., Client]) -> None:
    client = fake_gpus("1x16")
    model = linear()
    units.place(model)
    assert holders(client)
    del model
    gc.collect()
    wait_until(lambda: not holders(client), 2.0)


def test_placements_are_taken_up_again_by_a_new_daemon(fake_gpus: Callable[..., Client],
                                                      overmind_home: Path) -> None:
    """A daemon that died took the ledger with it: the next `using` block acquires the units again from
    the daemon the kernel starts, without moving the model."""
    from kernel_server.client import existing_shared_client

    client = fake_gpus("1x16")
    model = linear()
    units.place(model, units=2)
    os.kill(client.daemon_pid, signal.SIGKILL)
    wait_until(lambda: existing_shared_client() is None)
    with units.using(model):
        state = units.state()
        assert state["stats"] == {"acquires": 1, "granted": 1}, "a new daemon's ledger"
        [holder] = state["devices"][0]["holders"]
        assert holder["mine"] and holder["busy"] and holder["units"] == 2
    assert units.release(model) and units.device_of(model) is None
    assert not units.state()["devices"][0]["holders"]


def test_a_waiter_whose_daemon_dies_is_told_what_comes_next(fake_gpus: Callable[..., Client],
                                                            peers: Callable[..., Peer], overmind_home: Path) -> None:
    """The daemon killed while a kernel waits for units: the wait ends at once, with what happens next and
    where to read why it went."""
    client = fake_gpus("1x16")
    peers("trainer")("units_acquire", units=15, busy=True, label="Llama(7b)")
    killer = threading.Timer(0.5, os.kill, (client.daemon_pid, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(units.UnitsError) as info:
        units.place(linear(), timeout=60)
    killer.join()
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert message.startswith("lost the daemon while waiting for units (") and "the next call starts a new one" in \
        message and f"{overmind_home / 'daemon.log'} says why this one went" in message, message


def test_an_interrupt_as_the_units_request_is_sent_leaves_no_holding(fake_gpus: Callable[..., Client]) -> None:
    """A SIGINT that lands as `units.place` sends its request (the daemon has it, the wait's protection is not
    in place yet) is raised inside the wait, which withdraws the request and gives back what was granted:
    the kernel lives on holding no units, where it held a busy holding that nothing could release."""
    client = fake_gpus("1x16")
    code = textwrap.dedent("""
        import os, signal, sys, torch
        from kernel_server.client import Client
        from overmind_jupyter import units

        def _at_return(frame, event, arg):
            if event == "return" and frame.f_code is Client.submit.__code__ and \\
                    frame.f_locals.get("op") == "units_acquire":
                sys.setprofile(None)
                os.kill(os.getpid(), signal.SIGINT)

        sys.setprofile(_at_return)
        try:
            units.place(torch.nn.Linear(4, 4))
            print("placed", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        sys.stdin.read()
    """)
    kernel = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout is not None
        line = kernel.stdout.readline().strip()
        assert line == "interrupted", f"the cell said {line!r}: {kernel.stderr.read() if kernel.stderr else ''}"
        time.sleep(0.3)  # a grant left behind would be the daemon's holding by now
        assert [h for h in holders(client) if h["pid"] == kernel.pid] == [], holders(client)
        assert kernel.poll() is None, "the interrupted kernel lives on with its connection"
    finally:
        kernel.kill()
        kernel.wait()


def test_state_and_its_text(fake_gpus: Callable[..., Client], peers: Callable[..., Peer]) -> None:
    client = fake_gpus("2x16")
    model = linear()
    units.place(model, units=3, label="Mlp(tiny)")
    peer = peers("other-kernel")
    peer("units_acquire", units=4, busy=True, label="Llama(1b)", devices=["sim:0"])
    state = units.state()
    assert state["simulated"] and state["devices"][0]["simulated"] and state["devices"][0]["capacity"] == 15
    mine, theirs = state["devices"][0]["holders"]
    assert mine["mine"] and not mine["busy"] and mine["model"] == "Mlp(tiny)" and mine["units"] == 3
    assert not theirs["mine"] and theirs["busy"] and theirs["kernel"]["label"] == "other-kernel"
    text = units.format_state(state)
    assert "simulated devices (OVERMIND_FAKE_GPUS=2x16)" in text
    assert "cuda:0   simulated 16.0 GiB  capacity 15  used 7  free 8" in text
    assert f"pid {os.getpid()} (this kernel)" in text and "Mlp(tiny)      3  idle" in text
    assert f"pid {peer.pid} other-kernel" in text and "Llama(1b)      4  busy" in text
    assert "cuda:1" in text and "(no holders)" in text
    assert client.request("status")["units"]["devices"][0]["used"] == 7, "`overmind-daemon status` has units"


def test_importing_units_imports_no_torch(fake_gpus: Callable[..., Client]) -> None:
    fake_gpus("2x16")
    out = run_py("""
        import sys
        from overmind_jupyter import units
        state = units.state()
        print(units.format_state(state).splitlines()[0])
        print("torch" in sys.modules)
    """, fresh=True).stdout.splitlines()
    header = ("GPU units (1 unit = 1 GiB; 1 GiB of each device reserved) - simulated devices "
              "(OVERMIND_FAKE_GPUS=2x16)")
    assert out == [header, "False"]


# -- the way back to the host: Note [Lazy release to the cached weights] -------------------------------

def test_the_tests_loader_seeds_no_cuda_generator() -> None:
    """`tiny_modules.build` leaves every generator as it found it, as its docstring says and `arena_backed`
    needs: `torch.manual_seed` inside `fork_rng(devices=[])` also seeded the CUDA generators, which the fork
    does not restore, so on a GPU (CUDA initialised by an earlier test) the build was a load that changed
    the CUDA generator, keyed by its state (Note [Random loads]), and the second build a miss with the
    notice "cached for the state of the cuda generator" (issue 37, item 3). Without CUDA, torch queues the
    seed for CUDA's initialisation instead: that queue is what this reads here."""
    queued = list(torch.cuda._lazy_seed_tracker.get_calls())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    tiny_modules.build("mlp")
    assert torch.cuda._lazy_seed_tracker.get_calls() == queued, "a CUDA seed queued for CUDA's start"
    after = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    assert len(after) == len(cuda) and all(torch.equal(a, b) for a, b in zip(after, cuda, strict=True))


def test_way_back_reuses_unchanged_arena_tensors_and_copies_written_ones(overmind_home: Path) -> None:
    """The release logic on the CPU: `copy=True` makes the move to "cpu" a real copy, as to a GPU."""
    model = arena_backed("mlp")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    transfer = to_device(model, "cpu", copy=True)
    assert transfer.kept == 4 and not any(in_arena(p) for p in model.parameters()), "moved off the arena"
    first, second = model.layers[0], model.layers[1]
    with torch.no_grad():
        first.weight.add_(1.0)  # an in-place write on the device: its version counter moves
    second.bias.data = second.bias.data.double()  # replaced: another storage and dtype
    moved = transfer.to_host(model)
    assert moved["reused"] == 2 and moved["copied"] == 0, moved  # on the CPU the copies are the tensors
    assert in_arena(first.bias) and in_arena(second.weight), "unchanged: the cached weights again"
    assert not in_arena(first.weight) and torch.equal(first.weight, expected["layers.0.weight"] + 1)
    assert second.bias.dtype == torch.float64 and not in_arena(second.bias)
    assert torch.equal(second.weight, expected["layers.1.weight"])
    assert isinstance(first.weight, torch.nn.Parameter) and first.weight.requires_grad


def test_way_back_leaves_the_users_copies_of_the_old_weights_apart(overmind_home: Path) -> None:
    """A `state_dict()` or a view taken before the move holds the model's CPU storages; after a plain round
    trip through a device the model has storages of its own. So where the user holds one, the way back
    copies, and a write to the model never reaches the user's copy (Note [Lazy release to the cached
    weights]); where nothing else holds one, the cached weights come back."""
    model = arena_backed("mlp")
    snapshot = model.state_dict()  # views of the cached weights, as the user keeps them
    expected = {k: v.clone() for k, v in snapshot.items()}
    moved = to_device(model, "cpu", copy=True).to_host(model)
    assert moved["reused"] == 0, moved
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(snapshot[k], expected[k]) for k in snapshot), "a write to the model reached the copy"
    del snapshot
    weight = expected["layers.0.weight"].view(-1)
    for typed in (False, True):  # the storage's own object kept: `untyped_storage()`, or `storage()`
        model = arena_backed("mlp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
            held = model.layers[0].weight.storage() if typed else model.layers[0].weight.untyped_storage()
            raw = held.untyped() if typed else held
        moved = to_device(model, "cpu", copy=True).to_host(model)
        assert moved["reused"] == 3 and not in_arena(model.layers[0].weight), moved
        model.layers[0].weight.data += 1
        seen = torch.empty(0).set_(raw)[:weight.numel()]
        assert torch.equal(seen, weight), "a write to the model reached the storage the user holds"
    model = arena_backed("mlp")
    bias = model.layers[0].bias.detach()  # one of them
    moved = to_device(model, "cpu", copy=True).to_host(model)
    assert moved["reused"] == 3 and not in_arena(model.layers[0].bias) and in_arena(model.layers[0].weight), moved
    model.layers[0].bias.data += 1
    assert torch.equal(bias, expected["layers.0.bias"])


def test_way_back_keeps_writes_made_through_data(overmind_home: Path) -> None:
    """A write through `.data` (PEFT's merge_adapter, a hand edit) leaves the version counter where it was;
    the way back decides by the bytes, so it keeps the write, and an in-place no-op costs no copy."""
    model = arena_backed("mlp")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    transfer = to_device(model, "cpu", copy=True)
    first, second = model.layers[0], model.layers[1]
    first.weight.data += 1  # as `weight.data += delta` in merge_adapter
    with torch.no_grad():
        second.weight.mul_(1.0)  # its version counter moves, its bytes do not
    moved = transfer.to_host(model)
    assert torch.equal(first.weight, expected["layers.0.weight"] + 1), "the write is kept"
    assert not in_arena(first.weight) and in_arena(second.weight) and in_arena(first.bias)
    assert moved["reused"] == 3 and moved["copied"] == 0, moved


def test_way_back_compares_bytes_not_values() -> None:
    """The comparison is of bytes, to the last one and through several staging chunks: -0.0 is not 0.0,
    and a NaN is itself."""
    host = torch.zeros(300_000)  # 1.2 MB: five chunks
    device = host.clone()
    reader = Reader()
    assert reader.same_bytes(device, host)
    device[-1] = -0.0
    assert not reader.same_bytes(device, host) and torch.equal(device, host)
    odd = torch.full((3,), float("nan"), dtype=torch.bfloat16)  # 6 bytes: compared byte by byte
    assert reader.same_bytes(odd.clone(), odd) and not torch.equal(odd, odd)
    assert not reader.same_bytes(host.view(1000, 300), host) and not reader.same_bytes(host.double(), host)


def test_way_back_keeps_ties_and_can_be_turned_off(overmind_home: Path) -> None:
    model = arena_backed("tied")
    transfer = to_device(model, "cpu", copy=True)
    assert model.head.weight is model.embed.weight and not in_arena(model.embed.weight)
    transfer.to_host(model)
    assert model.head.weight is model.embed.weight and in_arena(model.embed.weight)
    plain = to_device(model, "cpu", copy=True, reuse_host=False)
    assert plain.kept == 0
    plain.to_host(model)
    assert not in_arena(model.embed.weight) and model.head.weight is model.embed.weight


# -- real devices ------------------------------------------------------------------------------------------

@pytest.fixture
def real_gpus(overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    monkeypatch.delenv("OVERMIND_FAKE_GPUS", raising=False)
    monkeypatch.setenv("OVERMIND_GPU_RESERVE", "1")
    client = Client(overmind_home, role="test")
    yield client
    client.close()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_place_moves_the_model_and_accounting_matches_mem_get_info(real_gpus: Client) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(5)])  # 1.25 GiB of fp32
    need = units.units_for(model)
    assert need == 2
    torch.cuda.init()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info(0)
    assert units.place(model, "cuda:0") == "cuda:0"
    assert all(p.device.type == "cuda" for p in model.parameters())
    free_after, _ = torch.cuda.mem_get_info(0)
    taken = free_before - free_after
    assert 1.2 * GiB < taken <= need * GiB, "the units cover what the model took on the device"
    state = units.state()
    dev = next(d for d in state["devices"] if d["here"] == "cuda:0")
    reported = torch.cuda.get_device_properties(0).total_memory
    assert abs(reported - total) < GiB and dev["total_bytes"] == reported
    assert not dev["simulated"] and dev["capacity"] == (reported - GiB) // GiB, "whole GiB after the reserve"
    context, placed = dev["holders"]
    assert context["context"] and context["mine"] and context["units"] == CONTEXT_UNITS
    assert placed["mine"] and placed["units"] == need and dev["used"] == need + CONTEXT_UNITS
    units.release(model)  # the release empties the allocator's cache (Note [Cached blocks of a released device])
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.cuda.mem_get_info(0)[0] >= free_after + 1.2 * GiB, "the device has the memory back"
    released = [e for e in units.state()["kernel"]["events"] if e["event"] == "released"][-1]
    assert released["freed_cache_bytes"] >= 1.2 * GiB
    holders_left = next(d for d in units.state()["devices"] if d["here"] == "cuda:0")["holders"]
    assert [h["context"] for h in holders_left] == [True], "the kernel's context stays counted"


@pytest.mark.gpu
def test_gpu_a_cuda_context_fits_its_units(real_gpus: Client) -> None:
    """Note [Context units]: another process's CUDA context, cuBLAS ready, as `mem_get_info` sees it."""
    torch.zeros(1, device="cuda:0")
    before = torch.cuda.mem_get_info(0)[0]
    other = start_py("""
        import sys, torch
        a = torch.ones(64, 64, device="cuda:0")
        print((a @ a).sum().item(), flush=True)
        sys.stdin.read()
    """)
    try:
        assert other.stdout.readline().strip() == "262144.0", other.stderr.read() if other.poll() else ""
        taken = before - torch.cuda.mem_get_info(0)[0]
    finally:
        other.kill()
        other.wait()
    assert 0 < taken <= CONTEXT_UNITS * GiB, f"a context took {taken / 2**20:.0f} MiB"


@pytest.mark.gpu
def test_gpu_eviction_moves_back_without_copies_when_unchanged(overmind_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                               real_gpus: Client) -> None:
    """torch's own move and its way back (the copier's fills are tests/test_copier.py's: its CUDA context
    and device copy would hold units this test grants to a peer)."""
    monkeypatch.setenv("OVERMIND_DEVICE_COPIER", "off")  # read at each move: no copier started, no notice
    model = arena_backed("mlp")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    units.place(model, "cuda:0")
    with units.using(model):
        out = model(torch.randn(2, 256, device="cuda:0"))
    assert out.device.type == "cuda"
    dev_id = next(d for d in units.state()["devices"] if d["here"] == "cuda:0")
    capacity = dev_id["capacity"] - CONTEXT_UNITS  # all but this kernel's context
    grant = real_gpus.request("units_acquire", units=capacity, devices=[dev_id["id"]], timeout_s=10)
    assert grant["units"] == capacity
    wait_until(lambda: units.device_of(model) is None, 5)
    assert all(p.device.type == "cpu" and in_arena(p) for p in model.parameters()), "no device-to-host copy"
    released = [e for e in units.state()["kernel"]["events"] if e["event"] == "asked"][-1]
    assert released["reused"] == 4 and released["copied"] == 0
    real_gpus.request("units_release", holding=grant["holding"])
    with units.using(model), torch.no_grad():  # placed again; a fine-tuning step writes on the device
        model.layers[0].weight.mul_(2)
    units.release(model)
    assert torch.equal(model.layers[0].weight, expected["layers.0.weight"] * 2)
    assert not in_arena(model.layers[0].weight) and in_arena(model.layers[1].weight)
