"""The daemon never runs out of file descriptors (Note [Descriptor budget] in kernel_server/descriptors.py).

Real daemons, started the way a kernel starts one but under a lowered RLIMIT_NOFILE, and real kernel
processes (tests/descriptors_worker.py) that load through the cached call. Nothing is mocked: the
shortages are the kernel's own EMFILE and MSG_CTRUNC.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch

from kernel_server import Client, arena, descriptors, lifecycle
from kernel_server.errors import DescriptorsExhausted
from overmind_jupyter import loading
from overmind_jupyter.errors import FallbackWarning
from tests.helpers import tiny_modules
from tests.helpers.faults_helpers import daemon_fds, daemon_log, daemon_pid, digest, wait_until
from tests.helpers.snippets import run_py

# Run the daemon's starter with RLIMIT_NOFILE set (no preexec_fn: the test process has threads).
_LIMITED = ("import os, resource, sys; soft, hard = int(sys.argv[1]), int(sys.argv[2]); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)); "
            "os.execv(sys.executable, [sys.executable, '-m', 'kernel_server', 'start', '--daemonize'])")


def start_daemon(home: Path, soft: int, hard: int, **env: str) -> int:
    """Start the daemon of `home` as a client would, with RLIMIT_NOFILE (soft, hard); returns its pid."""
    with open(lifecycle.log_path(home), "ab") as log:
        proc = subprocess.run([sys.executable, "-c", _LIMITED, str(soft), str(hard)],
                              env=dict(os.environ, OVERMIND_HOME=str(home), **env), stdin=subprocess.DEVNULL,
                              stdout=log, stderr=log, cwd=str(home), timeout=60, check=False)
    assert proc.returncode == 0, daemon_log(home)[-3000:]
    pid = daemon_pid(home)
    assert pid is not None
    return pid


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open files limit in /proc/{pid}/limits")


def test_the_daemon_raises_its_soft_limit_to_the_hard_limit(overmind_home: Path) -> None:
    pid = start_daemon(overmind_home, 256, 4096)
    assert open_files_limit(pid) == (4096, 4096)
    with Client(overmind_home, role="test") as client:
        assert client.daemon_pid == pid
        fds = client.request("status")["descriptors"]
    assert fds["limit"] == 4096 and fds["cap"] == 4096 - 4096 // 4 - 4 * fds["connections"]
    assert fds["entries"] == 0 and 0 < fds["open"] < 64
    assert "descriptor limit raised from 256 to 4096" in daemon_log(overmind_home)
    cli = subprocess.run([sys.executable, "-m", "kernel_server", "status"], env=dict(os.environ),
                         capture_output=True, text=True, timeout=60, check=True)
    assert "open of the limit 4096" in cli.stdout, cli.stdout


# -- the big one: four kernels, 3,000 entries, 256 descriptors -------------------------------------------------

class Pinger(threading.Thread):
    """Pings the daemon through its own connection every 20 ms; records the slowest answer and, every
    tenth ping, how many descriptors the daemon had open and how many entries referred to a checkpoint
    file (held a descriptor of it)."""

    def __init__(self, home: Path, pid: int) -> None:
        super().__init__(name="ping-sampler", daemon=True)
        self.client = Client(home, role="test", label="ping sampler")
        self.pid = pid
        self.stop = threading.Event()
        self.pings = 0
        self.slowest = 0.0
        self.max_open = 0
        self.max_with_sources = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.wait(0.02):
                started = time.monotonic()
                self.client.request("ping", timeout=30)
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.pings += 1
                if self.pings % 10 == 0:
                    self.max_open = max(self.max_open, daemon_fds(self.pid))
                    entries = self.client.request("status", timeout=30)["entries"]
                    self.max_with_sources = max(self.max_with_sources, sum(bool(e["pending"]) for e in entries))
        except BaseException as exc:  # noqa: BLE001 (asserted by the test)
            self.failure = exc

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        self.client.close()


def test_four_kernels_make_3000_entries_under_256_descriptors(overmind_home: Path, tmp_path: Path) -> None:
    limit, workers, entries = 256, 4, 750
    pid = start_daemon(overmind_home, limit, limit, OVERMIND_FAKE_GPUS="2x16")
    checkpoint = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tiny_modules.build("mlp", seed=7, width=64).state_dict(), str(checkpoint))
    pinger = Pinger(overmind_home, pid)
    pinger.start()
    env = dict(os.environ, OVERMIND_HOME=str(overmind_home), PYTHONFAULTHANDLER="1")
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.descriptors_worker", str(seed), str(entries),
                               str(checkpoint)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in range(workers)]
    results: list[dict[str, Any]] = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0 and out.strip(), f"worker exit {proc.returncode}: {err[-3000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    seconds = time.monotonic() - started
    pinger.finish()
    with Client(overmind_home, role="test") as probe:
        status = probe.request("status")
    open_at_end = daemon_fds(pid)
    stats, fds = status["stats"], status["descriptors"]
    fallbacks: dict[str, int] = {}
    for r in results:
        for kind, n in r["fallbacks"].items():
            fallbacks[kind] = fallbacks.get(kind, 0) + n
    figures = {
        "seconds": round(seconds, 1), "loads": sum(r["loads"] for r in results),
        "hits": sum(r["hits"] for r in results), "published": stats.get("published", 0),
        "evicted": stats.get("evicted", 0), "descriptors_refused": stats.get("descriptors_refused", 0),
        "descriptors_short": stats.get("descriptors_short", 0), "accept_deferred": stats.get("accept_deferred", 0),
        "fallbacks": fallbacks, "errors": status["errors"], "max_ping_s": round(pinger.slowest, 3),
        "pings": pinger.pings, "max_open": pinger.max_open, "open_at_end": open_at_end, "descriptors": fds,
        "max_entries_with_sources": pinger.max_with_sources,
        "reasons": sorted({reason for r in results for reason in r["reasons"]})[:10],
    }
    print(json.dumps(figures, indent=1))  # shown with -s, and on failure

    assert all(r["wrong"] == [] for r in results), "a load returned something other than the plain load's"
    assert status["errors"].get("internal", 0) == 0, "the daemon answered internal"
    assert not any("internal" in reason for r in results for reason in r["reasons"])
    assert all(r["lease_held"] for r in results), "a kernel lost its units lease"
    assert all(r["same_connection"] and r["daemon_pid"] == r["daemon_pid_before"] == pid for r in results), \
        "a kernel's connection was dropped (it reconnected)"
    assert status["daemon"]["pid"] == pid
    assert "Traceback" not in daemon_log(overmind_home), daemon_log(overmind_home)[-3000:]
    assert figures["published"] >= workers * entries, "every distinct load made an entry"
    assert stats.get("evicted", 0) > 0, "the limit was meant to force eviction"
    assert pinger.max_with_sources > 0, "some entries held a descriptor of the checkpoint file"
    assert pinger.failure is None, repr(pinger.failure)
    assert pinger.max_open < limit and open_at_end < limit
    assert fds["entries"] + fds["reserved"] <= fds["cap"]
    assert pinger.slowest < 2.0, "the daemon stopped answering for a while"
    # The only fallbacks a daemon short of descriptors may cause: a refused entry (everything pinned).
    assert set(fallbacks) <= {"descriptors"}, figures["reasons"]


# -- everything pinned ---------------------------------------------------------------------------------------

def test_with_every_entry_pinned_a_new_one_is_refused_and_loads_plainly(overmind_home: Path) -> None:
    start_daemon(overmind_home, 128, 128)
    calls_before = loading.calls()

    def load(seed: int) -> Any:
        model = loading.cached(tiny_modules.build, "mlp", seed=seed, width=4, depth=1)
        assert digest(model) == digest(tiny_modules.build("mlp", seed=seed, width=4, depth=1))
        return model

    # More entries than 128 descriptors hold, every one kept alive (pinned).
    with pytest.warns(FallbackWarning, match="no file descriptors left for a new entry"):
        models = [load(seed) for seed in range(60)]
    refused = [f for f in loading.fallbacks() if f["kind"] == "descriptors"]
    assert refused and len(refused) == len(loading.fallbacks()), loading.fallbacks()[-3:]
    assert "%overmind evict" in refused[0]["reason"] and "ulimit -Hn" in refused[0]["reason"]
    with Client(overmind_home, role="test") as probe:
        status = probe.request("status")
        assert status["errors"].get("internal", 0) == 0
        assert status["stats"]["descriptors_refused"] == len(refused)
        # under the cap as it was before this probe connected (a connection does not evict)
        assert status["descriptors"]["entries"] <= status["descriptors"]["cap"] + descriptors.PER_CONNECTION
        assert all(e["pinned_by"] for e in status["entries"])
        del models
        gc.collect()
        wait_until(lambda: not any(e["pinned_by"] for e in probe.request("status")["entries"]), 30,
                   "the dropped models unpinned their entries")
        misses = loading.calls().get("miss", 0)
        again = load(1000)
        assert loading.calls().get("miss", 0) == misses + 1, "caching works again once entries are unpinned"
        assert again is not None
        assert probe.request("status")["errors"].get("internal", 0) == 0
    assert loading.calls()["miss"] - calls_before.get("miss", 0) == 60 - len(refused) + 1


# -- a full descriptor table ---------------------------------------------------------------------------------

def _sealed(data: bytes) -> arena.ArenaWriter:
    writer = arena.ArenaWriter(len(data))
    if data:
        writer.view[:] = data
    writer.seal()
    return writer


def _fill_table(home: Path, pid: int, limit: int, idle: list[socket.socket], probe: Client) -> None:
    """Connect idle sockets until the daemon holds `limit` descriptors: one at a time, each accepted (as
    the daemon counts its connections) before the next, so that none waits in the backlog, where the
    accept loop would shed entries for it."""
    connections = probe.request("status")["descriptors"]["connections"]
    while daemon_fds(pid) < limit:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(lifecycle.socket_path(home)))
        idle.append(sock)
        expected = connections + len(idle)
        wait_until(lambda n=expected: probe.request("status")["descriptors"]["connections"] == n, 10,
                   f"the daemon accepted connection {len(idle)}; its descriptors: {_fds_of(pid)}; its log: "
                   f"{daemon_log(home)[-2000:]}")


def _fds_of(pid: int) -> dict[str, int]:
    """What the daemon's descriptors are, by kind (for a failure's message)."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}").split(":")[0]
        except OSError:
            continue
        kinds[target] = kinds.get(target, 0) + 1
    return kinds


