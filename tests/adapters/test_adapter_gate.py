"""The gate's surface: creation, adapter names, routed answers against PEFT's serial answers, state, close."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from overmind_jupyter import adapters
from overmind_jupyter.adapters import BASE, GateClosedError, NoAdaptersError, UnknownAdapterError

from .adapter_models import (
    ADAPTERS,
    CHOICES,
    activate,
    build_base,
    build_peft,
    hooks_on,
    serial_generate,
    serial_logits,
)


def test_import_is_light() -> None:
    code = (
        "import sys, overmind_jupyter.adapters as a; "
        "heavy = [m for m in ('torch', 'peft', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy; assert 'gate' in dir(a)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_gate_per_model(peft_model: Any) -> None:
    g = adapters.gate(peft_model)
    try:
        assert adapters.gate(peft_model) is g
        assert adapters.gate(peft_model, max_wait_s=0.1) is g
        with pytest.raises(ValueError, match="already has an open gate"):
            adapters.gate(peft_model, mode="switched")
    finally:
        g.close()
    assert adapters.gate(peft_model) is not g
    adapters.gate(peft_model).close()


def test_model_without_adapters_is_refused() -> None:
    with pytest.raises(NoAdaptersError, match="load_adapter"):
        adapters.gate(build_base())


def test_unknown_adapter_names_the_available_ones(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (2, 4))
    with adapters.gate(peft_model) as g:
        with pytest.raises(UnknownAdapterError, match="available: de, es, fr"):
            g(input_ids=ids, adapter="it")
        with pytest.raises(UnknownAdapterError):
            g(input_ids=ids, adapter=["fr", "xx"])
        with pytest.raises(ValueError, match="one per row"):
            g(input_ids=ids, adapter=["fr", "de", "es"])
        with pytest.raises(UnknownAdapterError):
            g.switch("it")
        assert g.state()["in_flight"] == {}


@pytest.mark.parametrize("kind", ["peft", "transformers"])
def test_routed_forward_equals_serial_reference(kind: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue("peft_model" if kind == "peft" else "hf_model")
    ids = torch.randint(2, 128, (1, 5))
    expected = {c: serial_logits(model, c, input_ids=ids) for c in CHOICES}
    activate(model, "fr")
    with adapters.gate(model) as g:
        assert g.state()["kind"] == kind and g.mode == "routed"
        for c in CHOICES:
            assert torch.equal(g(input_ids=ids, adapter=c).logits, expected[c]), c
        # one adapter per row: PEFT's mixed batch, equal to the solo rows within fp32 rounding
        rows = g(input_ids=ids.repeat(4, 1), adapter=list(CHOICES)).logits
        for i, c in enumerate(CHOICES):
            torch.testing.assert_close(rows[i : i + 1], expected[c], rtol=0, atol=1e-5)


def test_routed_generate_equals_serial_reference(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (2, 5))
    options = {"max_new_tokens": 6, "do_sample": False}
    expected = {c: serial_generate(peft_model, c, input_ids=ids, **options) for c in CHOICES}
    with adapters.gate(peft_model) as g:
        for c in CHOICES:
            assert torch.equal(g.generate(input_ids=ids, adapter=c, **options), expected[c]), c
        mixed = g.generate(input_ids=ids, adapter=["de", BASE], **options)
        assert torch.equal(mixed[0], expected["de"][0]) and torch.equal(mixed[1], expected[BASE][1])


def test_beam_search_repeats_row_names(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (2, 4))
    options = {"max_new_tokens": 4, "do_sample": False, "num_beams": 2}
    expected = [
        serial_generate(peft_model, c, input_ids=ids[i : i + 1], **options)
        for i, c in enumerate(("es", "fr"))
    ]
    with adapters.gate(peft_model) as g:
        out = g.generate(input_ids=ids, adapter=["es", "fr"], **options)
    for i in range(2):
        assert torch.equal(out[i : i + 1, : expected[i].shape[1]], expected[i])


def test_default_adapter_and_switch(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (1, 4))
    expected = {c: serial_logits(peft_model, c, input_ids=ids) for c in CHOICES}
    peft_model.set_adapter("de")
    with adapters.gate(peft_model) as g:
        assert g.default == "de"
        assert torch.equal(g(input_ids=ids).logits, expected["de"])
        g.switch("es")
        assert g.default == "es" and g.state()["default"] == "es"
        assert torch.equal(g(input_ids=ids).logits, expected["es"])
        g.switch(BASE)
        assert torch.equal(g(input_ids=ids).logits, expected[BASE])
        # switch changes the gate only: the model's own active adapter is untouched
        assert peft_model.active_adapter == "de"
    with adapters.gate(peft_model, default="fr") as g:
        assert torch.equal(g(input_ids=ids).logits, expected["fr"])


def test_direct_calls_are_untouched_by_the_hooks(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (2, 4))
    peft_model.set_adapter("es")
    before = serial_logits(peft_model, "es", input_ids=ids)
    bare = hooks_on(peft_model)
    g = adapters.gate(peft_model)
    assert hooks_on(peft_model) == bare + g.state()["hooks"] > bare
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=ids).logits, before)
    with g.use("de"), torch.no_grad():
        inside = peft_model(input_ids=ids).logits
    assert torch.equal(inside, serial_logits(peft_model, "de", input_ids=ids))
    g.close()
    assert hooks_on(peft_model) == bare


def test_state_is_plain_json(peft_model: Any) -> None:
    with adapters.gate(peft_model) as g:
        g(input_ids=torch.randint(2, 128, (1, 3)), adapter="fr")
        g.submit(input_ids=torch.randint(2, 128, (1, 3)), adapter="de", max_new_tokens=2).result()
        state = json.loads(json.dumps(g.state()))
    assert state["mode"] == "routed"
    assert state["adapters"] == list(ADAPTERS[::-1]) or state["adapters"] == sorted(ADAPTERS)
    assert set(state["routing"]) == {*ADAPTERS, BASE}
    assert {"in_flight", "queued", "max_wait_s", "active", "default", "engine", "blockers"} <= set(state)
    assert state["engine"]["batches"] + state["engine"]["alone"] >= 1


def test_training_mode_is_refused(peft_model: Any) -> None:
    peft_model.train()
    with adapters.gate(peft_model) as g, pytest.raises(adapters.AdapterError, match=r"model\.eval"):
        g(input_ids=torch.randint(2, 128, (1, 3)), adapter="fr")


def test_closed_gate_refuses(peft_model: Any) -> None:
    g = adapters.gate(peft_model)
    g.close()
    g.close()  # idempotent
    with pytest.raises(GateClosedError):
        g(input_ids=torch.randint(2, 128, (1, 3)))
    with pytest.raises(GateClosedError):
        g.submit(input_ids=torch.randint(2, 128, (1, 3)))
    with pytest.raises(GateClosedError), g.exclusive():
        pass


def test_injected_module_is_served() -> None:
    from peft import inject_adapter_in_model

    from .adapter_models import lora_config

    model = build_base()
    ref = build_peft(("fr",))
    inject_adapter_in_model(lora_config(), model, adapter_name="fr")
    model.load_state_dict(ref.get_base_model().state_dict())
    model.eval()
    ids = torch.randint(2, 128, (1, 4))
    with adapters.gate(model) as g:
        assert g.state()["kind"] == "injected"
        assert torch.equal(g(input_ids=ids, adapter="fr").logits, serial_logits(ref, "fr", input_ids=ids))
        assert torch.equal(g(input_ids=ids, adapter=BASE).logits, serial_logits(ref, BASE, input_ids=ids))


@pytest.mark.parametrize(
    "lora",
    [{"modules_to_save": ["lm_head"]}, {"target_modules": ["embed_tokens", "q_proj", "v_proj"]}],
    ids=["modules_to_save", "embedding"],
)
def test_other_routable_layers(lora: dict[str, Any]) -> None:
    from peft import get_peft_model

    from .adapter_models import lora_config

    model = None
    for i, name in enumerate(ADAPTERS):
        torch.manual_seed(40 + i)
        if model is None:
            model = get_peft_model(build_base(), lora_config(**lora), adapter_name=name)
        else:
            model.add_adapter(name, lora_config(**lora))
        with torch.no_grad():  # give each adapter its own copy of lm_head, so that rows can tell them apart
            for wrapper in model.modules():
                if type(wrapper).__name__ == "ModulesToSaveWrapper":
                    copy = wrapper.modules_to_save[name].weight
                    copy.add_(torch.randn_like(copy) * 0.1)
    model.eval()
    ids = torch.randint(2, 128, (1, 5))
    expected = {c: serial_logits(model, c, input_ids=ids) for c in CHOICES}
    activate(model, "fr")
    with adapters.gate(model) as g:
        assert g.mode == "routed", g.state()["blockers"]
        for c in CHOICES:
            assert torch.equal(g(input_ids=ids, adapter=c).logits, expected[c]), c
        rows = g(input_ids=ids.repeat(4, 1), adapter=list(CHOICES)).logits
        for i, c in enumerate(CHOICES):
            torch.testing.assert_close(rows[i : i + 1], expected[c], rtol=0, atol=1e-5)
