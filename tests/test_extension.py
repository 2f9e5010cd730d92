"""The IPython extension and the patched loaders: lifecycle, reversibility, keys, families, restarts."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overmind_jupyter import demo_models
from tests.helpers.kernels import magic_json
from tests.helpers.snippets import at_a_call, last_json, run_py


@pytest.fixture
def shell(overmind_home: Path):
    """A real IPython shell with the extension loaded; everything is unloaded afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "overmind_jupyter")
    yield ip
    ip.run_line_magic("unload_ext", "overmind_jupyter")


def loader_descriptors() -> dict[str, object]:
    """Every `from_pretrained` descriptor our targets can touch, as the classes hold them now."""
    import diffusers
    import peft
    import transformers
    from transformers.models.auto import modeling_auto

    classes = [transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase, transformers.AutoTokenizer,
               transformers.AutoProcessor, transformers.ProcessorMixin, transformers.LlamaForCausalLM,
               diffusers.DiffusionPipeline, diffusers.ModelMixin, diffusers.SchedulerMixin, diffusers.UNet2DModel,
               peft.PeftModel, peft.PeftModelForCausalLM]
    classes += [c for c in vars(modeling_auto).values() if isinstance(c, type) and c.__name__.startswith("Auto")]
    return {f"{c.__module__}.{c.__qualname__}": c.__dict__.get("from_pretrained") for c in classes}


def test_an_interrupted_off_is_finished_by_the_next_one(overmind_home: Path) -> None:
    """An interrupt inside `%overmind off`'s restore of one loader: the others are restored, the interrupt
    reaches the cell, and the next `off` restores that one too (docs/design.md invariant 6), where it
    stayed patched for good, and said that every loader was as it was."""
    code = """
        import os, signal, sys
        import overmind_jupyter
        from overmind_jupyter import patching
        from transformers import AutoModel, PreTrainedModel  # noqa: F401 (their loaders patched)

        overmind_jupyter.enable()
        bases = dict(patching._bases)  # every patched attribute as it was

        def _at_call(frame, event, arg):
            if event == "call" and frame.f_code is patching._settle.__code__:
                sys.setprofile(None)
                os.kill(os.getpid(), signal.SIGINT)

        sys.setprofile(_at_call)
        try:
            overmind_jupyter.disable()
            said = "restored"
        except KeyboardInterrupt:
            said = "interrupted"
        left = bool(patching._records)
        overmind_jupyter.disable()
        as_it_was = all((vars(owner).get(name) is base.original) if base.local else name not in vars(owner)
                        for (owner, name), base in bases.items())
        print(said, left, as_it_was, bool(patching._records))
    """
    out = run_py(code).stdout.split()
    assert out == ["interrupted", "True", "True", "False"], out


def test_a_ctrl_c_as_a_cell_ends_prints_no_error_and_the_preparation_is_done_later(overmind_home: Path) -> None:
    """A Ctrl-C that lands in the extension's work after a cell (here while it prepares the hit path, after
    the cell that imported torch) is dropped: IPython prints no "Error in callback" and no traceback under
    the finished cell, and the preparation it cut short is done after the next cell (Note [A Ctrl-C after
    the cell] in extension.py). A real SIGINT, sent as the preparation's first warm-up is called."""
    code = """
        import json, sys
        from IPython.core.interactiveshell import InteractiveShell

        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "overmind_jupyter")
        from overmind_jupyter import hit_tuning

        assert "torch" not in sys.modules
        {interrupt}
        ip.run_cell("import torch")
        sys.setprofile(None)
        interrupted = not hit_tuning._prepared
        ip.run_cell("x = 1")
        print(json.dumps({{"interrupted": interrupted, "prepared": hit_tuning._prepared}}))
    """
    interrupt = at_a_call("from overmind_jupyter import hit_tuning", "hit_tuning._warm_rebuild.__code__", " " * 8)
    proc = run_py(code.format(interrupt=interrupt), fresh=True)
    said = proc.stdout + proc.stderr
    assert "Error in callback" not in said and "KeyboardInterrupt" not in said, said
    assert last_json(proc) == {"interrupted": True, "prepared": True}


def test_on_off_restores_every_descriptor_and_reload_is_idempotent(shell, overmind_home: Path) -> None:
    import transformers

    before = loader_descriptors()
    original_signature = inspect.signature(transformers.AutoModelForCausalLM.from_pretrained)
    shell.run_line_magic("overmind", "on")
    during = loader_descriptors()
    changed = [name for name in before if during[name] is not before[name]]
    assert "transformers.modeling_utils.PreTrainedModel" in changed
    assert "transformers.models.auto.modeling_auto.AutoModelForCausalLM" in changed
    assert "peft.peft_model.PeftModel" in changed and "diffusers.pipelines.pipeline_utils.DiffusionPipeline" in changed
    import peft

    from overmind_jupyter import patching

    assert patching.is_patched(peft.PeftModel, "load_adapter")
    assert during["transformers.models.llama.modeling_llama.LlamaForCausalLM"] is None, "inherited, not copied"
    wrapper = transformers.AutoModelForCausalLM.from_pretrained
    assert wrapper.__name__ == "from_pretrained" and wrapper.__doc__ == before[
        "transformers.models.auto.modeling_auto.AutoModelForCausalLM"].__func__.__doc__
    assert inspect.signature(wrapper) == original_signature
    for _ in range(2):
        shell.run_line_magic("reload_ext", "overmind_jupyter")
        shell.run_line_magic("overmind", "on")
    assert loader_descriptors() == during or all(
        type(loader_descriptors()[n]) is type(during[n]) for n in during), "reload patches once"
    callbacks = [cb for cb in shell.events.callbacks["post_run_cell"] if "overmind" in repr(cb)]
    assert len(callbacks) == 1, "reload does not stack callbacks"
    shell.run_line_magic("overmind", "off")
    after = loader_descriptors()
    assert all(after[name] is before[name] for name in before), "every original descriptor is back"
    shell.run_line_magic("overmind", "on")
    shell.run_line_magic("unload_ext", "overmind_jupyter")
    assert all(loader_descriptors()[name] is before[name] for name in before)
    assert "overmind" not in shell.magics_manager.magics["line"]
    shell.run_line_magic("load_ext", "overmind_jupyter")  # for the fixture's unload


