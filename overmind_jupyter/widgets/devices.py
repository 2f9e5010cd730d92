"""The units bar: one bar per GPU, one segment per holder, busy and idle shaded differently.

It reads either `overmind_jupyter.units.state()` (what `%overmind units` shows: the ledger as this kernel
sees it, with its devices registered) or the `units` part of the daemon's status (inside `%overmind status`,
which registers nothing). `units_view` shapes both the same way.
"""

from __future__ import annotations

import time
from typing import Any

import traitlets

from kernel_server.settings import GiB

from .live import CSS, JS_HELPERS, LiveView, with_text

__all__ = ["UnitsBar", "fetch_units", "units_view"]


def fetch_units() -> dict[str, Any]:
    """The feed of `%overmind units`: `units.state()`, but never a daemon started by a poll (a user who
    stopped the daemon sees it stopped, not started again by a widget)."""
    from kernel_server.client import existing_shared_client, shared_client

    from .. import units

    if existing_shared_client() is None:
        shared_client(spawn=False)  # raises DaemonUnavailable when none runs
    return units.state()


def units_view(raw: dict[str, Any] | None, my_conn: int | None = None) -> dict[str, Any]:
    """The trait values of `UnitsBar` for a ledger snapshot.

    Args:
        raw: `units.state()`, or the `units` of the daemon's status reply (None: the daemon has no ledger).
        my_conn: this kernel's connection id, to mark its holdings where the snapshot does not.

    Returns:
        `dict` with `devices` (each: `name`, `id`, `model`, `simulated`, `capacity`, `used`, `free`,
        `total_bytes`, `holders` least recently used first (each: `model`, `units`, `busy`, `idle_since`
        (epoch seconds, whole; None while busy), `pid`, `kernel` (its notebook, or pid and command), `detail`
        (pid, path, command), `mine`, `release_requested`)), `simulated`,
        `fake_gpus`, `unit_bytes`, `reserve_gib`, `problem` (the ledger's configuration error) and `waiters`.
    """
    from kernel_server.formats import kernel_name

    raw = raw or {}
    now = time.time()
    devices = []
    for dev in raw.get("devices") or []:
        holders = []
        for holder in dev.get("holders") or []:
            kernel = holder.get("kernel") if isinstance(holder.get("kernel"), dict) else {}
            mine = holder.get("mine")
            if mine is None:
                mine = my_conn is not None and kernel.get("conn") == my_conn
            busy = bool(holder.get("busy"))
            idle_s = holder.get("idle_s")
            holders.append({
                "model": str(holder.get("model") or holder.get("label") or "?"),
                "units": int(holder.get("units") or 0),
                "busy": busy,
                "idle_since": None if busy or idle_s is None else round(now - float(idle_s)),
                "pid": kernel.get("pid", holder.get("pid")),
                "kernel": kernel_name(kernel)[0] if kernel else f"pid {holder.get('pid')}",
                "detail": kernel_name(kernel)[1] if kernel else "",
                "mine": bool(mine),
                "release_requested": bool(holder.get("release_requested")),
            })
        devices.append({
            "name": str(dev.get("here") or dev.get("name") or dev.get("id", "?")),
            "id": str(dev.get("id", "")),
            "model": str(dev.get("model") or ""),
            "simulated": bool(dev.get("simulated", raw.get("simulated", False))),
            "capacity": int(dev.get("capacity") or 0),
            "used": int(dev.get("used") or 0),
            "free": int(dev.get("free") or 0),
            "total_bytes": int(dev.get("total_bytes") or 0),
            "holders": holders,
        })
    waiters = [{
        "model": str(w.get("model") or "a model"),
        "units": int(w.get("units") or 0),
        "devices": [str(d) for d in w.get("devices") or []],
        "pid": (w.get("kernel") or {}).get("pid"),
        "since": round(now - float(w.get("waited_s") or 0.0), 1),
    } for w in raw.get("waiters") or []]
    return {
        "devices": devices,
        "simulated": bool(raw.get("simulated")) or any(d["simulated"] for d in devices),
        "fake_gpus": str(raw.get("fake_gpus") or ""),
        "unit_bytes": int(raw.get("unit_bytes") or GiB),
        "reserve_gib": float(raw.get("reserve_gib") or 0.0),
        "problem": str(raw.get("config_error") or ""),
        "waiters": waiters,
    }


