"""Loads asked onto a device (Note [Devices] in overmind_jupyter/placement.py): the explicit `cached` form
and the patched loaders alike, the loads the cache cannot reproduce there (they run as called, and say why
once), the units a placement takes, and a cached result's own `.to("cuda")` (Note [Moves of cached
results]). Devices are simulated (OVERMIND_FAKE_GPUS, set before the test's daemon starts): a placed model
stays on the CPU while the ledger counts it, and the plain load or move onto "cuda" raises here as it does
on any machine without CUDA.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch

from overmind_jupyter import loading, rebuild, units
from overmind_jupyter.errors import FallbackWarning
from overmind_jupyter.units.devices import model_label
from tests.helpers import tiny_modules


@pytest.fixture
def shell(overmind_home: Path):
    """A real IPython shell with the extension loaded and `%overmind on`; unloaded afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "overmind_jupyter")
    ip.run_line_magic("overmind", "on")
    yield ip
    ip.run_line_magic("unload_ext", "overmind_jupyter")


@pytest.fixture
def fake_gpus(overmind_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One simulated device of 16 GiB, for the daemon the test starts and for this kernel."""
    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "1x16")
    monkeypatch.setenv("OVERMIND_GPU_RESERVE", "1")


def in_arena(model: torch.nn.Module) -> bool:
    return all(rebuild.entry_of(p.data_ptr()) is not None for p in model.parameters())


def holders() -> list[dict]:
    return [h for h in units.state()["devices"][0]["holders"] if h["mine"]]


def plain_error(call) -> BaseException:
    """What `call` raises without overmind."""
    with pytest.raises(BaseException) as raised:
        call()
    return raised.value


# -- g. the explicit form places as the patched loaders do -------------------------------------------

def test_cached_with_a_device_map_splits_it_as_the_patched_loaders_do(fake_gpus: None, tiny_llama: Path,
                                                                       tmp_path: Path) -> None:
    """`cached(fn, ..., device_map=...)` is the patch-free form of `%overmind on`: a one-device map is the
    CPU load placed through the ledger, and an offloading map loads as called and says why (issue 37, g)."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained
    model = loading.cached(load, str(tiny_llama), device_map="cuda")
    assert units.device_of(model) == "cuda:0" and [h["units"] for h in holders()] == [1]
    assert next(model.parameters()).device.type == "cpu", "a simulated device leaves it on the CPU"
    with pytest.warns(FallbackWarning, match="max_memory"):
        offloaded = loading.cached(load, str(tiny_llama), device_map="auto", max_memory={"cpu": 20_000},
                                   offload_folder=str(tmp_path / "offload"))
    assert offloaded.hf_device_map == {"": "disk"}, "the plain load, which offloads to disk"
    assert [f["kind"] for f in loading.fallbacks()] == ["uncacheable"]


# -- a. weights the checkpoint lacks, drawn on the device --------------------------------------------

def test_a_load_that_draws_onto_a_device_runs_as_called(fake_gpus: None, tiny_llama: Path, shell) -> None:
    """A causal-LM checkpoint loaded as a classifier lacks the head, which the load draws. With a device
    map transformers makes the missing weights on the device and draws them from that device's generator;
    the cache loads on the CPU and would draw from the CPU's, other weights and another generator advanced.
    So the load runs as called (here it raises, as the plain load onto "cuda" does without CUDA), with the
    generators as it found them, and says why once: after the CPU load that showed it draws, and then from
    the entry's marker, without loading on the CPU. The CPU load of that seed stays cached (issue 37, a)."""
    from transformers import LlamaForSequenceClassification

    load = LlamaForSequenceClassification.from_pretrained
    shell.run_line_magic("overmind", "off")
    torch.manual_seed(0)
    plain = plain_error(lambda: load(str(tiny_llama), device_map="cuda"))
    plain_after = torch.random.get_rng_state()
    shell.run_line_magic("overmind", "on")
    before = loading.calls()
    for first in (True, False):
        torch.manual_seed(0)
        told = pytest.warns(FallbackWarning, match="generator") if first else contextlib.nullcontext()
        with told, pytest.raises(type(plain)):
            load(str(tiny_llama), device_map="cuda")
        assert torch.equal(torch.random.get_rng_state(), plain_after), "the generator as the plain load left it"
    torch.manual_seed(0)
    model = load(str(tiny_llama))
    assert in_arena(model), "the CPU load of the same seed: a hit"
    after = loading.calls()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in ("miss", "plain", "hit")} == {"miss": 1, "plain": 2,
                                                                                       "hit": 1}
    reasons = [f["reason"] for f in loading.fallbacks()]
    assert len(reasons) == 2 and "onto cuda" in reasons[0] and "generator" in reasons[0], reasons


