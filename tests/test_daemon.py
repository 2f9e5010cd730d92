"""The daemon as a process: lifecycle, wire robustness, peers, budget, single flight, leases."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel_server import Client, arena, lifecycle
from kernel_server.errors import BudgetExceeded, DaemonUnavailable, RemoteError, StateDirError
from kernel_server.protocol import HEADER, MAGIC, MAX_PAYLOAD, PROTOCOL_VERSION, FrameKind, encode
from kernel_server.transport import recv_frame, send_frame
from tests.helpers.snippets import last_json, run_py, start_py

PAGE = arena.PAGE


def publish(client: Client, key: str, nbytes: int, *, fill: int = 1, deps: list[str] | None = None) -> None:
    """Look up `key` (a miss), then publish an arena of `nbytes` filled with `fill`."""
    reply = client.request("lookup", key=key, wait=False)
    assert reply["status"] == "load", reply.payload
    graph = arena.ArenaWriter(16)
    graph.view[:] = b"g" * 16
    data = arena.ArenaWriter(nbytes)
    data.view[:] = bytes([fill]) * nbytes
    client.request("reserve", key=key, bytes=nbytes + 16)
    client.request("publish", key=key, fds=[graph.seal(), data.seal()], graph_bytes=16, arena_bytes=nbytes,
                   meta={"label": key}, deps=deps or [])
    graph.close()
    data.close()


def entry_keys(client: Client) -> list[str]:
    return [e["key"] for e in client.request("ls")["entries"]]


# -- lifecycle ----------------------------------------------------------------------------------------

def test_client_starts_one_detached_daemon_and_cli_stops_it(overmind_home: Path) -> None:
    clients = []
    errors = []

    def connect() -> None:
        try:
            clients.append(Client(overmind_home))
        except Exception as exc:  # noqa: BLE001 (collected and asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=connect) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pids = {c.daemon_pid for c in clients}
    assert len(pids) == 1, "racing clients must end up at a single daemon"
    pid = pids.pop()
    assert os.getsid(pid) != os.getsid(0), "the daemon runs in its own session, detached from the kernel"
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps, "the daemon never imports torch"
    assert stat.S_IMODE(os.stat(overmind_home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(overmind_home / "daemon.sock").st_mode) == 0o600
    assert "serving at" in (overmind_home / "daemon.log").read_text()
    for c in clients:
        c.close()
    cli = subprocess.run([sys.executable, "-m", "kernel_server", "stop"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert cli.returncode == 0, cli.stderr
    assert f"stopped daemon pid {pid}" in cli.stdout
    assert lifecycle.process_gone(pid)
    assert not (overmind_home / "daemon.sock").exists()


def test_cli_starts_saying_its_bad_settings_and_stops_a_daemon_that_does_not_answer(overmind_home: Path) -> None:
    """`start` detaches the daemon, whose warnings go to its log: a bad setting is said in the terminal too.
    `stop` ends a daemon that cannot answer (stopped with SIGSTOP) by its pid, and takes `10s` as a wait."""
    env = {**os.environ, "OVERMIND_BUDGET": "40 GB of it"}
    started = subprocess.run([sys.executable, "-m", "kernel_server", "start"], capture_output=True, text=True,
                             timeout=60, check=False, env=env)
    assert started.returncode == 0, started.stderr
    assert "OVERMIND_BUDGET='40 GB of it' is not a size" in started.stderr and "using the default" in started.stderr
    pid = lifecycle.daemon_pid(overmind_home)
    assert pid is not None and f"daemon pid {pid} serves" in started.stdout
    again = subprocess.run([sys.executable, "-m", "kernel_server", "start"], capture_output=True, text=True,
                           timeout=60, check=False, env=env)
    assert "already (with the settings it started with" in again.stdout and again.stderr == "", again
    os.kill(pid, signal.SIGSTOP)
    try:
        cli = subprocess.run([sys.executable, "-m", "kernel_server", "stop", "--timeout", "10s"], capture_output=True,
                             text=True, timeout=60, check=False)
        assert cli.returncode == 0, cli.stderr
        assert f"sending pid {pid} SIGCONT and SIGTERM" in cli.stderr and f"stopped daemon pid {pid}" in cli.stdout
        assert lifecycle.process_gone(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_state_dir_under_a_file_or_naming_one_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").touch()
    for home, said in ((tmp_path / "afile", "is not a directory"), (tmp_path / "afile" / "sub", "a path above it "
                                                                     "is a file")):
        monkeypatch.setenv("OVERMIND_HOME", str(home))
        for create in (True, False):
            with pytest.raises(StateDirError, match=said):
                lifecycle.state_dir(create=create)


# A kernel where the daemon cannot start: how `%overmind on` (api.start) and a load say why.
UNSTARTABLE = """
    import json, warnings
    from overmind_jupyter import api, loading
    from tests.helpers import tiny_modules
    said = api.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loading.cached(tiny_modules.build, "mlp", 1)
    print(json.dumps({"said": said, "calls": loading.calls(), "warnings": [str(w.message) for w in caught]}))
