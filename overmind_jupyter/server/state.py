"""What the side panel shows: the daemon's `status` reply, shaped for the panel.

The reply of `GET {base_url}overmind/state` (all sizes in bytes, times in seconds since the epoch):

    {
      "state":     "ok",                                 # "down" (and "message", "home") without a daemon
      "daemon":    {"pid", "version", "protocol", "home", "started"},
      "budget", "used", "reserved",                      # the store's byte budget and its use
      "disk":      null | {"directory", "used", "free", "size", "reserve"},  # under file arenas (disk.py)
      "stats":     {"hits", "misses", ...},              # the store's counters, as the daemon keeps them
      "entries":   [{"key", "label", "bytes", "hits", "last_used", "created", "backing", "load_s"?,
                     "pinned_by": [CONNECTION + {"pins"}], "progress"?, ...}],  # the largest, then the
                                                     # most recently used (at most 50)
      "entries_total", "entries_more",               # entries cached in all, and those not in `entries`
      "more_bytes":  int,                            # what those hold
      "loading":   [{"key", "since", "reserved", "loader": CONNECTION, "waiters", "progress"?}],
      "kernels":   [CONNECTION],                         # connected processes, this server left out
      "fallbacks": [{"time", "pid", "label", "name", "detail", "call", "kind", "reason"}],
      "hits_log":  [{"t", "key", "label", "load_s", "hit_s"}],  # recent hits, oldest first (hit_s: null
                                                     # until the kernel reported it)
      "texts":     {"used", "budget", "reserved", "unit_bytes", "more_bytes", "disk",  # display strings of
                                                     # the sizes above
                    "plain", "hits", "saved"},           # and of the timed hits' sums
      "units":     null | {"simulated": bool, "unit_bytes": int, "error": str | null, "waiting": int,
                           "devices": [{"device", "id", "model", "total", "used", "free", "simulated",
                                        "holders": [{"label", "kernel", "pid", "units", "busy"}]}]}
    }

A CONNECTION is the daemon's `{"conn", "pid", "role", "label", "command"?}` with what the panel shows:
`name` (the notebook or console path the Jupyter server's sessions give the kernel of that pid, else the
daemon's label, else the command) and `detail` ("pid 123", and the command of a process outside this
server), and, for this server's kernels, `path`, `session_type` and `kernel_id` (Note [Kernels by
notebook]). `progress` is `{"label", "done", "total", "unit", "eta_s"}` while a load or a preload runs.
Each entry carries `bytes_text`, each load `reserved_text`, each progress `text`: the sizes and times
written by the one formatter the CLI and the widgets use. The daemon's status carries only some of the
entries when it holds many (Note [Status with many entries] in kernel_server/catalogue.py): the panel shows
those, and how many more there are.

`units` is null while the daemon has no units ledger; its numbers count units of `unit_bytes` (1 GiB);
`total` is what the ledger may hand out (the device's memory less its reserve).
The ledger's snapshot (kernel_server/ledger.py) is read tolerantly (a list of devices or a mapping keyed
by device, a few spellings of its counts), so that the panel shows what an older or newer daemon reports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kernel_server.formats import byte_text, disk_text, kernel_name, pending_text, percent, progress_text, seconds_text
from kernel_server.settings import GiB

__all__ = ["Names", "ServerKernel", "down_state", "panel_state", "units_view"]

# How a preload's worker process labels itself (overmind_jupyter/worker.py).
_PRELOAD = re.compile(r"preload for pid (\d+)")

_TOTAL = ("capacity", "total", "units", "total_units")
_USED = ("used", "leased", "taken", "used_units", "in_use")
_FREE = ("free", "available", "free_units")
_HOLDERS = ("holders", "holdings", "leases")


# Note [Kernels by notebook]
# The daemon knows a connection by its pid, its role and the label the process gave it (a kernel's
# notebook path from JPY_SESSION_NAME, or "kernel ID" for a kernel started without a session). The
# Jupyter server knows which notebook or console each of its kernels serves, and the pid of each kernel
# it started. So the server names the daemon's connections: by the session path of the kernel with that
# pid (or with that kernel id in its label), else as the CLI and the widgets do (formats.kernel_name).
# The pid stays in `detail`, for the hover.


@dataclass(frozen=True)
class ServerKernel:
    """One kernel of this Jupyter server, as its session manager knows it.

    Args:
        kernel_id: the server's id of the kernel.
        pid: the kernel process's pid (None for a kernel that is not a local process).
        path: the notebook's or console's path in the server's root ("" for a kernel without a session).
        session_type: "notebook", "console", "file"... as the session says.
    """

    kernel_id: str
    pid: int | None
    path: str
    session_type: str


class Names:
    """How the panel names each connection of the daemon, from the server's kernels (see the Note)."""

    def __init__(self, kernels: Iterable[ServerKernel] = ()) -> None:
        self._by_pid = {k.pid: k for k in kernels if k.pid is not None}
        self._by_id = {k.kernel_id: k for k in kernels}

    def connection(self, conn: dict[str, Any]) -> dict[str, Any]:
        """`conn` (a connection as the daemon describes it) with `name` and `detail`, and the session's
        `path`, `session_type` and `kernel_id` when it is one of this server's kernels."""
        pid = conn.get("pid")
        label = str(conn.get("label") or "")
        kernel = ((self._by_pid.get(pid) if isinstance(pid, int) else None)
                  or self._by_id.get(label.removeprefix("kernel ")))
        out = dict(conn)
        if kernel is not None and kernel.path:
            out.update(path=kernel.path, session_type=kernel.session_type, kernel_id=kernel.kernel_id,
                       name=kernel.path, detail=f"pid {pid}, {kernel.session_type} kernel {kernel.kernel_id[:8]}")
        else:  # outside this server: as the CLI and the widgets name it
            out["name"], out["detail"] = kernel_name(conn)
            parent = _PRELOAD.fullmatch(label)
            kernel = self._by_pid.get(int(parent.group(1))) if parent else None
            if kernel is not None and kernel.path:  # a preload's worker, for one of this server's kernels
                out["name"] = f"preload for {kernel.path}"
        return out


