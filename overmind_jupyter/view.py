"""The one view of the daemon's state: the typed `status` reply (kernel_server/payloads.py `StatusReply`)
shaped for people, with every size and time written by kernel_server/formats.py. The side panel (through
the server extension, overmind_jupyter/server), the notebook widgets and `%overmind status`'s text all
show this view, so that one event has one set of numbers (Note [Load time saved] in kernel_server/store.py).

`state_view(status)` returns (all sizes in bytes, times in seconds since the epoch; labextension/src/api.ts
`IPanelState` is its type on the panel's side):

    {
      "state":     "ok",                                 # server/state.down_state: "down" without a daemon
      "daemon":    {"pid", "version", "protocol", "home", "started"},
      "budget", "used", "reserved",                      # the store's byte budget and its use
      "disk":      null | {"directory", "used", "free", "size", "reserve"},  # under file arenas (disk.py)
      "stats":     {"hits", "misses", ...},              # the store's counters, as the daemon keeps them
      "entries":   [{"key", "label", "bytes", "hits", "last_used", "created", "backing",
                     "waited_s", "load_s", "cache_s", "miss_text",  # what its miss cost (see below)
                     "pinned_by": [CONNECTION + {"pins"}], "progress", "pending", ...}],  # the largest, then
                                                     # the most recently used (at most 50)
      "entries_total", "entries_more",               # entries cached in all, and those not in `entries`
      "more_bytes":  int,                            # what those hold
      "loading":   [{"key", "since", "reserved", "loader": CONNECTION, "waiters", "progress"}],
      "kernels":   [CONNECTION],                         # connected processes, `own_conn` left out
      "fallbacks": [{"time", "pid", "label", "name", "detail", "call", "kind", "reason"}],
      "hits_log":  [{"t", "key", "label", "pid", "waited_s", "load_s", "cache_s", "hit_s"}],  # recent hits,
                                                     # oldest first (hit_s: null until the kernel reported it)
      "time_saved": {"misses", "cache_s", "hits", "plain_s", "hit_s", "saved_s",  # since the daemon started
                     "untimed_ended", "untimed_waiting"},  # hits not in the sums: their times never came
      "texts":     {"used", "budget", "reserved", "unit_bytes", "more_bytes", "disk",  # display strings of
                                                     # the sizes above
                    "plain", "hits", "caching", "saved", "saved_detail"},  # and of time_saved
      "units":     {"simulated": bool, "fake_gpus": str, "reserve_gib": float, "unit_bytes": int,
                    "error": str | null, "waiting": int,
                    "waiters": [{"label", "units", "devices", "waited_s", "waited_text"} + NAMED],  # oldest first
                    "devices": [{"device", "id", "model", "total", "used", "free", "simulated", "total_bytes",
                                 "total_text", "holders": [{"label", "kernel", "pid", "units", "busy", "idle_s",
                                 "idle_text", "release_requested"} + NAMED]}]}  # least recently used first
    }

A CONNECTION is the daemon's `{"conn", "pid", "role", "label", "command"?, "connected"?}` with NAMED, what
the views show: `name` and `detail` (by default as the CLI names it, formats.kernel_name; the server
extension names its kernels by notebook: server/state.Names), `mine` (it is `my_conn`, the connection of
the kernel that draws the view) and, for a Jupyter server's kernels, `path`, `session_type`, `kernel_id`.
`progress` is `{"label", "done", "total", "unit", "eta_s", "percent", "text"}` while a load, a preload or
the copy of an entry runs; `pending` (what is still served from the checkpoint) carries its `text`; each
entry `bytes_text`, each load `reserved_text`. The daemon's status carries only some of the entries when
it holds many (Note [Status with many entries] in kernel_server/catalogue.py): the views show those, and
how many more there are. `units` counts units of `unit_bytes` (1 GiB); `total` is what the ledger may hand
out (the device's memory less its reserve).

Time, from one source (Note [Load time saved] in kernel_server/store.py): an entry's miss cost its caller
`waited_s` (from the call's start to its return), `load_s` of loading plus `cache_s` of caching, as the
kernel measured them and printed them in the cell ("cached llama in 20.1 s: loading 8.0 s + caching
12.1 s"; `miss_text`). A hit's `hit_s` is the whole wait of the hit call. What the cache saved:

    saved_s = sum over timed hits of (load_s of its entry - hit_s)  -  sum over misses of cache_s

each hit saves the plain load it replaced less its own wait, and every miss's caching is a cost, hit or
not. `time_saved` holds these sums over the daemon's life (its `saved_s` negative while the caching cost
more than the hits saved, or the hits took longer than the loads they replaced); `texts.saved` is `saved_s`
as a figure ("none" while it is negative: never a negative saving), `texts.saved_detail` says it with its
parts (and why none was saved).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kernel_server.formats import (
    byte_text,
    disk_text,
    kernel_name,
    miss_text,
    pending_text,
    percent,
    progress_text,
    saved_figure,
    saved_seconds,
    saved_text,
    seconds_text,
)
from kernel_server.payloads import (
    EntryStatus,
    LoadStatus,
    Pending,
    Progress,
    StatusReply,
    UnitsSnapshot,
)

__all__ = ["Naming", "state_view", "units_state", "units_view"]


class Naming(Protocol):
    """How a view names the daemon's connections: `conn` with `name` and `detail` (and what else the namer
    knows of it). server/state.Names is the Jupyter server's."""

    def connection(self, conn: Mapping[str, Any]) -> dict[str, Any]: ...


