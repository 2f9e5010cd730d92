"""The spare process: imports the configured modules once, then forks a fresh kernel per request.

Run by the provisioner's side (`spares.py`) as `python [kernel's flags] -m overmind_jupyter.warm.zygote
--fd N --preload a,b`, with the kernel's interpreter, environment and working directory. It imports
ipykernel's kernel machinery and the configured modules, runs no torch operation, reports "ready", and
waits. On a "fork" request it forks; the child becomes the kernel (see `become_kernel`), the spare goes
on waiting. Beyond the standard library it imports only what every kernel would (ipykernel's machinery,
the preload list, this package's extension): whatever it imports, every kernel inherits.

Wire format. One Unix SOCK_SEQPACKET socket pair; the spare holds fd N.
- A message MUST be one datagram holding one UTF-8 JSON object with a string `kind`; file descriptors
  MAY ride on it as SCM_RIGHTS. At most `MAX_MESSAGE` bytes.
- The spare MUST send exactly one of these first, unasked, when its imports are done:
  `{"kind": "ready", "version": 2, "pid", "modules": [imported], "seconds", "native_threads",
  "stamps": {file: mtime_ns}}` or
  `{"kind": "failed", "version": 2, "error", "module"}` (then it exits 3). `version` is `PROTOCOL`,
  separate from the package version; a side that does not speak it MUST stop the spare.
- Then every request gets exactly one reply, in order:
  - `{"kind": "fork", "module", "args", "argv", "env", "cwd", "parent_pid", "fast_exit"}` with three fds (stdin,
    stdout, stderr of the kernel) -> `{"kind": "forked", "pid"}` with one fd, a pidfd of the kernel (none
    where pidfds are unsupported). The kernel is the child of the spare and leads its own session.
    With `"ahead": true` the kernel is started ahead (Note [Kernels started ahead]): it builds everything
    but its sockets' binds and waits; the spare keeps it until asked to start or discard it. A fourth fd
    rides along then: the kernel writes one byte to it once it listens on all its ports after `start`.
    A spare in which something initialised CUDA (Note [Fork safety]) answers a fork with an error and
    exits, so that it is replaced.
  - `{"kind": "start", "pid"}` -> `{"kind": "started", "pid"}`: a kernel started ahead binds its ports and
    runs on from there; an error reply if the spare holds no such kernel (it died, say).
  - `{"kind": "discard", "pid"}` -> `{"kind": "discarded", "pid"}`: a kernel started ahead exits without
    having bound anything (also when the spare exits).
  - `{"kind": "status", "pid"}` -> `{"kind": "status", "pid", "code": int or null, "known": bool}`: the
    exit code of a kernel the spare forked (negative: killed by that signal); null while it runs.
  - `{"kind": "ping"}` -> `{"kind": "pong", "pid", "kernels": [pids still running], "ahead": [pids waiting],
    "warmed": {pid: [records]}}`: `warmed` has, for each kernel still waiting that has said so, what it
    warmed (`warmup.Warmed` records; Note [Devices warmed ahead] in warmup.py).
  - Anything else -> `{"kind": "error", "error"}`; a bad request never stops the spare.
- A kernel started ahead MAY send one `{"kind": "warmed", "devices": [records]}` on the socket it waits on,
  once its warm-up is over; the spare keeps it for `pong` until the kernel is started or ends.
- EOF on the socket (the server closed it, or died) MUST make the spare exit. Kernels it forked live on:
  they watch the server themselves (Note [Kernel lifetime]).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import socket
import sys
import threading
import time
import traceback
from typing import Any

from . import warmup

__all__ = ["DEFAULT_PRELOAD", "MAX_MESSAGE", "PROTOCOL", "expand_preload", "stamps"]

PROTOCOL = 2
BIND_WAIT = 5.0  # seconds a kernel started ahead waits for its heartbeat's bind before it says it listens
MAX_MESSAGE = 1 << 20
DEFAULT_PRELOAD = ("torch", "transformers")

# Note [What preloading a package means]
# `import transformers` (or diffusers, peft) is lazy: it defines names and imports almost nothing, so a
# spare that only ran it would leave ~3 s of imports to the first `from transformers import AutoModel...`
# (measured here: torch 1.2-2.6 s, transformers' modeling core 1.1-2.4 s, then a model family's modeling
# module 25-50 ms). Preloading such a package therefore also imports the core every model load goes
# through, listed here; per-family modules (`transformers.models.llama.modeling_llama`) can be added by name.
CORE = {
    "transformers": ("transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                     "transformers.models.auto.tokenization_auto"),
    "diffusers": ("diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils"),
    "peft": ("peft.peft_model",),
}

# What a kernel imports before it answers its first request (15 modules beyond those below were left to each
# forked kernel), so a forked kernel only runs ipykernel_launcher's own few lines. `ipykernel.kernelapp` reads
# JPY_PARENT_PID and JPY_INTERRUPT_EVENT into trait defaults at import time; those belong to each kernel
# (Note [Per-kernel environment] in spares.py), so `become_kernel` sets them from the kernel's own environment.
KERNEL_MACHINERY = ("zmq", "tornado.ioloop", "tornado.platform.asyncio", "jupyter_client.session",
                    "jupyter_client.connect", "IPython.core.application", "IPython.core.profiledir",
                    "IPython.core.shellapp", "IPython.core.debugger", "IPython.core.oinspect",
                    "IPython.core.completerlib", "IPython.extensions.storemagic", "sqlite3", "ipykernel.ipkernel",
                    "ipykernel.zmqshell", "ipykernel.iostream", "ipykernel.heartbeat", "ipykernel.control",
                    "ipykernel.shellchannel", "ipykernel.connect", "ipykernel.parentpoller", "ipykernel.debugger",
                    "ipykernel.kernelapp")

# What `%load_ext overmind_jupyter` and `%overmind on` import (measured: 19 modules, 45 ms of CPU), so that
# a restarted warm kernel is model-ready sooner; with torch preloaded, also what the first cached load imports.
# The signatures `%overmind on` builds for the loaders it patches are built here too (`prepare_signatures`:
# 10-15 ms of each `%overmind on` otherwise), patching nothing.
EXTENSION = ("IPython.core.magics.extension", "IPython.core.magic_arguments", "overmind_jupyter.extension",
             "overmind_jupyter.magics", "overmind_jupyter.loading", "overmind_jupyter.config",
             "overmind_jupyter.patching", "overmind_jupyter.targets")
EXTENSION_WITH_TORCH = ("overmind_jupyter.rebuild",)


def expand_preload(names: list[str] | tuple[str, ...]) -> list[str]:
    """The modules a preload list imports, in order: each name, then its core (`CORE`, Note [What
    preloading a package means]), once each."""
    out: list[str] = []
    for name in names:
        for item in (name, *CORE.get(name, ())):
            if item and item not in out:
                out.append(item)
    return out


class ImportRefused(Exception):
    """A preloaded module failed to import, or left the process unsafe to fork; names the module."""

    def __init__(self, module: str, message: str) -> None:
        super().__init__(f"{module}: {message}")
        self.module = module


def _cuda_device_fds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.append(target)
    return found


def _import(name: str) -> None:
    """Import `name` as a module, or else as an attribute of its parent module (`transformers.AutoModel`)."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        parent, _, attr = name.rpartition(".")
        if not parent or exc.name != name:
            raise
        getattr(importlib.import_module(parent), attr)


