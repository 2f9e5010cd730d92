"""Where a converting miss's threads write: bf16 -> fp32 of 1 GiB (out) by 2 threads, 8 MiB chunks each, into
one memfd by pwrite (what the stage does: Note [Staged conversions] in overmind_jupyter/staging.py), into
two memfds by pwrite (one per thread), into a shared writable mapping of one memfd (with MADV_POPULATE_WRITE
first, and without), and into fresh anonymous memory (the plain load's way). Wall and process CPU time,
the cases interleaved in rounds, medians.

    .venv/bin/python benchmarks/stage_writes.py [ROUNDS]
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

OUT_BYTES = 1 << 30
CHUNK = 8 << 20
THREADS = 2
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)


def in_threads(job: Callable[[int, torch.Tensor], None], src: torch.Tensor) -> None:
    n = src.numel() // THREADS
    threads = [threading.Thread(target=job, args=(i, src[i * n:(i + 1) * n])) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def by_pwrite(src: torch.Tensor, fds: list[int]) -> None:
    def job(i: int, part: torch.Tensor) -> None:
        fd = fds[i % len(fds)]
        base = 0 if len(fds) > 1 else i * part.numel() * 4
        buffer, step = torch.empty(CHUNK, dtype=torch.uint8), CHUNK // 4
        for start in range(0, part.numel(), step):
            piece = part[start:start + step]
            out = buffer[:piece.numel() * 4].view(torch.float32)
            out.copy_(piece)
            view, at = memoryview(out.view(torch.uint8).numpy()), base + start * 4
            while view:
                done = os.pwrite(fd, view, at)
                view, at = view[done:], at + done

    in_threads(job, src)


def by_mapping(src: torch.Tensor, fd: int, populate: bool) -> None:
    m = mmap.mmap(fd, OUT_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    views = [torch.frombuffer(m, dtype=torch.float32)]

    def job(i: int, part: torch.Tensor) -> None:
        n = part.numel()
        dst = views[0][i * n:(i + 1) * n]
        if populate:
            _libc.madvise(ctypes.c_void_p(dst.data_ptr()), ctypes.c_size_t(n * 4), _MADV_POPULATE_WRITE)
        dst.copy_(part)

    in_threads(job, src)
    views.clear()
    m.close()


def anonymous(src: torch.Tensor) -> None:
    outs: list[torch.Tensor] = []
    in_threads(lambda i, part: outs.append(part.to(torch.float32)), src)


def memfds(count: int) -> list[int]:
    fds = [os.memfd_create(f"stage-{i}") for i in range(count)]
    for fd in fds:
        os.ftruncate(fd, OUT_BYTES // count)
    return fds



def run(name: str, src: torch.Tensor) -> tuple[float, float]:
    fds = memfds(2) if name == "two memfds, pwrite" else [] if name == "anonymous" else memfds(1)
    cpu, wall = time.process_time(), time.perf_counter()
    if name == "anonymous":
        anonymous(src)
    elif "pwrite" in name:
        by_pwrite(src, fds)
    else:
        by_mapping(src, fds[0], populate="no populate" not in name)
    result = time.perf_counter() - wall, time.process_time() - cpu
    for fd in fds:
        os.close(fd)
    return result


def main() -> None:
    torch.set_num_threads(1)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    src = torch.randn(OUT_BYTES // 4).to(torch.bfloat16)
    names = ["anonymous", "one memfd, pwrite", "two memfds, pwrite", "one memfd, mapping",
             "one memfd, mapping, no populate"]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            runs[name].append(run(name, src))
    for name, rs in runs.items():
        wall, cpu = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        print(f"{name:32} wall {wall:.3f} s  CPU {cpu:.3f} s  ({', '.join(f'{w:.2f}/{c:.2f}' for w, c in rs)})")


if __name__ == "__main__":
    main()
