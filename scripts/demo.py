"""`make demo`: JupyterLab on 127.0.0.1 with the demo notebooks, in a scratch workspace of their own.

    python scripts/demo.py                 # JupyterLab (foreground; Ctrl-C stops it and the demo's daemon)
    python scripts/demo.py --keep-daemon   # ... and leave the daemon running (it says how to stop it)
    python scripts/demo.py --headless      # no browser: load the model in two fresh processes, print both times
    python scripts/demo.py --setup-only    # copy the notebooks and build the model, then stop

The demo never opens the tracked notebooks: it copies notebooks/*.ipynb into a workspace (default
~/.cache/overmind-demo, or --workspace), builds the quickstart's model there once (under models/, as the
notebooks do), and serves that directory, so JupyterLab's autosave writes only the copies. A copy you
edited is kept on the next run (delete it to start again from the tracked notebook); an unedited one is
refreshed. JupyterLab's settings, its workspaces (open tabs) and its kernelspecs live in the workspace's
.jupyter/ too, so the demo never changes your own JupyterLab's theme or layout. It installs the warm
kernelspec there and opens the notebooks with it: a restart forks a kernel that has torch and transformers
imported already. It starts a daemon of its own (a private OVERMIND_HOME, so it never stops one of yours)
and stops it when JupyterLab ends. OVERMIND_DEMO_MODEL picks the model's size ("tiny", "0.1b", "1.1b");
the default is 0.1b.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SIZE = os.environ.get("OVERMIND_DEMO_MODEL", "0.1b")

LOAD = """
import json, time, torch
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama  # imported before the clock, as in a warm kernel
import overmind_jupyter
t = time.perf_counter()
model = overmind_jupyter.cached(AutoModelForCausalLM.from_pretrained, {path!r}, dtype=torch.float32)
loaded = time.perf_counter() - t
with torch.no_grad():
    logits = model(torch.arange(16)[None]).logits
