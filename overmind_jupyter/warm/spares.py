"""The Jupyter server's side of the spares: one spare process per kernelspec, shared by every kernel manager
of this server process, and the handle on a kernel forked from one.

A `Spare` starts `zygote.py` with the kernel's interpreter, environment and working directory and talks
to it over a socket pair (the wire format in `zygote.py`'s docstring). The registry (`spare_for`, `revive`,
`stop_spares`, `describe_spares`) keys spares by kernelspec, interpreter and preload list; a spare whose
environment no longer matches the kernel's, or whose preloaded modules changed on disk, is replaced, one
that died is replaced, one that failed to import stays failed (kernels then start plainly) until `stop_spares()`.

Lifetime: a spare exits on EOF of its socket, so it dies with this process however this process ends
(the socket's other end is never inherited by anything else); `stop_spares` also runs at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from kernel_server import settings

from ..errors import OvermindError
from .zygote import MAX_MESSAGE, PROTOCOL, expand_preload

__all__ = ["PER_KERNEL_ENV", "ForkedKernel", "Spare", "SpareKey", "SpareUnavailable", "describe_spares", "revive",
           "spare_for", "stop_spares"]

# Note [Per-kernel environment]
# Each kernel a spare forks gets its own whole environment, the one its launch asked for (`become_kernel`
# in zygote.py); what the preloaded modules did to os.environ while they were imported is replayed on top
# of it, as if they had been imported there. These variables differ from one kernel to the next by design
# (jupyter_server and jupyter_client set them per kernel), or are read by the kernels alone, after their
# fork (OVERMIND_WARM_DEVICES: Note [Devices warmed ahead] in warmup.py): a spare is started without them
# and every kernel gets them from its own launch. Any other difference between a kernel's environment and
# its spare's means the preloaded modules saw a different environment, so the spare is replaced.
PER_KERNEL_ENV = ("JPY_SESSION_NAME", "JPY_PARENT_PID", "JPY_INTERRUPT_EVENT", "IPY_INTERRUPT_EVENT", "KERNEL_ID",
                  settings.WARM_DEVICES.env)

_log = logging.getLogger(__name__)


class SpareUnavailable(OvermindError):
    """No spare can fork this kernel (still importing, failed, died, or the argv is not `python -m ...`);
    the provisioner starts a plain kernel instead and logs this message."""


@dataclass(frozen=True)
class SpareKey:
    """What makes two kernels able to share a spare."""

    spec: str  # the kernelspec's resource directory (or name)
    interpreter: tuple[str, ...]  # the argv before `-m`: python and its flags
    preload: tuple[str, ...]


class Spare:
    """One spare process (see zygote.py) and the socket to it.

    Args:
        key: what the spare serves.
        env: its environment: the kernels' environment without `PER_KERNEL_ENV`.
        cwd: its working directory (that of the kernel that asked first).
        crashes: how many spares of this key died before becoming ready, in a row.
    """

    def __init__(self, key: SpareKey, env: dict[str, str], cwd: str, crashes: int = 0) -> None:
        self.key, self.env, self.cwd, self.crashes = key, env, cwd, crashes
        self.state = "starting"  # -> ready -> died | stopped; or -> failed (import error) | crashed
        self.error: str | None = None
        self.info: dict[str, Any] = {}
        self.started = time.monotonic()
        self._lock = threading.Lock()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [*key.interpreter, "-m", "overmind_jupyter.warm.zygote", "--fd", str(theirs.fileno()),
               "--preload", ",".join(expand_preload(key.preload))]
        try:
            self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                         pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError:
            mine.close()
            raise
        finally:
            theirs.close()
        self.sock = mine
        _log.info("Started spare %d for %s, preloading %s", self.proc.pid, key.spec, ",".join(key.preload))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> str:
        """Update and return the state without blocking."""
        with self._lock:
            if self.state == "starting":
                try:
                    data: bytes | None = self.sock.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    data = None
                except OSError:
                    data = b""
                if data:
                    self._hello(data)
                elif data == b"" or self.proc.poll() is not None:
                    self.proc.poll()
                    self.state, self.error = "crashed", (
                        f"spare {self.pid} exited with code {self.proc.returncode} while importing")
            elif self.state == "ready" and self.proc.poll() is not None:
                self.state, self.error = "died", f"spare {self.pid} exited with code {self.proc.returncode}"
            return self.state

    def _hello(self, data: bytes) -> None:
        try:
            message = json.loads(data)
        except ValueError:
            message = {}
        if message.get("version") != PROTOCOL:
            self.state, self.error = "failed", (
                f"spare {self.pid} speaks protocol {message.get('version')}, this server {PROTOCOL}: "
                "restart the Jupyter server after upgrading overmind_jupyter")
            self._kill()
        elif message.get("kind") == "ready":
            self.state, self.info = "ready", message
            _log.info("Spare %d ready: %d modules in %.1f s", self.pid, len(message.get("modules", ())),
                      message.get("seconds", 0.0))
        else:
            self.state = "failed"
            self.error = f"spare for {self.key.spec} could not preload {message.get('error')}"

    async def wait_ready(self, timeout: float) -> None:
        """Wait (without blocking the event loop) until the spare has imported everything.

        Raises:
            SpareUnavailable: it failed, died, or is still importing after `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while self.check() == "starting":
            if time.monotonic() > deadline:
                raise SpareUnavailable(f"spare {self.pid} still importing after {timeout:.0f} s")
            await asyncio.sleep(0.02)
        if self.state != "ready":
            raise SpareUnavailable(self.error or f"spare {self.pid} is {self.state}")

    def _request(self, message: dict[str, Any], fds: list[int] | None = None,
                 timeout: float = 10.0) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            if self.state != "ready":
                raise SpareUnavailable(self.error or f"spare {self.pid} is {self.state}")
            try:
                data = json.dumps(message).encode()
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.send(data)
                if not select.select([self.sock], [], [], timeout)[0]:  # a late reply would pair with the
                    self.state = "died"  # next request: this spare is done, the next start replaces it
                    self.error = f"spare {self.pid} did not answer {message['kind']!r} in {timeout} s"
                    self._kill()
                    raise SpareUnavailable(self.error)
                reply, got, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
            except OSError as exc:
                self.state, self.error = "died", f"spare {self.pid} is gone ({exc})"
                raise SpareUnavailable(self.error) from exc
            if not reply:
                self.state, self.error = "died", f"spare {self.pid} closed its socket"
                raise SpareUnavailable(self.error)
            answer = json.loads(reply)
            if answer.get("kind") == "error":
                for fd in got:
                    os.close(fd)
                raise SpareUnavailable(f"spare {self.pid} refused {message['kind']!r}: {answer.get('error')}")
            return answer, got

    def fork(self, *, module: str, args: list[str], argv: list[str], env: dict[str, str], cwd: str,
             parent_pid: int | None, fast_exit: bool, stdio: tuple[int, int, int],
             bound: int | None = None) -> tuple[int, int | None]:
        """Fork a kernel; returns its pid and a pidfd of it (None where unsupported). With `bound` (the write
        end of a pipe), one started ahead, which waits for `start` and then writes a byte there once it
        listens (Note [Kernels started ahead] in zygote.py)."""
        request = {"kind": "fork", "module": module, "args": args, "argv": argv, "env": env, "cwd": cwd,
                   "parent_pid": parent_pid, "fast_exit": fast_exit, "ahead": bound is not None}
        answer, fds = self._request(request, [*stdio, *([] if bound is None else [bound])])
        return int(answer["pid"]), (fds[0] if fds else None)

    def start(self, pid: int) -> None:
        """Let the kernel `pid`, started ahead, bind its ports and run.

        Raises:
            SpareUnavailable: the spare holds no such kernel (it died) or is gone.
        """
        self._request({"kind": "start", "pid": pid})

    def discard(self, pid: int) -> None:
        """End the kernel `pid`, started ahead and never started (nothing if the spare is gone)."""
        try:
            self._request({"kind": "discard", "pid": pid}, timeout=2.0)
        except SpareUnavailable:  # a spare that is gone took it along (EOF on its socket)
            pass

    def exit_status(self, pid: int) -> tuple[int | None, bool]:
        """The exit code of a kernel this spare forked, and whether the spare knows that kernel at all."""
        try:
            answer, _ = self._request({"kind": "status", "pid": pid}, timeout=2.0)
        except SpareUnavailable:
            return None, False
        return answer.get("code"), bool(answer.get("known"))

    def ping(self) -> dict[str, Any]:
        return self._request({"kind": "ping"})[0]

    def _kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Close the socket (the spare exits on EOF); kill it if it has not exited within `timeout`."""
        with self._lock:
            if self.state in ("starting", "ready"):
                self.state = "stopped"
            self.sock.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            self.proc.wait()

    def changed_on_disk(self) -> list[str]:
        """The preloaded files rewritten since the spare imported them (an upgrade, say)."""
        changed = []
        for path, mtime in self.info.get("stamps", {}).items():
            try:
                if os.stat(path).st_mtime_ns != mtime:
                    changed.append(path)
            except OSError:
                changed.append(path)
        return changed

    def describe(self) -> dict[str, Any]:
        pong: dict[str, Any] = {}
        if self.check() == "ready":
            try:
                pong = self.ping()
            except SpareUnavailable:
                pass
        return {"spec": self.key.spec, "preload": list(self.key.preload), "pid": self.pid, "state": self.state,
                "error": self.error, "modules": self.info.get("modules", []), "seconds": self.info.get("seconds"),
                "kernels": pong.get("kernels", []), "ahead": pong.get("ahead", []),
                "warmed": {int(pid): devices for pid, devices in pong.get("warmed", {}).items()}}


class ForkedKernel:
    """The `subprocess.Popen` subset that `LocalProvisioner` uses, for a kernel forked by a spare.

    Liveness comes from a pidfd (no pid reuse), the exit code from the spare that reaped the kernel.
    A kernel whose spare is gone (killed or replaced) still reports its exit, with code 1 when the real
    code is unknowable: only a process's parent can read it.
    """

    stdin: IO[bytes] | None = None
    stdout: IO[bytes] | None = None
    stderr: IO[bytes] | None = None
    bound: int | None = None  # a kernel started ahead writes here once it listens (WarmProvisioner._bound)

    def __init__(self, spare: Spare, pid: int, pidfd: int | None) -> None:
        self.spare, self.pid, self._pidfd = spare, pid, pidfd
        self.returncode: int | None = None

    def _exited(self) -> bool:
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], 0)[0])
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return True  # the pid now belongs to someone else
        code, _known = self.spare.exit_status(self.pid)
        return code is not None  # a zombie the spare has not reaped yet

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self._exited():
            return None
        code, known = self.spare.exit_status(self.pid)
        if code is None and known:  # exited but not yet reaped: the spare reaps it on the next ask
            time.sleep(0.01)
            code, known = self.spare.exit_status(self.pid)
        self.returncode = code if code is not None else 1
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, sig)
        else:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if self._pidfd is not None:
            try:
                os.close(self._pidfd)
            except OSError:
                pass
            self._pidfd = None


_SPARES: dict[SpareKey, Spare] = {}
_REGISTRY = threading.Lock()
_MAX_CRASHES = 3


def spare_for(key: SpareKey, env: dict[str, str], cwd: str) -> Spare:
    """The spare for `key`, started (or replaced) as needed; it may still be importing."""
    with _REGISTRY:
        spare = _SPARES.get(key)
        crashes = 0
        if spare is not None:
            state = spare.check()
            if spare.env != env:
                names = sorted(k for k in set(env) | set(spare.env) if env.get(k) != spare.env.get(k))
                _log.info("The environment changed (%s): replacing spare %d", ", ".join(names[:8]), spare.pid)
            elif state == "crashed" and spare.crashes + 1 < _MAX_CRASHES:
                crashes = spare.crashes + 1
                _log.warning("%s; starting another", spare.error)
            elif state == "died":
                _log.warning("%s; starting another", spare.error)
            elif state == "ready" and (changed := spare.changed_on_disk()):
                _log.info("Preloaded modules changed on disk (%s): replacing spare %d", ", ".join(changed[:3]),
                          spare.pid)
            else:
                return spare  # starting, ready, failed (stays failed), or crashed too often
            spare.stop(timeout=1.0)
        spare = _SPARES[key] = Spare(key, env, cwd, crashes)
        return spare


def revive(key: SpareKey) -> None:
    """Replace the spare of `key` if it died after becoming ready (without waiting for the new one)."""
    spare = _SPARES.get(key)
    if spare is not None and spare.check() == "died":
        spare_for(key, spare.env, spare.cwd)


def stop_spares(timeout: float = 5.0) -> int:
    """Stop every spare of this process (kernels already forked keep running); returns how many."""
    with _REGISTRY:
        stopping = list(_SPARES.values())
        _SPARES.clear()
    for spare in stopping:
        spare.stop(timeout)
    return len(stopping)


def describe_spares() -> list[dict[str, Any]]:
    """What the spares of this process are doing: spec, preload, pid, state, error, modules, seconds, the
    pids of the kernels each forked that are still running, and of those started ahead and waiting, and
    `warmed`: {pid: what it warmed} of those waiting that have warmed their devices (Note [Devices warmed
    ahead] in warmup.py)."""
    with _REGISTRY:
        current = list(_SPARES.values())
    return [spare.describe() for spare in current]


atexit.register(stop_spares)