"""


def test_a_state_dir_that_takes_no_files_makes_loads_run_plainly_saying_why(overmind_home: Path) -> None:
    """Where the daemon's files cannot be made in the state directory (a read-only or full filesystem; here,
    as root too, a directory by the file's name), `%overmind on` and the load say which file, why and what to
    do, and the load runs plainly; `overmind-daemon start` says it without a traceback, and so does the
    daemon in the foreground, for its lock file and its socket alike."""
    (overmind_home / "daemon.log").mkdir()
    out = last_json(run_py(UNSTARTABLE))
    reason = f"cannot open the daemon's log daemon.log in the state directory {overmind_home}: Is a directory"
    assert reason in out["said"] and "set OVERMIND_HOME" in out["said"], out
    assert out["calls"] == {"plain": 1} and any(reason in w for w in out["warnings"]), out
    for run, named in ((["start"], "log daemon.log"), (["start", "--foreground"], "lock file daemon.lock"),
                       (["start", "--foreground"], "socket daemon.sock")):
        (overmind_home / named.split()[-1]).mkdir(exist_ok=True)
        cli = subprocess.run([sys.executable, "-m", "kernel_server", *run], capture_output=True, text=True,
                             timeout=30, check=False)
        assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr
        assert f"overmind-daemon: cannot open the daemon's {named} in the state directory" in cli.stderr \
            or f"overmind-daemon: cannot create the daemon's {named}" in cli.stderr, cli.stderr
        (overmind_home / named.split()[-1]).rmdir()


def test_a_daemon_that_exits_without_a_word_says_how_to_see_why(overmind_home: Path) -> None:
    quiet = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])  # as a daemon that could not log
    with pytest.raises(DaemonUnavailable, match=r"exited with status 1 while starting; it wrote nothing to its log "
                       r".*: run `overmind-daemon start --foreground` in a terminal to see the error"):
        lifecycle.wait_for_socket(overmind_home, quiet, 10)


def test_a_state_dir_on_a_full_filesystem_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon cannot write its pid, nor then its error, on a full filesystem: the kernel's message says the
    filesystem is full (a 1 MiB tmpfs mounted for the test, as root), and the daemon in the foreground which file
    it could not write."""
    disk = tmp_path / "full"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=700", "tmpfs", str(disk)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("mounting a small filesystem needs root (CI runs as root)")
    try:
        (disk / "home").mkdir(mode=0o700)
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
            while f.write(b"\0" * (64 << 10)):
                pass
        monkeypatch.setenv("OVERMIND_HOME", str(disk / "home"))
        with pytest.raises(DaemonUnavailable, match=r"it wrote nothing to its log .*, whose filesystem has no free "
                           r"space left: free some space there"):
            Client(disk / "home", timeout=30)
        cli = subprocess.run([sys.executable, "-m", "kernel_server", "start", "--foreground"], capture_output=True,
                             text=True, timeout=30, check=False)
        assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr
        assert "cannot write the daemon's pid into daemon.lock in the state directory" in cli.stderr, cli.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_cli_status_ls_evict_json(daemon: Client, overmind_home: Path) -> None:
    publish(daemon, "k" * 64, 2 * PAGE)
    env = dict(os.environ)
    status = run_py("from kernel_server.cli import main; main(['status', '--json'])", env=env)

    doc = json.loads(status.stdout)
    assert doc["running"] and doc["used"] == 2 * PAGE + 16 and doc["daemon"]["pid"] == daemon.daemon_pid
    listing = json.loads(run_py("from kernel_server.cli import main; main(['ls', '--json'])", env=env).stdout)
    assert [e["key"] for e in listing["entries"]] == ["k" * 64]
    text = subprocess.run([sys.executable, "-m", "kernel_server", "ls"], capture_output=True, text=True,
                          check=True).stdout
    assert "kkkkkkkkkkkkkkkk" in text and "8.0 KiB" in text
    text = subprocess.run([sys.executable, "-m", "kernel_server", "status"], capture_output=True, text=True,
                          check=True).stdout
    assert "(1 entry; " in text and "kernels 1 connected" in text and "(cli;" not in text, "the command is no kernel"
    # refused; nothing evicted or stopped
    for wrong, said in ((["evict", "kkkk", "--all"], "not both"), (["stop", "--timeout", "-1"], "not a duration"),
                        (["stop", "--timeout", "ten"], "'ten' is not a duration")):
        refused = subprocess.run([sys.executable, "-m", "kernel_server", *wrong], capture_output=True, text=True,
                                 check=False)
        assert refused.returncode == 2 and said in refused.stderr and "_" not in refused.stderr, refused
    assert entry_keys(daemon) == ["k" * 64] and daemon.request("ping")["pong"]
    out = subprocess.run([sys.executable, "-m", "kernel_server", "evict", "kkkk", "--json"], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == {"evicted": ["k" * 64]}
    assert entry_keys(daemon) == []
    for command in (["ls"], ["status"], ["status", "--json"]):  # the reader gone before the output: no traceback
        piped = subprocess.run(f"{shlex.quote(sys.executable)} -m kernel_server {' '.join(command)} | true", shell=True,
                               capture_output=True, text=True, check=True)
        assert piped.stderr == "", piped.stderr
    # `stop --timeout 0` asks and does not wait: no failure, no SIGKILL advice (Note [Stop without waiting])
    pid = daemon.daemon_pid
    stop = subprocess.run([sys.executable, "-m", "kernel_server", "stop", "--timeout", "0"], capture_output=True,
                          text=True, timeout=30, check=False)
    assert stop.returncode == 0 and stop.stderr == "", stop
    assert stop.stdout in (f"stopped daemon pid {pid}\n", f"asked daemon pid {pid} to stop, without waiting for it "
                           "(--timeout 0): it exits once its clients' requests end; `overmind-daemon status` says "
                           "when it has\n"), stop.stdout
    deadline = time.monotonic() + 10
    while not lifecycle.process_gone(pid):
        assert time.monotonic() < deadline, "the daemon asked to stop did not exit"
        time.sleep(0.02)


def test_the_commands_without_a_daemon_say_so_and_succeed(overmind_home: Path) -> None:
    """Without a daemon nothing is cached: `ls` lists nothing (its JSON has the listing's shape) and exits
    0, as `status` and `evict` do; none of them starts one. (`ls` exited 1, and its JSON was the status's.)"""
    def run(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kernel_server", *command], capture_output=True, text=True,
                              check=False, timeout=60)

    listed, as_json, status, evicted = run("ls"), run("ls", "--json"), run("status"), run("evict", "--all")
    assert [p.returncode for p in (listed, as_json, status, evicted)] == [0, 0, 0, 0], (listed, as_json)
    assert listed.stdout == f"no daemon runs at {overmind_home}: nothing cached\n", listed.stdout
    assert json.loads(as_json.stdout) == {"entries": [], "total": 0}, as_json.stdout
    assert status.stdout == f"no daemon runs at {overmind_home}\n"
    assert not lifecycle.running(overmind_home)


def test_state_dir_refuses_symlink_and_open_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setenv("OVERMIND_HOME", str(link))
    with pytest.raises(StateDirError, match="symbolic link"):
        lifecycle.state_dir()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    monkeypatch.setenv("OVERMIND_HOME", str(open_dir))
    with pytest.raises(StateDirError, match="chmod 700"):
        lifecycle.state_dir()
    monkeypatch.setenv("OVERMIND_HOME", str(tmp_path / "new"))
    assert stat.S_IMODE(os.stat(lifecycle.state_dir()).st_mode) == 0o700


def test_default_state_dir_is_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OVERMIND_HOME", raising=False)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert lifecycle.state_dir() == runtime / "overmind"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert lifecycle.state_dir() == tmp_path / "home" / ".cache" / "overmind"


# -- wire -------------------------------------------------------------------------------------------

def raw_connection(home: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(home / "daemon.sock"))
    sock.settimeout(10)
    return sock


def test_protocol_mismatch_says_what_to_do(daemon: Client, overmind_home: Path) -> None:
    sock = raw_connection(overmind_home)
    send_frame(sock, FrameKind.REQUEST, {"op": "hello", "id": 1, "protocol": PROTOCOL_VERSION + 1})
    frame = recv_frame(sock)
    assert frame is not None and not frame.payload["ok"]
    assert frame.payload["error"]["code"] == "protocol_mismatch"
    assert "overmind-daemon stop" in frame.payload["error"]["message"]
    sock.close()


def test_requests_before_hello_and_unknown_ops_get_errors(daemon: Client, overmind_home: Path) -> None:
    sock = raw_connection(overmind_home)
    send_frame(sock, FrameKind.REQUEST, {"op": "ls", "id": 1})
    assert recv_frame(sock).payload["error"]["code"] == "no_hello"
    send_frame(sock, FrameKind.REQUEST, {"op": "hello", "id": 2, "protocol": PROTOCOL_VERSION})
    assert recv_frame(sock).payload["ok"]
    send_frame(sock, FrameKind.REQUEST, {"op": "format_disk", "id": 3})
    reply = recv_frame(sock).payload
    assert reply["error"]["code"] == "unknown_op" and "lookup" in reply["error"]["message"]
    sock.close()


def _garbage_frame(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randrange(1, 64))
    if kind == 1:  # truncated valid frame
        frame = encode(FrameKind.REQUEST, {"op": "ls", "id": rng.randrange(100)})
        return frame[: rng.randrange(1, len(frame))]
    if kind == 2:  # oversized length
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, 1, 0, MAX_PAYLOAD + rng.randrange(1, 1 << 20))
    if kind == 3:  # valid header, payload not JSON
        body = rng.randbytes(rng.randrange(1, 40))
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, 1, 0, len(body)) + body
    if kind == 4:  # JSON of the wrong shapes
        body = rng.choice([b"[1,2]", b'"x"', b'{"op": 5, "id": "a"}', b'{"op": "lookup", "id": 1, "key": 7}',
                           b'{"op": "reserve", "id": 1, "key": "a", "bytes": -1}', b"{}"])
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.choice([1, 2, 3, 9]), 0, len(body)) + body
    body = b'{"op":"ping","id":1}'  # a header announcing descriptors that never come
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 1, 3, len(body)) + body


