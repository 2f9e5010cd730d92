"""Modules of the cache for the units and copier tests: a hit of a tiny module, whose CPU storages are
private mappings of the daemon's arena."""

from __future__ import annotations

import torch

from overmind_jupyter import loading, rebuild
from tests.helpers import tiny_modules


def arena_backed(kind: str) -> torch.nn.Module:
    """A module rebuilt from the cache: its CPU storages are private mappings of the daemon's arena."""
    loading.cached(tiny_modules.build, kind)
    model = loading.cached(tiny_modules.build, kind)
    assert all(rebuild.entry_of(p.data_ptr()) is not None for p in model.parameters())
    return model


def in_arena(t: torch.Tensor) -> bool:
    return rebuild.entry_of(t.untyped_storage().data_ptr()) is not None
