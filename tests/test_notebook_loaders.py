"""The ways notebooks load models (issue 24), in a real kernel and the kernel after a real restart: each
loader's result on a hit equals the plain load's (its outputs compared in float32, bit for bit), a
checkpoint changed in one shard or in its model code is a miss, and the loads the cache leaves plain
say so in README ("What is cached"). One kernel session runs every loader, so that the suite pays for
few kernel starts."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.helpers.kernels import USER_THREAD, execute, kernel, kernel_env
from tests.helpers.notebook_checkpoints import REMOTE_CODE, build_all, build_remote
from tests.helpers.snippets import last_json, run_py

# Each loader as a notebook cell runs it, with an output of its result: a digest of float32 outputs.
LOADERS = """
import hashlib, json, os, torch
import PIL.Image, numpy as np
from diffusers import AutoencoderKL, StableDiffusionPipeline
from transformers import AutoModel, AutoModelForCausalLM, pipeline
from overmind_jupyter import loading

paths = json.loads(os.environ["PATHS"])
ids = torch.tensor([[1, 5, 9, 3]])

def digest(t):
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]

def loaders(names):
    out = {}
    with torch.no_grad():
        if "pipeline-text" in names:
            text = pipeline("text-generation", model=paths["text"])
            out["pipeline-text"] = [digest(text.model.float()(ids).logits),
                                    text("the model", max_new_tokens=4, do_sample=False)[0]["generated_text"]]
        if "pipeline-image" in names:
            image = PIL.Image.fromarray((np.arange(32 * 32 * 3) % 251).astype("uint8").reshape(32, 32, 3))
            vision = pipeline("image-classification", model=paths["vit"])
            out["pipeline-image"] = [digest(vision.model(**vision.image_processor(image, return_tensors="pt")).logits),
                                     vision(image)[0]["label"]]
        for name in ("sharded", "bin"):
            if name in names:
                out[name] = digest(AutoModelForCausalLM.from_pretrained(paths[name], dtype=torch.float32)(ids).logits)
        if "remote" in names:
            out["remote"] = digest(AutoModel.from_pretrained(paths["remote"], trust_remote_code=True)(ids))
        if "from_single_file" in names:
            vae = AutoencoderKL.from_single_file(paths["vae_file"], config=paths["sd"], subfolder="vae")
            x = torch.linspace(-1, 1, 3 * 16 * 16).reshape(1, 3, 16, 16)
            out["from_single_file"] = digest(vae.encode(x).latent_dist.mean)
        if "load_lora_weights" in names:
            sd = StableDiffusionPipeline.from_pretrained(paths["sd"])
            sd.load_lora_weights(paths["lora"])
            latents = torch.linspace(-1, 1, 4 * 16 * 16).reshape(1, 4, 16, 16)
            cond = torch.linspace(-1, 1, 16 * 32).reshape(1, 16, 32)
            out["load_lora_weights"] = digest(sd.unet(latents, 10, encoder_hidden_states=cond).sample)
        if "SentenceTransformer" in names:
            from sentence_transformers import SentenceTransformer
            st = SentenceTransformer(paths["st"], device="cpu")
            out["SentenceTransformer"] = digest(st.encode(["the model loads fast"], convert_to_tensor=True))
    return out

def report(names):
    loading.clear_fallbacks()
    before = loading.calls()
    out = loaders(names)
    calls = {k: v - before.get(k, 0) for k, v in loading.calls().items() if v != before.get(k, 0)}
    print(json.dumps({"out": out, "calls": calls, "fallbacks": [f["reason"] for f in loading.fallbacks()]}))