def _close(idle: list[socket.socket], count: int, pid: int) -> None:
    before = daemon_fds(pid)
    for _ in range(min(count, len(idle))):
        idle.pop().close()
    wait_until(lambda: daemon_fds(pid) <= before - count, 10, "the daemon closed the idle connections")


def test_a_full_descriptor_table_answers_hits_and_publishes_and_keeps_the_connection(
        overmind_home: Path, tmp_path: Path) -> None:
    """The daemon's table filled to its limit by idle connections: a hit (its duplicates fail with EMFILE)
    and a publish (the kernel cannot install its descriptors: MSG_CTRUNC) are answered
    `descriptors_exhausted`; the connection, its pin and its units lease stay. A publish that takes the
    last descriptors is served, and its compaction waits until descriptors are free again."""
    limit = 128
    pid = start_daemon(overmind_home, limit, limit, OVERMIND_FAKE_GPUS="2x16")
    client = Client(overmind_home, role="test")
    client.request("units_register", devices=[])
    lease = client.request("units_acquire", units=1, devices=None, timeout_s=10, label="t", busy=True)["holding"]
    graph, data = _sealed(b"g" * 16), _sealed(b"\1" * arena.PAGE)
    assert client.request("lookup", key="pinned", wait=False)["status"] == "load"
    client.request("reserve", key="pinned", bytes=arena.PAGE + 16)
    client.request("publish", key="pinned", fds=[graph.fd, data.fd], graph_bytes=16, arena_bytes=arena.PAGE, meta={})
    client.request("lookup", key="pinned", wait=False).close()  # a hit: pinned by this connection
    assert client.request("lookup", key="new", wait=False)["status"] == "load"
    client.request("reserve", key="new", bytes=arena.PAGE + 16, descriptors=3)
    source_path = tmp_path / "source.bin"
    source_path.write_bytes(b"\2" * arena.PAGE)
    source = os.open(source_path, os.O_RDONLY)
    described = {"path": str(source_path), **arena.file_identity(os.fstat(source))}

    def publish_new() -> None:  # its arena's page lies in the source file (a pending piece)
        client.request("publish", key="new", fds=[graph.fd, data.fd, source], graph_bytes=16,
                       arena_bytes=arena.PAGE, meta={}, sources=[described], pieces=[[0, arena.PAGE, 0, 0]])

    idle: list[socket.socket] = []
    try:
        _fill_table(overmind_home, pid, limit, idle, client)
        with pytest.raises(DescriptorsExhausted, match="ran out of file descriptors"):
            client.request("lookup", key="pinned", wait=False)
        with pytest.raises(DescriptorsExhausted, match="descriptors arrived"):
            publish_new()
        assert client.request("ping")["pong"] and client.request("status")["daemon"]["pid"] == pid
        _close(idle, 3, pid)
        time.sleep(1.5)  # past the daemon's wait for a connection while its table was full (1 s): it then
        # waits holding no descriptor, so this publish's three fill the table: the compactor finds none
        publish_new()
        wait_until(lambda: "no descriptors free to compact" in daemon_log(overmind_home), 10, "compaction deferred")
        assert client.request("status")["entries"][0]["pending"] is not None
    finally:
        _close(idle, len(idle), pid)
    wait_until(lambda: not any(e["pending"] for e in client.request("status")["entries"]), 60,
               "the entry was compacted once descriptors were free")
    status = client.request("status")
    assert status["errors"].get("internal", 0) == 0 and status["errors"]["descriptors_exhausted"] == 2
    assert status["stats"]["descriptors_short"] == 2 and status["stats"]["compacted"] == 1
    pinned = next(e for e in status["entries"] if e["key"] == "pinned")
    assert [k["conn"] for k in pinned["pinned_by"]] == [client.conn_id]
    assert [h["holding"] for d in status["units"]["devices"] for h in d["holders"]] == [lease]
    for key, fill in (("pinned", b"\1"), ("new", b"\2")):
        hit = client.request("lookup", key=key, wait=False)
        assert hit["status"] == "hit" and len(hit.fds) == 2 and arena.read_all(hit.fds[1]) == fill * arena.PAGE
        hit.close()
    assert client.daemon_pid == pid and not client.closed
    log = daemon_log(overmind_home)
    assert "Traceback" not in log, log[-3000:]
    client.close()
    for fd in (graph.fd, data.fd, source):
        os.close(fd)


