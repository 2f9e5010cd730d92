"""Thousands of small entries, published through the real protocol in a few seconds: the tokenizers,
processors and schedulers of a long session (tests/test_many_entries.py, benchmarks/many_entries.py).

Every entry is a page of arena and a 16-byte graph. They all share one sealed graph and one sealed arena
(the daemon holds a descriptor of each per entry, as it would of entries of their own), and requests go
in batches without waiting for each reply, so that a store of 10,000 entries is filled quickly.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from kernel_server import Client, arena
from kernel_server.protocol import Frame

__all__ = ["ENTRY_BYTES", "HitTimer", "fits_descriptors", "publish_many", "tokenizer_meta"]

GRAPH_BYTES = 16
ENTRY_BYTES = GRAPH_BYTES + arena.PAGE  # what one small entry takes of the budget
_BATCH = 100  # keys whose requests are in flight at once (their replies fit the socket's buffers)


def fits_descriptors(client: Client, wanted: int, spare: int = 64) -> int:
    """How many of `wanted` small entries the daemon's descriptor cap lets it hold (2 descriptors
    each, Note [Descriptor budget] in kernel_server/descriptors.py), keeping `spare` for the test."""
    fds = client.request("status")["descriptors"]
    return max(0, min(wanted, (fds["cap"] - fds["entries"] - spare) // 2))


def tokenizer_meta(key: str) -> dict[str, str]:
    """What a kernel's publish says of a tokenizer (overmind_jupyter/publishing.py): about 300 bytes."""
    path = f"/home/ada/checkpoints/some-organisation/llama-3.2-1b-instruct-{key}"
    return {"label": f"PreTrainedTokenizerFast.from_pretrained({path!r}, use_fast=True, padding_side='left')",
            "class": "transformers.tokenization_utils_fast.PreTrainedTokenizerFast", "source": repr(path),
            "dtype": ""}


def publish_many(client: Client, count: int, prefix: str = "small", *, pages: int = 1) -> list[str]:
    """Publish `count` entries of `pages` pages of arena each, with keys `{prefix}-000000`...; returns their
    keys, in the order published."""
    graph, data = arena.ArenaWriter(GRAPH_BYTES), arena.ArenaWriter(pages * arena.PAGE)
    graph_fd, data_fd = graph.seal(), data.seal()
    keys = [f"{prefix}-{i:06d}" for i in range(count)]
    try:
        for start in range(0, count, _BATCH):
            pending: list[tuple[int, Future[Frame]]] = []
            for key in keys[start:start + _BATCH]:
                pending.append(client.submit("lookup", key=key, wait=False))
                pending.append(client.submit("reserve", key=key, bytes=GRAPH_BYTES + pages * arena.PAGE))
                pending.append(client.submit("publish", key=key, fds=[graph_fd, data_fd], graph_bytes=GRAPH_BYTES,
                                             arena_bytes=pages * arena.PAGE, meta=tokenizer_meta(key), deps=[]))
            for request_id, fut in pending:
                client.wait(request_id, fut, 60).close()
    finally:
        graph.close()
        data.close()
    return keys


class HitTimer:
    """Another kernel's hits of `key` and their unpins, one after the other on a thread of their own, each
    request timed (`times`): how long a kernel waits on the store while something else holds it."""

    def __init__(self, client: Client, key: str) -> None:
        self.client, self.key = client, key
        self.times: list[float] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hit-timer", daemon=True)

    def __enter__(self) -> HitTimer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                started = time.perf_counter()
                reply = self.client.request("lookup", key=self.key, wait=False, timeout=30)
                self.times.append(time.perf_counter() - started)
                reply.close()
                started = time.perf_counter()
                self.client.request("unpin", key=self.key, timeout=30)
                self.times.append(time.perf_counter() - started)
            except BaseException as exc:  # noqa: BLE001 - reported by the test that reads `errors`
                self.errors.append(exc)
                return
            time.sleep(0.001)
