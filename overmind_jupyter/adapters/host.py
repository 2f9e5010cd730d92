"""The model behind a gate: what it carries, and the structural operations on it, whatever its kind.

Three kinds of model carry PEFT adapters, and the gate serves all of them the same way:

- `"peft"`: a `peft.PeftModel`. Requests run on `model.get_base_model()`, the transformers model whose layers
  PEFT replaced with tuner layers; this skips `PeftModelForCausalLM.generate`, which swaps an attribute of the
  shared model for the length of each call.
- `"transformers"`: a transformers model whose adapters came through its PEFT integration
  (`model.load_adapter`, `model.add_adapter`). Requests run on the model itself.
- `"injected"`: any module with tuner layers from `peft.inject_adapter_in_model`. Requests run on the module;
  loading from disk and hot-swapping need one of the other two kinds.

Every method that changes the model is called by the gate with its exclusive side held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import (
    AdapterError,
    AdapterExistsError,
    NoAdaptersError,
    UnknownAdapterError,
    UnsupportedModelError,
)
from .routing import BASE

if TYPE_CHECKING:
    pass

__all__ = ["AdapterHost", "HostState"]


@dataclasses.dataclass(frozen=True)
class HostState:
    """What the gate may change on the model while switching, to be put back on close."""

    active: tuple[str, ...]
    enabled: bool
    merged: tuple[str, ...]


class AdapterHost:
    """Wraps a model that carries PEFT adapters.

    Args:
        model (`nn.Module`):
            A `PeftModel`, a transformers model with adapters loaded through its PEFT integration, or a module
            with injected tuner layers.
    """

    def __init__(self, model: Any) -> None:  # a PeftModel or a transformers model: attributes by name
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        if isinstance(model, PeftModel):
            learning = [n for n, c in model.peft_config.items() if c.is_prompt_learning]
            if learning:
                raise UnsupportedModelError(
                    f"adapters {learning} are prompt-learning adapters, which live outside the layers and "
                    "cannot be routed or switched per request; the gate serves LoRA-style adapters (LoRA, "
                    "DoRA, IA3, ...)"
                )
            self.kind = "peft"
            self.target: Any = model.get_base_model()
        elif getattr(model, "_hf_peft_config_loaded", False):
            self.kind = "transformers"
            self.target = model
        elif any(isinstance(m, BaseTunerLayer) for m in model.modules()):
            self.kind = "injected"
            self.target = model
        else:
            raise NoAdaptersError(
                f"{type(model).__name__} carries no PEFT adapter: wrap it with "
                "peft.get_peft_model(model, config) or PeftModel.from_pretrained(model, path), or load one "
                "with model.load_adapter(path, adapter_name=...), then call adapters.gate(model)"
            )
        if not self.adapters():
            raise NoAdaptersError(f"{type(model).__name__} has tuner layers but no adapter left in them")
        self._watched: list[Any] = []
        self.watch()

    # -- reading ---------------------------------------------------------------------------------------------

    def tuner_layers(self) -> list[Any]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for m in self.target.modules() if isinstance(m, BaseTunerLayer)]

    def layers(self) -> list[Any]:
        """The tuner layers and auxiliary wrappers (`modules_to_save`): every module whose state decides which
        adapter applies."""
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        return [m for m in self.target.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]

    def configs(self) -> dict[str, Any]:
        return dict(getattr(self.model, "peft_config", None) or {})

    def adapters(self) -> list[str]:
        """Every adapter name the model carries, sorted."""
        names = set(self.configs())
        for layer in self.tuner_layers():
            names |= layer._get_available_adapters()
        names.discard(BASE)
        return sorted(names)

    def active(self) -> tuple[str, ...]:
        for layer in self.tuner_layers():
            return tuple(layer.active_adapters)
        return ()

    def enabled(self) -> bool:
        return not any(layer.disable_adapters for layer in self.tuner_layers())

    def merged(self) -> tuple[str, ...]:
        names: set[str] = set()
        for layer in self.tuner_layers():
            names.update(layer.merged_adapters)
        return tuple(sorted(names))

    def watch(self) -> None:
        """Read the layers again (after a structural change): `layer_state()` reads these."""
        self._watched = self.layers()

    def layer_state(self) -> dict[int, tuple[Any, ...]]:
        """What decides which adapter layers apply, per tuner layer and auxiliary wrapper (by `id`, in module
        order, as of the last `watch()`): whether it is disabled, and its merged and active adapters. The gate
        records it after each switch and compares it before, during and after every request (Note [Changes
        behind the gate] in guarding.py). About 1 us a layer."""
        return {
            id(module): (
                bool(module.disable_adapters),
                tuple(getattr(module, "merged_adapters", ())),
                tuple(module.active_adapters),
            )
            for module in self._watched
        }

    def describe_change(self, before: dict[int, tuple[Any, ...]], after: dict[int, tuple[Any, ...]]) -> str:
        """What differs between two `layer_state()`s, in words (the first layer that changed)."""
        if not before:
            return "the layers were not as the gate set them, right after it switched them"
        names = {id(m): n for n, m in self.target.named_modules()}
        if list(before) != list(after):
            return "the gate's record of the layers is out of date"
        fields = ("disabled", "merged adapters", "active adapters")
        for key, old in before.items():
            for field, was, now in zip(fields, old, after[key], strict=True):
                if was != now:
                    return f"{names.get(key, '?')}: {field} {was} -> {now}"
        return "no change"

    def snapshot(self) -> HostState:
        return HostState(self.active(), self.enabled(), self.merged())

    def uses_dora(self, name: str) -> bool:
        config = self.configs().get(name)
        if config is not None and getattr(config, "use_dora", False):
            return True
        return any(getattr(layer, "use_dora", {}).get(name, False) for layer in self.tuner_layers())

    # -- switching (the gate holds the model drained) --------------------------------------------------------

    def set_active(self, names: Sequence[str]) -> None:
        """Make `names` the active adapters, through PEFT's API.

        A transformers model's own `set_adapter` refuses PEFT releases older than the one its integration was
        written for; `peft.functional.set_adapter` is what it calls underneath, so the gate calls that.
        """
        names = list(names)
        if self.kind == "peft" and len(names) == 1:
            self.model.set_adapter(names[0])
            return
        if self.kind == "peft":
            self.model.base_model.set_adapter(names)
            return
        from peft.functional import set_adapter

        set_adapter(self.target, names[0] if len(names) == 1 else names)

    def set_enabled(self, enabled: bool) -> None:
        """Enable or disable every tuner layer (disabled layers compute the base model)."""
        for module in self.layers():
            module.enable_adapters(enabled)

    def merge(self, names: Sequence[str]) -> None:
        """Merge `names` into the base weights."""
        if self.kind == "peft":
            self.model.base_model.merge_adapter(adapter_names=list(names))
            return
        for layer in self.tuner_layers():
            layer.merge(adapter_names=[n for n in names if n in layer._get_available_adapters()])

    def unmerge(self) -> None:
        """Take every merged adapter out of the base weights again."""
        for layer in self.tuner_layers():
            if layer.merged:
                layer.unmerge()

    def restore(self, state: HostState) -> None:
        """Put back the active set, enabled flag and merged set of `state`, as far as they still exist."""
        present = set(self.adapters())
        if self.merged() != state.merged:
            self.unmerge()
        active = [n for n in state.active if n in present]
        if active and tuple(active) != self.active():
            self.set_active(active)
        if self.enabled() != state.enabled:
            self.set_enabled(state.enabled)
        merged = [n for n in state.merged if n in present]
        if merged and self.merged() != tuple(merged):
            self.merge(merged)

    # -- structural changes (the gate holds its exclusive side) ----------------------------------------------

    def load(self, source: Any, name: str, **kwargs: Any) -> None:
        if name in self.adapters():
            raise AdapterExistsError(
                f"an adapter named {name!r} is loaded already: delete it first or pick another name"
            )
        if self.kind == "peft" or self.kind == "transformers":
            self.model.load_adapter(source, adapter_name=name, **kwargs)
        else:
            raise UnsupportedModelError(
                "this module's adapters were injected by hand, so it has no load_adapter: wrap it with "
                "peft.PeftModel or load through a transformers model's load_adapter"
            )

    def delete(self, name: str) -> None:
        self.require(name)
        if self.kind == "peft":
            self.model.delete_adapter(name)
            return
        from peft.functional import delete_adapter

        configs = getattr(self.model, "peft_config", None)
        config = configs.get(name) if isinstance(configs, dict) else None
        prefix = f"{config.peft_type.value.lower()}_" if config is not None else "lora_"
        delete_adapter(self.target, adapter_name=name, prefix=prefix)
        if isinstance(configs, dict):
            configs.pop(name, None)
            if not configs and self.kind == "transformers":
                # As transformers' own delete_adapter leaves a model without adapters.
                del self.model.peft_config
                self.model._hf_peft_config_loaded = False

    def hotswap(self, name: str, source: Any, **kwargs: Any) -> None:
        self.require(name)
        if self.kind == "peft":
            from peft.utils.hotswap import hotswap_adapter

            hotswap_adapter(self.model, source, adapter_name=name, **kwargs)
        elif self.kind == "transformers":
            self.model.load_adapter(source, adapter_name=name, hotswap=True, **kwargs)
        else:
            raise UnsupportedModelError(
                "hot-swapping needs a PeftModel or a transformers model with PEFT integration"
            )

    def add_lora(self, name: str, config: Any) -> None:
        if self.kind == "peft":
            self.model.add_adapter(name, config)
            return
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, self.target, adapter_name=name)
        configs = getattr(self.model, "peft_config", None)
        if isinstance(configs, dict):
            configs.setdefault(name, config)

    def mix(self, weights: Mapping[str, float], name: str) -> None:
        """Add adapter `name` = sum of `weight * adapter`, exact for LoRA, by concatenating the ranks.

        For every LoRA layer holding some of the adapters, the new adapter has scaling 1 and
        `A = cat([w_i * s_i * A_i])`, `B = cat([B_i], dim=1)`, so that `B @ A = sum(w_i * s_i * B_i @ A_i)`:
        the weighted sum of the adapters' own deltas (`s_i` is each adapter's scaling). This is PEFT's
        `add_weighted_adapter(combination_type="cat")`, done here so that it also serves transformers models
        with PEFT integration and keeps scaling 1 under rsLoRA.

        In three steps: plan the new adapter's config (checking everything before the model changes), create
        it, fill its weights; a failure while filling deletes it, the one way back.
        """
        config = self._plan_mix(weights, name)
        self.add_lora(name, config)
        try:
            self._fill_mix(weights, name)
        except BaseException:
            self.delete(name)
            raise

    def _plan_mix(self, weights: Mapping[str, float], name: str) -> Any:
        """The `LoraConfig` of the mix of `weights` as adapter `name`: rank the sum of the adapters' largest
        ranks, on every LoRA layer that holds one of them; raises before anything changed."""
        from peft import LoraConfig

        self._check_mixable(weights, name)
        layers, ranks, fan_in_fan_out = self._mixed_layers(weights)
        if not layers:
            raise AdapterError(
                f"no LoRA layer holds any of {sorted(weights)}: only LoRA adapters can be mixed"
            )
        new_rank = sum(ranks.values())
        return LoraConfig(
            r=new_rank,
            lora_alpha=new_rank,
            target_modules=sorted(layers),
            lora_dropout=0.0,
            bias="none",
            fan_in_fan_out=fan_in_fan_out,
        )

    def _check_mixable(self, weights: Mapping[str, float], name: str) -> None:
        if not weights:
            raise ValueError("gate.mix needs at least one adapter and weight, e.g. {'fr': 0.7, 'de': 0.3}")
        if name in self.adapters() or name == BASE:
            raise AdapterExistsError(
                f"an adapter named {name!r} exists already: pick another name for the mix"
            )
        for adapter in weights:
            self.require(adapter)
            if self.uses_dora(adapter):
                raise AdapterError(f"adapter {adapter!r} uses DoRA, whose magnitudes cannot be mixed exactly")

    def _mixed_layers(self, weights: Mapping[str, float]) -> tuple[dict[str, Any], dict[str, int], bool]:
        """The LoRA layers (by name) that hold some of the adapters of `weights`, each adapter's largest rank
        in them, and whether any of them is `fan_in_fan_out`."""
        from peft.tuners.lora import LoraLayer

        layers: dict[str, Any] = {}
        ranks = dict.fromkeys(weights, 0)
        fan_in_fan_out = False
        for key, module in self.target.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            held = [a for a in weights if a in module.lora_A or a in module.lora_embedding_A]
            if not held:
                continue
            layers[key] = module
            fan_in_fan_out = fan_in_fan_out or bool(getattr(module, "fan_in_fan_out", False))
            for a in held:
                ranks[a] = max(ranks[a], int(module.r[a]))
        return layers, ranks, fan_in_fan_out

    def _fill_mix(self, weights: Mapping[str, float], name: str) -> None:
        """Write the new adapter `name`'s weights in every LoRA layer that holds it (see `mix`)."""
        import torch
        from peft.tuners.lora import LoraLayer

        with torch.no_grad():
            for module in self.target.modules():
                if isinstance(module, LoraLayer) and name in (set(module.lora_A) | set(module.lora_embedding_A)):
                    _fill_mixed_layer(module, weights, name)

    # -- checks ----------------------------------------------------------------------------------------------

    def require(self, name: str) -> None:
        if name not in self.adapters():
            raise UnknownAdapterError(
                f"no adapter named {name!r}; available: {', '.join(self.adapters()) or '(none)'}"
            )