def test_fuzzed_frames_leave_the_daemon_answering(daemon: Client, overmind_home: Path) -> None:
    rng = random.Random(1234)
    publish(daemon, "survivor", PAGE)
    sent = 0
    while sent < 1000:
        sock = raw_connection(overmind_home)
        sock.settimeout(2)
        try:
            if rng.random() < 0.5:
                send_frame(sock, FrameKind.REQUEST, {"op": "hello", "id": 0, "protocol": PROTOCOL_VERSION})
                recv_frame(sock)
            for _ in range(rng.randrange(1, 10)):
                sock.sendall(_garbage_frame(rng))
                sent += 1
        except OSError:
            pass  # the daemon may close a connection whose stream it cannot delimit
        finally:
            sock.close()
    assert daemon.request("ping")["pong"] > 0
    assert entry_keys(daemon) == ["survivor"]
    fresh = Client(overmind_home)
    assert fresh.daemon_pid == daemon.daemon_pid
    fresh.close()


class _ClosedAfterHeader(socket.socket):
    """A socket that another thread closes right after the reader took a frame's header: a client's
    `close()` racing its reader thread, made to happen every time."""

    def recvmsg(self, *args: int) -> tuple[bytes, list[tuple[int, int, bytes]], int, object]:
        got = super().recvmsg(*args)
        self.close()
        return got


