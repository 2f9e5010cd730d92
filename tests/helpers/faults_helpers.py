"""Loaders, checksums and daemon probes for the fault, load and fuzz tests (tests/test_faults.py,
tests/test_load.py, tests/test_fuzz.py) and benchmarks/soak.py.

The loaders make the timing windows of a fault deterministic without any hook in the product: a
loader, or an object inside a cached graph, announces itself with a file in the directory named by
$FAULTS_GATE and then waits while the file `closed` exists there. The gate is read from the
environment, not from the arguments, so that it is no part of the cache key.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.helpers import tiny_modules

__all__ = [
    "Gate",
    "PackingGate",
    "Rendezvous",
    "daemon_fds",
    "daemon_log",
    "daemon_pid",
    "digest",
    "from_pretrained_after",
    "gated_build",
    "kill_daemon",
    "packing_gated_build",
    "rendezvous_build",
    "wait_until",
]


# -- checksums ---------------------------------------------------------------------------------------------

def digest(model: nn.Module) -> str:
    """A checksum of every tensor of `model`, bit for bit: names, dtypes, shapes, strides, storage offsets,
    bytes, and which tensors share a storage (tied weights stay tied)."""
    h = hashlib.sha256()
    first_name: dict[tuple[int, str], str] = {}
    for name, kept in model.state_dict(keep_vars=True).items():
        t = kept.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{t.stride()}|{t.storage_offset()}|{t.device}".encode())
        if t.device.type == "meta":
            continue
        storage = (t.untyped_storage().data_ptr(), str(t.device))
        h.update(first_name.setdefault(storage, name).encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- gates -------------------------------------------------------------------------------------------------

class Gate:
    """A directory named by $FAULTS_GATE: loaders announce themselves there and wait while it is closed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        (self.path / "closed").touch()

    def open(self) -> None:
        (self.path / "closed").unlink(missing_ok=True)

    def arrived(self, what: str) -> list[int]:
        """Pids that announced `what` ("started", "rebuilding")."""
        return [int(p.name.rsplit("-", 1)[1]) for p in self.path.glob(f"{what}-*")]

    def wait_for(self, what: str, timeout: float = 60.0) -> list[int]:
        wait_until(lambda: bool(self.arrived(what)), timeout, f"nobody announced {what!r} in {self.path}")
        return self.arrived(what)


def _announce_and_wait(what: str) -> None:
    gate = os.environ.get("FAULTS_GATE")
    if not gate:
        return
    Path(gate, f"{what}-{os.getpid()}").touch()
    wait_until(lambda: not Path(gate, "closed").exists(), 120.0, f"gate {gate} stayed closed")


def gated_build(kind: str = "mlp", seed: int = 0, **kwargs: Any) -> nn.Module:
    """`tiny_modules.build`, once the gate is open: an in-flight load that lasts as long as a test wants."""
    _announce_and_wait("started")
    return tiny_modules.build(kind, seed, **kwargs)


class Rendezvous:
    """An attribute of a cached model: rebuilding it from an entry (a hit) announces "rebuilding" and waits
    at the gate, between the daemon's lookup answer and the end of the rebuild."""

    def __reduce__(self) -> tuple[Callable[[], Rendezvous], tuple[()]]:
        return _rendezvous, ()


def _rendezvous() -> Rendezvous:
    _announce_and_wait("rebuilding")
    return Rendezvous()


def rendezvous_build(kind: str = "mlp", seed: int = 0, **kwargs: Any) -> nn.Module:
    model = tiny_modules.build(kind, seed, **kwargs)
    model.rendezvous = Rendezvous()
    return model


class PackingGate:
    """An attribute of a cached model: packing it (a miss caching the result it loaded) announces "packing"
    and waits at the gate, after the load and before the entry is published."""

    def __reduce__(self) -> tuple[type[PackingGate], tuple[()]]:
        _announce_and_wait("packing")
        return PackingGate, ()


def packing_gated_build(kind: str = "mlp", seed: int = 0, **kwargs: Any) -> nn.Module:
    model = tiny_modules.build(kind, seed, **kwargs)
    model.packing = PackingGate()
    return model


def from_pretrained_after(pretrained_model_name_or_path: str, dtype: Any = None) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained`, after doing to the checkpoint what $FAULTS_MUTATE says
    (once): "delete" removes it, "rewrite:DIR" copies DIR's files over it. This happens after the cache
    key fingerprinted the checkpoint and before transformers reads it."""
    from transformers import AutoModelForCausalLM

    action = os.environ.pop("FAULTS_MUTATE", "")
    path = Path(pretrained_model_name_or_path)
    if action == "delete":
        shutil.rmtree(path)
    elif action.startswith("rewrite:"):
        for src in Path(action.removeprefix("rewrite:")).iterdir():
            shutil.copy(src, path / src.name)  # new bytes, new mtimes
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


# -- the daemon, from outside ------------------------------------------------------------------------------

def daemon_pid(home: Path) -> int | None:
    try:
        return int((home / "daemon.lock").read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None


def daemon_log(home: Path) -> str:
    try:
        return (home / "daemon.log").read_text(errors="replace")
    except OSError:
        return ""


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def kill_daemon(home: Path) -> int:
    """SIGKILL the daemon of `home` and wait until it is gone; returns its pid."""
    from kernel_server.lifecycle import process_gone

    pid = daemon_pid(home)
    assert pid is not None, f"no daemon at {home}"
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: process_gone(pid), 10.0, f"daemon {pid} survived SIGKILL")
    return pid


def wait_until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something true, and return that; AssertionError naming `what`
    after `timeout` seconds. The one waiting helper of the suite."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.002)
