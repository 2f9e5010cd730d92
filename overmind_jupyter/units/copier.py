"""The device copier: one process per user, beside the daemon, that fills a kernel's device memory with
cached weights (issue 36).

A hit's weights are private mappings of the daemon's arena: pageable memory, which CUDA copies to a
device through its own small pinned buffer at 5.6-7.1 GB/s on an H200 (benchmarks/RESULTS.md, "The GPU
path"), about what the plain load's copy costs. This process keeps what a kernel cannot keep across its
restarts: a CUDA context, pinned staging buffers, mappings of the arenas, and copies of the entries on
the devices (Note [Device copies]). A kernel allocates the device memory of its model itself (one
allocation per entry), shares it with this process by one CUDA IPC handle, and this process fills it;
the kernel then makes its tensors views of that memory (overmind_jupyter/units/filling.py). The daemon
itself never imports torch; this process does, and is started with the kernel's interpreter by the
first kernel that needs it (`filling.connect`).

Run as `python -m overmind_jupyter.units.copier` with OVERMIND_HOME (and the stand-in setting) in its
environment. It holds `copier.lock` in the daemon's directory for as long as it runs (a second one
exits at once), listens on `copier.sock` there, and exits when the daemon goes away (its copies' units
go with the connection; Note [A copier before the daemon]) or after `IDLE_EXIT` seconds with no kernel
connected and no copy kept.

Wire format. A Unix SOCK_SEQPACKET connection per kernel.
- A message MUST be one datagram holding one UTF-8 JSON object with a string `kind`; file descriptors
  ride on it as SCM_RIGHTS. At most `MAX_MESSAGE` bytes. Every request gets exactly one reply, in order;
  a bad request gets `{"kind": "error", "error"}` and never stops the copier.
- `{"kind": "hello", "version"}` -> `{"kind": "hello", "version": PROTOCOL, "pid", "standin"}`. A side
  that does not speak `version` closes the connection.
- `{"kind": "fill", "entry", "label", "complete", "device", "index", "start", "nbytes", "target", "parts"}`,
  with the entry's arena descriptor, one per range of `parts` ([arena offset, bytes] each: Note [Arena
  parts] in kernel_server/arena.py) and, for the stand-in, the target's memfd -> `{"kind": "filled",
  "source", "seconds", "kept"}`. Bytes [start, start + nbytes) of the arena are written into the
  target: a CUDA allocation of the kernel's (`target`: the eight fields of torch's `_share_cuda_`, bytes
  in base64) on its CUDA device `index` here (the kernel sends the device's `device` id, a CUDA UUID, and
  this process finds its own index for it), or on the stand-in, a memfd the kernel mapped shared.
  `source` says where the bytes came from: "device copy" or "host". `kept`: a copy of the entry is now
  on the device (Note [Device copies]). `complete` false: the arena still lacks pieces the entry reads
  from its checkpoint files, so no copy of it is kept (those bytes of the arena are not written yet).
- `{"kind": "keep", ...}`: the fill's fields without a target, with the arena's descriptors -> `{"kind":
  "kept", "kept", "seconds"}`: make the device copy only (a kernel that moved its model itself, while
  the copier was starting).
- `{"kind": "drop"}` -> `{"kind": "dropped", "copies": count}`: every copy dropped and its units given back
  (benchmarks measure the fill from the host this way).
- `{"kind": "state"}` -> `{"kind": "state", "copies": [{entry, label, device, bytes, units, holding,
  last_used}], "fills": {source: count}, "bytes": {source: bytes}, "seconds": {source: seconds}}`.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import fcntl
import json
import logging
import mmap
import os
import queue
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernel_server import arena, lifecycle, settings
from kernel_server.client import Client
from kernel_server.errors import DaemonError, RemoteError
from kernel_server.operations import Op
from kernel_server.payloads import MAX_PARTS
from kernel_server.settings import GiB

from .devices import context_units, cuda_identity, local_devices

__all__ = ["IDLE_EXIT", "MAX_MESSAGE", "PROTOCOL", "lock_path", "socket_path"]

PROTOCOL = 1
MAX_MESSAGE = 1 << 16
MAX_FDS = 1 + MAX_PARTS + 1  # a fill's: the arena's, its parts' (as many as the daemon takes), the stand-in's target
IDLE_EXIT = 600.0  # seconds with no kernel connected and no copy kept before the copier exits
HOST_IDLE = 30.0  # seconds an arena's host mapping is kept unused (Note [Host mappings])
_CHUNK = 64 << 20  # bytes of each of the two pinned staging buffers of a device

log = logging.getLogger("overmind.copier")


def socket_path(home: Path) -> Path:
    return lifecycle.socket_path(home, "copier.sock")


def lock_path(home: Path) -> Path:
    return home / "copier.lock"


# Note [Device copies]
# A copy of an entry on a device makes the next kernel's move of that entry a copy within the device (an
# H200 copies device memory at about 4.3 TB/s: 16 GB in 4 ms) instead of one from host memory. The copier
# keeps one per (entry, device) where the units ledger grants the units at once (never waiting, never
# making a kernel wait: the holding is spare, Note [Spare holdings] in kernel_server/ledger.py, asked to
# release before any kernel's holding), made from the entry's arena the first time a kernel moves that
# entry there. What a kernel gets is always a copy in memory it allocated itself: its writes, through
# any route, reach only its own memory, and the copier's copy is written only from the arena, never from
# a kernel's memory (docs/design.md invariant 3). A copy is the arena's bytes as of a sealed, complete
# arena: the copier keys it by the entry and the identity of the arena's file (device and inode number,
# size, mtime_ns and ctime_ns: a file system reuses the inode number of a file deleted, and a new arena of
# the same size could have it) and of its parts' files (Note [Arena parts] in kernel_server/arena.py), so
# an entry compacted into a new arena, or a key published again, never meets an old copy; an arena with
# pieces pending (their bytes still only in checkpoint files) is copied to a kernel's memory only for the
# ranges the kernel read from it, and no copy of it is kept.
_FileId = tuple[int, int, int, int]  # device, inode number, mtime_ns, ctime_ns
_Ident = tuple[_FileId, int, tuple[tuple[int, int, _FileId], ...]]  # the arena's file and size; each part's


def _file_id(st: os.stat_result) -> _FileId:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(eq=False)
class _Copy:
    entry: str
    label: str
    device: str  # the ledger's id of the device
    tensor: Any  # torch.Tensor, uint8, the whole arena
    units: int
    holding: int | None  # None: the stand-in without a ledger
    last_used: float


class _Backend:
    """What differs between a CUDA device and the stand-in (the CPU, for tests and machines without a
    GPU): where a target is, where a copy is made, and how bytes get there from the host."""

    def __init__(self, standin: bool) -> None:
        import torch

        self.torch = torch
        self.standin = standin
        self._rings: dict[int, tuple[list[Any], list[Any], Any]] = {}

    def index_of(self, request: dict[str, Any]) -> int:
        """This process's index of the device a request names by the ledger's id (-1: the stand-in)."""
        if self.standin:
            return -1
        wanted = request["device"]
        for i in range(self.torch.cuda.device_count()):
            if cuda_identity(i) == wanted:
                return i
        raise LookupError(f"the copier sees no device {wanted} ({self.torch.cuda.device_count()} visible)")

    @contextlib.contextmanager
    def target(self, request: dict[str, Any], fds: list[int], index: int) -> Any:
        """The kernel's memory to fill, as a flat uint8 tensor, for the length of the block."""
        torch = self.torch
        nbytes = int(request["nbytes"])
        if self.standin:
            if len(fds) < 2:
                raise ValueError("a stand-in fill needs the target's memfd after the arena's descriptor")
            m = mmap.mmap(fds[1], nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                yield torch.frombuffer(m, dtype=torch.uint8, count=nbytes)
            finally:
                with contextlib.suppress(BufferError):
                    m.close()
            return
        try:
            fields = request["target"]
            _, handle, size, offset, counter, counter_offset, event, sync = (
                _unb64(f) if isinstance(f, str) and i in (1, 4, 6) else f for i, f in enumerate(fields))
            if int(size) < nbytes:
                raise ValueError(f"the target holds {int(size)} bytes, not {nbytes}")
            torch.cuda._lazy_init()
        except BaseException:
            self.give_back(request)  # Note [The kernel's reference to its block]
            raise
        with torch.cuda.device(index):
            # opening waits for the kernel's event on the current stream; the staging stream waits for that
            try:
                storage = torch.UntypedStorage._new_shared_cuda(index, handle, size, offset, counter,
                                                                counter_offset, event, sync)
            except BaseException:
                self.give_back(request)
                raise
            try:
                yield torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (nbytes,), (1,))
            finally:
                del storage

    # Note [The kernel's reference to its block]
    # `_share_cuda_` in the kernel (filling.py) sets the block's IPC reference counter to 1, and only the
    # deleter of the storage `_new_shared_cuda` opens here brings it back to 0. Until then torch keeps the
    # block from reuse when the kernel drops it: a fill that failed before it opened the handle (a device
    # this process does not see, a range outside the arena, no memory for the device copy, a handle that
    # does not open) would leave the kernel a model's size of device memory it can never use again. So
    # every fill that does not open its target gives the reference back, as torch.multiprocessing does
    # for a handle it does not open (`_release_ipc_counter` in torch/multiprocessing/reductions.py).
    def give_back(self, request: dict[str, Any]) -> None:
        """Release the kernel's IPC reference of a fill's target this process did not open (Note [The
        kernel's reference to its block]); nothing for the stand-in, whose target is a memfd."""
        if self.standin or not isinstance(request.get("target"), list) or len(request["target"]) != 8:
            return
        counter, counter_offset = request["target"][4:6]
        try:
            self.torch.UntypedStorage._release_ipc_counter_cuda(
                _unb64(counter) if isinstance(counter, str) else counter, int(counter_offset))
        except Exception:  # a bad request's fields: the kernel that sent it sees its fill fail
            log.exception("could not give back the IPC reference of a fill's target")

    def new_copy(self, index: int, nbytes: int) -> Any:
        torch = self.torch
        if self.standin:
            return torch.empty(nbytes, dtype=torch.uint8)
        return torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")

    def from_host(self, dst: Any, host: Any, index: int) -> None:
        """Copy the host tensor `host` (pageable, in an arena mapping) into `dst` on the device, through two
        pinned staging buffers: one filled by the CPU while the other is copied by the device's engine."""
        if self.standin:
            dst.copy_(host)
            return
        torch = self.torch
        with torch.cuda.device(index):
            buffers, events, stream = self._ring(index)
            stream.wait_stream(torch.cuda.current_stream(index))
            for i, start in enumerate(range(0, host.numel(), _CHUNK)):
                end = min(host.numel(), start + _CHUNK)
                buf, done = buffers[i % 2], events[i % 2]
                done.synchronize()  # the engine has read this buffer's previous chunk
                buf[:end - start].copy_(host[start:end])
                with torch.cuda.stream(stream):
                    dst[start:end].copy_(buf[:end - start], non_blocking=True)
                    done.record(stream)
            stream.synchronize()

    def within(self, dst: Any, src: Any, index: int) -> None:
        dst.copy_(src)
        if not self.standin:
            self.torch.cuda.synchronize(index)

    def _ring(self, index: int) -> tuple[list[Any], list[Any], Any]:
        ring = self._rings.get(index)
        if ring is None:
            torch = self.torch
            buffers = [torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            ring = self._rings[index] = (buffers, [torch.cuda.Event() for _ in range(2)], torch.cuda.Stream(index))
        return ring


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class Copier:
    """The copier's state: its copies, its arena mappings, its connection to the daemon's ledger."""

    def __init__(self, home: Path, standin: bool) -> None:
        self.home = home
        self.backend = _Backend(standin)
        self.copies: dict[tuple[str, _Ident, str], _Copy] = {}
        self.by_holding: dict[int, tuple[str, _Ident, str]] = {}
        # the arenas' host mappings, by their identity: (mapping, tensor over it, when last used)
        self.hosts: collections.OrderedDict[_Ident, tuple[mmap.mmap, Any, float]] = collections.OrderedDict()
        self.stats: dict[str, dict[str, float]] = {"fills": {}, "bytes": {}, "seconds": {}}
        self.work: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.client: Any = None
        self.simulated = False

    # -- the daemon's ledger ------------------------------------------------------------------

    # Note [A copier before the daemon]
    # A kernel starts the copier at its first move of a cached model to a device, and that move holds units,
    # so the daemon runs by then; but a process may start the copier first (`filling.connect` before any
    # load: a test, a benchmark), and a daemon may start after it. Without the ledger no copy is kept (its
    # units could not be counted), so the copier joins the ledger once one answers: before each fill or
    # keep, and once a second while it has none. Once joined, it exits when that daemon goes (its copies'
    # units went with the connection); a copier that never met a daemon exits when idle.
    def join_ledger(self) -> bool:
        """Join the daemon's units ledger if not joined yet (Note [A copier before the daemon]); whether it is."""
        if self.client is not None:
            return True
        try:
            client = Client(self.home, spawn=False, role="copier", label="device copier")
        except (DaemonError, OSError) as exc:
            log.debug("no units ledger yet: %s", exc)
            return False
        try:
            reply = client.request(Op.UNITS_REGISTER, devices=local_devices(), timeout=30)
        except (DaemonError, OSError) as exc:
            client.close()
            log.warning("the daemon did not register the copier's devices: %s", exc)
            return False
        self.simulated = bool(reply.get("simulated"))
        client.on_push("units_release_request", lambda p: self.work.put(("release", p.get("holding"))))
        self.client = client
        log.info("joined the units ledger")
        return True

    def _acquire(self, device: str, units: int, label: str) -> int | None:
        """A spare holding of `units` on `device`, if the ledger grants it at once."""
        if self.client is None:
            return None
        try:
            grant = self.client.request(Op.UNITS_ACQUIRE, units=units, devices=[device], timeout_s=0,
                                        label=f"device copy of {label}"[:200], busy=False, spare=True,
                                        context_units=context_units(self.simulated), timeout=30)
        except (RemoteError, DaemonError) as exc:
            log.info("no units for a copy of %s on %s: %s", label, device, exc)
            return None
        return int(grant["holding"])

    def _touch(self, copy: _Copy) -> None:
        """Tell the ledger the copy was used: the most recently used of the spare holdings now, before the
        kernel hears of the fill (one round trip: the ledger's order is the order of use)."""
        if copy.holding is not None and self.client is not None:
            with contextlib.suppress(DaemonError):
                self.client.request(Op.UNITS_TOUCH, holding=copy.holding, busy=False, timeout=30)

    def release(self, holding: int | None) -> None:
        """The ledger asks for a copy's units back: drop the copy, then give them back."""
        ident = self.by_holding.pop(holding, None) if holding is not None else None
        if ident is not None:
            self.copies.pop(ident, None)
            self._empty_cache()
        if holding is not None and self.client is not None:
            with contextlib.suppress(DaemonError):
                self.client.request(Op.UNITS_RELEASE, holding=holding, timeout=30)

    def expire(self, idle: float) -> None:
        """Drop the copies no kernel has used for `idle` seconds (OVERMIND_DEVICE_COPY_IDLE): the ledger
        gives kernels their units back at once, but programs outside it see only the device's memory. And
        the arenas' host mappings unused for as long, or HOST_IDLE if sooner (Note [Host mappings])."""
        now = time.time()
        for ident, (_, _, used) in list(self.hosts.items()):
            if now - used > min(idle, HOST_IDLE):
                del self.hosts[ident]
        for holding, key in list(self.by_holding.items()):
            copy = self.copies.get(key)
            if copy is not None and now - copy.last_used > idle:
                log.info("dropping the copy of %s on %s, unused for %.0f s", copy.label, copy.device,
                         now - copy.last_used)
                self.release(holding)

    def _empty_cache(self) -> None:
        if not self.backend.standin:
            self.backend.torch.cuda.empty_cache()

    # -- requests -----------------------------------------------------------------------------

    def handle(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        kind = request.get("kind")
        if kind == "hello":
            return {"kind": "hello", "version": PROTOCOL, "pid": os.getpid(), "standin": self.backend.standin}
        if kind == "state":
            return self.state()
        if kind == "drop":
            holdings = list(self.by_holding)
            for holding in holdings:
                self.release(holding)
            return {"kind": "dropped", "copies": len(holdings)}
        if kind in ("fill", "keep"):
            self.join_ledger()  # a daemon started after the copier (Note [A copier before the daemon])
            return self.fill(request, fds, target=kind == "fill")
        raise ValueError(f"unknown request {kind!r}")

    def fill(self, request: dict[str, Any], fds: list[int], *, target: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:  # up to the target's opening, which gives the reference back itself if it fails
            if not fds:
                raise ValueError(f"a {request['kind']} needs the entry's arena descriptor")
            entry, device = str(request["entry"]), str(request["device"])
            label = str(request.get("label") or entry[:12])
            start, nbytes = int(request.get("start", 0)), int(request.get("nbytes", 0))
            index = self.backend.index_of(request)
            described = request.get("parts", [])
            wanted = 1 + len(described) + (target and self.backend.standin)
            if len(fds) != wanted:
                which = "the arena's, its parts'" + (", the target's memfd" if wanted > 1 + len(described) else "")
                raise ValueError(f"a {request['kind']} of an arena in {1 + len(described)} files needs {wanted} "
                                 f"descriptors ({which}), not {len(fds)}")
            parts = [arena.Part(fd, int(offset), int(size))
                     for (offset, size), fd in zip(described, fds[1:1 + len(described)], strict=True)]
            st = os.fstat(fds[0])
            part_stats = [os.fstat(p.fd) for p in parts]
            ident = (_file_id(st), st.st_size,
                     tuple((p.offset, p.nbytes, _file_id(s)) for p, s in zip(parts, part_stats, strict=True)))
            fds = [fds[0], *fds[1 + len(parts):]]  # the arena, then the stand-in's target
            if start < 0 or nbytes < 0 or start + nbytes > st.st_size:
                raise ValueError(f"bytes {start}+{nbytes} lie outside the arena ({st.st_size} bytes)")
            key = (entry, ident, device)
            copy = self.copies.get(key)
            source = "device copy"
            if copy is None and request.get("complete"):
                copy = self._make_copy(key, label, fds[0], parts, index)
                source = "host" if copy is not None else source
            if copy is not None:
                copy.last_used = time.time()
                self._touch(copy)
        except BaseException:
            if target:
                self.backend.give_back(request)  # Note [The kernel's reference to its block]
            raise
        if target:
            with self.backend.target(request, fds, index) as dst:
                if copy is not None:
                    self.backend.within(dst, copy.tensor[start:start + nbytes], index)
                else:
                    source = "host"
                    self.backend.from_host(dst, self._host(fds[0], parts, ident)[start:start + nbytes], index)
        seconds = time.perf_counter() - t0
        for name, value in (("fills", 1), ("bytes", nbytes), ("seconds", seconds)):
            self.stats[name][source] = self.stats[name].get(source, 0) + value
        return {"kind": "filled" if target else "kept", "source": source, "seconds": round(seconds, 6),
                "kept": copy is not None}

    def _make_copy(self, key: tuple[str, _Ident, str], label: str, fd: int, parts: list[arena.Part],
                   index: int) -> _Copy | None:
        entry, ident, device = key
        nbytes = ident[1]
        units = -(-nbytes // GiB)
        holding = self._acquire(device, units, label)
        if holding is None:
            return None
        try:
            tensor = self.backend.new_copy(index, nbytes)
            self.backend.from_host(tensor, self._host(fd, parts, ident), index)
        except BaseException:
            self.release(holding)
            raise
        copy = self.copies[key] = _Copy(entry, label, device, tensor, units, holding, time.time())
        self.by_holding[holding] = key
        return copy

    # Note [Host mappings]
    # A fill from the host reads the arena through a private mapping of its files, kept for the next fills
    # of that arena (mapping it again would fault its pages in again). But a mapping holds its files open:
    # an entry the daemon evicts meanwhile keeps its memory (a memfd arena) or disk (a file arena) for as
    # long as the copier maps it, outside the daemon's budget. So at most eight are kept, and each is
    # dropped once unused for HOST_IDLE seconds (or OVERMIND_DEVICE_COPY_IDLE, if shorter).
    def _host(self, fd: int, parts: list[arena.Part], ident: _Ident) -> Any:
        """The arena with its parts as a host tensor over a private mapping that nothing writes, kept for
        the next fills (Note [Host mappings])."""
        found = self.hosts.get(ident)
        if found is None:
            m = arena.map_private(fd, ident[1], parts=parts)
            found = (m, self.backend.torch.frombuffer(m, dtype=self.backend.torch.uint8), 0.0)
            while len(self.hosts) >= 8:
                self.hosts.popitem(last=False)
        self.hosts[ident] = (found[0], found[1], time.time())
        self.hosts.move_to_end(ident)
        return found[1]

    def state(self) -> dict[str, Any]:
        return {"kind": "state", "pid": os.getpid(), "standin": self.backend.standin,
                "copies": [{"entry": c.entry, "label": c.label, "device": c.device, "bytes": int(c.tensor.numel()),
                            "units": c.units, "holding": c.holding, "last_used": c.last_used}
                           for c in self.copies.values()],
                "host_mappings": len(self.hosts),
                **{name: dict(values) for name, values in self.stats.items()}}

    # -- the loop -----------------------------------------------------------------------------

    def worker(self) -> None:
        """Runs every request and release in order, on one thread: one device copy at a time."""
        while True:
            item = self.work.get()
            if item[0] == "expire":
                self.expire(item[1])
                continue
            if item[0] == "ledger":
                self.join_ledger()
                continue
            if item[0] == "release":
                try:
                    self.release(item[1])
                except Exception:
                    log.exception("could not give back holding %s", item[1])
                continue
            _, conn, request, fds = item
            try:
                reply = self.handle(request, fds)
            except Exception as exc:
                log.exception("request %s failed", request.get("kind"))
                reply = {"kind": "error", "error": f"{type(exc).__name__}: {exc}"}
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(json.dumps(reply).encode())


def _receive(conn: socket.socket) -> tuple[dict[str, Any] | None, list[int]] | None:
    """The next request on `conn` and its descriptors; None at the connection's end; (None, []) for a
    request that could not be read, answered with an error here."""
    try:
        data, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, MAX_FDS)
    except OSError:
        return None
    if not data:
        return None
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):  # the kernel closed the descriptors that did not fit
            raise ValueError(f"it came cut short: more than {MAX_FDS} descriptors or {MAX_MESSAGE} bytes")
        request = json.loads(data)
        if not isinstance(request, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"kind": "error", "error": f"bad request: {exc}"}).encode())
        return None, []
    return request, fds