def test_a_socket_closed_inside_a_frame_is_a_read_error() -> None:
    """The client's reader thread ("overmind-client") had read a frame's header when another thread
    closed the client: waiting for the body, poll was handed descriptor -1 and raised ValueError, which
    the reader does not take for the stream's end (OSError), and the thread died printing a traceback
    (each of three runs of the suite showed it once). Now the read raises OSError, as a read of a closed
    socket does."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader = _ClosedAfterHeader(socket.AF_UNIX, socket.SOCK_STREAM, fileno=a.detach())
    try:
        send_frame(b, FrameKind.REPLY, {"id": 1, "ok": True})
        with pytest.raises(OSError):
            recv_frame(reader, stall=5.0)
        assert reader.fileno() == -1
    finally:
        reader.close()
        b.close()


def test_client_of_another_uid_is_refused(daemon: Client, overmind_home: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("switching to another uid needs root")
    # Open the way to the socket, so that only the daemon's SO_PEERCRED check stands in between.
    os.chmod(overmind_home, 0o711)
    os.chmod(overmind_home / "daemon.sock", 0o666)
    code = f"""
import json, socket, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from kernel_server.protocol import FrameKind, PROTOCOL_VERSION
from kernel_server.transport import recv_frame, send_frame
s = socket.socket(socket.AF_UNIX); s.connect({str(overmind_home / "daemon.sock")!r})
s.settimeout(10)
f = recv_frame(s)  # the daemon answers a foreign uid before it sends anything
print(json.dumps(f.payload if f else None))
"""
    proc = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c",
                           code], capture_output=True, text=True, timeout=30, cwd="/", check=False)
    if "Permission denied" in proc.stderr and "python3" in proc.stderr:
        pytest.skip("the system python cannot run as nobody here")
    assert proc.returncode == 0, proc.stderr
    assert '"refused"' in proc.stdout and "serves uid 0 only" in proc.stdout
    assert "refused pid" in (overmind_home / "daemon.log").read_text()
    assert daemon.request("ping")["pong"]


# -- store ------------------------------------------------------------------------------------------

ENTRY = 4 * PAGE + 16  # what an entry of `three_entries` takes of the budget (its graph too)


@pytest.fixture
def three_entries(overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    """A store whose budget holds three entries, holding "a", "b" and "c", none in use."""
    monkeypatch.setenv("OVERMIND_BUDGET", str(3 * ENTRY))
    client = Client(overmind_home)
    try:
        for key in ("a", "b", "c"):
            publish(client, key, 4 * PAGE)
        yield client
    finally:
        client.close()


def test_budget_evicts_lru_unpinned_and_is_never_exceeded(three_entries: Client) -> None:
    client = three_entries
    hit = client.request("lookup", key="a", wait=False)  # a: pinned and most recent
    assert hit["status"] == "hit"
    hit.close()
    publish(client, "d", 4 * PAGE)
    assert sorted(entry_keys(client)) == ["a", "c", "d"], "b was the least recently used unpinned entry"
    status = client.request("status")
    assert status["used"] <= status["budget"]
    with pytest.raises(BudgetExceeded, match="OVERMIND_BUDGET"):
        client.request("lookup", key="huge", wait=False)
        client.request("reserve", key="huge", bytes=10 * ENTRY)
    client.request("abandon", key="huge")
    # Everything else pinned: no room is made by evicting pinned entries.
    for key in ("c", "d"):
        client.request("lookup", key=key, wait=False).close()
    client.request("lookup", key="e", wait=False)
    with pytest.raises(BudgetExceeded, match="held by entries that kernels use"):
        client.request("reserve", key="e", bytes=ENTRY)
    assert client.request("status")["used"] <= 3 * ENTRY


def test_a_load_that_cannot_fit_evicts_nothing_for_it(three_entries: Client) -> None:
    """A reservation that would not fit with every unused entry evicted is refused before any is: the
    unused entries stay cached. One that fits once they are gone still evicts them."""
    client = three_entries
    for key in ("a", "b"):  # in use: pinned
        client.request("lookup", key=key, wait=False).close()
    assert client.request("lookup", key="e", wait=False)["status"] == "load"
    with pytest.raises(BudgetExceeded, match="held by entries that kernels use"):
        client.request("reserve", key="e", bytes=2 * ENTRY)
    assert sorted(entry_keys(client)) == ["a", "b", "c"], "c was evicted for a load that could never fit"
    assert client.request("reserve", key="e", bytes=ENTRY)["evicted"] == ["c"]
    assert sorted(entry_keys(client)) == ["a", "b"]
    # the load's own reservation is not another load's
    with pytest.raises(BudgetExceeded) as refused:
        client.request("reserve", key="e", bytes=2 * ENTRY)
    assert "use now; free models" in str(refused.value) and "other loads" not in str(refused.value), refused.value


def test_a_reservation_ahead_of_need_evicts_nothing(three_entries: Client) -> None:
    """Note [Reserving ahead] in store.py: a reserve with `evict` false is refused where it would evict, and
    evicts nothing; what fits beside the entries is granted; the same reserve that may evict does."""
    client = three_entries
    assert client.request("lookup", key="e", wait=False)["status"] == "load"
    with pytest.raises(BudgetExceeded, match="without evicting"):
        client.request("reserve", key="e", bytes=ENTRY, evict=False)
    assert sorted(entry_keys(client)) == ["a", "b", "c"] and "evicted" not in client.request("status")["stats"]
    assert client.request("reserve", key="e", bytes=ENTRY)["evicted"] == ["a"]
    assert client.request("reserve", key="e", bytes=1, evict=False)["evicted"] == []  # less than it holds

def test_a_publish_reserves_what_its_load_did_not(overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Reserved at publish] in store.py: a publish with no reservation before it is reserved then,
    evicting the least recently used entry as `reserve` would, and refused as `reserve` would when the
    budget cannot hold it; the refused load can still be abandoned, and the budget is never exceeded."""
    entry = 4 * PAGE + 16
    monkeypatch.setenv("OVERMIND_BUDGET", str(3 * entry))
    client = Client(overmind_home)

    def publish_unreserved(key: str, nbytes: int) -> None:
        assert client.request("lookup", key=key, wait=False)["status"] == "load"
        graph, data = arena.ArenaWriter(16), arena.ArenaWriter(nbytes)
        try:
            graph.view[:] = b"g" * 16
            client.request("publish", key=key, fds=[graph.seal(), data.seal()], graph_bytes=16, arena_bytes=nbytes,
                           meta={"label": key}, deps=[])
        finally:
            graph.close()
            data.close()

    try:
        for key in ("a", "b", "c"):
            publish_unreserved(key, 4 * PAGE)
        client.request("lookup", key="a", wait=False).close()  # a: the most recently used
        publish_unreserved("d", 4 * PAGE)
        assert sorted(entry_keys(client)) == ["a", "c", "d"], "b was the least recently used entry"
        with pytest.raises(BudgetExceeded, match="OVERMIND_BUDGET"):
            publish_unreserved("huge", 10 * entry)
        client.request("abandon", key="huge")
        status = client.request("status")
        assert status["used"] <= status["budget"] and "huge" not in entry_keys(client)
    finally:
        client.close()


