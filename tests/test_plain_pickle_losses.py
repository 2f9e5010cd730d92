"""A hit is the plain load where a pickle of it would not be (Note [What a plain pickle loses] in
overmind_jupyter/rebuild.py): a GenerationConfig's own hash, and what CLIPTokenizer sets on its native
tokenizer. Real checkpoints, real transformers; the hash across two processes that hash strings apart."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import pytest

from overmind_jupyter import demo_models, loading
from overmind_jupyter.errors import FallbackWarning
from tests.helpers.snippets import last_json, run_py


@pytest.fixture(scope="module")
def published_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (tied embeddings) whose generation config has sampling settings with sampling off, as
    many published models do (transformers warns of them, and refuses to save them once the config was
    changed)."""
    path = demo_models.build_llama(tmp_path_factory.mktemp("published") / "llama", "tiny", tie_word_embeddings=True)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False, "temperature": 0.6, "top_p": 0.9}))
    return path


@pytest.fixture(scope="module")
def clip_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_models.build_sd_pipeline(tmp_path_factory.mktemp("sd") / "sd") / "tokenizer"


GENERATION_CONFIGS = """
    import json, os, tempfile, torch
    import overmind_jupyter
    from overmind_jupyter import loading
    overmind_jupyter.enable()
    from transformers import AutoModelForCausalLM, GenerationConfig
    path = os.environ["MODEL"]

    def changed(path):
        model = AutoModelForCausalLM.from_pretrained(path)
        model.generation_config.top_k = 5  # changed before it is cached: one more setting sampling ignores
        return model

    def saves(config):
        with tempfile.TemporaryDirectory() as folder:
            try:
                config.save_pretrained(folder)
                return "saved"
            except ValueError:
                return "refused"

    loaded = AutoModelForCausalLM.from_pretrained(path)
    edited = loading.cached(changed, path)
    given = AutoModelForCausalLM.from_pretrained(path, generation_config=GenerationConfig.from_pretrained(path),
                                                 dtype=torch.float32)
    print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks(),
                      "saves": [saves(m.generation_config) for m in (loaded, edited, given)]}))
"""


def test_a_generation_config_is_as_changed_as_the_plain_loads(overmind_home: Path, published_llama: Path) -> None:
    """Saving a generation config that warns works where it is unchanged since it was loaded and is
    refused where it was changed: on a hit in a kernel that hashes strings apart as on the miss. A
    config given as an argument keys by whether it changed, not by its hash: a hit there too."""
    env = dict(os.environ, MODEL=str(published_llama))
    miss = last_json(run_py(GENERATION_CONFIGS, env=env | {"PYTHONHASHSEED": "1"}, timeout=300))
    hit = last_json(run_py(GENERATION_CONFIGS, env=env | {"PYTHONHASHSEED": "2"}, timeout=300))
    # (the miss of `changed` runs its load inside, a hit of the first load's entry)
    assert miss["calls"] == {"miss": 3, "hit": 1} and hit["calls"] == {"hit": 3}, (miss, hit)
    assert not miss["fallbacks"] and not hit["fallbacks"]
    # what the plain loads do, which the miss keeps (the library changes a config it is given)
    assert miss["saves"] == ["saved", "refused", "refused"]
    assert hit["saves"] == miss["saves"]


def test_a_clip_tokenizer_decodes_as_the_plain_ones(overmind_home: Path, clip_tokenizer: Path) -> None:
    from transformers import CLIPTokenizer

    plain = CLIPTokenizer.from_pretrained(clip_tokenizer)
    before = loading.calls()
    miss = loading.cached(CLIPTokenizer.from_pretrained, clip_tokenizer)
    hit = loading.cached(CLIPTokenizer.from_pretrained, clip_tokenizer)
    after = loading.calls()
    assert (after.get("miss", 0) - before.get("miss", 0), after.get("hit", 0) - before.get("hit", 0)) == (1, 1)
    ids = plain("a hello world").input_ids
    assert plain.decode(ids, skip_special_tokens=True) == "a hello world", "CLIP's wrapper strips </w>"
    for tokenizer in (miss, hit):
        assert tokenizer.decode(ids, skip_special_tokens=True) == "a hello world"
        assert tokenizer.backend_tokenizer.decode(ids[1:-1]) == "a hello world"


