"""Settings (kernel_server/settings.py): declared once, validated, in traitlets' order, and a bad value
never stops the extension or the daemon (Note [Bad settings]); the budget honours the memory limit
(Note [Memory limit])."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel_server import Client, settings
from kernel_server.lifecycle import log_path
from tests.helpers.snippets import last_json, run_py

REPO = Path(__file__).resolve().parent.parent

# One bad value for every setting, with a piece of the message it must give.
BAD = {
    "OVERMIND_ENABLED": ("maybe", "neither on"),
    "OVERMIND_HOME": ("relative/dir", "not an absolute path"),
    "OVERMIND_BUDGET": ("abc", "not a size"),
    "OVERMIND_WAIT_TIMEOUT": ("ten minutes", "not a duration"),
    "OVERMIND_ARENA": ("bogus", "not one of auto, memfd, file"),
    "OVERMIND_ARENA_DIR": ("arenas", "not an absolute path"),
    "OVERMIND_DISK_RESERVE": ("lots", "not a size or a percentage of the disk"),
    "OVERMIND_POPULATE": ("sometimes", "neither on"),
    "OVERMIND_COMPACT": ("2", "neither on"),
    "OVERMIND_FAKE_GPUS": ("lots", "not a device list"),
    "OVERMIND_GPU_RESERVE": ("-1", "not a non-negative number of GiB"),
    "OVERMIND_UNITS_TIMEOUT": ("x", "not a duration"),
    "OVERMIND_WARM": ("perhaps", "neither on"),
    "OVERMIND_DEVICE_COPIER": ("gpu", "not one of auto, off, cpu"),
    "OVERMIND_DEVICE_COPY_IDLE": ("soon", "not a duration"),
    "OVERMIND_WARM_DEVICES": ("gpu0", "not auto, off, or devices joined by commas"),
}

LOAD_EXT = """
    import json, warnings
    from IPython.core.interactiveshell import InteractiveShell
    ip = InteractiveShell.instance()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ip.run_line_magic("load_ext", "overmind_jupyter")
        {more}
    import overmind_jupyter
    from overmind_jupyter import loading
    print(json.dumps({{"warnings": [str(w.message) for w in caught], "enabled": overmind_jupyter.is_enabled(),
                      "wait_timeout": loading.options.wait_timeout, "backing": loading.options.backing,
                      "populate": loading.options.populate, "out": out}}))
