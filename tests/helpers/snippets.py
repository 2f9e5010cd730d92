"""Running Python snippets in fresh interpreters, as separate kernels would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

__all__ = ["last_json", "run_py", "start_py"]


def run_py(code: str, *, env: dict[str, str] | None = None, timeout: float = 120, check: bool = True,
           cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet in a fresh interpreter (this venv's), with this test's environment."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"snippet failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_py(code: str, *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start a snippet that keeps running; its stdin and stdout are pipes."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env or dict(os.environ),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
