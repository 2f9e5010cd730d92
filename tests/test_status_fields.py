"""What the daemon's status says for the views (issue 23): kernels by notebook, load times, hits, progress;
the one formatter of bytes and times; CLI tables that keep what tells entries apart."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from kernel_server import Client, arena, formats, payloads
from kernel_server.cli import main as cli_main
from tests.helpers.faults_helpers import wait_until
from tests.helpers.snippets import run_py


def miss_and_publish(client: Client, key: str, label: str, *, load_s: float = 0.0, **fields: Any) -> None:
    """A loader's miss: lookup, the load itself (`load_s` of sleep), reserve, publish (with `fields`)."""
    assert client.request("lookup", key=key, wait=False)["status"] == "load"
    time.sleep(load_s)
    graph, data = arena.ArenaWriter(16), arena.ArenaWriter(arena.PAGE)
    client.request("reserve", key=key, bytes=arena.PAGE + 16)
    client.request("publish", key=key, fds=[graph.seal(), data.seal()], graph_bytes=16, arena_bytes=arena.PAGE,
                   meta={"label": label}, deps=[], **fields)
    graph.close()
    data.close()


def test_kernels_are_named_by_their_notebook_with_pid_and_command(daemon: Client, overmind_home: Path) -> None:
    notebook = "/home/ada/projects/analysis.ipynb"
    code = ("import sys, time; from kernel_server.client import shared_client; shared_client(); "
            "print('ready', flush=True); sys.stdin.read()")
    env = dict(os.environ, JPY_SESSION_NAME=notebook)
    kernel = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    env.pop("JPY_SESSION_NAME")
    script = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        for proc in (kernel, script):
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        kernels = {k["pid"]: k for k in daemon.request("status")["kernels"]}
        assert kernels[kernel.pid]["label"] == notebook
        assert "python" in kernels[kernel.pid]["command"] and "-c" in kernels[kernel.pid]["command"]
        assert formats.kernel_name(kernels[kernel.pid]) == (
            "analysis.ipynb", f"pid {kernel.pid}, {notebook}: {kernels[kernel.pid]['command']}")
        name, _ = formats.kernel_name(kernels[script.pid])  # not a notebook: pid and what runs
        assert name == f"pid {script.pid} -c"
        text = run_py("from kernel_server.cli import main; main(['status'])").stdout
        assert f"analysis.ipynb  (kernel; pid {kernel.pid}, {notebook}" in text
        # a process named by its pid and label: each said once, then its command
        (line,) = [line for line in text.splitlines() if f"pid {script.pid}" in line]
        assert line == f"  pid {script.pid} -c  (kernel; {kernels[script.pid]['command']})", line
    finally:
        for proc in (kernel, script):
            proc.kill()
            proc.wait()


def test_load_time_at_the_miss_and_hit_times_reported_later(daemon: Client, overmind_home: Path) -> None:
    miss_and_publish(daemon, "a" * 64, "LlamaForCausalLM('m')", load_s=0.3)
    (entry,) = daemon.request("status")["entries"]
    assert 0.3 <= entry["load_s"] < 5
    with Client(overmind_home, role="kernel", label="/n/second.ipynb") as other:
        hit = other.request("lookup", key="a" * 64, wait=False)
        assert hit["status"] == "hit"
        hit.close()
        (logged,) = daemon.request("status")["hits_log"]
        assert logged["key"] == "a" * 64 and logged["label"] == "LlamaForCausalLM('m')"
        assert logged["load_s"] == entry["load_s"] and logged["hit_s"] is None and logged["pid"] == os.getpid()
        other.request("hits", hits=[{"key": "a" * 64, "t": time.time(), "hit_s": 0.004}])
        (logged,) = daemon.request("status")["hits_log"]
        assert logged["hit_s"] == 0.004
        with pytest.raises(Exception, match="hits"):
            other.request("hits", hits=[{"key": "a" * 64, "t": "yesterday", "hit_s": 1}])


