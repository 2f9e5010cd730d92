"""The device copier (overmind_jupyter/units/copier.py) and a kernel's fills through it (units/filling.py).

On the CPU the copier's stand-in (OVERMIND_DEVICE_COPIER=cpu) fills simulated devices (OVERMIND_FAKE_GPUS):
the kernel's "device memory" is a memfd it maps and the copier writes, the device copy a buffer of the
copier's, counted by the real ledger. Everything but the CUDA calls is the real path: a real copier
process, the real daemon and ledger, models from the cache. The tests marked gpu run the same on a
CUDA device.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kernel_server import Client, arena
from kernel_server.ledger import Ledger
from kernel_server.operations import Op
from overmind_jupyter import loading, mappings, units
from overmind_jupyter.units import copier, filling
from tests.helpers.cached_modules import arena_backed, in_arena, miss_in_parts, wide_llama
from tests.helpers.faults_helpers import wait_until


def holders(client: Client) -> list[dict[str, Any]]:
    return [h for d in client.request(Op.UNITS_STATE).payload["devices"] for h in d["holders"]]


def copier_pid() -> int | None:
    state = filling.state()
    return None if state is None else int(state["pid"])


@pytest.fixture
def standin(copier_up: Callable[..., Client], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Client]:
    """Simulated devices filled by the copier's stand-in; `standin("1x16")` starts the daemon and the
    copier (conftest's `copier_up`) and returns a test client."""

    def start(spec: str = "1x16", *, copier_up_too: bool = True) -> Client:
        monkeypatch.setenv("OVERMIND_FAKE_GPUS", spec)
        monkeypatch.setenv("OVERMIND_GPU_RESERVE", "1")
        monkeypatch.setenv("OVERMIND_DEVICE_COPIER", "cpu")
        return copier_up(copier=copier_up_too)

    return start


def test_a_hit_moved_to_a_device_is_filled_by_the_copier_then_from_its_device_copy_and_writes_stay_private(
        standin: Callable[..., Client]) -> None:
    """The first move of an entry fills from the arena and leaves a device copy, counted by the ledger as a
    spare holding; the next move of the same entry fills from that copy. A kernel's writes, through
    `.data`, numpy or in place, reach only its own memory: the next kernel's model has the cached bytes."""
    client = standin()
    first = arena_backed("mlp")
    expected = {k: v.clone() for k, v in first.state_dict().items()}
    units.place(first, "cuda:0")
    placed = units.state()["kernel"]["events"][-1]
    assert placed["fill"]["sources"] == {"host": 1}, placed
    assert not any(in_arena(p) for p in first.parameters()), "the model lies in its own memory now"
    assert all(torch.equal(v, expected[k]) for k, v in first.state_dict().items())
    spare = [h for h in holders(client) if h["spare"]]
    assert [(h["label"], h["units"]) for h in spare] == [("device copy of Mlp", 1)]

    first.layers[0].weight.data += 1  # as PEFT's merge_adapter writes
    first.layers[0].bias.detach().numpy()[:] = 7.0
    with torch.no_grad():
        first.layers[1].weight.mul_(3.0)

    second = arena_backed("mlp")
    units.place(second, "cuda:0")
    placed = units.state()["kernel"]["events"][-1]
    assert placed["fill"]["sources"] == {"device copy": 1}, placed
    assert all(torch.equal(v, expected[k]) for k, v in second.state_dict().items()), "a write leaked"
    assert first.layers[0].bias.eq(7.0).all() and not torch.equal(first.layers[0].weight, second.layers[0].weight)
    state = filling.state()
    assert state is not None and state["fills"] == {"host": 1, "device copy": 1} and len(state["copies"]) == 1


def test_a_weight_the_kernel_wrote_on_the_host_moves_with_its_writes(standin: Callable[..., Client]) -> None:
    """The copier fills from the arena: a storage this kernel wrote before the move (through `.data`, or
    numpy, which no version counter sees) is not filled but copied, writes and all."""
    standin()
    model = arena_backed("mlp")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model.layers[0].weight.data += 1
    model.layers[1].bias.detach().numpy()[0] = 5.0
    units.place(model, "cuda:0")
    assert units.state()["kernel"]["events"][-1]["fill"]["sources"] == {"host": 1}
    assert torch.equal(model.layers[0].weight, expected["layers.0.weight"] + 1)
    assert model.layers[1].bias[0] == 5.0 and torch.equal(model.layers[1].bias[1:], expected["layers.1.bias"][1:])
    assert torch.equal(model.layers[0].bias, expected["layers.0.bias"])


def test_an_arena_in_parts_is_filled_whole_from_the_host_then_from_its_device_copy(
        standin: Callable[..., Client], tmp_path: Path) -> None:
    """A converting miss leaves an entry whose arena lies in several files (Note [Arena parts] in
    kernel_server/arena.py): the copier maps the parts over the arena as a kernel does, so a hit moved to
    a device gets every weight, the first time from the host and the next from the device copy."""
    from transformers import AutoModelForCausalLM, core_model_loading

    if core_model_loading.GLOBAL_WORKERS < 2:
        pytest.skip("transformers converts in one thread on a machine of one core")
    standin()
    path = wide_llama(tmp_path / "llama")
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    miss_in_parts(path, torch.float32)
    for source in ("host", "device copy"):
        hit = loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=torch.float32)
        units.place(hit, "cuda:0")
        placed = units.state()["kernel"]["events"][-1]
        assert placed.get("fill", {}).get("sources") == {source: 1}, (placed, filling.reasons())
        assert not any(in_arena(p) for p in hit.parameters())
        for (name, a), (_, b) in zip(plain.state_dict().items(), hit.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


def test_an_arena_in_as_many_files_as_a_miss_makes_is_filled_on_the_standin(standin: Callable[..., Client]) -> None:
    """A converting miss's arena comes in up to four files (staging's `_FILES`: its own and three parts;
    the daemon takes up to `MAX_PARTS` parts): with the stand-in's target memfd a fill carries five
    descriptors. The copier took four, the kernel closed the fifth, and the fill was refused for want of
    its target. Each part's bytes land at its offset of the arena."""
    standin()
    page = mmap.PAGESIZE
    fds = [os.memfd_create(f"four-files-{i}", os.MFD_CLOEXEC) for i in range(4)]
    for i, fd in enumerate(fds):
        os.ftruncate(fd, 4 * page if i == 0 else page)
        os.pwrite(fd, bytes([i + 1]) * page, 0)  # the arena's first page; each part's one page
    parts = tuple(arena.Part(fd, i * page, page) for i, fd in enumerate(fds) if i)
    group = filling._Group("f" * 64, mappings.ArenaFile(fds[0], False, parts), low=0, high=4 * page)
    try:
        conn = filling.connect()
        assert conn is not None
        block, reply = filling._fill_group(conn, group, torch.device("cpu"), "sim:0", "four files")
        assert reply["source"] == "host"
        assert bytes(block.numpy()) == b"".join(bytes([i + 1]) * page for i in range(4))
    finally:
        group.arena.close()


def test_a_filled_model_keeps_its_ties_trains_and_goes_back_onto_the_cached_weights(
        standin: Callable[..., Client]) -> None:
    standin()
    model = arena_backed("tied")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    units.place(model, "cuda:0")
    assert units.state()["kernel"]["events"][-1]["fill"]["sources"] == {"host": 1}
    assert model.head.weight is model.embed.weight and not in_arena(model.embed.weight)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    loss = model(torch.tensor([[1, 2, 3]])).square().mean()
    loss.backward()
    opt.step()
    assert not torch.equal(model.embed.weight, expected["embed.weight"]), "the step wrote the filled weights"
    assert units.release(model)
    assert not in_arena(model.embed.weight), "a trained weight is copied back, never the cached one"
    untouched = arena_backed("tied")
    units.place(untouched, "cuda:0")
    assert units.release(untouched)
    assert in_arena(untouched.embed.weight), "unchanged: back onto the cached weights"
    assert torch.equal(untouched.embed.weight, expected["embed.weight"])


def test_the_ledger_asks_for_a_device_copy_before_any_kernels_idle_model(standin: Callable[..., Client],
                                                                        overmind_home: Path) -> None:
    """Note [Spare holdings]: the device copy is asked to release first, though used more recently than
    this kernel's first model (the second model's fill read it); both models stay placed."""
    client = standin("1x5")  # 4 units: two models, the copy, one free
    first, second = arena_backed("mlp"), arena_backed("mlp")
    units.place(first, "cuda:0")
    units.place(second, "cuda:0")  # filled from the copy, which the copier touches
    order = [(h["label"], h["spare"]) for h in holders(client)]  # least recently used first
    assert order[0] == ("Mlp", False) and ("device copy of Mlp", True) in order[1:], order
    other = Client(overmind_home, role="test")
    try:
        grant = other.request(Op.UNITS_ACQUIRE, units=2, timeout_s=30, label="peer", busy=True, timeout=60)
        assert grant["units"] == 2
        assert wait_until(lambda: not filling.state()["copies"], 10, "the copy dropped")
        labels = sorted(h["label"] for h in holders(client))
        assert labels == ["Mlp", "Mlp", "peer"], labels
        assert len(units.state()["kernel"]["placements"]) == 2, "the kernel's models are still placed"
    finally:
        other.close()


def test_the_ledger_asks_spare_holdings_first_whatever_their_recency() -> None:
    asked: list[int] = []
    ledger = Ledger()
    ledger.register([{"id": "g0", "name": "cuda:0", "total_bytes": 5 << 30, "model": "m", "simulated": False}])
    grants: list[dict[str, Any]] = []

    def acquire(conn: int, units_: int, **kw: Any) -> None:
        ledger.acquire(conn, 100 + conn, conn, units=units_, devices=None, timeout=None, label=f"c{conn}",
                       busy=False, answer=grants.append, push=lambda op, p: asked.append(p["holding"]) or True, **kw)

    acquire(1, 2)  # a kernel's model, least recently used
    acquire(2, 2, spare=True)  # a device copy, more recent
    acquire(3, 2)  # needs room: one holding must go
    spare_holding = grants[1]["holding"]
    assert asked == [spare_holding], asked


def test_without_the_copier_a_move_is_torchs_own_and_the_first_move_starts_it_and_keeps_a_copy(
        standin: Callable[..., Client], overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = standin(copier_up_too=False)
    monkeypatch.setenv("OVERMIND_DEVICE_COPIER", "off")
    model = arena_backed("mlp")
    units.place(model, "cuda:0")
    assert units.state()["kernel"]["events"][-1]["fill"] is None and in_arena(model.layers[0].weight), \
        "off: a simulated device moves nothing"
    assert not (overmind_home / "copier.sock").exists()
    units.release(model)

    monkeypatch.setenv("OVERMIND_DEVICE_COPIER", "cpu")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="device copier is starting"):
        units.place(model, "cuda:0")  # the copier is started, this move is torch's copy
    assert units.state()["kernel"]["events"][-1]["fill"] is None
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert any("starting" in reason for reason in filling.reasons())
    assert wait_until(lambda: (filling.state() or {}).get("copies"), 120, "the copy the first move asked for")
    assert [h["label"] for h in holders(client) if h["spare"]] == ["device copy of Mlp"]
    second = arena_backed("mlp")
    units.place(second, "cuda:0")
    assert units.state()["kernel"]["events"][-1]["fill"]["sources"] == {"device copy": 1}


def test_a_copier_that_died_leaves_moves_to_torch_and_says_why(standin: Callable[..., Client]) -> None:
    standin()
    pid = copier_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
               10, "the copier gone")
    model = arena_backed("mlp")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="pageable memory"):
        units.place(model, "cuda:0")
    assert units.state()["kernel"]["events"][-1]["fill"] is None
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert filling.reasons(), "the reason is kept"


