"""A store of thousands of small entries (issue 38): tokenizers, processors and schedulers of a few KB add up.

Making room among them stays quick and never holds the store long enough for another kernel's hit to give
up on the daemon (Note [Eviction in O(log n)] in kernel_server/catalogue.py); status is summarised and `ls`
paged, so that both answer with 10,000 entries and any entry can still be listed and evicted by its key
(Note [Status with many entries] in kernel_server/catalogue.py).

The daemon holds two descriptors per entry, so the count is what its descriptor limit lets it hold, up
to 10,000 (about 7,400 where the hard limit is 20,000; benchmarks/many_entries.py says which count it ran).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernel_server import Client
from kernel_server.cli import main as cli_main
from kernel_server.client import reset_shared_client
from kernel_server.protocol import MAX_PAYLOAD
from tests.conftest import stop_daemon
from tests.helpers.many_entries import ENTRY_BYTES, HitTimer, fits_descriptors, publish_many

WANTED = 10_000


# -- making room ------------------------------------------------------------------------------------------

def test_making_room_among_thousands_of_small_entries_keeps_other_kernels_hits_quick(
        overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that needs the room of every small entry evicts them all in well under a second, while
    another kernel's hits go on, each waiting on the store for milliseconds, not the 3 s after which a
    kernel gives up on the daemon."""
    budget = (WANTED + 2) * ENTRY_BYTES
    monkeypatch.setenv("OVERMIND_BUDGET", str(budget))
    with Client(overmind_home, role="test") as loader, Client(overmind_home, role="kernel", label="other") as other:
        count = fits_descriptors(loader, WANTED)
        publish_many(loader, 1, "hot")
        small = publish_many(loader, count, "small")
        with HitTimer(other, "hot-000000") as timer:
            time.sleep(0.3)  # hits before the eviction
            started = time.perf_counter()
            assert loader.request("lookup", key="big", wait=False)["status"] == "load"
            evicted = loader.request("reserve", key="big", bytes=budget - 2 * ENTRY_BYTES, timeout=120)["evicted"]
            took = time.perf_counter() - started
            time.sleep(0.3)  # and after
        assert not timer.errors, f"the other kernel's hits failed: {timer.errors}"
        assert len(evicted) == count - 1 and "hot-000000" not in evicted and set(evicted) <= set(small)
        assert took < 2.0, f"making room among {count} entries took {took:.2f} s"
        assert max(timer.times) < 0.5, (f"a hit waited {max(timer.times):.2f} s on the store while it made room "
                                        f"among {count} entries")
        status = other.request("status")
        assert status["used"] == 2 * ENTRY_BYTES and status["reserved"] == budget - 2 * ENTRY_BYTES


# -- status and ls ------------------------------------------------------------------------------------------

@dataclass
class Crowd:
    home: Path
    client: Client
    large: list[str]  # the three largest entries, largest first
    small: list[str]  # the small ones, in the order published
    recent: list[str]  # two old small ones used again lately, the most recent first

    @property
    def total(self) -> int:
        return len(self.large) + len(self.small)


@pytest.fixture(scope="module")
def crowd() -> Iterator[Crowd]:
    """A daemon holding as many entries as its descriptor limit allows, up to 10,000: three larger ones
    published first, then small ones; two of the oldest small ones used again since."""
    home = Path(tempfile.mkdtemp(prefix="om-", dir="/tmp"))
    os.chmod(home, 0o700)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OVERMIND_HOME", str(home))
        reset_shared_client()
        client = Client(home, role="test")
        try:
            count = fits_descriptors(client, WANTED)
            large = [publish_many(client, 1, f"large{pages}", pages=pages)[0] for pages in (8, 6, 4)]
            small = publish_many(client, count - len(large), "small")
            recent = [small[1], small[0]]
            for key in reversed(recent):
                client.request("lookup", key=key, wait=False).close()
                client.request("unpin", key=key)
            yield Crowd(home, client, large, small, recent)
        finally:
            client.close()
            reset_shared_client()
            stop_daemon(home)
            shutil.rmtree(home, ignore_errors=True)


def test_status_with_10000_entries_shows_the_largest_and_most_recent_and_counts_the_rest(crowd: Crowd) -> None:
    status = crowd.client.request("status")
    assert len(json.dumps(status.payload)) < MAX_PAYLOAD // 4, "a summary, not every entry"
    shown = [e["key"] for e in status["entries"]]
    assert status["entries_total"] == crowd.total
    assert status["entries_more"] == crowd.total - len(shown) > 0
    assert len(set(shown)) == len(shown)
    assert shown[:3] == crowd.large, "the largest first"
    assert set(crowd.recent) <= set(shown[3:]), "then the most recently used"
    assert shown.index(crowd.recent[0]) < shown.index(crowd.recent[1])
    assert status["used"] == len(crowd.small) * ENTRY_BYTES + sum(16 + pages * 4096 for pages in (8, 6, 4))


def test_the_views_say_how_many_more_entries_there_are(crowd: Crowd, capsys: pytest.CaptureFixture[str]) -> None:
    from overmind_jupyter import api
    from overmind_jupyter.view import state_view
    from overmind_jupyter.widgets.cache import state_of

    snapshot = api.status()
    daemon = snapshot["daemon"]
    assert daemon is not None, snapshot.get("daemon_error")
    more = daemon["entries_more"]
    assert more > 0 and daemon["entries_total"] == crowd.total
    text = api.format_status(snapshot)
    assert f"in {crowd.total} entries" in text and f"and {more} more" in text
    view = state_of(daemon)  # the widget's, the side panel's shape
    assert len(view["entries"]) == len(daemon["entries"])
    assert (view["entries_total"], view["entries_more"]) == (crowd.total, more) and view["more_bytes"] > 0
    panel = state_view(daemon)
    assert (panel["entries_total"], panel["entries_more"]) == (crowd.total, more)
    assert [e["key"] for e in panel["entries"][:3]] == crowd.large
    assert cli_main(["status"]) == 0
    out = capsys.readouterr().out
    assert f"({crowd.total} entries;" in out and f"... and {more} more" in out and "overmind-daemon ls" in out


def test_ls_pages_through_every_entry(crowd: Crowd, capsys: pytest.CaptureFixture[str]) -> None:
    first = crowd.client.request("ls", limit=100)
    assert len(first["entries"]) == 100 and first["total"] == crowd.total and first["next"]
    assert cli_main(["ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    keys = [e["key"] for e in listed["entries"]]
    assert len(keys) == len(set(keys)) == crowd.total and set(keys) == {*crowd.large, *crowd.small}
    assert listed["total"] == crowd.total


def test_any_entry_can_be_evicted_by_its_key(crowd: Crowd, capsys: pytest.CaptureFixture[str]) -> None:
    """One that status does not show: the key comes from `ls`, and the eviction takes milliseconds."""
    shown = {e["key"] for e in crowd.client.request("status")["entries"]}
    key = next(k for k in crowd.small[len(crowd.small) // 2:] if k not in shown)
    started = time.perf_counter()
    assert cli_main(["evict", key]) == 0
    assert time.perf_counter() - started < 1.0
    assert "evicted 1 entry" in capsys.readouterr().out
    assert crowd.client.request("ls", limit=1)["total"] == crowd.total - 1
    crowd.small.remove(key)
    assert cli_main(["evict", "small-00"]) == 1, "a prefix that matches many entries is refused"
    assert "matches" in capsys.readouterr().err
