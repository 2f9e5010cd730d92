"""A load whose result does not depend on the random numbers it draws (PEFT's) is one entry for every
state of the generator, and a hit replays its draws (Note [Replayed draws] in overmind_jupyter/draws.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from kernel_server import Client
from overmind_jupyter import demo_models, draws, randomness
from tests.helpers.kernels import USER_THREAD, execute, kernel, kernel_env
from tests.helpers.snippets import last_json, run_py

# A notebook cell after a restart: the base model and an adapter through the patched loaders, as a user
# runs them (progress bars on), with or without a seed of its own.
PEFT_CELL = """
import json, os, torch
import overmind_jupyter
from overmind_jupyter import loading
SEED = {seed!r}
if SEED is not None:
    torch.manual_seed(SEED)
if {cached}:
    overmind_jupyter.enable()
from transformers import AutoModelForCausalLM
from peft import PeftModel
base = AutoModelForCausalLM.from_pretrained({base!r}, dtype=torch.float32)
model = PeftModel.from_pretrained(base, {adapter!r}, adapter_name="fr")
model.load_adapter({other!r}, adapter_name="de")
ids = torch.arange(1, 9).unsqueeze(0)
with torch.no_grad():
    logits = model(ids).logits.double().sum().item()
    model.set_adapter("de")
    logits += model(ids).logits.double().sum().item()
lora = {{n: p.double().sum().item() for n, p in model.named_parameters() if "lora_" in n}}
print(json.dumps({{"logits": logits, "lora": lora, "rand": torch.rand(4).tolist(),
                   "seed": torch.initial_seed(), "calls": loading.calls(),
                   "fallbacks": [f["kind"] for f in loading.fallbacks()]}}))
"""


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("replayed")
    base = demo_models.build_llama(root / "llama", "tiny")
    return base, demo_models.build_lora_adapters(base, root / "lora", ("fr", "de"))


def test_an_adapter_is_a_hit_after_a_restart_with_any_seed_and_draws_as_plain(
        overmind_home: Path, adapters: tuple[Path, dict[str, Path]]) -> None:
    """PEFT's first misses (`from_pretrained`, `load_adapter`) are followed: from the first restart on,
    with another seed or none, every kernel shares their entries. Each gets the plain load's weights and
    logits, and its next random numbers are the ones a plain run from its state draws."""
    base, paths = adapters
    env = kernel_env(MKL_CBWR="AUTO,STRICT")  # logits compared bit for bit (README, Limits)

    def cell(seed: int | None, cached: bool) -> str:
        return PEFT_CELL.format(seed=seed, cached=cached, base=str(base), adapter=str(paths["fr"]),
                                other=str(paths["de"]))

    def run(kc, code: str) -> dict:  # type: ignore[no-untyped-def]
        return json.loads(execute(kc, code).strip().splitlines()[-1])

    got = []
    with kernel(env) as (km, kc):
        plain = {seed: run(kc, cell(seed, False)) for seed in (1, 2)}  # before `enable()`: the plain loads
        for seed in (1, 2, None):
            if got:
                km.restart_kernel(now=False)  # graceful, as the restart button
                kc.wait_for_ready(timeout=120)
            got.append(run(kc, USER_THREAD + cell(seed, True)))
    first, second, unseeded = got
    assert first["calls"] == {"miss": 3}
    assert second["calls"] == {"hit": 3} and unseeded["calls"] == {"hit": 3}, "another state, or none: hits"
    for seed, one in ((1, first), (2, second)):
        assert not one["fallbacks"]
        assert (one["logits"], one["lora"]) == (plain[seed]["logits"], plain[seed]["lora"])
        assert one["rand"] == plain[seed]["rand"], "the generator advanced as the plain load advances it"
    assert unseeded["seed"] not in (1, 2) and (unseeded["logits"], unseeded["lora"]) == (
        plain[1]["logits"], plain[1]["lora"])
    assert plain[1]["rand"] != plain[2]["rand"]
    with Client(overmind_home, spawn=False, role="test") as client:
        stats = client.request("status")["stats"]
    assert (stats["misses"], stats["hits"]) == (3, 6), "a load that draws is one miss, its marker no other"


# A notebook's cell that loads the base model and an adapter inside `torch.inference_mode()`, then trains.
INFERENCE_CELL = """
import json, torch, warnings
import overmind_jupyter
from overmind_jupyter import loading
torch.manual_seed({seed})
if {cached}:
    overmind_jupyter.enable()
