"""The units bar: one bar per GPU, one segment per holder, busy and idle shaded differently.

It reads either `overmind_jupyter.units.state()` (what `%overmind units` shows: the ledger as this kernel
sees it, with its devices registered) or the `units` part of the daemon's status (inside `%overmind status`,
which registers nothing), and shows either as `view.units_state` makes it: the side panel's `units`. Its
view is labextension/src/widgets/units.ts, bundled into widgets/static/units.js (see widgets/live.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import traitlets

from .live import LiveView, frontend, snapshot_now, with_text

if TYPE_CHECKING:
    from kernel_server.payloads import UnitsSnapshot

__all__ = ["UnitsBar", "fetch_units", "local_facts"]


def fetch_units() -> dict[str, Any]:
    """The feed of `%overmind units`: `units.state()`, but never a daemon started by a poll (a user who
    stopped the daemon sees it stopped, not started again by a widget)."""
    from kernel_server.client import existing_shared_client, shared_client

    from .. import units

    if existing_shared_client() is None:
        shared_client(spawn=False)  # raises DaemonUnavailable when none runs
    return units.state()


def local_facts() -> dict[str, Any]:
    """What the units bar shows besides the ledger's view (the `local` trait): this kernel's pid, whose
    holdings say "(this kernel)"."""
    return {"pid": os.getpid()}


class UnitsBar(LiveView):
    """GPU units per device: a bar each, a segment per holder (busy solid, idle hatched), "simulated" on
    simulated devices.

    Traits (synced, read-only for the frontend): `state` (`view.units_state` of the ledger's snapshot: the
    side panel's `units` and `texts.unit_bytes`; {} before the first snapshot), `local` (see
    `local_facts`), `error` (why the ledger could not be read).

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

        snapshot, error = snapshot_now(self._last, fetch_units)
        text = format_state(snapshot) if snapshot else f"GPU units: cannot be read ({error})"
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
            from kernel_server.client import existing_shared_client

            from ..view import units_state

            client = existing_shared_client()
            self.state = units_state(cast("UnitsSnapshot", snapshot),
                                     my_conn=client.conn_id if client is not None else None) if snapshot else {}
            self.local = local_facts()