class UnitsBar(LiveView):
    """GPU units per device: a bar each, a segment per holder (busy solid, idle hatched), "simulated" on
    simulated devices.

    Traits (synced, read-only for the frontend): `devices`, `simulated`, `fake_gpus`, `unit_bytes`,
    `reserve_gib`, `problem`, `waiters` (see `units_view`), `error` (why the ledger could not be read).

    Args:
        live: subscribe to the "units" feed (`units.state()`) itself; a `StatusPanel` feeds its bar from
            the daemon's status instead.
    """

    devices = traitlets.List(traitlets.Dict()).tag(sync=True)
    simulated = traitlets.Bool(False).tag(sync=True)
    fake_gpus = traitlets.Unicode("").tag(sync=True)
    unit_bytes = traitlets.Int(GiB).tag(sync=True)
    reserve_gib = traitlets.Float(0.0).tag(sync=True)
    problem = traitlets.Unicode("").tag(sync=True)
    waiters = traitlets.List(traitlets.Dict()).tag(sync=True)

    _esm = JS_HELPERS + r"""
function holderTitle(x) {
  const who = x.mine ? "this kernel (" + x.kernel + ")" : x.kernel;
  return x.model + ": " + x.units + (x.units === 1 ? " unit, " : " units, ") + who + ", " +
    (x.busy ? "busy" : "idle") + (x.release_requested ? ", asked to release" : "");
}
function deviceBlock(d) {
  const segs = d.holders.map((x) => h("div", {
      class: "om-seg " + (x.busy ? "om-busy" : "om-idle") + (x.mine ? " om-mine" : ""),
      "data-testid": "overmind-widget-segment", "data-busy": x.busy ? "true" : "false", "data-model": x.model,
      title: holderTitle(x), style: "flex-grow: " + x.units + "; flex-basis: 0" },
    h("span", { class: "om-seg-label" }, x.model + " (" + x.units + ")")));
  if (d.free > 0) segs.push(h("div", { class: "om-seg om-free", title: d.free + " units free",
    style: "flex-grow: " + d.free + "; flex-basis: 0" }));
  const rows = d.holders.map((x) => h("tr", { "data-testid": "overmind-widget-holder" },
    h("td", {}, h("span", { class: "om-swatch " + (x.busy ? "om-busy" : "om-idle") }), " ", x.model),
    h("td", { class: "om-num" }, String(x.units)),
    h("td", { title: x.detail, "data-testid": "overmind-widget-holder-kernel" }, x.kernel, x.mine ? h("b", {}, " (this kernel)") : null),
    h("td", x.busy ? {} : { "data-idle-since": x.idle_since }, x.busy ? h("b", {}, "busy") : "idle"),
    h("td", { class: "om-muted" }, x.release_requested ? "asked to release" : "")));
  return h("div", { class: "om-device", "data-testid": "overmind-widget-device", "data-device": d.name },
    h("div", { class: "om-head" },
      h("span", { class: "om-title" }, d.name),
      d.simulated ? h("span", { class: "om-sim", "data-testid": "overmind-widget-simulated" }, "simulated") : h("span", { class: "om-muted" }, d.model),
      h("span", {}, d.used + " of " + d.capacity + " units used, " + d.free + " free"),
      d.total_bytes ? h("span", { class: "om-muted" }, fmtBytes(d.total_bytes)) : null),
    h("div", { class: "om-bar" }, segs),
    rows.length ? h("table", { class: "om-holders" }, h("tbody", {}, rows)) : h("div", { class: "om-muted" }, "no holders"));
}
function draw(model, root) {
  const devices = model.get("devices") || [];
  const waiters = model.get("waiters") || [];
  const error = model.get("error");
  const gib = (model.get("unit_bytes") || 1073741824) / 1073741824;
  const parts = [h("div", { class: "om-head" },
    h("span", { class: "om-title" }, "GPU units"),
    h("span", { class: "om-muted" }, "1 unit = " + gib + " GiB" + (model.get("reserve_gib") ? ", " + model.get("reserve_gib") + " GiB of each device reserved" : "")),
    model.get("simulated") ? h("span", { class: "om-sim" }, "simulated devices" + (model.get("fake_gpus") ? " (OVERMIND_FAKE_GPUS=" + model.get("fake_gpus") + ")" : "")) : null,
    h("span", { class: "om-legend" }, h("span", { class: "om-swatch om-busy" }), " busy ", h("span", { class: "om-swatch om-idle" }), " idle"))];
  if (error) parts.push(h("div", { class: "om-error", "data-testid": "overmind-widget-units-error" }, error));
  if (model.get("problem")) parts.push(h("div", { class: "om-error" }, "ledger disabled: " + model.get("problem")));
  if (!devices.length && !error) parts.push(h("div", { class: "om-muted", "data-testid": "overmind-widget-nodevices" },
    "no GPU known yet (a kernel reports its devices when it first uses units)"));
  for (const d of devices) parts.push(deviceBlock(d));
  for (const w of waiters) parts.push(h("div", { "data-testid": "overmind-widget-waiter" },
    "waiting: pid " + w.pid + " " + w.model + " for " + w.units + " units on " + w.devices.join(" or ") + " ",
    h("span", { "data-ago": w.since }, "")));
  root.replaceChildren(...parts);
}
export default {
  render({ model, el }) {
    const root = h("div", { class: "om-w om-units", "data-testid": "overmind-widget-units" });
    el.append(root);
    return live(model, el, ["devices", "waiters", "simulated", "fake_gpus", "unit_bytes", "reserve_gib", "problem", "error"],
      () => draw(model, root));
  },
};
"""
    _css = CSS + r"""
.om-units .om-device { margin: 6px 0 10px; }
.om-units .om-bar { display: flex; height: 22px; border: 1px solid var(--jp-border-color1, #bbb); border-radius: 3px;
  overflow: hidden; background: var(--jp-layout-color2, #eee); }
.om-units .om-seg { overflow: hidden; white-space: nowrap; text-overflow: ellipsis; font-size: 11px; line-height: 22px;
  padding: 0 4px; border-right: 1px solid var(--jp-layout-color0, #fff); min-width: 2px; }
.om-units .om-busy { background: var(--jp-brand-color1, #1976d2); color: var(--jp-ui-inverse-font-color1, #fff); }
.om-units .om-idle { background: repeating-linear-gradient(135deg, var(--jp-layout-color1, #fff) 0 5px,
  var(--jp-brand-color2, #64b5f6) 5px 7px); color: var(--jp-ui-font-color1, #222); }
.om-units .om-idle .om-seg-label { background: var(--jp-layout-color1, #fff); padding: 0 3px; border-radius: 2px; }
.om-units .om-mine { box-shadow: inset 0 0 0 2px var(--jp-brand-color0, #0d47a1); }
.om-units .om-free { background: transparent; border-right: none; }
.om-units .om-swatch { display: inline-block; width: 12px; height: 10px; border-radius: 2px; vertical-align: middle; }
.om-units table.om-holders { width: auto; margin-top: 3px; }
.om-units table.om-holders td { border-bottom: none; padding: 1px 8px 1px 0; }
"""

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
        from kernel_server.client import existing_shared_client

        with self.hold_sync():
            self.take_notice()
            if error is not None:
                self.error = f"cannot read the units ledger: {error}"
                return
            self._last = snapshot
            client = existing_shared_client()
            view = units_view(snapshot, client.conn_id if client is not None else None)
            self.error = ""
            for name, value in view.items():
                setattr(self, name, value)
