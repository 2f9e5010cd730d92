"""The cache never takes the disk space the user needs (issue 38; Note [Disk room] in kernel_server/disk.py).

Each test gives the file arenas a small filesystem of their own (a 64 MiB tmpfs mounted for the test; it
needs root, as CI runs), with OVERMIND_ARENA=file so that the arenas are files there, as on a disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kernel_server import Client, arena
from kernel_server.errors import RemoteError
from kernel_server.formats import pending_text
from tests.helpers.faults_helpers import daemon_log, wait_until
from tests.helpers.snippets import last_json, run_py

SIZE, RESERVE = 64 << 20, 24 << 20
MODEL = 4 * (1024 * 1024 + 1024) * 4  # tiny_modules.build("mlp", width=1024, depth=4): 16.8 MB


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem for the arenas needs root (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"this machine lets no test mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def disk_env(overmind_home: Path, small_disk: Path) -> dict[str, str]:
    return dict(os.environ, OVERMIND_ARENA="file", OVERMIND_ARENA_DIR=str(small_disk),
                OVERMIND_DISK_RESERVE=str(RESERVE))


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# A kernel that loads `seeds` (different models, kept: their entries are pinned), and says how each went.
LOADS = """
    import json, os, warnings
    from overmind_jupyter import loading
    from tests.helpers import tiny_modules
    kept, free = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in {seeds}:
            kept.append(loading.cached(tiny_modules.build, "mlp", seed, width=1024, depth=4))
            st = os.statvfs({disk!r})
            free.append(st.f_bavail * st.f_frsize)
    print(json.dumps({{"calls": loading.calls(), "free": free, "warnings": [str(w.message) for w in caught]}}))
"""


def test_a_load_that_would_take_the_reserve_runs_plainly_and_says_why(disk_env: dict[str, str],
                                                                     small_disk: Path, overmind_home: Path) -> None:
    """Two models fit above the reserve; the third, with the first two in use, would leave less free than
    the reserve: it loads plainly, the warning says why, and the disk keeps its reserve."""
    out = last_json(run_py(LOADS.format(seeds=[1, 2, 3], disk=str(small_disk)), env=disk_env))
    assert out["calls"] == {"miss": 2, "plain": 1}, out
    assert all(f >= RESERVE for f in out["free"]), f"the free space fell below the reserve: {out['free']}"
    (warning,) = [w for w in out["warnings"] if "no room on the disk" in w]
    assert str(small_disk) in warning and "OVERMIND_DISK_RESERVE" in warning
    with Client(overmind_home, role="test") as client:
        disk = client.request("status")["disk"]
    assert disk["directory"] == str(small_disk) and disk["reserve"] == RESERVE
    assert 2 * MODEL <= disk["used"] < 3 * MODEL and disk["free"] >= RESERVE


def test_a_reserve_that_leaves_no_room_says_to_lower_it(disk_env: dict[str, str], small_disk: Path) -> None:
    """A reserve as large as the disk caches nothing there, ever: the warning says which setting to lower."""
    env = dict(disk_env, OVERMIND_DISK_RESERVE=str(SIZE - MODEL // 2))
    out = last_json(run_py(LOADS.format(seeds=[1], disk=str(small_disk)), env=env))
    assert out["calls"] == {"plain": 1}, out
    (warning,) = [w for w in out["warnings"] if "no room on the disk" in w]
    assert "nothing of this size is ever cached there: lower OVERMIND_DISK_RESERVE" in warning, warning


def test_a_small_miss_on_a_full_disk_falls_back_and_leaves_the_disk_as_it_was(
        disk_env: dict[str, str], small_disk: Path) -> None:
    """A miss that writes a few MiB into a file arena reserves them first (Note [Reserved at publish]): with
    less room than that, it falls back and says why, and the model it returns, kept, takes nothing of the
    disk. Written first, the refused arena's blocks stayed taken by the tensors moved onto it."""
    (small_disk / "users-file").write_bytes(b"\0" * (SIZE - (1 << 20)))  # 1 MiB left: less than the model
    env = dict(disk_env, OVERMIND_DISK_RESERVE="0")
    out = last_json(run_py(LOADS.format(seeds=[1], disk=str(small_disk)).replace("width=1024", "width=512"),
                           env=env))
    assert out["calls"] == {"plain": 1}, out
    (warning,) = [w for w in out["warnings"] if "no room on the disk" in w]
    assert str(small_disk) in warning, warning
    assert out["free"] == [1 << 20], "the model, kept, takes nothing of the disk"