def test_a_reply_that_is_not_the_requests_is_refused_not_taken_for_it(standin: Callable[..., Client],
                                                                       overmind_home: Path) -> None:
    """Note [One reply per request]: a request whose reply this kernel stopped waiting for (a `keep` that
    timed out) leaves that reply to be read by the next request. Before, a fill read a late "kept" reply as
    its own and made views of a block the copier had not written; now a reply of another kind is refused."""
    standin()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(str(copier.socket_path(overmind_home)))
    try:
        conn.send(json.dumps({"kind": "drop"}).encode())  # its reply never read, as a request that timed out
        with pytest.raises(ConnectionError, match="answered 'dropped' to a 'state' request"):
            filling._request(conn, {"kind": "state"})
    finally:
        conn.close()


def test_a_copy_no_kernel_used_for_the_idle_time_is_dropped_and_its_units_given_back(
        standin: Callable[..., Client], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERMIND_DEVICE_COPY_IDLE", "1")  # before the copier starts: it reads it then
    client = standin()
    units.place(arena_backed("mlp"), "cuda:0")
    assert [h["spare"] for h in holders(client)].count(True) == 1
    assert wait_until(lambda: not filling.state()["copies"], 30, "the idle copy dropped")
    assert not any(h["spare"] for h in holders(client)), "its units given back"
    # and the arena's mapping, which kept an evicted entry's memory outside the budget (Note [Host mappings])
    assert wait_until(lambda: filling.state()["host_mappings"] == 0, 30, "the idle host mapping dropped")


def test_one_copier_per_user_it_answers_bad_requests_and_exits_with_the_daemon(
        standin: Callable[..., Client], overmind_home: Path) -> None:
    client = standin()
    pid = copier_pid()
    second = subprocess.run([sys.executable, "-m", "overmind_jupyter.units.copier"], capture_output=True, check=False,
                            timeout=120, env=os.environ.copy())
    assert second.returncode == 0 and copier_pid() == pid, "a second copier leaves the first serving"

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(str(copier.socket_path(overmind_home)))
    for bad in (b"not json", b"[1]", json.dumps({"kind": "nothing"}).encode(),
                json.dumps({"kind": "fill", "entry": "x", "device": "sim:0"}).encode()):
        conn.send(bad)
        reply = json.loads(conn.recv(copier.MAX_MESSAGE))
        assert reply["kind"] == "error" and reply["error"], reply
    r, w = os.pipe()
    try:  # an arena descriptor that is no arena: a range outside it
        socket.send_fds(conn, [json.dumps({"kind": "fill", "entry": "x", "device": "sim:0", "start": 0,
                                           "nbytes": 10}).encode()], [r])
        assert json.loads(conn.recv(copier.MAX_MESSAGE))["kind"] == "error"
    finally:
        os.close(r)
        os.close(w)
    conn.send(json.dumps({"kind": "state"}).encode())
    assert json.loads(conn.recv(copier.MAX_MESSAGE))["pid"] == pid, "it goes on"
    conn.close()

    client.request(Op.SHUTDOWN)
    assert wait_until(lambda: not Path(f"/proc/{pid}").exists()
                      or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", 30, "the copier exits")


def test_a_copier_started_before_the_daemon_keeps_copies_once_it_is_up_and_exits_with_it(
        overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [A copier before the daemon]: a copier that found no ledger when it started joins it once the
    daemon is up, so the first move keeps a device copy and the next fills from it; and it exits when that
    daemon goes. Before, it served without the ledger for good: no copy, and it outlived the daemon."""
    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "1x16")
    monkeypatch.setenv("OVERMIND_GPU_RESERVE", "1")
    monkeypatch.setenv("OVERMIND_DEVICE_COPIER", "cpu")
    client = None
    assert filling.connect(wait=120) is not None, (overmind_home / "copier.log").read_text()
    pid = copier_pid()
    try:
        client = Client(overmind_home, role="test")  # the daemon starts after the copier
        models = [arena_backed("mlp"), arena_backed("mlp")]
        for model, source in zip(models, ("host", "device copy"), strict=True):
            units.place(model, "cuda:0")
            assert units.state()["kernel"]["events"][-1]["fill"]["sources"] == {source: 1}
        assert [h["label"] for h in holders(client) if h["spare"]] == ["device copy of Mlp"]
        client.request(Op.SHUTDOWN)
        assert wait_until(lambda: not Path(f"/proc/{pid}").exists()
                          or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", 30, "the copier exits")
    finally:
        filling.disconnect()
        if client is not None:
            client.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.gpu
def test_on_a_gpu_a_hit_is_filled_on_the_device_then_from_the_device_copy(gpu_copier: Client) -> None:
    first = arena_backed("tied")
    expected = {k: v.clone() for k, v in first.state_dict().items()}
    units.place(first, "cuda:0")
    assert units.state()["kernel"]["events"][-1]["fill"]["sources"] == {"host": 1}
    assert all(p.is_cuda for p in first.parameters()) and first.head.weight is first.embed.weight
    assert all(torch.equal(v.cpu(), expected[k]) for k, v in first.state_dict().items())
    first.embed.weight.data += 1
    second = arena_backed("tied")
    units.place(second, "cuda:0")
    assert units.state()["kernel"]["events"][-1]["fill"]["sources"] == {"device copy": 1}
    assert all(torch.equal(v.cpu(), expected[k]) for k, v in second.state_dict().items())
    assert np.allclose(first.embed.weight.cpu().numpy(), expected["embed.weight"].numpy() + 1)
