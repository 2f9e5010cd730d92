"""Converted weights written once, straight into the entry (Note [Staged conversions] in
overmind_jupyter/staging.py): a miss that converts dtypes writes its weights into the new arena as it
loads, publishing copies none of them, and everything Note [Atomic miss] promises still holds (the
write routes of tests/test_atomic_miss.py run through staged misses: their fp32 loads convert).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kernel_server import Client, arena
from kernel_server.errors import RemoteError
from overmind_jupyter import demo_models, loading
from overmind_jupyter.errors import FallbackWarning
from tests.helpers.cached_modules import miss_in_parts, wide_llama
from tests.helpers.faults_helpers import wait_until
from tests.helpers.snippets import last_json, run_py, start_py

KEPT: list[torch.Tensor] = []  # what a loading function below keeps outside its result


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_models.build_llama(tmp_path_factory.mktemp("staging") / "llama", "tiny", dtype="bfloat16")


def entry_meta(label_part: str) -> dict[str, Any]:
    (entry,) = [e for e in loading.shared_client().request("status")["entries"]
                if label_part in e["meta"].get("label", "") and not e["meta"].get("random")]
    return entry["meta"]


def converted_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters() if p.dtype != torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_converting_miss_writes_the_weights_into_the_entry_and_copies_none(
        overmind_home: Path, bf16_llama: Path, dtype: torch.dtype) -> None:
    """A bf16 checkpoint loaded as fp32 or fp16: every converted weight was written by the load into the
    arena (`made.staged`), publishing copied only what is no weight of the checkpoint (the rotary
    buffer), the result equals plain's bit for bit, and a hit afterwards too."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=dtype)
    model = loading.cached(AutoModelForCausalLM.from_pretrained, str(bf16_llama), dtype=dtype)
    assert not loading.fallbacks()
    made = entry_meta("llama")["made"]
    weights = sum(p.nbytes for p in plain.parameters())
    assert made["staged"] >= weights > 0, made
    assert made["copied"] < weights / 50, made
    assert made["pieces"] == 0, made
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    hit = loading.cached(AutoModelForCausalLM.from_pretrained, str(bf16_llama), dtype=dtype)
    assert loading.calls().get("hit", 0) >= 1
    for (name, a), (_, b) in zip(plain.state_dict().items(), hit.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_same_dtype_miss_stages_nothing(overmind_home: Path, bf16_llama: Path) -> None:
    """Loaded in its own dtype the checkpoint's tensors are pieces of its file: nothing is written."""
    from transformers import AutoModelForCausalLM

    loading.cached(AutoModelForCausalLM.from_pretrained, str(bf16_llama), dtype=torch.bfloat16)
    made = entry_meta("llama")["made"]
    assert made["staged"] == 0 and made["pieces"] > 0, made


def test_the_library_is_put_back_after_the_miss(overmind_home: Path, bf16_llama: Path) -> None:
    """The wrapper of transformers' `spawn_materialize` is there only while a miss loads."""
    from transformers import AutoModelForCausalLM, core_model_loading

    original = core_model_loading.spawn_materialize
    seen = []

    def load(path: str) -> Any:
        seen.append(core_model_loading.spawn_materialize)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    loading.cached(load, str(bf16_llama))
    assert seen and seen[0] is not original
    assert core_model_loading.spawn_materialize is original


def test_a_load_that_raises_after_staging_leaves_no_entry(overmind_home: Path, bf16_llama: Path) -> None:
    """Weights staged, then the loading function raises: the exception comes through as it was, no entry
    is left, and the next call loads again."""
    from transformers import AutoModelForCausalLM

    def load_then_fail(path: str) -> Any:
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        raise ValueError("the user's own error")

    with pytest.raises(ValueError, match="the user's own error"):
        loading.cached(load_then_fail, str(bf16_llama))
    assert loading.shared_client().request("status")["entries"] == []


def test_a_write_through_a_staged_tensor_kept_outside_the_result_reaches_no_entry(
        overmind_home: Path, bf16_llama: Path) -> None:
    """A loading function keeps a tensor of its own on a staged weight (`.data`: a tensor the result does
    not hold) and the user writes through it after the call: the entry, and a hit of it, stay the plain
    load's bytes."""
    from transformers import AutoModelForCausalLM

    def load_keeping_an_alias(path: str) -> Any:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        KEPT.append(model.lm_head.weight.data)
        KEPT.append(model.model.layers[0].mlp.up_proj.weight.data)
        return model

    plain = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.float32)
    try:
        loading.cached(load_keeping_an_alias, str(bf16_llama))
        assert not loading.fallbacks()
        assert entry_meta("load_keeping_an_alias")["made"]["staged"] >= converted_bytes(plain)
        for alias in KEPT:
            alias.fill_(7.0)
        KEPT.clear()
        hit = loading.cached(load_keeping_an_alias, str(bf16_llama))
        assert loading.calls().get("hit", 0) >= 1
        for (name, a), (_, b) in zip(plain.state_dict().items(), hit.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    finally:
        KEPT.clear()


def mapped_file(address: int) -> str:
    """The file of this process's mapping that holds `address` ("" for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    raise LookupError(hex(address))


def test_a_load_in_another_thread_meanwhile_is_not_staged(overmind_home: Path, bf16_llama: Path) -> None:
    """The user's own thread loads the same checkpoint while the miss loads: only the miss's thread
    stages, so the other model's weights lie in fresh memory (as plain's), the entry is published whole,
    and both equal the plain load. (One dtype for both: transformers sets torch's default dtype for the
    process while it builds a model, so two dtypes at once race in the library itself.)"""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import PreTrainedModel

    other: list[torch.nn.Module] = []

    def load_with_a_thread(path: str) -> Any:
        thread = threading.Thread(
            target=lambda: other.append(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)))
        thread.start()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        thread.join()
        return model

    tie_weights = PreTrainedModel.tie_weights
    try:
        model = loading.cached(load_with_a_thread, str(bf16_llama))
    finally:  # two loads at once may leave transformers' tying switched off in this process (Note [Tying
        # switched off] in loading.py): this model has no ties, and the loads after get tying back
        PreTrainedModel.tie_weights = tie_weights
    assert not loading.fallbacks()
    assert entry_meta("load_with_a_thread")["made"]["staged"] >= converted_bytes(model)
    assert mapped_file(model.lm_head.weight.data_ptr()).endswith("(deleted)")  # the entry's arena
    assert not [f for f in (mapped_file(p.data_ptr()) for p in other[0].parameters()) if f.startswith("/")]
    plain = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.float32)
    for result in (model, other[0]):
        for (name, a), (_, b) in zip(plain.state_dict().items(), result.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


def test_a_budget_smaller_than_the_model_stages_nothing_and_loads_plainly(
        overmind_home: Path, bf16_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage grows only as the daemon reserves it: a budget the model does not fit stops it, and the
    load ends as a plain one, said as a budget fallback."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OVERMIND_BUDGET", "64K")
    with pytest.warns(FallbackWarning, match="budget"):
        model = loading.cached(AutoModelForCausalLM.from_pretrained, str(bf16_llama), dtype=torch.float32)
    assert [f["kind"] for f in loading.fallbacks()] == ["budget"]
    plain = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.float32)
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


# -- a file per converting thread (Note [Arena parts] in kernel_server/arena.py) -------------------------

PARTS_PROBE = """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    from overmind_jupyter import loading
    m = loading.cached(AutoModelForCausalLM.from_pretrained, PATH, dtype=torch.float32)
    files = {}
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        files[(start, end)] = fields[5].strip() if len(fields) > 5 else ""
    def file_of(address):
        return next(f for (start, end), f in files.items() if start <= address < end)
    with torch.no_grad():
        out = m(torch.arange(8)[None]).logits.double().sum().item()
    print(json.dumps({"out": out, "calls": loading.calls(),
                      "files": sorted({file_of(p.data_ptr()) for p in m.parameters()}),
                      "checkpoint": any("model.safetensors" in f for f in files.values())}))
