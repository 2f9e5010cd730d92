"""How the side panel names what the daemon reports: by the Jupyter server's sessions.

The panel's state is overmind_jupyter/view.py's `state_view` of the daemon's `status` reply (its shape
is written there), with the daemon's connections named by this server's sessions (`Names`, Note [Kernels
by notebook]); `down_state` is the answer while no daemon runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kernel_server.formats import kernel_name

__all__ = ["Names", "ServerKernel", "down_state"]

# How a preload's worker process labels itself (overmind_jupyter/worker.py).
_PRELOAD = re.compile(r"preload for pid (\d+)")


# Note [Kernels by notebook]
# The daemon knows a connection by its pid, its role and the label the process gave it (a kernel's
# notebook path from JPY_SESSION_NAME, or "kernel ID" for a kernel started without a session). The
# Jupyter server knows which notebook or console each of its kernels serves, and the pid of each kernel
# it started. So the server names the daemon's connections: by the session path of the kernel with that
# pid (or with that kernel id in its label), else as the CLI and the widgets do (formats.kernel_name).
# The pid stays in `detail`, for the hover.


@dataclass(frozen=True)
class ServerKernel:
    """One kernel of this Jupyter server, as its session manager knows it.

    Args:
        kernel_id: the server's id of the kernel.
        pid: the kernel process's pid (None for a kernel that is not a local process).
        path: the notebook's or console's path in the server's root ("" for a kernel without a session).
        session_type: "notebook", "console", "file"... as the session says.
    """

    kernel_id: str
    pid: int | None
    path: str
    session_type: str


class Names:
    """How the panel names each connection of the daemon, from the server's kernels (see the Note)."""

    def __init__(self, kernels: Iterable[ServerKernel] = ()) -> None:
        self._by_pid = {k.pid: k for k in kernels if k.pid is not None}
        self._by_id = {k.kernel_id: k for k in kernels}

    def connection(self, conn: Mapping[str, Any]) -> dict[str, Any]:
        """`conn` (a connection as the daemon describes it) with `name` and `detail`, and the session's
        `path`, `session_type` and `kernel_id` when it is one of this server's kernels."""
        pid = conn.get("pid")
        label = str(conn.get("label") or "")
        kernel = ((self._by_pid.get(pid) if isinstance(pid, int) else None)
                  or self._by_id.get(label.removeprefix("kernel ")))
        out = dict(conn)
        if kernel is not None and kernel.path:
            out.update(path=kernel.path, session_type=kernel.session_type, kernel_id=kernel.kernel_id,
                       name=kernel.path, detail=f"pid {pid}, {kernel.session_type} kernel {kernel.kernel_id[:8]}")
        else:  # outside this server: as the CLI and the widgets name it
            out["name"], out["detail"] = kernel_name(conn)
            parent = _PRELOAD.fullmatch(label)
            kernel = self._by_pid.get(int(parent.group(1))) if parent else None
            if kernel is not None and kernel.path:  # a preload's worker, for one of this server's kernels
                out["name"] = f"preload for {kernel.path}"
        return out


def down_state(home: str, message: str) -> dict[str, Any]:
    """The answer while no daemon runs: a state of the panel, not an error (no model was loaded yet)."""
    return {"state": "down", "home": home, "message": message}