def _undeclared(hint: Any, value: Any, where: str = "status") -> list[str]:
    """The fields of `value` that its declared type (a TypedDict, or lists and unions of them) leaves out."""
    hint = typing.get_args(hint)[0] if typing.get_origin(hint) in (typing.Annotated, typing.NotRequired) else hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return min((_undeclared(a, value, where) for a in typing.get_args(hint) if a is not type(None)), key=len)
    if typing.get_origin(hint) is list and isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _undeclared(typing.get_args(hint)[0], v, f"{where}[{i}]")]
    if not (typing.is_typeddict(hint) and isinstance(value, dict)):
        return []
    fields = typing.get_type_hints(hint, include_extras=True)
    return [f"{where}.{k}" for k in value if k not in fields] + [
        x for k, v in value.items() if k in fields for x in _undeclared(fields[k], v, f"{where}.{k}")]


def test_the_status_reply_is_exactly_its_declared_type(overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """payloads.StatusReply says what status carries, no more and no less: every view reads it without
    guessing (issue 41). A status with an entry that is pinned and being copied, a load in flight with its
    progress, a timed hit, a fallback, and a holding of units on simulated devices."""
    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "2x16")
    with Client(overmind_home, role="kernel", label="/n/a.ipynb") as daemon, \
            Client(overmind_home, role="kernel", label="/n/b.ipynb") as other:
        miss_and_publish(daemon, "a" * 64, "m", times={"waited_s": 1.5, "load_s": 1.0, "cache_s": 0.5})
        hit = other.request("lookup", key="a" * 64, wait=False)
        hit.close()
        other.request("hits", hits=[{"key": "a" * 64, "t": time.time(), "hit_s": 0.25}])
        assert other.request("lookup", key="b" * 64, wait=False)["status"] == "load"
        other.request("progress", key="b" * 64, label="loading b", done=1, total=4, unit="it")
        daemon.request("fallback", call="AutoModel.from_pretrained", kind="uncacheable", reason="why")
        daemon.request("units_acquire", units=2, devices=None, timeout_s=0, label="m", busy=True)
        status = daemon.request("status").payload
    payloads.check(payloads.StatusReply, status, "status")
    assert _undeclared(payloads.StatusReply, status) == []
    assert status["entries"] and status["loading"] and status["hits_log"] and status["fallbacks"]
    assert any(d["holders"] for d in status["units"]["devices"]) and status["entries"][0]["pinned_by"]
    assert status["loading"][0]["progress"] is not None
    assert status["time_saved"] == {"misses": 1, "cache_s": 0.5, "hits": 1, "plain_s": 1.0, "hit_s": 0.25,
                                    "untimed_ended": 0, "untimed_waiting": 0}
    assert formats.saved_seconds(status["time_saved"]) == 0.25  # 1.0 - 0.25 - 0.5