def test_after_off_a_plain_loads_traceback_holds_no_frame_of_ours(overmind_home: Path, tmp_path: Path) -> None:
    """Off restores the originals, not wrappers that pass through: also where transformers copied our
    wrapper into an Auto class made while on (Note [Copied wrappers] in targets.py)."""
    out = last_json(run_py(f"""
        import json, traceback
        import overmind_jupyter
        overmind_jupyter.enable()
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # made while on
        overmind_jupyter.disable()
        ours = {{}}
        for loader in (AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM):
            try:
                loader.from_pretrained({str(tmp_path / "absent")!r})
            except Exception as exc:
                ours[loader.__name__] = [f"{{f.filename}}:{{f.name}}" for f in traceback.extract_tb(exc.__traceback__)
                                         if "overmind_jupyter" in f.filename]
        doc = AutoModelForCausalLM.from_pretrained.__doc__
        print(json.dumps({{"ours": ours, "doc": "AutoModelForCausalLM" in doc or "causal" in doc}}))
    """))
    assert out["ours"] == {"AutoModelForCausalLM": [], "AutoTokenizer": [], "LlamaForCausalLM": []}
    assert out["doc"], "the Auto class keeps the docstring transformers wrote for it"


def test_libraries_imported_after_on_are_patched(overmind_home: Path) -> None:
    out = last_json(run_py("""
        import json, sys
        import overmind_jupyter
        from overmind_jupyter import patching
        overmind_jupyter.enable()
        assert "peft" not in sys.modules and "diffusers" not in sys.modules and "torch" not in sys.modules
        import peft, diffusers, torch
        print(json.dumps({
            "peft": patching.is_patched(peft.PeftModel, "from_pretrained"),
            "pipeline": patching.is_patched(diffusers.DiffusionPipeline, "from_pretrained"),
            "moves": [patching.is_patched(torch.nn.Module, "to"), patching.is_patched(torch.nn.Module, "cuda"),
                      patching.is_patched(diffusers.DiffusionPipeline, "to")],
        }))
    """, fresh=True))  # (what the process imported before is what it is about)
    assert out == {"peft": True, "pipeline": True, "moves": [True, True, True]}


def test_import_is_light() -> None:
    out = last_json(run_py("""
        import json, sys
        import overmind_jupyter, kernel_server
        heavy = [m for m in ("torch", "transformers", "diffusers", "peft", "IPython") if m in sys.modules]
        print(json.dumps(heavy))
    """, fresh=True))
    assert out == []


