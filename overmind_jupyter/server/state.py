"""What the side panel shows: the daemon's `status` reply, shaped for the panel.

The reply of `GET {base_url}overmind/state` (all sizes in bytes, times in seconds since the epoch):

    {
      "daemon":    {"pid", "version", "protocol", "home", "started"},
      "budget", "used", "reserved",                      # the store's byte budget and its use
      "stats":     {"hits", "misses", ...},              # the store's counters, as the daemon keeps them
      "entries":   [{"key", "label", "bytes", "hits", "last_used", "created", "backing",
                     "pinned_by": [{"conn", "pid", "role", "label", "pins"}], ...}],
      "loading":   [{"key", "since", "reserved", "loader", "waiters"}],
      "kernels":   [{"conn", "pid", "role", "label"}],   # connected processes, this server left out
      "fallbacks": [{"time", "pid", "label", "call", "kind", "reason"}],
      "units":     null | {"simulated": bool, "unit_bytes": int, "error": str | null, "waiting": int,
                           "devices": [{"device", "id", "model", "total", "used", "free", "simulated",
                                        "holders": [{"label", "kernel", "pid", "units", "busy"}]}]}
    }

`units` is null while the daemon has no units ledger; its numbers count units of `unit_bytes` (1 GiB);
`total` is what the ledger may hand out (the device's memory less its reserve).
The ledger's snapshot (kernel_server/ledger.py) is read tolerantly (a list of devices or a mapping keyed
by device, a few spellings of its counts), so that the panel shows what an older or newer daemon reports.
"""

from __future__ import annotations

from typing import Any

from kernel_server.settings import GiB

__all__ = ["panel_state", "units_view"]

_TOTAL = ("capacity", "total", "units", "total_units")
_USED = ("used", "leased", "taken", "used_units", "in_use")
_FREE = ("free", "available", "free_units")
_HOLDERS = ("holders", "holdings", "leases")


def panel_state(status: dict[str, Any], own_conn: int | None = None) -> dict[str, Any]:
    """Shape a daemon `status` reply for the panel.

    Args:
        status: the payload of the daemon's `status` reply.
        own_conn: this server's connection id, left out of `kernels`.
    """
    entries = [dict(entry, label=_entry_label(entry)) for entry in status.get("entries", [])]
    kernels = [k for k in status.get("kernels", []) if own_conn is None or k.get("conn") != own_conn]
    return {
        "daemon": status.get("daemon", {}),
        "budget": status.get("budget", 0),
        "used": status.get("used", 0),
        "reserved": status.get("reserved", 0),
        "stats": status.get("stats", {}),
        "entries": entries,
        "loading": status.get("loading", []),
        "kernels": kernels,
        "fallbacks": status.get("fallbacks", []),
        "units": units_view(status.get("units")),
    }


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
