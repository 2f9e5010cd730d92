"""A kernel's side of the device copier (copier.py): a cached model's weights filled into device memory
this kernel allocates, at the device's speed, instead of copied by torch from pageable pages.

# Note [Filling a model on a device]
`fill` looks at a model's CPU tensors: those whose storage lies in a mapping of an entry's arena
(mappings.Span with its kept descriptor) are grouped by entry. For each entry it allocates one block of
device memory spanning the arena bytes those storages hold, has the copier fill it from a device copy of
the entry or from the arena through pinned staging (one request and one CUDA IPC handle per entry, never
per tensor), and gives each tensor a view of the block with its own dtype, shape, strides and offset:
tensors that shared a storage on the host (tied weights) share it on the device. A storage of which this
kernel wrote a page on the host (a private copy of the page, by any route: `.data`, numpy, an optimizer;
mappings.WrittenPages reads it from the page tables, never from version counters) is not filled: its bytes
are the kernel's, not the arena's, and torch copies them. The block is this
kernel's memory, so its writes stay its own (docs/design.md invariant 3); the copier keeps no handle to
it after the fill. Every other tensor (made by the kernel, in a checkpoint file's pages, at an offset no
view can take) is left to the caller's `.to`. Any failure leaves the model as it was: what was not filled
moves the plain way, and why is said once per process and reason (`reasons()`).

The copier is started by the first kernel that needs it, with this kernel's interpreter and environment
less CUDA_VISIBLE_DEVICES (it serves every device of the user, and finds a kernel's device by its UUID).
Its start takes seconds (torch's import, a CUDA context), so the move that starts it copies the plain
way, and asks it, once it is up, to keep a copy of the entries just moved (`keep`): the kernel started
after the next restart finds them on the device.
"""

from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernel_server import helper_threads, lifecycle, settings

from .. import mappings
from ..notices import tell_once
from .copier import MAX_MESSAGE, PROTOCOL, socket_path

__all__ = ["Filled", "connect", "disconnect", "enabled", "fill", "reasons", "state"]

log = logging.getLogger("overmind")

_START_WAIT = 120.0  # seconds a kernel that started the copier waits for it before it stops asking
_TIMEOUT = 60.0  # seconds a request may take beyond its copy
_SLOWEST = 1e9  # bytes per second of the slowest copy a fill may make (pageable memory runs at 5.6-7 GB/s)
_lock = threading.Lock()
_conns: dict[str, socket.socket] = {}  # the copier's socket path (one per OVERMIND_HOME) -> the connection
_started: dict[str, float] = {}  # the same -> when this process last started a copier there
_reasons: dict[str, int] = {}


def enabled(device: torch.device, simulated: bool) -> bool:
    """Whether a move to `device` goes through the copier (OVERMIND_DEVICE_COPIER): CUDA devices unless
    it is `off`; simulated ones (filled on the CPU) only with `cpu`."""
    mode = settings.get(settings.DEVICE_COPIER)
    if mode == "off":
        return False
    return mode == "cpu" if simulated else device.type == "cuda"


def reasons() -> dict[str, int]:
    """Why moves of this process went the plain way, with how many times."""
    return dict(_reasons)


def _plain(reason: str) -> None:
    _reasons[reason] = _reasons.get(reason, 0) + 1
    tell_once(f"copier:{reason}", f"overmind: moving to the GPU through pageable memory: {reason}")


# -- the connection ------------------------------------------------------------------------------

# Note [One reply per request]
# The copier answers each request of a connection once, in order (copier.py's wire format), and nothing
# else tells a reply to which request it belongs. So a request that got no reply in time (its reply may
# still come) or a reply that is not the kind its request gets leaves the connection out of step: every
# later reply would be read as the answer to the request after it (a fill would take a late "kept" for
# its own, and make views of a block the copier had not written yet). Such a connection is dropped
# (`_drop`) by whoever met the failure, and the next move connects again.
_REPLIES = {"hello": "hello", "state": "state", "fill": "filled", "keep": "kept", "drop": "dropped"}