from transformers import AutoModelForCausalLM
from peft import PeftModel
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    with torch.inference_mode():
        base = AutoModelForCausalLM.from_pretrained({base!r})
    inference = sorted(n for n, p in base.named_parameters() if p.is_inference())
    ids = torch.arange(1, 9).unsqueeze(0)
    base(ids, labels=ids).loss.backward()  # outside the mode: trains
    grads = sum(p.grad is not None for p in base.parameters())
    base.zero_grad(set_to_none=True)
    with torch.inference_mode():
        model = PeftModel.from_pretrained(base, {adapter!r})
print(json.dumps({{"inference": inference, "grads": grads, "calls": loading.calls(),
                   "said": [str(w.message) for w in said if "overmind" in str(w.message)]}}))
"""


def test_loads_inside_inference_mode_train_after_a_hit_and_an_adapter_is_one_entry(
        overmind_home: Path, adapters: tuple[Path, dict[str, Path]]) -> None:
    """Note [Hits inside inference_mode] in loading.py: a hit made inside the mode trains in a later cell, as
    the plain load does; and PEFT's load inside it, whose `.data =` asks torch about a weight drawn at
    random, is still found not to depend on its draws: one entry, a hit after the restart, nothing said."""
    base, paths = adapters

    def run(seed: int, cached: bool) -> dict:
        return last_json(run_py(INFERENCE_CELL.format(seed=seed, cached=cached, base=str(base),
                                                      adapter=str(paths["fr"]))))

    plain, miss, hit = run(1, False), run(1, True), run(2, True)
    assert (miss["calls"], hit["calls"]) == ({"miss": 2}, {"hit": 2}), (miss, hit)
    for got in (miss, hit):
        assert got["inference"] == plain["inference"] == [] and got["grads"] == plain["grads"] > 0, got
        assert got["said"] == [], got["said"]


# A loader of the notebook's own that draws (a layer's initialisation) and then overwrites all of it.
OWN_LOADER = """
import json, torch
from overmind_jupyter import loading
SEED = {seed!r}
if SEED is not None:
    torch.manual_seed(SEED)
def load(path):
    layer = torch.nn.Linear(16, 8)
    layer.load_state_dict(torch.load(path))
    return layer
layer = loading.cached(load, {path!r})
print(json.dumps({{"weight": layer.weight.double().sum().item(), "rand": torch.rand(4).tolist(),
                   "calls": loading.calls()}}))
"""


def own_load_plainly(path: Path, seed: int) -> dict:
    """What OWN_LOADER's load gives without the cache, here: the same operations from the same seed (this
    process's generator is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = torch.nn.Linear(16, 8)
        layer.load_state_dict(torch.load(path))
        return {"weight": layer.weight.double().sum().item(), "rand": torch.rand(4).tolist()}


def test_another_loader_is_followed_from_its_second_miss_and_a_seeded_kernel_finds_its_state_first(
        overmind_home: Path, tmp_path: Path) -> None:
    """A loader not known to draw: its first miss is keyed by the state (and marks the call); a kernel
    with that seed finds that entry; another seed's miss is followed, and from then on every state hits,
    the generator advanced as plain."""
    weights = tmp_path / "layer.pt"
    torch.save(torch.nn.Linear(16, 8).state_dict(), weights)

    def run(seed: int | None) -> dict:
        return last_json(run_py(OWN_LOADER.format(seed=seed, path=str(weights)), cwd=tmp_path))

    got = {name: run(seed) for name, seed in (("first", 1), ("again", 1), ("second", 2), ("third", 3))}
    assert [g["calls"] for g in got.values()] == [{"miss": 1}, {"hit": 1}, {"miss": 1}, {"hit": 1}]
    for name, seed in (("first", 1), ("again", 1), ("second", 2), ("third", 3)):
        plain = own_load_plainly(weights, seed)
        assert (got[name]["weight"], got[name]["rand"]) == (plain["weight"], plain["rand"]), name
    assert run(None)["calls"] == {"hit": 1}