def serve(home: Path, standin: bool) -> int:
    """Run the copier until the daemon goes, or until idle (see the module's docstring)."""
    home.mkdir(parents=True, exist_ok=True)
    lock = os.open(lock_path(home), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another copier runs: it serves
    copier = Copier(home, standin)
    if not copier.join_ledger():  # no daemon yet: serve (fills need no units), without copies until one answers
        log.warning("device copier without the units ledger until a daemon answers at %s", home)
    path = socket_path(home)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(64)
    threading.Thread(target=copier.worker, name="overmind-copier", daemon=True).start()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    connections = 0
    idle_since = time.monotonic()
    copy_idle = float(settings.get(settings.DEVICE_COPY_IDLE))
    expired_at = ledger_at = time.monotonic()
    while True:
        if (copier.copies or copier.hosts) and time.monotonic() - expired_at >= 1.0:  # their age, once a second
            expired_at = time.monotonic()
            copier.work.put(("expire", copy_idle))
        if copier.client is None and copier.work.empty() and time.monotonic() - ledger_at >= 1.0:
            ledger_at = time.monotonic()  # Note [A copier before the daemon]
            copier.work.put(("ledger",))
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                accepted, _ = listener.accept()
                selector.register(accepted, selectors.EVENT_READ)
                connections += 1
                continue
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            received = _receive(conn)
            if received is None:
                selector.unregister(conn)
                conn.close()
                connections -= 1
                idle_since = time.monotonic()
                continue
            request, fds = received
            if request is None:
                continue
            copier.work.put(("request", conn, request, fds))
        if copier.client is not None and copier.client.closed:
            log.info("the daemon is gone: the copier exits")
            return 0
        if not connections and not copier.copies and copier.work.empty() \
                and time.monotonic() - idle_since > IDLE_EXIT:
            log.info("idle: the copier exits")
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overmind_jupyter.units.copier")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    home = lifecycle.state_dir()
    standin = settings.get(settings.DEVICE_COPIER) == "cpu"
    return serve(home, standin)


if __name__ == "__main__":
    sys.exit(main())
