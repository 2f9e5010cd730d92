"""Never stale, by construction (Note [Never stale] in overmind_jupyter/keys.py): a key sees every change
a load would see. Each case rewrites a real checkpoint the way people do (`cp -p`, `rsync -t`, `tar x`,
a restore from backup, a retargeted HF-cache link) and checks the cached load against a plain load of
the files as they are now.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_server import Client
from overmind_jupyter import demo_models, loading
from tests.helpers import tiny_modules
from tests.helpers.faults_helpers import wait_until
from tests.helpers.snippets import last_json, run_py

IDS = torch.arange(10)[None]


def outputs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def plain_and_cached(path: Path | str, **kwargs: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    kwargs.setdefault("dtype", torch.bfloat16)
    plain = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    cached = loading.cached(AutoModelForCausalLM.from_pretrained, str(path), **kwargs)
    return plain, cached


def assert_like_plain(path: Path | str, **kwargs: object) -> None:
    plain, cached = plain_and_cached(path, **kwargs)
    assert torch.equal(outputs(cached), outputs(plain)), "the cached load differs from a plain load of the files now"
    assert cached.config.to_dict() == plain.config.to_dict()


def settled(home: Path) -> None:
    """Wait until the daemon copied every entry out of its checkpoint files: from then on only the key
    can tell a changed file from the old one."""
    with Client(home, role="test") as client:
        wait_until(lambda: all(e["pending"] is None for e in client.request("ls")["entries"]), 60, "compacted")


def rewrite_keeping_times(file: Path, data: bytes) -> None:
    """Rewrite `file` in place (same inode) and put its atime and mtime back, as `cp -p` or `rsync -t` do."""
    st = file.stat()
    with open(file, "r+b") as f:
        f.write(data)
        f.truncate()
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


def replace_keeping_times(file: Path, data: bytes) -> None:
    """Replace `file` by a new one (another inode) with the same size and mtime, as `tar x` does."""
    st = file.stat()
    tmp = file.with_name(file.name + ".new")
    tmp.write_bytes(data)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, file)


@pytest.fixture
def two(tmp_path: Path) -> tuple[Path, Path]:
    """Two tiny checkpoints of the same shapes (so of the same file sizes) and other weights."""
    return (demo_models.build_llama(tmp_path / "a", "tiny", seed=1),
            demo_models.build_llama(tmp_path / "b", "tiny", seed=2))


# -- 1. files that change and keep their size and mtime ------------------------------------------------

@pytest.mark.parametrize("change", [rewrite_keeping_times, replace_keeping_times],
                         ids=["rewritten in place, mtime restored", "replaced by rename, same size and mtime"])
def test_a_checkpoint_changed_with_its_size_and_mtime_kept(overmind_home: Path, two: tuple[Path, Path],
                                                           change: Callable[[Path, bytes], None]) -> None:
    a, b = two
    assert_like_plain(a)
    settled(overmind_home)
    change(a / "model.safetensors", (b / "model.safetensors").read_bytes())
    assert_like_plain(a)


def test_only_config_json_changed(overmind_home: Path, two: tuple[Path, Path]) -> None:
    a, _ = two
    assert_like_plain(a)
    settled(overmind_home)
    config = a / "config.json"
    text = config.read_text()
    edited = text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-01')
    assert edited != text and len(edited) == len(text)
    rewrite_keeping_times(config, edited.encode())
    assert_like_plain(a)


def test_a_symlinked_checkpoint_pointed_at_another_blob(overmind_home: Path, two: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    """As the HF cache lays a snapshot out: files are links to blobs."""
    a, b = two
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.copy2(a / "model.safetensors", blobs / "one")
    shutil.copy2(b / "model.safetensors", blobs / "two")
    one = (blobs / "one").stat()
    os.utime(blobs / "two", ns=(one.st_atime_ns, one.st_mtime_ns))  # same size, same mtime: only the link moved
    snapshot = tmp_path / "snapshot"
    shutil.copytree(a, snapshot)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to("../blobs/one")
    assert_like_plain(snapshot)
    settled(overmind_home)
    tmp = snapshot / "link.new"
    tmp.symlink_to("../blobs/two")
    os.replace(tmp, snapshot / "model.safetensors")
    assert_like_plain(snapshot)


def test_one_shard_of_a_sharded_checkpoint_replaced(overmind_home: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    paths = []
    for seed in (1, 2):
        built = demo_models.build_llama(tmp_path / f"whole{seed}", "tiny", seed=seed, num_hidden_layers=4)
        model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / f"sharded{seed}", max_shard_size="100KB")
        paths.append(tmp_path / f"sharded{seed}")
    shards = sorted(p.name for p in paths[0].glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert_like_plain(paths[0])
    settled(overmind_home)
    middle = shards[len(shards) // 2]
    rewrite_keeping_times(paths[0] / middle, (paths[1] / middle).read_bytes())
    assert_like_plain(paths[0])


# -- 2. config= ------------------------------------------------------------------------------------------

def test_config_as_a_relative_directory_name_without_a_slash(overmind_home: Path, two: tuple[Path, Path],
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = two
    shutil.copytree(a, tmp_path / "cfgdir", ignore=shutil.ignore_patterns("*.safetensors"))
    monkeypatch.chdir(tmp_path)
    assert_like_plain(a, config="cfgdir")
    config = tmp_path / "cfgdir" / "config.json"
    rewrite_keeping_times(config, config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-01').encode())
    assert_like_plain(a, config="cfgdir")


def test_a_config_object_is_keyed_by_its_whole_state(overmind_home: Path, two: tuple[Path, Path]) -> None:
    """`attn_implementation="eager"` lives in a private field that `to_dict()` drops: the eager config
    must not be served the sdpa model, whose `output_attentions=True` gives no attentions."""
    from transformers import AutoConfig

    a, _ = two
    sdpa = AutoConfig.from_pretrained(a)
    eager = AutoConfig.from_pretrained(a, attn_implementation="eager")
    hits = loading.calls().get("hit", 0)
    plain_and_cached(a, config=sdpa)
    plain, cached = plain_and_cached(a, config=eager)
    assert loading.calls().get("hit", 0) == hits, "two configs, two keys"
    with torch.no_grad():
        got = cached(IDS, output_attentions=True).attentions
        want = plain(IDS, output_attentions=True).attentions
    assert got and len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want, strict=False))


def test_a_scheduler_made_from_a_config_has_one_key_in_every_process() -> None:
    """diffusers lists a config's defaulted fields (`_use_default_values`) from a set, in the order of the
    process's string hashing: a pipeline given a scheduler made by `from_config` was a miss after every
    restart, and each restart stored the whole pipeline once more."""
    code = """
        import json
        from diffusers import DDIMScheduler, EulerDiscreteScheduler
        from overmind_jupyter import keys
        scheduler = EulerDiscreteScheduler.from_config(DDIMScheduler().config)
        print(json.dumps({"order": list(scheduler.config["_use_default_values"]),
                          "key": keys.make_key(lambda scheduler: scheduler, (scheduler,), {}).key}))
    """
    one, two = (last_json(run_py(code)) for _ in range(2))  # (two processes: two hash seeds)
    assert one["order"] != two["order"], "the two processes list the defaulted fields in other orders"
    assert one["key"] == two["key"]


# -- 3. cached(fn): functions by what they do ------------------------------------------------------------

def notebook_function(body: str) -> object:
    """A function defined as a notebook cell defines it: `__main__.load`."""
    namespace: dict[str, object] = {"__name__": "__main__", "tiny_modules": tiny_modules}
    exec(compile(f"def load(width):\n    {body}\n", "<cell>", "exec"), namespace)
    return namespace["load"]


def test_an_edited_notebook_function_is_a_miss(overmind_home: Path) -> None:
    first = notebook_function("return tiny_modules.build('mlp', width=width, seed=1)")
    edited = notebook_function("return tiny_modules.build('mlp', width=width, seed=2)")
    assert first.__qualname__ == edited.__qualname__ == "load" and first.__module__ == "__main__"
    hits = loading.calls().get("hit", 0)
    loading.cached(first, 16)
    got = loading.cached(edited, 16)
    want = tiny_modules.build("mlp", width=16, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(got.state_dict().values(), want.state_dict().values(), strict=False))
    again = loading.cached(first, 16)
    first_want = tiny_modules.build("mlp", width=16, seed=1)
    assert all(torch.equal(x, y)
               for x, y in zip(again.state_dict().values(), first_want.state_dict().values(), strict=True))
    assert loading.calls().get("hit", 0) == hits + 1, "the unchanged function is a hit"


def test_a_notebook_class_edited_under_its_function_is_a_miss(overmind_home: Path) -> None:
    """The function is unchanged; the notebook class it builds was redefined: another key."""
    namespace: dict[str, object] = {"__name__": "__main__", "torch": torch}
    cell = ("class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        torch.manual_seed(0)\n        self.layer = torch.nn.Linear({n}, {n})\n"
            "def load():\n    with torch.random.fork_rng(devices=[]):\n        return Net()\n")
    exec(compile(cell.format(n=3), "<cell>", "exec"), namespace)
    assert loading.cached(namespace["load"]).layer.in_features == 3
    exec(compile(cell.format(n=5), "<cell>", "exec"), namespace)
    assert loading.cached(namespace["load"]).layer.in_features == 5


def test_another_notebooks_function_of_the_same_name(overmind_home: Path) -> None:
    """Two notebooks (processes), each with its own `load`: each gets its own result."""
    env = dict(os.environ)
    code = """
        import json, torch
        from tests.helpers import tiny_modules
        from overmind_jupyter import loading
        SEED = {seed}
        def load():
            return tiny_modules.build("mlp", width=16, seed=SEED)
        m = loading.cached(load)
        print(json.dumps({{"sum": float(sum(p.double().sum() for p in m.parameters())), "calls": loading.calls()}}))
    """
    one = last_json(run_py(code.format(seed=1), env=env))
    two = last_json(run_py(code.format(seed=2), env=env))
    want = float(sum(p.double().sum() for p in tiny_modules.build("mlp", width=16, seed=2).parameters()))
    assert one["calls"] == two["calls"] == {"miss": 1}, "a global the function reads is part of its key"
    assert two["sum"] == want != one["sum"]


def test_a_kernel_with_another_default_dtype_gets_the_weights_its_plain_call_makes(overmind_home: Path) -> None:
    """Note [Torch's default dtype]: after `torch.set_default_dtype(torch.float64)` a cached function that
    builds modules misses the entry made under float32, and its own entry is float64, as the plain call's
    weights are; back under float32, the first entry is a hit again."""
    def dtypes(model: torch.nn.Module) -> set[torch.dtype]:
        return {p.dtype for p in model.parameters()}

    assert dtypes(loading.cached(tiny_modules.build, "mlp", 3, width=8)) == {torch.float32}
    calls = dict(loading.calls())
    torch.set_default_dtype(torch.float64)
    try:
        want = tiny_modules.build("mlp", 3, width=8)
        assert dtypes(want) == {torch.float64}
        for _ in range(2):  # a miss, then a hit of its own entry
            got = loading.cached(tiny_modules.build, "mlp", 3, width=8)
            assert dtypes(got) == {torch.float64}
            assert all(torch.equal(x, y) for x, y in zip(got.state_dict().values(), want.state_dict().values(),
                                                         strict=True))
    finally:
        torch.set_default_dtype(torch.float32)
    assert dtypes(loading.cached(tiny_modules.build, "mlp", 3, width=8)) == {torch.float32}
    assert loading.calls().get("miss", 0) == calls.get("miss", 0) + 1
    assert loading.calls().get("hit", 0) == calls.get("hit", 0) + 2


# -- 3b. what a function reads, and the user's classes (issue 38) --------------------------------------------

# A kernel: loads through the cache (or plainly), and says what it got. {prelude} is the notebook's own code.
KERNEL = """
    import json, os, sys, torch, warnings
    sys.path.insert(0, os.getcwd())  # a module beside the notebook, as a kernel's cwd is on its path
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from overmind_jupyter import loading
{prelude}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = {call}
    print(json.dumps({{"layers": len(m.model.layers), "head": list(m.lm_head.weight.shape),
                       "sum": float(sum(p.double().sum() for p in m.parameters())), "calls": loading.calls(),
                       "warnings": [str(w.message) for w in caught]}}))
"""


def kernel_load(prelude: str, call: str, cwd: Path, **env: str) -> dict:
    code = KERNEL.format(prelude=textwrap.indent(textwrap.dedent(prelude), "    "), call=call)
    return last_json(run_py(code, env=dict(os.environ, **env), cwd=cwd))


def plain_sum(path: Path, **kwargs: object) -> float:
    """KERNEL's "sum" for a plain load of the files at `path` now, loaded here: no process of its own is
    needed for a load the cache takes no part in (the sum of a checkpoint's values is exact in float64)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


PRUNED = """
    class Pruned(LlamaForCausalLM):
        def __init__(self, config):
            config.num_hidden_layers = {layers}
            super().__init__(config)
"""


@pytest.mark.parametrize("where", ["notebook", "module beside it"])
def test_an_edited_model_subclass_is_a_miss(overmind_home: Path, tiny_llama: Path, tmp_path: Path,
                                            where: str) -> None:
    """`class Pruned(LlamaForCausalLM)`, defined in the notebook or in a module beside it, then edited:
    the next kernel gets the edited class's model, not the entry of the old one."""
    call = f"loading.cached(Pruned.from_pretrained, {str(tiny_llama)!r})"

    def load(layers: int) -> dict:
        if where == "notebook":
            return kernel_load(PRUNED.format(layers=layers), call, tmp_path)
        (tmp_path / "pruned_models.py").write_text("from transformers import LlamaForCausalLM\n"
                                                   + textwrap.dedent(PRUNED.format(layers=layers)))
        return kernel_load("from pruned_models import Pruned", call, tmp_path)

    one, two, again = load(1), load(2), load(1)
    assert (one["layers"], two["layers"], again["layers"]) == (1, 2, 1)
    assert (one["calls"], two["calls"], again["calls"]) == ({"miss": 1}, {"miss": 1}, {"hit": 1})


def mlp_of(model: torch.nn.Module) -> tuple[str, object]:
    mlp = model.model.layers[0].mlp
    return type(mlp).__name__, vars(mlp).get("scale")


def test_a_class_swapped_into_a_library_gets_an_entry_of_its_own(overmind_home: Path, tiny_llama: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Classes swapped in a library] in library_classes.py: a kernel that puts its own class in a
    library's module before the load (liger-kernel's way) gets the model its plain load builds, not the entry
    made without the swap, nor the other way round."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    class ScaledMLP(modeling_llama.LlamaMLP):
        def __init__(self, config: object) -> None:
            super().__init__(config)
            self.scale = 3.0

    ScaledMLP.__module__ = "tests.test_never_stale"  # a class of a module, found by its name
    monkeypatch.setattr(sys.modules[__name__], "ScaledMLP", ScaledMLP, raising=False)
    got = []
    for swapped in (False, True, True, False):
        with monkeypatch.context() as patch:
            if swapped:
                patch.setattr(modeling_llama, "LlamaMLP", ScaledMLP)
            before = dict(loading.calls())
            got.append((*mlp_of(loading.cached(LlamaForCausalLM.from_pretrained, str(tiny_llama))),
                        "hit" if loading.calls().get("hit", 0) > before.get("hit", 0) else "miss"))
    assert got == [("LlamaMLP", None, "miss"), ("ScaledMLP", 3.0, "miss"), ("ScaledMLP", 3.0, "hit"),
                   ("LlamaMLP", None, "hit")]


# A kernel that may patch a library's method before the load (Note [Methods patched into a library's
# classes] in keys.py): what the cached load gives, and what the plain load gives in the same process.
PATCHING_KERNEL = """
    import functools, json, torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification
    from transformers.models.llama import modeling_llama
    from overmind_jupyter import loading
{patch}
    def seen(m):
        return {{"sum": float(sum(t.double().sum() for t in m.state_dict().values())),
                 "eps": m.model.norm.variance_epsilon,
                 "tags": sorted({{str(getattr(x, "tag", None)) for x in m.modules()}})}}

    torch.manual_seed(0)
    cached = seen(loading.cached({load}))
    torch.manual_seed(0)
    plain = seen(_plain({load}))
    print(json.dumps({{"calls": loading.calls(), "cached": cached, "plain": plain}}))
"""

PATCHES = {
    # an `__init__` that sets another eps on every RMSNorm (the hunt's first case)
    "RMSNorm.__init__": ("LlamaForCausalLM.from_pretrained, {path!r}", """
        _init = modeling_llama.LlamaRMSNorm.__init__
        modeling_llama.LlamaRMSNorm.__init__ = lambda self, *a, **k: (_init(self, *a, **k),
                                                                      setattr(self, "variance_epsilon", 0.5))[0]
    """),
    # `_init_weights` filling the head the checkpoint lacks otherwise (the hunt's second case)
    "_init_weights": ("LlamaForSequenceClassification.from_pretrained, {path!r}, num_labels=3", """
        _init_weights = modeling_llama.LlamaPreTrainedModel._init_weights
        def init_weights(self, module):
            _init_weights(self, module)
            if isinstance(module, torch.nn.Linear) and module.out_features == 3:
                with torch.no_grad():
                    module.weight.fill_(0.5)
        modeling_llama.LlamaPreTrainedModel._init_weights = init_weights
    """),
    # torch.nn's own class, patched with `functools.wraps` (which copies the name and module of the original)
    "wraps nn.Linear.__init__": ("LlamaForCausalLM.from_pretrained, {path!r}", """
        _linear = torch.nn.Linear.__init__
        @functools.wraps(_linear)
        def linear_init(self, *args, **kwargs):
            _linear(self, *args, **kwargs)
            self.tag = "patched"
        torch.nn.Linear.__init__ = linear_init
    """),
}


@pytest.mark.parametrize("patched", list(PATCHES))
def test_a_method_patched_into_a_library_gets_an_entry_of_its_own(overmind_home: Path, tiny_llama: Path,
                                                                  tmp_path: Path, patched: str) -> None:
    """Note [Methods patched into a library's classes] in library_classes.py: a kernel that replaces a method of a
    library's class before the load gets its plain load's model (a miss), and a kernel without the patch
    then gets its own plain load's model, not the patched one: a miss, then a hit of its own entry; the
    patched kernel hits the entry it made."""
    load, patch = PATCHES[patched]
    load = load.format(path=str(tiny_llama))

    def run(with_patch: bool) -> dict:
        # the plain load in the same process: the call itself (no `%overmind on`, nothing else patched)
        prelude = textwrap.dedent(patch if with_patch else "") + "_plain = lambda f, *a, **k: f(*a, **k)\n"
        code = PATCHING_KERNEL.format(patch=textwrap.indent(prelude, "    "), load=load)
        return last_json(run_py(code, cwd=tmp_path))

    got = [run(with_patch) for with_patch in (True, False, False, True)]
    assert [g["cached"] for g in got] == [g["plain"] for g in got], "a cached load differs from its plain load"
    assert got[0]["plain"] != got[1]["plain"], "the patch changes nothing the test sees"
    assert [g["calls"] for g in got] == [{"miss": 1}, {"miss": 1}, {"hit": 1}, {"hit": 1}]


def test_without_patched_methods_a_module_keeps_the_digest_entries_were_made_with(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Methods patched into a library's classes] in library_classes.py: where no method is patched (the library's
    own decorators, dataclasses' generated methods, `smart_apply` that transformers puts on nn.Module, the
    hub kernels' wrappers are not patches), a module's digest is that of its names alone, as entries made
    before methods were read recorded it, so those still hit; a patch, an edit of it, and its undoing are
    each seen at the next call."""
    import functools
    import hashlib

    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    from overmind_jupyter import library_classes, rebuild

    model = LlamaForCausalLM.from_pretrained(tiny_llama)  # (its weights' initialisation sets smart_apply)
    modules = sorted(rebuild.pack(model).modules)

    def names_alone(name: str) -> str:  # what entries made before methods were read recorded
        top = name.partition(".")[0]
        bound = [(k, v.__module__, v.__qualname__) for k, v in vars(sys.modules[name]).items()
                 if isinstance(v, type) and str(v.__module__).partition(".")[0] != top]
        return hashlib.blake2b(repr(bound).encode(), digest_size=8).hexdigest()

    before = library_classes.bindings(modules)
    assert "transformers.models.llama.modeling_llama" in before and "torch.nn.modules.linear" in before
    assert before == {name: names_alone(name) for name in before}

    def patch(eps: float) -> None:  # the same patch, its constant edited
        space = {"init": modeling_llama.LlamaRMSNorm.__init__, "functools": functools}
        exec(textwrap.dedent(f"""
            @functools.wraps(init)
            def patched(self, *args, **kwargs):
                init(self, *args, **kwargs)
                self.variance_epsilon = {eps}
        """), space)
        monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "__init__", space["patched"])

    name = "transformers.models.llama.modeling_llama"
    patch(0.5)
    one = library_classes.bindings(modules)
    monkeypatch.undo()
    patch(0.25)
    other = library_classes.bindings(modules)
    monkeypatch.undo()
    assert one[name] != before[name] and other[name] not in (one[name], before[name])
    assert library_classes.bindings(modules) == before


REGISTERED = """
from transformers import LlamaConfig, LlamaForCausalLM


class MineConfig(LlamaConfig):
    model_type = "overmind-mine"


class Mine(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.tag = {tag!r}
"""


def test_a_class_registered_with_an_auto_class_is_in_the_key(overmind_home: Path, tiny_llama: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Classes registered with an Auto class] in keys.py: the Auto class builds the class registered
    for the config, and an edited one, as its plain load does."""
    import importlib

    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    monkeypatch.syspath_prepend(str(tmp_path))
    for mapping in (AutoModelForCausalLM._model_mapping, CONFIG_MAPPING):  # (put back as they were)
        monkeypatch.setattr(mapping, "_extra_content", dict(mapping._extra_content))
    got = []
    for tag in ("", "one", "two", ""):
        AutoModelForCausalLM._model_mapping._extra_content.pop(LlamaConfig, None)
        CONFIG_MAPPING._extra_content.pop("overmind-mine", None)
        if tag:
            (tmp_path / "registered.py").write_text(REGISTERED.format(tag=tag))
            module = importlib.reload(sys.modules["registered"]) if "registered" in sys.modules else \
                importlib.import_module("registered")
            AutoConfig.register("overmind-mine", module.MineConfig, exist_ok=True)  # a model type: a string
            AutoModelForCausalLM.register(LlamaConfig, module.Mine, exist_ok=True)
        before = dict(loading.calls())
        model = loading.cached(AutoModelForCausalLM.from_pretrained, str(tiny_llama))
        got.append((type(model).__name__, vars(model).get("tag"),
                    "hit" if loading.calls().get("hit", 0) > before.get("hit", 0) else "miss"))
    monkeypatch.delitem(sys.modules, "registered")
    assert got == [("LlamaForCausalLM", None, "miss"), ("Mine", "one", "miss"), ("Mine", "two", "miss"),
                   ("LlamaForCausalLM", None, "hit")]
    assert loading.fallbacks() == []


def test_the_imports_a_modules_import_may_run_are_followed(tmp_path: Path) -> None:
    """Note [The user's modules a module imports] in user_modules.py: imports under a module-level `try`, `with` or
    `if` are followed, and those of its functions and classes (run when called: the key is the same in a
    process that ran them and in one that did not); those under `if TYPE_CHECKING:` (never run) are not."""
    from overmind_jupyter import user_modules

    file = tmp_path / "blocks.py"
    file.write_text(textwrap.dedent("""
        import warnings
        from typing import TYPE_CHECKING
        from . import sibling
        try:
            import in_try
        except ImportError:
            import in_except
        with warnings.catch_warnings():
            from in_with import Attention
        if warnings:
            import in_if
        else:
            import in_else
        if TYPE_CHECKING:
            import only_for_types
        else:
            import in_the_else_of_type_checking
        if not TYPE_CHECKING:
            import when_not_type_checking

        def later():
            import in_a_function

        class Block:
            def __init__(self):
                from .attention import Attention
                import deep.er.module
    """))
    got = user_modules._imports("pkg.blocks", str(file), (1,))
    assert set(got) == {"warnings", "typing", "typing.TYPE_CHECKING", "pkg", "pkg.sibling", "in_try", "in_except",
                        "in_with", "in_with.Attention", "in_if", "in_else", "in_the_else_of_type_checking",
                        "when_not_type_checking", "in_a_function", "pkg.attention", "pkg.attention.Attention",
                        "deep", "deep.er", "deep.er.module"}, got


# A kernel that loads through the cache and says what it got. {prelude}: the notebook's own code.
LAYERS = """
    import json, os, sys
    sys.path.insert(0, os.getcwd())
    from overmind_jupyter import loading
{prelude}
    m = loading.cached({loader}.from_pretrained, {path!r})
    print(json.dumps({{"layers": len(m.model.layers), "calls": loading.calls()}}))
"""


def test_a_module_edited_two_imports_below_the_models_class_is_a_miss(overmind_home: Path, tiny_llama: Path,
                                                                      tmp_path: Path) -> None:
    """Note [The user's modules a module imports] in user_modules.py: `Deep` (deep_model.py) asks `layers()` of
    deep_layers.py, which reads a constant of deep_constants.py; an edit of that last file alone changes
    the model the load builds."""
    (tmp_path / "deep_model.py").write_text(textwrap.dedent("""
        from transformers import LlamaForCausalLM
        from deep_layers import layers


        class Deep(LlamaForCausalLM):
            def __init__(self, config):
                config.num_hidden_layers = layers()
                super().__init__(config)
    """))
    (tmp_path / "deep_layers.py").write_text("from deep_constants import LAYERS\n\n\ndef layers():\n"
                                             "    return LAYERS\n")
    got = []
    for layers in (1, 2):
        (tmp_path / "deep_constants.py").write_text(f"LAYERS = {layers}\n")
        code = LAYERS.format(prelude="    from deep_model import Deep", loader="Deep", path=str(tiny_llama))
        got.append(last_json(run_py(code, cwd=tmp_path)))
    assert [(g["layers"], g["calls"]) for g in got] == [(1, {"miss": 1}), (2, {"miss": 1})]


def load_run(revision: str | None = "best") -> torch.nn.Module:
    """A function of the user's whose `revision=None` means something else than its default."""
    return tiny_modules.build("mlp", width=8 if revision == "best" else 16)


def test_a_functions_hub_named_argument_given_as_none_is_another_call(overmind_home: Path) -> None:
    """Note [Hub arguments left at their default] in keys.py: only the libraries' loaders key a
    `revision=None` as left out; `load_run(revision=None)` of the user's is not `load_run()`."""
    misses = loading.calls().get("miss", 0)
    widths = [loading.cached(load_run, **kwargs).layers[0].in_features for kwargs in ({}, {"revision": None})]
    assert widths == [8, 16] and loading.calls().get("miss", 0) == misses + 2, (widths, loading.calls())


def test_a_function_is_keyed_by_the_environment_it_reads(overmind_home: Path, tiny_llama: Path,
                                                        tmp_path: Path) -> None:
    """A path taken from os.environ: another value is another model, never the first one's entry."""
    other = demo_models.build_llama(tmp_path / "other", "tiny", seed=1)
    prelude = "def load():\n    return AutoModelForCausalLM.from_pretrained(os.environ['CHECKPOINT'])\n"
    first = kernel_load(prelude, "loading.cached(load)", tmp_path, CHECKPOINT=str(tiny_llama))
    second = kernel_load(prelude, "loading.cached(load)", tmp_path, CHECKPOINT=str(other))
    assert first["calls"] == second["calls"] == {"miss": 1}
    assert second["sum"] == plain_sum(other) != first["sum"]
    # os.getenv and a module imported in the function are read the same way: a hit for the same value
    prelude = ("def load():\n    import os as o\n"
               "    return AutoModelForCausalLM.from_pretrained(o.getenv('CHECKPOINT'))\n")
    assert kernel_load(prelude, "loading.cached(load)", tmp_path, CHECKPOINT=str(other))["calls"] == {"miss": 1}
    assert kernel_load(prelude, "loading.cached(load)", tmp_path, CHECKPOINT=str(other))["calls"] == {"hit": 1}


def test_an_environment_read_that_cannot_be_keyed_loads_plainly_and_says_which(overmind_home: Path,
                                                                              tiny_llama: Path,
                                                                              tmp_path: Path) -> None:
    prelude = ("NAME = 'CHECKPOINT'\n"
               "def load():\n    return AutoModelForCausalLM.from_pretrained(os.environ[NAME])\n")
    got = kernel_load(prelude, "loading.cached(load)", tmp_path, CHECKPOINT=str(tiny_llama))
    assert got["calls"] == {"plain": 1}
    assert any("reads the environment" in w and "os.environ" in w for w in got["warnings"]), got["warnings"]


def test_a_function_is_keyed_by_the_module_attributes_it_reads(overmind_home: Path, tmp_path: Path) -> None:
    """`helpers.LAYERS` of a module beside the notebook, edited between two kernels: another key."""
    prelude = ("import helpers\nfrom transformers import LlamaConfig\n"
               "torch.manual_seed(0)  # the load draws its weights: one state for every kernel\n"
               "def load():\n"
               "    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,\n"
               "                         num_key_value_heads=2, num_hidden_layers=helpers.LAYERS)\n"
               "    return LlamaForCausalLM(config)\n")
    got = []
    for layers in (1, 3, 1):
        (tmp_path / "helpers.py").write_text(f"LAYERS = {layers}\n")
        got.append(kernel_load(prelude, "loading.cached(load)", tmp_path))
    assert [g["layers"] for g in got] == [1, 3, 1]
    assert [g["calls"] for g in got] == [{"miss": 1}, {"miss": 1}, {"hit": 1}]


WHOSE = """
    import json, sys, types
    sys.path.insert(0, {beside!r})
    import six, webencodings, beside_the_notebook, kernel_server  # webencodings: the one beside the notebook
    from overmind_jupyter.reads import is_users_module
    sys.modules["made_in_memory"] = types.ModuleType("made_in_memory")
    opened = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
    names = ["beside_the_notebook", "webencodings", "kernel_server.client", "made_in_memory", "__main__", "six",
             "json.decoder", "torch.nn"]
    whose = {{name: is_users_module(name) for name in names}}
    print(json.dumps({{"whose": whose, "metadata": [p for p in opened if "-info" in p],
                      "webencodings": webencodings.__file__}}))
"""


def test_whose_module_it_is_is_told_by_where_its_files_lie(tmp_path: Path) -> None:
    """Note [Installed code] in reads.py. The user's: a module beside the notebook, one named like an
    installed distribution's module (`webencodings`) but imported from beside the notebook, a package
    installed in place (this repository's kernel_server), a module made in memory, the notebook. Not the
    user's: a module from site-packages (`six`), the standard library's, torch. Telling them apart opens
    no distribution's metadata (reading all of it took 0.1-0.3 s of a first call)."""
    (tmp_path / "beside_the_notebook.py").write_text("SCALE = 2\n")
    (tmp_path / "webencodings.py").write_text("SCALE = 3\n")
    got = last_json(run_py(WHOSE.format(beside=str(tmp_path))))
    assert got["webencodings"] == str(tmp_path / "webencodings.py")
    assert got["whose"] == {"beside_the_notebook": True, "webencodings": True, "kernel_server.client": True,
                            "made_in_memory": True, "__main__": True, "six": False, "json.decoder": False,
                            "torch.nn": False}
    assert got["metadata"] == [], "telling whose a module is reads no distribution's metadata"


def test_a_checkpoint_replaced_under_a_literal_path_is_a_miss(overmind_home: Path, tmp_path: Path) -> None:
    """The path written in the function's body names a checkpoint that is replaced between two kernels."""
    checkpoint, other = tmp_path / "model", demo_models.build_llama(tmp_path / "other", "tiny", seed=1)
    demo_models.build_llama(checkpoint, "tiny")
    # converted to fp32: the entry holds its own copy of the weights, not references to the checkpoint's
    prelude = (f"def load():\n"
               f"    return AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}, dtype=torch.float32)\n")
    first = kernel_load(prelude, "loading.cached(load)", tmp_path)
    shutil.rmtree(checkpoint)
    shutil.copytree(other, checkpoint)
    second = kernel_load(prelude, "loading.cached(load)", tmp_path)
    assert (first["calls"], second["calls"]) == ({"miss": 1}, {"miss": 1})
    assert second["sum"] == plain_sum(checkpoint, dtype=torch.float32) != first["sum"]


# -- 4. random weights follow the caller's seed -------------------------------------------------------------

RANDOM_HEAD = """
    import json, sys, torch
    from transformers import LlamaForSequenceClassification
    from overmind_jupyter import loading
    torch.manual_seed({seed})
    m = loading.cached(LlamaForSequenceClassification.from_pretrained, {path!r})
    print(json.dumps({{"head": m.score.weight.float().sum().item(), "rand": torch.rand(3).tolist(),
                       "fallbacks": [f["kind"] for f in loading.fallbacks()], "calls": loading.calls()}}))
"""


def test_a_head_the_checkpoint_lacks_follows_each_kernels_seed(overmind_home: Path, tiny_llama: Path) -> None:
    """Two kernels with different seeds load a causal-LM checkpoint as a classifier (its head is
    initialised randomly): each gets what a plain load gives for its seed, and its next random numbers
    are a plain run's. A kernel restarted with the same seed is a hit with the same head and draws
    (Note [Random loads]). The second kernel's miss is followed and finds the head's random values in the
    result (Note [Replayed draws] in draws.py), and says so."""
    from transformers import LlamaForSequenceClassification

    told = []

    def run(seed: int) -> dict:
        proc = run_py(RANDOM_HEAD.format(seed=seed, path=str(tiny_llama)))
        told.append(proc.stderr)
        return last_json(proc)

    def plain_run(seed: int) -> dict:  # RANDOM_HEAD's plain load, here: the seed decides all it draws
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = LlamaForSequenceClassification.from_pretrained(tiny_llama)
            return {"head": m.score.weight.float().sum().item(), "rand": torch.rand(3).tolist()}

    plain = {seed: plain_run(seed) for seed in (1, 2)}
    first = {seed: run(seed) for seed in (1, 2)}
    assert "its result depends on them (random values outlive the load in 1 storage)" in told[-1], told[-1]
    again = run(1)
    for seed in (1, 2):
        assert (first[seed]["head"], first[seed]["rand"]) == (plain[seed]["head"], plain[seed]["rand"])
        assert first[seed]["calls"] == {"miss": 1} and not first[seed]["fallbacks"]
    assert plain[1]["head"] != plain[2]["head"]
    assert again["calls"] == {"hit": 1}, "the same seed after a restart: a hit"
    assert (again["head"], again["rand"]) == (plain[1]["head"], plain[1]["rand"]), "and the generator advanced as plain"


# -- 5. an adapter folder's base model (Note [An adapter's base model] in adapter_bases.py) ----------------

ADAPTER_KERNEL = """
    import json, torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM
    from overmind_jupyter import loading
    out = {{}}
    for loader in (AutoModelForCausalLM, AutoPeftModelForCausalLM):
        before = loading.calls()
        torch.manual_seed(0)
        m = loading.cached(loader.from_pretrained, {adapter!r})
        calls = {{k: n - before.get(k, 0) for k, n in loading.calls().items() if n != before.get(k, 0)}}
        out[loader.__name__] = {{"sum": float(sum(p.double().sum() for p in m.parameters())), "calls": calls}}
    out["fallbacks"] = [f["reason"] for f in loading.fallbacks()]
    print(json.dumps(out))
"""
LOADERS = ("AutoModelForCausalLM", "AutoPeftModelForCausalLM")
MISSED = {"AutoModelForCausalLM": {"miss": 1}, "AutoPeftModelForCausalLM": {"miss": 1}}


def save_adapter(base: str, path: Path) -> Path:
    """A LoRA adapter with random (non-zero) weights over the causal LM at `base`, as spelled (its
    adapter_config.json names the base so), for AutoPeftModelForCausalLM too (its task type)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(LlamaForCausalLM.from_pretrained(base), config).save_pretrained(str(path))
    return path


def test_an_adapter_folders_base_rebuilt_under_it_is_a_miss(overmind_home: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder with only an adapter, loaded by the loaders that load the base its adapter_config.json
    names (transformers' PEFT integration, peft's AutoPeftModel): the base deleted and rebuilt with other
    weights between two kernels, the adapter untouched. The second kernel misses with each and gets its
    plain load, of the base now; a third hits. The base is named relative to the kernels' working
    directory, where the loaders look for it (not beside the adapter)."""
    import peft
    import transformers

    monkeypatch.chdir(tmp_path)
    demo_models.build_llama(tmp_path / "base", "tiny", seed=1, dtype="float32")
    adapter = save_adapter("base", tmp_path / "adapters" / "fr")
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"

    def run() -> dict:
        return last_json(run_py(ADAPTER_KERNEL.format(adapter=str(adapter)), cwd=tmp_path))

    def plain(loader: str) -> float:
        torch.manual_seed(0)
        model = getattr(transformers if loader.startswith("AutoModel") else peft, loader).from_pretrained(str(adapter))
        with torch.no_grad():
            return float(sum(p.double().sum() for p in model.parameters()))

    first = run()
    assert {n: first[n]["calls"] for n in LOADERS} == MISSED, first
    assert not first["fallbacks"], first
    settled(overmind_home)  # the entries no longer read the old base's files: only the keys can tell
    shutil.rmtree(tmp_path / "base")
    demo_models.build_llama(tmp_path / "base", "tiny", seed=2, dtype="float32")
    second, third = run(), run()
    assert {n: second[n]["calls"] for n in LOADERS} == MISSED, \
        "the base was rebuilt: the entries hold the old base's weights"
    for n in LOADERS:
        assert second[n]["sum"] == plain(n) != first[n]["sum"], n
        assert third[n] == {"sum": second[n]["sum"], "calls": {"hit": 1}}, (n, third)


def hub_cache(cache: Path, repo_id: str, commits: dict[str, Path]) -> None:
    """Lay `commits` (revision name -> a checkpoint folder) out as the local Hugging Face cache at `cache`
    holds repo `repo_id`: refs/REVISION naming a commit, snapshots/COMMIT/FILE linked to blobs/."""
    import hashlib

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for revision, folder in commits.items():
        commit = hashlib.sha1(f"{repo_id}@{revision}@{folder}".encode()).hexdigest()
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
        for file in folder.iterdir():
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():  # a blob another commit shares stays as it is, as the hub's client leaves it
                shutil.copyfile(file, blob)
            (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
            (repo / "snapshots" / commit / file.name).symlink_to(os.path.relpath(blob, repo / "snapshots" / commit))


def test_an_adapter_folders_hub_base_is_keyed_by_the_commit_its_loader_reads(tmp_path: Path) -> None:
    """A hub id as the base, in the local HF cache: transformers reads it at the call's revision, peft's
    AutoPeftModel at the adapter config's `revision`. A ref moved to another commit is another key; a base
    the cache cannot resolve offline leaves the call uncacheable (it loads plainly), never keyed by its name.
    A folder with a config.json of its own is loaded by transformers from itself, with no base."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from overmind_jupyter import keys
    from overmind_jupyter.errors import Uncacheable

    one = demo_models.build_llama(tmp_path / "one", "tiny", seed=1, dtype="float32")
    two = demo_models.build_llama(tmp_path / "two", "tiny", seed=2, dtype="float32")
    adapter = save_adapter(str(one), tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "org/base",
                                                                      "revision": "v2"}))
    cache = tmp_path / "hub"
    hub_cache(cache, "org/base", {"main": one, "v2": one})

    def key(loader: object) -> str:
        return keys.make_key(loader.from_pretrained, (str(adapter),), {"cache_dir": str(cache)}).key  # type: ignore[attr-defined]

    before = {loader: key(loader) for loader in (AutoModelForCausalLM, AutoPeftModelForCausalLM)}
    hub_cache(cache, "org/base", {"v2": two})  # the adapter config's revision moves: only peft reads it
    assert key(AutoModelForCausalLM) == before[AutoModelForCausalLM]
    assert key(AutoPeftModelForCausalLM) != before[AutoPeftModelForCausalLM]
    hub_cache(cache, "org/base", {"main": two})  # and the default branch: transformers reads that one
    assert key(AutoModelForCausalLM) != before[AutoModelForCausalLM]
    shutil.rmtree(cache)
    for loader in (AutoModelForCausalLM, AutoPeftModelForCausalLM):
        with pytest.raises(Uncacheable, match="org/base"):
            key(loader)
    # a full model that carries an adapter: transformers loads it from itself, peft still the base
    shutil.copy(one / "config.json", adapter / "config.json")
    assert key(AutoModelForCausalLM)
    with pytest.raises(Uncacheable, match="org/base"):
        key(AutoPeftModelForCausalLM)


# -- a property: whatever happens to the directory, a cached load is a plain load of it now -----------------

MUTATIONS = st.lists(st.sampled_from(["rewrite", "replace", "config", "link", "touch", "nothing"]), min_size=1,
                     max_size=3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=MUTATIONS, seeds=st.lists(st.integers(1, 3), min_size=3, max_size=3))
def test_every_hit_equals_a_plain_load_of_the_directory_as_it_is_now(
        overmind_home: Path, property_checkpoints: dict[str, Path], steps: list[str], seeds: list[int]) -> None:
    directory = property_checkpoints["dir"]
    for step, seed in zip(steps, seeds, strict=False):
        blob = property_checkpoints[f"blob{seed}"]
        target = directory / "model.safetensors"
        if step == "rewrite":  # in place, times restored
            if target.is_symlink():
                target.unlink()
                shutil.copy2(blob, target)
            rewrite_keeping_times(target, blob.read_bytes())
        elif step == "replace":
            replace_keeping_times(target, blob.read_bytes())
        elif step == "config":
            config = directory / "config.json"
            data = json.loads(config.read_text())
            data["rms_norm_eps"] = [1e-6, 1e-3, 1e-1][seed - 1]
            st_ = config.stat()
            config.write_text(json.dumps(data))
            os.utime(config, ns=(st_.st_atime_ns, st_.st_mtime_ns))
        elif step == "link":
            tmp = directory / "link.new"
            tmp.symlink_to(blob)
            os.replace(tmp, target)
        elif step == "touch":
            st_ = target.stat()
            os.utime(target, ns=(st_.st_atime_ns, st_.st_mtime_ns))
        assert_like_plain(directory)


@pytest.fixture(scope="module")
def property_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("property")
    out = {"dir": Path(shutil.copytree(demo_models.build_llama(root / "seed1", "tiny", seed=1), root / "dir"))}
    for seed in (1, 2, 3):
        built = demo_models.build_llama(root / f"seed{seed}", "tiny", seed=seed)
        out[f"blob{seed}"] = Path(shutil.copy2(built / "model.safetensors", root / f"blob{seed}"))
    return out


def test_signatures_are_kept_by_function_and_a_redefined_function_is_keyed_by_its_own() -> None:
    """Note [Signatures] in keys.py: a bound method's signature is built once per function, and a
    function redefined with other parameters binds the same call to other names (another key)."""
    from overmind_jupyter import keys

    class Loader:
        @classmethod
        def from_pretrained(cls, path: str, *args: object, dtype: object = None, **kwargs: object) -> None:
            pass

    assert Loader.from_pretrained is not Loader.from_pretrained  # a new bound method at each access
    assert keys.signature(Loader.from_pretrained) is keys.signature(Loader.from_pretrained)
    assert next(iter(keys.signature(Loader.from_pretrained).parameters)) == "path"
    assert next(iter(keys.signature(Loader.from_pretrained.__func__).parameters)) == "cls"

    def load(a: int, b: int = 0) -> None:
        pass

    first = keys.make_key(load, (1, 2), {}).key
    assert keys.make_key(load, (1,), {"b": 2}).key == first

    def load(b: int, a: int = 0) -> None:  # type: ignore[no-redef]  # the cell edited and run again
        pass

    assert keys.make_key(load, (1, 2), {}).key != first


def test_calls_of_one_function_are_labelled_by_their_plain_arguments() -> None:
    """`ls`, status and the panel name an entry by its label: calls of one function without a checkpoint
    (a notebook's `make(seed)`) read apart by their arguments of plain values, cut to a line, and a dtype
    alone reads as one argument (they all read `make()`, and a dtype `make(, dtype=...)`)."""
    import torch

    from overmind_jupyter import keys, progress

    def make(seed: int, name: str = "", model: object = None, dtype: object = None) -> None:
        pass

    def label(*args: object, **kwargs: object) -> str:
        return keys.make_key(make, args, kwargs).label

    assert label(3).endswith(".make(seed=3)")
    assert label(3, "a").endswith(".make(seed=3, name='a')")
    assert label(3, model=[1, 2]).endswith(".make(seed=3)"), "other values are the key's, not the label's"
    assert label(3, dtype=torch.bfloat16).endswith(".make(seed=3, dtype=bfloat16)")
    long = label(3, "x" * 100)
    assert long.endswith("...)") and len(long[long.index(".make("):]) < 70, long
    # the bars and the panel's progress name such a load by its function, not by "seed=3"
    assert progress.model_name(label(3, "a")).endswith(".make"), progress.model_name(label(3, "a"))


def test_loads_of_one_checkpoint_are_labelled_by_their_other_plain_arguments(tmp_path: Path) -> None:
    """Two heads of one checkpoint (`num_labels=2`, `num_labels=3`) were two entries of one label in `ls`
    and status: a checkpoint's load is labelled by its other plain arguments too, after it."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from overmind_jupyter import keys, progress

    (tmp_path / "config.json").write_text("{}")
    load = AutoModelForSequenceClassification.from_pretrained
    labels = {keys.make_key(load, (str(tmp_path),), {"num_labels": n, "dtype": torch.float16}).label for n in (2, 3)}
    assert labels == {f"AutoModelForSequenceClassification.from_pretrained({str(tmp_path)!r}, num_labels={n}, "
                      "dtype=float16)" for n in (2, 3)}, labels
    assert {progress.model_name(label) for label in labels} == {tmp_path.name}
    # never a credential: labels are printed by ls, status, the panel and warnings
    secret = keys.make_key(load, (str(tmp_path),), {"token": "hf_SECRET", "use_auth_token": "hf_OTHER",
                                                    "subfolder": "a"}).label
    assert "SECRET" not in secret and "OTHER" not in secret and "subfolder='a'" in secret, secret
    # a bar names the model by its folder, a comma in it too (it read "Loading weights (a")
    assert progress.model_name("X.from_pretrained('/m/a,v1', num_labels=3)") == "a,v1"


def test_a_model_loaded_from_its_own_folder_is_named_by_that_folder(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`from_pretrained(".")` in the model's folder: the bars, the miss line and the label of a call given
    that model name the folder, not "." (they read "cached ." and "model=<. float32>")."""
    from overmind_jupyter import keys, progress
    from tests.helpers import tiny_modules

    (tmp_path / "llama").mkdir()
    monkeypatch.chdir(tmp_path / "llama")
    assert progress.model_name("X.from_pretrained('.', dtype=float32)") == "llama"
    assert progress.model_name("X.from_pretrained('./')") == "llama"
    assert progress.model_name("X.from_pretrained('..')") == tmp_path.name
    model = tiny_modules.build("mlp", seed=1, width=4, depth=1)
    model.config = type("Config", (), {"_name_or_path": "."})()
    assert keys._model_short(model) == "llama float32"


def test_a_subfolders_load_is_named_by_its_folder_and_subfolder(tmp_path: Path) -> None:
    """The miss line and the bars name a pipeline's component by the checkpoint and its subfolder ("sd/unet"):
    a pipeline, its UNet and its scheduler all read "cached sd". The subfolder follows the checkpoint in the
    label, ahead of the other plain arguments, which a long one cut off."""
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from overmind_jupyter import keys, progress

    for sub in ("unet", "scheduler"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text("{}")
    unet = keys.make_key(UNet2DConditionModel.from_pretrained, (str(tmp_path),),
                         {"revision": "r" * 80, "subfolder": "unet"}).label
    assert unet.startswith(f"UNet2DConditionModel.from_pretrained({str(tmp_path)!r}, subfolder='unet', "), unet
    assert progress.model_name(unet) == f"{tmp_path.name}/unet"
    scheduler = keys.make_key(DDIMScheduler.from_pretrained, (str(tmp_path),), {"subfolder": "scheduler/"}).label
    assert progress.model_name(scheduler) == f"{tmp_path.name}/scheduler"
    assert progress.model_name(f"X.from_pretrained({str(tmp_path)!r}, subfolder='')") == tmp_path.name
