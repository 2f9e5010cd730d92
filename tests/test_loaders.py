"""Ways notebooks load models that the libraries' own test suites showed going the plain way, or showing
less on a hit than the plain load does (issue 24): each in fresh processes, as a kernel and the kernel
after a restart."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from overmind_jupyter import demo_models
from tests.helpers.snippets import last_json, run_py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loaders")
    llama = demo_models.build_llama(root / "llama", "tiny")
    adapters = demo_models.build_lora_adapters(llama, root / "lora", ("fr", "de"))
    # an adapter saved by a newer PEFT: its config has a key this PEFT lacks, which every PEFT warns about
    newer = root / "lora" / "newer"
    shutil.copytree(adapters["fr"], newer)
    config = json.loads((newer / "adapter_config.json").read_text())
    (newer / "adapter_config.json").write_text(json.dumps(dict(config, a_newer_peft_option=True)))
    return {"llama": str(llama), "fr": str(adapters["fr"]), "de": str(adapters["de"]), "newer": str(newer)}


def twice(code: str, checkpoints: dict[str, str]) -> tuple[dict, dict, str, str]:
    """`code` in a kernel, then in the kernel after a restart: their last JSON lines and their stderr.
    transformers logs warnings, as it does for a user (the suite quiets it to errors)."""
    env = dict(os.environ, PATHS=json.dumps(checkpoints), TRANSFORMERS_VERBOSITY="warning")
    first, second = run_py(code, env=env, timeout=300), run_py(code, env=env, timeout=300)
    return last_json(first), last_json(second), first.stderr, second.stderr


PREAMBLE = """
    import json, os, torch
    import overmind_jupyter
    from overmind_jupyter import loading
    paths = json.loads(os.environ["PATHS"])
    torch.manual_seed(0)  # PEFT's loads draw random numbers: a seeded notebook hits after a restart
    overmind_jupyter.enable()
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from peft import PeftConfig, PeftMixedModel, PeftModel
"""


def test_peft_from_pretrained_with_its_config_given_is_cached(overmind_home: Path, checkpoints: dict) -> None:
    """PEFT keeps `target_modules` as a set and its LoraConfig holds a LoraRuntimeConfig dataclass: both
    are keyed by value now (they were "no canonical form", 217 fallbacks in PEFT's suite)."""
    miss, hit, _, _ = twice(PREAMBLE + """
    base = AutoModelForCausalLM.from_pretrained(paths["llama"])
    config = PeftConfig.from_pretrained(paths["fr"])
    model = PeftModel.from_pretrained(base, paths["fr"], config=config)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        out = model(ids).logits.double().sum().item()
    print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks(), "out": out,
                      "set": isinstance(config.target_modules, set)}))
    """, checkpoints)
    assert miss["set"] and not miss["fallbacks"] and not hit["fallbacks"]
    assert miss["calls"].get("miss") == 2 and hit["calls"].get("hit") == 2, (miss["calls"], hit["calls"])
    assert hit["out"] == miss["out"]


def test_a_hit_replayed_onto_a_model_keeps_its_parameters_and_what_holds_them(overmind_home: Path,
                                                                              checkpoints: dict) -> None:
    """Note [Argument replay]: a hit replayed onto the caller's model keeps every parameter object, as
    the plain call does. The base's gradients survive PeftModel.from_pretrained, and an optimizer built
    before `load_adapter` (TRL's layout: the adapter loaded twice) still trains the model after it. When
    the parameters were made anew, the hit kept none of them and trained nothing, silently."""
    miss, hit, _, _ = twice(PREAMBLE + """
    base = AutoModelForCausalLM.from_pretrained(paths["llama"])
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    base(ids, labels=ids).loss.backward()
    grads = {id(p): (p, p.grad) for p in base.parameters()}
    model = PeftModel.from_pretrained(base, paths["fr"], adapter_name="trn", is_trainable=True)
    now = {id(p) for p in model.parameters()}
    kept_base = sum(i in now and p.grad is g for i, (p, g) in grads.items())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    trained = {id(p): p for p in model.parameters()}
    model.load_adapter(paths["fr"], adapter_name="reference")
    model.set_adapter("trn")
    kept = len(trained.keys() & {id(p) for p in model.parameters()})
    model.train()
    losses = []
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks(), "losses": losses,
                      "kept_base": [kept_base, len(grads)], "kept": [kept, len(trained)]}))
    """, checkpoints)
    assert not miss["fallbacks"] and not hit["fallbacks"]
    assert miss["calls"] == {"miss": 3} and hit["calls"] == {"hit": 3}, (miss["calls"], hit["calls"])
    for run in (miss, hit):
        assert run["kept_base"][0] == run["kept_base"][1], "base parameters or their gradients were replaced"
        assert run["kept"][0] == run["kept"][1], "parameters the optimizer holds were replaced"
        assert run["losses"][0] > run["losses"][1] > run["losses"][2], "the optimizer trained nothing"
    assert hit["losses"] == pytest.approx(miss["losses"], rel=1e-5)


def test_peft_mixed_model_load_adapter_runs_as_it_is_without_a_fallback(overmind_home: Path,
                                                                        checkpoints: dict) -> None:
    """PeftMixedModel.load_adapter calls the patched PeftModel.load_adapter unbound, on a PeftMixedModel
    (no target of ours): that runs as the library wrote it, and reports no fallback (was one per call)."""
    out, _, _, _ = twice(PREAMBLE + """
    base = AutoModelForCausalLM.from_pretrained(paths["llama"])
    mixed = PeftMixedModel.from_pretrained(base, paths["fr"], adapter_name="fr")
    mixed.load_adapter(paths["de"], adapter_name="de")
    print(json.dumps({"fallbacks": loading.fallbacks(), "adapters": sorted(mixed.peft_config)}))
    """, checkpoints)
    assert out["fallbacks"] == [] and out["adapters"] == ["de", "fr"]


def test_an_adapter_loaded_through_an_open_gate_says_to_load_it_before_or_close_the_gate(
        overmind_home: Path, checkpoints: dict) -> None:
    """The gate's hooks change the model while it is open, so its load_adapter cannot be keyed: it runs
    plainly, and says why and what to do, not that the user changed the model. Done as it says (the adapter
    loaded before the gate is opened), it is cached."""
    env = dict(os.environ, PATHS=json.dumps(checkpoints))
    out = last_json(run_py(PREAMBLE + """
    from overmind_jupyter import adapters
    base = AutoModelForCausalLM.from_pretrained(paths["llama"])
    model = PeftModel.from_pretrained(base, paths["fr"], adapter_name="fr")
    gate = adapters.gate(model)
    gate.load_adapter(paths["de"], adapter_name="de")
    said = [f["reason"] for f in loading.fallbacks()]
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["llama"]), paths["fr"],
                                      adapter_name="fr")
    again.load_adapter(paths["de"], adapter_name="de")
    adapters.gate(again)
    print(json.dumps({"said": said, "calls": loading.calls(), "adapters": sorted(again.peft_config)}))
    """, env=env, timeout=300))
    [reason] = out["said"]
    assert "has an adapter gate open on it" in reason and "adapters.gate(model)" in reason, reason
    assert out["calls"] == {"miss": 3, "hit": 2, "plain": 1} and out["adapters"] == ["de", "fr"], out


def test_components_given_to_a_load_are_the_callers_own_objects_after_a_hit(overmind_home: Path,
                                                                             tmp_path: Path) -> None:
    """A scheduler and a feature extractor given to a pipeline, an image processor given to a processor: the
    result holds the caller's objects, and the pipeline's reset of an old scheduler's `steps_offset` is made
    on the caller's scheduler, in the kernel that missed and after a restart alike. Before, a hit held the
    entry's copies, and a change made to them after the load did not reach its outputs."""
    sd = demo_models.build_sd_pipeline(tmp_path / "sd")
    code = f"""
        import json, torch
        import overmind_jupyter
        from overmind_jupyter import loading
        overmind_jupyter.enable()
        from diffusers import DDIMScheduler, StableDiffusionPipeline
        from transformers import CLIPImageProcessor, CLIPProcessor
        scheduler = DDIMScheduler.from_pretrained({str(sd)!r}, subfolder="scheduler")
        scheduler.register_to_config(steps_offset=0)  # an old config, which the pipeline resets
        extractor = CLIPImageProcessor(size={{"shortest_edge": 16}})
        pipe = StableDiffusionPipeline.from_pretrained({str(sd)!r}, scheduler=scheduler, feature_extractor=extractor)
        images = CLIPImageProcessor(size={{"shortest_edge": 8}}, crop_size=8)
        processor = CLIPProcessor.from_pretrained({str(sd / "tokenizer")!r}, image_processor=images)
        print(json.dumps({{"calls": loading.calls(), "scheduler": pipe.scheduler is scheduler,
                          "steps_offset": scheduler.config.steps_offset,
                          "extractor": pipe.feature_extractor is extractor,
                          "images": processor.image_processor is images}}))
    """
    miss, hit = (last_json(run_py(code, timeout=300)) for _ in range(2))
    assert hit["calls"].get("hit") == miss["calls"].get("miss") and not hit["calls"].get("fallback"), (miss, hit)
    for out in (miss, hit):
        assert out["scheduler"] and out["steps_offset"] == 1 and out["extractor"] and out["images"], out


def test_a_hit_logs_the_load_report_the_plain_load_logs(overmind_home: Path, checkpoints: dict) -> None:
    """A classification head on a causal-LM checkpoint: transformers logs which weights were newly
    initialized. The hit after a restart logs the same report (Note [What the load said] in load_log.py)."""
    miss, hit, miss_err, hit_err = twice(PREAMBLE + """
    model = AutoModelForSequenceClassification.from_pretrained(paths["llama"], num_labels=3)
    print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks(),
                      "head": model.score.weight.sum().item()}))
    """, checkpoints)
    assert miss["calls"].get("miss") == 1 and hit["calls"].get("hit") == 1, (miss["calls"], hit["calls"])
    assert hit["head"] == miss["head"]
    report = [line for line in miss_err.splitlines() if "score.weight" in line]
    assert "LOAD REPORT" in miss_err and report, miss_err[-2000:]
    assert "LOAD REPORT" in hit_err and all(line in hit_err for line in report), hit_err[-2000:]


def test_a_miss_in_a_quiet_kernel_keeps_what_a_kernel_at_the_defaults_is_shown(overmind_home: Path,
                                                                            checkpoints: dict) -> None:
    """Note [A quiet kernel's miss]: a kernel that silenced transformers (TRANSFORMERS_VERBOSITY=error) and
    Python's warnings (-W ignore) misses, and shows nothing, as its plain load does; the hit in a kernel at
    the defaults then shows the load report and PEFT's warning about an adapter a newer PEFT saved, as its
    plain load does. Before, the miss kept only what the quiet kernel was shown, and the hits said nothing."""
    code = PREAMBLE + """
    model = AutoModelForSequenceClassification.from_pretrained(paths["llama"], num_labels=3)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["llama"], dtype=torch.bfloat16),
                                      paths["newer"])
    print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks()}))
    """
    env = dict(os.environ, PATHS=json.dumps(checkpoints))
    quiet = run_py(code, env=dict(env, TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore"), timeout=300)
    default = run_py(code, env=dict(env, TRANSFORMERS_VERBOSITY="warning"), timeout=300)
    assert last_json(quiet)["calls"] == {"miss": 3} and last_json(default)["calls"] == {"hit": 3}
    assert "LOAD REPORT" not in quiet.stderr and "Warning" not in quiet.stderr, quiet.stderr[-2000:]
    assert "LOAD REPORT" in default.stderr and "score.weight" in default.stderr, default.stderr[-2000:]
    assert "UserWarning: Unexpected keyword arguments" in default.stderr, default.stderr[-2000:]


def test_a_followed_miss_keeps_the_load_report_for_its_hits(overmind_home: Path, checkpoints: dict) -> None:
    """A head drawn at random under two seeds: the second seed's miss is followed (Note [Replayed draws] in
    draws.py) and goes under the key of the result without the draws; its hits, in the kernel and after a
    restart, log the report that says the head is new, as plain does."""
    env = dict(os.environ, PATHS=json.dumps(checkpoints), TRANSFORMERS_VERBOSITY="warning")
    code = PREAMBLE + """
    torch.manual_seed(int(os.environ["SEED"]))
    model = AutoModelForSequenceClassification.from_pretrained(paths["llama"], num_labels=3)
    print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks()}))
    """
    runs = [run_py(code, env=dict(env, SEED=seed), timeout=300) for seed in ("11", "22", "22")]
    assert [last_json(r)["calls"] for r in runs] == [{"miss": 1}, {"miss": 1}, {"hit": 1}]
    for run in runs:
        assert "LOAD REPORT" in run.stderr and "score.weight" in run.stderr, run.stderr[-2000:]


def test_a_hit_in_a_fresh_process_returns_hidden_states_and_attentions(overmind_home: Path, checkpoints: dict) -> None:
    """Note [What a plain pickle loses] in rebuild.py: the hit's model records what its forward can
    record, in a process that never built one of its class."""
    miss, hit, _, _ = twice(PREAMBLE + """
    model = AutoModelForCausalLM.from_pretrained(paths["llama"], attn_implementation="eager")
    out = model(torch.arange(6)[None], output_hidden_states=True, output_attentions=True)
    print(json.dumps({"calls": loading.calls(), "hidden": len(out.hidden_states or ()),
                      "attentions": len(out.attentions or ()), "layers": model.config.num_hidden_layers}))
    """, checkpoints)
    assert (miss["calls"], hit["calls"]) == ({"miss": 1}, {"hit": 1})
    assert miss["hidden"] == hit["hidden"] == miss["layers"] + 1, (miss, hit)
    assert miss["attentions"] == hit["attentions"] == miss["layers"], (miss, hit)


def test_a_hit_warns_what_the_plain_load_warns(overmind_home: Path, checkpoints: dict) -> None:
    """Note [What the load said]: the Python warnings a load shows (PEFT warns of a key in an adapter's
    config that a newer PEFT wrote) are shown by the hit after a restart too, from the same place, and a
    function of the user's warns again likewise; a second hit in the same kernel warns no more, as a
    second plain load does not (the place's registry). The cache's own notices are not said again.
    Before, a hit showed none of them."""
    miss, hit, miss_err, hit_err = twice(PREAMBLE + """
    import warnings

    def load(path):
        warnings.warn("load() is deprecated; use load_v2()", DeprecationWarning, stacklevel=1)
        # a load the cache cannot reproduce: its notice is the cache's, not the load's, and not said again
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_buffers=True)

    warnings.simplefilter("default")  # as a notebook shows DeprecationWarnings of its own code
    for _ in range(2):
        base = AutoModelForCausalLM.from_pretrained(paths["llama"], dtype=torch.bfloat16)
        model = PeftModel.from_pretrained(base, paths["newer"])
        mine = loading.cached(load, paths["llama"])
    print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks()}))
    """, checkpoints)
    assert miss["calls"]["miss"] == 3 and hit["calls"] == {"hit": 6}, (miss["calls"], hit["calls"])

    def warned(err: str) -> list[str]:
        return [line for line in err.splitlines() if "Warning: " in line and "overmind" not in line]

    assert any("Unexpected keyword arguments" in line for line in warned(miss_err)), miss_err[-3000:]
    assert any("load() is deprecated" in line for line in warned(miss_err)), miss_err[-3000:]
    assert warned(hit_err) == warned(miss_err), hit_err[-3000:]
    assert sum("load() is deprecated" in line for line in warned(hit_err)) == 1, "once per place, as plain warns"
    assert "offload_buffers" in miss_err and "offload_buffers" not in hit_err, hit_err[-3000:]


def test_what_the_library_says_once_per_process_a_hit_says_once_per_process_too(
        overmind_home: Path, tmp_path: Path) -> None:
    """transformers says some messages once per process (`warning_once`): a GPT-2 whose special tokens lie
    outside its vocabulary. Two checkpoints that say the same, loaded A, A, B in one process and B, B in a
    fresh one, must say it where the plain loads say it: first in each process, never again. Before, every
    hit said it again, and B's miss, made where it was said already, kept nothing for B's hits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=512, n_positions=32)
    for name in "ab":
        GPT2LMHeadModel(config).save_pretrained(tmp_path / name)
    def said(names: str, how: str) -> list[str]:
        err = run_py(f"""
            import sys
            if {how == "cache"}:
                import overmind_jupyter
                overmind_jupyter.enable()
            from transformers import GPT2LMHeadModel
            for name in {names!r}:
                print(f"-- {{name}}", file=sys.stderr, flush=True)
                GPT2LMHeadModel.from_pretrained({str(tmp_path)!r} + "/" + name)
            """, env=dict(os.environ, TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="warning")).stderr
        return [line for line in err.splitlines() if line.startswith("-- ") or "bos_token_id" in line]

    plain = said("aab", "plain") + said("bb", "plain")
    assert plain.count("-- a") == 2 and sum("bos_token_id" in line for line in plain) == 2, plain
    assert said("aab", "cache") + said("bb", "cache") == plain  # a miss, a hit, a miss; then two hits


def test_an_entry_whose_checkpoint_is_deleted_is_dropped(overmind_home: Path, tmp_path: Path) -> None:
    """Its key can never be reached again (a checkpoint written anew has another key): the daemon drops
    it within seconds (Note [Orphaned entries]), not when the budget would evict it; an entry whose
    checkpoint stays, stays."""
    import shutil

    from kernel_server import Client
    from tests.helpers.faults_helpers import wait_until

    kept = demo_models.build_llama(tmp_path / "kept", "tiny")
    deleted = demo_models.build_llama(tmp_path / "gone", "tiny")
    run_py(f"""
        import overmind_jupyter
        overmind_jupyter.enable()
        from transformers import AutoModelForCausalLM
        for path in ({str(kept)!r}, {str(deleted)!r}):
            AutoModelForCausalLM.from_pretrained(path)
    """)
    with Client(overmind_home, spawn=False, role="test") as client:
        def sources() -> list[str]:
            return sorted(e["meta"]["source"] for e in client.request("status")["entries"])

        assert sources() == sorted([repr(str(kept)), repr(str(deleted))])
        # Copied into the daemon's own arenas first: the entries no longer need their files, and a copy
        # finishing after the deletion would drop the entry as stale (its file's ctime moved), not as
        # an orphan.
        wait_until(lambda: client.request("status")["stats"].get("compacted", 0) == 2, 30, "both entries compacted")
        shutil.rmtree(deleted)
        wait_until(lambda: sources() == [repr(str(kept))], 15, "the entry of the deleted checkpoint dropped")
        assert client.request("status")["stats"]["orphaned"] == 1


def test_a_config_through_cached_is_a_miss_then_a_hit(overmind_home: Path, checkpoints: dict) -> None:
    """A transformers config has no hash (it defines __eq__): `cached(AutoConfig.from_pretrained, ...)`
    is still a miss, then a hit equal to the plain load, not a TypeError after the load."""
    out = last_json(run_py("""
        import json, os
        from overmind_jupyter import loading
        from transformers import AutoConfig
        path = json.loads(os.environ["PATHS"])["llama"]
        got = [loading.cached(AutoConfig.from_pretrained, path) for _ in range(2)]
        print(json.dumps({"calls": loading.calls(), "fallbacks": loading.fallbacks(),
                          "equal": [g.to_dict() == AutoConfig.from_pretrained(path).to_dict() for g in got]}))
    """, env=dict(os.environ, PATHS=json.dumps(checkpoints))))
    assert out["calls"] == {"miss": 1, "hit": 1} and not out["fallbacks"] and out["equal"] == [True, True], out


def across_two_loads(first: Callable[[], Callable[[], None]]) -> tuple[list[str], list[str]]:
    """Run `first` inside a load and what it returns once that load ended, then warn inside a second load
    and after it: what Python's showwarning showed, and what the second load kept for its hits."""
    import warnings

    from overmind_jupyter.load_log import load_log

    original = warnings.showwarning
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            with load_log():
                after = first()
            after()
            with load_log() as said:
                warnings.warn("in the next load", UserWarning, stacklevel=1)
            warnings.warn("after it", UserWarning, stacklevel=1)
    finally:
        warnings.showwarning = original
    return [str(w.message) for w in shown], [w[2] for w in said.warned]


def test_a_catch_warnings_block_across_a_loads_end_leaves_warnings_working(overmind_home: Path) -> None:
    """Note [Stand-ins left behind] in load_log.py: a `catch_warnings()` of another thread that starts
    during a load and ends after it puts the load's stand-in of `showwarning` back for good; the next
    load took it for the original, and every warning of the process raised RecursionError."""
    import warnings

    def first() -> Callable[[], None]:
        block = warnings.catch_warnings()  # (as another thread's: the module's state is shared)
        block.__enter__()
        return lambda: block.__exit__(None, None, None)

    assert across_two_loads(first) == (["in the next load", "after it"], ["in the next load"])


def test_a_users_showwarning_hook_set_during_a_load_keeps_warnings_working(overmind_home: Path) -> None:
    """Note [Stand-ins left behind]: a hook set during a load wraps the stand-in (`old = showwarning`); the
    next load stands in for the hook, which calls the stand-in back. Every warning raised RecursionError
    from then on; now the hook sees each warning once and it is shown once, as without the cache."""
    import warnings

    seen: list[str] = []

    def first() -> Callable[[], None]:
        old = warnings.showwarning

        def hook(message: Warning | str, *args: object, **kwargs: object) -> None:
            seen.append(str(message))
            old(message, *args, **kwargs)  # type: ignore[arg-type]

        warnings.showwarning = hook
        return lambda: None

    assert across_two_loads(first) == (["in the next load", "after it"], ["in the next load"])
    assert seen == ["in the next load", "after it"], seen


@dataclasses.dataclass
class Held:
    """An object of the user's that holds a model and the path it came from."""

    model: object
    path: str


def _held(path: str) -> Held:
    from transformers import AutoModelForCausalLM

    return Held(AutoModelForCausalLM.from_pretrained(path), path)


def test_a_hit_names_the_checkpoint_as_its_own_call_spells_it(overmind_home: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Spellings] in spellings.py: one checkpoint spelled from the project's folder, then from a
    notebook's folder and by its absolute path. Each hit names it as the plain load with that spelling
    does: the model, its config, the tokenizer and its files, a base given to PEFT, the load report; so
    `AutoTokenizer.from_pretrained(model.name_or_path)` finds it from that folder."""
    import logging

    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from overmind_jupyter import loading

    root = tmp_path / "project"
    (root / "notebooks").mkdir(parents=True)
    monkeypatch.chdir(root)
    llama = demo_models.build_tokenizer(demo_models.build_llama(root / "models" / "llama", "tiny"))
    # saved as from the project's folder: its adapter_config.json names the base "models/llama", which a
    # hit spelled otherwise keeps, as plainly
    demo_models.build_lora_adapters("models/llama", root / "models" / "lora", ("fr",))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()

    def names(load: Callable[..., object], spelled: str) -> dict[str, object]:
        torch.manual_seed(0)  # the classifier's head and PEFT's layers are drawn
        base, tokenizer = load(AutoModelForCausalLM.from_pretrained, spelled), load(AutoTokenizer.from_pretrained,
                                                                                     spelled)
        peft = load(PeftModel.from_pretrained, base, os.path.join(spelled, "..", "lora", "fr"))
        said.clear()
        load(AutoModelForSequenceClassification.from_pretrained, spelled, num_labels=2)
        held = load(_held, spelled)
        return {"model": (base.name_or_path, base.config._name_or_path),
                "peft base": (peft.base_model.model.name_or_path, peft.peft_config["default"].base_model_name_or_path),
                "held": (held.model.name_or_path, held.path),
                "tokenizer": (tokenizer.name_or_path, {k: v for k, v in tokenizer.init_kwargs.items()
                                                       if isinstance(v, str)}),
                "report": [line for line in said if "LOAD REPORT" in line]}

    def calls() -> tuple[int, int]:  # this process's, since its first test
        return loading.calls().get("miss", 0), loading.calls().get("hit", 0)

    before = calls()
    try:
        names(loading.cached, "models/llama")
        assert calls() == (before[0] + 5, before[1]), (before, calls())
        for cwd, spelled in ((root / "notebooks", "../models/llama/"), (root / "notebooks", str(llama))):
            monkeypatch.chdir(cwd)
            hit, plain = names(loading.cached, spelled), names(lambda fn, *args, **kwargs: fn(*args, **kwargs),
                                                              spelled)
            assert hit == plain, (hit, plain)
            assert spelled in hit["report"][0]
            assert AutoTokenizer.from_pretrained(hit["model"][0]).name_or_path == spelled
        assert calls() == (before[0] + 5, before[1] + 10), (before, calls())
    finally:
        transformers.logging.set_verbosity(verbosity)
        logging.getLogger("transformers").removeHandler(handler)


def test_a_bare_spelling_is_respelled_only_where_a_path_is_held() -> None:
    """Note [Spellings]: a checkpoint spelled "llama" or "." (a folder in the working directory, or that
    folder) is also a word a model may hold (a label of `id2label`); only a path's attribute or key, and
    paths under it, take the hit's spelling."""
    from transformers import LlamaConfig

    from overmind_jupyter import spellings

    for bare in ("llama", "."):
        config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=1,
                             num_hidden_layers=1, name_or_path=bare, id2label={0: "O", 1: bare})
        word = config._name_or_path
        config.family = word  # the same string object, not a path's place
        model = {"config": config, "files": [os.path.join(word, "tokenizer.json")], "llama": word,
                 "tokenizer_file": os.path.join(word, "tokenizer.json"), "kept": (word,)}
        how = spellings.found({"": {"/real": bare}}, {"": {"/real": "../models/llama"}}, [])
        assert how is not None
        spellings.respell(model, [], how)
        assert (config._name_or_path, config.family, config.id2label[1]) == ("../models/llama", bare, bare)
        assert model["tokenizer_file"] == os.path.join("../models/llama", "tokenizer.json")
        assert (model["files"], model["llama"], model["kept"]) == ([os.path.join(bare, "tokenizer.json")], bare,
                                                                    (bare,))


def test_a_checkpoint_spelled_with_a_tilde_loads_as_the_plain_load_does(overmind_home: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers does not expand "~" (it takes "~/llama" for a hub id, and fails): neither does the key,
    so a cached folder does not answer a call the plain load fails."""
    from transformers import AutoModelForCausalLM

    from overmind_jupyter import loading
    from overmind_jupyter.errors import FallbackWarning

    llama = demo_models.build_llama(tmp_path / "llama", "tiny")
    monkeypatch.setenv("HOME", str(tmp_path))
    loading.cached(AutoModelForCausalLM.from_pretrained, str(llama))  # the folder's entry
    with pytest.raises(OSError) as plain:
        AutoModelForCausalLM.from_pretrained("~/llama")
    with pytest.warns(FallbackWarning, match="neither a local path nor a hub id"), pytest.raises(type(plain.value)):
        loading.cached(AutoModelForCausalLM.from_pretrained, "~/llama")
