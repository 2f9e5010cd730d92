"""Real IPython kernels through jupyter_client, started as JupyterLab starts them: progress bars on
(tqdm's monitor thread runs), and optionally a thread of the user's own alive."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["USER_THREAD", "execute", "execute_all", "kernel", "kernel_env", "magic_json"]

# A cell that leaves a thread of the user's running, as a data loader or a progress monitor would.
USER_THREAD = """
import threading as _t, time as _time
_t.Thread(target=lambda: [_time.sleep(0.005) for _ in iter(int, 1)], name="user-thread", daemon=True).start()
"""


def kernel_env(**extra: str) -> dict[str, str]:
    """This test's environment for a kernel, with progress bars as a user has them (not disabled)."""
    env = dict(os.environ, **extra)
    env.pop("TQDM_DISABLE", None)
    return env


@contextmanager
def kernel(env: dict[str, str] | None = None, cwd: str | None = None) -> Iterator[tuple[Any, Any]]:
    """A started python3 kernel (this venv's) and its blocking client; shut down at the end."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", env=env or kernel_env(), cwd=cwd, startup_timeout=120)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def execute(kc: Any, code: str, timeout: float = 300) -> str:
    """Run `code` in the kernel; its stdout. Raises AssertionError with the traceback on an error."""
    return "".join(text for kind, text in execute_all(kc, code, timeout) if kind == "stdout")


def execute_all(kc: Any, code: str, timeout: float = 300) -> list[tuple[str, str]]:
    """Run `code` in the kernel; everything it showed, in order, as (kind, text): "stdout", "stderr",
    or "display" (the text/plain form of a displayed object, such as a progress bar widget)."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append((content["name"], content["text"]))
        elif kind in ("display_data", "update_display_data", "execute_result"):
            out.append(("display", str(content.get("data", {}).get("text/plain", ""))))
        elif kind == "error":
            raise AssertionError("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return out


def magic_json(shell: Any, line: str) -> Any:
    """What `%overmind LINE --json` prints, read back (the magic prints JSON; it returns nothing)."""
    import contextlib
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert shell.run_line_magic("overmind", f"{line} --json") is None
    return json.loads(out.getvalue())