def panel_state(status: dict[str, Any], own_conn: int | None = None, names: Names | None = None) -> dict[str, Any]:
    """Shape a daemon `status` reply for the panel.

    Args:
        status: the payload of the daemon's `status` reply.
        own_conn: this server's connection id, left out of `kernels`.
        names: this server's kernels, to name the daemon's connections by notebook.
    """
    names = names or Names()
    entries = [
        dict(entry, label=_entry_label(entry), bytes_text=byte_text(entry.get("bytes", 0)),
             pinned_by=[names.connection(c) for c in entry.get("pinned_by", [])],
             progress=_progress(entry.get("progress")), pending=_pending(entry.get("pending")))
        for entry in status.get("entries", [])
    ]
    kernels = [names.connection(k) for k in status.get("kernels", [])
               if own_conn is None or k.get("conn") != own_conn]
    loading = [
        dict(load, loader=names.connection(load.get("loader") or {}), progress=_progress(load.get("progress")),
             reserved_text=byte_text(load.get("reserved", 0)))
        for load in status.get("loading", [])
    ]
    fallbacks = [dict(f, **_named(names, f)) for f in status.get("fallbacks", [])]
    units = units_view(status.get("units"))
    if units is not None:
        for device in units["devices"]:
            device["holders"] = [dict(h, **_named(names, {"pid": h["pid"], "label": h["kernel"]}))
                                 for h in device["holders"]]
    budget, used, reserved = (int(status.get(name, 0)) for name in ("budget", "used", "reserved"))
    total = int(status.get("entries_total", len(entries)))  # a daemon before protocol 3 sends them all
    more_bytes = max(0, used - sum(int(e.get("bytes", 0)) for e in entries)) if total > len(entries) else 0
    hits_log = _hits_log(status.get("hits_log"))
    timed = [h for h in hits_log if h["hit_s"] is not None]
    plain, served = sum(h["load_s"] for h in timed), sum(h["hit_s"] for h in timed)
    return {
        "state": "ok",
        "daemon": status.get("daemon", {}),
        "budget": budget,
        "used": used,
        "reserved": reserved,
        "disk": status.get("disk"),
        "stats": status.get("stats", {}),
        "entries": entries,
        "entries_total": total,
        "entries_more": total - len(entries),
        "more_bytes": more_bytes,
        "loading": loading,
        "kernels": kernels,
        "fallbacks": fallbacks,
        "hits_log": hits_log,
        "units": units,
        "texts": {"used": byte_text(used), "budget": byte_text(budget), "reserved": byte_text(reserved),
                  "more_bytes": byte_text(more_bytes), "disk": disk_text(status.get("disk")),
                  "unit_bytes": byte_text(units["unit_bytes"]) if units else "",
                  "plain": seconds_text(plain), "hits": seconds_text(served), "saved": seconds_text(plain - served)},
    }


def down_state(home: str, message: str) -> dict[str, Any]:
    """The answer while no daemon runs: a state of the panel, not an error (no model was loaded yet)."""
    return {"state": "down", "home": home, "message": message}


def _named(names: Names, conn: dict[str, Any]) -> dict[str, Any]:
    named = names.connection(conn)
    return {k: named[k] for k in ("name", "detail", "path", "session_type", "kernel_id") if k in named}


