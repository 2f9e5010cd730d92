"""The store's catalogue keeps its orders, sums and indices right through any sequence of adds, uses,
pins and removals (Note [Eviction in O(log n)] in kernel_server/catalogue.py): each is checked against
the same thing computed the slow way, from every entry, after every step."""

from __future__ import annotations

import itertools
import random

import pytest

from kernel_server import catalogue
from kernel_server.catalogue import Catalogue, Entry


def entry(key: str, nbytes: int, deps: list[str], now: float, *, marker: bool = False, backing: str = "memfd",
          pending: int = 0) -> Entry:
    """`pending` of its `nbytes` still in a checkpoint (one piece), for an entry in a file arena."""
    return Entry(key, graph_fd=-1, arena_fd=-1, graph_bytes=16, arena_bytes=nbytes, backing=backing, meta={},
                 deps=deps, created=now, last_used=now, marker=marker, pieces=[[0, pending, 0, 0]] if pending else [])


def check(cat: Catalogue, entries: dict[str, Entry]) -> None:
    """Everything the catalogue answers, against the answer from all entries (`entries` in the order of
    their use, the least recent first)."""
    listed = [e for e in entries.values() if not e.marker]
    assert len(cat) == len(entries) and cat.listed == len(listed)
    assert (cat.nbytes, cat.nfds) == (sum(e.nbytes for e in entries.values()), sum(e.nfds for e in entries.values()))
    on_disk = [e.arena_bytes - sum(p[1] for p in e.pieces) for e in entries.values() if e.backing == "file"]
    assert cat.disk_bytes == sum(on_disk)
    assert cat.by_use() == list(entries)
    for key in entries:
        closure, stack = set(), [key]
        while stack:
            k = stack.pop()
            for e in entries.values():
                if k in e.deps and e.key not in closure:
                    closure.add(e.key)
                    stack.append(e.key)
        assert set(cat.dependents(key)) == closure
    held, stack = set(), [e for e in entries.values() if e.pins]
    while stack:
        e = stack.pop()
        if e.key not in held:
            held.add(e.key)
            stack += [entries[d] for d in e.deps if d in entries]
    assert cat.held_by_pins() == held
    for limit in (0, 1, 4, 7, 50):
        largest = sorted(listed, key=lambda e: (e.nbytes, e.last_used, e.key), reverse=True)[:limit // 2]
        recent = [e for e in reversed(listed) if e not in largest]
        assert cat.shown(limit) == largest + recent[:limit - len(largest)]
    by_key = sorted(e.key for e in listed)
    for after in ("", *by_key[::7]):
        assert [e.key for e in cat.page(after, 5)] == [k for k in by_key if k > after][:5]
    for prefix in ("k1", "k2", "k", "m"):
        assert cat.with_prefix(prefix, 3) == [k for k in by_key if k.startswith(prefix)][:3]


@pytest.mark.parametrize("chunk", [2, 256])
@pytest.mark.parametrize("seed", range(4))
def test_the_catalogue_agrees_with_its_entries_after_every_step(
        seed: int, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With chunks of its sorted lists so short that they split and join all the time, and as they are."""
    monkeypatch.setattr(catalogue._SortedChunks, "CHUNK", chunk)
    rng = random.Random(seed)
    cat, entries = Catalogue(), {}
    clock = itertools.count(1)
    names = itertools.count()
    for _ in range(400):
        op = rng.random()
        present = list(entries)
        if op < 0.35 or not present:  # publish, maybe building on others
            key = f"{rng.choice('km')}{next(names)}"
            deps = rng.sample(present, min(len(present), rng.choice((0, 0, 1, 2))))
            nbytes, backing = rng.choice((4096, 8192, 4096 * rng.randrange(1, 9))), rng.choice(("memfd", "file"))
            new = entry(key, nbytes, deps, next(clock), marker=rng.random() < 0.1, backing=backing,
                        pending=rng.choice((0, nbytes // 2)))
            if rng.random() < 0.3:
                new.pins[rng.randrange(3)] += 1  # published pinned by its loader
            cat.add(new)
            entries[key] = new
        elif op < 0.55:  # a hit: the entry and what it builds on, pinned and used
            e = entries[rng.choice(present)]
            conn, now = rng.randrange(3), next(clock)
            chain, stack = {}, [e]
            while stack:
                x = stack.pop()
                if x.key not in chain:
                    chain[x.key] = x
                    stack += [entries[d] for d in x.deps if d in entries]
            for x in chain.values():
                cat.pin(x, conn)
            for x in reversed(list(chain.values())):
                cat.used(x, now)
                entries[x.key] = entries.pop(x.key)  # the most recently used last
        elif op < 0.7:  # an unpin
            pinned = [(e, c) for e in entries.values() for c in e.pins]
            if pinned:
                e, conn = rng.choice(pinned)
                cat.unpin(e, conn, rng.choice((1, 1, 2)))
        elif op < 0.8:  # a connection ends
            cat.release(rng.randrange(3))
        elif op < 0.9:  # a compaction copies an entry's pieces and lets its sources go
            e = entries[rng.choice(present)]
            before, disk_before = e.nfds, e.disk_bytes
            e.sources, e.pieces = [], []
            cat.recount(e, before, disk_before)
        else:  # an eviction: the entry and what builds on it
            key = rng.choice(present)
            for k in [*cat.dependents(key), key]:
                assert cat.remove(k) is entries.pop(k)
        check(cat, entries)