"""
# sentence-transformers is an optional extra (the test extra installs it)
SENTENCE_TRANSFORMERS = importlib.util.find_spec("sentence_transformers") is not None
ALL = ["pipeline-text", "pipeline-image", "sharded", "bin", "remote", "from_single_file", "load_lora_weights",
       *(["SentenceTransformer"] if SENTENCE_TRANSFORMERS else [])]
# The cached loads of ALL, as the calls they make: the text pipeline's model and tokenizer, the image
# pipeline's model (its image processor loads plainly), the sharded and pickle checkpoints, the remote
# code model, the single-file VAE, the Stable Diffusion pipeline (its LoRA loads plainly), and the
# sentence-transformers model's transformer and tokenizer.
CACHED_CALLS = 8 + 2 * SENTENCE_TRANSFORMERS


def run(kc: object, names: list[str]) -> dict:
    return json.loads(execute(kc, f"report({names!r})").strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_all(tmp_path_factory.mktemp("notebook"))


def test_every_way_to_load_hits_after_a_restart_as_the_plain_load(overmind_home: Path, checkpoints: dict,
                                                                 tmp_path: Path) -> None:
    # MKL_CBWR: the outputs are compared bit for bit, and a hit's tensors lie page-aligned in the arena where the
    # plain load's lie wherever torch's allocator put them. MKL may take another path for an operand at another
    # address: on this machine kind's AMD EPYC the tiny UNet's time-embedding GEMV then rounds differently in the
    # last place (weights equal bit for bit). MKL's strict mode makes its results independent of alignment, so
    # the comparison checks the weights and the model, not where MKL found them (README, Limits). Only here: in
    # strict mode a batch of rows no longer rounds as the rows one by one, which the adapter tests compare.
    env = kernel_env(PATHS=json.dumps(checkpoints), HF_MODULES_CACHE=str(tmp_path / "modules"),
                     MKL_CBWR="AUTO,STRICT")
    with kernel(env) as (km, kc):
        execute(kc, USER_THREAD + LOADERS)
        plain = run(kc, ALL)
        execute(kc, "%load_ext overmind_jupyter\n%overmind on")
        miss = run(kc, ALL)
        assert miss["calls"] == {"miss": CACHED_CALLS} and not miss["fallbacks"], miss
        assert miss["out"] == plain["out"]

        km.restart_kernel(now=False)  # graceful, as the restart button
        kc.wait_for_ready(timeout=120)
        execute(kc, "%load_ext overmind_jupyter\n%overmind on\n" + LOADERS)
        hit = run(kc, ALL)
        assert hit["calls"] == {"hit": CACHED_CALLS} and not hit["fallbacks"], hit
        assert hit["out"] == plain["out"]

        # One shard rewritten (another value in one tensor), and the model code changed: both are misses,
        # each equal to the plain load of what is on disk now; in the same kernel, and after a restart.
        shard = Path(checkpoints["sharded"]) / "model-00002-of-00005.safetensors"
        execute(kc, f"""
from safetensors.torch import load_file, save_file
tensors = load_file({str(shard)!r})
first = sorted(tensors)[0]
tensors[first] = tensors[first] + 1
save_file(tensors, {str(shard)!r}, metadata={{"format": "pt"}})
""")
        (Path(checkpoints["remote"]) / "modeling_tinyremote.py").write_text(REMOTE_CODE.format(scale=2.0))
        changed = run(kc, ["sharded", "remote"])
        assert changed["calls"] == {"miss": 2} and not changed["fallbacks"], changed
        assert all(changed["out"][k] != plain["out"][k] for k in changed["out"])
        km.restart_kernel(now=False)
        kc.wait_for_ready(timeout=120)
        execute(kc, "%load_ext overmind_jupyter\n%overmind on\n" + LOADERS)
        again = run(kc, ["sharded", "remote"])
        assert again["calls"] == {"hit": 2} and again["out"] == changed["out"], again
        execute(kc, "%overmind off")
        assert run(kc, ["sharded", "remote"])["out"] == changed["out"]


def test_model_code_in_another_folder_is_keyed_and_found_after_a_restart(overmind_home: Path, tmp_path: Path) -> None:
    """Note [Code in another folder]: a config whose auto_map names code in another folder
    ("code--modeling_tinyremote.TinyRemoteModel", found from the working directory). An edit of that code is
    a miss in the same kernel (was a hit with the old class), and after a restart, with the modules cache
    cleared, the hit finds the code where the plain load does (was a fallback that evicted the entry, every
    other restart)."""
    ckpt = build_remote(tmp_path / "ckpt")
    (tmp_path / "code").mkdir()
    (ckpt / "modeling_tinyremote.py").rename(tmp_path / "code" / "modeling_tinyremote.py")
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {k: f"code--{v}" for k, v in config["auto_map"].items()}
    (ckpt / "config.json").write_text(json.dumps(config))
    load = """
        import json, torch
        import overmind_jupyter
        from overmind_jupyter import loading
        from transformers import AutoModel
        overmind_jupyter.enable()

        def load():
            model = AutoModel.from_pretrained("ckpt", trust_remote_code=True)
            with torch.no_grad():
                return model(torch.arange(10)[None]).double().sum().item()
    """
    kernel = load + """
        first = load()
        code = open("code/modeling_tinyremote.py").read()
        open("code/modeling_tinyremote.py", "w").write(code.replace("* 1.0", "* 2.0"))  # the user edits it
        edited = load()
        print(json.dumps({"first": first, "edited": edited, "calls": loading.calls(),
                          "fallbacks": loading.fallbacks()}))
    """
    restarted = load + """
        print(json.dumps({"out": load(), "calls": loading.calls(), "fallbacks": loading.fallbacks()}))
    """
    miss = last_json(run_py(kernel, cwd=tmp_path, env=dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "m1"))))
    assert miss["calls"] == {"miss": 2} and not miss["fallbacks"], miss
    assert miss["edited"] == pytest.approx(2 * miss["first"]), miss
    hit = last_json(run_py(restarted, cwd=tmp_path, env=dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "m2"))))
    assert hit["calls"] == {"hit": 1} and not hit["fallbacks"] and hit["out"] == miss["edited"], hit