def noted(path: Path) -> object:
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.note = "mine"  # an attribute a pickle of the native tokenizer drops
    return tokenizer


def test_an_attribute_a_native_pickle_would_drop_leaves_the_result_uncached(overmind_home: Path,
                                                                         clip_tokenizer: Path) -> None:
    """Not cached, rather than cached without it: the plain result, with the reason said."""
    for call in range(2):
        before = loading.calls()
        with pytest.warns(FallbackWarning, match="holds attributes") if call == 0 else contextlib.nullcontext():
            result = loading.cached(noted, clip_tokenizer)
        after = loading.calls()
        assert after.get("plain", 0) - before.get("plain", 0) == 1 and after.get("hit") == before.get("hit")
        assert result.backend_tokenizer.note == "mine"
        assert result.decode(result("a hello world").input_ids, skip_special_tokens=True) == "a hello world"
    (fallback, *_) = loading.fallbacks()
    assert fallback["kind"] == "unpicklable"
    assert "a Tokenizer holds attributes that pickling it loses (decode, note)" in fallback["reason"]


def test_a_parameter_of_a_class_of_its_own_leaves_the_result_uncached(overmind_home: Path) -> None:
    """torch's reduction of a Parameter makes an nn.Parameter of any subclass: the result is not cached,
    rather than cached with its parameter's class lost, and the reason is said."""
    from tests.helpers import tiny_modules

    before = loading.calls()
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            result = loading.cached(tiny_modules.build, "tagged_weight")
        assert type(result.weight) is tiny_modules.TaggedParameter
    after = loading.calls()
    assert after.get("plain", 0) - before.get("plain", 0) == 2 and after.get("hit") == before.get("hit")
    (fallback, *_) = loading.fallbacks()
    assert fallback["kind"] == "unpicklable" and "a parameter of class TaggedParameter" in fallback["reason"]


def with_a_closure(path: Path) -> dict[str, object]:
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(path)
    return {"tokenizer": tokenizer, "lower": lambda text: text.lower()}  # a lambda: dill packs it


def test_a_result_dill_packs_keeps_the_tokenizers_wrapper_too(overmind_home: Path, clip_tokenizer: Path) -> None:
    from overmind_jupyter import rebuild

    before = loading.calls()
    miss = loading.cached(with_a_closure, clip_tokenizer)
    assert rebuild.pack(miss).pickler == "dill", "the C pickler cannot pickle the lambda"
    hit = loading.cached(with_a_closure, clip_tokenizer)
    after = loading.calls()
    assert (after.get("miss", 0) - before.get("miss", 0), after.get("hit", 0) - before.get("hit", 0)) == (1, 1)
    assert hit["lower"]("A") == "a"
    ids = hit["tokenizer"]("a hello world").input_ids
    assert hit["tokenizer"].decode(ids, skip_special_tokens=True) == "a hello world"


# A function defined in the notebook (`__main__`), whose result holds a lambda: dill pickles it by value,
# naming the notebook's globals as `__builtin__.__main__`.
NOTEBOOK_FUNCTION = """
    import json, overmind_jupyter
    from overmind_jupyter import loading

    def make(n):
        return {"n": n, "add": lambda x: x + n, "none": type(None)}

    r = overmind_jupyter.cached(make, 3)
    print(json.dumps({"add": r["add"](1), "none": r["none"] is type(None), "calls": loading.calls(),
                      "fallbacks": [f["reason"] for f in loading.fallbacks()]}))
"""


def test_a_result_dill_packs_with_the_notebooks_globals_is_a_hit_in_the_next_kernel(overmind_home: Path) -> None:
    """Note [dill's globals] in rebuild.py: a miss, then a hit in a fresh process, as plain returns it."""
    miss, hit = (last_json(run_py(NOTEBOOK_FUNCTION)) for _ in range(2))
    assert miss == {"add": 4, "none": True, "calls": {"miss": 1}, "fallbacks": []}, miss
    assert hit == {"add": 4, "none": True, "calls": {"hit": 1}, "fallbacks": []}, hit


