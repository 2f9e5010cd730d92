"""The cache table: what the daemon holds, who uses it, an evict button per entry, and the calls that fell back.

`CacheTable` shows the side panel's state of the daemon (`state_of`: the shape of labextension/src/api.ts
`IPanelState`, made by overmind_jupyter/view.py) and a few facts only this kernel knows (`local_facts`). Its
view is labextension/src/widgets/cache.ts, which draws the panel's memory and time-saved charts with the
panel's own code (charts.ts), bundled into widgets/static/cache.js (see widgets/live.py).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, cast

import traitlets

from .live import LiveView, frontend, run_action

if TYPE_CHECKING:
    from kernel_server.payloads import StatusReply

__all__ = ["CacheTable", "fetch_status", "local_facts", "open_gates", "state_of"]

# Note [Segment colours]
# "Memory per model" gives each entry a colour, in the widget and in the side panel alike: both draw it
# with labextension/src/charts.ts's `memoryChart`, whose ten hues (distinct, readable on light and dark
# backgrounds) and three patterns (plain, then light stripes one way, then the other) give the first 30
# entries 30 different fills. tests/test_widgets.py checks the list and that the widget's bundle carries it.


def fetch_status() -> dict[str, Any]:
    """The feed of the cache table: `overmind_jupyter.status()` (never starts a daemon), and the adapter
    gates open in this kernel."""
    from ..api import status

    snapshot = status()
    snapshot["gates"] = open_gates()
    return snapshot


def open_gates() -> list[dict[str, Any]]:
    """A line per adapter gate open in this kernel; nothing is imported for it (no gate: no adapters module)."""
    gating = sys.modules.get("overmind_jupyter.adapters.gating")
    if gating is None:
        return []
    out = []
    for gate in gating.open_gates():
        state = gate.state()
        out.append({
            "model": type(gate.model).__name__,
            "mode": state["mode"],
            "default": state["default"],
            "adapters": len(state["adapters"]),
            "in_flight": sum(state["in_flight"].values()),
            "queued": sum(state["queued"].values()),
        })
    return out


def state_of(daemon: dict[str, Any] | None, my_conn: int | None = None) -> dict[str, Any]:
    """The side panel's state (api.ts `IPanelState`) of the daemon's status reply, or {} without a daemon:
    `view.state_view`, named as the CLI names connections (no Jupyter server's sessions here), with
    `my_conn`'s connections marked `mine`."""
    if daemon is None:
        return {}
    from ..view import state_view

    return state_view(cast("StatusReply", daemon), my_conn=my_conn)


def local_facts(snapshot: dict[str, Any], my_conn: int | None = None) -> dict[str, Any]:
    """What the cache table shows that only this kernel knows (the `local` trait).

    Args:
        snapshot: what `fetch_status()` returned.
        my_conn: this kernel's connection id, to mark the entries it uses "(this kernel)".

    Returns:
        `dict` with `enabled`, `patched` (how many loaders are patched), `pid`, `conn` (`my_conn`),
        `daemon_error` (why there is no daemon, or ""), `gates` (`open_gates()`), and `fallbacks`: this
        kernel's fallbacks that never reached the daemon (each `time`, `call`, `kind`, `reason`; those that
        did are in the state's `fallbacks`).
    """
    daemon = snapshot.get("daemon")
    my_pid = os.getpid()
    reported = [(str(f.get("call", "")), str(f.get("reason", "")), float(f.get("time") or 0.0))
                for f in (daemon or {}).get("fallbacks", []) if f.get("pid") == my_pid]
    fallbacks = []
    for f in snapshot.get("fallbacks") or []:
        call, reason, when = str(f.get("call", "")), str(f.get("reason", "")), float(f.get("time") or 0.0)
        if not any(c == call and r == reason and abs(t - when) < 5 for c, r, t in reported):
            fallbacks.append({"time": when, "call": call, "kind": str(f.get("kind", "")), "reason": reason})
    return {
        "enabled": bool(snapshot.get("enabled")),
        "patched": len(snapshot.get("patched") or []),
        "pid": my_pid,
        "conn": my_conn,
        "daemon_error": str(snapshot.get("daemon_error") or "") if daemon is None else "",
        "gates": list(snapshot.get("gates") or []),
        "fallbacks": fallbacks[-50:],
    }


class CacheTable(LiveView):
    """The daemon's cache entries with an evict button each, the open adapter gates, and the fallbacks.

    Traits (synced, read-only for the frontend): `state` (the side panel's state of the daemon, see
    `state_of`; {} without a daemon), `local` (see `local_facts`), `error` (why the daemon could not be
    read), `notice` (the last eviction's outcome).
    A view's evict button sends `{"event": "evict", "key": ...}`; the eviction runs off the main thread
    and the table shows its effect at the next tick.

    Args:
        live: subscribe to the "status" feed itself (a `StatusPanel` feeds its table instead).
    """

    state = traitlets.Dict().tag(sync=True)
    local = traitlets.Dict().tag(sync=True)

    _esm, _css = frontend("cache")

    def __init__(self, *, live: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if live:
            self.subscribe("status", fetch_status, self.update)

    def update(self, snapshot: dict[str, Any] | None, error: Exception | None = None) -> None:
        """Show one `fetch_status()` snapshot (on the poller's thread)."""
        from kernel_server.client import existing_shared_client

        with self.hold_sync():
            self.take_notice()
            if error is not None or snapshot is None:
                self.error = f"cannot read the cache: {error}"
                return
            client = existing_shared_client()
            self.error = ""
            my_conn = client.conn_id if client is not None else None
            self.state = state_of(snapshot.get("daemon"), my_conn)
            self.local = local_facts(snapshot, my_conn)

    def on_event(self, event: str, content: dict[str, Any]) -> None:
        if event == "evict" and isinstance(content.get("key"), str):
            self.evict(content["key"])

    def evict(self, key: str) -> None:
        """Evict `key` off the main thread (what the row's button does); the table shows it at the next tick."""
        label = next((e["label"] for e in self.state.get("entries", []) if e["key"] == key), key[:12])

        def act() -> None:
            from ..api import evict

            started = time.monotonic()
            try:
                evicted = evict(key)
            except Exception as exc:  # noqa: BLE001 - shown in the widget: the daemon went away, the key is gone
                self.tell(f"could not evict {label}: {exc}")
                return
            took = time.monotonic() - started
            self.tell(f"evicted {label} ({took * 1000:.0f} ms)" if evicted else f"{label} was already gone")

        run_action("evict", act)
