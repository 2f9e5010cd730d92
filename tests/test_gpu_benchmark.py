"""benchmarks/gpu.py end to end without a GPU (its --dry-run), so that a session lent a GPU for minutes spends
them measuring, not debugging the script: every case, the warm restart and the probes' processes run with CPU
stand-ins, and what needs CUDA or a package the device lacks is skipped with a message that says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu.py"
CUDA_ONLY = ("cudaHostRegister: CUDA only",)


def dry_run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--models-dir", str(tmp_path / "models"),
                           "--out", str(out), *args], env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_dry_run_measures_every_case_the_warm_restart_and_the_probes(tmp_path: Path) -> None:
    report, table = dry_run(tmp_path)
    assert report["dry_run"] and report["device"] == "cpu" and "no CUDA device (--dry-run)" in report["notes"][0]
    cases = report["sizes"]["tiny"]["cases"]
    for name in ("plain", "miss", "hit", "copy"):
        row = cases[name]
        assert not row["errors"] and not row["fallbacks"], (name, row)
        assert row["call"] > 0 and row["first"] > 0 and row["total"] >= row["call"] + row["first"], (name, row)
    assert cases["plain"]["x_plain"] == 1 and "tokens_differ" not in cases, "the four cases make the same token"
    warm = report["warm"]["tiny"]
    assert warm["hits"] == len(warm["runs"]) == 1 and warm["ready"] >= warm["restart"] + warm["call"]
    [warmed] = warm["warmed"]  # the kernel started ahead ran the warm-up's steps on the CPU before the restart
    assert warmed["device"] == "cpu" and warmed["error"] is None and warm["runs"][0]["warmed_ahead"] == [warmed]
    probes = report["sizes"]["tiny"]["probes"]
    assert "error" not in probes, probes
    rows = probes["probes"]
    assert list(rows) == ["pageable", "pageable-4", "bounce", "d2d", "pinned", "pinned-ro", "register-private"]
    for name in ("pageable", "pageable-4", "bounce", "d2d", "pinned", "pinned-ro"):
        assert rows[name]["checked"] and rows[name]["gbps"] > 0, (name, rows[name])
    assert "open_s" in rows["d2d"] and "open_s" in rows["pinned"], "the handles were opened in the other process"
    assert rows["pinned"]["note"].startswith(CUDA_ONLY) and rows["register-private"]["skipped"].startswith(CUDA_ONLY)
    for line in ("DRY RUN", "warm restart: restart", "warmed ahead of the restart: cpu", "copy probes",
                 "goal (issue 36):", "tiny: miss"):
        assert line in table, table
    assert (tmp_path / "gpu.txt").read_text() in table, "the table is written beside the JSON"


def test_a_run_stopped_by_sigterm_writes_what_ran_and_its_table(tmp_path: Path) -> None:
    """Note [A report that survives the time limit]: gpu_run.sh's `timeout` sends SIGTERM to the run's
    process group; the run stops what it started and writes its report and table. Before, it died with
    nothing written."""
    out = tmp_path / "gpu.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--no-warm", "--no-probes", "--models-dir",
                             str(tmp_path / "models"), "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("building tiny")
        os.killpg(proc.pid, signal.SIGTERM)  # as `timeout` does: the run and what it started in its group
        printed, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, printed
    report = json.loads(out.read_text())
    assert report["notes"][-1].startswith("stopped by SIGTERM after"), report
    assert out.with_suffix(".txt").read_text() in printed and "stopped by SIGTERM" in printed, printed


def test_logits_that_differ_from_the_plain_loads_are_flagged() -> None:
    """The hit's weights are the plain load's bytes: its logits' checksum differing is said under the
    table (before, each case's checksum was measured and never compared)."""
    gpu = _gpu_module()

    def run(checksum: float) -> dict[str, Any]:
        return {"ctx": 0.1, "call": 1.0, "copy": 0.5, "first": 0.2, "total": 1.3, "steady": 0.1, "token": 5,
                "checksum": checksum}

    rows = gpu.summarize({"plain": [run(1.5), run(1.5)], "miss": [run(1.5)], "hit": [run(1.25)], "copy": []},
                         10**9)
    assert rows["checksums_differ"] == {"plain": [1.5], "hit": [1.25]} and "copy" not in rows, rows
    assert "tokens_differ" not in rows and rows["hit"]["copy_gbps"] == 2.0
    text = gpu.table({"dry_run": False, "device": "cuda", "notes": [], "wall_s": 1.0,
                      "sizes": {"1.1b": {"bytes": 10**9, "cases": rows}}})
    assert "LOGITS' CHECKSUMS DIFFER from plain's: plain [1.5]; hit [1.25]" in text, text


_BLOCKER = """
import os, sys

class _NotOnTheDevice:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in os.environ["OM_BLOCK"].split(","):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotOnTheDevice())
"""


def test_without_the_carried_wheels_the_dry_run_says_what_it_skips(tmp_path: Path) -> None:
    """As on the device before the wheels are installed: no dill, traitlets, ipykernel, IPython, jupyter_client."""
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(textwrap.dedent(_BLOCKER))
    env = dict(os.environ, OM_BLOCK="dill,traitlets,ipykernel,IPython,jupyter_client",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "blocker"), str(REPO), os.environ.get("PYTHONPATH", "")]))
    report, table = dry_run(tmp_path, "--no-probes", env=env)
    assert list(report["sizes"]["tiny"]["cases"]) == ["plain"]
    assert not report["sizes"]["tiny"]["cases"]["plain"]["errors"]
    assert any(n.startswith("traitlets, dill not importable here: the miss and hit cases are skipped")
               for n in report["notes"]), report["notes"]
    assert report["warm"]["skipped"].startswith("ipykernel, jupyter_client, IPython, traitlets not importable"), report
    assert "scripts/device_wheels.sh" in table and "warm restart: skipped" in table


def _gpu_module() -> Any:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu


def test_a_job_that_hangs_is_killed_and_the_next_one_runs(tmp_path: Path) -> None:
    """A probe stuck in a driver call (a registration that never ends) costs its timeout, not the run."""
    gpu = _gpu_module()
    parent = gpu.ForkParent(dict(os.environ), tmp_path / "parent.log")
    try:
        hung = parent.run({"job": "sleep", "seconds": 60}, timeout=1)
        assert hung["partial"] and hung["error"].startswith("timed out after 1 s"), hung
        assert parent.run({"job": "sleep", "seconds": 0}, timeout=30) == {"partial": True}
    finally:
        parent.close()


def test_two_lines_that_come_at_once_are_both_read_without_waiting() -> None:
    """A job that ends at once: the fork parent's "pid" and "code" lines reach the pipe together. A buffered
    readline took both, and the wait for the second then ran to its timeout (the job reported as hung)."""
    gpu = _gpu_module()
    read, write = os.pipe()
    try:
        os.write(write, b'{"pid": 7}\n{"code": 0}\n{"pa')
        lines = gpu.JsonLines(read)
        started = time.monotonic()
        assert lines.next(5) == {"pid": 7} and lines.next(5) == {"code": 0}
        assert time.monotonic() - started < 1, "the second line was waited for"
        assert lines.next(0.05) is None  # the third is not whole yet
        os.write(write, b'rtial": true}\n')
        assert lines.next(5) == {"partial": True}
        os.close(write)
        write = -1
        with pytest.raises(EOFError):
            lines.next(5)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