"""


def load_ext(env: dict[str, str], more: str = "out = None") -> dict:
    return last_json(run_py(LOAD_EXT.format(more=more), env=env))


def test_every_setting_is_declared_once_and_readme_lists_them_all() -> None:
    names = [s.name for s in settings.SETTINGS]
    envs = [s.env for s in settings.SETTINGS]
    assert len(set(names)) == len(names) and len(set(envs)) == len(envs)
    assert set(BAD) == set(envs), "every setting has a bad value tried below"
    readme = (REPO / "README.md").read_text()
    table = re.search(r"<!-- settings table:.*?-->\n(.*?)<!-- end of settings table -->", readme, re.DOTALL)
    assert table is not None, "README's settings table lost its markers"
    assert table.group(1) == settings.markdown_table(), \
        "README's settings table differs from kernel_server/settings.py: paste `python -m kernel_server.settings`"
    used = set(re.findall(r"OVERMIND_[A-Z_]+", "".join(
        p.read_text() for pkg in ("overmind_jupyter", "kernel_server") for p in (REPO / pkg).rglob("*.py"))))
    assert used <= set(envs), f"variables read but not declared: {sorted(used - set(envs))}"


def test_the_configurable_has_a_trait_for_each_setting_a_kernel_reads_or_hands_on() -> None:
    from overmind_jupyter.config import Overmind

    traits = Overmind.class_traits(config=True)
    declared = {s.name: s for s in settings.SETTINGS if s.read_by != "server"}
    assert set(traits) == set(declared)
    assert all(trait.setting is declared[name] for name, trait in traits.items()), "each made from its own setting"


def test_every_bad_value_is_named_with_an_example_and_the_extension_still_loads(overmind_home: Path) -> None:
    """All at once: `%load_ext` succeeds, each gives its own message (variable, value, example),
    and the cache stays off (`OVERMIND_ENABLED=maybe` is not a yes)."""
    env = dict(os.environ, **{var: value for var, (value, _) in BAD.items()})
    env["OVERMIND_HOME"] = BAD["OVERMIND_HOME"][0]
    out = load_ext(env, more="from overmind_jupyter.warm.provisioner import WarmProvisioner; "
                              "out = WarmProvisioner().enabled")
    assert not out["enabled"], "a bad OVERMIND_ENABLED leaves the cache off"
    assert out["out"] is True, "a bad OVERMIND_WARM gives the default (on)"
    assert (out["wait_timeout"], out["backing"], out["populate"]) == (600.0, "auto", True), "the defaults"
    for var, (value, reason) in BAD.items():
        [message] = [w for w in out["warnings"] if w.startswith(f"{var}={value!r} ")]
        assert reason in message and f"write e.g. {var}=" in message and "using the default" in message
    declared = {s.env: s for s in settings.SETTINGS}
    for var in BAD:
        example = re.search(rf"write e\.g\. {var}=(\S+);", " ".join(out["warnings"])).group(1)
        declared[var].parse(example)  # the example given is a good value


def test_with_bad_values_the_cache_works_on_its_defaults_and_the_daemon_says_why(
        overmind_home: Path, tiny_llama: Path) -> None:
    """The daemon started by a kernel whose environment holds bad values for the daemon's settings:
    it starts, logs each once, and serves with the defaults; the load is cached."""
    daemon_side = ("OVERMIND_BUDGET", "OVERMIND_COMPACT", "OVERMIND_GPU_RESERVE", "OVERMIND_ARENA_DIR")
    env = dict(os.environ, OVERMIND_ENABLED="1", **{v: BAD[v][0] for v in daemon_side})
    load = f"""
        from transformers import AutoModelForCausalLM
        from overmind_jupyter import loading
        AutoModelForCausalLM.from_pretrained({str(tiny_llama)!r})
        out = loading.calls()"""
    out = load_ext(env, more=textwrap.indent(textwrap.dedent(load), "    ").strip())
    assert out["enabled"] and out["out"]["miss"] == 1, out
    with Client(overmind_home, spawn=False, role="test") as client:
        status = client.request("status")
    assert status["budget"] == settings.memory_limit()[0] // 2
    assert status["units"]["config_error"] and "OVERMIND_GPU_RESERVE='-1'" in status["units"]["config_error"]
    log = log_path(overmind_home).read_text()
    for var in daemon_side:
        assert log.count(f"{var}={BAD[var][0]!r}") == 1, f"{var} reported once in the daemon log"
    assert "Traceback" not in log


def test_the_command_line_beats_the_config_file_which_beats_the_environment(tmp_path: Path) -> None:
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "ipython_config.py").write_text("c.Overmind.wait_timeout = 5\nc.Overmind.populate = False\n")
    code = ("from overmind_jupyter.config import Overmind; import json; "
            "o = Overmind(parent=get_ipython()); print(json.dumps([o.wait_timeout, o.populate, o.arena]))")
    env = dict(os.environ, OVERMIND_WAIT_TIMEOUT="7", OVERMIND_POPULATE="1", OVERMIND_ARENA="memfd")

    def ipython(*args: str) -> list:
        proc = subprocess.run([sys.executable, "-m", "IPython", f"--profile-dir={profile}", *args, "-c", code],
                              env=env, capture_output=True, text=True, timeout=120, check=True)
        return last_json(proc)

    assert ipython() == [5.0, False, "memfd"], "the file over the environment; the environment as default"
    assert ipython("--Overmind.wait_timeout=9") == [9.0, False, "memfd"], "the command line over the file"


def test_config_values_are_checked_as_the_environment_s_are() -> None:
    from traitlets.config import Config

    from overmind_jupyter.config import Overmind

    cfg = Config()
    cfg.Overmind.wait_timeout = "10m"
    cfg.Overmind.budget = "1G"
    o = Overmind(config=cfg)
    assert (o.wait_timeout, o.budget) == (600.0, 1 << 30)
    cfg.Overmind.wait_timeout = "soon"
    with pytest.warns(settings.SettingWarning, match=r"c\.Overmind\.wait_timeout = 'soon' is not a duration.*"
                                                     r"write e\.g\. c\.Overmind\.wait_timeout = '10m'"):
        assert Overmind(config=cfg).wait_timeout == 600.0


def test_the_devices_warmed_ahead_are_auto_off_or_a_list() -> None:
    parse = settings.WARM_DEVICES.parse
    assert [parse(v) for v in ("auto", "on", "1", "off", "0", "no")] == ["auto"] * 3 + ["off"] * 3
    assert parse(" CUDA:1, cuda ,cpu,cuda:0") == "cuda:1,cuda:0,cpu", "named once each, `cuda` is cuda:0"
    for bad in ("", "gpu", "cuda:", "cuda:x", "cuda:0;cuda:1", "2"):
        with pytest.raises(settings.SettingError, match="not auto, off, or devices"):
            parse(bad)


def test_budgets_above_the_memory_limit_are_refused() -> None:
    limit, limited_by = settings.memory_limit()
    assert settings.BUDGET.parse("50%") == limit // 2
    assert settings.BUDGET.parse(f"{limit}") == limit
    for too_much in ("150%", "1T", str(limit + 1)):
        with pytest.raises(settings.SettingError,
                           match=rf"more than the .* GiB of memory .*\({re.escape(limited_by)}\)"):
            settings.BUDGET.parse(too_much)


# -- the memory limit of a cgroup ------------------------------------------------------------------

def fake_proc(tmp_path: Path, cgroup: str, mounts: list[tuple[str, str, str, str]],
              files: dict[str, str]) -> Path:
    """A /proc/self with `cgroup` and a mountinfo of `mounts` ((root, mount point, fstype, options)),
    and the cgroup files `files` (path under tmp_path -> content)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(
        f"{30 + i} 23 0:{40 + i} {root} {tmp_path / point} rw,relatime - {fstype} cgroup rw,{options}\n"
        for i, (root, point, fstype, options) in enumerate(mounts)))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return proc