FAMILIES = """
    import json, os, sys, torch
    import overmind_jupyter
    from overmind_jupyter import loading, rebuild
    torch.manual_seed(0)  # a reproducible notebook: PEFT's loads draw random numbers (Note [Random loads])
    overmind_jupyter.enable()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from diffusers import DiffusionPipeline
    from peft import PeftModel
    paths = json.loads(os.environ["PATHS"])
    base = AutoModelForCausalLM.from_pretrained(paths["llama"], dtype=torch.float32)
    try:  # its published generation config warns: saved back unchanged, as the plain load's is (what
        # `base.save_pretrained` does, which would also change `base.config`: no cached result after it)
        base.generation_config.save_pretrained(os.environ["SAVE_TO"])
        saved = "saved"
    except ValueError as exc:
        saved = str(exc)
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    pipe = DiffusionPipeline.from_pretrained(paths["pipeline"])
    prompt = pipe.tokenizer("a hello world").input_ids  # CLIP's: decodes with its own wrapper
    peft_model = PeftModel.from_pretrained(base, paths["fr"], adapter_name="fr")
    peft_model.load_adapter(paths["de"], adapter_name="de")
    ids = torch.tensor([tok("hello world the model").input_ids])
    with torch.no_grad():
        peft_model.set_adapter("fr")
        fr = peft_model(ids).logits.double().sum().item()
        peft_model.set_adapter("de")
        de = peft_model(ids).logits.double().sum().item()
        image = pipe("hello world", num_inference_steps=2, height=16, width=16, output_type="np",
                     generator=torch.manual_seed(0)).images
    status = overmind_jupyter.status()
    print(json.dumps({
        "ids": ids.tolist(), "fr": fr, "de": de, "image": float(image.sum()), "saved": saved,
        "decoded": pipe.tokenizer.decode(prompt, skip_special_tokens=True),
        "arena": [rebuild.entry_of(next(m.parameters()).data_ptr()) is not None
                  for m in (base, pipe.unet, pipe.text_encoder, peft_model)],
        "labels": sorted(e["meta"]["label"].split("(")[0] for e in status["daemon"]["entries"]),
        "base_is_wrapped": peft_model.base_model.model is base,
        "hits": status["daemon"]["stats"].get("hits", 0), "fallbacks": loading.fallbacks(),
    }))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    llama = demo_models.build_llama(root / "llama", "tiny")
    # as many published models have it: sampling settings with sampling off (the library warns of them)
    (llama / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False, "temperature": 0.6, "top_p": 0.9}))
    adapters = demo_models.build_lora_adapters(llama, root / "lora", ("fr", "de"))
    return {"llama": str(llama), "tokenizer": str(demo_models.build_tokenizer(root / "tokenizer")),
            "pipeline": str(demo_models.build_sd_pipeline(root / "sd")),
            "fr": str(adapters["fr"]), "de": str(adapters["de"])}


def test_every_family_is_a_hit_in_the_next_process(overmind_home: Path, checkpoints: dict[str, str],
                                                   tmp_path: Path) -> None:
    """And each is the plain load's in the ways a pickle would lose (Note [What a plain pickle loses] in
    rebuild.py): the two processes hash strings differently, as two kernels do."""
    env = dict(os.environ, PATHS=json.dumps(checkpoints), SAVE_TO=str(tmp_path / "saved"))
    miss = last_json(run_py(FAMILIES, env=env | {"PYTHONHASHSEED": "1"}, timeout=300))
    hit = last_json(run_py(FAMILIES, env=env | {"PYTHONHASHSEED": "2"}, timeout=300))
    assert not miss["fallbacks"] and not hit["fallbacks"]
    assert miss["saved"] == "saved" and hit["saved"] == "saved", "the config is unchanged since it was loaded"
    assert miss["decoded"] == "a hello world" and hit["decoded"] == "a hello world", "no </w> left in"
    assert miss["labels"] == ["AutoModelForCausalLM.from_pretrained", "AutoTokenizer.from_pretrained",
                              "DiffusionPipeline.from_pretrained", "PeftModel.from_pretrained",
                              "PeftModel.load_adapter"], \
        "one entry per outermost call: nested loads (components, the concrete class) pass through"
    assert hit["hits"] == 5 and all(hit["arena"]), "the second process got all five from shared memory"
    assert hit["base_is_wrapped"], "PeftModel wraps the caller's base model object, as without the cache"
    for name in ("ids", "fr", "de", "image"):
        assert hit[name] == miss[name], name
    assert miss["fr"] != miss["de"], "the adapters differ, so the comparison means something"


def test_a_rewritten_checkpoint_is_loaded_fresh(overmind_home: Path, tmp_path: Path) -> None:
    code = """
        import json, sys, torch
        import overmind_jupyter
        from overmind_jupyter import loading
        overmind_jupyter.enable()
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
        overmind_jupyter.disable()
        plain = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
        ids = torch.arange(8)[None]
        with torch.no_grad():
            a, b = m(ids).logits.double().sum().item(), plain(ids).logits.double().sum().item()
        print(json.dumps({"cached": a, "plain": b, "entries": len(overmind_jupyter.status()["daemon"]["entries"])}))
    """.replace("sys.argv[1]", repr(str(tmp_path / "model")))
    demo_models.build_llama(tmp_path / "model", "tiny", seed=1)
    first = last_json(run_py(code))
    shutil.rmtree(tmp_path / "model")
    demo_models.build_llama(tmp_path / "model", "tiny", seed=2)  # rewritten in place
    second = last_json(run_py(code))
    assert first["cached"] == first["plain"] and second["cached"] == second["plain"]
    assert second["cached"] != first["cached"], "the rewritten checkpoint was served stale"
    assert second["entries"] in (1, 2), "its own entry, and the old one until the daemon drops it"
    from kernel_server import Client
    from tests.helpers.faults_helpers import wait_until

    with Client(overmind_home, spawn=False, role="test") as client:  # Note [Orphaned entries]
        wait_until(lambda: client.request("status")["stats"].get("orphaned") == 1, 15,
                   "the entry of the checkpoint's first version dropped")
        assert len(client.request("status")["entries"]) == 1


def test_the_same_relative_path_from_two_cwds_gives_two_entries(overmind_home: Path, tmp_path: Path) -> None:
    for name, seed in (("a", 1), ("b", 2)):
        demo_models.build_llama(tmp_path / name / "model", "tiny", seed=seed)
    code = """
        import json, torch, overmind_jupyter
        from overmind_jupyter import loading
        overmind_jupyter.enable()
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained("model", dtype=torch.float32)
        with torch.no_grad():
            print(json.dumps({"out": m(torch.arange(8)[None]).logits.double().sum().item(),
                              "keys": sorted(e["key"] for e in overmind_jupyter.status()["daemon"]["entries"])}))
    """
    a = last_json(run_py(code, cwd=tmp_path / "a"))
    b = last_json(run_py(code, cwd=tmp_path / "b"))
    assert a["out"] != b["out"] and len(b["keys"]) == 2


def test_an_exception_in_the_original_load_propagates_and_leaves_nothing(shell, overmind_home: Path,
                                                                         tmp_path: Path) -> None:
    import warnings

    from transformers import AutoModelForCausalLM

    from overmind_jupyter.errors import FallbackWarning

    def chain(exc: BaseException | None) -> list[str]:
        """The exception and those it was raised in handling or from: their types."""
        out = []
        while exc is not None:
            out.append(f"{type(exc).__module__}.{type(exc).__qualname__}")
            exc = exc.__cause__ or exc.__context__
        return out

    missing = tmp_path / "no-such-model"
    missing.mkdir()
    misspelt = str(tmp_path / "no-such-path")  # no key at all: the call falls back, then raises
    plain = {}
    for path in (str(missing), misspelt):
        with pytest.raises(Exception) as raised:
            AutoModelForCausalLM.from_pretrained(path)
        plain[path] = chain(raised.value)
    shell.run_line_magic("overmind", "on")
    for path in (str(missing), misspelt):
        with pytest.raises(Exception) as raised, warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)  # the misspelt one's: "neither a local path ..."
            AutoModelForCausalLM.from_pretrained(path)
        assert chain(raised.value) == plain[path], "the same exception, with no exception of ours in its chain"
    state = magic_json(shell, "status")
    assert state["daemon"]["entries"] == [] and state["daemon"]["loading"] == []


def test_a_failing_loads_traceback_in_the_cell_shows_the_frames_the_plain_one_shows(
        shell, tiny_llama: Path, overmind_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Note [Our frames hidden] in loading.py: the cell's traceback goes from the user's line to the
    library's, as without the cache, saying that it skips ours."""
    cell = ("from transformers import AutoModelForCausalLM\n"
            f"AutoModelForCausalLM.from_pretrained({str(tiny_llama)!r}, not_an_argument=3)\n")

    def shown() -> tuple[str, list[str]]:
        capsys.readouterr()
        result = shell.run_cell(cell)
        assert result.error_in_exec is not None
        text = capsys.readouterr().out
        files = re.findall(r"File (\S+?):\d+", re.sub(r"\x1b\[[0-9;]*m", "", text))
        return text, files

    plain_text, plain = shown()
    shell.run_line_magic("overmind", "on")
    cached_text, cached = shown()
    assert not [f for f in cached if "overmind_jupyter" in f], cached_text
    assert cached == plain, (cached, plain)
    assert "skipping hidden" in cached_text and "skipping hidden" not in plain_text


