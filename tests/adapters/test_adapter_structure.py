"""Structural changes through the gate: load, delete, mix, hot-swap (PeftModel and transformers model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from overmind_jupyter import adapters
from overmind_jupyter.adapters import BASE, AdapterExistsError, UnknownAdapterError

from .adapter_models import build_peft, serial_logits


def _lora_layers(model: Any) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@pytest.mark.parametrize("kind", ["peft", "transformers"])
def test_mix_is_the_exact_weighted_sum(kind: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue("peft_model" if kind == "peft" else "hf_model")
    with adapters.gate(model) as g:
        assert g.mix({"fr": 0.7, "de": 0.3}, name="fr_de") == "fr_de"
        assert "fr_de" in g.adapters and g.mode == "routed"
        for layer in _lora_layers(model):
            expected = 0.7 * layer.get_delta_weight("fr") + 0.3 * layer.get_delta_weight("de")
            torch.testing.assert_close(layer.get_delta_weight("fr_de"), expected, rtol=0, atol=1e-6)
        ids = torch.randint(2, 128, (1, 4))
        out = g(input_ids=ids, adapter="fr_de").logits
        assert not torch.allclose(out, g(input_ids=ids, adapter="fr").logits)
        with pytest.raises(AdapterExistsError):
            g.mix({"fr": 1.0}, name="fr_de")
        with pytest.raises(UnknownAdapterError):
            g.mix({"fr": 0.5, "it": 0.5}, name="fr_it")
        assert "fr_it" not in g.adapters


def test_mix_matches_peft_cat(peft_model: Any) -> None:
    twin = build_peft()
    twin.add_weighted_adapter(["fr", "es"], [0.4, -0.6], adapter_name="mix", combination_type="cat")
    ids = torch.randint(2, 128, (2, 5))
    with adapters.gate(peft_model) as g:
        g.mix({"fr": 0.4, "es": -0.6}, name="mix")
        torch.testing.assert_close(
            g(input_ids=ids, adapter="mix").logits,
            serial_logits(twin, "mix", input_ids=ids),
            rtol=0,
            atol=1e-5,
        )


def test_mix_refuses_dora() -> None:
    model = build_peft(("fr", "x"), dora=("x",))
    with adapters.gate(model) as g:
        with pytest.raises(adapters.AdapterError, match="DoRA"):
            g.mix({"fr": 0.5, "x": 0.5}, name="fx")
        assert g.adapters == ["fr", "x"]


@pytest.mark.parametrize("kind", ["peft", "transformers"])
def test_load_hotswap_delete(
    kind: str, request: pytest.FixtureRequest, adapter_dirs: dict[str, Path]
) -> None:
    model = request.getfixturevalue("peft_model" if kind == "peft" else "hf_model")
    reference = build_peft(("es",))
    reference.load_adapter(str(adapter_dirs["es2"]), adapter_name="es2")
    ids = torch.randint(2, 128, (1, 4))
    expected_es2 = serial_logits(reference, "es2", input_ids=ids)
    expected_es = serial_logits(reference, "es", input_ids=ids)
    with adapters.gate(model) as g:
        hooks = g.state()["hooks"]
        assert torch.equal(g(input_ids=ids, adapter="es").logits, expected_es)
        g.load_adapter(str(adapter_dirs["es2"]), "it")
        assert torch.equal(g(input_ids=ids, adapter="it").logits, expected_es2)
        with pytest.raises(AdapterExistsError):
            g.load_adapter(str(adapter_dirs["es2"]), "it")
        g.hotswap("es", str(adapter_dirs["es2"]))
        assert torch.equal(g(input_ids=ids, adapter="es").logits, expected_es2)
        g.delete_adapter("it")
        with pytest.raises(UnknownAdapterError):
            g(input_ids=ids, adapter="it")
        with pytest.raises(adapters.AdapterError, match="default adapter"):
            g.delete_adapter(g.default)
        assert g.state()["hooks"] == hooks


def test_loading_new_layers_hooks_them(peft_model: Any) -> None:
    from .adapter_models import lora_config

    ids = torch.randint(2, 128, (1, 4))
    with adapters.gate(peft_model) as g:
        hooks = g.state()["hooks"]
        with g.exclusive() as model:
            torch.manual_seed(9)
            # lm_head was no target so far: a new LoRA layer appears and must be hooked
            model.add_adapter("head", lora_config(target_modules=["lm_head"]))
        assert g.state()["hooks"] == hooks + 1
        expected = serial_logits(peft_model, "head", input_ids=ids)
        assert torch.equal(g(input_ids=ids, adapter="head").logits, expected)
        mixed = g(input_ids=ids.repeat(2, 1), adapter=["head", "fr"]).logits
        torch.testing.assert_close(mixed[:1], expected, rtol=0, atol=1e-5)


def test_default_removed_by_hand_falls_back_to_base(peft_model: Any) -> None:
    ids = torch.randint(2, 128, (1, 4))
    expected = serial_logits(peft_model, BASE, input_ids=ids)
    with adapters.gate(peft_model, default="es") as g:
        with (
            pytest.warns(adapters.AdapterWarning, match="default adapter 'es' is gone"),
            g.exclusive() as model,
        ):
            model.delete_adapter("es")
        assert g.default == BASE
        assert torch.equal(g(input_ids=ids).logits, expected)
