"""Where the daemon lives, and how a client finds it or starts it.

One daemon per user and state directory: it holds an exclusive lock on `daemon.lock` for its whole
life, so a second one started by a racing client exits at once and the client connects to the first.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from . import settings
from .errors import DaemonUnavailable, DaemonUntrusted, StateDirError
from .transport import peer_credentials

__all__ = [
    "check_ancestors",
    "lock_path",
    "log_path",
    "running",
    "socket_path",
    "spawn_daemon",
    "state_dir",
    "state_dir_refused",
    "try_connect",
    "wait_for_socket",
]

_SOCKET_NAME = "daemon.sock"
_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL
_NO_LOG = "(no log)"


def state_dir(create: bool = True) -> Path:
    """The per-user state directory: OVERMIND_HOME, else $XDG_RUNTIME_DIR/overmind, else
    ~/.cache/overmind. Created with mode 0700; refused when it is a symlink, another user's, or open
    to others."""
    home = settings.get(settings.HOME)
    if home:
        path = Path(home)
    elif os.environ.get("XDG_RUNTIME_DIR") and Path(os.environ["XDG_RUNTIME_DIR"]).is_dir():
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "overmind"
    else:
        path = Path.home() / ".cache" / "overmind"
    path = Path(os.path.abspath(path))
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            pass  # something else by that name: check_state_dir says what
        except NotADirectoryError:
            raise StateDirError(f"cannot create the state directory {path}: a path above it is a file, not a "
                                "directory; set OVERMIND_HOME to a directory you own") from None
        except OSError as exc:
            raise StateDirError(f"cannot create the state directory {path}: {exc}; set OVERMIND_HOME "
                                "to a directory you own") from exc
    check_state_dir(path)
    return path


def check_state_dir(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StateDirError(f"state directory {path} does not exist") from None
    except NotADirectoryError:
        raise StateDirError(f"state directory {path} cannot exist: a path above it is a file, not a directory; "
                            "set OVERMIND_HOME to a directory you own") from None
    if stat.S_ISLNK(st.st_mode):
        raise StateDirError(
            f"state directory {path} is a symbolic link; overmind refuses it because another user could "
            "redirect it. Point OVERMIND_HOME at the real directory, or remove the link"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise StateDirError(f"state directory {path} is not a directory; remove it or set OVERMIND_HOME")
    if st.st_uid != os.getuid():
        raise StateDirError(
            f"state directory {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
            "set OVERMIND_HOME to a directory of your own"
        )
    if st.st_mode & 0o077:
        raise StateDirError(
            f"state directory {path} has mode {stat.S_IMODE(st.st_mode):o}: other users could reach the "
            f"daemon's socket. Run `chmod 700 {path}`"
        )
    check_ancestors(path)


def check_ancestors(path: Path) -> None:
    """No directory above the state directory may be writable by another user, unless it is sticky
    (as /tmp is) and the directory under it is ours: otherwise that user could replace the state
    directory by one of their own, with a socket of theirs in it (docs/design.md, invariant 4)."""
    me = os.getuid()
    chain = [Path(os.path.realpath(path))]
    chain += list(chain[0].parents)
    for child, parent in itertools.pairwise(chain):
        st = os.stat(parent)
        others = st.st_mode & 0o022 or (st.st_uid not in (me, 0) and st.st_mode & 0o200)
        if not others:
            continue
        if st.st_mode & stat.S_ISVTX and os.lstat(child).st_uid == me:
            continue  # a sticky directory: only its owner, root and we may rename what is ours
        who = "other users" if st.st_mode & 0o022 else f"uid {st.st_uid}"
        raise StateDirError(
            f"directory {parent}, above the state directory {path}, is writable by {who} (mode "
            f"{stat.S_IMODE(st.st_mode):o}): they could replace {child} with a directory of their own and "
            "serve your kernels. Set OVERMIND_HOME to a directory under one only you can write, such as "
            "~/.cache/overmind"
        )


def state_dir_refused(home: Path, doing: str, exc: OSError) -> StateDirError:
    """The error for a file the daemon needs in the state directory `home` that could not be made or written
    (`doing`: "open the daemon's log daemon.log"), from the OSError that said why, with what to do (a
    read-only directory or filesystem, a full one, one out of inodes or quota)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = ("free some space there (and inodes: `df -i`), or set OVERMIND_HOME to a directory on a "
                "filesystem with room")
    else:
        todo = "set OVERMIND_HOME to a directory of your own that you can write, on a filesystem with room"
    return StateDirError(f"cannot {doing} in the state directory {home}: {exc.strerror or exc}; {todo}")


def socket_path(home: Path, name: str = _SOCKET_NAME) -> Path:
    """The daemon's socket in `home` (or another one's, by `name`), refused where too long to bind."""
    path = home / name
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise StateDirError(
            f"socket path {path} is longer than the {_MAX_SOCKET_PATH} bytes a Unix socket allows; "
            "set OVERMIND_HOME to a shorter directory"
        )
    return path


def lock_path(home: Path) -> Path:
    return home / "daemon.lock"


def log_path(home: Path) -> Path:
    return home / "daemon.log"