"""


# A fresh process's loads, through an Auto class (transformers imports its loading module inside the first)
LOADS_IN_ORDER = """
    import torch
    from transformers import AutoModelForCausalLM
    from overmind_jupyter import loading
    for path, dtype in LOADS:
        loading.cached(AutoModelForCausalLM.from_pretrained, path, dtype=getattr(torch, dtype))
    assert loading.calls() == {"miss": len(LOADS)} and not loading.fallbacks(), (loading.calls(), loading.fallbacks())
"""


def test_a_miss_gets_the_backing_of_its_kind_whatever_the_process_loaded_before(
        overmind_home: Path, bf16_llama: Path, tmp_path: Path) -> None:
    """OVERMIND_ARENA=auto, the arenas on a disk (Note [Arena backing] in kernel_server/arena.py): a miss in
    the stored dtype gets a file and one that converts dtypes a memfd, the process's first load as its later
    ones, in either order."""
    other = demo_models.build_llama(tmp_path / "llama", "tiny", dtype="bfloat16", seed=1)
    orders = [[(str(bf16_llama), "bfloat16"), (str(bf16_llama), "float32")],
              [(str(other), "float32"), (str(other), "bfloat16")]]
    env = dict(os.environ, OVERMIND_ARENA="auto")
    procs = [start_py(LOADS_IN_ORDER.replace("LOADS", repr(loads)), env=env) for loads in orders]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    with Client(overmind_home, role="test") as client:
        backings = {e["meta"]["label"]: e["backing"] for e in client.request("ls")["entries"]}
    want = {f"AutoModelForCausalLM.from_pretrained({path!r}, dtype={dtype})": "file" if dtype == "bfloat16" else "memfd"
            for loads in orders for path, dtype in loads}
    assert backings == want


def test_a_tokenizers_miss_imports_no_module_of_model_loading(overmind_home: Path, tmp_path: Path) -> None:
    """Only the miss of an Auto model class imports transformers' loading module ahead (Note [Staged
    conversions]): a tokenizer's plain load never imports it, nor does its miss (0.6 s here)."""
    tokenizer = demo_models.build_tokenizer(tmp_path / "tokenizer")
    out = last_json(run_py(f"""
        import json, sys
        import overmind_jupyter
        overmind_jupyter.enable()
        from transformers import AutoTokenizer
        from overmind_jupyter import loading
        AutoTokenizer.from_pretrained({str(tokenizer)!r})
        print(json.dumps({{"calls": loading.calls(), "imported": "transformers.core_model_loading" in sys.modules}}))
    """, fresh=True))
    assert out == {"calls": {"miss": 1}, "imported": False}, out


