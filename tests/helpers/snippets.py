"""Running Python snippets in separate interpreters, as separate kernels would.

A snippet that imports torch, transformers, diffusers, peft or this package (which imports transformers to
patch its loaders) runs in a child forked from a server, an interpreter that has imported torch and
transformers' common modules already (tests/helpers/zygote_server.py), as in a kernel whose first cell
imported them: those imports took 4-6 s of CPU in each fresh interpreter, most of the suite's time. The
server was started with the same environment as far as an interpreter's start and the libraries' imports
read it (`IMPORT_TIME_ENV`), and two servers of each environment, used in turn, give consecutive snippets
different hash seeds, as fresh interpreters have. Other snippets, those that set PYTHONHASHSEED, and those
that ask for `fresh=True` (what a process imported or started is what their test is about) run in a fresh
interpreter.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import itertools
import json
import locale
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

__all__ = ["last_json", "run_py", "start_py"]

# Variables an interpreter or a library reads when it starts or is imported (prefixes): a snippet runs in a
# child of servers started with the same values of these as its environment has (a pair for each set of
# values, at most _SERVER_PAIRS pairs in a test process: the pair used least recently and running no snippet
# is stopped for a new one).
IMPORT_TIME_ENV = ("PYTHON", "TRANSFORMERS", "HF_", "HUGGINGFACE", "TORCH", "PYTORCH", "OMP_", "MKL", "KMP_",
                   "OPENBLAS", "CUDA", "TQDM", "TOKENIZERS", "SAFETENSORS", "DIFFUSERS", "PEFT", "ACCELERATE",
                   "XDG_", "HOME", "LD_", "USE_", "JUPYTER", "IPYTHON", "NUMPY", "LC_", "LANG", "TMP", "PATH")
_SERVER_PAIRS = 4
# The imports of a snippet that runs in a server's child
_SERVED_IMPORTS = re.compile(r"^\s*(from|import)\s+(torch|transformers|diffusers|peft|overmind_jupyter)\b",
                                   re.MULTILINE)


def run_py(code: str, *, env: dict[str, str] | None = None, timeout: float = 120, check: bool = True,
           cwd: str | os.PathLike[str] | None = None, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet in an interpreter of its own (this venv's), with this test's environment."""
    code, env = textwrap.dedent(code), env or dict(os.environ)
    with _POOL.lock:
        servers = _servers(env) if not fresh and _SERVED_IMPORTS.search(code) else None
        if servers is not None:
            servers.running += 1
    if servers is not None:
        try:
            proc = _forked(servers, code, env, os.fspath(cwd) if cwd is not None else os.getcwd(), timeout)
        finally:
            with _POOL.lock:
                servers.running -= 1
    else:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"snippet failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


# An interrupt as a function is called: the process sends itself SIGINT at that call (where a real SIGINT
# landed), by a profile hook that then removes itself. {imports} names the module, {code} the function's code.
_AT_A_CALL = """
import os, signal, sys
{imports}

def _at_call(frame, event, arg):
    if event == "call" and frame.f_code is {code}:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)

sys.setprofile(_at_call)
"""


def at_a_call(imports: str, code: str, indent: str = "    ") -> str:
    """Lines that interrupt the snippet as the function whose code is `code` is called, to put into a
    snippet's text at a line indented by `indent`."""
    return f"\n{indent}".join(_AT_A_CALL.format(imports=imports, code=code).strip().splitlines())


