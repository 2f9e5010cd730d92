"""Fixtures of the adapter gate tests (the models themselves are built in adapter_models.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from .adapter_models import ADAPTERS, activate, build_base, build_peft, lora_config


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread: tiny ops from many Python threads thrash an OpenMP pool on two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def peft_model() -> Any:
    return build_peft()


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Saved adapters: fr, de, es (as in `build_peft`), es2 (other weights, same shape), dora."""
    from peft import get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    dirs: dict[str, Path] = {}
    source = build_peft()
    for name in ADAPTERS:
        path = root / name
        source.save_pretrained(str(root / "_all"), selected_adapters=[name])
        saved = root / "_all" / name if (root / "_all" / name).exists() else root / "_all"
        saved.rename(path)
        dirs[name] = path
    for name, dora, seed in (("es2", False, 77), ("dora", True, 78)):
        torch.manual_seed(seed)
        model = get_peft_model(build_base(), lora_config(use_dora=dora))
        model.save_pretrained(str(root / name))
        dirs[name] = root / name
    return dirs


@pytest.fixture
def hf_model(adapter_dirs: dict[str, Path]) -> Any:
    """A transformers model whose fr, de, es adapters came through its PEFT integration (`load_adapter`)."""
    from transformers.utils import logging

    model = build_base()
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the load report lists the other adapters' keys as missing
    try:
        for name in ADAPTERS:
            model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    finally:
        logging.set_verbosity(verbosity)
    activate(model, ADAPTERS[0])
    return model.eval()
