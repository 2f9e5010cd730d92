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
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 256},
    "0.1b": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 32000},
    "1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000},
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "vocab_size": 32000},
    # Llama-2-7B's shape (6.7B parameters, 13.5 GB in bf16) and Llama-3.1-8B's (8.0B, 16.1 GB): the GPU
    # benchmark's large models (benchmarks/gpu.py)
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256},
}


def build_llama(path: str | os.PathLike[str], size: str = "tiny", *, dtype: str = "bfloat16", seed: int = 0,
                device: str = "cpu", **overrides: Any) -> Path:
    """Save a randomly initialised Llama-shaped causal LM at `path` (skipped if already there).

    Args:
        path: the directory to write.
        size: a key of LLAMA_SIZES ("tiny", "0.1b", "1.1b", "3b", "7b" or "8b").
        dtype: the stored dtype.
        seed: the initialisation seed.
        device: where the weights are drawn before they are saved ("cuda" draws a 7B model's in a fraction
            of the seconds the CPU takes; the values differ from a CPU draw of the same seed).
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
    model = model.to(getattr(torch, dtype)).to_empty(device=device)  # allocated in the stored dtype only
    if config.tie_word_embeddings:  # `to_empty` gave the tied weights storages of their own. (Not by
        # `model.tie_weights()`: loads in two threads can leave transformers' no-op in its place for good.)
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(path)  # buffers left empty by to_empty are not persistent, so not saved
    return path


_WORDS = ["the", "a", "an", "model", "adapter", "kernel", "restart", "load", "cache", "weights", "shared", "memory",
          "fast", "slow", "gpu", "cpu", "jupyter", "notebook", "lora", "base", "token", "layer", "attention", "hello",
          "world", "french", "german", "english"]


def build_tokenizer(path: str | os.PathLike[str], *, vocab_size: int = 256) -> Path:
    """Save a word-level fast tokenizer built in code (special tokens, a few words, then fillers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return path
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = specials + list(_WORDS)
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", padding_side="left")
    fast.save_pretrained(path)
    return path


def _clip_tokenizer() -> Any:
    """A CLIP tokenizer over single characters (no merges), built in code."""
    from transformers import CLIPTokenizer

    # The byte-level alphabet of GPT-2 and CLIP: printable bytes stand for themselves, the others are
    # shifted above 255, so every byte has a visible character.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(shifted))]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)


def build_sd_pipeline(path: str | os.PathLike[str], *, width: int = 8, seed: int = 0) -> Path:
    """Save a Stable-Diffusion-shaped pipeline (UNet, VAE, CLIP text encoder, a tokenizer built in code,
    DDIM scheduler). `width` scales the channels: 8 is tiny, 64 is a few hundred MB."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    path = Path(path)
    if (path / "model_index.json").exists():
        return path
    torch.manual_seed(seed)
    groups = 2 if width < 32 else 32
    unet = UNet2DConditionModel(
        block_out_channels=(width, 2 * width), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=4 * width, norm_num_groups=groups, attention_head_dim=2,
    )
    vae = AutoencoderKL(block_out_channels=[width, 2 * width], in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        norm_num_groups=groups)
    tokenizer = _clip_tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        hidden_size=4 * width, intermediate_size=8 * width, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=len(tokenizer), max_position_embeddings=16,
    ))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(path)  # type: ignore[attr-defined]  # diffusers' lazy modules hide it from mypy
    return path


def build_lora_adapters(base: str | os.PathLike[str], path: str | os.PathLike[str],
                        names: tuple[str, ...] = ("fr", "de"),
                        *, rank: int = 4, seed: int = 0) -> dict[str, Path]:
    """Save LoRA adapters with random (non-zero) weights for the causal LM at `base`, one directory per
    adapter name under `path`; returns {name: directory}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(path)
    out = {name: path / name for name in names}
    if all((p / "adapter_config.json").exists() for p in out.values()):
        return out
    for i, name in enumerate(names):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(str(out[name]))
    return out