def _request(conn: socket.socket, message: dict[str, Any], fds: list[int] = (),  # type: ignore[assignment]
             nbytes: int = 0) -> dict[str, Any]:
    """One request and its reply, waiting at most what copying `nbytes` at the slowest path could take (a
    copier that hangs costs a kernel a minute, then its move goes torch's way; a block it might still be
    writing is kept from reuse by torch's IPC reference count until the copier lets go of it). Any failure
    but an error reply leaves the connection out of step: the caller drops it (Note [One reply per request])."""
    conn.settimeout(_TIMEOUT + nbytes / _SLOWEST)
    socket.send_fds(conn, [json.dumps(message).encode()], list(fds))
    data = conn.recv(MAX_MESSAGE)
    if not data:
        raise ConnectionError("the device copier closed the connection")
    reply: dict[str, Any] = json.loads(data)
    if reply.get("kind") == "error":
        raise RuntimeError(f"the device copier failed: {reply.get('error')}")
    if reply.get("kind") != _REPLIES[message["kind"]]:
        raise ConnectionError(f"the device copier answered {reply.get('kind')!r} to a {message['kind']!r} request: "
                              "the connection is out of step; the next move connects again")
    return reply


def connect(*, start: bool = True, wait: float = 0.0) -> socket.socket | None:
    """This kernel's connection to the copier; None while there is none. Starts the copier when none
    answers and `start`, then waits up to `wait` seconds for it."""
    home = lifecycle.state_dir()
    path = str(socket_path(home))
    deadline = time.monotonic() + wait
    while True:
        with _lock:
            found = _conns.get(path)
            if found is not None:
                return found
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(path)
                hello = _request(conn, {"kind": "hello", "version": PROTOCOL})
                if hello.get("version") != PROTOCOL:
                    raise ConnectionError(f"the device copier speaks protocol {hello.get('version')}, not {PROTOCOL}")
                _conns[path] = conn
                return conn
            except (OSError, ValueError, RuntimeError):
                conn.close()
            started = _started.get(path)
            if start and (started is None or time.monotonic() - started > _START_WAIT):
                _started[path] = time.monotonic()  # none answers: the first time, or long after a start
                _start(home)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _start(home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env[settings.HOME.env] = str(home)
    with open(home / "copier.log", "ab") as logfile:
        subprocess.Popen([sys.executable, "-m", "overmind_jupyter.units.copier"], stdin=subprocess.DEVNULL,
                         stdout=logfile, stderr=logfile, env=env, start_new_session=True, close_fds=True)


def _drop(conn: socket.socket) -> None:
    """Forget a connection that failed: the next move connects again (or starts a copier)."""
    with _lock:
        for path, known in list(_conns.items()):
            if known is conn:
                del _conns[path]
    conn.close()


def disconnect() -> None:
    """Close this process's connections to copiers (a kernel's lives as long as the kernel); the next move
    connects again."""
    with _lock:
        conns = list(_conns.values())
        _conns.clear()
    for conn in conns:
        conn.close()


def state() -> dict[str, Any] | None:
    """What the copier holds and has done (its `state` reply), or None when none runs."""
    for _ in range(2):  # a connection to a copier gone since: once more, with a new one
        conn = connect(start=False)
        if conn is None:
            return None
        try:
            with _lock:
                return _request(conn, {"kind": "state"})
        except (OSError, ValueError):
            _drop(conn)
    return None


# -- a model's fill ------------------------------------------------------------------------------

@dataclass
class _Group:
    """The tensors of one entry to fill, and the arena bytes their storages hold."""

    key: str
    arena: mappings.ArenaFile
    tensors: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (tensor, arena offset of its storage)
    low: int = -1
    high: int = 0


@dataclass
class Filled:
    """A model's fill: each host tensor and its device view (by the id of the host tensor, which the
    record keeps alive) and how it went."""

    views: dict[int, tuple[torch.Tensor, torch.Tensor]]
    bytes: int
    sources: dict[str, int]  # "device copy" / "host" -> entries
    seconds: float


def _groups(tensors: Iterable[torch.Tensor]) -> dict[str, _Group]:
    groups: dict[str, _Group] = {}
    seen: set[int] = set()
    written = mappings.WrittenPages()
    for t in tensors:
        if id(t) in seen or t.device.type != "cpu" or not t.numel() or t.layout != torch.strided:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        address = storage.data_ptr()
        span = mappings.span_of(address)
        if span is None or span.arena is None or address + storage.nbytes() > span.end:
            continue
        if written.any(span.start, span.end, address, storage.nbytes()):
            continue  # the kernel wrote it on the CPU: the arena's bytes are not its bytes any more
        at = span.offset(address)
        group = groups.get(span.key)
        if group is None:
            group = groups[span.key] = _Group(span.key, span.arena)
        group.tensors.append((t, at))
        group.low = at if group.low < 0 else min(group.low, at)
        group.high = max(group.high, at + storage.nbytes())
    return groups


def fill(tensors: Iterable[torch.Tensor], device: torch.device, unit_device: str, label: str) -> Filled | None:
    """Fill the arena-backed tensors of a model into memory of this kernel on `device` (Note [Filling a
    model on a device]); None, and the reason said once, when the copier cannot.

    Args:
        tensors: the model's parameters and buffers, on the CPU as a hit returns them.
        device: where to: a CUDA device, or "cpu" for the stand-in (a simulated device).
        unit_device: the ledger's id of the device (a CUDA UUID; "sim:0" for the stand-in).
        label: the model's name, for the copier's records.
    """
    groups = _groups(tensors)
    if not groups:
        return None
    conn = connect()
    if conn is None:
        _plain("the device copier is starting; the moves after it is up take the fast path")
        _keep_when_up(groups, unit_device, label)
        return None
    t0 = time.perf_counter()
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sources: dict[str, int] = {}
    total = 0
    try:
        for group in groups.values():
            block, reply = _fill_group(conn, group, device, unit_device, label)
            sources[reply["source"]] = sources.get(reply["source"], 0) + 1
            total += group.high - group.low
            for t, at in group.tensors:
                view = _view(block, t, at - group.low)
                if view is not None:
                    views[id(t)] = (t, view)
    except (OSError, ValueError, RuntimeError) as exc:
        _drop(conn)
        _plain(str(exc))
        return None
    return Filled(views, total, sources, time.perf_counter() - t0)


def _fill_group(conn: socket.socket, group: _Group, device: torch.device, unit_device: str,
                label: str) -> tuple[torch.Tensor, dict[str, Any]]:
    nbytes = group.high - group.low
    request = {"kind": "fill", "entry": group.key, "label": label, "complete": group.arena.complete,
               "device": unit_device, "start": group.low, "nbytes": nbytes,
               "parts": [p.describe() for p in group.arena.parts]}
    if device.type == "cuda":
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)  # what the allocator reused this memory from is done with it
        shared = block.untyped_storage()._share_cuda_()
        request["target"] = [base64.b64encode(f).decode() if isinstance(f, bytes) else f for f in shared]
        with _lock:
            reply = _request(conn, request, group.arena.fds(), nbytes)
        return block, reply
    # the stand-in: a memfd only this kernel keeps mapped once the copier has written it
    fd = os.memfd_create(f"overmind-fill:{group.key[:12]}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with _lock:
            reply = _request(conn, request, [*group.arena.fds(), fd], nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes), reply


def _view(block: torch.Tensor, t: torch.Tensor, at: int) -> torch.Tensor | None:
    """`t`'s view of `block`, whose byte `at` holds the start of `t`'s storage; None where `t`'s dtype
    cannot start there."""
    size = t.element_size()
    if at % size:
        return None
    view = torch.empty(0, dtype=t.dtype, device=block.device)
    return view.set_(block.untyped_storage(), at // size + t.storage_offset(), t.size(), t.stride())


def _keep_when_up(groups: dict[str, _Group], unit_device: str, label: str) -> None:
    """Once the copier answers, ask it to keep a copy of each complete entry of `groups` on the device
    (in a thread: the move that started the copier does not wait for it)."""
    wanted = [(g.key, g.arena.dup()) for g in groups.values() if g.arena.complete]
    if not wanted:
        return

    def run() -> None:
        try:
            conn = connect(start=False, wait=_START_WAIT)
            for key, arena in wanted:
                if conn is None:
                    break
                try:
                    with _lock:
                        _request(conn, {"kind": "keep", "entry": key, "label": label, "complete": True,
                                        "device": unit_device, "parts": [p.describe() for p in arena.parts]},
                                 arena.fds(), os.fstat(arena.fd).st_size)
                except (OSError, ValueError, RuntimeError) as exc:  # a late reply would be the next fill's
                    log.info("the device copier kept no copy of %s: %s", label, exc)
                    _drop(conn)  # Note [One reply per request]
                    conn = None
        finally:
            for _, arena in wanted:
                arena.close()

    if helper_threads.start(run, name="overmind-keep") is None:  # no thread to be had: nothing kept
        for _, arena in wanted:
            arena.close()