# A kernel that loads the tiny Llama (its weights same-dtype pieces of its checkpoint, its rotary buffers a
# copy of a few bytes), and says what it asked of the daemon, whether the buffers lie on the entry's arena
# (a mapping of the registry), and the disk's room before and after.
SAME_DTYPE = """
    import json, os, warnings
    import torch
    from transformers import AutoModelForCausalLM
    from kernel_server.client import Client
    from overmind_jupyter import loading, mappings
    asked, submit = [], Client.submit
    def spied(self, op, *args, **kwargs):
        asked.append(getattr(op, "value", op))
        return submit(self, op, *args, **kwargs)
    Client.submit = spied
    def free():
        st = os.statvfs({disk!r})
        return st.f_bavail * st.f_frsize
    before = free()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = loading.cached(AutoModelForCausalLM.from_pretrained, {path!r}, dtype=torch.bfloat16)
    buffer = model.model.rotary_emb.inv_freq
    print(json.dumps({{"calls": loading.calls(), "asked": asked, "before": before, "after": free(),
                      "on_the_arena": mappings.span_of(buffer.data_ptr()) is not None,
                      "warnings": [str(w.message) for w in caught]}}))
"""


def test_a_same_dtype_miss_into_a_file_arena_is_reserved_by_its_publish(
        disk_env: dict[str, str], small_disk: Path, tiny_llama: Path) -> None:
    """A miss that writes a few KiB into its file arena (a same-dtype load's buffers) asks the daemon once, at
    the publish, which reserves its room (Note [Reserved at publish] in kernel_server/store.py); the buffers'
    tensors then lie on the arena, as every copied tensor of a miss does."""
    out = last_json(run_py(SAME_DTYPE.format(path=str(tiny_llama), disk=str(small_disk)), env=disk_env))
    assert out["calls"] == {"miss": 1}, out
    assert "publish" in out["asked"] and "reserve" not in out["asked"], out["asked"]
    assert out["on_the_arena"], "the copied buffers moved onto the entry's arena once the publish was taken"


def test_a_same_dtype_miss_refused_at_its_publish_leaves_the_disk_as_it_was(
        disk_env: dict[str, str], small_disk: Path, tiny_llama: Path) -> None:
    """With less room than the entry's arena, the publish refuses it: the miss falls back and says why, and
    the model it returns, kept, takes nothing of the disk: its buffers' tensors stay where the load put them,
    as they move onto an arena only once its publish is taken (Note [Reserved at publish])."""
    (small_disk / "users-file").write_bytes(b"\0" * (SIZE - (128 << 10)))  # 128 KiB left: the entry needs 180
    env = dict(disk_env, OVERMIND_DISK_RESERVE="0")
    out = last_json(run_py(SAME_DTYPE.format(path=str(tiny_llama), disk=str(small_disk)), env=env))
    assert out["calls"] == {"plain": 1}, out
    assert "reserve" not in out["asked"], out["asked"]
    (warning,) = [w for w in out["warnings"] if "no room on the disk" in w]
    assert str(small_disk) in warning, warning
    assert not out["on_the_arena"] and out["after"] == out["before"], out


def test_a_disk_filled_by_something_else_makes_the_cache_give_back_its_unpinned_entries(
        disk_env: dict[str, str], small_disk: Path, overmind_home: Path) -> None:
    out = last_json(run_py(LOADS.format(seeds=[1, 2], disk=str(small_disk)), env=disk_env))  # then it exits
    assert out["calls"] == {"miss": 2}
    with Client(overmind_home, role="test") as client:
        assert len(client.request("status")["entries"]) == 2
        (small_disk / "users-file").write_bytes(b"\0" * (28 << 20))  # the user's own data: 2 MB free now
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (client.request("status")["entries"] or free(small_disk) < RESERVE):
            time.sleep(0.2)
        assert client.request("status")["entries"] == [], "the daemon evicted both entries to keep the reserve"
    assert free(small_disk) >= RESERVE