def _fill_mixed_layer(module: Any, weights: Mapping[str, float], name: str) -> None:
    """In one LoRA layer: `name`'s A and B become the concatenation of the adapters' own, A's parts scaled by
    weight times the adapter's scaling, and its scaling 1 (see `AdapterHost.mix`)."""
    import torch

    if name in module.lora_embedding_A:
        target_a, target_b = module.lora_embedding_A[name], module.lora_embedding_B[name]
    else:
        target_a, target_b = module.lora_A[name].weight, module.lora_B[name].weight
    target_a.zero_()
    target_b.zero_()
    a_parts: list[torch.Tensor] = []
    b_parts: list[torch.Tensor] = []
    down: Any
    up: Any
    for adapter, weight in weights.items():
        if adapter in module.lora_A:
            down, up = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        elif adapter in module.lora_embedding_A:
            down, up = module.lora_embedding_A[adapter], module.lora_embedding_B[adapter]
        else:
            continue
        a_parts.append(down * (float(weight) * float(module.scaling[adapter])))
        b_parts.append(up)
    cat_a, cat_b = torch.cat(a_parts, dim=0), torch.cat(b_parts, dim=1)
    target_a[: cat_a.shape[0], :] = cat_a.to(target_a.dtype)
    target_b[:, : cat_b.shape[1]] = cat_b.to(target_b.dtype)
    module.scaling[name] = 1.0
