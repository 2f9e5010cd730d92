"""Models and references of the adapter tests: tiny Llamas from a config, LoRA adapters with random weights.

PEFT initialises LoRA's B to zero, which would make every adapter the identity: the adapters here use
`init_lora_weights=False`, so that each one changes the outputs. Everything is fp32 and seeded.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import torch

ADAPTERS = ("fr", "de", "es")
CHOICES = ("fr", "de", "es", "__base__")


def tiny_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    values: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": None,
    }
    values.update(overrides)
    return LlamaConfig(**values)


def lora_config(**overrides: Any) -> Any:
    from peft import LoraConfig

    values: dict[str, Any] = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": "all-linear",
        "init_lora_weights": False,
    }
    values.update(overrides)
    return LoraConfig(**values)


def build_base(seed: int = 0, **config: Any) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**config))
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    return model.eval()


def _name_seed(name: str, seed: int) -> int:
    """Each adapter's weights depend on its name only (and the seed), not on its place among the others."""
    return 1000 + zlib.crc32(name.encode()) % 100_000 + seed


def build_peft(
    names: tuple[str, ...] = ADAPTERS, *, dora: tuple[str, ...] = (), seed: int = 0, **config: Any
) -> Any:
    """A PeftModel over a tiny Llama with one LoRA adapter per name (seeded by name), in eval mode."""
    from peft import get_peft_model

    model = None
    for name in names:
        cfg = lora_config(use_dora=name in dora)
        if model is None:
            base = build_base(seed, **config)
            torch.manual_seed(_name_seed(name, seed))
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            torch.manual_seed(_name_seed(name, seed))
            model.add_adapter(name, cfg)
    assert model is not None
    model.set_adapter(names[0])
    return model.eval()


def activate(model: Any, name: str) -> None:
    """PEFT's global switch (a transformers model's own `set_adapter` wants a newer PEFT than installed)."""
    from peft import PeftModel
    from peft.functional import set_adapter

    if isinstance(model, PeftModel):
        model.set_adapter(name)
    else:
        set_adapter(model, name)


def serial_logits(model: Any, choice: str, **inputs: Any) -> torch.Tensor:
    """The reference: PEFT's own global switch, one request at a time, no gate involved."""
    with torch.no_grad():
        if choice == "__base__":
            with disabled(model):
                return model(**inputs).logits
        activate(model, choice)
        return model(**inputs).logits


def serial_generate(model: Any, choice: str, **inputs: Any) -> torch.Tensor:
    with torch.no_grad():
        if choice == "__base__":
            with disabled(model):
                return model.generate(**inputs)
        activate(model, choice)
        return model.generate(**inputs)


@contextlib.contextmanager
def disabled(model: Any) -> Iterator[None]:
    """Every tuner layer computes the base model inside."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def hooks_on(model: Any) -> int:
    """How many forward pre-hooks sit on the model's modules."""
    return sum(len(m._forward_pre_hooks) for m in model.modules())
