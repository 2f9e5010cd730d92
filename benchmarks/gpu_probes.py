"""Probes of the ways a kernel's weights could reach its GPU (issue 36, candidates (a), (b), (c)).

Each probe moves the same bytes, a model's safetensors files laid end to end in one file (in /dev/shm: shared
memory, as a memfd arena's pages are), into device memory that the measuring process (the "kernel") owns,
and reports the model's bytes over the time of the copy (GB/s, 1e9 bytes; bytes read plus written would be
twice that). The kernel is a process forked from one that imported torch and ran no torch operation; it forks
its helper (the stand-in for a per-user process beside the daemon) before either touches CUDA.

  pageable          the kernel maps the file privately (MAP_PRIVATE, as a hit maps an arena) and copies it to
                    its device buffer in one `copy_` (today's hit, per model rather than per tensor)
  pageable-4        the same in 4 chunks, from 4 threads, each on its own stream
  bounce            the kernel copies chunks (64 MiB) of its private mapping into 2 pinned staging buffers
                    allocated once, and each staging buffer to the device on a stream, pipelined; the
                    allocation is reported apart (a helper would make it once)
  d2d               (b) the helper holds a device copy of the bytes and shares it over CUDA IPC (one handle);
                    the kernel opens it and copies it into its own allocation (a copy: writes stay private)
  pinned            (a) the kernel allocates its device buffer and shares it with the helper over CUDA IPC
                    (one handle for the whole model); the helper maps the file shared, registers its pages
                    with `cudaHostRegister` once (timed), opens the handle (timed) and copies
  pinned-ro         the same registration with cudaHostRegisterReadOnly (after unregistering the first)
  register-private  the kernel registers its own private mapping read-only and copies from it: what
                    pinning inside each kernel after each restart would cost

Every probe poisons the device buffer first and checks 4,096 sampled bytes against the file afterwards.
Registrations that do not finish within `register_timeout` seconds are reported as such (the issue saw one of
2.2 GB not finish in 150 s), and the probes after them in the same helper are skipped.

Without CUDA (`device="cpu"`, gpu.py --dry-run) every probe runs with CPU stand-ins (a shared-memory tensor
for the device buffer, torch's CPU sharing for the IPC handle, plain memory for pinned) so that the processes'
choreography is checked; the registrations are skipped and say so. Results are written to `result` after
each probe, so a probe that hangs and is killed leaves those before it.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

CHUNK = 64 << 20
SAMPLES = 4096
REGISTER_DEFAULT = 0
REGISTER_PORTABLE = 0x01
REGISTER_READ_ONLY = 0x08
PROBES = ("pageable", "pageable-4", "bounce", "d2d", "pinned", "pinned-ro", "register-private")


class Dev:
    """The device, or its CPU stand-in: allocation, synchronisation, streams, pinning."""

    def __init__(self, name: str) -> None:
        import torch

        self.torch, self.name, self.cuda = torch, name, name == "cuda"

    def empty(self, n: int, shared: bool = False) -> Any:
        t = self.torch.empty(n, dtype=self.torch.uint8, device=self.name)
        return t.share_memory_() if shared and not self.cuda else t

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def stream(self) -> Any:
        import contextlib

        return self.torch.cuda.Stream() if self.cuda else contextlib.nullcontext()

    def use(self, stream: Any) -> Any:
        return self.torch.cuda.stream(stream) if self.cuda else stream

    def pinned(self, n: int) -> Any:
        return self.torch.empty(n, dtype=self.torch.uint8, pin_memory=self.cuda)

    def register(self, ptr: int, n: int, flags: int) -> None:
        err = self.torch.cuda.cudart().cudaHostRegister(ptr, n, flags)  # releases the GIL while it runs
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"cudaHostRegister(flags={flags:#x}) failed: {err}")

    def unregister(self, ptr: int) -> None:
        self.torch.cuda.cudart().cudaHostUnregister(ptr)


def _map(path: str, n: int, shared: bool) -> tuple[mmap.mmap, Any]:
    import torch

    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _poison(dev: Dev, dst: Any) -> None:
    dst.fill_(0xA5)
    dev.sync()


def _check(dev: Dev, dst: Any, src: Any, index: Any) -> bool:
    return bool(dev.torch.equal(dst[index.to(dst.device)].cpu(), src[index]))


def _gbps(n: int, seconds: float) -> float:
    return n / seconds / 1e9


# -- the helper: a process beside the kernel -------------------------------------------------------------

def helper(conn: Any, path: str, n: int, device: str) -> None:
    """Serve the kernel's requests on `conn` until "exit": ("hold",) keeps a device copy of the file and
    answers with its handle; ("register", flags) maps the file shared and registers it; ("copy_into",) then
    receives a handle to the kernel's buffer, opens it and copies the registered pages into it."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 (its reductions make CUDA and shared tensors picklable)

    dev = Dev(device)
    held = mapping = None
    registered: int | None = None
    while True:
        request = conn.recv()
        kind = request[0]
        try:
            if kind == "exit":
                return
            if kind == "hold":
                mm, src = _map(path, n, shared=True)
                held = dev.empty(n, shared=True)
                held.copy_(src)
                dev.sync()
                del src
                mm.close()
                conn.send_bytes(bytes(ForkingPickler.dumps(held)))
            elif kind == "register":
                if registered is not None:
                    dev.unregister(registered)
                    registered = None
                if mapping is None:
                    mapping = _map(path, n, shared=True)
                mm, src = mapping
                t0 = time.perf_counter()
                if dev.cuda:
                    dev.register(src.data_ptr(), n, request[1])
                    registered = src.data_ptr()
                conn.send({"register_s": time.perf_counter() - t0})
            elif kind == "copy_into":
                data = conn.recv_bytes()
                t0 = time.perf_counter()
                dst = pickle.loads(data)
                t1 = time.perf_counter()
                dst.copy_(mapping[1], non_blocking=dev.cuda)
                dev.sync()
                t2 = time.perf_counter()
                del dst
                conn.send({"open_s": t1 - t0, "copy_s": t2 - t1})
            else:
                conn.send({"error": f"unknown request {kind!r}"})
        except Exception as exc:  # noqa: BLE001 (the kernel reports it with the probe's name)
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


