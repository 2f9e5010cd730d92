"""Stand-ins for the hub checkpoints that PEFT's own tests load, laid out as a local Hugging Face cache.

PEFT's model tests load tiny checkpoints by hub id (`peft-internal-testing/tiny-random-OPTForCausalLM`,
...), which this machine cannot download. This builds, for each id the selection uses, a checkpoint of the
same architecture with a tiny random configuration (seeded, so every build is byte-identical), and writes it
where `huggingface_hub` looks with `HF_HUB_OFFLINE=1`: `HF_HUB_CACHE/models--ORG--NAME/` with
`refs/main`, `snapshots/COMMIT/FILE` as links into `blobs/`. The hub-id path of the cache (keyed by the
commit an id resolves to) is so exercised as it is with real downloads, and the tests' repeated loads of
the same id are what makes hits.

What cannot match the real checkpoints: their weights and their tokenizers (none is written). A test that
depends on them fails without the cache as with it, and is therefore not compared (run.py compares only
tests that pass without the cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# hub id -> (transformers config class, model class, config): small, and with the module names of the
# architecture, which PEFT's default target modules are looked up by.
_TEXT = {"vocab_size": 1024, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
STANDINS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "peft-internal-testing/tiny-random-OPTForCausalLM": ("OPTConfig", "OPTForCausalLM", {
        **_TEXT, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 4,
        "word_embed_proj_dim": 16, "max_position_embeddings": 100}),
    "peft-internal-testing/tiny-random-GPT2LMHeadModel": ("GPT2Config", "GPT2LMHeadModel", {
        **_TEXT, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 512}),
    "hf-internal-testing/tiny-random-gpt2": ("GPT2Config", "GPT2LMHeadModel", {
        **_TEXT, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 512}),
    "trl-internal-testing/tiny-random-LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM", {
        **_TEXT, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 32, "max_position_embeddings": 128}),
    # PEFT 0.22's tests load their Llama from here
    "peft-internal-testing/tiny-random-LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM", {
        **_TEXT, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 32, "max_position_embeddings": 128}),
    "peft-internal-testing/tiny-dummy-qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {
        **_TEXT, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 32, "max_position_embeddings": 128}),
    "hf-internal-testing/tiny-random-MistralForCausalLM": ("MistralConfig", "MistralForCausalLM", {
        **_TEXT, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 32, "max_position_embeddings": 128}),
    "peft-internal-testing/tiny-random-GPTJForCausalLM": ("GPTJConfig", "GPTJForCausalLM", {
        **_TEXT, "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4, "n_positions": 512}),
    "hf-internal-testing/tiny-random-Gemma3ForCausalLM": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_TEXT, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 32, "max_position_embeddings": 128, "sliding_window": 16}),
    "peft-internal-testing/tiny-random-T5ForConditionalGeneration-calibrated": (
        "T5Config", "T5ForConditionalGeneration", {
            **_TEXT, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 2, "num_heads": 4,
            "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}),
    "peft-internal-testing/tiny-random-BartForConditionalGeneration": (
        "BartConfig", "BartForConditionalGeneration", {
            **_TEXT, "d_model": 16, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
            "decoder_attention_heads": 4, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
            "max_position_embeddings": 128, "decoder_start_token_id": 2}),
    "peft-internal-testing/tiny-random-BertModel": ("BertConfig", "BertModel", {
        **_TEXT, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 32,
        "max_position_embeddings": 128}),
    "peft-internal-testing/tiny-random-RobertaModel": ("RobertaConfig", "RobertaModel", {
        **_TEXT, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 32,
        "max_position_embeddings": 130}),
}

# pipelines (diffusers), for PEFT's tests/test_stablediffusion.py: built by _tiny_sd_pipe
PIPELINES = ("hf-internal-testing/tiny-sd-pipe",)

VERSION = "2"  # of the recipes here: a change rebuilds the stand-ins


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's (and CLIP's) byte-level alphabet: 256 printable characters, one for each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _tiny_sd_pipe(target: Path) -> None:
    """A Stable Diffusion pipeline of the sizes diffusers' own pipeline tests use (`get_dummy_components`),
    with a byte-level CLIP tokenizer of no merges (no vocabulary can be downloaded), saved to `target`."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=2)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    vae = AutoencoderKL(block_out_channels=[4, 8], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        latent_channels=4, norm_num_groups=2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05,
        num_attention_heads=4, num_hidden_layers=2, pad_token_id=1, vocab_size=1000))
    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate([*chars, *(c + "</w>" for c in chars), "<|startoftext|>", "<|endoftext|>"])}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n")
        tokenizer = CLIPTokenizer(vocab_file=str(Path(tmp) / "vocab.json"), merges_file=str(Path(tmp) / "merges.txt"),
                                  model_max_length=77)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(target)


def _commit(files: dict[str, str]) -> str:
    """A commit hash for a snapshot: deterministic in its files' contents (40 hex digits, as the hub's)."""
    return hashlib.sha1(json.dumps(sorted(files.items())).encode()).hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_repo(hub_cache: Path, repo_id: str, files: Path) -> str:
    """Lay the files under `files` out as huggingface_hub's cache does: blobs by hash, a snapshot of links."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    if repo.exists():
        shutil.rmtree(repo)
    blobs = repo / "blobs"
    blobs.mkdir(parents=True)
    digests = {}
    for path in sorted(p for p in files.rglob("*") if p.is_file()):
        digest = _sha256(path)
        digests[path.relative_to(files).as_posix()] = digest
        shutil.copyfile(path, blobs / digest)
    commit = _commit(digests)
    snapshot = repo / "snapshots" / commit
    for name, digest in digests.items():
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blobs / digest, link.parent), link)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


def build(hub_cache: Path) -> dict[str, str]:
    """Write every stand-in into `hub_cache` (unless it is there from this recipe); returns id -> commit."""
    marker = hub_cache / "STANDINS.json"
    wanted = {*STANDINS, *PIPELINES}
    if marker.exists():
        recorded = json.loads(marker.read_text())
        if recorded.get("version") == VERSION and set(recorded.get("commits", {})) == wanted:
            return dict(recorded["commits"])
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    hub_cache.mkdir(parents=True, exist_ok=True)
    commits = {}
    for repo_id, (config_name, model_name, config_kwargs) in STANDINS.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**config_kwargs)
        model = getattr(transformers, model_name)(config)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            commits[repo_id] = _write_repo(hub_cache, repo_id, Path(tmp))
    for repo_id in PIPELINES:
        with tempfile.TemporaryDirectory() as tmp:
            _tiny_sd_pipe(Path(tmp))
            commits[repo_id] = _write_repo(hub_cache, repo_id, Path(tmp))
    marker.write_text(json.dumps({"version": VERSION, "commits": commits}, indent=1) + "\n")
    return commits
