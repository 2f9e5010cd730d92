"""The conformance run's selection: which of the libraries' own tests run, in which groups.

Each group is one pytest process (with the cache on: its own private daemon), rooted at the unpacked test
tree of its library (`.conformance-cache/NAME-VERSION`), running `paths` filtered by `keyword` (pytest's
`-k`). run.py runs the groups two at a time. Chosen by trying, on these machines (2 cores, no network):

- what the sdists hold: peft's has its whole suite. transformers' has only the common mixins, not the
  per-model files that bind them to models: `transformers_models.py` (here) binds `ModelTesterMixin` to
  five tiny models, as those files do. diffusers' has no tests at all (`tests/testing_utils.py` only), and
  no other source on the registries has them: diffusers' pipelines are exercised by PEFT's
  `test_stablediffusion.py` (a tiny Stable Diffusion pipeline loaded by hub id), and by this project's own
  suite.
- offline: PEFT's model tests load tiny checkpoints by hub id; `hub_standins.py` lays stand-ins for the ids
  below out as a local HF cache. Tests needing anything else from the hub (tokenizers, datasets, real
  weights) fail without the cache as with it, so they are left out where a filter can say so, and are
  harmless where it cannot (only tests that pass without the cache are compared).
- bounded: the save/load, from_pretrained and adapter tests; of PEFT's 40 tuner configs x 7 decoders, the
  decoders OPT, Llama and GPT-2; of the custom models, the vanilla MLPs with LoRA, IA3, LoHa and LoKr.
  The whole run with the cache takes about 4-5 minutes on 2 cores.
- left out: GPU, multi-GPU, quantization, torch.compile and training-loop files; PEFT's hub feature tests;
  tokenizer, processor and pipeline mixins of transformers (they need hub files).
"""

from __future__ import annotations

from dataclasses import dataclass

LIBRARIES = ("peft", "transformers", "diffusers")

# What the libraries' tests import that this project does not install; into .conformance-cache/site, with
# --no-deps (everything they need besides is in .venv). peft's tests/testing_utils.py imports `datasets`
# at the top; transformers' test_modeling_common.py imports `parameterized`.
TEST_REQUIREMENTS = (
    "datasets==5.2.0",
    "multiprocess==0.70.19",
    "pandas==3.1.1",
    "parameterized==0.9.0",
    "pyarrow==26.0.1",
    "xxhash==4.1.0",
)


@dataclass(frozen=True)
class Group:
    name: str
    library: str
    paths: tuple[str, ...]  # relative to the library's unpacked tree (`tests/...`)
    keyword: str | None = None  # pytest -k
    why: str = ""


_SAVE_LOAD = ("test_save_pretrained or test_from_pretrained_config_construction or test_inference_safetensors "
              "or test_unload_adapter or test_load")

GROUPS: tuple[Group, ...] = (
    Group(
        "peft-decoders", "peft", ("tests/test_decoder_models.py",),
        f"({_SAVE_LOAD}) and (OPTForCausalLM or LlamaForCausalLM or GPT2LMHeadModel)",
        "PEFT's save/load of every tuner on decoders loaded by hub id: PeftModel.from_pretrained on a cached "
        "base, load_adapter, get_peft_model on a hit",
    ),
    Group(
        "peft-encoders", "peft",
        ("tests/test_encoder_decoder_models.py", "tests/test_feature_extraction_models.py"),
        f"({_SAVE_LOAD}) and (T5ForConditionalGeneration or BartForConditionalGeneration or BertModel "
        "or RobertaModel) and (LoraConfig or IA3Config or PrefixTuningConfig or PromptTuningConfig "
        "or LoHaConfig or AdaLoraConfig)",
        "the same for encoder-decoders and encoders",
    ),
    Group(
        "peft-custom", "peft",
        ("tests/test_custom_models.py", "tests/test_mixed.py", "tests/test_vera.py", "tests/test_vblora.py",
         "tests/test_shira.py", "tests/test_loraplus.py", "tests/test_bufferdict.py", "tests/test_mapping.py"),
        "not test_custom_models or ((test_save_pretrained or test_load_multiple_adapters "
        "or test_from_pretrained_config_construction or test_load_model_low_cpu_mem_usage) "
        "and Vanilla and (LoraConfig or IA3Config or LoHaConfig or LoKrConfig))",
        "models built in code (not cached results: every PEFT load falls back), PeftMixedModel, and small "
        "tuner files that need no hub",
    ),
    Group(
        "peft-diffusers", "peft", ("tests/test_stablediffusion.py",), None,
        "diffusers' StableDiffusionPipeline.from_pretrained by hub id (a stand-in tiny-sd-pipe), PEFT adapters "
        "on its text encoder and UNet, and the pipeline run: the only diffusers tests the sdists hold",
    ),
    Group(
        "transformers-models", "transformers", ("overmind/transformers_models.py",), None,
        "ModelTesterMixin (save_pretrained/from_pretrained, safetensors, tied weights, dtypes, offload, "
        "mismatched shapes, device context managers...) on Llama, tied Llama, Qwen2, GPT-2 and BERT",
    ),
)