def running(home: Path) -> bool:
    """Whether a daemon of this user serves `home` (connects once, and closes)."""
    sock = try_connect(home)
    if sock is None:
        return False
    sock.close()
    return True


def try_connect(home: Path) -> socket.socket | None:
    """A connection to the daemon of `home`, or None when none serves there. Before anything is sent
    or read, the daemon is checked as it checks its clients: the process at the other end and the
    socket file both belong to this user (DaemonUntrusted otherwise)."""
    path = socket_path(home)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN):
            return None
        raise DaemonUnavailable(f"cannot connect to the daemon at {path}: {exc}") from exc
    try:
        _, uid, _ = peer_credentials(sock)
        owner = os.lstat(path).st_uid
    except OSError as exc:
        sock.close()
        raise DaemonUnavailable(f"cannot check the daemon at {path}: {exc}") from exc
    me = os.getuid()
    if uid != me or owner != me:
        sock.close()
        who = uid if uid != me else owner
        raise DaemonUntrusted(
            f"the daemon socket {path} is {'served' if uid != me else 'owned'} by uid {who}, not by you "
            f"(uid {me}): another user may have put it in {home}. Nothing was sent to it; set OVERMIND_HOME "
            "to a directory of your own (mode 0700), or remove that socket"
        )
    return sock


def spawn_daemon(home: Path) -> subprocess.Popen[bytes]:
    """Start a detached daemon with this interpreter (never through PATH). The process started here
    forks the daemon and exits once it serves (status 0) or failed (status 1), so the daemon is
    nobody's child and the caller reaps only the short-lived parent."""
    env = dict(os.environ, OVERMIND_HOME=str(home))
    try:
        log = open(log_path(home), "ab")  # noqa: SIM115 (closed below; the child keeps its own copy)
    except OSError as exc:  # a read-only or full filesystem: the caller falls back (docs/design.md section 3)
        raise state_dir_refused(home, f"open the daemon's log {log_path(home).name}", exc) from exc
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "kernel_server", "start", "--daemonize"],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, close_fds=True, cwd=str(home),
        )


def wait_for_socket(home: Path, proc: subprocess.Popen[bytes] | None, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        sock = try_connect(home)
        if sock is not None:
            if proc is not None:
                proc.wait()
            return sock
        if proc is not None and proc.poll() not in (None, 0):
            raise DaemonUnavailable(f"the daemon exited with status {proc.returncode} while starting; "
                                    f"{_what_it_said(home)}")
        if time.monotonic() > deadline:
            raise DaemonUnavailable(
                f"no daemon answered at {socket_path(home)} within {timeout:.0f} s; see {log_path(home)} "
                "or run `overmind-daemon start` in a terminal to see why"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _what_it_said(home: Path) -> str:
    """The end of the log of a daemon that failed to start, or, where it wrote nothing there, why that may be
    and what to do."""
    said = tail(log_path(home)).strip()
    if said and said != _NO_LOG:
        return f"its log {log_path(home)} ends with:\n{said}"
    try:
        st = os.statvfs(home)
    except OSError:
        st = None
    free = None if st is None else st.f_bfree if os.geteuid() == 0 else st.f_bavail
    lack = ("no free space" if free == 0 else
            "no free inodes" if st is not None and st.f_files and st.f_favail == 0 else None)
    if lack is None:
        return (f"it wrote nothing to its log {log_path(home)}: run `overmind-daemon start --foreground` in a "
                "terminal to see the error")
    return (f"it wrote nothing to its log {log_path(home)}, whose filesystem has {lack} left: free some space "
            "there (and inodes: `df -i`), or set OVERMIND_HOME to a directory on a filesystem with room")


def process_gone(pid: int) -> bool:
    """True once `pid` has exited, also while it waits as a zombie for a busy init to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def daemon_pid(home: Path) -> int | None:
    """The pid the daemon of `home` wrote into its lock file (it may have exited since)."""
    try:
        text = lock_path(home).read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def kill_daemon(home: Path, grace: float = 5.0) -> None:
    """Stop the daemon of `home` by the pid in its lock file: SIGTERM, then SIGKILL after `grace`
    seconds; returns once it is gone. For tests and tools that started one; users run
    `overmind-daemon stop`, which asks it over the socket."""
    pid = daemon_pid(home)
    if pid is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if process_gone(pid):
                return
            time.sleep(0.01)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return _NO_LOG


class DaemonLock:
    """The single-instance lock, held by the daemon process for its whole life."""

    def __init__(self, home: Path) -> None:
        self.home = home
        try:
            self.fd = os.open(lock_path(home), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise state_dir_refused(home, f"open the daemon's lock file {lock_path(home).name}", exc) from exc

    def acquire(self) -> bool:
        """Take the lock and write this process's pid into it; False where another process holds it.
        Raises StateDirError where the pid cannot be written (a full filesystem)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            raise state_dir_refused(self.home, f"write the daemon's pid into {lock_path(self.home).name}", exc) from exc
        return True

    def holder_pid(self) -> int | None:
        try:
            return int(os.pread(self.fd, 32, 0).decode().strip() or 0) or None
        except (ValueError, OSError):
            return None

    def close(self) -> None:
        os.close(self.fd)