class _AsTheCliNames:
    """Connections named as the CLI names them (formats.kernel_name): where no Jupyter server's sessions are
    known, in a kernel."""

    def connection(self, conn: Mapping[str, Any]) -> dict[str, Any]:
        name, detail = kernel_name(conn)
        return dict(conn, name=name, detail=detail)


_NAMED = ("name", "detail", "path", "session_type", "kernel_id", "mine")


def state_view(status: StatusReply, *, names: Naming | None = None, own_conn: int | None = None,
               my_conn: int | None = None) -> dict[str, Any]:
    """The view of a daemon's `status` reply (the shape: this module's docstring).

    Args:
        status: the payload of the daemon's `status` reply.
        names: how to name the daemon's connections (default: as the CLI names them).
        own_conn: the viewer's own connection (the Jupyter server's), left out of `kernels`.
        my_conn: the connection of the kernel that shows the view: its connections carry `mine` true.
    """
    named = _Namer(names or _AsTheCliNames(), my_conn)
    entries = [_entry(e, named) for e in status["entries"]]
    used, shown = status["used"], sum(e["bytes"] for e in status["entries"])
    more_bytes = max(0, used - shown) if status["entries_more"] else 0
    sums = status["time_saved"]
    units = _units(status["units"], named)
    return {
        "state": "ok",
        "daemon": status["daemon"],
        "budget": status["budget"],
        "used": used,
        "reserved": status["reserved"],
        "disk": status["disk"],
        "stats": status["stats"],
        "entries": entries,
        "entries_total": status["entries_total"],
        "entries_more": status["entries_more"],
        "more_bytes": more_bytes,
        "loading": [_load(load, named) for load in status["loading"]],
        "kernels": [named.connection(k) for k in status["kernels"] if k["conn"] != own_conn],
        "fallbacks": [dict(f, **named.only_names(f)) for f in status["fallbacks"]],
        "hits_log": status["hits_log"],
        "time_saved": dict(sums, saved_s=saved_seconds(sums)),
        "units": units,
        "texts": {"used": byte_text(used), "budget": byte_text(status["budget"]),
                  "reserved": byte_text(status["reserved"]), "more_bytes": byte_text(more_bytes),
                  "disk": disk_text(status["disk"]), "unit_bytes": byte_text(units["unit_bytes"]),
                  "plain": seconds_text(sums["plain_s"]), "hits": seconds_text(sums["hit_s"]),
                  "caching": seconds_text(sums["cache_s"]), "saved": saved_figure(saved_seconds(sums)),
                  "saved_detail": saved_text(sums)},
    }


