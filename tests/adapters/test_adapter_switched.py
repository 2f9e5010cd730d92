"""Switched mode: what PEFT cannot route per row (DoRA, merged weights) is served one adapter at a time."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from overmind_jupyter import adapters
from overmind_jupyter.adapters import BASE, RoutingUnavailableError

from .adapter_models import CHOICES, activate, build_peft, serial_generate, serial_logits


@pytest.fixture
def dora_model() -> Any:
    return build_peft(("fr", "de", "x"), dora=("x",))


def test_dora_adapter_is_detected_and_switched(dora_model: Any) -> None:
    ids = torch.randint(2, 128, (1, 5))
    choices = ("fr", "de", "x", BASE)
    expected = {c: serial_logits(dora_model, c, input_ids=ids) for c in choices}
    activate(dora_model, "fr")
    with adapters.gate(dora_model) as g:
        state = g.state()
        assert g.mode == "hybrid"
        assert state["routing"] == {"fr": "routed", "de": "routed", "x": "switched", BASE: "routed"}
        assert "DoRA" in state["blockers"]["x"]
        for c in choices:
            assert torch.equal(g(input_ids=ids, adapter=c).logits, expected[c]), c
        # a per-row request across the routed and the switched side runs in parts and comes back in row order
        rows = g(input_ids=ids.repeat(4, 1), adapter=["x", "fr", BASE, "x"]).logits
        for i, c in enumerate(["x", "fr", BASE, "x"]):
            torch.testing.assert_close(rows[i : i + 1], expected[c], rtol=0, atol=1e-5)
        out = g.generate(input_ids=ids.repeat(2, 1), adapter=["de", "x"], max_new_tokens=4, do_sample=False)
        assert torch.equal(
            out[1:], serial_generate(dora_model, "x", input_ids=ids, max_new_tokens=4, do_sample=False)
        )
        assert g.state()["switches"] >= 2


def test_routed_mode_refuses_dora(dora_model: Any) -> None:
    with pytest.raises(RoutingUnavailableError, match="DoRA"):
        adapters.gate(dora_model, mode="routed")


def test_hybrid_traffic_from_threads(dora_model: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randint(2, 128, (1, 3), generator=gen) for _ in range(4)]
    choices = ("fr", "de", "x", BASE)
    expected = {
        (i, c): serial_logits(dora_model, c, input_ids=x) for i, x in enumerate(inputs) for c in choices
    }
    wrong: list[tuple[int, str]] = []
    with adapters.gate(dora_model, max_wait_s=0.02) as g:

        def run(t: int) -> None:
            for k in range(40):
                i, c = (t + k) % len(inputs), choices[(t + 2 * k) % len(choices)]
                if not torch.equal(g(input_ids=inputs[i], adapter=c).logits, expected[i, c]):
                    wrong.append((i, c))

        workers = [threading.Thread(target=run, args=(t,)) for t in range(6)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert g.state()["in_flight"] == {}
    assert wrong == []


def test_forced_switched_mode_equals_reference(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (2, 4))
    expected = {c: serial_logits(peft_model, c, input_ids=ids) for c in CHOICES}
    activate(peft_model, "de")
    with adapters.gate(peft_model, mode="switched") as g:
        assert g.mode == "switched" and g.state()["blockers"] == {"*": "mode='switched' was asked for"}
        for c in (*CHOICES, "fr", BASE):
            assert torch.equal(g(input_ids=ids, adapter=c).logits, expected[c]), c
        assert g.state()["active"] == [BASE]
    # closing puts back what switching changed
    assert peft_model.active_adapter == "de"
    assert all(not layer.disable_adapters for layer in _lora_layers(peft_model))


def test_merged_adapter_switches_by_merging(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (1, 4))
    expected = {c: serial_logits(peft_model, c, input_ids=ids) for c in CHOICES}
    activate(peft_model, "fr")
    with adapters.gate(peft_model) as g:
        assert g.mode == "routed"
        g.merge("fr")
        state = g.state()
        assert state["mode"] == "switched" and "merged" in state["blockers"]["*"]
        for c in ("fr", "de", BASE, "fr", "es"):
            # merged weights round differently from the unmerged path: close, not equal
            torch.testing.assert_close(g(input_ids=ids, adapter=c).logits, expected[c], rtol=0, atol=1e-4)
        assert _merged(peft_model) == {"es"}
        g.unmerge()
        assert g.mode == "routed" and _merged(peft_model) == set()
        for c in CHOICES:
            torch.testing.assert_close(g(input_ids=ids, adapter=c).logits, expected[c], rtol=0, atol=1e-4)


def test_switches_counts_only_changes_of_the_layers(peft_model: Any) -> None:
    """`switches` counts the times the gate changed which adapter the layers apply: not a routed gate's first
    request, nor the first after an exclusive section (a mix), which find the layers as they need them."""
    ids = torch.randint(2, 128, (1, 4))
    activate(peft_model, "fr")
    with adapters.gate(peft_model) as g:
        for c in ("fr", "de", BASE, "fr"):
            g(input_ids=ids, adapter=c)
        g.mix({"fr": 0.5, "de": 0.5}, name="fr_de")
        g(input_ids=ids, adapter="fr_de")
        assert g.state()["switches"] == 0, "a routed gate switches nothing"
    activate(peft_model, "fr")
    with adapters.gate(peft_model, mode="switched") as g:
        g(input_ids=ids, adapter="fr")
        assert g.state()["switches"] == 0, "the layers already applied fr"
        for c in ("de", "de", "fr", BASE):
            g(input_ids=ids, adapter=c)
        assert g.state()["switches"] == 3
        with g.exclusive():  # forgets the key: the next request re-checks the layers, which are still right
            pass
        g(input_ids=ids, adapter=BASE)
        assert g.state()["switches"] == 3


def test_model_merged_before_the_gate(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (1, 4))
    expected = {c: serial_logits(peft_model, c, input_ids=ids) for c in CHOICES}
    activate(peft_model, "de")
    peft_model.base_model.merge_adapter(["de"])
    with adapters.gate(peft_model) as g:
        assert g.mode == "switched"
        for c in ("fr", "de"):
            torch.testing.assert_close(g(input_ids=ids, adapter=c).logits, expected[c], rtol=0, atol=1e-4)
    # closing puts the merged adapter back as it was
    assert _merged(peft_model) == {"de"}


def _lora_layers(model: Any) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _merged(model: Any) -> set[str]:
    return {name for layer in _lora_layers(model) for name in layer.merged_adapters}