def test_a_device_map_that_names_no_device_raises_the_librarys_own_error_and_nothing_else(
        tiny_llama: Path, shell, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [Devices]: an int names a device of the current accelerator, and a string must be a device
    name; where it names none (here: no accelerator; a typo), the call runs as made, without a notice, and
    the user gets transformers' own error: before, an int went to CUDA (torch's assertion, after a whole
    CPU load was cached) and a bad name got a notice that the map spreads the model over devices. "cuda"
    is the device of LOCAL_RANK, as transformers reads it."""
    import warnings

    from transformers import AutoModelForCausalLM

    from overmind_jupyter.placement import split_placement

    load = AutoModelForCausalLM.from_pretrained
    for device_map in (0, {"": 0}, "bogus", {"": "bogus"}):
        shell.run_line_magic("overmind", "off")
        plain = plain_error(lambda device_map=device_map: load(str(tiny_llama), device_map=device_map))
        shell.run_line_magic("overmind", "on")
        before = loading.calls()
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            with pytest.raises(type(plain)) as raised:
                load(str(tiny_llama), device_map=device_map)
        assert str(raised.value) == str(plain), device_map
        assert loading.calls() == before, "neither a load through the cache nor a fallback"
    assert loading.fallbacks() == []
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert split_placement({"device_map": "cuda"}).device == torch.device("cuda", 1)
    assert split_placement({"device_map": {"": "cuda"}}).device == torch.device("cuda"), "accelerate's own"


# -- b. quantized loads ------------------------------------------------------------------------------

def test_quantized_loads_run_as_called_and_say_why_once(tiny_llama: Path, tmp_path: Path, shell) -> None:
    """A checkpoint whose config.json carries a `quantization_config`, or a `quantization_config=` argument,
    asks for a quantized load: bitsandbytes quantizes as it loads onto the GPU and its models refuse
    `.to()`, which the cache's CPU load and move cannot reproduce. Both run as called (here they raise
    ImportError: no bitsandbytes), and each reason, naming quantization, is told once (issue 37, b)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantized = Path(shutil.copytree(tiny_llama, tmp_path / "quantized"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    load = AutoModelForCausalLM.from_pretrained
    shell.run_line_magic("overmind", "off")
    in_config = plain_error(lambda: load(str(quantized), device_map="cuda"))
    in_argument = plain_error(lambda: load(str(tiny_llama), quantization_config=BitsAndBytesConfig(load_in_8bit=True)))
    shell.run_line_magic("overmind", "on")
    with pytest.warns(FallbackWarning, match="quantiz"), pytest.raises(type(in_config)):
        load(str(quantized), device_map="cuda")
    with pytest.warns(FallbackWarning, match="quantiz"), pytest.raises(type(in_argument)):
        load(str(tiny_llama), quantization_config=BitsAndBytesConfig(load_in_8bit=True))  # another reason: told
    shell.run_line_magic("overmind", "off")
    with pytest.raises(type(in_config)):
        loading.cached(AutoModelForCausalLM.from_pretrained, str(quantized))  # the explicit form too: not again
    fallbacks = loading.fallbacks()
    assert [f["kind"] for f in fallbacks] == ["quantized"] * 3, fallbacks
    assert "bitsandbytes" in fallbacks[0]["reason"] and "config.json" in fallbacks[0]["reason"], fallbacks
    assert "quantization_config=" in fallbacks[1]["reason"], fallbacks
    assert loading.shared_client().request("ls")["entries"] == [], "nothing cached, nothing left loading"


# -- c. pipelines take units -------------------------------------------------------------------------

def test_a_pipeline_placed_on_a_device_holds_its_units(fake_gpus: None, tmp_path: Path, shell) -> None:
    """A pipeline asked onto a device is placed through the ledger as a model is (issue 37, c): one holding
    for all its modules, which the ledger can ask back; released, it is placed again by `using`."""
    from diffusers import DiffusionPipeline

    from overmind_jupyter import demo_models

    sd = str(demo_models.build_sd_pipeline(tmp_path / "sd"))
    DiffusionPipeline.from_pretrained(sd)
    pipe = DiffusionPipeline.from_pretrained(sd, device_map="cuda")  # a hit, then placed
    assert units.device_of(pipe) == "cuda:0"
    (held,) = holders()
    assert held["units"] == units.units_for(pipe) == 1 and held["model"] == "StableDiffusionPipeline(sd)", held
    assert units.release(pipe) and units.device_of(pipe) is None and holders() == []
    assert in_arena(pipe.unet), "back on the cached weights (Note [Lazy release to the cached weights])"
    with units.using(pipe):
        assert units.device_of(pipe) == "cuda:0" and holders()[0]["busy"]
    assert not loading.fallbacks()


# -- d. an entry with tensors on a device --------------------------------------------------------------

class _OnCuda0:
    """Unpickles, in a rebuild, to a storage of 64 bytes on cuda:0: what a cached function that returns
    CUDA tensors leaves in its graph."""

    def __reduce__(self) -> tuple:
        return (rebuild._storage_at, ("own", None, 0, 64, "cuda:0"))


def test_an_entry_on_a_device_this_kernel_lacks_loads_plainly_and_stays(overmind_home: Path) -> None:
    """An entry whose tensors lie on a CUDA device is checked by that device's identity (its UUID, not its
    ordinal, which names another device under another CUDA_VISIBLE_DEVICES): a kernel that does not see
    that device as that ordinal, here one without CUDA, loads plainly and leaves the entry to the kernels
    that can rebuild it, where it used to evict it for everyone as corrupt (issue 37, d)."""
    from kernel_server import arena
    from overmind_jupyter import keys

    key = keys.make_key(tiny_modules.build, ("tied",), {}).key
    client = loading.shared_client()
    assert client.request("lookup", key=key, wait=False)["status"] == "load"
    body = rebuild.pack((_OnCuda0(), [], None)).graph
    graph, data = arena.ArenaWriter(len(body)), arena.ArenaWriter(64)
    graph.view[:] = body
    client.request("reserve", key=key, bytes=len(body) + 64)
    client.request("publish", key=key, fds=[graph.seal(), data.seal()], graph_bytes=len(body), arena_bytes=64,
                   meta={"label": "tied", "devices": {"cuda:0": "GPU-5e1f0000-0000-0000-0000-000000000000"}})
    for told in (pytest.warns(FallbackWarning, match="GPU-5e1f"), contextlib.nullcontext()):
        with told:
            model = loading.cached(tiny_modules.build, "tied")
        assert isinstance(model, tiny_modules.TiedWeights) and not in_arena(model)
    assert [f["kind"] for f in loading.fallbacks()] == ["device"] * 2
    assert [e["key"] for e in client.request("ls")["entries"]] == [key], "the entry stays"


ON_CUDA = """
    import json
    from overmind_jupyter import loading
    from tests.helpers import tiny_modules
    try:
        where = str(next(loading.cached(tiny_modules.build_on, "mlp", "cuda:0").parameters()).device)
    except Exception as exc:  # no CUDA here: the plain call raises
        where = type(exc).__name__
    print(json.dumps({"where": where, "calls": loading.calls(), "kinds": [f["kind"] for f in loading.fallbacks()]}))
"""


@pytest.mark.gpu
def test_gpu_an_entry_on_a_device_is_checked_by_its_identity(daemon) -> None:
    """The entry of a function that returns CUDA tensors names the device's UUID; a kernel whose cuda:0 is
    that device hits it, one without CUDA loads plainly and leaves it (Note [Tensors on a device])."""
    import os

    from overmind_jupyter.units.devices import cuda_identity
    from tests.helpers.snippets import last_json, run_py

    first = last_json(run_py(ON_CUDA))
    assert first == {"where": "cuda:0", "calls": {"miss": 1}, "kinds": []}, first
    (entry,) = daemon.request("ls")["entries"]
    assert entry["meta"]["devices"] == {"cuda:0": cuda_identity(0)}
    assert last_json(run_py(ON_CUDA))["calls"] == {"hit": 1}
    hidden = last_json(run_py(ON_CUDA, env=dict(os.environ, CUDA_VISIBLE_DEVICES="")))
    assert hidden["kinds"] == ["device"] and hidden["calls"] == {"plain": 1}, hidden
    assert [e["key"] for e in daemon.request("ls")["entries"]] == [entry["key"]], "the entry stays"


def test_a_kernel_that_simulates_no_gpu_places_nothing_on_the_daemon_s_simulated_ones(
        fake_gpus: None, tiny_llama: Path, overmind_home: Path, monkeypatch: pytest.MonkeyPatch, shell) -> None:
    """A daemon started with OVERMIND_FAKE_GPUS, this kernel without it: `device_map="cuda:0"` ends as the
    plain load does (torch's error without CUDA, the model on the real device with it), on a miss and on a
    hit, with a notice that says the daemon simulates GPUs and how to restart it; it used to return the
    model on the CPU, "placed" on a simulated device (Note [Simulated here] in units/residency.py)."""
    from transformers import AutoModelForCausalLM

    from kernel_server import Client

    Client(overmind_home, role="test").close()  # the daemon starts with the test's OVERMIND_FAKE_GPUS=1x16
    load = AutoModelForCausalLM.from_pretrained
    shell.run_line_magic("overmind", "off")
    plain = plain_error(lambda: load(str(tiny_llama), device_map="cuda:0")) if not torch.cuda.is_available() else None
    shell.run_line_magic("overmind", "on")
    monkeypatch.delenv("OVERMIND_FAKE_GPUS")  # after `%overmind on`, which writes the extension's config there
    before = loading.calls()
    for told in (pytest.warns(FallbackWarning, match=r"the daemon simulates GPUs \(OVERMIND_FAKE_GPUS=1x16"),
                 warnings.catch_warnings(record=True)):
        with told:
            if plain is None:
                model = load(str(tiny_llama), device_map="cuda:0")
                assert next(model.parameters()).device == torch.device("cuda:0")
                continue
            with pytest.raises(type(plain)) as raised:
                load(str(tiny_llama), device_map="cuda:0")
        assert str(raised.value) == str(plain)
    after = loading.calls()
    assert (after["miss"] - before["miss"], after["hit"] - before["hit"]) == (1, 1), (before, after)
    [fallback] = {f["reason"] for f in loading.fallbacks()}
    assert "restart the daemon without the variable (`overmind-daemon stop`" in fallback, fallback
    assert units.state()["devices"][0]["holders"] == [], "nothing placed on the simulated device"


# -- f. device_map="auto" on one device ----------------------------------------------------------------

def test_auto_on_one_device_places_a_model_that_fits(fake_gpus: None, tiny_llama: Path, shell) -> None:
    """`device_map="auto"` with one device puts a model that fits there whole, as the plain load does:
    the cached model is placed through the ledger (with simulated devices standing in for real ones)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map="auto")
    assert units.device_of(model) == "cuda:0" and [h["units"] for h in holders()] == [1]
    assert not loading.fallbacks()


def test_auto_on_one_device_loads_plainly_a_model_that_does_not_fit(tiny_llama: Path, overmind_home: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    shell) -> None:
    """A model larger than what the device can take (here: the units the ledger can grant on a simulated
    device of half a GiB, none) is one the plain `device_map="auto"` load spreads over the device, the CPU
    and the disk; moved whole onto the device, it would not fit. So it loads as called, and says why once
    (issue 37, f)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "1x0.5")
    monkeypatch.setenv("OVERMIND_GPU_RESERVE", "0")
    AutoModelForCausalLM.from_pretrained(str(tiny_llama))  # cached: the loads below find the entry
    with pytest.warns(FallbackWarning, match="units"):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map="auto")
    AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map="auto")  # told once
    assert units.device_of(model) is None and not in_arena(model), "the plain load's model"
    fallbacks = loading.fallbacks()
    assert [f["kind"] for f in fallbacks] == ["too_large"] * 2, fallbacks
    assert "needs 1 unit" in fallbacks[0]["reason"] and "0 units" in fallbacks[0]["reason"], fallbacks