def test_uncacheable_argument_loads_plainly_and_status_says_why(shell, tiny_llama: Path, overmind_home: Path,
                                                                tmp_path: Path) -> None:
    import shutil
    import warnings

    from transformers import AutoModelForCausalLM

    from overmind_jupyter.errors import FallbackWarning

    plain = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    shell.run_line_magic("overmind", "on")
    with pytest.warns(FallbackWarning, match="no canonical form"):
        model = type(plain).from_pretrained(None, config=plain.config, state_dict=plain.state_dict())
    assert model is not None
    state = magic_json(shell, "status")
    assert any("state_dict" in f["reason"] for f in state["fallbacks"])
    assert any("state_dict" in f["reason"] for f in state["daemon"]["fallbacks"]), "the daemon heard of it too"
    # told once per label and reason: a loop once, a load of another model again, its checkpoint given by
    # keyword or not, with a comma in its path or not (it was silent: one function, one reason)
    first, other = tmp_path / "m,1", tmp_path / "m,2"
    for path in (first, other):
        shutil.copytree(tiny_llama, path)
    told = []
    for path, keyword in ((first, False), (first, False), (other, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match="meta"):  # (the plain load's error: it has no weights)
                if keyword:
                    type(plain).from_pretrained(pretrained_model_name_or_path=str(path), device_map="meta")
                else:
                    type(plain).from_pretrained(str(path), device_map="meta")
        told.append([str(w.message) for w in caught if issubclass(w.category, FallbackWarning)])
    assert [len(t) for t in told] == [1, 0, 1] and repr(str(other)) in told[2][0], told


def test_an_adapter_loaded_onto_a_changed_model_says_why_and_what_to_do(shell, tiny_llama: Path,
                                                                        tmp_path: Path) -> None:
    """A base frozen before its adapter is loaded, and a get_peft_model model given a saved adapter, load
    plainly (no entry holds them as they are now): the warning says so, names the kinds of change, and says
    how to cache such loads. It said "no canonical form for a cache key", and no fix. It names the adapter,
    given positionally or by keyword (PeftModel.from_pretrained's was "(...)": its path is not the first
    argument)."""
    import warnings

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from overmind_jupyter import loading
    from overmind_jupyter.errors import FallbackWarning

    adapter = str(demo_models.build_lora_adapters(tiny_llama, tmp_path / "lora", ("fr",))["fr"])
    shell.run_line_magic("overmind", "on")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
        base.requires_grad_(False)
        PeftModel.from_pretrained(base, adapter)
        PeftModel.from_pretrained(base, model_id=adapter)
        made = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_llama)),
                              LoraConfig(r=2, target_modules=["q_proj"]))
        made.load_adapter(adapter, adapter_name="fr")
    said = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(said) == 2, said
    for text, argument in zip(said, ("argument model", "argument self"), strict=True):
        assert argument in text and "changed since it was loaded or made" in text, text
        assert "requires_grad_" in text and "get_peft_model" in text and "set_adapter" in text, text
        assert "load adapters right after loading the base model, before changing it" in text, text
        assert "canonical form" not in text, text
        assert repr(adapter) in text, "the adapter's path, given second to PeftModel.from_pretrained"
    calls = [f["call"] for f in loading.fallbacks()]
    assert len(calls) == 3 and all(c.endswith(f"({adapter!r}, ...)") for c in calls), calls