def test_a_cgroup_v2_limit_of_the_process_or_an_ancestor_counts(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "0::/user.slice/jupyter/kernel\n", [("/", "unified", "cgroup2", "")], {
        "unified/user.slice/memory.max": "8589934592\n",
        "unified/user.slice/jupyter/memory.max": "max\n",
        "unified/user.slice/jupyter/kernel/memory.max": "max\n",
    })
    assert settings.cgroup_memory_limit(proc) == (8 << 30, str(tmp_path / "unified/user.slice"))


def test_a_cgroup_v1_limit_counts_and_no_limit_is_none(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "4:memory:/docker/abc\n3:cpu:/docker/abc\n",
                     [("/docker", "memory", "cgroup", "memory"), ("/", "cpu", "cgroup", "cpu")], {
                         "memory/abc/memory.limit_in_bytes": "2147483648\n",
                         "memory/memory.limit_in_bytes": "9223372036854771712\n",
                     })
    assert settings.cgroup_memory_limit(proc) == (2 << 30, str(tmp_path / "memory/abc"))
    (tmp_path / "memory/abc/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert settings.cgroup_memory_limit(proc) is None


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A real memory cgroup limited to 2 GiB, made under this process's own (cgroup v1 or v2) where the
    machine lets us (root, a writable cgroup filesystem); skipped elsewhere."""
    for _, directory, limit_name in settings.memory_cgroups():
        if not os.access(directory, os.W_OK):
            continue
        made = Path(tempfile.mkdtemp(prefix="overmind-test-", dir=directory))
        try:
            (made / limit_name).write_text(str(2 << 30))
        except OSError:
            made.rmdir()
            continue
        break
    else:
        pytest.skip("no memory cgroup can be made here (needs root and a writable cgroup filesystem)")
    try:
        yield made
    finally:
        deadline = time.monotonic() + 10
        while True:  # a cgroup can be removed once its last process is gone
            try:
                made.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_the_default_budget_of_a_daemon_in_a_memory_cgroup_is_half_its_limit(
        overmind_home: Path, memory_cgroup: Path) -> None:
    from tests.conftest import stop_daemon

    def into_cgroup() -> None:
        (memory_cgroup / "cgroup.procs").write_text(str(os.getpid()))

    env = {k: v for k, v in os.environ.items() if k != "OVERMIND_BUDGET"}
    subprocess.run([sys.executable, "-m", "kernel_server", "start", "--daemonize"], env=env, cwd=REPO,
                   preexec_fn=into_cgroup, check=True, timeout=60)
    try:
        with Client(overmind_home, spawn=False, role="test") as client:
            assert client.budget == 1 << 30, "half of the cgroup's 2 GiB, not of the machine's memory"
            assert str(client.daemon_pid) in (memory_cgroup / "cgroup.procs").read_text().split()
    finally:
        stop_daemon(overmind_home)
    inside = subprocess.run(
        [sys.executable, "-c", "from kernel_server import settings; settings.BUDGET.parse('3G')"],
        env=env, preexec_fn=into_cgroup, capture_output=True, text=True, timeout=60, check=False)
    assert inside.returncode != 0
    assert (f"OVERMIND_BUDGET='3G' is 3.0 GiB, more than the 2.0 GiB of memory this machine lets the daemon "
            f"use (the memory limit of cgroup {memory_cgroup})") in inside.stderr


def test_a_kernel_that_loads_the_extension_from_its_config_shows_its_bad_settings_at_its_first_cell(
        overmind_home: Path, tmp_path: Path) -> None:
    """ipykernel loads the extensions of its config before any cell runs, and sends what they print with no
    parent, which no notebook shows: a bad value must reach the user anyway, once, in the first cell."""
    from tests.helpers.kernels import execute_all, kernel, kernel_env

    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    (profile / "ipython_config.py").write_text('c.InteractiveShellApp.extensions = ["overmind_jupyter"]\n'
                                               'c.Overmind.enabled = True\nc.Overmind.wait_timeout = "ten minutes"\n')
    with kernel(kernel_env(IPYTHONDIR=str(tmp_path / "ipython"), OVERMIND_ARENA="bogus")) as (_, kc):
        first = execute_all(kc, "print('first')")
        second = execute_all(kc, "from overmind_jupyter import loading; print(loading.options.wait_timeout)")
    said = "".join(text for kind, text in first if kind == "stderr")
    assert "c.Overmind.wait_timeout = 'ten minutes' is not a duration" in said, first
    assert "OVERMIND_ARENA='bogus' is not one of auto, memfd, file" in said, first
    assert first[-1] == ("stdout", "first\n"), "before the cell's own output"
    assert second == [("stdout", "600.0\n")], "said once; the default is in effect"


def test_an_arena_directory_that_names_a_file_is_a_bad_value(tmp_path: Path) -> None:
    """Else every load fell back with a bare "File exists", or used memory while status named the file."""
    a_file = tmp_path / "afile"
    a_file.write_text("")
    with pytest.raises(settings.SettingError, match=f"OVERMIND_ARENA_DIR='{a_file}' is not a directory"):
        settings.ARENA_DIR.read({"OVERMIND_ARENA_DIR": str(a_file)})
    assert settings.ARENA_DIR.read({"OVERMIND_ARENA_DIR": str(tmp_path / "new")}) == str(tmp_path / "new")
