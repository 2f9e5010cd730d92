"""`WarmProvisioner`: a jupyter_client kernel provisioner that hands out pre-warmed kernels.

Selected by a kernelspec whose `metadata.kernel_provisioner.provisioner_name` is `overmind-warm` (the
entry point in the group `jupyter_client.kernel_provisioners`); `python -m overmind_jupyter.warm install`
writes such a kernelspec. Its `config` sets the traits below, e.g. `{"preload": ["torch", "transformers"]}`.

Everything but the launch is `LocalProvisioner`'s: ports, connection file, signals to the kernel's process
group, shutdown, cleanup. The launch asks this kernelspec's spare (`spares.py`) to fork a kernel with the
argv, environment and working directory the plain launch would have used, and keeps a `ForkedKernel`
where `LocalProvisioner` keeps its `Popen`. When no spare can serve (it failed to import, the argv is not
`python -m module ...`, `OVERMIND_WARM=0`), the kernel starts plainly, and the log says why
(docs/design.md invariant 1: never worse than without us).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from traitlets import Bool, Float, List, Unicode, default

from kernel_server import settings

from . import spares
from .spares import ForkedKernel, SpareKey, SpareUnavailable
from .zygote import DEFAULT_PRELOAD

__all__ = ["WarmProvisioner"]


def split_argv(cmd: list[str]) -> tuple[tuple[str, ...], str, list[str]]:
    """`[python, *flags, "-m", module, *args]` -> `((python, *flags), module, args)`.

    Raises:
        SpareUnavailable: the command does not have that shape (a spare can only run a module).
    """
    if "-m" in cmd[1:]:
        at = cmd.index("-m", 1)
        flags = cmd[1:at]
        if at + 1 < len(cmd) and all(f.startswith("-") and f not in ("-c", "-") for f in flags):
            return tuple(cmd[:at]), cmd[at + 1], list(cmd[at + 2:])
    raise SpareUnavailable(f"the kernelspec's argv {cmd!r} is not `python [flags] -m module ...`")


BIND_TIMEOUT = 30.0  # seconds a launch waits for a forked kernel to listen (Note [Launched means listening])
RECONNECT_IVL_MS, RECONNECT_IVL_MAX_MS = 10, 40  # zmq's defaults: 100 and 0 (Note [Reconnecting clients])


def listening_ports() -> set[int]:
    """The local TCP ports some process of this machine's network namespace listens on (/proc/net/tcp{,6})."""
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split(None, 4)
                    if len(fields) > 3 and fields[3] == "0A":  # st: TCP_LISTEN
                        found.add(int(fields[1].rpartition(":")[2], 16))
        except OSError:
            continue
    return found


class _Stdio:
    """The three fds a kernel gets, built from Popen-style arguments, and the pipe ends we keep."""

    def __init__(self, stdin: Any, stdout: Any, stderr: Any) -> None:
        self.fds: list[int] = []
        self._close_after: list[int] = []
        self.keep: dict[str, Any] = {}
        self.fds.append(self._one("stdin", stdin, 0))
        self.fds.append(self._one("stdout", stdout, 1))
        if stderr == subprocess.STDOUT:
            self.fds.append(self.fds[1])
        else:
            self.fds.append(self._one("stderr", stderr, 2))

    def _one(self, name: str, value: Any, default_fd: int) -> int:
        reading = name == "stdin"
        if value is None and reading:  # jupyter_client's launcher: a pipe whose write end is closed at once
            r, w = os.pipe()
            self._close_after += [r, w]
            return r
        if value is None:
            try:
                os.fstat(default_fd)
                return default_fd
            except OSError:
                value = subprocess.DEVNULL
        if value == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            self._close_after.append(fd)
            return fd
        if value == subprocess.PIPE:
            r, w = os.pipe()
            theirs, ours = (r, w) if reading else (w, r)
            self._close_after.append(theirs)
            self.keep[name] = os.fdopen(ours, "wb" if reading else "rb")
            return theirs
        return value if isinstance(value, int) else value.fileno()

    def close(self) -> None:
        for fd in self._close_after:
            os.close(fd)
        self._close_after = []


@dataclass
class _Ahead:
    """A kernel started ahead (Note [Kernels started ahead] in zygote.py) and the start it was made for."""

    spare: spares.Spare
    kernel: ForkedKernel
    request: dict[str, Any]  # what `Spare.fork` was asked: argv, environment, working directory ...
    stdio: tuple[Any, Any, Any]  # the launch's stdin, stdout and stderr arguments
    connection: dict[str, Any]  # the connection info it read (ports, key)

    def discard(self) -> None:
        self.spare.discard(self.kernel.pid)
        if self.kernel.bound is not None:
            os.close(self.kernel.bound)
            self.kernel.bound = None
        for name in ("stdin", "stdout", "stderr"):
            pipe = getattr(self.kernel, name)
            if pipe is not None:
                pipe.close()


