"""What a gate changes on its model's adapter layers: the structural changes users ask for (load, delete,
mix, merge, unmerge, hot-swap) and, in switched mode, the switch to the next key.

`AdapterGate` (gating.py) decides when: a structural change runs with its exclusive side held, and the
gate re-reads the model when that side is let go; a switch runs with no request in flight (Note [Keyed
admission] in switching.py). `LayerChanges` does the change, on the gate's `AdapterHost`, and remembers
what switching must know of the model: whether the gate changed its active, enabled or merged state
(put back on close), whether a switch merges, and the active set the routed path needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._errors import AdapterError
from .host import AdapterHost, HostState
from .routing import BASE
from .switching import ROUTED

__all__ = ["LayerChanges", "conforms"]


class LayerChanges:
    """Changes one gate's model; the gate calls each structural change with its exclusive side held.

    Args:
        host (`AdapterHost`):
            The gate's model.
    """

    def __init__(self, host: AdapterHost) -> None:
        self.host = host
        self.touched = False  # whether the gate changed the model's active/enabled/merged state
        self.merge_on_switch = False  # whether a switch merges the adapter it switches to
        self.routed_active: tuple[str, ...] = ()  # the active set routed requests need

    def reread(self) -> None:
        """Take the model's merged and active sets as the ones switching goes back to (after a structural
        change)."""
        self.merge_on_switch = bool(self.host.merged())
        self.routed_active = self.host.active()

    def restore(self, initial: HostState) -> None:
        """Put back the model's active, enabled and merged state of `initial` if the gate changed it."""
        if self.touched:
            self.host.restore(initial)

    # -- structural changes (the gate holds its exclusive side) ----------------------------------------------

    def load(self, source: Any, adapter_name: str, **kwargs: Any) -> None:
        """Load an adapter, keeping the active set (see `AdapterGate.load_adapter`)."""
        before = self.host.active()
        self.host.load(source, adapter_name, **kwargs)
        self._keep_active(before)

    def delete(self, adapter_name: str, default: str) -> None:
        """Delete an adapter other than the gate's `default`, unmerging it first (see
        `AdapterGate.delete_adapter`)."""
        self.host.require(adapter_name)
        if adapter_name == default:
            raise AdapterError(
                f"{adapter_name!r} is the gate's default adapter: gate.switch(...) to another one first"
            )
        if adapter_name in self.host.merged():
            self.host.unmerge()
        self.host.delete(adapter_name)

    def mix(self, weights: Mapping[str, float], name: str) -> None:
        """Add the weighted sum of adapters as `name`, keeping the active set (see `AdapterGate.mix`)."""
        before = self.host.active()
        self.host.mix(dict(weights), name)
        self._keep_active(before)

    def merge(self, name: str) -> None:
        """Merge adapter `name` alone into the base weights (see `AdapterGate.merge`)."""
        self.host.unmerge()
        self.host.set_active([name])
        self.host.merge([name])
        self.touched = True

    def unmerge(self) -> None:
        """Take merged adapters out of the base weights."""
        self.host.unmerge()

    def hotswap(self, adapter_name: str, source: Any, **kwargs: Any) -> None:
        """Replace an adapter's weights in place (see `AdapterGate.hotswap`)."""
        self.host.hotswap(adapter_name, source, **kwargs)

    def _keep_active(self, before: tuple[str, ...]) -> None:
        present = set(self.host.adapters())
        keep = [a for a in before if a in present]
        if keep and self.host.active() != tuple(keep):
            self.host.set_active(keep)

    # -- switched mode (no request in flight) ----------------------------------------------------------------

    def apply(self, key: str, every_layer: bool = False) -> None:
        """Switch the layers to `key`, skipping what looks done already (unless `every_layer`)."""
        host = self.host
        if key == ROUTED:
            # The routed path reads no active adapter, but disabled layers compute the base model and wrappers
            # pass rows through unless they hold the active adapter: put back what switching changed.
            if self.touched:
                if not host.enabled():
                    host.set_enabled(True)
                if self.routed_active and host.active() != self.routed_active:
                    host.set_active(self.routed_active)
            return
        self.touched = True
        if key == BASE:
            if host.merged():
                host.unmerge()
            host.set_enabled(False)
            return
        if not host.enabled():
            host.set_enabled(True)
        if self.merge_on_switch:
            if every_layer or host.merged() != (key,):
                host.unmerge()
                host.set_active([key])
                host.merge([key])
        elif every_layer or host.active() != (key,):
            host.set_active([key])


def conforms(key: str, state: dict[int, tuple[Any, ...]]) -> bool:
    """Whether the layers' state (`AdapterHost.layer_state`) is one that requests of `key` are right with."""
    for disabled, merged, active in state.values():
        if key == ROUTED:
            if disabled or merged:
                return False
        elif key == BASE:
            if not disabled:
                return False
        elif disabled or active not in ((key,), ()) or any(m != key for m in merged):
            return False  # (a wrapper that does not hold the adapter is left with none active)
    return True