def test_an_adapter_over_two_bases_is_two_entries_that_read_apart(shell, tiny_llama: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """One adapter over a float32 and over a bfloat16 base are two entries: `ls` and status named both
    `PeftModel.from_pretrained('.../fr')`. A cached model a call is given is in its label, short: the folder
    it was loaded from and its dtype (load_adapter's object too)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from overmind_jupyter import loading

    adapters = demo_models.build_lora_adapters(tiny_llama, tmp_path / "lora", ("fr", "de"))
    shell.run_line_magic("overmind", "on")
    for dtype in (torch.float32, torch.bfloat16):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=dtype),
                                          str(adapters["fr"]))
    model.load_adapter(str(adapters["de"]), adapter_name="de")
    labels = sorted(e["meta"]["label"] for e in loading.shared_client().request("ls")["entries"])
    assert len(labels) == 5, labels
    fr = f"PeftModel.from_pretrained({str(adapters['fr'])!r}"
    assert [label for label in labels if label.startswith(fr)] == [
        f"{fr}, model=<tiny-llama bfloat16>)", f"{fr}, model=<tiny-llama float32>)"], labels
    assert f"PeftModel.load_adapter({str(adapters['de'])!r}, adapter_name='de', self=<tiny-llama bfloat16>)" \
        in labels, labels
    assert capsys.readouterr().err.count("overmind: cached fr in") == 2, "the miss line names the adapter"


def test_a_model_loaded_through_diffusers_automodel_is_the_entry_its_own_class_made(
        shell, checkpoints: dict[str, str]) -> None:
    """Note [Hub arguments left at their default] in keys.py: diffusers' AutoModel passes the hub's
    arguments at their defaults (cache_dir=None, ...) to the class it picks, where the class's own call
    leaves them out: one model, one entry, and the second load is a hit."""
    from diffusers import AutoModel, UNet2DConditionModel

    from overmind_jupyter import loading

    shell.run_line_magic("overmind", "on")
    before = dict(loading.calls())
    first = UNet2DConditionModel.from_pretrained(checkpoints["pipeline"], subfolder="unet")
    second = AutoModel.from_pretrained(checkpoints["pipeline"], subfolder="unet")
    assert type(second) is type(first)
    assert loading.calls().get("hit", 0) == before.get("hit", 0) + 1, loading.calls()
    assert len(loading.shared_client().request("ls")["entries"]) == 1


def test_a_pipeline_hit_spelled_otherwise_leaves_the_component_it_was_given_as_it_was(
        shell, checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Spellings] in spellings.py: `from_pretrained("./sd", unet=unet)` after a kernel made the entry
    as `from_pretrained("sd", unet=unet)` names "./sd" and its other components under it, as plainly, and
    leaves the user's own UNet (loaded as "sd") as it was; the hit is still its entry's, for the next load
    it is given to (Note [References] in results.py)."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel

    from overmind_jupyter import loading, results

    monkeypatch.chdir(Path(checkpoints["pipeline"]).parent)
    run_py("""
        import overmind_jupyter
        overmind_jupyter.enable()
        from diffusers import DiffusionPipeline, UNet2DConditionModel
        DiffusionPipeline.from_pretrained("sd", unet=UNet2DConditionModel.from_pretrained("sd", subfolder="unet"))
    """)
    shell.run_line_magic("overmind", "on")
    hits = loading.calls().get("hit", 0)
    unet = UNet2DConditionModel.from_pretrained("sd", subfolder="unet")
    pipe = DiffusionPipeline.from_pretrained("./sd", unet=unet)
    assert loading.calls().get("hit", 0) == hits + 2, loading.calls()
    assert (pipe.config._name_or_path, pipe.vae.config._name_or_path) == ("./sd", os.path.join("./sd", "vae"))
    assert pipe.unet is unet and unet.config._name_or_path == "sd"
    assert results.result_key(pipe) is not None, "the respelled hit still pickles as its respelled entry"


def test_a_vae_given_to_pipelines_stays_its_own_entrys(shell, checkpoints: dict[str, str]) -> None:
    """Note [References] in results.py: a cached vae given to a pipeline's load is keyed by its own entry
    in the next load it is given to, as in a process that loaded no pipeline with it: the same pipeline
    again is a hit while the first lives, and a load after the pipelines are gone keys it, not a fallback."""
    import gc

    from diffusers import AutoencoderKL, DiffusionPipeline

    from overmind_jupyter import loading, results

    shell.run_line_magic("overmind", "on")
    vae = AutoencoderKL.from_pretrained(checkpoints["pipeline"], subfolder="vae")
    own = results.result_key(vae)
    pipe = DiffusionPipeline.from_pretrained(checkpoints["pipeline"], vae=vae)
    assert pipe.vae is vae and results.result_key(vae) == own
    hits = loading.calls().get("hit", 0)
    again = DiffusionPipeline.from_pretrained(checkpoints["pipeline"], vae=vae)
    assert loading.calls().get("hit", 0) == hits + 1, loading.calls()
    assert len(loading.shared_client().request("ls")["entries"]) == 2, "the vae's and the pipeline's"
    del pipe, again
    gc.collect()
    DiffusionPipeline.from_pretrained(checkpoints["pipeline"], vae=vae)  # a fallback's warning is an error here
    assert loading.calls().get("hit", 0) == hits + 2, loading.calls()
    assert results.result_key(vae) == own


def test_a_component_of_a_cached_pipeline_is_keyed_by_its_entry_while_unchanged(overmind_home: Path,
                                                                               checkpoints: dict[str, str]) -> None:
    """Note [References] in results.py: a cached pipeline's vae and text encoder, unchanged, given to another
    pipeline's load are keyed as parts of its entry, by the same key after a restart (a hit there); they
    fell back, told they were changed. A component written in place since is keyed by nothing."""
    code = f"""
        import json, warnings
        import torch
        import overmind_jupyter
        from overmind_jupyter import loading, results
        overmind_jupyter.enable()
        from diffusers import DiffusionPipeline
        first = DiffusionPipeline.from_pretrained({checkpoints["pipeline"]!r})
        parts = [results.result_key(first.vae), results.result_key(first.text_encoder)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = DiffusionPipeline.from_pretrained({checkpoints["pipeline"]!r}, vae=first.vae,
                                                       text_encoder=first.text_encoder)
            calls = dict(loading.calls())
            with torch.no_grad():
                first.unet.conv_in.weight.add_(1)
            DiffusionPipeline.from_pretrained({checkpoints["pipeline"]!r}, unet=first.unet)
        print(json.dumps({{"parts": parts, "calls": calls, "shared": second.vae is first.vae,
                          "after": [results.result_key(first.vae), results.result_key(first.text_encoder)],
                          "changed": results.result_key(first.unet), "told": [str(w.message) for w in caught]}}))
    """
    miss, hit = (last_json(run_py(code, timeout=300)) for _ in range(2))
    assert miss["calls"] == {"miss": 2} and hit["calls"] == {"hit": 2}, (miss, hit)
    for out in (miss, hit):
        assert out["parts"][0].endswith("/vae") and out["parts"][1].endswith("/text_encoder"), out
        assert out["parts"] == miss["parts"] and out["after"] == out["parts"] and out["shared"], out
        assert out["changed"] is None, out
        [told] = out["told"]
        assert "argument unet" in told and "was changed since it was loaded or made" in told, told


def test_a_scheduler_given_to_a_pipeline_is_keyed_by_its_whole_state(shell, checkpoints: dict[str, str]) -> None:
    """Note [Schedulers given to a load] in keys.py: a fresh scheduler with an attribute of its user's, given
    to the load another scheduler of the same config was given after `set_timesteps(7)`, is the plain load's
    afterwards: no timesteps, its own attribute. Keyed by its config alone, it was a hit that gave it the
    other's 7 timesteps and dropped the attribute. The same state again is a hit that keeps them."""
    from diffusers import DDIMScheduler, DiffusionPipeline

    from overmind_jupyter import loading

    shell.run_line_magic("overmind", "on")
    before = loading.calls()
    config = DDIMScheduler.load_config(checkpoints["pipeline"], subfolder="scheduler")
    used = DDIMScheduler.from_config(config)
    used.set_timesteps(7)
    assert DiffusionPipeline.from_pretrained(checkpoints["pipeline"], scheduler=used).scheduler is used
    for again in (False, True):
        mine = DDIMScheduler.from_config(config)
        mine.my_tag = "mine"
        pipe = DiffusionPipeline.from_pretrained(checkpoints["pipeline"], scheduler=mine)
        assert pipe.scheduler is mine and mine.num_inference_steps is None and mine.my_tag == "mine", vars(mine)
        calls = {k: c - before.get(k, 0) for k, c in loading.calls().items() if c != before.get(k, 0)}
        assert calls == ({"miss": 2} if not again else {"miss": 2, "hit": 1}), calls
    assert used.num_inference_steps == 7


def test_evict_magic_names_what_it_evicted(shell, tiny_llama: Path, overmind_home: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`%overmind evict KEY` names the entry as `%overmind status` shows it: its key, label and size."""
    from transformers import AutoModelForCausalLM

    from kernel_server.formats import byte_text

    shell.run_line_magic("overmind", "on")
    AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    (entry,) = magic_json(shell, "status")["daemon"]["entries"]
    capsys.readouterr()
    shell.run_line_magic("overmind", f"evict {entry['key'][:10]}")
    said = capsys.readouterr().out
    line = f"  {entry['key'][:12]}  {entry['meta']['label']}  {byte_text(entry['bytes'])}"
    assert said == f"evicted 1 entry ({byte_text(entry['bytes'])}):\n{line}\n", said
    assert "tiny" in entry["meta"]["label"] or "Llama" in entry["meta"]["label"], entry["meta"]
    import overmind_jupyter

    what = "pass the key of an entry or a unique prefix of it, as `%overmind status` and `overmind-daemon ls` list them"
    for key, error, said in (("", ValueError, "evict got an empty key: "), ("k" * 300, ValueError, "of 300 characters"),
                             (b"abc", TypeError, "evict takes a key as a string, not bytes")):
        with pytest.raises(error, match=re.escape(said)) as raised:
            overmind_jupyter.evict(key)  # type: ignore[arg-type]
        assert what in str(raised.value) and "no key at all (`evict()`) to evict every entry" in str(raised.value)
    shell.run_line_magic("overmind", "evict --all")
    assert capsys.readouterr().out == "evicted 0 entries\n", "nothing left to evict, and it says so"


def test_overmind_on_without_a_daemon_says_why_once_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`%overmind on` where no daemon can start (OVERMIND_HOME names a file) says so in its one line, with
    the reason and its fix, and warns nothing besides (it printed the reason twice in other words, one
    of them a warning pointing into extension.py). `enable()` from Python still warns it."""
    import warnings

    from IPython.core.interactiveshell import InteractiveShell

    import overmind_jupyter
    from kernel_server.client import reset_shared_client
    from overmind_jupyter.errors import FallbackWarning

    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    monkeypatch.setenv("OVERMIND_HOME", str(not_a_directory))
    reset_shared_client()
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "overmind_jupyter")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            shell.run_line_magic("overmind", "on")
        said = capsys.readouterr().out
        assert said.count("\n") == 1 and said.count("is not a directory") == 1, said
        assert "no daemon could be started" in said and "remove it or set OVERMIND_HOME" in said, said
        with pytest.warns(FallbackWarning, match="no daemon could be started"):
            overmind_jupyter.enable()
    finally:
        shell.run_line_magic("unload_ext", "overmind_jupyter")
        reset_shared_client()


def test_cpu_device_maps_share_the_cpu_entry(shell, tiny_llama: Path, overmind_home: Path) -> None:
    from transformers import AutoModelForCausalLM


    shell.run_line_magic("overmind", "on")
    AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    for device_map in ("cpu", {"": "cpu"}, "auto"):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map=device_map)
        assert next(model.parameters()).device.type == "cpu"
    state = magic_json(shell, "status")
    assert len(state["daemon"]["entries"]) == 1 and state["daemon"]["stats"]["hits"] == 3


def test_offloading_device_maps_load_plainly_and_say_why_once(shell, tiny_llama: Path, overmind_home: Path,
                                                              tmp_path: Path) -> None:
    """`max_memory`, `offload_folder`, "disk" and "meta" ask for a split the cache cannot reproduce: the
    call is the plain one (its parameters offloaded to disk, its exception), and each reason is told once."""
    from transformers import AutoModelForCausalLM

    from overmind_jupyter.errors import FallbackWarning

    shell.run_line_magic("overmind", "on")
    AutoModelForCausalLM.from_pretrained(str(tiny_llama))  # an entry these loads must not take
    offloaded = {"device_map": "auto", "max_memory": {"cpu": 20_000}, "offload_folder": str(tmp_path / "a")}
    with pytest.warns(FallbackWarning, match="max_memory"):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), **offloaded)
    assert {p.device.type for p in model.parameters()} == {"meta"} and model.hf_device_map == {"": "disk"}
    layers_on_disk = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
                      "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with pytest.warns(FallbackWarning, match="offload_folder"):  # another reason: told too
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map=layers_on_disk,
                                                     offload_folder=str(tmp_path / "b"))
    assert {n for n, p in model.named_parameters() if p.device.type == "meta"} == {
        n for n, _ in model.named_parameters() if n.startswith("model.layers.")}
    with pytest.warns(FallbackWarning, match="meta"), pytest.raises(ValueError, match="meta"):
        AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map="meta")
    with pytest.raises(ValueError, match="meta"):
        AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map="meta")  # the same reason: not again
    reasons = [f["reason"] for f in magic_json(shell, "status")["fallbacks"]]
    assert len(reasons) == 4 and "max_memory" in reasons[0] and "offload_folder" in reasons[1], reasons
    assert "'meta'" in reasons[2] and reasons[3] == reasons[2], reasons