def cache_entry(client: Client, key: str, nbytes: int, backing: str, directory: Path | None = None, *,
                pin: bool = False, deps: tuple[str, ...] = ()) -> None:
    """An entry of `nbytes` in a memfd or a file arena in `directory`, made as a kernel's miss makes it; `pin`:
    pinned by `client`, as a kernel pins the model it keeps; `deps`: the entries it builds on."""
    assert client.request("lookup", key=key, wait=False)["status"] == "load"
    client.request("reserve", key=key, bytes=nbytes + 16, backing=backing)
    graph, data = arena.ArenaWriter(16), arena.ArenaWriter(nbytes, backing=backing, directory=directory)
    try:
        os.posix_fallocate(data.fd, 0, nbytes)  # the blocks (or pages) its bytes take
        client.request("publish", key=key, fds=[graph.seal(), data.seal()], graph_bytes=16, arena_bytes=nbytes,
                       meta={"label": key}, pin=pin, deps=list(deps))
    finally:
        graph.close()
        data.close()


def publish_from_checkpoint(client: Client, key: str, folder: Path, disk: Path, nbytes: int, *,
                            before: Callable[[], object] = lambda: None, pin: bool = False) -> None:
    """Make `key` an entry as a same-dtype miss makes it: a file arena on `disk` whose `nbytes` are all pieces
    of a checkpoint file in `folder`, served from it until the compactor copies them. `before` runs between
    the reservation and the publish."""
    source_path = folder / "model.safetensors"
    source_path.write_bytes(b"\1" * nbytes)
    source = os.open(source_path, os.O_RDONLY)
    graph, data = arena.ArenaWriter(16), arena.ArenaWriter(nbytes, backing="file", directory=disk)
    try:
        assert client.request("lookup", key=key, wait=False)["status"] == "load"
        client.request("reserve", key=key, bytes=nbytes + 16, descriptors=3)
        before()
        client.request("publish", key=key, fds=[graph.seal(), data.seal(), source], graph_bytes=16,
                       arena_bytes=nbytes, meta={"label": key}, pin=pin, pieces=[[0, nbytes, 0, 0]],
                       sources=[{"path": str(source_path), **arena.file_identity(os.fstat(source))}])
    finally:
        for fd in (graph.fd, data.fd, source):
            os.close(fd)