def test_a_publish_says_what_the_miss_cost_and_the_parts_add_up(daemon: Client,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Note [Load time saved]: the loader's times are kept, waited at least the load, caching the rest;
    times out of range are refused."""
    miss_and_publish(daemon, "a" * 64, "m", times={"waited_s": 20.1, "load_s": 8.0, "cache_s": 12.1})
    miss_and_publish(daemon, "b" * 64, "n", times={"waited_s": 1.0, "load_s": 3.0, "cache_s": 9.0})
    entries = {e["key"][0]: e for e in daemon.request("status")["entries"]}
    assert (entries["a"]["waited_s"], entries["a"]["load_s"], entries["a"]["cache_s"]) == (20.1, 8.0, 12.1)
    assert (entries["b"]["waited_s"], entries["b"]["load_s"], entries["b"]["cache_s"]) == (3.0, 3.0, 0.0)
    assert formats.miss_text(entries["a"]) == "20 s: loading 8.0 s + caching 12 s"
    # no hit yet: the caching is a cost, said in words, never as a negative saving, in every view
    from overmind_jupyter.view import state_view

    status = daemon.request("status").payload
    said = "none saved yet: no hit yet, and the caching cost 12 s in 2 misses"  # no "0 hits took 0 ms instead of"
    assert state_view(status)["texts"]["saved"] == "none" and state_view(status)["texts"]["saved_detail"] == said
    assert cli_main(["status"]) == 0 and f"time   {said}\n" in capsys.readouterr().out
    nothing = payloads.TimeSaved(misses=0, cache_s=0.0, hits=0, plain_s=0.0, hit_s=0.0)
    assert formats.saved_text(nothing) == "none saved yet: no load through the cache yet"
    assert formats.saved_text(payloads.TimeSaved(misses=1, cache_s=0.024, hits=0, plain_s=0.0, hit_s=0.0)) == \
        "none saved yet: no hit yet, and the caching cost 24 ms in 1 miss"
    assert formats.saved_figure(-0.0004) == "0 ms" and formats.saved_figure(1.44) == "1.4 s", "no loss that rounds to 0"
    # a hit slower than the load it replaced (its kernel imported the model's code first)
    daemon.request("lookup", key="b" * 64, wait=False).close()
    daemon.request("hits", hits=[{"key": "b" * 64, "t": time.time(), "hit_s": 4.0}])
    said = ("none saved yet (the hits took longer than the loads they replaced): 1 hit took 4.0 s instead of 3.0 s, "
            "plus 12 s of caching in 2 misses")
    assert cli_main(["status"]) == 0 and f"time   {said}\n" in capsys.readouterr().out
    with pytest.raises(Exception, match="times"):
        miss_and_publish(daemon, "c" * 64, "o", times={"waited_s": -1.0, "load_s": 0.0, "cache_s": 0.0})


def test_hits_whose_times_never_came_are_said_beside_the_timed_ones(daemon: Client, overmind_home: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Note [Load time saved]: a kernel killed before it reported its hits' times leaves them untimed for
    good, and a running kernel's are untimed until it reports; status counts both beside the timed hits, and
    the CLI, the widgets and `%overmind status` (state_view's text) say so in the same words."""
    from overmind_jupyter.view import state_view

    key = "a" * 64
    miss_and_publish(daemon, key, "m", times={"waited_s": 1.5, "load_s": 1.0, "cache_s": 0.5})
    daemon.request("lookup", key=key, wait=False).close()
    daemon.request("hits", hits=[{"key": key, "t": time.time(), "hit_s": 0.25}])
    killed = run_py(f"""
        import os, signal
        from pathlib import Path
        from kernel_server import Client
        client = Client(Path({str(overmind_home)!r}), role="kernel")
        for _ in range(2):
            client.request("lookup", key={key!r}, wait=False).close()
        os.kill(os.getpid(), signal.SIGKILL)  # before it reports the times of its hits
    """, check=False)
    assert killed.returncode == -9, killed.stderr
    daemon.request("lookup", key=key, wait=False).close()  # this kernel's, not reported yet
    def told() -> dict[str, Any]:  # once the daemon saw the killed kernel's connection end
        status = daemon.request("status").payload
        return status if status["time_saved"].get("untimed_ended") else {}

    status = wait_until(told, what="the killed kernel's hits counted as never timed")
    assert status["stats"]["hits"] == 4, status["stats"]
    assert (status["time_saved"]["untimed_ended"], status["time_saved"]["untimed_waiting"]) == (2, 1)
    said = ("250 ms saved: 1 hit took 250 ms instead of 1.0 s (3 more: 2 of kernels that ended before telling "
            "their times, 1 not timed yet), less 500 ms of caching in 1 miss")
    assert formats.saved_text(status["time_saved"]) == said
    assert state_view(status)["texts"]["saved_detail"] == said
    assert cli_main(["status"]) == 0 and f"time   {said}\n" in capsys.readouterr().out
    sums = payloads.TimeSaved(misses=1, cache_s=0.5, hits=510, plain_s=1320.0, hit_s=23.0, untimed_ended=130)
    assert formats.saved_text(sums) == ("22 min saved: 510 hits took 23 s instead of 22 min (130 more, of kernels "
                                        "that ended before telling their times), less 500 ms of caching in 1 miss")
    sums = payloads.TimeSaved(misses=1, cache_s=0.5, hits=0, plain_s=0.0, hit_s=0.0, untimed_waiting=1)
    assert formats.saved_text(sums) == ("none saved yet: no hit timed yet (1 hit, not timed yet), and the caching "
                                        "cost 500 ms in 1 miss")


@pytest.mark.parametrize(("plain_s", "hit_s", "cache_s", "said"), [
    (14.0, 0.4, 1.6, "12 s saved: 3 hits took 400 ms instead of 14 s, less 1.6 s of caching in 2 misses"),
    (0.45, 0.4, 0.059, "none saved yet (the caching cost 9 ms more than the hits saved): 3 hits took 400 ms instead "
                       "of 450 ms, less 59 ms of caching in 2 misses"),
    (0.033, 3.3, 0.036, "none saved yet (the hits took longer than the loads they replaced): 3 hits took 3.3 s "
                        "instead of 33 ms, plus 36 ms of caching in 2 misses"),
    (0.033, 3.3, 0.0, "none saved yet (the hits took longer than the loads they replaced): 3 hits took 3.3 s "
                      "instead of 33 ms, plus 0 ms of caching in 2 misses"),
    (0.4, 0.4004, 0.0, "0 ms saved: 3 hits took 400 ms instead of 400 ms, less 0 ms of caching in 2 misses"),
])
def test_what_the_cache_saved_is_said_truly_when_the_hits_or_the_caching_cost_more(
        plain_s: float, hit_s: float, cache_s: float, said: str) -> None:
    """Note [Load time saved]: never a negative saving, and what is said of the loss is what made it: the
    caching, where the hits saved less than it cost; the hits, where they took longer than the loads they
    replaced (the caching then adds to it)."""
    sums = payloads.TimeSaved(misses=2, cache_s=cache_s, hits=3, plain_s=plain_s, hit_s=hit_s)
    assert formats.saved_text(sums) == said


def test_a_loads_progress_reaches_status_with_eta(daemon: Client, overmind_home: Path) -> None:
    key = "b" * 64
    assert daemon.request("lookup", key=key, wait=False)["status"] == "load"
    daemon.request("progress", key=key, label="loading llama-0.1b", done=0, total=1000, unit="B")
    time.sleep(0.2)
    daemon.request("progress", key=key, label="loading llama-0.1b", done=250, total=1000, unit="B")
    (load,) = daemon.request("status")["loading"]
    progress = load["progress"]
    assert progress["label"] == "loading llama-0.1b" and (progress["done"], progress["total"]) == (250, 1000)
    assert progress["eta_s"] == pytest.approx(0.6, rel=0.5)  # three more quarters at a quarter per 0.2 s
    assert formats.progress_text(progress).startswith("loading llama-0.1b: 25% (250 B of 1000 B), ")
    text = run_py("from kernel_server.cli import main; main(['status'])").stdout
    assert "loading llama-0.1b: 25%" in text and "left" in text


def test_cli_ls_keeps_what_tells_entries_apart(daemon: Client, capsys: pytest.CaptureFixture[str]) -> None:
    base = "LlamaForCausalLM.from_pretrained('/data/checkpoints/some-long-organisation/llama-0.1b-instruct'"
    labels = [base + ", dtype=torch.float32)", base + ", dtype=torch.bfloat16)"]
    keys = ["c" * 20 + "1" * 44, "c" * 20 + "2" * 44]  # equal for 20 characters
    for key, label in zip(keys, labels, strict=True):
        miss_and_publish(daemon, key, label)
    assert cli_main(["ls"]) == 0
    out = capsys.readouterr().out
    for key, label in zip(keys, labels, strict=True):
        assert label in out
        assert key[:24] in out
    assert len({line.split()[0] for line in out.splitlines()[1:]}) == 2


def test_one_formatter_of_sizes_and_times() -> None:
    assert formats.byte_text(11.8 * 2**30) == "11.8 GiB" and formats.byte_text(512 * 2**20) == "512 MiB"
    assert formats.ago_text(1000, 1001) == "just now" and formats.ago_text(1000, 1180) == "3 min ago"


def test_magic_status_in_a_real_shell_names_kernels_by_notebook(overmind_home: Path) -> None:
    env = dict(os.environ, JPY_SESSION_NAME="/home/ada/analysis.ipynb")
    out = run_py("""
        from IPython.core.interactiveshell import InteractiveShell
        from kernel_server import Client
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "overmind_jupyter")
        shell.run_line_magic("overmind", "on")
        other = Client(role="kernel", label="/home/ada/second.ipynb")
        shell.run_line_magic("overmind", "status")
    """, env=env).stdout
    assert "kernel analysis.ipynb  (kernel; pid " in out, out
    assert "kernel second.ipynb  (kernel; pid " in out, out