def test_evicting_a_base_evicts_what_is_built_on_it(daemon: Client) -> None:
    publish(daemon, "base", 2 * PAGE)
    publish(daemon, "adapter", PAGE, deps=["base"])
    hit = daemon.request("lookup", key="adapter", wait=False)
    assert [e["key"] for e in hit["entries"]] == ["adapter", "base"] and len(hit.fds) == 3
    hit.close()
    daemon.request("evict", key="base")
    assert entry_keys(daemon) == []


def test_single_flight_second_kernel_waits_for_the_first(daemon: Client, overmind_home: Path) -> None:
    other = Client(overmind_home)
    try:
        assert daemon.request("lookup", key="model", wait=False)["status"] == "load"
        request_id, waiting = other.submit("lookup", key="model", wait=True)
        time.sleep(0.2)
        assert not waiting.done(), "the second kernel waits instead of loading again"
        assert other.request("lookup", key="model", wait=False)["status"] == "busy"
        graph, data = arena.ArenaWriter(8), arena.ArenaWriter(PAGE)
        daemon.request("reserve", key="model", bytes=PAGE + 8)
        daemon.request("publish", key="model", fds=[graph.seal(), data.seal()], graph_bytes=8, arena_bytes=PAGE)
        reply = other.wait(request_id, waiting, 10)
        assert reply["status"] == "hit"
        reply.close()
        status = daemon.request("status")
        assert status["stats"]["misses"] == 1, "one load for two kernels"
        assert status["stats"]["hits"] == 1 and status["stats"]["waits"] == 1
    finally:
        other.close()