class WarmProvisioner(LocalProvisioner):
    """Starts kernels by forking them from a spare process that has already imported `preload`.

    One spare per kernelspec lives in the Jupyter server process for as long as it runs (shared by all
    kernels of that kernelspec); each start or restart forks a fresh kernel from it, so a kernel never
    inherits anything from an earlier one. See docs/warm-kernels.md.
    """

    preload = List(Unicode(), default_value=list(DEFAULT_PRELOAD), config=True,
                   help="Modules the spare imports before forking kernels. A package with a lazy top level "
                        "(transformers, diffusers, peft) also brings its model-loading core; a dotted name "
                        "may also be a module attribute (transformers.AutoModelForCausalLM).")
    kernel_env_keys = List(Unicode(), default_value=[], config=True,
                           help="Environment variables, beyond JPY_SESSION_NAME and the other per-kernel "
                                "ones, that may differ between kernels without replacing the spare.")
    ready_timeout = Float(300.0, config=True,
                          help="Seconds a start waits for a spare still importing before starting plainly.")
    enabled = Bool(config=True, help="False starts plain kernels (environment: OVERMIND_WARM=0).")
    fast_exit = Bool(True, config=True,
                     help="A forked kernel ends with atexit handlers, closing open files and os._exit, "
                          "skipping the ~1 s teardown of torch's modules (see Note [Fast exit] in zygote.py).")

    exit_grace = Float(1.0, config=True,
                       help="Seconds a graceful shutdown or restart waits for the kernel's own exit before the "
                            "kernel manager's polling takes over (Note [What a restart waits for]).")

    start_ahead = Bool(True, config=True,
                       help="Keep the next kernel started ahead (a waiting process, about 40 MB of its own), so that a "
                            "restart only binds its ports (Note [Kernels started ahead] in zygote.py).")

    _key: SpareKey | None = None
    _unread_shutdown_until = 0.0  # see Note [Shutdown request to a dead kernel]
    _ahead: _Ahead | None = None
    _ahead_round = 0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ahead_lock = threading.Lock()

    @default("enabled")
    def _enabled_default(self) -> bool:
        return bool(settings.get(settings.WARM))

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        if self.enabled:
            self._reconnect_sooner()
        return await super().pre_launch(**kwargs)

    def _reconnect_sooner(self) -> None:
        """Note [Reconnecting clients]: a restart keeps the clients connected to the kernel's ports. When
        the old kernel exits, each of their sockets tries again after zmq's `reconnect_ivl` (100 ms, plus
        up to as much again of jitter), and after every refused attempt as long again: so a client sees the
        new kernel 100-200 ms after the old one exited however soon the new one listens. JupyterLab's
        client is such a socket: jupyter_server keeps the websocket's zmq channels (made by this kernel's
        manager, `connect_iopub` ...) while the browser reconnects after a restart, reuses them, and opens
        the websocket once an iopub message arrived on them (its `nudge`, retried every 0.5 s). So the
        sockets this kernel's manager makes from now on try every 10-20 ms at first, backing off to 40-50 ms
        (what a dead kernel's clients keep trying). jupyter_server shares one context among all its kernels:
        the setting goes on this kernel's own view of it (a shadow, the same zmq context), so no other
        kernel's sockets change. Clients with a context of their own (`KernelManager.client()`, nbclient)
        keep zmq's defaults."""
        manager = self.parent
        context = getattr(manager, "context", None)
        if not isinstance(context, zmq.Context) or context.sockopts.get(zmq.RECONNECT_IVL) == RECONNECT_IVL_MS:
            return
        if not getattr(manager, "_created_context", True):  # shared: a shadow (a manager that made its
            context = type(context).shadow(context)  # own context destroys it, which a shadow must not do)
            setattr(manager, "context", context)  # noqa: B010 (the parent is typed Any | None)
        context.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        context.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Fork the kernel from the spare; start it plainly when no spare can serve."""
        if not self.enabled or kwargs.get("independent") or not sys.platform.startswith("linux"):
            return await super().launch_kernel(cmd, **kwargs)  # forking after imports is a Linux design
        try:
            return await self._launch_warm(cmd, kwargs)
        except SpareUnavailable as exc:
            self.log.warning("No warm kernel (%s): starting a plain one", exc)
            return await super().launch_kernel(cmd, **kwargs)

    async def shutdown_requested(self, restart: bool = False) -> None:
        """Note [Shutdown request to a dead kernel]: a graceful restart sends `shutdown_request` on the
        manager's control socket even when the kernel already died. No one reads it: zmq keeps it queued
        for the socket's linger (100 ms in jupyter_client) after the manager closes the socket, and
        reconnects meanwhile. A plain kernel takes seconds to bind the same cached port, but a forked one
        binds in milliseconds, receives that request and shuts down ("Kernel died before replying to
        kernel_info"). So the next launch waits until the request has expired."""
        await super().shutdown_requested(restart)
        if self.process is not None and self.process.poll() is not None:
            control = getattr(self.parent, "_control_socket", None)
            linger_ms = getattr(control, "linger", 100) if control is not None else 100
            self._unread_shutdown_until = time.monotonic() + max(linger_ms, 100) / 1000 + 0.2
        elif self.process is not None:
            await self._exit_of(self.process.pid, self.exit_grace)

    async def _exit_of(self, pid: int, timeout: float) -> None:
        """Note [What a restart waits for]: after `shutdown_request`, jupyter_client polls the kernel every
        0.1 s until it has exited, and only then starts the next one. Waiting for the exit is right: the
        old kernel's ports must be free before the new one binds them, and its atexit handlers, open files
        and device memory must be done with, as for a plain kernel. Waiting for the next poll tick is not:
        a forked kernel skips the interpreter's teardown (Note [Fast exit]) and usually exits well within
        one tick, which a restart then waits out. So this waits on a pidfd (woken by the exit
        itself, the event loop free meanwhile) for up to `timeout` s; the manager's first poll then finds
        the kernel gone. A kernel still running after `timeout` gets the manager's usual steps (SIGTERM
        after half of `shutdown_wait_time`, then SIGKILL)."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already, or no pidfds here: the manager's poll sees to it
            return
        try:
            await self._readable(pidfd, timeout)
        finally:
            os.close(pidfd)

    @staticmethod
    async def _readable(fd: int, timeout: float) -> None:
        """Wait until `fd` is readable (or `timeout` s pass), the event loop free meanwhile."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await asyncio.wait_for(ready, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            loop.remove_reader(fd)

    async def _launch_warm(self, cmd: list[str], kwargs: dict[str, Any]) -> KernelConnectionInfo:
        interpreter, module, args = split_argv([os.path.expanduser(part) for part in cmd])
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client's launcher sets it
        cwd = os.path.abspath(os.fspath(kwargs.get("cwd") or os.getcwd()))
        if not os.path.isdir(cwd):  # let the plain launch raise what Popen raises for it
            raise SpareUnavailable(f"the working directory {cwd} does not exist")
        per_kernel = set(spares.PER_KERNEL_ENV) | set(self.kernel_env_keys)
        spare_env = {k: v for k, v in env.items() if k not in per_kernel}
        spec = self.kernel_spec
        self._key = SpareKey(spec.resource_dir or spec.name or spec.display_name, interpreter,
                             tuple(self.preload))
        spare = spares.spare_for(self._key, spare_env, cwd)
        await spare.wait_ready(self.ready_timeout)
        await asyncio.sleep(max(0.0, self._unread_shutdown_until - time.monotonic()))
        request = {"module": module, "args": args, "argv": [*interpreter, "-m", module, *args], "env": env,
                   "cwd": cwd, "parent_pid": os.getpid(), "fast_exit": self.fast_exit}
        stdio = (kwargs.get("stdin"), kwargs.get("stdout"), kwargs.get("stderr"))
        kernel = self._take_ahead(spare, request, stdio)
        how = "started ahead by" if kernel is not None else "forked from"
        if kernel is None:
            kernel = self._fork(spare, request, stdio)
        self.process = kernel  # type: ignore[assignment]  # it has the methods of Popen that LocalProvisioner uses
        self.pid = self.pgid = kernel.pid
        self.cwd = cwd
        self.log.info("Kernel %s %s spare %d as %d", self.kernel_id, how, spare.pid, kernel.pid)
        await self._bound(kernel, BIND_TIMEOUT)
        if self.start_ahead:
            self._start_next_ahead(spare, request, stdio)
        return self.connection_info

    @staticmethod
    def _fork(spare: spares.Spare, request: dict[str, Any], stdio_args: tuple[Any, Any, Any],
              ahead: bool = False) -> ForkedKernel:
        stdio = _Stdio(*stdio_args)
        bound, tell = os.pipe() if ahead else (None, None)  # Note [Launched means listening]
        try:
            pid, pidfd = spare.fork(**request, stdio=(stdio.fds[0], stdio.fds[1], stdio.fds[2]), bound=tell)
        except BaseException:
            for pipe in stdio.keep.values():
                pipe.close()
            if bound is not None:
                os.close(bound)
            raise
        finally:
            stdio.close()
            if tell is not None:
                os.close(tell)
        kernel = ForkedKernel(spare, pid, pidfd)
        kernel.bound = bound
        for name, pipe in stdio.keep.items():
            setattr(kernel, name, pipe)
        return kernel

    def _take_ahead(self, spare: spares.Spare, request: dict[str, Any],
                    stdio: tuple[Any, Any, Any]) -> ForkedKernel | None:
        """The kernel started ahead for this start, started now; None if there is none or it was started
        for a start other than this one (then it is discarded). Note [Kernels started ahead] in zygote.py."""
        ahead = self._swap_ahead(None)
        if ahead is None:
            return None
        if (ahead.spare is spare and ahead.request == request and ahead.stdio == stdio
                and ahead.connection == dict(self.connection_info) and ahead.kernel.poll() is None):
            try:
                spare.start(ahead.kernel.pid)
                return ahead.kernel
            except SpareUnavailable as exc:
                self.log.info("The kernel started ahead is gone (%s): forking one", exc)
        ahead.discard()
        return None

    def _swap_ahead(self, new: _Ahead | None) -> _Ahead | None:
        """Put `new` in place of the kernel started ahead; returns the one before. A kernel still being
        started ahead meanwhile is for a start that is over: it is discarded when it arrives."""
        with self._ahead_lock:
            old, self._ahead = self._ahead, new
            self._ahead_round += 1
        return old

    def _start_next_ahead(self, spare: spares.Spare, request: dict[str, Any], stdio: tuple[Any, Any, Any]) -> None:
        """Start the kernel of the next restart ahead, in a thread (the fork takes the spare 10-20 ms)."""
        with self._ahead_lock:
            round_ = self._ahead_round
        connection = dict(self.connection_info)

        def start() -> None:
            try:
                kernel = self._fork(spare, request, stdio, ahead=True)
            except (SpareUnavailable, OSError) as exc:
                self.log.info("No kernel started ahead (%s)", exc)
                return
            ahead = _Ahead(spare, kernel, request, stdio, connection)
            with self._ahead_lock:
                if self._ahead is None and self._ahead_round == round_:
                    self._ahead = ahead
                    return
            ahead.discard()

        threading.Thread(target=start, name="overmind-kernel-ahead", daemon=True).start()

    async def cleanup(self, restart: bool = False) -> None:
        """`LocalProvisioner.cleanup`; at a shutdown, also the kernel started ahead ends (its exit awaited)."""
        if not restart:
            ahead = self._swap_ahead(None)
            if ahead is not None:
                ahead.discard()
                deadline = time.monotonic() + 2.0
                while ahead.kernel.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
        await super().cleanup(restart)

    async def _bound(self, kernel: ForkedKernel, timeout: float) -> None:
        """Note [Launched means listening]: wait until the forked kernel listens on all its TCP ports (it
        exits, or `timeout` s pass). A plain launch returns at once, and the kernel then takes seconds to
        bind; whoever connects first (the manager's control socket, jupyter_server's restart reply, which
        waits for `kernel_info` on a new shell socket) is refused and zmq tries again only after 100-200 ms
        (its `reconnect_ivl` plus jitter). A forked kernel binds 30-60 ms after the fork, so returning once
        it has bound saves that retry. Read from /proc/net, so no connection is made to the kernel. A kernel
        that has not bound after `timeout` s is returned as it is; the manager's own timeouts then apply.
        A kernel started ahead says itself when it listens (a byte on `kernel.bound`, or EOF if it died):
        reading /proc/net/tcp takes 10 ms here, as long as the rest of its start."""
        if kernel.bound is not None:
            bound, kernel.bound = kernel.bound, None
            try:
                await self._readable(bound, timeout)
            finally:
                os.close(bound)
            return
        info = self.connection_info
        if info.get("transport", "tcp") != "tcp":
            return
        ports = {int(info[name]) for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
                 if info.get(name)}
        deadline = time.monotonic() + timeout
        while not ports <= listening_ports() and kernel.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.003)

    async def poll(self) -> int | None:
        """`LocalProvisioner.poll`; also replaces this kernelspec's spare if it died (the kernel restarter
        polls every few seconds, so a dead spare is back before the next restart needs it)."""
        if self._key is not None:
            spares.revive(self._key)
        return await super().poll()

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info["warm"] = isinstance(self.process, ForkedKernel)
        return info

