"""PEFT's calls that change which adapter layers apply, made from another thread while 8 threads send routed
and engine requests through the gate: every answer equals the serial PEFT reference (0 wrong).

Each call, made outside `gate.exclusive()`, takes the gate's exclusive side by itself (Note [Changes behind
the gate] in overmind_jupyter/adapters/guarding.py): it waits for the requests in flight and holds new ones
until it returns, or until its `with` block ends. A change the gate cannot see coming (a layer-level call) is
detected: the requests it would have made wrong fail with `AdapterChangedError` instead.

The reference: a second copy of the model (same seeds, same weights), one request at a time, its adapter set
by PEFT's own `set_adapter`, no gate. Real threads, real PEFT, fp32.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from overmind_jupyter import adapters, patching
from overmind_jupyter.adapters import BASE, AdapterChangedError, GateDeadlockError, UnknownAdapterError

from .adapter_models import ADAPTERS, CHOICES, build_peft, serial_generate, serial_logits

THREADS = 8
PER_THREAD = 9  # forward, generate and engine requests in turn: 72 per test
NEW_TOKENS = 3


@dataclass
class Reference:
    inputs: list[torch.Tensor]
    logits: dict[tuple[int, str], torch.Tensor]
    tokens: dict[tuple[int, str], torch.Tensor]
    es2_logits: dict[int, torch.Tensor]  # adapter "es" after a hot-swap to the weights of "es2"
    es2_tokens: dict[int, torch.Tensor]
    mix_logits: torch.Tensor  # PEFT's cat mix 0.6 fr + 0.4 de, on inputs[0]


@pytest.fixture(scope="module")
def reference(adapter_dirs: dict[str, Path]) -> Reference:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every thread of the tests (a module fixture runs before conftest's)
    try:
        return _reference(adapter_dirs)
    finally:
        torch.set_num_threads(threads)


def _reference(adapter_dirs: dict[str, Path]) -> Reference:
    from peft.utils.hotswap import hotswap_adapter

    gen = torch.Generator().manual_seed(21)
    inputs = [torch.randint(2, 128, (1, 3 + i % 3), generator=gen) for i in range(4)]
    twin = build_peft()
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    logits = {(i, c): serial_logits(twin, c, input_ids=x) for i, x in enumerate(inputs) for c in CHOICES}
    tokens = {(i, c): serial_generate(twin, c, input_ids=x, **options) for i, x in enumerate(inputs) for c in CHOICES}
    twin.add_weighted_adapter(["fr", "de"], [0.6, 0.4], adapter_name="mix", combination_type="cat")
    mix = serial_logits(twin, "mix", input_ids=inputs[0])
    hotswap_adapter(twin, str(adapter_dirs["es2"]), adapter_name="es", torch_device="cpu")
    es2_logits = {i: serial_logits(twin, "es", input_ids=x) for i, x in enumerate(inputs)}
    es2_tokens = {i: serial_generate(twin, "es", input_ids=x, **options) for i, x in enumerate(inputs)}
    return Reference(inputs, logits, tokens, es2_logits, es2_tokens, mix)


@dataclass
class Outcome:
    wrong: list[tuple[str, int, str]] = field(default_factory=list)
    failed: list[BaseException] = field(default_factory=list)  # errors a test allows (a deleted adapter)
    answered: int = 0
    changes: int = 0  # calls the changer made while the traffic ran


@dataclass
class Case:
    """The call under test, made by `change(model, gate, ref, k)` in another thread, over and over."""

    change: Callable[[Any, adapters.AdapterGate, Reference, int, dict[str, Path]], None]
    choices: tuple[str, ...] = CHOICES
    allowed: type[BaseException] | tuple[type[BaseException], ...] = ()
    es_swapped: bool = False  # "es" may answer with the weights of "es2" (hot-swap)
    merged: bool = False  # merged weights round differently: logits within 1e-4


def _right(kind: str, out: Any, i: int, c: str, ref: Reference, case: Case) -> bool:
    if kind == "forward":
        expected = [ref.logits[i, c]] + ([ref.es2_logits[i]] if case.es_swapped and c == "es" else [])
        if case.merged:
            return any(torch.allclose(out, e, rtol=0, atol=1e-4) for e in expected)
        return any(torch.equal(out, e) for e in expected)
    expected = [ref.tokens[i, c]] + ([ref.es2_tokens[i]] if case.es_swapped and c == "es" else [])
    return any(torch.equal(out, e) for e in expected)


def run_traffic(
    g: adapters.AdapterGate, model: Any, ref: Reference, case: Case, dirs: dict[str, Path]
) -> Outcome:
    """8 threads of routed forwards, routed generates and engine requests, while one more thread makes the
    call of `case` again and again until the traffic ends."""
    outcome = Outcome()
    lock = threading.Lock()
    done = threading.Event()
    start = threading.Barrier(THREADS + 1)
    crashed: list[BaseException] = []
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False}

    def client(t: int) -> None:
        rng = random.Random(t)
        start.wait()
        for k in range(PER_THREAD):
            i, c = rng.randrange(len(ref.inputs)), rng.choice(case.choices)
            kind = ("forward", "generate", "engine")[(t + k) % 3]
            x = ref.inputs[i]
            try:
                if kind == "forward":
                    out = g(input_ids=x, adapter=c).logits
                elif kind == "generate":
                    out = g.generate(input_ids=x, adapter=c, **options)
                else:
                    out = g.submit(input_ids=x, adapter=c, **options).result(timeout=120)
            except case.allowed as e:  # type: ignore[misc]
                with lock:
                    outcome.failed.append(e)
                continue
            right = _right(kind, out, i, c, ref, case)
            with lock:
                outcome.answered += 1
                if not right:
                    outcome.wrong.append((kind, i, c))

    def changer() -> None:
        start.wait()
        k = 0
        while not done.is_set() or k < 2:
            case.change(model, g, ref, k, dirs)
            k += 1
            time.sleep(0.005)
        outcome.changes = k

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            torch.set_num_threads(1)  # as the reference's thread (conftest): the same kernels, the same bits
            try:
                body()
            except BaseException as e:  # noqa: BLE001 -- raised again in the test's thread
                crashed.append(e)

        return run

    clients = [threading.Thread(target=guarded(lambda t=t: client(t))) for t in range(THREADS)]
    side = threading.Thread(target=guarded(changer))
    for th in [*clients, side]:
        th.start()
    for th in clients:
        th.join()
    done.set()
    side.join()
    if crashed:
        raise crashed[0]
    return outcome


# -- the calls -----------------------------------------------------------------------------------------------


def _disable_adapter(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
    with model.disable_adapter(), torch.no_grad():
        # inside the block the model is the base model, for this thread's direct calls
        direct = model(input_ids=ref.inputs[k % 4]).logits
        time.sleep(0.01)
    assert torch.equal(direct, ref.logits[k % 4, BASE])


def _disable_adapter_layers(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
    model.disable_adapter_layers()
    time.sleep(0.01)
    with g.exclusive():
        model.enable_adapter_layers()


def _enable_adapter_layers(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
    with g.exclusive():
        model.disable_adapter_layers()
    time.sleep(0.01)
    model.enable_adapter_layers()


def _set_adapter(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
    model.set_adapter(ADAPTERS[k % len(ADAPTERS)])


def _merge_adapter(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
    model.merge_adapter()
    time.sleep(0.01)
    with g.exclusive():
        model.unmerge_adapter()


def _unmerge_adapter(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
    with g.exclusive():
        model.merge_adapter()
    time.sleep(0.01)
    model.unmerge_adapter()


def _delete_adapter(model: Any, g: Any, ref: Reference, k: int, dirs: dict[str, Path]) -> None:
    model.delete_adapter("es")
    time.sleep(0.005)
    model.load_adapter(str(dirs["es"]), adapter_name="es")  # the same weights again


def _load_adapter(model: Any, g: Any, ref: Reference, k: int, dirs: dict[str, Path]) -> None:
    name = f"it{k}"
    model.load_adapter(str(dirs["es2"]), adapter_name=name)
    assert torch.equal(g(input_ids=ref.inputs[0], adapter=name).logits, ref.es2_logits[0])
    model.delete_adapter(name)


def _add_weighted_adapter(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
    name = f"mix{k}"
    model.add_weighted_adapter(["fr", "de"], [0.6, 0.4], adapter_name=name, combination_type="cat")
    got = g(input_ids=ref.inputs[0], adapter=name).logits
    torch.testing.assert_close(got, ref.mix_logits, rtol=0, atol=1e-5)
    model.delete_adapter(name)


def _layer_calls(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
    from peft.functional import set_adapter
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:  # what `with model.disable_adapter():` does, without PEFT's model-level method
        layer.enable_adapters(False)
    time.sleep(0.01)
    for layer in layers:
        layer.enable_adapters(True)
    set_adapter(model, ADAPTERS[k % len(ADAPTERS)])  # PEFT's functional API: the layers' own set_adapter
    layers[k % len(layers)].merge()
    layers[k % len(layers)].unmerge()


def _hotswap(model: Any, g: Any, ref: Reference, k: int, dirs: dict[str, Path]) -> None:
    from peft.utils.hotswap import hotswap_adapter

    source = dirs["es2"] if k % 2 == 0 else dirs["es"]
    hotswap_adapter(model, str(source), adapter_name="es", torch_device="cpu")


CASES: dict[str, Case] = {
    "disable_adapter()": Case(_disable_adapter),
    "disable_adapter_layers()": Case(_disable_adapter_layers),
    "enable_adapter_layers()": Case(_enable_adapter_layers),
    "set_adapter": Case(_set_adapter),
    "merge_adapter": Case(_merge_adapter, merged=True),
    "unmerge_adapter": Case(_unmerge_adapter, merged=True),
    "delete_adapter": Case(_delete_adapter, allowed=UnknownAdapterError),
    "load_adapter": Case(_load_adapter),
    "add_weighted_adapter": Case(_add_weighted_adapter),
    "hotswap_adapter": Case(_hotswap, es_swapped=True),
    "layer-level calls": Case(_layer_calls, merged=True),
}


@pytest.mark.parametrize("call", list(CASES))
def test_a_change_from_another_thread_waits_for_the_requests(
    call: str, reference: Reference, adapter_dirs: dict[str, Path]
) -> None:
    case = CASES[call]
    model = build_peft()
    with adapters.gate(model, window_s=0.005) as g:
        outcome = run_traffic(g, model, reference, case, adapter_dirs)
        state = g.state()
    assert outcome.wrong == [], f"{call}: {len(outcome.wrong)} wrong answers: {outcome.wrong[:5]}"
    assert outcome.changes >= 2
    assert outcome.answered + len(outcome.failed) == THREADS * PER_THREAD
    assert outcome.answered >= THREADS * PER_THREAD // 2, outcome.failed[:3]
    assert state["changes_behind"] == 0, "a guarded call was seen as a change behind the gate"
    assert state["in_flight"] == {} and not state["exclusive"]


def test_transformers_model_calls_wait_too(hf_model: Any, reference: Reference, adapter_dirs: dict[str, Path]) -> None:
    """A transformers model with PEFT integration: its `load_adapter`, and the layers' own calls (its other
    adapter methods want a newer PEFT than the one installed)."""
    from peft.functional import set_adapter
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in hf_model.modules() if isinstance(m, BaseTunerLayer)]

    def change(model: Any, g: Any, ref: Reference, k: int, dirs: dict[str, Path]) -> None:
        name = f"it{k}"
        model.load_adapter(str(dirs["es2"]), adapter_name=name)
        assert torch.equal(g(input_ids=ref.inputs[0], adapter=name).logits, ref.es2_logits[0])
        g.delete_adapter(name)
        for layer in layers:
            layer.enable_adapters(False)
        time.sleep(0.01)
        for layer in layers:
            layer.enable_adapters(True)
        set_adapter(model, ADAPTERS[k % len(ADAPTERS)])

    with adapters.gate(hf_model, window_s=0.005) as g:
        outcome = run_traffic(g, hf_model, reference, Case(change), adapter_dirs)
        assert g.state()["changes_behind"] == 0
    assert outcome.wrong == [] and outcome.changes >= 2 and not outcome.failed


def test_a_change_behind_the_gate_is_detected_never_answered_wrong(
    reference: Reference, adapter_dirs: dict[str, Path]
) -> None:
    """A flag written by hand is no call the gate can make wait: the requests it reaches fail with
    `AdapterChangedError` (each of them would otherwise have been a base-model answer), and the gate re-reads
    the model before the next one."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = build_peft()
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def change(model: Any, g: Any, ref: Reference, k: int, dirs: Any) -> None:
        for layer in layers:
            layer._disable_adapters = True  # what enable_adapters(False) sets, without the method
        time.sleep(0.1)
        for layer in layers:
            layer._disable_adapters = False
        time.sleep(0.02)

    case = Case(change, allowed=AdapterChangedError)
    with pytest.warns(adapters.AdapterWarning, match="changed without gate.exclusive"), adapters.gate(model) as g:
        outcome = run_traffic(g, model, reference, case, adapter_dirs)
        seen = g.state()["changes_behind"]
        for c in CHOICES:  # and it serves right again afterwards
            assert torch.equal(g(input_ids=reference.inputs[1], adapter=c).logits, reference.logits[1, c]), c
    assert outcome.wrong == [], f"{len(outcome.wrong)} wrong answers: {outcome.wrong[:5]}"
    assert seen > 0
    assert all("exclusive" in str(e) for e in outcome.failed)
    print(f"\nflags written by hand: {len(outcome.failed)} requests failed, {outcome.answered} right, 0 wrong")


