"""A started interpreter that has imported torch and transformers, and forks a child for each snippet
(tests/helpers/snippets.py starts it with `python -c`, its last arguments the socket to listen on and its own
pid, and runs snippets through it).

A kernel's first cell imports torch and transformers, and each fresh interpreter of the suite spent 4-6 s of
CPU on those imports before its first line of test: most of the suite's time. A child forked here starts
where that cell left off, with the rest of a fresh interpreter's state: the snippet runs as `python -c` runs
it (a `__main__` of its own, `sys.argv == ["-c"]`, the cwd and environment it was given, the descriptors 0-2
it was given and no other of this server's), and exits as an interpreter exits (atexit handlers run).

Requests come over a unix socket: a 4-byte length and a JSON body (code, cwd, env), with three descriptors
for the child's stdin, stdout and stderr. The server says it is ready with a line, the JSON of its pid and
of what its imports set in the environment; the reply to a request is the child's pid as a line, then, when
the child has ended, its wait status as a line. This file imports nothing of the suite or of the package.
"""

import array
import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import traceback
import types

# Not a descendant of the test process that starts it (a test looks for what its kernels left running
# among its own children): the process it started exits here, and this one goes on under init.
if os.fork() > 0:
    os._exit(0)
_STARTED_WITH = dict(os.environ)
# What the children start with: torch, and transformers' modules that every model's module imports (4-6 s of
# CPU), not a model's own module (a hit's rebuild imports the one its graph needs, as in a fresh kernel).
import torch  # noqa: E402, F401
import transformers.activations  # noqa: E402
import transformers.generation.utils  # noqa: E402
import transformers.masking_utils  # noqa: E402
import transformers.modeling_layers  # noqa: E402
import transformers.modeling_utils  # noqa: E402, F401

# What the imports set in the environment (TORCHINDUCTOR_CACHE_DIR): a child's environment may have it or not.
SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if _STARTED_WITH.get(k) != v}


def _request(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    (size,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise EOFError("the request ended early")
        body += more
    return json.loads(body), list(fds)


def serve(path: str, owner: int) -> dict:
    """Answer requests until a child is forked; returns that child's request (in the child only). Exits
    when the process `owner` (the test process that started it) is gone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()  # SIGCHLD wakes the select
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}  # a child's pid: the request's connection, told its status
    print(json.dumps({"pid": os.getpid(), "set_by_imports": SET_BY_IMPORTS}), flush=True)
    while True:
        try:
            readable, _, _ = select.select([listener, wake_r], [], [], 5)
        except InterruptedError:
            readable = []
        if not readable and not _alive(owner):
            for leftover in (path, path.removesuffix(".sock") + ".log"):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
            with contextlib.suppress(OSError):  # (the other server's files may still be there)
                os.rmdir(os.path.dirname(path))
            os._exit(0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        _tell_ended(waiting)
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _request(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for sock in (listener, conn, *waiting.values()):
                sock.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in set(fds) - {0, 1, 2}:
                os.close(fd)
            return request
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(b"%d\n" % pid)
        waiting[pid] = conn


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _tell_ended(waiting: dict[int, socket.socket]) -> None:
    """Reap the children that ended; each one's connection is told its wait status and closed."""
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(b"%d\n" % status)
            conn.close()


def run(request: dict) -> None:
    """Run the snippet as `python -c` runs it, in the cwd and environment of the request."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv[:] = ["-c"]
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=__builtins__, __loader__=__loader__, __spec__=None)
    sys.modules["__main__"] = main
    code = 0
    try:
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        raise  # the interpreter's own way: killed by SIGINT after the traceback
    except BaseException as exc:  # noqa: BLE001  (told as the interpreter tells it, without this file's frame)
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        code = 1
    _exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """Exit as an interpreter exits (threads joined, atexit handlers run, output flushed), less the
    teardown of every module's objects: in a child, each object's count it changes copies its page from
    the server (1.2 s of the child's life)."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120
    os._exit(code)


if __name__ == "__main__":
    run(serve(sys.argv[-2], int(sys.argv[-1])))