def test_a_load_under_a_meta_device_runs_plainly(shell, tiny_llama: Path, overmind_home: Path) -> None:
    """`with torch.device("meta")` and accelerate's `init_empty_weights()` make the plain load raise; a hit
    would return a whole CPU model, so the call runs plainly and raises what it raises."""
    import accelerate
    from transformers import AutoModelForCausalLM

    from overmind_jupyter import loading
    from overmind_jupyter.errors import FallbackWarning

    shell.run_line_magic("overmind", "on")
    before = loading.calls()
    AutoModelForCausalLM.from_pretrained(str(tiny_llama))  # cached: the next call would be a hit
    with pytest.warns(FallbackWarning, match="meta"), pytest.raises(RuntimeError, match="meta device"), \
            torch.device("meta"):
        AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    with pytest.warns(FallbackWarning, match="init_empty_weights"), pytest.raises(ValueError, match="meta"), \
            accelerate.init_empty_weights():
        AutoModelForCausalLM.from_pretrained(str(tiny_llama))  # another reason: told too
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    assert next(model.parameters()).device.type == "cpu"
    reasons = [f["reason"] for f in loading.fallbacks()]
    assert len(reasons) == 2 and "default device is meta" in reasons[0], reasons
    assert "init_empty_weights" in reasons[1] and "register_parameter" in reasons[1], reasons
    after = loading.calls()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in ("miss", "plain", "hit")} == {"miss": 1, "plain": 2,
                                                                                       "hit": 1}