def test_entries_in_memory_neither_count_against_the_reserve_nor_go_to_make_room_on_the_disk(
        disk_env: dict[str, str], small_disk: Path, overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """memfd arenas take memory, not disk (Note [Disk room]): with the disk below its reserve, the daemon gives
    back the entry in a file and keeps the one in a memfd; a new memfd is granted its room there, and a new
    file is refused it without an entry in memory evicted for nothing."""
    for name in ("OVERMIND_ARENA", "OVERMIND_ARENA_DIR", "OVERMIND_DISK_RESERVE"):
        monkeypatch.setenv(name, disk_env[name])
    nbytes = 16 << 20
    with Client(overmind_home, role="test") as client:
        def cached() -> list[str]:
            return sorted(e["key"] for e in client.request("status")["entries"])

        cache_entry(client, "in-memory", nbytes, "memfd")
        cache_entry(client, "on-disk", nbytes, "file", small_disk)
        (small_disk / "users-file").write_bytes(b"\0" * (44 << 20))  # 4 MiB free; 20 once the file entry goes
        wait_until(lambda: "on-disk" not in cached(), 20, "the entry in a file was given back")
        assert cached() == ["in-memory"] and free(small_disk) < RESERVE
        assert client.request("lookup", key="new", wait=False)["status"] == "load"
        assert client.request("reserve", key="new", bytes=nbytes, backing="memfd")["evicted"] == []
        with pytest.raises(RemoteError, match="no room on the disk"):
            client.request("reserve", key="new", bytes=nbytes, backing="file")
        assert cached() == ["in-memory"]


def test_a_load_that_cannot_fit_beside_the_entries_in_use_evicts_none_for_it(
        disk_env: dict[str, str], small_disk: Path, overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries a kernel holds take most of the disk: a load that would not fit there even with every unpinned
    entry gone loads plainly and says why, and the unpinned entries stay cached (Note [Disk room]). Before,
    all of them were evicted, and the load ran plainly anyway."""
    for name in ("OVERMIND_ARENA", "OVERMIND_ARENA_DIR", "OVERMIND_DISK_RESERVE"):
        monkeypatch.setenv(name, disk_env[name])
    with Client(overmind_home, role="test") as kernel:  # holds the model it pins, as a kernel does
        cache_entry(kernel, "unused-1", 4 << 20, "file", small_disk)
        cache_entry(kernel, "unused-2", 4 << 20, "file", small_disk)
        cache_entry(kernel, "in-use", 28 << 20, "file", small_disk, pin=True)
        # 4 MiB above the reserve, 12 with both unused entries gone: less than the model's 16
        out = last_json(run_py(LOADS.format(seeds=[1], disk=str(small_disk)), env=disk_env))
        assert out["calls"] == {"plain": 1}, out
        (warning,) = [w for w in out["warnings"] if "no room on the disk" in w]
        assert str(small_disk) in warning, warning
        listed = sorted(e["key"] for e in kernel.request("ls")["entries"])
        assert listed == ["in-use", "unused-1", "unused-2"], "an entry was evicted for a load that ran plainly"
        assert "evicted" not in kernel.request("status")["stats"]


def test_a_publish_that_cannot_fit_beside_the_entries_in_use_evicts_none_for_it(
        disk_env: dict[str, str], small_disk: Path, overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish reserves what its load did not (Note [Reserved at publish] in kernel_server/store.py): where
    the file arena it brings would not fit even with every unpinned entry gone, it is refused and evicts none.
    The entry that holds the disk here is not pinned itself but built on by one that is: eviction passes it
    over, so it counts as held (Note [Budget accounting] in kernel_server/store.py)."""
    for name in ("OVERMIND_ARENA", "OVERMIND_ARENA_DIR", "OVERMIND_DISK_RESERVE"):
        monkeypatch.setenv(name, disk_env[name])
    with Client(overmind_home, role="test") as client:
        cache_entry(client, "unused", 8 << 20, "file", small_disk)
        cache_entry(client, "weights", 28 << 20, "file", small_disk)
        cache_entry(client, "in-use", 1 << 20, "memfd", deps=("weights",), pin=True)
        assert client.request("lookup", key="late", wait=False)["status"] == "load"
        client.request("reserve", key="late", bytes=1 << 20, backing="memfd")  # none of the disk
        graph, data = arena.ArenaWriter(16), arena.ArenaWriter(16 << 20, backing="file", directory=small_disk)
        try:
            with pytest.raises(RemoteError, match="no room on the disk"):  # 4 MiB above the reserve, 12 evicting
                client.request("publish", key="late", fds=[graph.seal(), data.seal()], graph_bytes=16,
                               arena_bytes=16 << 20, meta={"label": "late"})
        finally:
            graph.close()
            data.close()
        assert sorted(e["key"] for e in client.request("ls")["entries"]) == ["in-use", "unused", "weights"]


def test_status_says_where_the_bytes_live(disk_env: dict[str, str], small_disk: Path, overmind_home: Path) -> None:
    """The text status, the CLI, the widget's and the side panel's states name the disk and its use."""
    run_py(LOADS.format(seeds=[1], disk=str(small_disk)), env=disk_env)
    text = run_py("from overmind_jupyter import api; print(api.format_status(api.status()))", env=disk_env).stdout
    assert f"of arenas in {small_disk}" in text and "kept free for you" in text, text
    widget = last_json(run_py("import json; from overmind_jupyter import api; from overmind_jupyter.widgets.cache "
                              "import state_of; print(json.dumps(state_of(api.status()['daemon'])['texts']))",
                              env=disk_env))
    assert f"of arenas in {small_disk}" in widget["disk"]
    from overmind_jupyter.view import state_view

    with Client(overmind_home, role="test") as client:
        panel = state_view(client.request("status").payload)
    assert panel["disk"]["directory"] == str(small_disk) and f"of arenas in {small_disk}" in panel["texts"]["disk"]
    cli = subprocess.run([sys.executable, "-m", "kernel_server", "status"], env=disk_env, capture_output=True,
                         text=True, check=True).stdout
    assert f"of arenas in {small_disk}" in cli and "kept free for you" in cli, cli


def test_a_copy_that_would_take_the_reserve_waits_for_room(
        disk_env: dict[str, str], small_disk: Path, overmind_home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry served from its checkpoint is copied into an arena of the daemon's only where that arena leaves
    the reserve free (Note [Disk room]): with the disk filled since its load reserved, the copy waits, the entry
    stays servable from its file and the log says why once; it is copied once the user's file is gone."""
    for name in ("OVERMIND_ARENA", "OVERMIND_ARENA_DIR", "OVERMIND_DISK_RESERVE"):
        monkeypatch.setenv(name, disk_env[name])
    user_file = small_disk / "users-file"  # 34 MiB free once written: 10 above the reserve
    with Client(overmind_home, role="test") as client:
        publish_from_checkpoint(client, "waiting", tmp_path, small_disk, 16 << 20, pin=True,
                                before=lambda: user_file.write_bytes(b"\0" * (30 << 20)))
        wait_until(lambda: "no room on the disk to compact" in daemon_log(overmind_home), 10, "the copy was skipped")
        pending = client.request("status")["entries"][0]["pending"]
        assert pending is not None and free(small_disk) >= RESERVE
        assert pending_text(pending) == ("served from its checkpoint; copied once the disk has room "
                                         "(OVERMIND_DISK_RESERVE)"), pending
        user_file.unlink()
        wait_until(lambda: client.request("status")["entries"][0]["pending"] is None, 20, "the copy ran")
        assert free(small_disk) >= RESERVE and daemon_log(overmind_home).count("no room on the disk to compact") == 1


def test_an_entry_served_from_its_checkpoint_frees_only_what_its_arena_holds_when_evicted(
        disk_env: dict[str, str], small_disk: Path, overmind_home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry not yet compacted holds its pieces in its checkpoint: its file arena takes next to nothing on
    the disk, so evicting it makes no room there, and a load that needs room is refused, not let into the
    reserve (Note [Disk room])."""
    for name in ("OVERMIND_ARENA", "OVERMIND_ARENA_DIR", "OVERMIND_DISK_RESERVE"):
        monkeypatch.setenv(name, disk_env[name])
    user_file = small_disk / "users-file"  # 34 MiB free once written: its copy would not fit
    with Client(overmind_home, role="test") as client:
        publish_from_checkpoint(client, "pending", tmp_path, small_disk, 16 << 20,
                                before=lambda: user_file.write_bytes(b"\0" * (30 << 20)))
        wait_until(lambda: "no room on the disk to compact" in daemon_log(overmind_home), 10, "the copy waits")
        assert client.request("lookup", key="new", wait=False)["status"] == "load"
        with pytest.raises(RemoteError, match="no room on the disk"):  # 10 MiB above the reserve, evicting or not
            client.request("reserve", key="new", bytes=12 << 20, backing="file")
    assert free(small_disk) >= RESERVE


@pytest.mark.parametrize("by", ["the user", "the load"])
def test_evicting_an_entry_stops_its_copy_and_gives_its_room_back(
        disk_env: dict[str, str], small_disk: Path, overmind_home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, by: str) -> None:
    """An entry evicted while the compactor copies it gives back at once the room its copy had yet to write,
    and the copy stops (Note [A dropped entry's copy stops] in kernel_server/compaction.py): a load that
    needs that room is let in with no entry left, not refused until the copy ends; evicted by the load itself
    too, which counts that room as what eviction can give back (Note [Disk room]). Every core is kept busy
    so that the copy waits for an idle one (up to 2 s before each chunk) while the test evicts its entry."""
    for name in ("OVERMIND_ARENA", "OVERMIND_ARENA_DIR", "OVERMIND_DISK_RESERVE"):
        monkeypatch.setenv(name, disk_env[name])
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        with Client(overmind_home, role="test") as client:
            # two chunks of the copy; the disk has 40 MiB above its reserve
            publish_from_checkpoint(client, "copied", tmp_path, small_disk, 36 << 20)
            def copying() -> dict[str, Any] | None:
                pending = client.request("status")["entries"][0]["pending"]
                return pending if pending["copying"] else None

            pending = wait_until(copying, 10, "the copy started")
            assert pending["done"] == 0, pending  # waiting for an idle core
            if by == "the user":
                client.request("evict", all=True)
            assert client.request("lookup", key="new", wait=False)["status"] == "load"
            # the copy's 36 MiB are free again
            evicted = client.request("reserve", key="new", bytes=30 << 20, backing="file")["evicted"]
            assert evicted == ([] if by == "the user" else ["copied"])
            for p in busy:
                p.kill()
            wait_until(lambda: "stopped compacting" in daemon_log(overmind_home), 5, "the copy stopped")
            assert client.request("status")["stats"].get("compacted") is None
        assert free(small_disk) >= SIZE - (1 << 20)
    finally:
        for p in busy:
            p.kill()
            p.wait()