# Note [Fork safety]
# A process may be forked only while it has one thread and has not initialised a device driver: a Python
# thread started at import does not exist in the forked kernels (its module then silently misbehaves), and
# a CUDA context does not survive fork. Torch is safe to fork after import and before its first operation
# (measured here: after any operation the forked children hung), so this process runs none. Each module is
# checked right after its import, so the error names the culprit; and before every fork the spare checks
# again that CUDA is not initialised here (`_cuda_in_use`: devices are warmed in the kernels started ahead,
# never here: Note [Devices warmed ahead] in warmup.py).
def preload(names: list[str]) -> list[str]:
    """Import the kernel machinery and `names`; raise `ImportRefused` naming the module that failed or
    that made forking unsafe (see Note [Fork safety]). Returns the modules imported.
    """
    for name in KERNEL_MACHINERY:
        try:
            importlib.import_module(name)
        except ImportError:  # another ipykernel layout: the kernel imports what it needs itself
            continue
    _check_fork_safe("ipykernel")
    done = []
    for name in names:
        try:
            _import(name)
        except BaseException as exc:  # reported; the server then starts plain kernels
            raise ImportRefused(name, f"import failed: {type(exc).__name__}: {exc}") from exc
        _check_fork_safe(name)
        done.append(name)
    for name in EXTENSION + (EXTENSION_WITH_TORCH if "torch" in sys.modules else ()):
        try:
            importlib.import_module(name)
        except ImportError:  # a head start only: the kernel reports it if `%load_ext` is run
            continue
    targets = sys.modules.get("overmind_jupyter.targets")
    if targets is not None:
        targets.prepare_signatures()
    _check_fork_safe("overmind_jupyter")
    return done