def test_a_load_after_torch_compile_is_cached(tiny_llama: Path, overmind_home: Path) -> None:
    """torch.compile's dynamo replaces `nn.Module.__init__`, where the check of Note [Meta loads] learned
    which file torch's own methods come from: after any compile in the process, every load ran plainly
    with a wrong reason ("register_parameter is replaced ... init_empty_weights")."""
    got = last_json(run_py(f"""
        import json, torch
        torch.compile(torch.nn.Linear(4, 4), backend="eager")(torch.ones(1, 4))
        import overmind_jupyter
        from overmind_jupyter import loading
        from transformers import AutoModelForCausalLM
        overmind_jupyter.enable()
        for _ in range(2):
            AutoModelForCausalLM.from_pretrained({str(tiny_llama)!r})
        print(json.dumps({{"calls": loading.calls(), "fallbacks": [f["reason"] for f in loading.fallbacks()]}}))
    """))
    assert got == {"calls": {"miss": 1, "hit": 1}, "fallbacks": []}, got


@pytest.mark.gpu
def test_a_cuda_device_map_lands_on_the_gpu(gpu_copier, shell, tiny_llama: Path, overmind_home: Path) -> None:
    """The miss and then the hit, each filled on the device through the copier (`gpu_copier`)."""
    from transformers import AutoModelForCausalLM

    shell.run_line_magic("overmind", "on")
    plain = AutoModelForCausalLM.__dict__  # noqa: F841 (keeps the import obvious)
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map="cuda:0")
        assert all(p.device == torch.device("cuda", 0) for p in model.parameters())


