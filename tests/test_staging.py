"""Converted weights written once, straight into the entry (Note [Staged conversions] in
overmind_jupyter/staging.py): a miss that converts dtypes writes its weights into the new arena as it
loads, publishing copies none of them, and everything Note [Atomic miss] promises still holds (the
write routes of tests/test_atomic_miss.py run through staged misses: their fp32 loads convert).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from overmind_jupyter import demo_models, loading
from overmind_jupyter.errors import FallbackWarning

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

    other: list[torch.nn.Module] = []

    def load_with_a_thread(path: str) -> Any:
        thread = threading.Thread(
            target=lambda: other.append(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)))
        thread.start()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        thread.join()
        return model

    model = loading.cached(load_with_a_thread, str(bf16_llama))
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