def test_loader_that_dies_hands_the_load_to_a_waiter(daemon: Client, overmind_home: Path) -> None:
    loader = start_py("""
        import sys
        from kernel_server import Client
        c = Client()
        print(c.request("lookup", key="model", wait=False)["status"], flush=True)
        sys.stdin.read()
    """)
    assert loader.stdout.readline().strip() == "load"
    request_id, waiting = daemon.submit("lookup", key="model", wait=True)
    time.sleep(0.1)
    assert not waiting.done()
    loader.send_signal(signal.SIGKILL)
    loader.wait()
    reply = daemon.wait(request_id, waiting, 1.0)
    assert reply["status"] == "load", "the waiter becomes the loader within a second"


def test_sigkilled_client_frees_pins_reservations_and_loads_within_1s(daemon: Client) -> None:
    publish(daemon, "pinned", 2 * PAGE)
    victim = start_py("""
        import sys
        from kernel_server import Client
        c = Client()
        hit = c.request("lookup", key="pinned", wait=False)
        assert hit["status"] == "hit"
        assert c.request("lookup", key="loading", wait=False)["status"] == "load"
        c.request("reserve", key="loading", bytes=8192)
        print("ready", flush=True)
        sys.stdin.read()
    """)
    assert victim.stdout.readline().strip() == "ready"
    status = daemon.request("status")
    entry = status["entries"][0]
    assert entry["pinned_by"] and status["reserved"] == 8192 and status["loading"]
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    victim.wait()
    while True:
        status = daemon.request("status")
        if not status["entries"][0]["pinned_by"] and not status["reserved"] and not status["loading"]:
            break
        assert time.monotonic() - killed < 1.0, f"leases still held after 1 s: {status}"
        time.sleep(0.01)