def test_units_magic_shows_simulated_devices(overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "2x4")  # read by the daemon this test starts
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "overmind_jupyter")
    try:
        ip.run_line_magic("overmind", "on")
        state = magic_json(ip, "units")
        assert [d["capacity"] for d in state["devices"]] == [3, 3] and state["simulated"]
        cli = subprocess.run([sys.executable, "-m", "kernel_server", "status"], capture_output=True, text=True,
                             check=True)
        assert "(simulated): 0/3 used" in cli.stdout
    finally:
        ip.run_line_magic("unload_ext", "overmind_jupyter")


def test_preload_warms_the_cache_from_a_worker(overmind_home: Path, tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    import overmind_jupyter

    handle = overmind_jupyter.preload(AutoModelForCausalLM, str(tiny_llama), dtype=torch.float32)
    handle.wait(120)
    from overmind_jupyter import loading

    model = loading.cached(AutoModelForCausalLM.from_pretrained, str(tiny_llama), dtype=torch.float32)
    status = overmind_jupyter.status()["daemon"]
    assert status["stats"]["hits"] == 1 and status["stats"]["misses"] == 1, "the worker loaded, we hit"
    from overmind_jupyter import rebuild

    assert rebuild.entry_of(next(model.parameters()).data_ptr()) is not None


def test_config_overrides_the_environment_which_gives_the_defaults(overmind_home: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from traitlets.config import Config

    from overmind_jupyter.config import Overmind

    monkeypatch.setenv("OVERMIND_ENABLED", "0")
    monkeypatch.setenv("OVERMIND_WAIT_TIMEOUT", "7")
    assert not Overmind().enabled and Overmind().wait_timeout == 7.0
    cfg = Config()
    cfg.Overmind.enabled = True
    cfg.Overmind.wait_timeout = 5.0
    assert Overmind(config=cfg).enabled and Overmind(config=cfg).wait_timeout == 5.0


def test_kernel_restart_gives_a_hit_with_equal_outputs(overmind_home: Path, tiny_llama: Path) -> None:
    from jupyter_client.manager import start_new_kernel

    cell = f"""
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tiny_llama)!r}, dtype=torch.float32)
with torch.no_grad():
    out = model(torch.arange(10)[None]).logits.double().sum().item()
import overmind_jupyter
print(repr(out), overmind_jupyter.status()["daemon"]["stats"].get("hits", 0), len(overmind_jupyter.loading.fallbacks()))
"""
    km, kc = start_new_kernel(kernel_name="python3", env=dict(os.environ))
    try:
        outputs = []
        for attempt in range(2):
            if attempt:
                km.restart_kernel(now=True)
                kc.wait_for_ready(timeout=60)
            run(kc, "%load_ext overmind_jupyter\n%overmind on")
            outputs.append(run(kc, cell).split())
        (first, hits_before, fb1), (second, hits_after, fb2) = outputs
        assert first == second, "the restarted kernel computes the same logits"
        assert int(hits_after) == int(hits_before) + 1 and fb1 == fb2 == "0"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run(kc, code: str) -> str:  # type: ignore[no-untyped-def]
    """Execute `code` in the kernel; return its stdout, raise on error."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out)