def units_view(snapshot: UnitsSnapshot, *, names: Naming | None = None, my_conn: int | None = None) -> dict[str, Any]:
    """The units ledger's snapshot (status's `units`, or the `units_state` reply) as the views draw it:
    `state_view`'s `units`; `names` and `my_conn` as there."""
    return _units(snapshot, _Namer(names or _AsTheCliNames(), my_conn))


def units_state(snapshot: UnitsSnapshot, *, my_conn: int | None = None) -> dict[str, Any]:
    """The part of `state_view` that the ledger's snapshot alone makes (`units`, `texts.unit_bytes`): what the
    units bar draws when it reads the ledger without the store's status."""
    units = units_view(snapshot, my_conn=my_conn)
    return {"units": units, "texts": {"unit_bytes": byte_text(units["unit_bytes"])}}


class _Namer:
    """`names` with `mine` marked on `my_conn`'s connections."""

    def __init__(self, names: Naming, my_conn: int | None) -> None:
        self._names, self._mine = names, my_conn

    def connection(self, conn: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self._names.connection(conn), mine=self._mine is not None and conn.get("conn") == self._mine)

    def only_names(self, conn: Mapping[str, Any]) -> dict[str, Any]:
        """What naming adds to `conn`, to merge into a record that is not a connection (a fallback, a holder)."""
        named = self.connection(conn)
        return {k: named[k] for k in _NAMED if k in named}


def _units(snapshot: UnitsSnapshot, named: _Namer) -> dict[str, Any]:
    devices = [{
        "device": dev["name"], "id": dev["id"], "model": dev["model"], "total": dev["capacity"],
        "used": dev["used"], "free": dev["free"], "simulated": dev["simulated"], "total_bytes": dev["total_bytes"],
        "total_text": byte_text(dev["total_bytes"]),
        "holders": [{"label": h["label"], "kernel": h["kernel"]["label"], "pid": h["pid"], "units": h["units"],
                     "busy": h["busy"], "idle_s": h["idle_s"], "release_requested": h["release_requested"],
                     "spare": h["spare"],
                     "idle_text": "" if h["idle_s"] is None else seconds_text(h["idle_s"]),
                     **named.only_names(h["kernel"])} for h in dev["holders"]],
    } for dev in snapshot["devices"]]
    waiters = [{"label": w["model"], "units": w["units"], "devices": w["devices"], "waited_s": w["waited_s"],
                "waited_text": seconds_text(w["waited_s"]), **named.only_names(w["kernel"])}
               for w in snapshot["waiters"]]
    return {"simulated": snapshot["simulated"] or any(d["simulated"] for d in devices),
            "fake_gpus": snapshot["fake_gpus"] or "", "reserve_gib": snapshot["reserve_gib"],
            "unit_bytes": snapshot["unit_bytes"], "error": snapshot["config_error"],
            "waiting": len(waiters), "waiters": waiters, "devices": devices}


def _entry(entry: EntryStatus, named: _Namer) -> dict[str, Any]:
    label = entry["meta"].get("label")
    return dict(entry, label=str(label) if label else entry["key"][:16], bytes_text=byte_text(entry["bytes"]),
                miss_text=miss_text(entry), pinned_by=[named.connection(c) for c in entry["pinned_by"]],
                progress=_progress(entry["progress"]), pending=_pending(entry["pending"]))


def _load(load: LoadStatus, named: _Namer) -> dict[str, Any]:
    return dict(load, loader=named.connection(load["loader"]), progress=_progress(load["progress"]),
                reserved_text=byte_text(load["reserved"]))


def _progress(progress: Progress | None) -> dict[str, Any] | None:
    """A progress with its `percent` (None while the total is unknown) and its display `text` ("loading
    llama: 40% (1.2 GiB of 3.0 GiB), 3.5 s left")."""
    if progress is None:
        return None
    total = progress["total"]
    return dict(progress, text=progress_text(progress), percent=percent(progress["done"], total) if total > 0 else None)


def _pending(pending: Pending | None) -> dict[str, Any] | None:
    """An entry's pieces still served from its checkpoint, with their display `text`."""
    return None if pending is None else dict(pending, text=pending_text(pending))
