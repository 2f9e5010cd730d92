"""`make demo` (scripts/demo.py) works on copies of the notebooks and stops the daemon it started."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from kernel_server import lifecycle

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "scripts" / "demo.py"


def tracked_notebooks() -> dict[str, str]:
    """Every file under notebooks/ with its hash (models/ included: the demo builds nothing there)."""
    root = REPO / "notebooks"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def demo_env() -> dict[str, str]:
    return dict(os.environ, OVERMIND_DEMO_MODEL="tiny")


def test_demo_setup_copies_the_notebooks_and_leaves_the_tracked_ones_alone(tmp_path: Path) -> None:
    before = tracked_notebooks()
    workspace = tmp_path / "ws"
    out = subprocess.run([sys.executable, str(DEMO), "--setup-only", "--workspace", str(workspace)],
                         env=demo_env(), capture_output=True, text=True, timeout=600, check=True)
    assert tracked_notebooks() == before, "the demo's setup changed files under notebooks/"
    names = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in workspace.glob("*.ipynb")) == names
    assert (workspace / "models" / "llama-tiny" / "config.json").exists()
    assert str(workspace) in out.stdout
    # A copy edited since is kept on the next run (and said so); an unedited one is written again.
    (workspace / "quickstart.ipynb").write_text((workspace / "quickstart.ipynb").read_text().replace("}", "} ", 1))
    (workspace / "adapters.ipynb").unlink()
    again = subprocess.run([sys.executable, str(DEMO), "--setup-only", "--workspace", str(workspace)],
                           env=demo_env(), capture_output=True, text=True, timeout=600, check=True)
    assert f"kept your edited {workspace / 'quickstart.ipynb'}" in again.stdout
    assert "} " in (workspace / "quickstart.ipynb").read_text() and (workspace / "adapters.ipynb").exists()
    assert json.loads((workspace / "adapters.ipynb").read_text())["metadata"]["kernelspec"]["name"] == "overmind-warm"
    # the language_info its kernels report, so that JupyterLab opens the copies unmodified
    from ipykernel.ipkernel import IPythonKernel

    for copy in workspace.glob("*.ipynb"):
        assert json.loads(copy.read_text())["metadata"]["language_info"] == IPythonKernel.language_info, copy
    refused = subprocess.run([sys.executable, str(DEMO), "--setup-only", "--workspace", str(REPO / "notebooks")],
                             env=demo_env(), capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 2 and "lies in the tracked notebooks/" in refused.stderr


def test_demo_lab_serves_the_copies_and_stops_its_daemon(tmp_path: Path) -> None:
    before = tracked_notebooks()
    workspace = tmp_path / "ws"
    proc = subprocess.Popen([sys.executable, str(DEMO), "--workspace", str(workspace)], env=demo_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    lines: list[str] = []  # read all along: JupyterLab blocks on a full pipe otherwise
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        url = None
        while url is None and time.monotonic() < deadline:
            found = re.search(r"(http://127\.0\.0\.1:\d+)/lab/tree/quickstart\.ipynb\?token=(\w+)", "".join(lines))
            if found:
                url = found.groups()
            assert proc.poll() is None, "the demo ended early:\n" + "".join(lines)
            time.sleep(0.2)
        assert url is not None, "".join(lines)
        base, token = url
        # printed once the server answers: the first request needs no retry
        with urllib.request.urlopen(f"{base}/api/kernelspecs?token={token}", timeout=10) as r:
            specs = json.load(r)
        assert specs["default"] == "overmind-warm" and {"overmind-warm", "python3"} <= set(specs["kernelspecs"])
        text = "".join(lines)
        started = re.search(r"daemon pid (\d+) serves (\S+)", text)
        assert started, text
        daemon_pid, home = int(started.group(1)), started.group(2)
        assert "left sidebar" in text and "Restart Kernel" in text and "warm" in text
        with urllib.request.urlopen(f"{base}/api/contents/quickstart.ipynb?token={token}", timeout=10) as r:
            notebook = json.load(r)
        assert notebook["content"]["metadata"]["kernelspec"]["name"] == "overmind-warm"
        # JupyterLab's settings (a theme picked in the demo) and workspaces (its open tabs) stay in the demo's
        jupyter = workspace / ".jupyter"
        put(f"{base}/lab/api/settings/@jupyterlab/apputils-extension:themes?token={token}",
            {"raw": '{"theme": "JupyterLab Dark"}'})
        put(f"{base}/lab/api/workspaces/demo-check?token={token}",
            {"data": {}, "metadata": {"id": "demo-check"}})
        assert "JupyterLab Dark" in (jupyter / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
                                     / "themes.jupyterlab-settings").read_text()
        assert list((jupyter / "lab" / "workspaces").glob("demo-check*"))
        assert (jupyter / "data" / "kernels" / "overmind-warm" / "kernel.json").exists()
        # What autosave does: write the notebook back through the server. Only the copy changes.
        notebook["content"]["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "saved"})
        body = json.dumps({"type": "notebook", "format": "json", "content": notebook["content"]}).encode()
        put(f"{base}/api/contents/quickstart.ipynb?token={token}", body)
        assert "saved" in (workspace / "quickstart.ipynb").read_text()
        assert tracked_notebooks() == before
        assert not lifecycle.process_gone(daemon_pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(30)
    text = "".join(lines)
    assert f"stopped daemon pid {daemon_pid}" in text, text
    assert lifecycle.process_gone(daemon_pid)
    assert not Path(home).exists()
    assert f"The demo's workspace stays at {workspace}" in text and f"rm -r {workspace}" in text


def put(url: str, body: object) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="PUT", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).close()


def test_demo_headless_with_keep_daemon_says_how_to_stop_it_and_leave_nothing(tmp_path: Path) -> None:
    """`--keep-daemon` leaves the demo's daemon running; the command it prints stops it and removes its state
    directory (it was left behind)."""
    done = subprocess.run([sys.executable, str(DEMO), "--headless", "--keep-daemon", "--workspace", str(tmp_path)],
                          env=demo_env(), capture_output=True, text=True, timeout=600, check=True)
    assert "outputs identical: True" in done.stdout, done.stdout + done.stderr
    command = re.search(r"^\s+(OVERMIND_HOME=(\S+) .* -m kernel_server stop && rm -r \S+)$", done.stdout, re.M)
    assert command, done.stdout
    home = Path(command.group(2))
    assert lifecycle.running(home)
    subprocess.run(command.group(1), shell=True, check=True, capture_output=True, timeout=60)
    assert not home.exists() and not lifecycle.running(home)
