"""Small local checkpoints for demos, benchmarks and tests, built from a config (no hub access).

The real loading code runs on them: they are saved with `save_pretrained` exactly as a hub download
would be laid out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["LLAMA_SIZES", "build_llama"]

# name -> LlamaConfig keyword arguments
LLAMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    "0.1b": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
}


def build_llama(path: str | os.PathLike[str], size: str = "tiny", *, dtype: str = "bfloat16", seed: int = 0,
                **overrides: Any) -> Path:
    """Save a randomly initialised Llama-shaped causal LM at `path` (skipped if already there).

    Args:
        path: the directory to write.
        size: a key of LLAMA_SIZES ("tiny", "0.1b" or "1.1b").
        dtype: the stored dtype.
        seed: the initialisation seed.
        **overrides: more LlamaConfig fields.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = LlamaConfig(**(LLAMA_SIZES[size] | overrides))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(path)  # buffers left empty by to_empty are not persistent, so not saved
    return path
