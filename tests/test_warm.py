"""Warm kernels (issue 10): the provisioner, its spares, the kernelspec installer, through real kernels.

Kernels start through `jupyter_client` from kernelspecs installed into this module's own Jupyter data
directory; one test runs a real `jupyter server` and restarts through its REST API, the path of
JupyterLab's restart button. Two kernelspecs: WARM preloads torch and transformers (the default) plus
`warm_probe`; LIGHT preloads only `warm_probe`, so the tests that start spares again stay quick.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import stop_daemon
from tests.helpers.faults_helpers import wait_until as _wait_until
from tests.helpers.kernels import execute_all

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
GROUP = "jupyter_client.kernel_provisioners"
WARM, LIGHT, PLAIN = "om-warm-test", "om-warm-light", "python3"


def wait_until(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    return _wait_until(condition, timeout, what)  # kernels and servers take longer than daemons


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def is_spare(proc: psutil.Process) -> bool:
    try:
        return "overmind_jupyter.warm.zygote" in proc.cmdline()
    except psutil.Error:
        return False


def execute(kc, code: str, timeout: float = 120) -> tuple[str, str | None]:  # type: ignore[no-untyped-def]
    """Run `code`; returns (stdout, name of the error raised or None)."""
    msg_id = kc.execute(code)
    out, error = [], None
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            error = msg["content"]["ename"]
            if error != "KeyboardInterrupt":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out), error


def stderr_of(kc, code: str) -> str:  # type: ignore[no-untyped-def]
    """Run `code`; what the cell wrote on stderr (the kernel's post-cell hooks included)."""
    return "".join(text for kind, text in execute_all(kc, code) if kind == "stderr")


def run_json(kc, code: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    return json.loads(execute(kc, code)[0].strip().splitlines()[-1])


PROBE = """
import json as _json, os as _os, sys as _sys, random as _random
_info = {"pid": _os.getpid(), "ppid": _os.getppid(), "cwd": _os.getcwd(), "torch_preloaded": "torch" in _sys.modules,
         "leaked": "leaked" in globals(), "wave": "wave" in _sys.modules, "random": _random.random()}
import torch as _torch, transformers.modeling_utils, warm_probe as _probe
_info.update(path=_sys.path, argv=_sys.argv, orig_argv=_sys.orig_argv, env=dict(_os.environ),
             seed=_torch.initial_seed(),
             probe_in_spare=_probe.IMPORTED_IN != _os.getpid(), probe_saw=_probe.SAW)
print(_json.dumps(_info))
"""


@pytest.fixture(scope="module")
def entry_point() -> str:
    """The provisioner's entry point, as the package's metadata installs it."""
    found = entry_points(group=GROUP, name="overmind-warm")
    assert found, "the overmind-warm provisioner is not installed: run `pip install -e .` (make setup does)"
    return next(iter(found)).value


@pytest.fixture(scope="module")
def warm(entry_point: str, tmp_path_factory: pytest.TempPathFactory):
    """This module's Jupyter data dir with the WARM and LIGHT kernelspecs, and the environment every kernel
    here starts with (fixed, so that all kernels of a kernelspec share one spare). Spares are stopped after."""
    from overmind_jupyter import warm as warm_pkg

    data = tmp_path_factory.mktemp("jupyter-data")
    probe = tmp_path_factory.mktemp("probe")  # a copy, so a test may rewrite it
    shutil.copy(TESTS / "helpers" / "warm_probe.py", probe / "warm_probe.py")
    home = Path(tempfile.mkdtemp(prefix="om-w-", dir="/tmp"))
    os.chmod(home, 0o700)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_DATA_DIR", str(data))
        warm_pkg.install(WARM, preload=["torch", "transformers", "warm_probe"])
        warm_pkg.install(LIGHT, preload=["warm_probe"])
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        paths = [str(probe), env.get("PYTHONPATH", "")]
        env.update(OVERMIND_HOME=str(home), WARM_PROBE_SEEN="spare-env",
                   PYTHONPATH=os.pathsep.join(p for p in paths if p))
        yield env
        warm_pkg.stop_spares()
    stop_daemon(home)
    shutil.rmtree(home, ignore_errors=True)  # (in /tmp, not pytest's own folders: a socket's path is short)


def start(name: str, env: dict[str, str], cwd: Path | None = None):  # type: ignore[no-untyped-def]
    from jupyter_client.manager import start_new_kernel

    return start_new_kernel(kernel_name=name, env=env, cwd=str(cwd) if cwd else None, startup_timeout=120)


def restart(km, kc, *, now: bool = False, **kw: Any) -> float:  # type: ignore[no-untyped-def]
    """Restart and wait until the kernel answers; returns the seconds that took. `now=False` is the graceful
    path JupyterLab's restart button takes."""
    started = time.perf_counter()
    km.restart_kernel(now=now, **kw)
    kc.wait_for_ready(timeout=120)
    return time.perf_counter() - started


def spare_of(spec: str) -> dict[str, Any]:
    from overmind_jupyter.warm import describe_spares

    found = [s for s in describe_spares() if s["spec"].endswith(os.sep + spec)]
    assert len(found) == 1, found
    return found[0]


def test_install_writes_a_kernelspec_jupyter_client_resolves(warm: dict[str, str], entry_point: str,
                                                             tmp_path: Path) -> None:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.provisioning import KernelProvisionerFactory

    from overmind_jupyter.warm import WarmProvisioner

    env = dict(warm, JUPYTER_DATA_DIR=str(tmp_path))
    cli = [sys.executable, "-m", "overmind_jupyter.warm"]
    done = subprocess.run([*cli, "install", "--name", "cli-warm", "--preload", "torch,peft"], env=env,
                          capture_output=True, text=True, check=True)
    assert "cli-warm" in done.stdout
    spec_file = tmp_path / "kernels" / "cli-warm" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    assert spec["argv"] == [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    assert spec["metadata"]["kernel_provisioner"] == {"provisioner_name": "overmind-warm",
                                                      "config": {"preload": ["torch", "peft"]}}
    assert spec["metadata"]["debugger"] is True and (spec_file.parent / "logo-64x64.png").exists()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_DATA_DIR", str(tmp_path))
        kernelspec = KernelSpecManager().get_kernel_spec("cli-warm")
        factory = KernelProvisionerFactory.instance()
        assert factory.is_provisioner_available(kernelspec), "the entry point resolves"
        provisioner = factory.create_provisioner_instance("k1", kernelspec, None)
    assert isinstance(provisioner, WarmProvisioner) and provisioner.preload == ["torch", "peft"]
    assert subprocess.run([*cli, "uninstall", "--name", "cli-warm"], env=env, capture_output=True,
                          check=False).returncode == 0
    assert not spec_file.exists()
    again = subprocess.run([*cli, "uninstall", "--name", "cli-warm"], env=env, capture_output=True, text=True,
                           check=False)
    assert again.returncode == 1 and "jupyter kernelspec list" in again.stderr
    assert entry_point == "overmind_jupyter.warm.provisioner:WarmProvisioner"


def test_every_start_forks_a_fresh_kernel_and_interrupt_and_shutdown_work(warm: dict[str, str],
                                                                          tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    km, kc = start(WARM, warm, cwd=tmp_path / "a")
    try:
        first = run_json(kc, PROBE + "\nleaked = 41\nimport wave")
        spare = spare_of(WARM)
        assert first["ppid"] == spare["pid"] and spare["state"] == "ready"
        assert {"torch", "transformers", "transformers.modeling_utils", "warm_probe"} <= set(spare["modules"])
        assert first["torch_preloaded"] and first["probe_in_spare"] and first["probe_saw"] == "spare-env"
        assert first["env"]["WARM_PROBE_SET"] == "by-import", "what a preloaded import set is replayed"
        assert first["cwd"] == str(tmp_path / "a") and first["env"]["JPY_PARENT_PID"] == str(os.getpid())

        restart(km, kc)
        second = run_json(kc, PROBE)
        assert second["pid"] != first["pid"] and second["ppid"] == spare["pid"]
        assert not second["leaked"] and not second["wave"], "nothing of kernel A is in kernel B"
        assert second["seed"] != first["seed"] and second["random"] != first["random"], "fresh random state"

        restart(km, kc, now=True, env={**warm, "JPY_SESSION_NAME": "other.ipynb"}, cwd=str(tmp_path / "b"))
        third = run_json(kc, PROBE)
        assert third["cwd"] == str(tmp_path / "b") and third["env"]["JPY_SESSION_NAME"] == "other.ipynb"
        assert third["ppid"] == spare["pid"], "a per-kernel variable does not replace the spare"
        assert spare_of(WARM)["kernels"] == [third["pid"]], "earlier kernels are reaped"

        msg_id = kc.execute("import time; time.sleep(30)")
        wait_until(lambda: (m := kc.get_iopub_msg(timeout=10))["parent_header"].get("msg_id") == msg_id
                   and m["content"].get("execution_state") == "busy", what="the cell to start")
        time.sleep(0.3)
        started = time.perf_counter()
        km.interrupt_kernel()
        reply = wait_until(lambda: (m := kc.get_shell_msg(timeout=15))["parent_header"].get("msg_id") == msg_id
                           and m, what="the interrupted cell's reply")
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert time.perf_counter() - started < 10
        # the same kernel goes on (read from the execute reply: a loaded machine may publish a cell's
        # stdout after its idle status). ipykernel aborts an execute request that reaches it before it has
        # finished handling the error it just replied with (ipython/ipykernel#609): ask again then.
        after = wait_until(lambda: (r := kc.execute_interactive(
            "", user_expressions={"pid": "__import__('os').getpid()"}, timeout=60))["content"]["status"] != "aborted"
            and r, what="a cell after the interrupt to run")
        assert after["content"]["status"] == "ok", after["content"]
        assert after["content"]["user_expressions"]["pid"]["data"]["text/plain"] == str(third["pid"])
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
    assert not km.is_alive() and gone(third["pid"])
    assert spare_of(WARM)["kernels"] == []
    extra = [p for p in psutil.Process().children(recursive=True) if not is_spare(p) and not gone(p.pid)]
    assert extra == [], "nothing but spares outlives the kernels"


STATE = """
import json as _json, os as _os, sys as _sys
from ipykernel.kernelapp import IPKernelApp as _App
_app = _App.instance()
_fds = {}
for _fd in _os.listdir("/proc/self/fd"):
    try:
        _fds[_fd] = _os.readlink(f"/proc/self/fd/{_fd}")
    except OSError:
        pass
print(_json.dumps({"pid": _os.getpid(), "ppid": _os.getppid(), "cwd": _os.getcwd(), "env": dict(_os.environ),
                   "names": sorted(n for n in globals() if not n.startswith("_")), "modules": sorted(_sys.modules),
                   "ports": [_app.shell_port, _app.iopub_port, _app.stdin_port, _app.control_port, _app.hb_port],
                   "key": _app.session.key.decode(), "fds": sorted(_fds.values()), "parent": _app.parent_handle,
                   "extension_preloaded": "overmind_jupyter.loading" in _sys.modules}))
"""
PROBE_DIR = "import json, warm_probe; print(json.dumps({'dir': warm_probe.TEMP_DIR}))"
DIRTY = """
import os, sys, importlib
sys.path.insert(0, {user!r})
import warm_user_module
secret = 42
handle = open({scratch!r}, "w")
handle.write("unflushed")
import tempfile, warm_probe
user_temp = tempfile.TemporaryDirectory(dir={temps!r})
os.environ["ONLY_IN_THE_OLD_KERNEL"] = "1"
os.environ["WARM_PROBE_SEEN"] = "changed inside the kernel"
os.chdir({elsewhere!r})
import wave, colorsys
"""


def test_a_restarted_warm_kernel_is_a_fresh_process_with_nothing_of_the_old_one(warm: dict[str, str],
                                                                               tmp_path: Path) -> None:
    """Each restart, graceful or not, gives a new process with the start's argv, environment and working
    directory, the same ports and key, and nothing of the kernel before: no variables, no modules it
    imported, no environment or working directory it changed, no file it held open (and, after a graceful
    restart, what it wrote was flushed when it ended)."""
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "warm_user_module.py").write_text("VALUE = 1\n")
    (tmp_path / "start").mkdir()
    (tmp_path / "elsewhere").mkdir()
    scratch = tmp_path / "scratch.txt"
    (tmp_path / "temps").mkdir()
    dirty = DIRTY.format(user=str(tmp_path / "user"), scratch=str(scratch), elsewhere=str(tmp_path / "elsewhere"),
                         temps=str(tmp_path / "temps"))
    km, kc = start(WARM, warm, cwd=tmp_path / "start")
    try:
        first = run_json(kc, STATE)
        info = km.get_connection_info()
        assert first["ports"] == [info[p] for p in ("shell_port", "iopub_port", "stdin_port", "control_port",
                                                     "hb_port")] and first["key"] == info["key"].decode()
        assert first["extension_preloaded"], "the spare imported %load_ext overmind_jupyter's modules"
        assert first["parent"] == os.getpid(), "ipykernel, imported in the spare, watches this kernel's parent"
        kernels = [first["pid"]]
        for now in (False, True, False):
            execute(kc, dirty)
            restart(km, kc, now=now)
            fresh = run_json(kc, STATE)
            assert fresh["pid"] not in kernels and fresh["ppid"] == first["ppid"], "a new process from the spare"
            assert all(gone(pid) for pid in kernels)
            kernels.append(fresh["pid"])
            assert fresh["names"] == first["names"], "an empty namespace"
            assert "warm_user_module" not in fresh["modules"] and "wave" not in fresh["modules"]
            assert set(fresh["modules"]) == set(first["modules"]), "no module the old kernel imported"
            assert fresh["env"] == first["env"] and fresh["cwd"] == str(tmp_path / "start"), \
                "the start's environment and working directory, not what the old kernel changed"
            assert fresh["ports"] == first["ports"] and fresh["key"] == first["key"], "the same connection info"
            assert str(scratch) not in fresh["fds"] and not any("warm_user_module" in f for f in fresh["fds"])
            if not now:  # killed (now=True), a kernel flushes nothing, as a plain kernel
                assert scratch.read_text() == "unflushed", "the old kernel's open file was flushed as it ended"
                assert not any((tmp_path / "temps").iterdir()), "the old kernel's own finalizers ran as it ended"
            assert Path(run_json(kc, PROBE_DIR)["dir"]).is_dir(), \
                "a finalizer the spare's imports made is the spare's (Note [Finalizers of the spare])"
            scratch.unlink()
            for left in (tmp_path / "temps").iterdir():
                left.rmdir()
        assert spare_of(WARM)["kernels"] == [kernels[-1]], "the old kernels were reaped; no other process"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def first_polls(km) -> list[int | None]:  # type: ignore[no-untyped-def]
    """What the manager's first poll sees at each graceful shutdown of `km`'s kernel from now on (its exit
    status, or None while it runs), with the kernel's own exit deciding, however loaded the machine."""
    polls: list[int | None] = []
    km.provisioner.exit_grace = 30.0
    poll, finish = km.provisioner.poll, km._async_finish_shutdown

    async def finish_shutdown(*args: Any, **kwargs: Any) -> None:
        polls.append(await poll())
        await finish(*args, **kwargs)

    km._async_finish_shutdown = finish_shutdown
    return polls


def test_a_graceful_restart_waits_for_the_old_kernel_exit_not_for_a_poll_tick_and_returns_once_listening(
        warm: dict[str, str]) -> None:
    """Note [What a restart waits for] and Note [Launched means listening] in provisioner.py: the manager
    finds the old kernel gone at its first poll (it does not sleep 0.1 s between polls for it), and when
    `restart_kernel` returns the new kernel already listens on all its ports."""
    from overmind_jupyter.warm.provisioner import listening_ports

    km, kc = start(LIGHT, warm)
    try:
        polls = first_polls(km)
        for _ in range(3):
            old = km.provisioner.pid
            km.restart_kernel(now=False)
            info = km.get_connection_info()
            ports = {info[p] for p in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")}
            assert ports <= listening_ports(), "launched means listening"
            assert gone(old) and km.provisioner.pid != old
            kc.wait_for_ready(timeout=60)
        assert polls == [0, 0, 0], "the old kernel had exited (code 0) before the manager's first poll"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# Held by a module, as a library holds its objects: IPython's atexit handler clears the user's namespace
DEAD_PROXY = """
import sys, types, weakref
class _Gone:
    pass
_gone = _Gone()
holder = sys.modules["om_test_holder"] = types.ModuleType("om_test_holder")
holder.proxy = weakref.proxy(_gone)
del _gone
holder.handle = open({scratch!r}, "w")
holder.handle.write("unflushed")
"""


def test_a_kernel_that_holds_a_dead_weak_proxy_still_ends_by_the_fast_exit(warm: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """Note [Fast exit] in zygote.py: the scan for open files meets every object of the kernel, and a
    weakref.proxy whose object is gone raises ReferenceError when asked its class. A kernel that had
    loaded a model held one; its exit then fell back to the interpreter's full teardown (0.6-1.4 s
    more) and ended with status 1. It must end by the fast exit, status 0, its files flushed."""
    scratch = tmp_path / "scratch.txt"
    km, kc = start(LIGHT, warm)
    try:
        codes = first_polls(km)
        execute(kc, DEAD_PROXY.format(scratch=str(scratch)))
        km.restart_kernel(now=False)
        kc.wait_for_ready(timeout=60)
        assert codes == [0], "the old kernel ended by the fast exit (status 0), not the interpreter's teardown"
        assert scratch.read_text() == "unflushed", "its open file was flushed as it ended"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


MARK = "import os, time\nwith open({marks!r}, 'a') as f:\n    f.write(f'{{os.getpid()}} {{time.time()}}\\n')\n"


def test_a_restart_starts_the_kernel_started_ahead_which_ran_nothing_of_the_users_before(
        warm: dict[str, str], tmp_path: Path) -> None:
    """Note [Kernels started ahead] in zygote.py: while a kernel runs, the next one waits, started with the
    same argv, environment and working directory, without its ports and without having run the startup
    code of IPython's profile; a restart starts it, and it runs that code then. A restart that asks for
    something else (another environment) discards it and forks a kernel for what was asked; a shutdown
    ends it."""
    marks = tmp_path / "marks.txt"
    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-mark.py").write_text(MARK.format(marks=str(marks)))
    env = dict(warm, IPYTHONDIR=str(tmp_path / "ipython"))
    who = "import json, os; print(json.dumps({'pid': os.getpid(), 'session': os.environ.get('JPY_SESSION_NAME')}))"

    def ran_startup() -> dict[int, float]:
        return {int(pid): float(at) for pid, at in (line.split() for line in marks.read_text().splitlines())}

    def waiting() -> list[int]:
        return spare_of(LIGHT)["ahead"]

    km, kc = start(LIGHT, env)
    try:
        first = run_json(kc, who)["pid"]
        ahead = wait_until(waiting, what="a kernel started ahead")[0]
        assert ahead != first and list(ran_startup()) == [first], "the kernel ahead ran no startup code"
        info = km.get_connection_info()
        ports = {info[p] for p in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")}
        listening = {c.laddr.port for c in psutil.Process(ahead).net_connections("tcp") if c.status == "LISTEN"}
        assert not listening & ports, "the kernel ahead has bound none of the kernel's ports"
        asked = time.time()
        restart(km, kc)
        assert run_json(kc, who)["pid"] == ahead and ran_startup()[ahead] >= asked, "started at the restart"
        assert spare_of(LIGHT)["kernels"] == [ahead] and gone(first)

        following = wait_until(waiting, what="the next kernel started ahead")[0]
        restart(km, kc, env={**env, "JPY_SESSION_NAME": "other.ipynb"})
        other = run_json(kc, who)
        assert other["session"] == "other.ipynb" and other["pid"] != following, "forked for what was asked"
        wait_until(lambda: gone(following), what="the kernel ahead for another start to end")
        assert following not in ran_startup()
        last = wait_until(waiting, what="a kernel started ahead for the new start")[0]
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
    assert gone(last) and waiting() == [] and spare_of(LIGHT)["kernels"] == [], "a shutdown ends the one ahead"
    assert set(ran_startup()) == {first, ahead, other["pid"]}


WARMED = ("import json, os\nfrom overmind_jupyter.warm import warmed\n"
          "print(json.dumps({'pid': os.getpid(), 'ppid': os.getppid(), 'warmed': warmed()}))")
STATUS = "from overmind_jupyter import api; print(api.format_status(api.status()))"  # %overmind status's text


def warmed_ahead(spec: str) -> tuple[int, list[dict[str, Any]]] | None:
    """The kernel started ahead from `spec`'s spare and what it told the spare it warmed; None until it has."""
    spare = spare_of(spec)
    ahead = [pid for pid in spare["ahead"] if pid in spare["warmed"]]
    return (ahead[0], spare["warmed"][ahead[0]]) if ahead else None


def test_a_kernel_started_ahead_warms_its_devices_before_the_restart_and_no_other_process_does(
        warm: dict[str, str]) -> None:
    """Note [Devices warmed ahead] in warmup.py, with `cpu` standing in for a GPU: the kernel started ahead
    runs the warm-up while it waits and tells the spare; once a restart has started it, its own record says
    the warm-up was over before the restart was asked for, and `%overmind status` says so. The kernel
    forked for the start warmed nothing, nor did the spare (whose record every kernel forked from it would
    carry); the record is the kernel's own (its pid). With the setting off, nothing is warmed, and the
    setting, read by the kernels alone, changes no spare."""
    env = dict(warm, OVERMIND_WARM_DEVICES="cpu")
    km, kc = start(WARM, env)
    try:
        first = run_json(kc, WARMED)
        spare = spare_of(WARM)["pid"]
        assert first["ppid"] == spare and first["warmed"] == [], "a kernel forked for its start warms nothing"
        ahead, said = wait_until(lambda: warmed_ahead(WARM), what="the kernel started ahead to warm the device")
        asked = time.time()
        restart(km, kc)
        kernel = run_json(kc, WARMED)
        assert kernel["pid"] == ahead != first["pid"] and kernel["ppid"] == spare
        [row] = kernel["warmed"]
        assert row == said[0], "what it told the spare"
        assert row["device"] == "cpu" and row["error"] is None and row["pid"] == ahead, row
        assert row["started_at"] <= row["finished_at"] < asked and row["seconds"] > 0, "warmed before the restart"
        status = execute(kc, STATUS)[0]
        assert "warmed cpu ahead of this kernel's start" in status, status
        said_after = stderr_of(kc, "import os; os.environ['CUDA_VISIBLE_DEVICES'] = '7'")
        assert "CUDA_VISIBLE_DEVICES changed after this warm kernel initialised CUDA" in said_after, said_after
        assert "CUDA_VISIBLE_DEVICES" not in stderr_of(kc, "os.environ['CUDA_VISIBLE_DEVICES'] = '6'"), "once"

        restart(km, kc, env={**env, "OVERMIND_WARM_DEVICES": "off"})  # another start: forked, not taken ahead
        forked = run_json(kc, WARMED)
        assert forked["ppid"] == spare and forked["warmed"] == [], "the same spare; a forked kernel warms nothing"
        ahead, said = wait_until(lambda: warmed_ahead(WARM), what="the kernel started ahead to say it warmed nothing")
        assert said == []
        restart(km, kc)
        kernel = run_json(kc, WARMED)
        assert kernel["pid"] == ahead and kernel["warmed"] == [], "off: nothing warmed"
        assert "warmed" not in execute(kc, STATUS)[0]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_warm_up_that_fails_is_recorded_and_the_kernel_config_turns_it_off(warm: dict[str, str],
                                                                              tmp_path: Path) -> None:
    """Note [Devices warmed ahead]: a device that cannot be warmed (here: the LIGHT spare did not preload
    torch) is recorded with its error, and the kernel works; `c.Overmind.warm_devices` in the kernel's
    IPython config wins over the environment, in the kernels started ahead after it was written."""
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    env = dict(warm, OVERMIND_WARM_DEVICES="cpu", IPYTHONDIR=str(tmp_path / "ipython"))
    km, kc = start(LIGHT, env)
    try:
        ahead, said = wait_until(lambda: warmed_ahead(LIGHT), what="the kernel started ahead to try the warm-up")
        (profile / "ipython_kernel_config.py").write_text("c.Overmind.warm_devices = 'off'\n")  # for the next
        restart(km, kc)
        kernel = run_json(kc, WARMED)
        [row] = kernel["warmed"]
        assert kernel["pid"] == ahead and row == said[0] and row["device"] == "cpu", row
        assert "torch is not preloaded" in row["error"] and row["finished_at"] is not None
        assert "warming cpu ahead of this kernel's start failed: RuntimeError: torch is not preloaded" in \
            execute(kc, STATUS)[0]
        assert execute(kc, "print(6 * 7)")[0] == "42\n"
        ahead, said = wait_until(lambda: warmed_ahead(LIGHT), what="the next kernel started ahead")
        assert said == [], "the config file's off over the environment's cpu"
        restart(km, kc)
        assert run_json(kc, WARMED) == {"pid": ahead, "ppid": spare_of(LIGHT)["pid"], "warmed": []}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_the_sockets_of_a_warm_kernels_manager_reconnect_soon_and_no_other_kernels_do(warm: dict[str, str],
                                                                                     tmp_path: Path) -> None:
    """Note [Reconnecting clients] in provisioner.py, with a MultiKernelManager's shared context as in
    jupyter_server: the warm kernel's manager makes sockets that try again after 10 ms (zmq's default is
    100 ms), the shared context and what other kernels make from it keep zmq's defaults, and a channel made
    before a graceful restart hears the new kernel (its iopub welcome) once it listens."""
    import zmq
    from jupyter_client.multikernelmanager import MultiKernelManager
    from jupyter_client.session import Session

    mkm = MultiKernelManager(connection_dir=str(tmp_path))  # as jupyter_server's runtime dir, not the cwd
    kernel_id = mkm.start_kernel(kernel_name=LIGHT, env=warm)
    km = mkm.get_kernel(kernel_id)
    stream = km.connect_iopub()  # a ZMQStream, as jupyter_server's channels
    iopub = stream.socket
    try:
        assert iopub.getsockopt(zmq.RECONNECT_IVL) == 10 and iopub.getsockopt(zmq.RECONNECT_IVL_MAX) == 40
        other = mkm.context.socket(zmq.SUB)
        assert other.getsockopt(zmq.RECONNECT_IVL) == 100 and other.getsockopt(zmq.RECONNECT_IVL_MAX) == 0
        other.close(linger=0)
        assert km.context.underlying == mkm.context.underlying, "the same zmq context"
        session = Session(key=km.session.key)
        assert iopub.poll(30_000), "the welcome of the first kernel"
        session.recv(iopub)
        for _ in range(2):
            km.restart_kernel(now=False)
            assert iopub.poll(30_000), "the channel made before the restart hears the new kernel"
            while iopub.poll(0):
                session.recv(iopub)
    finally:
        stream.close(linger=0)
        mkm.shutdown_all(now=True)


@pytest.mark.parametrize("victim", ["old", "new"])
def test_a_kernel_killed_during_the_hand_over_restarts_cleanly(warm: dict[str, str], victim: str) -> None:
    """SIGKILL the old kernel right after the shutdown request, or the new one right after it was forked:
    the restart (and, for a new kernel that died, the next restart) ends with a working kernel from the
    spare on the same ports, and nothing is left behind."""
    km, kc = start(LIGHT, warm)
    who = "import json, os; print(json.dumps({'pid': os.getpid(), 'ppid': os.getppid()}))"
    killed: list[int] = []
    try:
        before = run_json(kc, who)
        if victim == "old":
            requested = km.provisioner.shutdown_requested

            async def kill_at_the_request(restart: bool = False) -> None:  # the request is on its way
                killed.append(km.provisioner.pid)
                os.kill(killed[-1], signal.SIGKILL)
                await requested(restart)

            km.provisioner.shutdown_requested = kill_at_the_request
            restart(km, kc)
            del km.provisioner.shutdown_requested
        else:
            launch = km._async_launch_kernel

            async def launch_then_kill(*args: Any, **kwargs: Any) -> None:
                await launch(*args, **kwargs)
                killed.append(km.provisioner.pid)
                os.kill(killed[-1], signal.SIGKILL)

            km._async_launch_kernel = launch_then_kill
            km.restart_kernel(now=False)
            km._async_launch_kernel = launch
            wait_until(lambda: not km.is_alive(), what="the killed kernel's death to be seen")
            assert km.provisioner.process.returncode == -signal.SIGKILL
            restart(km, kc)
        after = run_json(kc, who)
        assert after["pid"] not in (before["pid"], *killed)
        assert after["ppid"] == before["ppid"] == spare_of(LIGHT)["pid"], "forked from the same spare"
        assert execute(kc, "print(6 * 7)")[0] == "42\n"
        assert all(gone(pid) for pid in (before["pid"], *killed))
        assert spare_of(LIGHT)["kernels"] == [after["pid"]]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_dead_kernel_is_seen_and_a_killed_spare_is_replaced(warm: dict[str, str]) -> None:
    km, kc = start(LIGHT, warm)
    try:
        kc.execute("import os; os._exit(3)")
        wait_until(lambda: not km.is_alive(), what="the kernel's death to be seen")
        assert km.provisioner.process.returncode == 3, "the spare reports the exit code"
        restart(km, kc)
        spare = spare_of(LIGHT)["pid"]
        kernel = run_json(kc, "import json, os; print(json.dumps({'pid': os.getpid(), 'ppid': os.getppid()}))")
        assert kernel["ppid"] == spare
        os.kill(spare, signal.SIGKILL)
        wait_until(lambda: gone(spare), what="the spare to die")
        out, _ = execute(kc, "print(6 * 7)")
        assert out == "42\n", "a running kernel outlives its spare (Note [Kernel lifetime])"

        def replaced() -> bool:
            km.is_alive()  # the kernel restarter polls like this every few seconds
            info = spare_of(LIGHT)
            return info["pid"] != spare and info["state"] == "ready"

        wait_until(replaced, timeout=60, what="a new spare")
        restart(km, kc)
        again = run_json(kc, "import json, os; print(json.dumps({'pid': os.getpid(), 'ppid': os.getppid()}))")
        assert again["ppid"] == spare_of(LIGHT)["pid"] != spare
        assert gone(kernel["pid"])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_graceful_restart_after_a_crash_does_not_hand_the_new_kernel_the_old_shutdown(
        warm: dict[str, str]) -> None:
    """Note [Shutdown request to a dead kernel] in provisioner.py. The manager's control socket lingers
    2 s here instead of 0.1 s, so that the window the note closes is wide open rather than a race."""
    km, kc = start(LIGHT, warm)
    try:
        km._control_socket.linger = 2000
        for _ in range(2):
            kc.execute("import os; os._exit(3)")
            wait_until(lambda: not km.is_alive(), what="the kernel's death to be seen")
            restart(km, kc)
            km._control_socket.linger = 2000  # the manager made a new socket for the new kernel
            out, _ = execute(kc, "print(6 * 7)")
            assert out == "42\n" and km.is_alive(), "the new kernel runs: it did not get the old request"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_spare_is_replaced_when_the_environment_or_its_modules_change(warm: dict[str, str]) -> None:
    km, kc = start(LIGHT, warm)
    probe = "import json, os, sys, warm_probe; print(json.dumps({'ppid': os.getppid(), 'saw': warm_probe.SAW}))"
    try:
        before = run_json(kc, probe)
        restart(km, kc, now=True, env={**warm, "WARM_PROBE_SEEN": "changed"})
        changed = run_json(kc, probe)
        assert changed["ppid"] != before["ppid"] and changed["saw"] == "changed", \
            "a variable read at import time is seen with the kernel's value"
        module = Path(warm["PYTHONPATH"].split(os.pathsep)[0]) / "warm_probe.py"
        os.utime(module, ns=(time.time_ns(), time.time_ns()))  # what an upgrade does to a preloaded file
        restart(km, kc, now=True)
        upgraded = run_json(kc, probe)
        assert upgraded["ppid"] not in (before["ppid"], changed["ppid"]) and gone(changed["ppid"])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.parametrize("module, error", [("no_such_module_here", "import failed: ModuleNotFoundError"),
                                           ("warm_threaded", "importing it started threads ['warm-threaded']")])
def test_a_spare_that_cannot_preload_gives_plain_kernels(warm: dict[str, str], module: str, error: str) -> None:
    from overmind_jupyter import warm as warm_pkg

    probe = Path(warm["PYTHONPATH"].split(os.pathsep)[0])
    (probe / "warm_threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), name='warm-threaded', "
        "daemon=True).start()\n")
    name = f"om-warm-broken-{module.replace('_', '-')}"
    warm_pkg.install(name, preload=["json", module])  # into this module's data dir (JUPYTER_DATA_DIR)
    km, kc = start(name, warm)
    try:
        info = run_json(kc, "import json, os; print(json.dumps({'ppid': os.getppid()}))")
        assert info["ppid"] == os.getpid(), "a plain kernel, the child of its manager"
        spare = spare_of(name)
        assert spare["state"] == "failed" and f"{module}: {error}" in spare["error"], spare
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_the_spare_answers_bad_requests_with_errors_and_goes_on(warm: dict[str, str], tmp_path: Path) -> None:
    import asyncio

    from overmind_jupyter.warm.spares import Spare, SpareKey

    spare = Spare(SpareKey("protocol-test", (sys.executable,), ()), warm, str(tmp_path))
    try:
        loop = asyncio.new_event_loop()  # not asyncio.run, which leaves this thread without a current loop
        try:
            loop.run_until_complete(spare.wait_ready(60))
        finally:
            loop.close()
        for bad in (b"not json", b"[1]", b'{"kind": "nope"}', b'{"kind": "status"}', b'{"kind": "status", "pid": "x"}',
                    b'{"kind": "fork", "module": "m"}'):
            spare.sock.send(bad)
            answer = json.loads(spare.sock.recv(1 << 16))
            assert answer["kind"] == "error" and "bad request" in answer["error"], (bad, answer)
        r, w = os.pipe()
        socket.send_fds(spare.sock, [b'{"kind": "fork", "module": "m"}'], [r, w, w])  # fds, but no argv
        assert json.loads(spare.sock.recv(1 << 16))["kind"] == "error"
        os.close(r)
        os.close(w)
        assert spare.ping() == {"kind": "pong", "pid": spare.pid, "kernels": [], "ahead": [], "warmed": {}}
        assert spare.exit_status(12345678) == (None, False)
    finally:
        spare.stop()
    assert spare.proc.returncode == 0, "EOF ends the spare cleanly"


def test_stop_spares_ends_them_and_running_kernels_live_on(warm: dict[str, str]) -> None:
    from overmind_jupyter.warm import stop_spares

    km, kc = start(LIGHT, warm)
    try:
        spare = spare_of(LIGHT)["pid"]
        assert stop_spares() >= 1
        wait_until(lambda: gone(spare), timeout=10, what="the spare to exit")
        assert execute(kc, "print('still here')")[0] == "still here\n"
        assert not [p for p in psutil.Process().children(recursive=True) if is_spare(p) and not gone(p.pid)]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rest(port: int, path: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": "token warm-test"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
        return response.status, json.loads(text) if text else None


def test_a_jupyter_server_restarts_warm_kernels_and_its_spare_dies_with_it(warm: dict[str, str],
                                                                          tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
             "--IdentityProvider.token=warm-test", "--ServerApp.open_browser=False", "--allow-root",
             f"--ServerApp.root_dir={tmp_path}",
             "--ServerApp.ip=127.0.0.1"], env=warm, stdout=sink, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            try:
                return _rest(port, "/api/status")[0] == 200
            except OSError:
                assert server.poll() is None, log.read_text()
                return False

        wait_until(up, timeout=60, what="the jupyter server")
        status, kernel = _rest(port, "/api/kernels", "POST", {"name": LIGHT})
        assert status == 201, kernel

        def kernels() -> tuple[int, list[int]]:
            """The spare, and its children oldest first: the kernel, then the one started ahead."""
            spares = [p for p in psutil.Process(server.pid).children() if is_spare(p)]
            assert len(spares) == 1, log.read_text()
            children = sorted((c for c in spares[0].children() if not gone(c.pid)), key=lambda c: c.create_time())
            return spares[0].pid, [c.pid for c in children]

        spare, first = wait_until(lambda: len((k := kernels())[1]) == 2 and k,
                                  what="the forked kernel and the one started ahead")
        assert _rest(port, f"/api/kernels/{kernel['id']}/restart", "POST")[0] == 200
        spare_after, second = wait_until(lambda: len((k := kernels())[1]) == 2 and first[1] in k[1] and k,
                                         what="the restarted kernel and the next one started ahead")
        assert spare_after == spare and second[0] == first[1] and second[1] not in first and gone(first[0]), \
            "the restart started the kernel started ahead, and started the next one ahead"
        assert "forked from spare" in log.read_text() and "started ahead by spare" in log.read_text()
        server.kill()
        server.wait()
        wait_until(lambda: gone(spare) and all(gone(pid) for pid in second), timeout=15,
                   what="the spare, the kernel and the one started ahead to die with the server")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


SETUP = "import sys as _sys\n_preloaded = 'torch' in _sys.modules\n%load_ext overmind_jupyter\n%overmind on"
CELL = """
import time as _t, json as _j
_t0 = _t.perf_counter()
import torch
from transformers import AutoModelForCausalLM
_t1 = _t.perf_counter()
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32)
_t2 = _t.perf_counter()
with torch.no_grad():
    _out = model(torch.arange(10)[None]).logits.double().sum().item()
import overmind_jupyter
print(_j.dumps({{"preloaded": _preloaded, "imports": _t1 - _t0, "load": _t2 - _t1, "out": _out,
                "hits": overmind_jupyter.status()["daemon"]["stats"].get("hits", 0),
                "fallbacks": len(overmind_jupyter.loading.fallbacks())}}))
"""

# the same load once more, counting how often the hit asks how many objects are frozen
FREEZE_COUNTED = """
import gc, json, torch
from transformers import AutoModelForCausalLM
import overmind_jupyter
_hits = overmind_jupyter.loading.calls().get("hit", 0)
_counted, _count = [], gc.get_freeze_count
gc.get_freeze_count = lambda: _counted.append(1) or _count()
try:
    _again = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32)
finally:
    gc.get_freeze_count = _count
print(json.dumps({{"counted": len(_counted), "frozen": _count() > 0,
                  "hits": overmind_jupyter.loading.calls().get("hit", 0) - _hits}}))
"""


def test_after_a_restart_the_first_cell_imports_and_loads_a_cached_model_sooner(warm: dict[str, str],
                                                                                tiny_llama: Path) -> None:
    cell = CELL.format(path=str(tiny_llama))
    figures, probes, counted = {}, {}, {}
    for name in (PLAIN, WARM):
        km, kc = start(name, warm, cwd=REPO)
        try:
            execute(kc, SETUP)
            run_json(kc, cell)  # the first load of the day: a miss for the first kernel, then hits
            started = time.perf_counter()
            restart_s = restart(km, kc)
            setup_started = time.perf_counter()
            execute(kc, SETUP)
            setup_s = time.perf_counter() - setup_started
            result = run_json(kc, cell)
            result.update(restart=restart_s, setup=setup_s, ready=time.perf_counter() - started)
            figures[name] = result
            probes[name] = run_json(kc, PROBE)
            counted[name] = run_json(kc, FREEZE_COUNTED.format(path=str(tiny_llama)))
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    plain, warm_ = figures[PLAIN], figures[WARM]
    print("\nrestart to model ready, s: " + "; ".join(
        f"{n}: restart {f['restart']:.2f} + %overmind on {f['setup']:.2f} + imports {f['imports']:.2f} + load "
        f"{f['load']:.3f} -> {f['ready']:.2f}"
        for n, f in figures.items()) + f"; warm/plain {warm_['ready'] / plain['ready']:.2f}")
    assert plain["out"] == warm_["out"], "the same model, the same logits"
    assert plain["fallbacks"] == warm_["fallbacks"] == 0 and warm_["hits"] >= 3, "both cached loads were hits"
    assert warm_["preloaded"] and not plain["preloaded"], "the warm kernel started with torch imported"
    assert warm_["setup"] + warm_["imports"] < (plain["setup"] + plain["imports"]) / 4, "the imports were skipped"
    assert warm_["ready"] < plain["ready"], "and the kernel was model-ready sooner"
    # Note [Old at birth] in hit_tuning.py: the spare froze its heap and said so, so a hit in the warm
    # kernel never counts the frozen objects (a walk over all of them: 21 ms for a kernel with torch)
    assert counted[WARM] == {"counted": 0, "frozen": True, "hits": 1}, counted
    assert counted[PLAIN]["frozen"] is False and counted[PLAIN]["hits"] == 1, counted
    a, b = probes[PLAIN], probes[WARM]
    assert a["cwd"] == b["cwd"] and a["path"] == b["path"] and a["argv"][0] == b["argv"][0]
    assert a["orig_argv"][:3] == b["orig_argv"][:3] == [sys.executable, "-m", "ipykernel_launcher"]
    assert a["env"] == b["env"], "the same environment as a plain kernel"
