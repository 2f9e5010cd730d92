"""The side panel's server extension: its routes against a real daemon, and its installation.

The routes run in a real Jupyter server (pytest-jupyter's `jp_serverapp`, under a base_url that needs
escaping) talking to a real daemon on the test's OVERMIND_HOME. The installation checks run the same
`jupyter ... list` commands a user would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# The fixtures of pytest-jupyter for this module only (its autouse fixtures then touch no other test).
from pytest_jupyter.jupyter_server import *  # noqa: F403

import overmind_jupyter
from kernel_server import Client, arena, formats
from kernel_server.formats import byte_text, progress_text, saved_figure, seconds_text
from tests.helpers.snippets import last_json, run_py

REPO = Path(__file__).resolve().parent.parent
JUPYTER = [sys.executable, "-m", "jupyter"]


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"overmind_jupyter": True}}}


@pytest.fixture
def fetch(jp_fetch, jp_asyncio_loop, jp_serverapp):
    """`fetch(*path, method=, body=, token=)` -> (status, JSON body), from a synchronous test."""
    # jp_fetch makes its Future in asyncio's current loop, and jp_asyncio_loop returns the loop
    # jupyter_core keeps for this thread without making it current: a test of another file run before
    # in this worker that ended with asyncio.run() (which unsets the current loop) left none.
    asyncio.set_event_loop(jp_asyncio_loop)

    def call(*parts: str, method: str = "GET", body: Any = None, token: bool = True) -> tuple[int, Any]:
        headers = None if token else {"Authorization": "token not-the-token"}
        raw = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
        response = jp_asyncio_loop.run_until_complete(
            jp_fetch(*parts, method=method, body=raw, headers=headers, raise_error=False)
        )
        text = response.body.decode() if response.body else ""
        try:
            return response.code, json.loads(text) if text else None
        except ValueError:
            return response.code, text

    yield call
    jp_serverapp.web_app.settings["overmind_link"].close()


def publish(client: Client, key: str, nbytes: int, label: str) -> None:
    """Put an entry of `nbytes` under `key` into the store, the way a kernel publishes one."""
    assert client.request("lookup", key=key, wait=False)["status"] == "load"
    graph, data = arena.ArenaWriter(16), arena.ArenaWriter(nbytes)
    graph.view[:] = b"g" * 16
    data.view[:] = b"\x01" * nbytes
    client.request("reserve", key=key, bytes=nbytes + 16)
    client.request("publish", key=key, fds=[graph.seal(), data.seal()], graph_bytes=16, arena_bytes=nbytes,
                   meta={"label": label}, deps=[])
    graph.close()
    data.close()


# -- routes -------------------------------------------------------------------------------------------

def test_state_without_a_daemon_is_a_state_logged_at_debug_only(fetch, overmind_home: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        for _ in range(5):  # a panel left open polls
            status, body = fetch("overmind", "state")
            assert status == 200, body
    assert body["state"] == "down" and body["home"] == str(overmind_home)
    assert f"no overmind daemon runs at {overmind_home}" in body["message"]
    assert "%overmind on" in body["message"]
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage() for r in loud]
    assert not (overmind_home / "daemon.sock").exists(), "the server must never start a daemon"
    status, body = fetch("overmind", "evict", method="POST", body={"all": True})
    assert status == 503 and body["reason"] == "daemon_down", "an evict without a daemon is an error"


def test_state_shows_entries_budget_stats_kernels_and_fallbacks(fetch, daemon: Client) -> None:
    publish(daemon, "aaaa1111", 3 * arena.PAGE, "TinyLlama (bf16)")
    reply = daemon.request("lookup", key="aaaa1111", wait=False)  # a hit
    assert reply["status"] == "hit"
    reply.close()
    daemon.request("unpin", key="aaaa1111")
    daemon.request("fallback", call="AutoModel.from_pretrained", kind="uncacheable", reason="a callable argument")

    status, state = fetch("overmind", "state")
    assert status == 200, state
    assert state["state"] == "ok" and state["daemon"]["pid"] == daemon.daemon_pid
    [entry] = state["entries"]
    assert entry["key"] == "aaaa1111" and entry["label"] == "TinyLlama (bf16)"
    assert entry["bytes"] >= 3 * arena.PAGE and entry["hits"] == 1
    assert entry["bytes_text"] == byte_text(entry["bytes"]), "sizes are written by the shared formatter"
    assert state["texts"]["budget"] == byte_text(daemon.budget)
    assert state["budget"] == daemon.budget and state["used"] >= entry["bytes"]
    assert state["stats"]["hits"] == 1 and state["stats"]["misses"] == 1
    roles = [k["role"] for k in state["kernels"]]
    assert roles == ["test"], "the test's connection shows; the server's own connection does not"
    [fallback] = state["fallbacks"]
    assert fallback["reason"] == "a callable argument" and fallback["kind"] == "uncacheable"
    assert "units" in state  # null until the daemon has a units ledger, then a list of devices
    if state["units"] is not None:
        assert all({"device", "total", "used", "free", "simulated"} <= set(d) for d in state["units"]["devices"])


def test_state_shows_units_per_simulated_device(fetch, overmind_home: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "2x16")  # the daemon this client starts simulates them
    with Client(overmind_home, role="kernel", label="notebook.ipynb") as kernel:
        if "units" not in kernel.request("status").payload:
            pytest.skip("this daemon has no units ledger yet")
        held = kernel.request("units_acquire", units=3, devices=None, timeout_s=0, label="TinyLlama", busy=True)
        status, state = fetch("overmind", "state")
        assert status == 200, state
        units = state["units"]
        assert units["simulated"] and units["unit_bytes"] == 1 << 30 and units["error"] is None
        assert [d["simulated"] for d in units["devices"]] == [True, True]
        taken = next(d for d in units["devices"] if d["used"])
        assert taken["id"] == held["device"] and taken["device"].startswith("cuda:")
        assert taken["used"] == 3 and taken["free"] == taken["total"] - 3 and taken["total"] >= 14
        [holder] = taken["holders"]
        assert {k: holder[k] for k in ("label", "kernel", "pid", "units", "busy")} == {
            "label": "TinyLlama", "kernel": "notebook.ipynb", "pid": os.getpid(), "units": 3, "busy": True}
        assert holder["name"] == "notebook.ipynb" and f"pid {os.getpid()}" in holder["detail"]
        kernel.request("units_release", holding=held["holding"])
        assert all(d["used"] == 0 for d in fetch("overmind", "state")[1]["units"]["devices"])


def test_connections_are_named_by_the_servers_session_else_by_the_daemon(daemon: Client) -> None:
    """Note [Kernels by notebook]: the daemon's connection of this process, matched by pid to a kernel
    of the server, takes the session's path; unmatched, it keeps the daemon's label or command."""
    from overmind_jupyter.server.state import Names, ServerKernel
    from overmind_jupyter.view import state_view

    status = daemon.request("status").payload
    names = Names([ServerKernel("1f2e3d4c-aaaa", os.getpid(), "work/train.ipynb", "notebook"),
                   ServerKernel("9f9f9f9f-bbbb", None, "other.ipynb", "notebook")])
    [me] = state_view(status, names=names)["kernels"]
    assert (me["name"], me["path"], me["kernel_id"]) == ("work/train.ipynb", "work/train.ipynb", "1f2e3d4c-aaaa")
    assert me["detail"] == f"pid {os.getpid()}, notebook kernel 1f2e3d4c"
    [outside] = state_view(status)["kernels"]
    assert "path" not in outside and str(os.getpid()) in outside["detail"]
    # a kernel labelled by its kernel id (no JPY_SESSION_NAME) is matched by that id
    by_id = Names([ServerKernel("k-1", None, "console-1", "console")]).connection(
        {"conn": 1, "pid": 4242, "role": "kernel", "label": "kernel k-1"})
    assert by_id["name"] == "console-1" and by_id["detail"] == "pid 4242, console kernel k-1"
    # a preload's worker is named by the notebook it preloads for
    worker = names.connection({"conn": 3, "pid": 99, "role": "worker", "label": f"preload for pid {os.getpid()}"})
    assert worker["name"] == "preload for work/train.ipynb" and "pid 99" in worker["detail"]


def test_progress_pending_and_times_carry_their_display_strings(daemon: Client) -> None:
    """The view of a real status reply: a load's progress, an entry's pending copy and its miss's times,
    and the time saved, each with the text the one formatter writes."""
    from overmind_jupyter.view import state_view

    publish(daemon, "k1", arena.PAGE, "llama")
    with Client(daemon.home, role="kernel", label="a.ipynb") as other:
        assert other.request("lookup", key="k2", wait=False)["status"] == "load"
        other.request("progress", key="k2", label="loading big", done=1 << 29, total=1 << 30, unit="B")
        status = daemon.request("status").payload
        state = state_view(status, my_conn=other.conn_id)
    [load] = state["loading"]
    assert load["progress"]["percent"] == 50 and load["loader"]["mine"] and load["loader"]["name"]
    assert load["progress"]["text"] == progress_text(status["loading"][0]["progress"] or {})
    assert load["reserved_text"] == byte_text(0)
    [entry] = state["entries"]
    assert entry["label"] == "llama" and entry["pending"] is None
    assert entry["miss_text"] == formats.miss_text(status["entries"][0])
    assert state["texts"]["saved"] == formats.saved_figure(-entry["cache_s"])
    assert state["time_saved"]["saved_s"] == -status["time_saved"]["cache_s"]


# A cell that loads a tiny model through the cache, timing the call as a user's %%time would.
TIMED_LOAD = """
import json, time, overmind_jupyter, torch
from transformers import AutoModelForCausalLM
started = time.perf_counter()
overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, {path!r}, dtype=torch.float16)
print(json.dumps({{"cell_s": time.perf_counter() - started}}), flush=True)
"""


def test_a_miss_and_a_hit_have_one_set_of_figures_in_the_cell_status_the_panel_and_the_text(
        fetch, daemon: Client, tiny_llama: Path) -> None:
    """Issue 40, item 1: what a miss cost (waited = loading + caching) is printed in the cell, and the same
    numbers are in `overmind-daemon status --json`, the panel's state and `%overmind status`'s text; the
    time saved is the hits' plain loads less their waits less the misses' caching (Note [Load time saved])."""
    miss = run_py(TIMED_LOAD.format(path=str(tiny_llama)))
    cell_s = last_json(miss)["cell_s"]
    [line] = [x for x in miss.stderr.splitlines() if x.startswith("overmind: cached")]
    raw = json.loads(run_py("from kernel_server.cli import main; main(['status', '--json'])").stdout)
    [entry] = raw["entries"]
    waited, load, cache = entry["waited_s"], entry["load_s"], entry["cache_s"]
    assert load > 0 and cache > 0 and abs(waited - (load + cache)) <= 2e-4, entry
    assert waited <= cell_s < waited + 1.0, "the whole wait of the call, as the cell timed it"
    assert line == f"overmind: cached tiny-llama in {seconds_text(waited)}: loading {seconds_text(load)} " \
                   f"+ caching {seconds_text(cache)}", line
    assert raw["time_saved"] == {"misses": 1, "cache_s": cache, "hits": 0, "plain_s": 0.0, "hit_s": 0.0,
                                 "untimed_ended": 0, "untimed_waiting": 0}

    status, state = fetch("overmind", "state")
    assert status == 200, state
    [shown] = state["entries"]
    assert (shown["waited_s"], shown["load_s"], shown["cache_s"]) == (waited, load, cache)
    assert shown["miss_text"] == line.split(" in ", 1)[1], "the panel's words are the cell's"
    assert state["texts"]["saved"] == saved_figure(-cache), "no hit yet: caching is all the cache cost"

    hit = run_py(TIMED_LOAD.format(path=str(tiny_llama)))
    hit_cell_s = last_json(hit)["cell_s"]
    assert not [x for x in hit.stderr.splitlines() if x.startswith("overmind: cached")], "a hit caches nothing"
    deadline = time.monotonic() + 10
    while daemon.request("status")["hits_log"][-1]["hit_s"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _, state = fetch("overmind", "state")
    [logged] = state["hits_log"]
    assert (logged["waited_s"], logged["load_s"], logged["cache_s"]) == (waited, load, cache)
    assert 0 < logged["hit_s"] <= hit_cell_s, "the hit's whole wait, as the cell timed it"
    saved = load - logged["hit_s"] - cache
    assert state["time_saved"]["saved_s"] == pytest.approx(saved)
    assert state["texts"]["saved"] == saved_figure(saved)
    assert state["texts"]["hits"] == seconds_text(logged["hit_s"]) and state["texts"]["caching"] == seconds_text(cache)

    text = run_py("from overmind_jupyter import api; print(api.format_status(api.status()))").stdout
    assert f"missed in {shown['miss_text']}" in text, text
    assert f"time: {state['texts']['saved_detail']}" in text and " in 1 entry; " in text, text
    cli = run_py("from kernel_server.cli import main; main(['status'])").stdout
    assert f"missed in {shown['miss_text']}" in cli and state["texts"]["saved_detail"] in cli, cli
    assert "(1 entry; " in cli, cli


def test_evict_one_by_prefix_then_all(fetch, daemon: Client) -> None:
    publish(daemon, "bbbb2222", arena.PAGE, "one")
    publish(daemon, "cccc3333", arena.PAGE, "two")
    publish(daemon, "cccc4444", arena.PAGE, "three")

    status, body = fetch("overmind", "evict", method="POST", body={"key": "bbbb"})
    assert status == 200 and body == {"evicted": ["bbbb2222"]}
    status, body = fetch("overmind", "evict", method="POST", body={"key": "cccc"})
    assert status == 409 and body["reason"] == "ambiguous_key"
    status, body = fetch("overmind", "evict", method="POST", body={"key": "dddd"})
    assert status == 404 and "no entry" in body["message"]
    for bad in ("not json", {"key": 3}, {}, [1, 2], "[" * 100_000 + "]" * 100_000):  # (the last: too deep)
        status, body = fetch("overmind", "evict", method="POST", body=bad)
        assert status == 400, str(bad)[:40]
        assert "{\"all\": true}" in body["message"]
    status, body = fetch("overmind", "evict", method="POST", body={"key": "c" * (1 << 20)})
    assert status == 400 and "names no entry" in body["message"], body
    assert sorted(e["key"] for e in fetch("overmind", "state")[1]["entries"]) == ["cccc3333", "cccc4444"]

    status, body = fetch("overmind", "evict", method="POST", body={"all": True})
    assert status == 200 and sorted(body["evicted"]) == ["cccc3333", "cccc4444"]
    assert fetch("overmind", "state")[1]["entries"] == []


def test_every_route_refuses_a_request_without_the_token(fetch, daemon: Client) -> None:
    publish(daemon, "eeee5555", arena.PAGE, "kept")
    status, _ = fetch("overmind", "state", token=False)
    assert status == 403
    status, _ = fetch("overmind", "evict", method="POST", body={"all": True}, token=False)
    assert status == 403
    assert [e["key"] for e in daemon.request("ls")["entries"]] == ["eeee5555"], "a refused evict evicts nothing"


def test_the_server_reaches_a_restarted_daemon(fetch, daemon: Client, overmind_home: Path) -> None:
    assert fetch("overmind", "state")[0] == 200
    first_pid = daemon.daemon_pid
    daemon.close()
    stop = subprocess.run([sys.executable, "-m", "kernel_server", "stop"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert stop.returncode == 0, stop.stderr
    status, body = fetch("overmind", "state")
    assert status == 200 and body["state"] == "down"
    with Client(overmind_home, role="test") as again:
        assert again.daemon_pid != first_pid
        status, state = fetch("overmind", "state")
        assert status == 200 and state["daemon"]["pid"] == again.daemon_pid


# -- installation -------------------------------------------------------------------------------------

def test_labextension_has_the_python_package_version() -> None:
    package = json.loads((REPO / "labextension" / "package.json").read_text())
    assert package["version"] == overmind_jupyter.__version__
    built = Path(overmind_jupyter.__file__).parent / "labextension" / "package.json"
    if built.exists():  # the build output copies it
        assert json.loads(built.read_text())["version"] == overmind_jupyter.__version__


def _jupyter(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    proc = subprocess.run([*JUPYTER, *args], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # no colours


def test_jupyter_lists_the_server_extension_enabled() -> None:
    out = _jupyter("server", "extension", "list")
    assert re.search(r"overmind_jupyter\s+enabled", out), out
    assert re.search(r"overmind_jupyter\s+\S*\s*OK", out), out


def test_jupyter_lists_the_labextension_enabled_and_ok() -> None:
    name = json.loads((REPO / "labextension" / "package.json").read_text())["name"]
    out = _jupyter("labextension", "list")
    line = next((ln for ln in out.splitlines() if name in ln), None)
    assert line is not None, f"{name} is not installed; `make setup` builds and installs it:\n{out}"
    version = re.escape(overmind_jupyter.__version__)
    assert re.search(rf"{re.escape(name)} v{version} enabled\s+OK", line), line