# A class defined in the notebook, in a result that dill must pack (it holds a lambda too).
NOTEBOOK_CLASS = """
    import json, overmind_jupyter
    from overmind_jupyter import loading

    class Config:
        def __init__(self, n):
            self.n = n

    def make(n):
        return {"cfg": Config(n), "add": lambda x: x + n}

    r = overmind_jupyter.cached(make, 3)
    print(json.dumps({"isinstance": isinstance(r["cfg"], Config), "calls": loading.calls(),
                      "fallbacks": [f["reason"] for f in loading.fallbacks()]}))
"""


def test_a_result_holding_a_class_of_the_notebook_is_not_cached_and_says_why(overmind_home: Path) -> None:
    """Note [Classes of the notebook] in rebuild.py: a hit would hold a copy of the class."""
    for _ in range(2):  # and the next kernel finds no entry to serve
        out = last_json(run_py(NOTEBOOK_CLASS, env=dict(os.environ, PYTHONWARNINGS="ignore")))
        assert out["isinstance"] and out["calls"] == {"plain": 1}, out
        (reason,) = out["fallbacks"]
        assert "a class defined in the notebook (Config)" in reason and "a .py file" in reason, reason


GRAPHS = """
    import json, os, sys, torch
    from tests.helpers.graphs import describe
    if sys.argv[1] != "plain":
        import overmind_jupyter
        overmind_jupyter.enable()
    from transformers import AutoModelForCausalLM
    from diffusers import DiffusionPipeline
    from peft import PeftModel
    from overmind_jupyter import loading
    paths = json.loads(os.environ["PATHS"])
    results = {
        "llama": AutoModelForCausalLM.from_pretrained(paths["llama"]),
        "pipeline": DiffusionPipeline.from_pretrained(paths["pipeline"]),
    }
    base = AutoModelForCausalLM.from_pretrained(paths["llama"], dtype=torch.float32)
    results["peft"] = PeftModel.from_pretrained(base, paths["fr"], adapter_name="fr")
    results["peft"].load_adapter(paths["de"], adapter_name="de")
    with open(os.environ["OUT"], "w") as f:
        json.dump({"calls": loading.calls(), "lines": {name: describe(r) for name, r in results.items()}}, f)
"""


def test_a_hits_object_graph_is_the_plain_loads(overmind_home: Path, published_llama: Path, tmp_path: Path) -> None:
    """Every object a plain load makes, with its attributes in order, its sharing, and its tensors'
    bytes, is in the miss and in the hit in another process alike (tests/helpers/graphs.py says what
    is left out). A release that adds state a pickle loses, or that only the loading process can
    read, fails here before a user meets it. Each result is compared on its own: two results of a
    plain process share their classes' constants (transformers' `_pp_plan` tuples), which each entry
    holds a copy of."""
    import difflib

    root = tmp_path / "checkpoints"
    adapters = demo_models.build_lora_adapters(published_llama, root / "lora", ("fr", "de"))
    paths = {"llama": str(published_llama), "pipeline": str(demo_models.build_sd_pipeline(root / "sd")),
             "fr": str(adapters["fr"]), "de": str(adapters["de"])}
    graphs = {}
    for run in ("plain", "miss", "hit"):
        out = tmp_path / f"{run}.json"
        # one hash seed: PEFT's sets and diffusers' lists made from sets come out in its order
        env = dict(os.environ, PATHS=json.dumps(paths), OUT=str(out), PYTHONHASHSEED="0")
        run_py(GRAPHS.replace("sys.argv[1]", repr(run)), env=env, timeout=300)
        graphs[run] = json.loads(out.read_text())
    assert graphs["miss"]["calls"] == {"miss": 5} and graphs["hit"]["calls"] == {"hit": 5}
    plain = graphs["plain"]["lines"]
    assert len(plain["pipeline"]) > 5000, "the whole graph is described"
    assert any("['lm_head']._parameters['weight']: the object at " in line for line in plain["peft"]), \
        "sharing is described: the tied weights are one object"
    for run in ("miss", "hit"):
        for name, lines in plain.items():
            diff = list(difflib.unified_diff(lines, graphs[run]["lines"][name], "plain", run, n=0, lineterm=""))
            assert not diff, f"{name}:\n" + "\n".join(diff[:40]) + f"\n({len(diff)} lines)"