print(json.dumps({{"load_s": loaded, "checksum": float(logits.double().sum())}}))
"""


def default_workspace() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "overmind-demo"


def prepare(workspace: Path) -> Path:
    """Copy the tracked notebooks into `workspace` (keeping a copy edited since the demo made it) and build
    the quickstart's model under `workspace/models` once; returns the model's directory."""
    from overmind_jupyter.demo_models import build_llama

    workspace.mkdir(parents=True, exist_ok=True)
    made = workspace / ".jupyter" / "copies.json"  # notebook -> hash of the copy the demo wrote
    made.parent.mkdir(exist_ok=True)
    copies = json.loads(made.read_text()) if made.exists() else {}
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        copy = workspace / notebook.name
        if copy.exists() and copies.get(notebook.name) != _digest(copy.read_bytes()):
            print(f"kept your edited {copy} (delete it to start again from notebooks/{notebook.name})", flush=True)
            continue
        text = json.loads(notebook.read_text())
        # what JupyterLab writes into the notebook when the kernel starts: a notebook that differs opens
        # marked modified (the tracked ones carry the language_info of the Python they were saved with)
        text["metadata"]["kernelspec"] = {"name": WARM, "display_name": WARM_DISPLAY, "language": "python"}
        text["metadata"]["language_info"] = language_info()
        data = (json.dumps(text, indent=1, ensure_ascii=False) + "\n").encode()
        copy.write_bytes(data)
        copies[notebook.name] = _digest(data)
    made.write_text(json.dumps(copies, indent=1))
    path = workspace / "models" / f"llama-{SIZE}"
    print(f"demo workspace {workspace} (copies of notebooks/; the tracked files stay as they are)", flush=True)
    print(f"building a {SIZE} Llama-shaped model in {path} (once)...", flush=True)
    return build_llama(path, SIZE)


def language_info() -> dict[str, Any]:
    """The `language_info` the demo's kernels report (ipykernel's, for this Python): the copies carry it."""
    from ipykernel.ipkernel import IPythonKernel

    return json.loads(json.dumps(IPythonKernel.language_info))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


WARM = "overmind-warm"
WARM_DISPLAY = "Python 3 (overmind warm: torch and transformers imported ahead)"


def demo_env(workspace: Path | None = None) -> dict[str, str]:
    """The demo's environment: a private OVERMIND_HOME (short: it holds the daemon's socket) and, for
    JupyterLab, Jupyter's config, data, settings and workspaces directories in `workspace/.jupyter`."""
    home = tempfile.mkdtemp(prefix="om-demo-", dir="/tmp" if os.path.isdir("/tmp") else None)
    env = dict(os.environ, OVERMIND_HOME=home, TRANSFORMERS_VERBOSITY="error")
    if workspace is not None:
        jupyter = workspace / ".jupyter"
        env.update(JUPYTER_CONFIG_DIR=str(jupyter / "config"), JUPYTER_DATA_DIR=str(jupyter / "data"),
                   JUPYTERLAB_SETTINGS_DIR=str(jupyter / "lab" / "user-settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(jupyter / "lab" / "workspaces"))
    return env


def install_warm_kernelspec(env: dict[str, str]) -> None:
    """The warm kernelspec, in the demo's own Jupyter data directory (never the user's)."""
    subprocess.run([sys.executable, "-m", "overmind_jupyter.warm", "install", "--name", WARM,
                    "--display-name", WARM_DISPLAY], env=env, check=True, capture_output=True, text=True)


def wait_listening(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> bool:
    """Whether JupyterLab answers at `url` (its API status) before `timeout`, or False once it ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def daemon(env: dict[str, str], command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kernel_server", command], env=env, check=False,
                          capture_output=True, text=True)


def finish(env: dict[str, str], keep: bool, workspace: Path | None = None) -> None:
    """Stop the demo's daemon, or say that it keeps running and how to stop it; say what stays on disk."""
    home = env["OVERMIND_HOME"]
    if workspace is not None and workspace.exists():
        size = sum(p.stat().st_size for p in workspace.rglob("*") if p.is_file() and not p.is_symlink())
        print(f"\nThe demo's workspace stays at {workspace} ({size / 1e9:.1f} GB: the notebooks' copies, the model, "
              f"JupyterLab's settings); the next make demo reuses it. Remove it with:  rm -r {workspace}", flush=True)
    if keep:
        print(f"\nThe demo's daemon keeps running and holds its cached models in memory. Stop it, and remove its "
              f"state directory, with:\n\n    OVERMIND_HOME={home} {sys.executable} -m kernel_server stop && rm -r "
              f"{home}\n", flush=True)
        return
    print(daemon(env, "stop").stdout.strip() + " (the demo's daemon; its cached models are freed)", flush=True)
    shutil.rmtree(home, ignore_errors=True)


def headless(path: Path, keep: bool) -> None:
    env = demo_env()
    try:
        results = []
        for run in ("first process (miss: load and publish)", "second process (hit: shared memory)"):
            out = subprocess.run([sys.executable, "-c", LOAD.format(path=str(path))], env=env, check=True,
                                 capture_output=True, text=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(result)
            print(f"{run:42} from_pretrained took {result['load_s'] * 1000:8.1f} ms")
        same = results[0]["checksum"] == results[1]["checksum"]
        print(f"speed-up {results[0]['load_s'] / results[1]['load_s']:.1f}x; outputs identical: {same}")
    finally:
        finish(env, keep)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lab(workspace: Path, keep: bool) -> int:
    env = demo_env(workspace)
    install_warm_kernelspec(env)
    started = daemon(env, "start")  # now, so that the side panel shows it before any notebook runs
    print(started.stdout.strip() or started.stderr.strip(), flush=True)
    port, token = free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}/lab/tree/quickstart.ipynb?token={token}"
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={workspace}", f"--MappingKernelManager.default_kernel_name={WARM}"]
    if os.getuid() == 0:
        command.append("--allow-root")
    proc = subprocess.Popen(command, cwd=workspace, env=env)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # stop what we started, also when killed
    try:
        try:
            if wait_listening(f"http://127.0.0.1:{port}/api/status?token={token}", proc):
                print(f"\nJupyterLab with the quickstart notebook:\n\n    {url}\n\n"
                      f"The notebooks run on the kernel '{WARM_DISPLAY}': each kernel is\n"
                      "forked from a process that imported them already, so Kernel > Restart Kernel gives a fresh\n"
                      "kernel with the model back in about 0.1 s ('Python 3' is the plain kernel, for comparison).\n"
                      "The overmind side panel: the overmind icon in the left sidebar (or the status bar's overmind\n"
                      "item, or the command palette's 'Show the Overmind Panel'). JupyterLab's settings and open tabs\n"
                      f"for the demo are kept in {workspace / '.jupyter'}, apart from yours.\n"
                      + ("Ctrl-C stops JupyterLab; the demo's daemon keeps running (--keep-daemon).\n" if keep
                         else "Ctrl-C stops JupyterLab and the demo's daemon.\n"), flush=True)
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            return proc.wait()
    finally:
        finish(env, keep, workspace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headless", action="store_true", help="no JupyterLab: two processes, two loads")
    parser.add_argument("--setup-only", action="store_true", help="copy the notebooks, build the model, stop")
    parser.add_argument("--keep-daemon", action="store_true", help="leave the demo's daemon running at the end")
    parser.add_argument("--workspace", type=Path, default=default_workspace(),
                        help="where the copies of the notebooks and the models go (default: %(default)s)")
    args = parser.parse_args()
    workspace = args.workspace.resolve()
    if workspace == NOTEBOOKS or NOTEBOOKS in workspace.parents:
        parser.error(f"--workspace {workspace} lies in the tracked notebooks/; choose a directory outside it")
    path = prepare(workspace)
    if args.setup_only:
        return 0
    if args.headless:
        headless(path, args.keep_daemon)
        return 0
    return lab(workspace, args.keep_daemon)


if __name__ == "__main__":
    sys.exit(main())