# -- what the following sees, on torch's own operations ----------------------------------------------------

def follow(load) -> tuple[draws.Draws, bytes, bytes, object]:  # type: ignore[no-untyped-def]
    before = torch.random.get_rng_state().numpy().tobytes()
    with draws.following() as drew:
        result = load()
    return drew, before, torch.random.get_rng_state().numpy().tobytes(), result


def linear_then_checkpoint() -> torch.nn.Module:
    """What PEFT does: a layer initialised at random, then overwritten as a whole from the checkpoint."""
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16).to(torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.ones(4, 8))
        layer.bias.zero_()
    return layer


def test_a_layer_overwritten_from_its_checkpoint_does_not_depend_on_the_draws() -> None:
    drew, before, after, _ = follow(linear_then_checkpoint)
    assert drew.independent() is None and len(drew.ops) == 2
    assert draws.replays(drew.ops, before, after) and not draws.replays(drew.ops[:1], before, after)
    torch.random.set_rng_state(torch.frombuffer(bytearray(before), dtype=torch.uint8))
    randomness.replay(drew.ops)
    assert torch.random.get_rng_state().numpy().tobytes() == after


@pytest.mark.parametrize("load, why", [  # each made inside the following: lambdas, not bound methods
    (lambda: torch.nn.Linear(8, 4), "outlive the load"),
    (lambda: torch.nn.Linear(8, 4).weight.to(torch.bfloat16), "outlive the load"),
    (lambda: torch.nn.Linear(8, 4).weight.detach()[:2].clone(), "outlive the load"),  # noqa: PLW0108
    (lambda: torch.zeros(4, 8).copy_(torch.nn.Linear(8, 4).weight), "outlive the load"),
    (lambda: torch.zeros(8)[:4].copy_(torch.rand(4)), "outlive the load"),
    (lambda: torch.rand(4, 8)[:2].zero_(), "outlive the load"),  # noqa: PLW0108
    (lambda: torch.cat([torch.zeros(2), torch.rand(2)]) * 0 + 1, "outlive the load"),  # through a list's
    (lambda: torch.stack((torch.zeros(2), torch.rand(2)))[0], "outlive the load"),  # and a tuple's tensors
    (lambda: torch.rand(4).split(2)[1].clone(), "outlive the load"),  # noqa: PLW0108 (a list of results)
    (lambda: torch.zeros(3) if torch.equal(torch.rand(2), torch.zeros(2)) else None, "aten.equal.default read"),
    (lambda: torch.zeros(3) if torch.rand(1).item() > 2 else None, "aten._local_scalar_dense.default"),
    (lambda: torch.zeros(3) if bool((torch.rand(2) > 2).any()) else None, "drawn at random"),
    (lambda: torch.zeros(len(torch.rand(5).tolist())), "tolist() read values"),
    (lambda: torch.zeros(int(torch.rand(3).numpy().sum() > 9)), "numpy() read values"),
    (lambda: torch.nonzero(torch.rand(6) > 0.5).shape, "aten.nonzero.default read values"),
    (lambda: torch.zeros(2).uniform_(generator=torch.Generator().manual_seed(0)), "generator of the load's own"),
    (lambda: torch.multinomial(torch.ones(4), 2), "not replayed"),
])
def test_what_makes_a_result_depend_on_the_draws(load, why: str) -> None:  # type: ignore[no-untyped-def]
    drew, _, _, result = follow(load)
    assert why in (drew.independent() or ""), drew.verdict
    del result