# -- the kernel: the process that owns the device buffer -------------------------------------------------

class Kernel:
    def __init__(self, spec: dict[str, Any]) -> None:
        from multiprocessing import Pipe

        self.spec, self.n, self.path = spec, spec["bytes"], spec["source"]
        self.report: dict[str, Any] = {"bytes": self.n, "device": spec["device"], "probes": {}}
        self.conn, child = Pipe()
        self.helper = os.fork()  # before CUDA, here and there
        if self.helper == 0:
            code = 0
            try:
                self.conn.close()
                helper(child, self.path, self.n, spec["device"])
            except BaseException:  # noqa: BLE001 (a broken pipe when the kernel is gone)
                code = 1
            finally:
                os._exit(code)
        child.close()
        self.helper_alive, self.stuck = True, False
        self.dev = Dev(spec["device"])
        import torch

        self.mm, self.src = _map(self.path, self.n, shared=False)
        self.index = torch.cat([torch.randint(0, self.n, (SAMPLES - 1,)), torch.tensor([self.n - 1])])
        t0 = time.perf_counter()
        self.dst = self.dev.empty(self.n, shared=True)
        self.dev.sync()
        self.report["context_and_alloc_s"] = time.perf_counter() - t0

    def save(self) -> None:
        Path(self.spec["result"]).write_text(json.dumps(self.report))

    def record(self, name: str, row: dict[str, Any]) -> None:
        if "copy_s" in row:
            row["gbps"] = _gbps(self.n, row["copy_s"])
        self.report["probes"][name] = row
        self.save()

    def ask(self, request: tuple[Any, ...], timeout: float) -> dict[str, Any] | None:
        """The helper's answer, or None when it gave none within `timeout` (it is then killed)."""
        self.conn.send(request)
        if self.conn.poll(timeout):
            answer: dict[str, Any] = self.conn.recv()
            if "error" in answer:
                raise RuntimeError(answer["error"])
            return answer
        os.kill(self.helper, signal.SIGKILL)  # not waited for: a registration may not end at once
        self.helper_alive = False
        return None

    def copy_timed(self, copy: Any) -> dict[str, Any]:
        _poison(self.dev, self.dst)
        t0 = time.perf_counter()
        copy()
        self.dev.sync()
        seconds = time.perf_counter() - t0
        return {"copy_s": seconds, "checked": _check(self.dev, self.dst, self.src, self.index)}

    # the probes, in the order they run -------------------------------------------------------------

    def pageable(self) -> dict[str, Any]:
        first = self.copy_timed(lambda: self.dst.copy_(self.src))
        second = self.copy_timed(lambda: self.dst.copy_(self.src))
        return second | {"first_copy_s": first["copy_s"], "first_gbps": _gbps(self.n, first["copy_s"]),
                         "checked": first["checked"] and second["checked"]}

    def pageable_4(self) -> dict[str, Any]:
        parts = 4
        step = -(-self.n // parts)
        streams = [self.dev.stream() for _ in range(parts)]

        def one(i: int) -> None:
            with self.dev.use(streams[i]):
                self.dst[i * step:(i + 1) * step].copy_(self.src[i * step:(i + 1) * step], non_blocking=True)
                if self.dev.cuda:
                    streams[i].synchronize()

        def copy() -> None:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(parts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        return self.copy_timed(copy)

    def bounce(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        staging = [self.dev.pinned(CHUNK), self.dev.pinned(CHUNK)]
        streams = [self.dev.stream(), self.dev.stream()]
        alloc = time.perf_counter() - t0
        torch = self.dev.torch

        def copy() -> None:
            done: list[Any] = [None, None]
            for k, start in enumerate(range(0, self.n, CHUNK)):
                i, size = k % 2, min(CHUNK, self.n - start)
                if done[i] is not None:
                    done[i].synchronize()  # the staging buffer's last copy to the device has finished
                staging[i][:size].copy_(self.src[start:start + size])
                with self.dev.use(streams[i]):
                    self.dst[start:start + size].copy_(staging[i][:size], non_blocking=True)
                    if self.dev.cuda:
                        done[i] = torch.cuda.Event()
                        done[i].record()

        return self.copy_timed(copy) | {"pinned_alloc_s": alloc, "chunk_bytes": CHUNK}

    def d2d(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.conn.send(("hold",))
        data = self.conn.recv_bytes()
        held_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        held = pickle.loads(data)
        open_s = time.perf_counter() - t1
        row = self.copy_timed(lambda: self.dst.copy_(held))
        return row | {"open_s": open_s, "helper_fill_s": held_s}

    def pinned(self, flags: int) -> dict[str, Any]:
        from multiprocessing.reduction import ForkingPickler

        if not self.dev.cuda:
            note = "cudaHostRegister: CUDA only, skipped (the helper's copy runs from its shared mapping)"
        else:
            note = f"flags {flags:#x}"
        answer = self.ask(("register", flags), self.spec["register_timeout"])
        if answer is None:
            return {"skipped": f"the helper's cudaHostRegister of {self.n / 1e9:.2f} GB (flags {flags:#x}) did not "
                               f"finish in {self.spec['register_timeout']:.0f} s; helper killed"}
        _poison(self.dev, self.dst)
        self.conn.send(("copy_into",))
        t0 = time.perf_counter()
        self.conn.send_bytes(bytes(ForkingPickler.dumps(self.dst)))
        done = self.conn.recv()
        wall = time.perf_counter() - t0
        if "error" in done:
            raise RuntimeError(done["error"])
        return {"register_s": answer["register_s"], "open_s": done["open_s"], "copy_s": done["copy_s"],
                "request_s": wall, "checked": _check(self.dev, self.dst, self.src, self.index), "note": note}

    def register_private(self) -> dict[str, Any]:
        if not self.dev.cuda:
            return {"skipped": "cudaHostRegister: CUDA only"}
        outcome: dict[str, Any] = {}

        def register() -> None:
            t0 = time.perf_counter()
            try:
                self.dev.register(self.src.data_ptr(), self.n, REGISTER_READ_ONLY)
                outcome["register_s"] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 (reported as the probe's error)
                outcome["error"] = exc

        thread = threading.Thread(target=register, daemon=True)
        thread.start()
        thread.join(self.spec["register_timeout"])
        if thread.is_alive():  # left running: this process ends without waiting for it
            self.stuck = True
            return {"skipped": f"cudaHostRegister of the kernel's private mapping ({self.n / 1e9:.2f} GB, "
                               f"read-only) did not finish in {self.spec['register_timeout']:.0f} s"}
        if "error" in outcome:
            raise outcome["error"]
        try:
            row = self.copy_timed(lambda: self.dst.copy_(self.src, non_blocking=True))
        finally:
            self.dev.unregister(self.src.data_ptr())
        return row | {"register_s": outcome["register_s"]}

    def run(self, which: list[str]) -> None:
        steps = {"pageable": self.pageable, "pageable-4": self.pageable_4, "bounce": self.bounce, "d2d": self.d2d,
                 "pinned": lambda: self.pinned(REGISTER_DEFAULT),
                 "pinned-ro": lambda: self.pinned(REGISTER_READ_ONLY | REGISTER_PORTABLE),
                 "register-private": self.register_private}
        skip = self.spec.get("skip") or {}
        for name in PROBES:
            if name not in which:
                continue
            if name in skip:
                self.record(name, {"skipped": skip[name]})
                continue
            if name in ("d2d", "pinned", "pinned-ro") and not self.helper_alive:
                self.record(name, {"skipped": "the helper was killed after an earlier registration timed out"})
                continue
            self.report["running"] = name
            self.save()  # a probe killed by the job's timeout is named in the partial result
            try:
                self.record(name, steps[name]())
            except Exception as exc:  # noqa: BLE001 (reported in the table; the next probe runs)
                self.record(name, {"error": f"{type(exc).__name__}: {exc}"})
        self.report.pop("running", None)
        self.save()

    def close(self) -> None:
        if self.helper_alive and not self.stuck:
            self.conn.send(("exit",))
            os.waitpid(self.helper, 0)


def run(spec: dict[str, Any]) -> None:
    """gpu.py's "probes" job, in a process forked from the fork parent. `spec`: source (the file),
    bytes, device, register_timeout (s), probes (names), skip ({name: why}), result (the JSON file written)."""
    import torch.multiprocessing  # noqa: F401

    kernel = Kernel(spec)
    try:
        kernel.run(list(spec.get("probes") or PROBES))
    finally:
        kernel.close()
