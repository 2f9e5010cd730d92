"""The cache table: what the daemon holds, who uses it, an evict button per entry, and the calls that fell back.

`cache_view(status)` turns `overmind_jupyter.status()` into the table's trait values (plain JSON, so tests
read them as they are); `CacheTable` draws them.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from typing import Any

import traitlets

from .live import CSS, JS_HELPERS, LiveView, run_action

__all__ = ["SEGMENT_COLOURS", "SEGMENT_PATTERNS", "CacheTable", "cache_view", "fetch_status", "open_gates"]

# Note [Segment colours]
# "Memory per model" gives each entry a colour, in the widget and in the side panel alike. The theme's
# colours repeat (JupyterLab's accent and success colours are the same green), and six or seven of them
# cycled; these ten have distinct hues, readable on light and dark backgrounds, and entry i takes colour
# i % 10 with pattern i // 10 % 3 (plain, then light stripes one way, then the other), so the first 30
# entries never look alike. labextension/src/charts.ts holds the same list (tests/test_widgets.py compares).
SEGMENT_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7",
                   "#9c755f", "#1f3f8f")
SEGMENT_PATTERNS = 3


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


def cache_view(snapshot: dict[str, Any], my_conn: int | None = None) -> dict[str, Any]:
    """The trait values of `CacheTable` for one `status()` snapshot.

    Args:
        snapshot: what `overmind_jupyter.status()` returned (with `gates` from `open_gates`, optionally).
        my_conn: this kernel's connection id, to mark the entries it uses.

    Returns:
        `dict` with `entries` (each: `key`, `label`, `cls`, `model`, `path`, `dtype`, `bytes`, `hits`,
        `last_used`, `created`, `load_s` (the plain load's time, measured at its miss), `kernels` (`pid`,
        `label`, `name` (the notebook's file name, or pid and command), `detail` (pid, path, command),
        `mine`), `pending` (what the daemon still copies from the checkpoint: `text` and `percent`, or
        None)): the largest and the most recently used when the daemon holds many (Note [Status with many
        entries] in kernel_server/catalogue.py), `fallbacks` (each: `time`, `pid`, `kernel`, `call`, `kind`,
        `reason`, `here`), `summary` (with `entries_total` and `entries_more`: the entries cached in all and
        those not in `entries`, and `more_bytes`, what those hold; `disk`: the disk under the file arenas
        as text, "" where they take memory; `loads`: the loads in flight, each `key`,
        `text`, `percent` and `by`; and `hits`: the
        daemon's recent hits for the time-saved chart, each `model`, `label`, `t`, `load_s`, `hit_s`, and
        `saved_s`, their sum of plain load time minus hit time) and `gates`.
    """
    from kernel_server.formats import disk_text

    daemon = snapshot.get("daemon")
    my_pid = os.getpid()
    entries = [_entry(e, my_conn) for e in (daemon or {}).get("entries", [])]
    summary: dict[str, Any] = {
        "enabled": bool(snapshot.get("enabled")),
        "patched": len(snapshot.get("patched") or []),
        "home": snapshot.get("home", ""),
        "daemon_error": snapshot.get("daemon_error", "") if daemon is None else "",
    }
    if daemon is not None:
        summary.update({
            "daemon_pid": (daemon.get("daemon") or {}).get("pid"),
            "budget": daemon.get("budget", 0),
            "used": daemon.get("used", 0),
            "reserved": daemon.get("reserved", 0),
            "disk": disk_text(daemon.get("disk")),  # "" where the arenas take memory (Note [Disk room])
            "stats": dict(daemon.get("stats") or {}),
            **_more(daemon, entries),
            "kernels": len(daemon.get("kernels") or []),
            "loading": len(daemon.get("loading") or []),
            "loads": [_load(load) for load in daemon.get("loading") or []],
            **_hits(daemon.get("hits_log") or []),
        })
    return {"entries": entries, "fallbacks": _fallbacks(snapshot, daemon, my_pid), "summary": summary,
            "gates": list(snapshot.get("gates") or [])}


def _more(daemon: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """How many entries the daemon holds beyond those shown, and their bytes (a daemon before protocol 3
    sends every entry)."""
    total = int(daemon.get("entries_total", len(entries)))
    more = total - len(entries)
    more_bytes = max(0, int(daemon.get("used") or 0) - sum(e["bytes"] for e in entries)) if more else 0
    return {"entries_total": total, "entries_more": more, "more_bytes": more_bytes}


def _load(load: dict[str, Any]) -> dict[str, Any]:
    """A load in flight, with its progress (Note [Progress] in kernel_server/store.py)."""
    from kernel_server.formats import kernel_name, percent, progress_text

    progress = load.get("progress")
    return {"key": str(load.get("key", "")),
            "text": progress_text(progress) if progress else f"loading {str(load.get('key', ''))[:12]}",
            "percent": percent(progress["done"], progress["total"]) if progress else None,
            "by": kernel_name(load.get("loader") or {})[0]}


def _hits(log: list[dict[str, Any]], last: int = 30) -> dict[str, Any]:
    """The time-saved chart's data: the last hits (each its plain load time and its own), and the sum."""
    from ..progress import model_name

    hits: list[dict[str, Any]] = [
        {"model": model_name(str(h.get("label") or h.get("key", "")[:12])), "label": str(h.get("label") or ""),
         "t": float(h.get("t") or 0.0), "load_s": h.get("load_s"), "hit_s": h.get("hit_s")} for h in log]
    saved = sum(max(0.0, float(h["load_s"]) - float(h["hit_s"])) for h in hits
                if h["load_s"] is not None and h["hit_s"] is not None)
    return {"hits": hits[-last:], "saved_s": saved, "hits_counted": len(hits)}


def _entry(e: dict[str, Any], my_conn: int | None) -> dict[str, Any]:
    meta = e.get("meta") or {}
    label = str(meta.get("label") or e.get("key", "")[:16])
    qualified = str(meta.get("class") or "")
    cls = qualified.rsplit(".", 1)[-1] if qualified else label.split("(", 1)[0].split(".", 1)[0]
    path = _unrepr(meta.get("source"))
    model = os.path.basename(path.rstrip("/")) if os.path.isabs(path) else path
    return {
        "key": e.get("key", ""),
        "label": label,
        "cls": cls,
        "model": model or label,
        "path": path,
        "dtype": str(meta.get("dtype") or ""),
        "bytes": int(e.get("bytes") or 0),
        "hits": int(e.get("hits") or 0),
        "last_used": float(e.get("last_used") or 0.0),
        "created": float(e.get("created") or 0.0),
        "load_s": e.get("load_s"),
        "kernels": [_kernel(k, my_conn) for k in e.get("pinned_by") or []],
        "pending": _pending(e.get("pending")),
    }


def _kernel(k: dict[str, Any], my_conn: int | None) -> dict[str, Any]:
    from kernel_server.formats import kernel_name

    name, detail = kernel_name(k)
    return {"pid": k.get("pid"), "label": str(k.get("label") or ""), "name": name, "detail": detail,
            "mine": my_conn is not None and k.get("conn") == my_conn}


def _pending(pending: dict[str, Any] | None) -> dict[str, Any] | None:
    """An entry's compaction (Note [Pending pieces] in kernel_server/store.py), as the widgets show it."""
    from kernel_server.formats import pending_text, percent

    if not pending:
        return None
    return {"text": pending_text(pending), "percent": percent(pending["done"], pending["bytes"])}


def _unrepr(source: Any) -> str:
    """The model id or path of a key's meta (stored as the repr of the argument)."""
    if not source:
        return ""
    try:
        value = ast.literal_eval(str(source))
    except (ValueError, SyntaxError):
        return str(source)
    return value if isinstance(value, str) else str(source)


def _fallbacks(snapshot: dict[str, Any], daemon: dict[str, Any] | None, my_pid: int) -> list[dict[str, Any]]:
    """Every kernel's fallbacks (the daemon's list), and this kernel's that never reached the daemon."""
    from kernel_server.formats import kernel_name

    out = [{"time": float(f.get("time") or 0.0), "pid": f.get("pid"), "kernel": kernel_name(f)[0],
            "call": str(f.get("call") or ""), "kind": str(f.get("kind") or ""), "reason": str(f.get("reason") or ""),
            "here": f.get("pid") == my_pid}
           for f in (daemon or {}).get("fallbacks", [])]
    reported = [(f["call"], f["reason"], f["time"]) for f in out if f["here"]]
    for f in snapshot.get("fallbacks") or []:
        call, reason, when = str(f.get("call", "")), str(f.get("reason", "")), float(f.get("time") or 0.0)
        if any(c == call and r == reason and abs(t - when) < 5 for c, r, t in reported):
            continue
        out.append({"time": when, "pid": my_pid, "kernel": "this kernel", "call": call,
                    "kind": str(f.get("kind", "")), "reason": reason, "here": True})
    out.sort(key=lambda f: f["time"])
    return out[-50:]


class CacheTable(LiveView):
    """The daemon's cache entries with an evict button each, the open adapter gates, and the fallbacks.

    Traits (synced, read-only for the frontend): `entries`, `fallbacks`, `summary`, `gates` (see
    `cache_view`), `error` (why the daemon could not be read), `notice` (the last eviction's outcome).
    A view's evict button sends `{"event": "evict", "key": ...}`; the eviction runs off the main thread
    and the table shows its effect at the next tick.

    Args:
        live: subscribe to the "status" feed itself (a `StatusPanel` feeds its table instead).
    """

    entries = traitlets.List(traitlets.Dict()).tag(sync=True)
    fallbacks = traitlets.List(traitlets.Dict()).tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)
    gates = traitlets.List(traitlets.Dict()).tag(sync=True)

    _esm = JS_HELPERS + f"""
const OM_SEGMENTS = {json.dumps(list(SEGMENT_COLOURS))};
const OM_PATTERNS = {SEGMENT_PATTERNS};
""" + r"""
function plural(n, word) {
  return n + " " + (n === 1 ? word : word + (word.endsWith("s") ? "es" : "s"));
}
function entriesText(n, more) {
  return n + (more ? " more" : "") + (n === 1 ? " entry" : " entries");
}
function kernelsOf(e) {
  if (!e.kernels.length) return h("span", { class: "om-muted" }, "-");
  return e.kernels.map((k, i) => h("div", { class: "om-kernel", title: k.detail, "data-testid": "overmind-widget-kernel" },
    k.name, k.mine ? h("b", {}, " (this kernel)") : null));
}
function segmentFill(i) {
  // an entry's colour and pattern (Note [Segment colours] in widgets/cache.py)
  const colour = OM_SEGMENTS[i % OM_SEGMENTS.length];
  const pattern = Math.floor(i / OM_SEGMENTS.length) % OM_PATTERNS;
  if (!pattern) return "background: " + colour;
  return "background: repeating-linear-gradient(" + (pattern === 1 ? 45 : -45) + "deg, " + colour +
    " 0 3px, rgba(255, 255, 255, 0.6) 3px 5px), " + colour;
}
function memoryChart(s, entries) {
  // memory per entry against the budget: a stacked bar, a segment per entry, and who uses each
  const budget = Math.max(1, s.budget || 0);
  const width = (n) => "width:" + Math.min(100, 100 * n / budget).toFixed(2) + "%";
  const users = (e) => e.kernels.length ? e.kernels.map((k) => k.name).join(", ") : "no kernel now";
  const segs = entries.map((e, i) => h("div", { class: "om-seg", style: width(e.bytes) + "; " + segmentFill(i),
    title: e.model + ": " + fmtBytes(e.bytes) + ", used by " + users(e), "data-testid": "overmind-widget-memory-segment",
    "data-key": e.key }));
  if (s.entries_more) segs.push(h("div", { class: "om-seg om-more", style: width(s.more_bytes || 0),
    title: entriesText(s.entries_more, true) + ": " + fmtBytes(s.more_bytes || 0) }));
  if (s.reserved) segs.push(h("div", { class: "om-seg om-reserved", style: width(s.reserved),
    title: fmtBytes(s.reserved) + " reserved by loads in flight" }));
  return h("div", { class: "om-chart", "data-testid": "overmind-widget-memory" },
    h("div", { class: "om-section" }, "Memory per model: " + fmtBytes(s.used) + " of the " + fmtBytes(s.budget) + " budget",
      s.reserved ? " (+" + fmtBytes(s.reserved) + " reserved)" : ""),
    h("div", { class: "om-bar", role: "img", "aria-label": "memory per model against the budget" }, segs),
    s.disk ? h("div", { class: "om-muted", "data-testid": "overmind-widget-disk" }, s.disk) : null,
    h("div", { class: "om-legend" }, entries.map((e, i) => h("span", { class: "om-legend-item" },
      h("span", { class: "om-swatch", style: segmentFill(i), "data-testid": "overmind-widget-swatch" }), e.model + " " + fmtBytes(e.bytes) + " \u00b7 " + users(e)))));
}
function savedChart(s) {
  // load time saved: each hit's plain load time (measured at its miss) against the hit's own time
  const hits = (s.hits || []).filter((x) => x.load_s !== null && x.load_s !== undefined);
  if (!hits.length) return null;
  const longest = Math.max(0.001, ...hits.map((x) => Math.max(x.load_s, x.hit_s || 0)));
  const pct = (v) => "width:" + Math.max(0.4, 100 * v / longest).toFixed(2) + "%";
  return h("div", { class: "om-chart", "data-testid": "overmind-widget-saved" },
    h("div", { class: "om-section" }, "Load time saved: " + fmtSeconds(s.saved_s || 0) + " over " + plural(s.hits_counted || hits.length, "hit")),
    h("div", { class: "om-hits" }, hits.slice().reverse().map((x) => h("div", { class: "om-hit", "data-testid": "overmind-widget-hit",
        title: x.label + "\nplain load " + fmtSeconds(x.load_s) + ", this hit " + (x.hit_s === null ? "not reported yet" : fmtSeconds(x.hit_s)) },
      h("span", { class: "om-hit-name" }, x.model),
      h("span", { class: "om-hit-bars" },
        h("span", { class: "om-hbar om-hbar-load", style: pct(x.load_s) }),
        x.hit_s === null ? null : h("span", { class: "om-hbar om-hbar-hit", style: pct(x.hit_s) })),
      h("span", { class: "om-hit-times" }, fmtSeconds(x.load_s) + " \u2192 " + (x.hit_s === null ? "?" : fmtSeconds(x.hit_s)))))),
    h("div", { class: "om-legend" },
      h("span", { class: "om-legend-item" }, h("span", { class: "om-swatch om-hbar-load" }), "plain load (at the miss)"),
      h("span", { class: "om-legend-item" }, h("span", { class: "om-swatch om-hbar-hit" }), "hit")));
}
function entryRow(model, e) {
  const button = h("button", { class: "om-btn", "data-testid": "overmind-widget-evict", title: "evict " + e.key,
    onclick: () => { button.disabled = true; button.textContent = "evicting..."; model.send({ event: "evict", key: e.key }); } },
    "evict");
  return h("tr", { "data-testid": "overmind-widget-entry", "data-key": e.key, title: e.label },
    h("td", {},
      h("div", {}, h("span", { class: "om-title" }, e.cls), " ", h("span", { "data-testid": "overmind-widget-model" }, e.model)),
      h("div", { class: "om-muted om-mono" }, e.path && e.path !== e.model ? e.path + " - " : "", e.key.slice(0, 12)),
      e.pending ? h("div", { class: "om-muted", "data-testid": "overmind-widget-pending" },
        h("progress", { max: "100", value: String(e.pending.percent) }), " ", e.pending.text) : null),
    h("td", {}, e.dtype || h("span", { class: "om-muted" }, "as stored")),
    h("td", { class: "om-num" }, fmtBytes(e.bytes)),
    h("td", { class: "om-num" }, String(e.hits)),
    h("td", { "data-ago": e.last_used }, ""),
    h("td", {}, kernelsOf(e)),
    h("td", {}, button));
}
function draw(model, root) {
  const s = model.get("summary") || {};
  const entries = model.get("entries") || [];
  const fallbacks = model.get("fallbacks") || [];
  const gates = model.get("gates") || [];
  const error = model.get("error");
  const notice = model.get("notice");
  const stats = s.stats || {};
  const total = s.entries_total === undefined ? entries.length : s.entries_total;
  const parts = [];
  parts.push(h("div", { class: "om-head" },
    h("span", { class: "om-title" }, "overmind cache"),
    h("span", { "data-testid": "overmind-widget-enabled" }, s.enabled ? "on" : "off", " (", String(s.patched || 0), " loaders patched)"),
    s.daemon_pid ? h("span", { class: "om-muted" }, "daemon pid " + s.daemon_pid) : null,
    s.daemon_pid ? h("span", { "data-testid": "overmind-widget-used" }, fmtBytes(s.used) + " of " + fmtBytes(s.budget) + " in " + entriesText(total, false)) : null,
    s.daemon_pid ? h("span", { class: "om-muted" }, plural(stats.hits || 0, "hit") + " / " + plural(stats.misses || 0, "miss")) : null,
    s.loading ? h("span", {}, s.loading + " loading") : null));
  for (const load of s.loads || []) {
    parts.push(h("div", { class: "om-progress", "data-testid": "overmind-widget-progress" },
      load.percent === null ? null : h("progress", { max: "100", value: String(load.percent) }), " ", load.text,
      h("span", { class: "om-muted" }, " (" + load.by + ")")));
  }
  if (error || s.daemon_error) {
    parts.push(h("div", { class: "om-error", "data-testid": "overmind-widget-down" },
      error || ("no daemon: " + s.daemon_error + " - `%overmind on` starts one")));
  }
  if (entries.length) {
    parts.push(h("table", { "data-testid": "overmind-widget-entries" },
      h("thead", {}, h("tr", {}, h("th", {}, "Model"), h("th", {}, "dtype"), h("th", { class: "om-num" }, "Size"),
        h("th", { class: "om-num" }, "Hits"), h("th", {}, "Last used"), h("th", {}, "Kernels using it"), h("th", {}, ""))),
      h("tbody", {}, entries.map((e) => entryRow(model, e)))));
    if (s.entries_more) parts.push(h("div", { class: "om-muted", "data-testid": "overmind-widget-more" },
      "and " + entriesText(s.entries_more, true) + " (" + fmtBytes(s.more_bytes || 0) + "): the largest and the most " +
      "recently used are shown; `overmind-daemon ls` lists every one"));
  } else if (s.daemon_pid) {
    parts.push(h("div", { class: "om-muted", "data-testid": "overmind-widget-empty" }, "no cached models"));
  }
  if (s.daemon_pid) parts.push(memoryChart(s, entries));
  if (s.daemon_pid) parts.push(savedChart(s));
  if (gates.length) {
    parts.push(h("div", { class: "om-section" }, "Adapter gates in this kernel"));
    parts.push(h("ul", { class: "om-list", "data-testid": "overmind-widget-gates" }, gates.map((g) =>
      h("li", {}, g.model + ": " + g.mode + ", default " + g.default + ", " + g.adapters + " adapters, " +
        g.in_flight + " in flight, " + g.queued + " queued"))));
  }
  if (fallbacks.length) {
    parts.push(h("div", { class: "om-section" }, "Calls that fell back (" + fallbacks.length + ")"));
    parts.push(h("ul", { class: "om-list", "data-testid": "overmind-widget-fallbacks" }, fallbacks.slice().reverse().map((f) =>
      h("li", { "data-testid": "overmind-widget-fallback" }, h("span", { class: "om-mono" }, f.call), ": ", f.reason, " ",
        h("span", { class: "om-muted" }, "(", f.here ? "this kernel" : "pid " + f.pid + (f.kernel ? " " + f.kernel : ""), ", ",
          h("span", { "data-ago": f.time }, ""), ")")))));
  }
  if (notice) parts.push(h("div", { class: "om-notice", "data-testid": "overmind-widget-notice" }, notice));
  root.replaceChildren(...parts);
}
export default {
  render({ model, el }) {
    const root = h("div", { class: "om-w om-cache", "data-testid": "overmind-widget-cache" });
    el.append(root);
    return live(model, el, ["entries", "fallbacks", "summary", "gates", "error", "notice"], () => draw(model, root));
  },
};
"""
    _css = CSS + r"""
.om-w .om-chart { margin-top: 8px; }
.om-w .om-bar { display: flex; height: 14px; border: 1px solid var(--jp-border-color1, #bbb); border-radius: 3px;
  background: var(--jp-layout-color2, #eee); overflow: hidden; }
.om-w .om-seg { height: 100%; border-right: 1px solid var(--jp-layout-color0, #fff); box-sizing: border-box; }
.om-w .om-more { background: var(--jp-border-color2, #ccc); }
.om-w .om-reserved { background: repeating-linear-gradient(45deg, var(--jp-border-color1, #bbb) 0 3px, transparent 3px 6px); }
.om-w .om-legend { display: flex; flex-wrap: wrap; gap: 2px 12px; margin-top: 3px; }
.om-w .om-legend-item { display: inline-flex; align-items: center; gap: 4px; overflow-wrap: anywhere; }
.om-w .om-swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; flex: none; }
.om-w .om-hit { display: grid; grid-template-columns: minmax(80px, 22%) 1fr auto; gap: 8px; align-items: center; }
.om-w .om-hit-name { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.om-w .om-hit-bars { display: flex; flex-direction: column; gap: 1px; }
.om-w .om-hbar { display: block; height: 5px; border-radius: 2px; }
.om-w .om-hbar-load { background: var(--jp-ui-font-color3, #999); }
.om-w .om-hbar-hit { background: var(--jp-brand-color1, #1976d2); }
.om-w .om-hit-times { font-variant-numeric: tabular-nums; }
.om-w .om-kernel { overflow-wrap: anywhere; }
"""

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
            view = cache_view(snapshot, client.conn_id if client is not None else None)
            self.error = ""
            self.summary = view["summary"]
            self.entries = view["entries"]
            self.fallbacks = view["fallbacks"]
            self.gates = view["gates"]

    def on_event(self, event: str, content: dict[str, Any]) -> None:
        if event == "evict" and isinstance(content.get("key"), str):
            self.evict(content["key"])

    def evict(self, key: str) -> None:
        """Evict `key` off the main thread (what the row's button does); the table shows it at the next tick."""
        label = next((e["label"] for e in self.entries if e["key"] == key), key[:12])

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