def test_a_kernel_loads_plainly_while_the_daemon_has_no_descriptor_free(overmind_home: Path) -> None:
    """The cached call with the daemon's table full: a hit whose descriptors cannot be duplicated and a
    miss whose publish's descriptors cannot arrive (a few KiB copied: the publish reserves, Note [Reserved
    at publish] in kernel_server/store.py) both return the plain load's model, as fallbacks; the kernel's
    connection stays, and caching resumes once descriptors are free."""
    from kernel_server.client import shared_client

    limit = 128
    pid = start_daemon(overmind_home, limit, limit)

    def load(seed: int) -> Any:
        model = loading.cached(tiny_modules.build, "mlp", seed=seed, width=4, depth=1)
        assert digest(model) == digest(tiny_modules.build("mlp", seed=seed, width=4, depth=1))
        return model

    before = loading.calls()

    def calls(kind: str) -> int:
        return loading.calls().get(kind, 0) - before.get(kind, 0)

    kept = load(1)  # an entry this kernel pins: nothing can be evicted to make room below
    conn = shared_client().conn_id
    idle: list[socket.socket] = []
    try:
        _fill_table(overmind_home, pid, limit, idle, shared_client())
        with pytest.warns(FallbackWarning, match="file descriptors"):
            results = [load(1), load(2)]  # a hit that cannot be sent, a miss that cannot be cached
    finally:
        _close(idle, len(idle), pid)
    kinds = [(f["kind"], f["reason"]) for f in loading.fallbacks()]
    assert [k for k, _ in kinds] == ["descriptors", "descriptors"], kinds
    assert "ran out of file descriptors" in kinds[0][1] and "descriptors arrived, and they were lost" in kinds[1][1]
    assert (calls("miss"), calls("plain"), calls("hit")) == (1, 2, 0)
    load(2)
    assert calls("miss") == 2, "caching works again once descriptors are free"
    assert shared_client().conn_id == conn and kept is not None and len(results) == 2
    with Client(overmind_home, role="test") as probe:
        status = probe.request("status")
    assert status["errors"].get("internal", 0) == 0 and status["errors"]["descriptors_exhausted"] == 2
    assert "Traceback" not in daemon_log(overmind_home)