# -- h. a cached result's own moves to a GPU (issue 36, item 3) ----------------------------------------

def hit(path: Path) -> torch.nn.Module:
    """A model of the cache: the load of `path` (a miss, or a hit), then its hit."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert in_arena(model)
    return model


def placed() -> list[tuple[str, int, bool]]:
    """This kernel's holdings on the (simulated) device: model, units, busy."""
    return [(h["model"], h["units"], h["busy"]) for h in holders() if not h["context"]]


MOVES = {
    'to("cuda:0")': lambda m: m.to("cuda:0"),
    'to("cuda")': lambda m: m.to("cuda"),
    "to(0)": lambda m: m.to(0),
    'to(torch.device("cuda"))': lambda m: m.to(torch.device("cuda")),
    'to(device="cuda:0")': lambda m: m.to(device="cuda:0"),
    "cuda()": lambda m: m.cuda(),
    "cuda(0)": lambda m: m.cuda(0),
}


def test_a_hits_own_move_to_a_gpu_is_placed_as_device_map_places_it(fake_gpus: None, tiny_llama: Path,
                                                                     shell) -> None:
    """`model.to("cuda")`, `.to(0)`, `.cuda()`, ... of a cached result goes through the units ledger, as
    `device_map="cuda:0"` does: the same holding, and the method returns the model (Note [Moves of cached
    results]). Simulated, the model stays on the CPU; torch's own `.to("cuda")` raises here."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map="cuda:0")
    as_device_map = placed()
    assert len(as_device_map) == 1 and units.release(loaded)
    [(label, count, _)] = as_device_map
    model = hit(tiny_llama)
    for name, move in MOVES.items():
        assert move(model) is model, name
        # the same holding, held as torch's `.to` leaves it (Note [Held placements]): busy, never asked back
        assert units.device_of(model) == "cuda:0" and placed() == [(label, count, True)], name
        assert next(model.parameters()).device.type == "cpu" and in_arena(model), name
        assert units.release(model) and placed() == [], name
    before = loading.calls().get("miss", 0)
    miss = loading.cached(tiny_modules.build, "mlp")  # a miss's result moves so too
    assert loading.calls()["miss"] == before + 1
    assert miss.to("cuda:0") is miss and units.device_of(miss) == "cuda:0"
    assert placed() == [("Mlp", 1, True)] and not loading.fallbacks()


def test_a_model_moved_by_its_own_to_stays_when_another_kernel_waits_and_using_nests_on_it(
        fake_gpus: None, tiny_llama: Path, shell, overmind_home: Path) -> None:
    """Note [Held placements]: the ledger never asks a held placement back, so a peer's request for the
    units it holds times out while the model stays; `using` nests on it and leaves it held; a release
    gives the units back, after which the peer is served."""
    from kernel_server import Client
    from kernel_server.errors import RemoteError
    from kernel_server.operations import Op

    model = hit(tiny_llama)
    lazy = hit(tiny_llama)
    model.to("cuda:0")
    units.place(lazy, "cuda:0")  # device_map's way: given back lazily
    peer = Client(overmind_home, role="test")
    try:
        capacity = peer.request(Op.UNITS_STATE).payload["devices"][0]["capacity"]
        grant = peer.request(Op.UNITS_ACQUIRE, units=capacity - 1, timeout_s=30, label="peer", busy=True,
                             timeout=60)  # room for it: the lazy model is asked, and gives its unit back
        assert units.device_of(lazy) is None and units.device_of(model) == "cuda:0"
        peer.request(Op.UNITS_RELEASE, holding=grant["holding"])
        with pytest.raises(RemoteError) as refused:
            peer.request(Op.UNITS_ACQUIRE, units=capacity, timeout_s=1, label="peer", busy=True, timeout=60)
        assert refused.value.code == "units_timeout"
        assert units.device_of(model) == "cuda:0", "held: not given back when asked"
        with units.using(model):
            pass
        assert placed() == [(placed()[0][0], placed()[0][1], True)], "still held after a using block"
        assert units.release(model) and placed() == []
        assert peer.request(Op.UNITS_ACQUIRE, units=capacity, timeout_s=30, label="peer", busy=True,
                            timeout=60)["units"] == capacity
    finally:
        peer.close()


def test_any_other_move_is_torchs_own(fake_gpus: None, tiny_llama: Path, shell) -> None:
    """A dtype, `non_blocking`, a submodule, a module of no cached call, a result already placed there, a
    device this kernel lacks, a move inside one of ours: each is torch's own method, untouched, and raises
    here as torch raises without CUDA (Note [Moves of cached results])."""
    from overmind_jupyter.units.residency import moving

    model = hit(tiny_llama)
    plain = plain_error(lambda: torch.nn.Linear(2, 2).to("cuda:0"))
    untouched = {
        'to("cuda", torch.float16)': lambda: model.to("cuda", torch.float16),
        'to("cuda:0", non_blocking=True)': lambda: model.to("cuda:0", non_blocking=True),
        'a submodule\'s to("cuda:0")': lambda: model.lm_head.to("cuda:0"),
        'a new module\'s to("cuda:0")': lambda: torch.nn.Linear(2, 2).to("cuda:0"),
        'to("cuda:1"), a device this kernel lacks': lambda: model.to("cuda:1"),
        "cuda() inside a move of ours": lambda: _inside(moving, model.cuda),
    }
    for name, move in untouched.items():
        with pytest.raises(type(plain), match=str(plain)):
            move()
        assert placed() == [], name
    assert model.to(torch.float16) is model and model.dtype == torch.float16 and placed() == []
    assert model.to(torch.float32).to("cuda:0") is model and units.device_of(model) == "cuda:0"
    assert model.to("cuda:0") is model and len(placed()) == 1, "there already: the no-op of a real device"
    with pytest.raises(type(plain), match=str(plain)):
        model.to("cuda:0", torch.float16)
    assert len(placed()) == 1 and not loading.fallbacks()


def _inside(context, call):
    with context():
        return call()


def test_moves_in_threads_are_one_placement_and_a_move_of_ours_marks_its_thread_alone(
        fake_gpus: None, tiny_llama: Path, shell) -> None:
    """Threads moving one hit at once make one holding and all get the model; a thread inside a move of
    ours (`moving`, which units' own `.to` runs under) leaves the moves of other threads routed."""
    import threading

    from overmind_jupyter.units.residency import moving

    model = hit(tiny_llama)
    inside, done = threading.Event(), threading.Event()

    def hold() -> None:
        with moving():
            inside.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    got: list[object] = []
    try:
        assert inside.wait(30)
        movers = [threading.Thread(target=lambda: got.append(model.to("cuda:0"))) for _ in range(4)]
        for t in movers:
            t.start()
        for t in movers:
            t.join(60)
    finally:
        done.set()
        holder.join(30)
    assert got == [model] * 4 and units.device_of(model) == "cuda:0" and len(placed()) == 1
    assert not loading.fallbacks()


def test_after_off_nothing_is_routed(fake_gpus: None, tiny_llama: Path, shell) -> None:
    """`%overmind off` restores torch's own methods exactly; a hit's `.to("cuda")` is then torch's."""
    model = hit(tiny_llama)
    originals = {name: torch.nn.Module.__dict__[name].__wrapped__ for name in ("to", "cuda")}
    shell.run_line_magic("overmind", "off")
    assert all(torch.nn.Module.__dict__[name] is original for name, original in originals.items())
    for name, move in MOVES.items():
        plain = plain_error(lambda: move(torch.nn.Linear(2, 2)))  # noqa: B023 (called at once)
        with pytest.raises(type(plain), match=str(plain)):
            move(model)
        assert placed() == [], name


def test_a_placed_results_move_back_to_the_cpu_gives_its_units_back(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    shell) -> None:
    """Note [Moves back to the CPU] in placement.py: `.to("cpu")`, `.cpu()` and `.to("cpu", dtype)` of a result
    placed by its own `.to("cuda")` give its units back, as torch's frees the GPU's memory; and a result so
    placed moves to another device, as torch's does (it was refused as "inside units.using")."""
    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "2x16")
    monkeypatch.setenv("OVERMIND_GPU_RESERVE", "1")
    model = hit(tiny_llama)
    for back in (lambda m: m.to("cpu"), lambda m: m.cpu(), lambda m: m.to("cpu", torch.float64)):
        assert model.to("cuda:0") is model
        assert units.device_of(model) == "cuda:0" and len(placed()) == 1
        assert back(model) is model
        assert units.device_of(model) is None and placed() == [], "its units given back"
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    model.to("cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        model.to("cuda:1")
    devices = units.state()["devices"]
    assert units.device_of(model) == "cuda:1" and placed() == [], "cuda:0 holds nothing of it now"
    assert [h["model"] for h in devices[1]["holders"] if h["mine"] and not h["context"]] == [model_label(model)]
    # a call torch would not read is torch's to refuse, from its own frame (Note [Our frames hidden])
    with pytest.raises(RuntimeError, match="must not be negative") as refused:
        model.to(-1)
    assert "overmind_jupyter" not in refused.traceback[-1].path.parts, refused.traceback[-1]
    assert units.device_of(model) == "cuda:1"
    assert loading.fallbacks() == []


def test_a_peft_model_and_its_base_are_one_placement_on_the_way_back(tiny_llama: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch, shell) -> None:
    """A PeftModel over a cached base and the base are two objects over one set of weights: the move of
    either to the CPU gives back the units the other was placed with (Note [Moves back to the CPU])."""
    from peft import PeftModel

    from overmind_jupyter import demo_models

    monkeypatch.setenv("OVERMIND_FAKE_GPUS", "1x16")
    monkeypatch.setenv("OVERMIND_GPU_RESERVE", "1")
    adapter = demo_models.build_lora_adapters(tiny_llama, tmp_path / "lora", ("fr",))["fr"]
    wrapped = PeftModel.from_pretrained(hit(tiny_llama), str(adapter))
    base = wrapped.get_base_model()
    for placed_one, moved_back in ((wrapped, base), (base, wrapped)):
        placed_one.to("cuda:0")
        assert units.device_of(placed_one) == "cuda:0" and len(placed()) == 1
        moved_back.cpu()
        assert units.device_of(placed_one) is None and placed() == [], "its units given back"


def test_a_failure_on_our_path_moves_with_torch_and_says_why_once(fake_gpus: None, tiny_llama: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  shell) -> None:
    """Units that cannot be granted (another kernel holds the device, and the timeout is 0.1 s) leave the move
    to torch's own `.to` (here it raises, as torch does without CUDA): one fallback with its reason per
    move, told once. A load with `device_map` falling back so moves once too, not again through the hook."""
    from transformers import AutoModelForCausalLM

    from kernel_server import Client

    model = hit(tiny_llama)
    monkeypatch.setenv("OVERMIND_UNITS_TIMEOUT", "0.1")
    other = Client(loading.shared_client().home, role="test")
    try:
        (device,) = other.request("units_state")["devices"]
        assert other.request("units_acquire", units=device["capacity"], devices=[device["id"]], timeout_s=5)
        plain = plain_error(lambda: torch.nn.Linear(2, 2).to("cuda:0"))
        with pytest.warns(FallbackWarning, match="units"), pytest.raises(type(plain)):
            model.to("cuda:0")
        with pytest.raises(type(plain)):
            model.cuda()  # told once
        with pytest.raises(type(plain)):
            AutoModelForCausalLM.from_pretrained(str(tiny_llama), device_map="cuda:0")
    finally:
        other.close()
    fallbacks = loading.fallbacks()
    assert [f["kind"] for f in fallbacks] == ["units"] * 3, fallbacks
    assert all("was not free within" in f["reason"] and "moved without the ledger" in f["reason"]
               for f in fallbacks), fallbacks
    assert units.device_of(model) is None and placed() == []


def test_a_cached_pipelines_to_cuda_takes_one_holding(fake_gpus: None, tmp_path: Path, shell) -> None:
    """`pipe.to("cuda")` of a cached pipeline is one holding for all its modules, as `device_map` makes
    (Note [Pipelines] in units/devices.py); a component's own `.to("cuda")` is torch's."""
    from diffusers import DiffusionPipeline

    from overmind_jupyter import demo_models

    sd = str(demo_models.build_sd_pipeline(tmp_path / "sd"))
    DiffusionPipeline.from_pretrained(sd)
    pipe = DiffusionPipeline.from_pretrained(sd)
    plain = plain_error(lambda: torch.nn.Linear(2, 2).to("cuda:0"))
    with pytest.raises(type(plain)):
        pipe.unet.to("cuda")
    assert placed() == []
    assert pipe.to("cuda") is pipe and units.device_of(pipe) == "cuda:0"
    assert placed() == [("StableDiffusionPipeline(sd)", units.units_for(pipe), True)]
    assert in_arena(pipe.unet) and not loading.fallbacks()


def test_a_peft_model_over_a_cached_base_moves_as_one_holding(fake_gpus: None, tiny_llama: Path,
                                                              shell) -> None:
    """A PeftModel made over a cached base (`get_peft_model`: no cached call) moves through the ledger as
    one model, the base with its adapter; the base is not placed apart."""
    from peft import LoraConfig, get_peft_model

    base = hit(tiny_llama)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    assert peft_model.to("cuda:0") is peft_model and units.device_of(peft_model) == "cuda:0"
    assert [m.split("(")[0] for m, _, _ in placed()] == ["PeftModel"]
    assert units.device_of(base) is None and not loading.fallbacks()


# -- on a real device ----------------------------------------------------------------------------------
# The tests that move a cached model there start the daemon and the device copier first (conftest's
# `gpu_copier`): their moves fill through it, and none of them meets the notice that it is starting.

@pytest.mark.gpu
def test_gpu_a_load_that_draws_onto_a_device_is_the_plain_one(overmind_home: Path, tiny_llama: Path,
                                                              shell) -> None:
    """Item a on a GPU: the head the checkpoint lacks, and both generators after the load, are the plain
    `device_map="cuda"` load's, the first time (a miss) and the next (the marker)."""
    from transformers import LlamaForSequenceClassification

    load = LlamaForSequenceClassification.from_pretrained

    def run() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        model = load(str(tiny_llama), device_map="cuda")
        assert model.score.weight.device.type == "cuda"
        return model.score.weight.detach().cpu(), torch.rand(3, device="cuda").cpu(), torch.rand(3)

    shell.run_line_magic("overmind", "off")
    plain = run()
    shell.run_line_magic("overmind", "on")
    for first in (True, False):  # told the first time only, as on the CPU (test_a_load_that_draws_onto_...)
        told = pytest.warns(FallbackWarning, match="generator") if first else contextlib.nullcontext()
        with told:
            loaded = run()
        assert all(torch.equal(a, b) for a, b in zip(loaded, plain, strict=True))
    assert [f["kind"] for f in loading.fallbacks()] == ["random_device"] * 2


@pytest.mark.gpu
def test_gpu_a_pipeline_placed_on_a_device_moves_and_comes_back_whole(overmind_home: Path, tmp_path: Path,
                                                                      gpu_copier, shell) -> None:
    """Item c on a GPU: every module of the pipeline on the device under one holding, the pipeline runs
    there, and a release brings all of it back onto the cached weights."""
    from diffusers import DiffusionPipeline

    from overmind_jupyter import demo_models

    sd = str(demo_models.build_sd_pipeline(tmp_path / "sd"))
    DiffusionPipeline.from_pretrained(sd)
    pipe = DiffusionPipeline.from_pretrained(sd, device_map="cuda")
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    assert {p.device.type for m in modules for p in m.parameters()} == {"cuda"}
    assert [h["units"] for h in holders() if not h["context"]] == [units.units_for(pipe)]
    with units.using(pipe):
        image = pipe("hello world", num_inference_steps=2, height=16, width=16, output_type="np",
                     generator=torch.manual_seed(0)).images
    assert image.shape[-1] == 3
    units.release(pipe)
    assert {p.device.type for m in modules for p in m.parameters()} == {"cpu"} and in_arena(pipe.unet)


@pytest.mark.gpu
def test_gpu_auto_loads_plainly_a_model_the_device_has_no_room_for(overmind_home: Path, tmp_path: Path,
                                                                   gpu_copier, shell) -> None:
    """Item f on a GPU: with the device filled but for less than the model, `device_map="auto"` loads as
    called and spills to the CPU; with room, the cached model is placed whole."""
    from transformers import AutoModelForCausalLM

    from overmind_jupyter import demo_models

    path = str(demo_models.build_llama(tmp_path / "wide", "tiny", vocab_size=262_144))  # 32 MiB of bf16
    model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
    assert units.device_of(model) == "cuda:0" and {p.device.type for p in model.parameters()} == {"cuda"}
    units.release(model)
    del model
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(0)
    filler = torch.empty(free - (24 << 20), dtype=torch.uint8, device="cuda:0")  # leaves 24 MiB
    try:
        with pytest.warns(FallbackWarning, match="device_map='auto' may fill"):
            model = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
        assert "cpu" in set(model.hf_device_map.values()) or "disk" in set(model.hf_device_map.values())
        assert units.device_of(model) is None
    finally:
        del filler
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_a_hits_own_to_cuda_puts_every_tensor_on_the_device_with_its_bytes(overmind_home: Path,
                                                                              tiny_llama: Path, gpu_copier,
                                                                              shell) -> None:
    """Item h on a GPU: `model.to("cuda")` of a hit moves every parameter and buffer there, byte for byte,
    under one holding (units' own move reaches torch's `.to`, not the hook again); `.cuda()` then is
    torch's own (it is there), and a release brings the model back onto the cached weights."""
    model = hit(tiny_llama)
    expected = {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert model.to("cuda") is model
    moved = dict([*model.named_parameters(), *model.named_buffers()])
    assert moved.keys() == expected.keys()
    for name, t in moved.items():
        assert t.device == torch.device("cuda", torch.cuda.current_device()), name
        assert torch.equal(t.detach().cpu().reshape(-1).view(torch.uint8),
                           expected[name].reshape(-1).view(torch.uint8)), name
    assert model.cuda() is model
    assert [h["units"] for h in holders() if not h["context"]] == [units.units_for(model)]
    assert not loading.fallbacks()
    units.release(model)
    assert in_arena(model)
