"""Tiny checkpoints, built in code, in the layouts notebooks load: a text model with its tokenizer, a
sharded safetensors checkpoint, a pickle (`.bin`) one, one whose model code ships with it
(`trust_remote_code`), an image classifier with its processor, an audio feature extractor, a VAE saved
as a single file, a Stable Diffusion pipeline with a LoRA for its UNet, and a sentence-transformers model
over a tiny BERT. Each is seeded, so a rebuild writes the same bytes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from overmind_jupyter import demo_models

__all__ = ["REMOTE_CODE", "build_all", "build_remote"]

# The model code of the `trust_remote_code` checkpoint; `{scale}` lets a test change it.
REMOTE_CODE = textwrap.dedent("""
    import torch
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel


    class TinyRemoteConfig(PretrainedConfig):
        model_type = "tiny-remote"

        def __init__(self, vocab=32, width=16, **kwargs):
            self.vocab, self.width = vocab, width
            super().__init__(**kwargs)


    class TinyRemoteModel(PreTrainedModel):
        config_class = TinyRemoteConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab, config.width)
            self.proj = nn.Linear(config.width, config.vocab)
            self.post_init()

        def forward(self, ids):
            return self.proj(self.embed(ids)) * {scale}
""")


def _vocab_words() -> list[str]:
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "model", "kernel", "cache", "fast",
            "restart", "load", "notebook", "weights", *[f"w{i}" for i in range(50)]]


def build_remote(path: Path, scale: float = 1.0) -> Path:
    """A checkpoint whose config and model classes are in its own `modeling_tinyremote.py`."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "modeling_tinyremote.py").write_text(REMOTE_CODE.format(scale=scale))
    auto = {"AutoConfig": "modeling_tinyremote.TinyRemoteConfig", "AutoModel": "modeling_tinyremote.TinyRemoteModel"}
    (path / "config.json").write_text(json.dumps({"model_type": "tiny-remote", "vocab": 32, "width": 16,
                                                  "auto_map": auto, "architectures": ["TinyRemoteModel"]}))
    g = torch.Generator().manual_seed(3)
    save_file({"embed.weight": torch.randn(32, 16, generator=g), "proj.weight": torch.randn(32, 16, generator=g),
               "proj.bias": torch.randn(32, generator=g)}, str(path / "model.safetensors"))
    return path


def build_all(root: Path) -> dict[str, str]:
    """Every checkpoint under `root`; returns their paths by name."""
    import torch
    from diffusers import AutoencoderKL, StableDiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import (
        BertConfig,
        BertModel,
        BertTokenizerFast,
        LlamaForCausalLM,
        ViTConfig,
        ViTForImageClassification,
        ViTImageProcessor,
        Wav2Vec2FeatureExtractor,
    )

    paths: dict[str, Path] = {}
    text = demo_models.build_llama(root / "text", "tiny")
    demo_models.build_tokenizer(text)
    paths["text"] = text

    model = LlamaForCausalLM.from_pretrained(text)
    model.save_pretrained(root / "sharded", max_shard_size="64KB")
    paths["sharded"] = root / "sharded"
    (root / "bin").mkdir()
    model.config.save_pretrained(root / "bin")
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    paths["bin"] = root / "bin"

    paths["remote"] = build_remote(root / "remote")

    torch.manual_seed(0)
    vit = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=37, num_labels=3))
    vit.save_pretrained(root / "vit")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root / "vit")
    paths["vit"] = root / "vit"
    Wav2Vec2FeatureExtractor(sampling_rate=16000).save_pretrained(root / "audio")
    paths["audio"] = root / "audio"

    sd = demo_models.build_sd_pipeline(root / "sd")
    paths["sd"] = sd
    vae = AutoencoderKL.from_pretrained(sd, subfolder="vae")
    save_file(vae.state_dict(), str(root / "vae.safetensors"))
    paths["vae_file"] = root / "vae.safetensors"
    pipe = StableDiffusionPipeline.from_pretrained(sd)
    torch.manual_seed(1)
    pipe.unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v"],
                                     init_lora_weights=False))
    StableDiffusionPipeline.save_lora_weights(root / "lora", unet_lora_layers=get_peft_model_state_dict(pipe.unet))
    paths["lora"] = root / "lora"

    bert = root / "bert"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(_vocab_words()), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=37, max_position_embeddings=64)).save_pretrained(bert)
    (root / "vocab.txt").write_text("\n".join(_vocab_words()) + "\n")
    BertTokenizerFast(vocab_file=str(root / "vocab.txt")).save_pretrained(bert)
    paths["bert"] = bert
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        pass
    else:
        try:
            from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
        except ImportError:  # before sentence-transformers 6
            from sentence_transformers.models import Pooling, Transformer
        st = SentenceTransformer(modules=[Transformer(str(bert)), Pooling(32)], device="cpu")
        st.save(str(root / "st"))
        paths["st"] = root / "st"
    return {name: str(p) for name, p in paths.items()}