# A kernel whose soft limit is below its hard limit, which keeps the models it loads.
KEPT_UNDER_A_LIMIT = """
    import json, resource, warnings
    from overmind_jupyter import api, loading
    from tests.helpers import tiny_modules
    resource.setrlimit(resource.RLIMIT_NOFILE, (24, 40))
    api.start()
    raised = resource.getrlimit(resource.RLIMIT_NOFILE)
    kept = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(24):
            kept.append(loading.cached(tiny_modules.build, "mlp", seed, width=4, depth=1))
    print(json.dumps({"raised": raised, "calls": loading.calls(), "warnings": [str(w.message) for w in caught]}))
"""


def test_a_kernel_raises_its_soft_limit_and_says_when_its_own_table_is_full(daemon: Client) -> None:
    """Each cached model a kernel holds keeps descriptors open (Note [Descriptor budget]): enabling the cache
    raises the kernel's soft limit to its hard limit, and a kernel that reaches it anyway loads plainly, saying
    that its limit is reached, which it is, and what to do."""
    out = json.loads(run_py(KEPT_UNDER_A_LIMIT).stdout.strip().splitlines()[-1])
    assert out["raised"] == [40, 40], out
    assert out["calls"].get("miss") and out["calls"].get("plain"), out
    advice = "this process reached its limit on open files (soft 40, hard 40), and each cached model it holds"
    assert all(advice in w and "`ulimit -n`" in w for w in out["warnings"] if "Errno 24" in w), out["warnings"]
    assert any(advice in w for w in out["warnings"]), out["warnings"]
