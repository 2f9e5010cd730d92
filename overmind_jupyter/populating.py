"""A hit's pages mapped ahead of its first forward: those its storages lie on, but those no forward reads whole.

`rebuild` calls `populate_ahead` once a hit's graph is rebuilt; one background thread faults the pages in
(kernel_server/arena.py `populate`), so that the first forward takes no page faults.
"""

from __future__ import annotations

import _thread
from collections.abc import Sequence
from typing import Any

import torch

from kernel_server import arena

__all__ = ["populate_ahead"]


def populate_ahead(spans: list[tuple[int, int]], result: Any,
                   holes: Sequence[tuple[int, int]] = ()) -> None:
    """Start one thread that faults in the pages of `spans` ((address, bytes) of what a hit's storages
    lie on), less those inside `holes` (the ranges of an arena whose bytes lie in a checkpoint file) and
    the input embedding table of `result` (Note [Populate what a forward reads]).

    One thread for all the mappings, started without waiting for it to run: threading's start() waits
    until the new thread is scheduled, a slice on a loaded machine, on the hit's path. Where the process
    can start no thread, none: the first forward faults the pages in (Note [Helper threads] in threads.py).
    """
    pages = _without(_pages(spans), [*holes, *_sparse_tables(result)])
    try:
        _thread.start_new_thread(_populate, (pages,))
    except RuntimeError:  # "can't start new thread"
        pass


def _populate(spans: list[tuple[int, int]]) -> None:
    """Fault in the pages of a rebuild's mappings ahead of the first forward (arena.populate)."""
    for address, nbytes in spans:
        arena.populate(address, nbytes)


# Note [Populate what a forward reads]
# A hit maps every page its storages lie on ahead of the first forward (arena.populate), in one background
# thread, so that the forward takes no page faults. Of an entry whose weights still lie in its checkpoint
# files (Note [Pending pieces] in kernel_server/store.py), that is the pieces in each file's mapping and
# the rest of its arena, not the arena's ranges under the pieces: those are holes in the arena's file,
# which no storage of the hit lies on, and a read fault there fills them with new zeroed pages. Mapped
# whole, a 1.1B bf16 entry's arena took 2 GiB of zeroes into the kernel and 3.8 s of a core, while the
# kernel's next load waited for the mmap lock that populating holds (benchmarks/RESULTS.md, "A hit while
# the compactor copies"). Every page but those of the input embedding table:
# a forward reads the rows of its tokens only, and a page mapped is a page counted in the process's RSS
# and PSS. Three kernels holding a 1.1B fp32 model from the cache each mapped all of its 4.4 GB, the
# embedding table included (262 MB that no forward reads; benchmarks/RESULTS.md, issue 39). A table read
# whole elsewhere (tied to the output layer) is mapped as the rest. The table is found by the model's own
# `get_input_embeddings` and `get_output_embeddings` (transformers' models; about 15 us on the hit's
# path), not by a walk of the modules (0.5 ms for a 1.1B Llama), and not in the populate thread: a
# thread inside torch's calls when the interpreter exits aborts the process ("terminate called without
# an active exception"), which a thread inside madvise does not.


def _sparse_tables(obj: Any, depth: int = 2) -> list[tuple[int, int]]:
    """The (address, bytes) of the input embedding table of `obj` (a transformers model, or one in a
    tuple, list or dict, as a hit's graph holds its result) when no forward reads it whole (Note
    [Populate what a forward reads])."""
    if isinstance(obj, (tuple, list, dict)) and depth:
        return [t for item in (obj.values() if isinstance(obj, dict) else obj)
                for t in _sparse_tables(item, depth - 1)]
    inputs, outputs = getattr(obj, "get_input_embeddings", None), getattr(obj, "get_output_embeddings", None)
    if not isinstance(obj, torch.nn.Module) or not callable(inputs):
        return []
    try:
        table = inputs()
        output = outputs() if callable(outputs) else None
        if not isinstance(table, torch.nn.Embedding) or table.weight.device.type != "cpu":
            return []
        storage = table.weight.untyped_storage()
        read_whole = getattr(output, "weight", None)
        if isinstance(read_whole, torch.Tensor) and read_whole.untyped_storage().data_ptr() == storage.data_ptr():
            return []  # tied: the output layer reads all of it
        return [(storage.data_ptr(), storage.nbytes())]
    except Exception:  # noqa: BLE001 (a model without them: every page is mapped, as before)
        return []


def _pages(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages of `spans` (madvise takes page-aligned ranges), in order, overlaps merged."""
    page = arena.PAGE
    merged: list[list[int]] = []
    for start, end in sorted((at // page * page, arena.align(at + nbytes)) for at, nbytes in spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged if end > start]


def _without(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` (whole pages, in order and apart, as `_pages` gives them) less the whole pages of `holes`
    (both as (address, bytes)): one pass over both, in order, for the hundreds of pieces of a pending
    entry."""
    page = arena.PAGE
    cuts = sorted(cut for at, nbytes in holes
                  if (cut := (arena.align(at), (at + nbytes) // page * page))[1] > cut[0])
    kept, first = [], 0
    for at, nbytes in spans:
        start, end = at, at + nbytes
        while first < len(cuts) and cuts[first][1] <= start:  # cuts that end before this span
            first += 1
        i = first
        while i < len(cuts) and cuts[i][0] < end:  # cuts that start inside it
            cut_start, cut_end = cuts[i]
            if cut_start > start:
                kept.append((start, cut_start - start))
            start = max(start, cut_end)
            i += 1
        if start < end:
            kept.append((start, end - start))
    return kept