def test_a_thread_the_load_starts_is_not_followed() -> None:
    def load() -> torch.Tensor:
        out = torch.zeros(4)
        worker = threading.Thread(target=lambda: out.copy_(torch.ones(4)))
        worker.start()
        worker.join()
        return out

    drew, _, _, _ = follow(load)
    assert "started a thread" in (drew.independent() or "")
    assert threading.Thread.start is not None and threading.Thread.start.__name__ == "start", "put back"


def test_a_draw_the_following_does_not_see_breaks_the_replay() -> None:
    """A draw in a thread that was running already is not followed: the replay then leaves the generator
    elsewhere, and the load is keyed by the state as before."""
    go, done = threading.Event(), threading.Event()

    def elsewhere() -> None:
        go.wait()
        torch.rand(16)
        done.set()

    worker = threading.Thread(target=elsewhere)
    worker.start()

    def load() -> torch.nn.Module:
        layer = linear_then_checkpoint()
        go.set()
        done.wait()
        return layer

    drew, before, after, _ = follow(load)
    worker.join()
    assert drew.independent() is None
    assert not draws.replays(drew.ops, before, after)


def test_the_recorded_draws_pickle_as_the_entry_holds_them() -> None:
    import pickle

    drew, before, after, _ = follow(linear_then_checkpoint)
    ops = pickle.loads(pickle.dumps(drew.ops, protocol=pickle.HIGHEST_PROTOCOL))
    assert draws.replays(ops, before, after)
    assert json.dumps([op[0] for op in ops]) == '["aten.uniform_.default", "aten.uniform_.default"]'


def test_a_result_that_cannot_be_cached_is_not_said_to_be_cached_for_a_seed(overmind_home: Path) -> None:
    """A load that draws and returns what cannot be pickled says that it is not cached, and never that it
    "is cached for the state of the torch generator" with advice to seed it, which would change nothing
    (the notice used to come before the publish that then failed)."""
    import warnings

    from overmind_jupyter import loading

    def make(width: int) -> torch.nn.Module:
        layer = torch.nn.Linear(width, width)
        layer.gen = (x for x in range(3))  # a generator: no pickle of it
        return layer

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            loading.cached(make, 4)
    texts = [str(w.message) for w in said]
    assert texts and all("will not be cached" in t and "seed it" not in t for t in texts), texts


SEED_NOTICE = """
import json, shutil, warnings, torch
import overmind_jupyter
overmind_jupyter.enable()
from transformers import AutoModelForSequenceClassification, logging
logging.set_verbosity_error()
other = shutil.copytree({path!r}, {other!r})
said = {{}}
for path, how in (({path!r}, 1234), (other, "torch.seed")):  # the marker of the first load sends the second on
    for seed in (None, how):
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            if seed is None:
                torch.rand(1)
            elif seed == "torch.seed":
                torch.seed()  # a random 64-bit seed, as torch gives each process: not the user's
            else:
                torch.manual_seed(seed)
            AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
        said.setdefault(str(seed), []).extend(str(w.message) for w in told if "draws random numbers" in str(w.message))
print(json.dumps(said))
"""


def test_a_load_that_draws_is_told_to_seed_only_where_it_was_not(tiny_llama: Path, overmind_home: Path,
                                                                  tmp_path: Path) -> None:
    """A head the checkpoint lacks is drawn at random: the notice that the load is cached per state of
    torch's generator advises seeding it, except where the load started from `torch.manual_seed(N)` with
    nothing drawn since, where it says so (the advice was given to kernels that had just seeded); torch's
    own seed of a fresh process (or `torch.seed()`) is no seed of the user's, and gets the advice."""
    said = last_json(run_py(SEED_NOTICE.format(path=str(tiny_llama), other=str(tmp_path / "other"))))
    (seeded,) = said["1234"]
    assert "here torch.manual_seed(1234), nothing drawn since" in seeded and "seed it" not in seeded, seeded
    (unseeded,) = said["torch.seed"]
    assert "seed it (torch.manual_seed) before the load" in unseeded, unseeded