def _progress(raw: Any) -> dict[str, Any] | None:
    """A load's or preload's progress with its `percent` (None while the total is unknown) and its
    display `text` ("loading llama: 40% (1.2 GiB of 3.0 GiB), 3.5 s left"), or None."""
    if not isinstance(raw, dict):
        return None
    total = raw.get("total")
    known = isinstance(total, (int, float)) and total > 0
    return dict(raw, label=str(raw.get("label") or ""), text=progress_text(raw),
                percent=percent(raw.get("done") or 0, float(total or 0)) if known else None)


def _pending(raw: Any) -> dict[str, Any] | None:
    """An entry's pieces still served from its checkpoint, with their display `text`."""
    return dict(raw, text=pending_text(raw)) if isinstance(raw, dict) else None


def _hits_log(raw: Any) -> list[dict[str, Any]]:
    """The daemon's recent hits whose plain load was timed at the miss. A hit's own time (`hit_s`) is
    None until its kernel reports it, after the hit (Note [Load time saved] in kernel_server/store.py)."""
    if not isinstance(raw, list):
        return []
    return [dict(h, hit_s=h.get("hit_s") if isinstance(h.get("hit_s"), (int, float)) else None)
            for h in raw if isinstance(h, dict) and isinstance(h.get("load_s"), (int, float))]


def units_view(raw: Any) -> dict[str, Any] | None:
    """The units ledger's snapshot shaped for the panel, or None when the daemon has no ledger."""
    if raw is None:
        return None
    ledger = raw if isinstance(raw, dict) else {"devices": raw}
    simulated = bool(ledger.get("simulated", False))
    devices: Any = ledger.get("devices", [])
    if isinstance(devices, dict):
        items = [(str(name), dev) for name, dev in devices.items() if isinstance(dev, dict)]
    elif isinstance(devices, list):
        items = [(str(_first(dev, ("name", "device", "index", "id"), i)), dev)
                 for i, dev in enumerate(devices) if isinstance(dev, dict)]
    else:
        items = []
    out = []
    for name, dev in items:
        total = _number(dev, _TOTAL)
        used = _number(dev, _USED)
        free = _number(dev, _FREE)
        if used is None and total is not None and free is not None:
            used = total - free
        if free is None and total is not None and used is not None:
            free = total - used
        out.append({
            "device": name,
            "id": str(dev.get("id", name)),
            "model": str(dev.get("model") or ""),
            "total": total or 0,
            "used": used or 0,
            "free": free if free is not None else 0,
            "simulated": bool(dev.get("simulated", simulated)),
            "holders": [_holder(h) for h in _holders(dev)],
        })
    waiters = ledger.get("waiters")
    return {
        "simulated": simulated or any(d["simulated"] for d in out),
        "unit_bytes": ledger.get("unit_bytes", GiB),
        "error": ledger.get("config_error") or None,
        "waiting": len(waiters) if isinstance(waiters, list) else 0,
        "devices": out,
    }


def _entry_label(entry: dict[str, Any]) -> str:
    meta = entry.get("meta") or {}
    label = meta.get("label") if isinstance(meta, dict) else None
    return str(label) if label else str(entry.get("key", ""))[:16]


def _first(mapping: dict[str, Any], names: tuple[str, ...], default: Any = None) -> Any:
    for name in names:
        if mapping.get(name) is not None:
            return mapping[name]
    return default


def _number(mapping: dict[str, Any], names: tuple[str, ...]) -> int | None:
    value = _first(mapping, names)
    if isinstance(value, list):  # a list of leases, say: count what they hold
        return sum(int(v.get("units", 1)) if isinstance(v, dict) else 1 for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    return None


def _holders(dev: dict[str, Any]) -> list[Any]:
    value = _first(dev, _HOLDERS, [])
    if isinstance(value, dict):
        return [dict(v, label=v.get("label", k)) if isinstance(v, dict) else {"label": k, "units": v}
                for k, v in value.items()]
    return value if isinstance(value, list) else []


def _holder(holder: Any) -> dict[str, Any]:
    """One holding: the model it is for, the kernel that holds it, its units, busy or idle."""
    if not isinstance(holder, dict):
        return {"label": str(holder), "kernel": "", "pid": None, "units": None, "busy": None}
    kernel = holder.get("kernel")
    kernel = kernel if isinstance(kernel, dict) else {"label": kernel} if kernel else {}
    return {
        "label": str(_first(holder, ("model", "label", "name"), "")),
        "kernel": str(kernel.get("label") or ""),
        "pid": kernel.get("pid", holder.get("pid")),
        "units": _number(holder, ("units", "count", "n")),
        "busy": holder.get("busy"),
    }
