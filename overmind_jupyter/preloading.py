"""`preload`: warm the cache from a background worker process while the kernel goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .errors import PreloadError

__all__ = ["Preload", "PreloadError", "preload"]


class Preload:
    """A running preload. The kernel's own call of the same load waits for it instead of loading twice."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path, label: str) -> None:
        self._proc = proc
        self.log = log
        self.label = label
        self.pid = proc.pid

    def done(self) -> bool:
        return self._proc.poll() is not None

    def wait(self, timeout: float | None = None, *, show_progress: bool = True) -> None:
        """Wait for the worker; raises PreloadError if it could not load or publish.

        Args:
            timeout: seconds to wait at most (None: until it ends).
            show_progress: show the worker's load as a progress bar (tqdm, an ipywidgets bar in a
                notebook) with the model's name, percent and time left, read from the daemon.
        """
        try:
            if show_progress:
                self._follow(timeout)
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise PreloadError(f"preload of {self.label} still runs after {timeout} s (pid {self.pid}): wait again, "
                               f"with a larger timeout or none, or stop it with `kill {self.pid}`") from None
        if code != 0:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
            raise PreloadError(f"preload of {self.label} failed (exit {code}); {self.log} ends with:\n{tail}")

    def _follow(self, timeout: float | None) -> None:
        """Show the worker's progress as the daemon has it (Note [Progress] in kernel_server/store.py)
        until the worker ends or `timeout` passes (then the caller's wait raises)."""
        from kernel_server.client import shared_client
        from kernel_server.errors import DaemonError
        from kernel_server.operations import Op

        deadline = None if timeout is None else time.monotonic() + timeout
        bar: Any = None
        try:
            while self._proc.poll() is None and (deadline is None or time.monotonic() < deadline):
                try:
                    status = shared_client(spawn=False).request(Op.STATUS, limit=0, timeout=10)  # loads, no entries
                except DaemonError:
                    status = None
                load = next((x for x in (status["loading"] if status else []) if (x.get("loader") or {}).get("pid")
                             == self.pid and x.get("progress")), None)
                if load is not None:
                    bar = _show(bar, load["progress"])
                try:
                    self._proc.wait(_FOLLOW_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if bar is not None:
                bar.close()

    def __repr__(self) -> str:
        state = "running" if not self.done() else f"exit {self._proc.returncode}"
        return f"<Preload {self.label} pid {self.pid} {state}>"


_FOLLOW_S = 0.25  # how often a waiting cell reads the worker's progress


def _show(bar: Any, progress: dict[str, Any]) -> Any:
    """Move the cell's bar to `progress` (made on the first report, made anew when the phase changes)."""
    from tqdm.auto import tqdm

    desc = f"preload: {progress['label']}"
    if bar is None or bar.desc != desc:
        if bar is not None:
            bar.close()
        byte = progress.get("unit") == "B"
        bar = tqdm(total=progress.get("total") or None, desc=desc, unit="B" if byte else "it",
                   unit_scale=byte, unit_divisor=1024 if byte else 1000)
    bar.n = progress.get("done") or 0
    bar.refresh()
    return bar


def preload(owner: Any, *args: Any, **kwargs: Any) -> Preload:
    """Load `owner.from_pretrained(*args, **kwargs)` (or `owner(*args, **kwargs)` for a callable) into
    the cache in a background worker started with this interpreter, and return at once.

    Args:
        owner: a class with `from_pretrained` (`AutoModelForCausalLM`), or a loader callable.
        *args, **kwargs: the arguments of the load, as you will pass them later.

    Returns:
        A `Preload`; `.wait()` blocks until the entry is published.
    """
    import dill

    from kernel_server import lifecycle

    from . import targets

    # the library's own loader, also under `%overmind on`: the worker caches it, and dill pickles the
    # library's by reference where it would pickle our wrapper by value, with this module's state
    fn = targets.unpatched(getattr(owner, "from_pretrained") if isinstance(owner, type) else owner)  # noqa: B009
    label = f"{getattr(owner, '__name__', type(owner).__name__)}({', '.join(map(repr, args))[:80]})"
    # Two pickles: where to import from, then the job, whose loader may live in a module found only
    # through this kernel's sys.path (a directory the notebook appended, say).
    job = dill.dumps({"cwd": os.getcwd(), "path": list(sys.path)}) + dill.dumps(
        {"fn": fn, "args": args, "kwargs": kwargs, "parent": os.getpid()})
    home = lifecycle.state_dir()
    log = home / f"preload-{os.getpid()}-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "overmind_jupyter.worker"], stdin=subprocess.PIPE,
                                stdout=out, stderr=out, start_new_session=True, env=dict(os.environ))
    assert proc.stdin is not None
    proc.stdin.write(job)
    proc.stdin.close()
    return Preload(proc, log, label)