def test_changes_inside_exclusive_work_as_before(reference: Reference) -> None:
    model = build_peft()
    x = reference.inputs[0]
    with adapters.gate(model) as g:
        with g.exclusive():
            with model.disable_adapter(), torch.no_grad():
                assert torch.equal(model(input_ids=x).logits, reference.logits[0, BASE])
            model.set_adapter("de")
            model.disable_adapter_layers()
            model.enable_adapter_layers()
        for c in CHOICES:
            assert torch.equal(g(input_ids=x, adapter=c).logits, reference.logits[0, c]), c
        assert g.state()["changes_behind"] == 0
    assert model.active_adapter == "de"


@pytest.mark.parametrize("merged", [False, True], ids=["switched", "merged"])
def test_a_request_between_guarded_layer_calls_gets_its_adapter(reference: Reference, merged: bool) -> None:
    """`peft.functional.set_adapter` walks the layers one guarded call at a time, and a request may be
    admitted between two of them: the layers then disagree on the active adapter, while the first layer (what
    the gate's quick check reads) already looks right. The switch sets every layer; nothing is seen as a change
    behind the gate. (In CI this was a 1-in-20 failure of the threaded test above.)"""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = build_peft()
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    x = reference.inputs[2]
    with adapters.gate(model, mode="switched") as g:
        assert torch.equal(g(input_ids=x, adapter="fr").logits, reference.logits[2, "fr"])
        if merged:
            layers[0].merge()  # merged layers: the gate merges the adapter it switches to
        for layer in layers[len(layers) // 2 :]:
            layer.set_adapter("de")  # half of what peft.functional.set_adapter(model, "de") does
        assert layers[0].active_adapters == ["fr"]
        got = g(input_ids=x, adapter="fr").logits
        if merged:
            torch.testing.assert_close(got, reference.logits[2, "fr"], rtol=0, atol=1e-4)
        else:
            assert torch.equal(got, reference.logits[2, "fr"])
        assert g.state()["changes_behind"] == 0
        assert {tuple(layer.active_adapters) for layer in layers} == {("fr",)}


def test_requests_inside_a_guarded_change_of_the_same_thread_are_refused(reference: Reference) -> None:
    model = build_peft()
    x = reference.inputs[0]
    with adapters.gate(model) as g:
        with model.disable_adapter():
            with pytest.raises(GateDeadlockError, match="exclusive section"):
                g(input_ids=x, adapter="fr")
            with pytest.raises(GateDeadlockError):
                g.generate(input_ids=x, adapter="de", max_new_tokens=2)
        with g.use("fr"), pytest.raises(GateDeadlockError):
            model.set_adapter("de")  # inside a request of the same gate: it would wait for itself
        assert torch.equal(g(input_ids=x, adapter="es").logits, reference.logits[0, "es"])
        assert g.state()["in_flight"] == {}


@pytest.mark.parametrize("order", ["patch first", "gate first"])
def test_guard_patches_stack_over_other_patches_and_leave_with_the_last_gate(
    order: str, adapter_dirs: dict[str, Path]
) -> None:
    """`%overmind on` patches `PeftModel.load_adapter` too (patch layer 0): the guard wraps it (layer 1) in
    whichever order the two came, so the cached load runs inside the exclusive section; each patch is removed on
    its own, the guard's with the last gate."""
    from peft import PeftModel

    original = PeftModel.__dict__["load_adapter"]
    seen: list[bool] = []
    gates: list[adapters.AdapterGate] = []

    def inner(original: Any) -> Any:
        def load_adapter(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(gates[0].state()["exclusive"])
            return original.__get__(self, type(self))(*args, **kwargs)

        return load_adapter

    first, second = build_peft(), build_peft()
    try:
        if order == "patch first":
            assert patching.patch(PeftModel, "load_adapter", inner)
        gates += [adapters.gate(first), adapters.gate(second)]
        if order == "gate first":
            assert patching.patch(PeftModel, "load_adapter", inner)
        first.load_adapter(str(adapter_dirs["es2"]), adapter_name="it")
        assert seen == [True], "the other patch ran outside the exclusive section"
        assert "it" in gates[0].adapters
        gates[0].close()
        assert any("load_adapter (layer 1)" in p for p in patching.patched()), "one gate is still open"
        gates[1].close()
        assert not any("(layer 1)" in p for p in patching.patched())
        assert patching.is_patched(PeftModel, "load_adapter")  # the other patch stays
        second.load_adapter(str(adapter_dirs["es2"]), adapter_name="it")
        assert seen == [True, False]
    finally:
        for g in gates:
            g.close()
        patching.unpatch(PeftModel, "load_adapter")
    assert not patching.is_patched(PeftModel, "load_adapter")
    assert PeftModel.__dict__["load_adapter"] is original