def _check_fork_safe(name: str) -> None:
    """Raise `ImportRefused` naming `name` if this process is no longer safe to fork (Note [Fork safety])."""
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        raise ImportRefused(name, f"importing it started threads {threads}, which forked kernels would "
                                 "not have (see Note [Fork safety]); remove it from the preload list")
    devices = _cuda_device_fds()
    if devices:
        raise ImportRefused(name, f"importing it opened {devices}: a GPU driver initialised before fork is "
                                 "unusable in the forked kernels; remove it from the preload list")


def _cuda_in_use() -> str | None:
    """What initialised CUDA in this process, if anything did (see Note [Fork safety])."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch has initialised CUDA in the spare"
    devices = _cuda_device_fds()
    return f"the spare has opened {devices}" if devices else None


def stamps(modules: list[str]) -> dict[str, int]:
    """`{file: mtime_ns}` of the preloaded modules, their top-level packages and ipykernel: an upgrade
    (`pip install -U torch`) rewrites these, so the server can tell that this spare is stale."""
    found: dict[str, int] = {}
    for name in dict.fromkeys([*modules, *(m.split(".")[0] for m in modules), "ipykernel", "IPython"]):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            try:
                found[path] = os.stat(path).st_mtime_ns
            except OSError:
                continue
    return found


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


class _Spare:
    """The serving loop of the spare: replies to requests, forks kernels, reaps them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.codes: dict[int, int] = {}  # exit codes of reaped kernels, oldest first
        self.running: set[int] = set()
        self.ahead: dict[int, socket.socket] = {}  # kernels started ahead, and our end of the socket each waits on
        self.unheard: set[int] = set()  # kernels started ahead that may still say what they warmed
        self.warmed: dict[int, list[Any]] = {}  # what kernels started ahead warmed, while they wait

    def reap(self, pid: int = -1) -> None:
        while True:
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                if pid != -1:
                    self.running.discard(pid)
                return
            if got == 0:
                return
            self.running.discard(got)
            if got in self.ahead:
                self._forget_ahead(got).close()
            self.codes[got] = os.waitstatus_to_exitcode(status)
            while len(self.codes) > 4096:
                del self.codes[next(iter(self.codes))]
            if pid != -1:
                return

    def serve(self) -> dict[str, Any] | None:
        """Serve until EOF (returns None, in the spare) or a fork (returns the plan, in the child)."""
        handlers = {"fork": self.fork, "start": self.start, "discard": self.discard, "status": self.status,
                    "ping": self.ping}  # what the server may ask
        while True:
            self.reap()
            ready, _, _ = select.select([self.sock, *(self.ahead[pid] for pid in self.unheard)], [], [], 1.0)
            for pid in [pid for pid in self.unheard if self.ahead[pid] in ready]:
                self.hear(pid)
            if self.sock not in ready:
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
            except ConnectionError:
                return None
            if not data:
                return None
            try:
                request = json.loads(data)
                handler = handlers.get(request["kind"])
                if handler is None:
                    raise ValueError(f"unknown kind {request['kind']!r}")
                plan = handler(request, fds)
            except (ValueError, KeyError, TypeError) as exc:  # a bad request gets an error reply
                self._close(fds)
                _send(self.sock, {"kind": "error", "error": f"bad request: {type(exc).__name__}: {exc}"})
                continue
            if plan is not None:
                return plan
            if handler != self.fork:  # fork closes (or hands on) the fds it got; the others get none
                self._close(fds)

    def hear(self, pid: int) -> None:
        """Read what the kernel `pid`, started ahead, says on the socket it waits on: what it warmed, once."""
        self.unheard.discard(pid)
        try:
            message = json.loads(self.ahead[pid].recv(MAX_MESSAGE))
            if message.get("kind") == "warmed" and isinstance(message.get("devices"), list):
                self.warmed[pid] = message["devices"]
        except (OSError, ValueError, AttributeError):  # EOF (it died: reaped soon) or nonsense: nothing to keep
            pass

    def _forget_ahead(self, pid: int) -> socket.socket:
        self.unheard.discard(pid)
        self.warmed.pop(pid, None)
        return self.ahead.pop(pid)

    def status(self, request: dict[str, Any], fds: list[int]) -> None:
        pid = int(request["pid"])
        if pid in self.running:
            self.reap(pid)
        _send(self.sock, {"kind": "status", "pid": pid, "code": self.codes.get(pid),
                          "known": pid in self.codes or pid in self.running})

    def ping(self, request: dict[str, Any], fds: list[int]) -> None:
        _send(self.sock, {"kind": "pong", "pid": os.getpid(), "kernels": sorted(self.running),
                          "ahead": sorted(self.ahead), "warmed": {str(pid): self.warmed[pid] for pid in self.warmed}})

    def start(self, request: dict[str, Any], fds: list[int]) -> None:
        pid = int(request["pid"])
        self.reap()
        if pid not in self.ahead:
            raise ValueError(f"no kernel started ahead as {pid}")
        go = self._forget_ahead(pid)
        try:
            go.send(b"go")
        except OSError as exc:  # it died a moment ago
            raise ValueError(f"kernel {pid} started ahead is gone ({exc})") from exc
        finally:
            go.close()
        self.running.add(pid)
        _send(self.sock, {"kind": "started", "pid": pid})

    def discard(self, request: dict[str, Any], fds: list[int]) -> None:
        pid = int(request["pid"])
        if pid in self.ahead:
            self._forget_ahead(pid).close()  # EOF: it exits (Note [Kernels started ahead])
        _send(self.sock, {"kind": "discarded", "pid": pid})

    @staticmethod
    def _close(fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)

    def fork(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
        ahead = bool(request.get("ahead"))
        if len(fds) != 3 + ahead:
            raise ValueError(f"fork needs {3 + ahead} fds (stdin, stdout, stderr{', bound' if ahead else ''}), "
                             f"got {len(fds)}")
        if ahead and not _can_start_ahead():
            raise ValueError("this ipykernel cannot be started ahead (Note [Kernels started ahead])")
        missing = {"module", "args", "argv", "env", "cwd"} - set(request)
        if missing:
            raise KeyError(f"fork without {sorted(missing)}")
        unsafe = _cuda_in_use()
        if unsafe is not None:  # Note [Fork safety]: a kernel forked now could not use CUDA, nor any later one
            self._close(fds)
            _send(self.sock, {"kind": "error", "error": f"{unsafe}, so a kernel forked from it could not use "
                                                        "CUDA: the spare exits and is replaced"})
            raise SystemExit(4)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if ahead else (None, None)
        pid = os.fork()
        if pid == 0:
            self.sock.close()
            for other in self.ahead.values():  # or another kernel's wait would not end when the spare closes it
                other.close()
            if mine is not None:
                mine.close()
            return dict(request, fds=fds, go=theirs)
        self._close(fds)
        if mine is not None and theirs is not None:
            theirs.close()
            self.ahead[pid] = mine
            self.unheard.add(pid)
        else:
            self.running.add(pid)
        try:
            pidfd = [os.pidfd_open(pid)]
        except (AttributeError, OSError):
            pidfd = []
        try:
            _send(self.sock, {"kind": "forked", "pid": pid}, pidfd)
        finally:
            self._close(pidfd)
        return None


# Note [Kernel lifetime]
# A plain kernel is the Jupyter server's child and ipykernel's poller exits it when its parent changes. A
# forked kernel is the spare's child, so that poller would either watch the spare (a spare killed or
# replaced would take running kernels with it) or nothing. `ServerPoller` watches the server itself
# (`JPY_PARENT_PID`, opened as a pidfd when the kernel was forked, so a reused pid cannot fool it) and
# exits the same way: the same log line, `os._exit(1)`.
class ServerPoller(threading.Thread):
    """Stands in for ipykernel's `ParentPollerUnix` in a forked kernel: exits it when the Jupyter server
    exits (see Note [Kernel lifetime])."""

    pidfd: int | None = None  # opened by `become_kernel`

    def __init__(self, parent_pid: int = 0) -> None:
        super().__init__(name="overmind-server-poller", daemon=True)
        self.parent_pid = parent_pid

    def run(self) -> None:
        fd = ServerPoller.pidfd
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(self.parent_pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1.0)
        from traitlets.log import get_logger

        get_logger().warning("Parent appears to have exited, shutting down.")
        os._exit(1)


def _reseed() -> None:
    """Give this kernel its own random state, as a fresh process would have (random reseeds itself at fork)."""
    if "numpy" in sys.modules:
        import numpy.random

        numpy.random.seed()
    if "torch" in sys.modules:
        import torch

        torch.default_generator.seed()


# Note [Finalizers of the spare]
# `weakref.finalize(obj, ..., atexit=True)` callbacks that exist at the fork were registered by the spare's
# imports, for the spare's objects: torch registers one per operator library (176 with transformers), and
# running them at a kernel's exit took 60 ms of the 100 ms of its exit handlers (measured here), only to
# unregister operators from torch's dispatcher in a process about to end. What such a callback cleans up
# outside the process (a temporary directory an import made) is the spare's, still in use by the spare and
# its other kernels, so a kernel must not run it either. The kernel leaves them to the spare: they no
# longer run at its exit; they still run if their object dies while the kernel runs, and the finalizers
# the kernel makes itself run at its exit as usual.
def _leave_the_spares_finalizers() -> None:
    """Leave the finalizers that exist at the fork to the spare: none runs at this kernel's exit (see
    Note [Finalizers of the spare])."""
    import weakref

    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        finalizer.atexit = False


def _can_start_ahead() -> bool:
    """Whether the ipykernel this spare imported is one `_bind_when_started` knows how to hold back."""
    kernelapp = sys.modules.get("ipykernel.kernelapp")
    app = getattr(kernelapp, "IPKernelApp", None)
    heartbeat = getattr(sys.modules.get("ipykernel.heartbeat"), "Heartbeat", None)
    return callable(getattr(heartbeat, "_bind_socket", None)) and all(
        callable(getattr(app, name, None)) for name in ("_try_bind_socket", "init_heartbeat", "init_extensions"))


# Note [Kernels started ahead]
# A restart of a warm kernel used to wait for the next kernel's fork and for its whole start (ipykernel's
# configuration, sockets, IPython's shell and history database: about 0.1 s of CPU) after the old kernel
# had exited, because the ports the new kernel binds are the old one's. A kernel started ahead is forked
# while the current kernel runs, with the argv, environment, working directory and connection file of the
# current start, and builds everything of ipykernel's app that does not need the ports: configuration,
# sockets created but not bound, threads, kernel, shell. Then, before anything of the user's runs (the
# extensions and startup code of IPython's configuration, which may hold a GPU or a lock, run only at the
# restart, as in a plain kernel), it waits on `go`. At the restart the provisioner checks that the start
# asks for exactly the same (else it discards it and forks a kernel as before); the spare writes to `go`,
# and the kernel binds its ports, starts its heartbeat, writes to `bound` (what the provisioner waits for:
# Note [Launched means listening] in provisioner.py), runs the extensions and startup code, and answers.
# While it waits, a thread of its own warms its devices (Note [Devices warmed ahead] in warmup.py) and then
# says what it warmed on `go`, for the spare's `pong`.
# EOF on `go` (discarded, or the spare or the server is gone) ends it at once: it bound nothing and ran
# nothing of the user's. It is a new process, forked before the restart was asked for: its pid, random
# state and IPython history session are its own; only its start time (and its history session's) is
# earlier.
def _bind_when_started(app_class: Any, go: socket.socket, bound: int) -> None:
    """Hold back the binds of `app_class` (ipykernel's app) until the spare writes to `go`, then bind, write
    to `bound` and run on; EOF on `go` exits (see Note [Kernels started ahead]).

    This patches the app class of this process only (the kernel's own copy of ipykernel, from the spare).
    """
    deferred: list[tuple[Any, int]] = []
    try_bind, init_heartbeat, init_extensions = (app_class._try_bind_socket, app_class.init_heartbeat,
                                                 app_class.init_extensions)
    heartbeat_class = sys.modules["ipykernel.heartbeat"].Heartbeat
    bind_heartbeat, heartbeat_bound = heartbeat_class._bind_socket, threading.Event()

    def bind_heartbeat_and_tell(heartbeat: Any) -> Any:  # it binds in its own thread
        try:
            return bind_heartbeat(heartbeat)
        finally:
            heartbeat_bound.set()

    def defer_bind(app: Any, sock: Any, port: int) -> int:
        if port <= 0:  # a port to choose: nothing to keep free for later
            return int(try_bind(app, sock, port))
        deferred.append((sock, port))
        return port

    def defer_heartbeat(app: Any) -> None:
        if app.hb_port <= 0:
            init_heartbeat(app)

    said = threading.Lock()  # `go` is closed by this thread and written by the warm-up's

    def say_warmed(devices: list[warmup.Warmed]) -> None:
        with said:
            if go.fileno() < 0:  # started already: the kernel's own `warmed()` tells the rest
                return
            try:
                go.send(json.dumps({"kind": "warmed", "devices": devices}).encode())
            except OSError:  # the spare is gone, or has just started this kernel
                pass

    def start_then_init_extensions(app: Any) -> None:
        warmup.start(getattr(app, "config", None), say_warmed)
        if not go.recv(16):
            os._exit(0)
        with said:
            go.close()
        app_class._try_bind_socket, app_class.init_heartbeat = try_bind, init_heartbeat
        for sock, port in deferred:
            try_bind(app, sock, port)
        debug_shell = getattr(app, "debug_shell_socket", None)  # ipykernel connects it once the shell is bound
        endpoint = app.shell_socket.getsockopt(zmq_last_endpoint)
        if debug_shell is not None and endpoint:
            debug_shell.connect(endpoint)
        heartbeat_class._bind_socket = bind_heartbeat_and_tell
        init_heartbeat(app)
        heartbeat_bound.wait(BIND_WAIT)
        heartbeat_class._bind_socket = bind_heartbeat
        try:
            os.write(bound, b"1")
        except OSError:  # the provisioner stopped waiting: it goes by /proc/net then
            pass
        os.close(bound)
        app_class.init_extensions = init_extensions
        shell = getattr(app, "shell", None)
        if shell is not None:  # a variable CUDA read at the warm-up, changed by a cell: say it does nothing
            shell.events.register("post_run_cell", warmup.check_environment)
        init_extensions(app)

    import zmq

    zmq_last_endpoint = zmq.LAST_ENDPOINT
    app_class._try_bind_socket, app_class.init_heartbeat = defer_bind, defer_heartbeat
    app_class.init_extensions = start_then_init_extensions


def become_kernel(plan: dict[str, Any], cwd_entry: bool) -> None:
    """Turn this freshly forked child into the kernel of `plan`, then run it (returns when the kernel exits).

    The kernel gets exactly what `Popen(argv, env=env, cwd=cwd, start_new_session=True)` would give it:
    its own session and process group (interrupts go to the group), the three stdio fds, the working
    directory, the whole environment (Note [Per-kernel environment] in spares.py), `sys.path[0]` and `sys.argv` as
    `python -m module` sets them, and fresh random seeds.
    """
    os.setsid()
    for target, fd in zip((0, 1, 2), plan["fds"][:3], strict=True):
        if fd != target:
            os.dup2(fd, target)
    for fd in plan["fds"][:3]:
        if fd > 2:
            os.close(fd)
    os.chdir(plan["cwd"])
    env = plan["env"]
    os.environ.clear()
    os.environ.update(env)
    if cwd_entry:
        sys.path.insert(0, os.getcwd())
    _reseed()
    _leave_the_spares_finalizers()
    parent = int(plan.get("parent_pid") or 0)
    if parent:
        try:
            ServerPoller.pidfd = os.pidfd_open(parent)
        except ProcessLookupError:  # the server is already gone: exit as its kernel would
            os._exit(1)
        except (AttributeError, OSError):
            ServerPoller.pidfd = None
        try:
            from ipykernel import parentpoller

            parentpoller.ParentPollerUnix = ServerPoller  # type: ignore[misc, assignment]
        except ImportError:
            pass
    kernelapp = sys.modules.get("ipykernel.kernelapp")
    if plan.get("go") is not None and kernelapp is not None:  # the spare checked it (`_can_start_ahead`)
        _bind_when_started(kernelapp.IPKernelApp, plan["go"], plan["fds"][3])
    if kernelapp is not None:  # imported by the spare (KERNEL_MACHINERY): give it this kernel's view
        setattr(kernelapp, "ParentPollerUnix", ServerPoller)  # noqa: B010 (a module mypy does not know)
        app = kernelapp.IPKernelApp
        traits = app.class_traits()
        # traitlets also caches a static default per class (`_static_immutable_initial_values`), which is
        # what a new instance gets: both must say this kernel's values.
        cached = getattr(app, "_static_immutable_initial_values", {})
        for name, variable in (("parent_handle", "JPY_PARENT_PID"), ("interrupt", "JPY_INTERRUPT_EVENT")):
            traits[name].default_value = int(env.get(variable) or 0)
            if name in cached:
                cached[name] = traits[name].default_value
    sys.orig_argv = list(plan["argv"])
    sys.argv = [plan["argv"][0], *plan["args"]]

    import runpy

    runpy.run_module(plan["module"], run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overmind_jupyter.warm.zygote")
    parser.add_argument("--fd", type=int, required=True, help="this end of the socket pair (inherited)")
    parser.add_argument("--preload", default="", help="comma-separated modules (expanded by the caller)")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    # `python -m` put the working directory first on sys.path; a kernel's own launcher removes it before
    # importing anything, so the preloaded modules are resolved without it too. Each kernel gets its own
    # working directory back (become_kernel).
    cwd_entry = bool(sys.path) and sys.path[0] in ("", os.getcwd())
    if cwd_entry:
        del sys.path[0]
    started = time.perf_counter()
    env_before = dict(os.environ)
    try:
        modules = preload([m for m in args.preload.split(",") if m])
    except ImportRefused as exc:
        _send(sock, {"kind": "failed", "version": PROTOCOL, "error": str(exc), "module": exc.module,
                     "trace": traceback.format_exc(limit=-3)})
        return 3
    # What the preloaded modules did to os.environ while importing, replayed on top of each kernel's own
    # environment (see Note [Per-kernel environment] in spares.py).
    changed = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
    removed = [k for k in env_before if k not in os.environ]
    # Note [Frozen imports]: what the imports allocated moves to the collector's permanent generation, as
    # the gc docs advise before fork: the kernels' collections skip it (IPython's exit runs gc.collect:
    # 0.33 s over torch's objects otherwise) and do not dirty its copy-on-write pages.
    import gc

    gc.collect()
    gc.freeze()
    hit_tuning = sys.modules.get("overmind_jupyter.hit_tuning")  # imported with loading
    if hit_tuning is not None:
        hit_tuning.heap_frozen()  # so that a hit need not count what is frozen (Note [Old at birth] there)
    _send(sock, {"kind": "ready", "version": PROTOCOL, "pid": os.getpid(), "modules": modules,
                 "seconds": time.perf_counter() - started, "native_threads": _native_threads(),
                 "stamps": stamps(modules)})
    plan = _Spare(sock).serve()
    if plan is None:
        return 0
    env = dict(plan["env"])
    env.update(changed)
    for key in removed:
        env.pop(key, None)
    plan["env"] = env
    if not plan.get("fast_exit"):
        become_kernel(plan, cwd_entry)
        return 0
    try:
        become_kernel(plan, cwd_entry)
    except SystemExit as exc:
        fast_exit(_exit_code(exc))
    fast_exit(0)
    return 0


def _exit_code(exc: SystemExit) -> int:
    """The status the interpreter would exit with for `exc` (printing a non-int code, as it does)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _close_written_files() -> None:
    """Close the writable file objects on regular files that are still open, wrappers before what they
    wrap, as their finalizers would at exit. Pipes, sockets and terminals are left alone: ipykernel's
    output capture still reads from its pipes."""
    import _io  # its C base class makes the scan cheap: io.IOBase is an ABC, slow in isinstance
    import gc
    import io
    import stat

    def order(f: Any) -> int:
        if isinstance(f, io.TextIOBase):
            return 0
        if isinstance(f, (io.BufferedWriter, io.BufferedRandom, io.BufferedReader)):
            return 2
        return 3 if isinstance(f, io.RawIOBase) else 1  # other wrappers (gzip, ...) before their buffers

    files = []
    for obj in gc.get_objects():  # objects frozen in the spare (see main) are not listed: not the user's
        # The type, not isinstance: that reads `__class__`, which a weakref.proxy forwards, and a dead
        # one raises ReferenceError (a kernel that had loaded a model held one, and so never exited fast)
        if not issubclass(type(obj), _io._IOBase):
            continue
        try:
            if obj.closed or not obj.writable() or not stat.S_ISREG(os.fstat(obj.fileno()).st_mode):
                continue
        except Exception:  # noqa: BLE001 - not a file to close (io.UnsupportedOperation, a user's class)
            continue
        files.append(obj)
    for obj in sorted(files, key=order):
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - as in IOBase.__del__, a failing close is ignored
            continue


# Note [Fast exit]
# A kernel that has imported torch and transformers spends about a second in interpreter finalization
# (measured here: 1.06 s for `import torch, transformers.modeling_utils` then exit, 0.04 s with `os._exit`
# after the atexit handlers), and a restart waits for it. A forked kernel instead joins its non-daemon
# threads, runs the atexit handlers, closes the file objects still open (flushing what was buffered, as
# their finalizers would), flushes stdio and calls `os._exit`. What it skips is what Python does not
# promise to run at exit anyway: `__del__` of objects still alive. `WarmProvisioner.fast_exit = False`
# restores the full shutdown.
def fast_exit(code: int) -> None:
    """End a forked kernel the way interpreter shutdown begins, then skip tearing down its modules (see
    Note [Fast exit]).

    Args:
        code: the exit status.
    """
    import atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
    except Exception:  # noqa: BLE001 - a failing thread must not keep the kernel alive
        traceback.print_exc()
    atexit._run_exitfuncs()
    try:
        _close_written_files()
    except Exception:  # noqa: BLE001 - reported; the exit goes on, as the interpreter's would
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001
            continue
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