def test_publish_refuses_unsealed_or_mislabelled_arenas(daemon: Client) -> None:
    assert daemon.request("lookup", key="x", wait=False)["status"] == "load"
    daemon.request("reserve", key="x", bytes=2 * PAGE)
    unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, PAGE)
    graph = arena.ArenaWriter(8)
    with pytest.raises(RemoteError, match="not sealed"):
        daemon.request("publish", key="x", fds=[graph.seal(), unsealed], graph_bytes=8, arena_bytes=PAGE)
    data = arena.ArenaWriter(PAGE)
    graph2 = arena.ArenaWriter(8)
    with pytest.raises(RemoteError, match="announced"):
        daemon.request("publish", key="x", fds=[graph2.seal(), data.seal()], graph_bytes=8, arena_bytes=2 * PAGE)
    for w in (graph, graph2, data):
        w.close()
    os.close(unsealed)
    assert entry_keys(daemon) == []


def test_sealed_arena_cannot_be_written_shared() -> None:
    writer = arena.ArenaWriter(PAGE)
    writer.view[:4] = b"abcd"
    fd = writer.seal()
    import mmap

    with pytest.raises(PermissionError):
        mmap.mmap(fd, PAGE, flags=mmap.MAP_SHARED)
    private = arena.map_private(fd, PAGE)
    private[:4] = b"WXYZ"
    assert bytes(arena.map_private(fd, PAGE)[:4]) == b"abcd", "a private write is never seen by another mapping"
    writer.close()


def test_daemon_gone_makes_the_client_fail_fast(daemon: Client, overmind_home: Path) -> None:
    os.kill(daemon.daemon_pid, signal.SIGKILL)
    with pytest.raises(DaemonUnavailable):
        for _ in range(100):
            daemon.request("ping", timeout=5)
            time.sleep(0.01)
    fresh = Client(overmind_home)  # a new daemon takes over the stale socket
    assert fresh.daemon_pid != daemon.daemon_pid
    fresh.close()
