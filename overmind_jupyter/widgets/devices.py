"""The units bar: one bar per GPU, one segment per holder, busy and idle shaded differently.

It reads either `overmind_jupyter.units.state()` (what `%overmind units` shows: the ledger as this kernel
sees it, with its devices registered) or the `units` part of the daemon's status (inside `%overmind status`,
which registers nothing), and shows either as the side panel's state (`cache.state_of`, whose `units` the
view draws). Its view is labextension/src/widgets/units.ts, bundled into widgets/static/units.js (see
widgets/live.py).
"""

from __future__ import annotations

import os
from typing import Any

import traitlets

from .cache import state_of
from .live import LiveView, frontend, with_text

__all__ = ["UnitsBar", "fetch_units", "local_facts"]


def fetch_units() -> dict[str, Any]:
    """The feed of `%overmind units`: `units.state()`, but never a daemon started by a poll (a user who
    stopped the daemon sees it stopped, not started again by a widget)."""
    from kernel_server.client import existing_shared_client, shared_client

    from .. import units

    if existing_shared_client() is None:
        shared_client(spawn=False)  # raises DaemonUnavailable when none runs
    return units.state()


def local_facts(raw: dict[str, Any] | None) -> dict[str, Any]:
    """What the units bar shows besides the side panel's state (the `local` trait): this kernel's pid (its
    holdings say "(this kernel)"), and the ledger's settings the panel's state leaves out.

    Args:
        raw: `units.state()`, or the `units` of the daemon's status reply (None: the daemon has no ledger).
    """
    raw = raw or {}
    return {"pid": os.getpid(), "fake_gpus": str(raw.get("fake_gpus") or ""),
            "reserve_gib": float(raw.get("reserve_gib") or 0.0)}


class UnitsBar(LiveView):
    """GPU units per device: a bar each, a segment per holder (busy solid, idle hatched), "simulated" on
    simulated devices.

    Traits (synced, read-only for the frontend): `state` (the side panel's state of a status reply holding
    the ledger's snapshot: its `units` and `texts.unit_bytes` are drawn; {} before the first snapshot),
    `local` (see `local_facts`), `error` (why the ledger could not be read).

    Args:
        live: subscribe to the "units" feed (`units.state()`) itself; a `StatusPanel` feeds its bar from
            the daemon's status instead.
    """

    state = traitlets.Dict().tag(sync=True)
    local = traitlets.Dict().tag(sync=True)

    _esm, _css = frontend("units")

    def __init__(self, *, live: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._last: dict[str, Any] | None = None
        if live:
            self.subscribe("units", fetch_units, self.update)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        from ..units import format_state

        text = format_state(self._last) if self._last else "GPU units (a widget: run in JupyterLab)"
        return with_text(super()._repr_mimebundle_(**kwargs), text)

    def update(self, snapshot: dict[str, Any] | None, error: Exception | None = None) -> None:
        """Show one ledger snapshot (on the poller's thread)."""
        with self.hold_sync():
            self.take_notice()
            if error is not None:
                self.error = f"cannot read the units ledger: {error}"
                return
            self._last = snapshot
            self.error = ""
            self.state = state_of({"units": snapshot})
            self.local = local_facts(snapshot)