def start_py(code: str, *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start a snippet that keeps running; its stdin and stdout are pipes."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env or dict(os.environ),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class _Servers:
    """Two servers started with the environment `env` (the first snippet's of those with its `_signature`),
    and stopped at this process's exit."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="zyg-", dir="/tmp"))
        self.pids: list[int] = []
        self.running = 0  # snippets in its children now (run_py may be called from several threads)
        server = str(Path(__file__).parent / "zygote_server.py")
        run = "import sys; exec(compile(open(sys.argv[1]).read(), sys.argv[1], 'exec'))"  # (as `python -c` runs)
        starts = []
        for n in range(2):
            with open(self.folder / f"{n}.log", "wb") as log:
                starts.append(subprocess.Popen([sys.executable, "-c", run, server, str(self.folder / f"{n}.sock"),
                                                str(os.getpid())], env=env, cwd=_SUITE_CWD, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.PIPE, stderr=log, start_new_session=True))
        atexit.register(self.stop)
        for n, start in enumerate(starts):
            assert start.stdout is not None
            with start.stdout:
                line = start.stdout.readline()
            start.wait()
            if not line:
                raise RuntimeError(f"a snippet server did not start: {(self.folder / f'{n}.log').read_text()}")
            ready = json.loads(line)
            self.pids.append(ready["pid"])
            _POOL.set_by_imports.update(ready["set_by_imports"])
        self.turn = itertools.cycle(range(2))

    def stop(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.folder, ignore_errors=True)


class _Pool:
    """This process's servers, by the `_signature` of their environment (one object, not module-level
    literals: the suite's keys reach this module, and a literal its functions change would be keyed)."""

    def __init__(self) -> None:
        # by signature, the pair used last at the end (a pair may be there under two signatures)
        self.started: dict[tuple[tuple[str, str], ...], _Servers] = {}
        self.asked: set[tuple[tuple[str, str], ...]] = set()  # the environments snippets asked for
        self.set_by_imports: dict[str, str] = {}  # what the servers' imports set (TORCHINDUCTOR_CACHE_DIR)
        self.lock = threading.Lock()  # run_py may be called from several threads

    def names_of(self, servers: _Servers) -> list[tuple[tuple[str, str], ...]]:
        """The signatures `servers` is started under (one, or two)."""
        return [name for name, s in self.started.items() if s is servers]


_SUITE_CWD = os.getcwd()
_POOL = _Pool()


def _signature(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What an interpreter's start and imports read of `env`; a value the imports set themselves counts
    as unset."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(IMPORT_TIME_ENV) and _POOL.set_by_imports.get(k) != v))


def _servers(env: dict[str, str]) -> _Servers | None:
    """The servers whose children start as a fresh interpreter with `env` would; None for an environment
    other than the first one seen for the first time (a pair of servers costs what two fresh interpreters
    cost), for one that sets the hash seed (forked children share their server's), and where _SERVER_PAIRS
    pairs run snippets already (else the one used least recently is stopped for this one)."""
    signature = _signature(env)
    if signature not in _POOL.started:
        seen, pairs = signature in _POOL.asked, len(set(map(id, _POOL.started.values())))
        _POOL.asked.add(signature)
        if "PYTHONHASHSEED" in env or (pairs and not seen):
            return None
        if pairs >= _SERVER_PAIRS:
            idle = [s for s in _POOL.started.values() if not s.running]
            if not idle:
                return None
            idle[0].stop()
            for name in _POOL.names_of(idle[0]):
                del _POOL.started[name]
        servers = _Servers(env)
        _POOL.started[signature] = _POOL.started[_signature(env)] = servers  # (as it reads after the first start)
    servers = _POOL.started[signature]
    for name in _POOL.names_of(servers):
        _POOL.started[name] = _POOL.started.pop(name)  # the last used
    return servers


def _forked(servers: _Servers, code: str, env: dict[str, str], cwd: str,
            timeout: float) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([python, -c, code], capture_output=True, text=True)` in a child of one of `servers`."""
    path = servers.folder / f"{next(servers.turn)}.sock"
    body = json.dumps({"code": code, "env": env, "cwd": cwd}).encode()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    with open(os.devnull, "rb") as null, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(path))
        fds = array.array("i", [null.fileno(), out_w, err_w])
        conn.sendmsg([struct.pack("!I", len(body)) + body[:60000]],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        conn.sendall(body[60000:])
        os.close(out_w)
        os.close(err_w)
        pid, status, captured = _collect(conn, {out_r: bytearray(), err_r: bytearray()}, timeout)
    if status is None:
        if pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise subprocess.TimeoutExpired([sys.executable, "-c", code], timeout)
    encoding = locale.getpreferredencoding(False)
    out, err = (captured[fd].decode(encoding).replace("\r\n", "\n").replace("\r", "\n") for fd in (out_r, err_r))
    return subprocess.CompletedProcess([sys.executable, "-c", code], os.waitstatus_to_exitcode(status), out, err)


def _collect(conn: socket.socket, captured: dict[int, bytearray],
             timeout: float) -> tuple[int, int | None, dict[int, bytearray]]:
    """The child's pid, its output (read until both pipes close) and its wait status; the status is None
    where `timeout` passed first."""
    deadline = time.monotonic() + timeout
    reply = b""
    with selectors.DefaultSelector() as sel:
        sel.register(conn, selectors.EVENT_READ)
        for fd in captured:
            sel.register(fd, selectors.EVENT_READ)
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return int(reply.split(b"\n")[0] or 0), None, captured
                for key, _ in sel.select(left):
                    data = conn.recv(4096) if key.fileobj is conn else os.read(key.fd, 1 << 16)
                    if not data:
                        sel.unregister(key.fileobj)
                    elif key.fileobj is conn:
                        reply += data
                    else:
                        captured[key.fd] += data
        finally:
            for fd in captured:
                os.close(fd)
    lines = reply.split(b"\n")
    if len(lines) < 3:
        raise RuntimeError(f"a snippet server closed a request before its child's status: {reply!r}")
    return int(lines[0]), int(lines[1]), captured
