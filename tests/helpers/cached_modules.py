"""Modules of the cache for the units and copier tests: a hit of a tiny module, whose CPU storages are
private mappings of the daemon's arena."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as transformers_logging

from overmind_jupyter import demo_models, loading, rebuild
from tests.helpers import tiny_modules

# a Llama whose weights are MiBs each, so that every thread of transformers' pool has tensors to convert
WIDE_LLAMA = {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 8}


def arena_backed(kind: str) -> torch.nn.Module:
    """A module rebuilt from the cache: its CPU storages are private mappings of the daemon's arena."""
    loading.cached(tiny_modules.build, kind)
    model = loading.cached(tiny_modules.build, kind)
    assert all(rebuild.entry_of(p.data_ptr()) is not None for p in model.parameters())
    return model


def in_arena(t: torch.Tensor) -> bool:
    return rebuild.entry_of(t.untyped_storage().data_ptr()) is not None


def wide_llama(path: Path) -> Path:
    return demo_models.build_llama(path, "tiny", dtype="bfloat16", **WIDE_LLAMA)


def slowly_built(steps: int, delay: float) -> torch.nn.Module:
    """`tiny_modules.build("mlp")` after a transformers progress bar of `steps` steps `delay` s apart (the
    library's own bar, which a miss names and reports: Note [Load progress] in overmind_jupyter/progress.py):
    a load whose progress lasts as long as a test wants, on any machine."""
    for _ in transformers_logging.tqdm(range(steps), desc="Loading weights"):
        time.sleep(delay)
    return tiny_modules.build("mlp")


def miss_in_parts(path: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The converting miss of `path` loaded as `dtype` whose arena lies in more than one file (Note [Arena
    parts] in kernel_server/arena.py), and its entry's `made`. Which pool thread converts which tensor is
    the pool's choice, and on a loaded machine one thread may convert them all: so the miss is made again
    (the entry evicted) until two threads took part, three times at most."""
    from transformers import AutoModelForCausalLM

    client = loading.shared_client()
    for _ in range(3):
        model = loading.cached(AutoModelForCausalLM.from_pretrained, str(path), dtype=dtype)
        assert not loading.fallbacks()
        [entry] = [e for e in client.request("status")["entries"] if not e["meta"].get("random")]
        if entry["meta"]["made"]["files"] >= 2:
            return model, entry["meta"]["made"]
        del model
        gc.collect()
        client.request("evict", all=True)
    raise AssertionError(f"three misses of {path} converted in one thread each: {entry['meta']['made']}")