def staged_files(model: torch.nn.Module) -> set[str]:
    return {mapped_file(p.data_ptr()) for p in model.parameters()}


def logits_sum(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(model(torch.arange(8)[None]).logits.double().sum().item())


def test_each_converting_thread_writes_a_file_of_its_own_and_every_hit_maps_them_as_one_arena(
        overmind_home: Path, tmp_path: Path) -> None:
    """transformers converts in a pool of threads: each writes into a memfd of its own (one memfd would
    make them wait for its lock), and the entry is the arena's own file and its parts. The loading kernel
    and a kernel started afterwards both see every weight at its place, equal to plain's."""
    from transformers import AutoModelForCausalLM, core_model_loading

    if core_model_loading.GLOBAL_WORKERS < 2:
        pytest.skip("transformers converts in one thread on a machine of one core")
    path = wide_llama(tmp_path / "llama")
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model, made = miss_in_parts(path, torch.float32)
    assert made["staged"] >= converted_bytes(plain), made
    files = staged_files(model)
    assert len(files) >= 2 and all(f.startswith("/memfd:overmind:") for f in files), files
    assert logits_sum(model) == logits_sum(plain)
    hit = last_json(run_py(PARTS_PROBE.replace("PATH", repr(str(path)))))
    assert hit["calls"] == {"hit": 1} and hit["out"] == logits_sum(plain)
    assert set(hit["files"]) == files, "the hit maps the same files: the arena's own and its parts"


def test_an_entry_of_parts_and_pending_pieces_is_compacted_whole(overmind_home: Path, tmp_path: Path) -> None:
    """A checkpoint of bf16 weights and fp32 norms loaded as fp32: the converted weights are staged (in
    parts), the norms are pieces of the checkpoint. The daemon compacts the entry into one arena of its
    own, reading each range where it lies; a hit after that maps that arena alone and equals plain."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = wide_llama(tmp_path / "mixed")
    file = path / "model.safetensors"
    tensors = {k: v.float() if "norm" in k else v for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=torch.float32)
    assert not loading.fallbacks()
    made = entry_meta("mixed")["made"]
    assert made["staged"] > 0 and made["pieces"] > 0, made
    client = Client(overmind_home, role="test")
    try:
        wait_until(lambda: client.request("status")["entries"][0]["pending"] is None, 60, "the entry compacted")
        assert client.request("status")["stats"].get("compacted") == 1
    finally:
        client.close()
    hit = last_json(run_py(PARTS_PROBE.replace("PATH", repr(str(path)))))
    assert hit["calls"] == {"hit": 1} and hit["out"] == logits_sum(plain)
    assert len(hit["files"]) == 1 and not hit["checkpoint"], hit["files"]


def test_the_daemon_refuses_parts_that_are_not_sealed_whole_pages_or_apart(daemon: Client) -> None:
    """A publish's parts are checked as its arena is: sealed, whole pages, inside the arena, apart from
    each other and from the pieces; a good one is served with the parts' descriptors after the arena's."""
    page = arena.PAGE

    def attempt(parts: list[tuple[int, int, bool]], fds_for: int | None = None) -> str:
        key = f"k{os.urandom(4).hex()}"
        assert daemon.request("lookup", key=key, wait=False)["status"] == "load"
        daemon.request("reserve", key=key, bytes=8 * page, descriptors=2 + len(parts))
        graph, data = arena.ArenaWriter(16), arena.ArenaWriter(4 * page)
        graph.view[:] = bytes(16)
        writers = [arena.ArenaWriter(size) for _, size, _ in parts]
        for w, (_, size, seal) in zip(writers, parts, strict=True):
            w.write(0, bytes([7]) * size)
            if seal:
                w.seal()
        fds = [graph.seal(), data.seal(), *(w.fd for w in writers)][:fds_for]
        try:
            daemon.request("publish", key=key, fds=fds, graph_bytes=16, arena_bytes=4 * page,
                           parts=[[offset, size] for offset, size, _ in parts])
        finally:
            for w in (graph, data, *writers):
                w.close()
        return key

    with pytest.raises(RemoteError, match="not sealed"):
        attempt([(page, page, False)])
    with pytest.raises(RemoteError, match="overlaps another"):
        attempt([(page, 2 * page, True), (2 * page, page, True)])
    with pytest.raises(RemoteError, match="whole pages"):
        attempt([(100, page, True)])
    with pytest.raises(RemoteError, match="outside"):
        attempt([(3 * page, 2 * page, True)])
    with pytest.raises(RemoteError, match="one per part"):
        attempt([(page, page, True)], fds_for=2)
    key = attempt([(page, page, True), (3 * page, page, True)])
    other = Client(daemon.home, role="test")
    try:
        reply = other.request("lookup", key=key)
        [entry] = reply["entries"]
        assert entry["parts"] == [[page, page], [3 * page, page]]
        assert len(reply.fds) == 1 + 1 + 2
        m = arena.map_private(reply.fds[1], 4 * page, parts=[arena.Part(fd, offset, size) for fd, (offset, size)
                                                             in zip(reply.fds[2:], entry["parts"], strict=True)])
        assert m[:page] == bytes(page) and m[page:2 * page] == bytes([7]) * page
        assert m[2 * page:3 * page] == bytes(page) and m[3 * page:] == bytes([7]) * page
        m.close()
        reply.close()
    finally:
        other.close()
    assert daemon.request("ping")["pong"]


def test_a_converting_miss_evicts_no_entry_that_fits_beside_it(
        overmind_home: Path, bf16_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage reserves a granule ahead only where that evicts nothing (Note [Reserving ahead] in
    kernel_server/store.py): with a budget a little over the granule, an unused entry that fits beside a
    converting miss stays cached."""
    import gc

    from transformers import AutoModelForCausalLM

    from overmind_jupyter.staging import _GRANULE

    checkpoint = sum(f.stat().st_size for f in bf16_llama.glob("*.safetensors"))
    monkeypatch.setenv("OVERMIND_BUDGET", str(_GRANULE + checkpoint // 2))  # both fit; the granule beside it not
    client = loading.shared_client()
    loading.cached(AutoModelForCausalLM.from_pretrained, str(bf16_llama), dtype=torch.bfloat16)
    gc.collect()
    wait_until(lambda: all(not e["pinned_by"] for e in client.request("status")["entries"]), what="the unpin")
    misses = loading.calls().get("miss", 0)
    model = loading.cached(AutoModelForCausalLM.from_pretrained, str(bf16_llama), dtype=torch.float32)
    assert loading.calls()["miss"] == misses + 1 and not loading.fallbacks(), (loading.calls(), loading.fallbacks())
    status = client.request("status")
    assert status["stats"].get("evicted", 0) == 0 and len(status["entries"]) == 2, status["stats"]
    assert max(e["meta"]["made"]["staged"] for e in status["entries"]) >= converted_bytes(model) > 0  # staged
