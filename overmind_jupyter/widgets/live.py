"""What every live widget shares: knowing whether it is shown, its subscriptions, closing, text fallback.

`LiveView` is the base of the custom-drawn widgets (anywidget: the ES module and the CSS are inline strings,
so JupyterLab renders them with anywidget's prebuilt frontend, without a build step or network). Its views
tell the kernel when they appear and go (a message from `render` and one from its cleanup), so that a widget
whose output was cleared stops being polled (see Note [Widget polling] in polling.py). `LivePanel` is the
base of the panels made of several widgets (stock ipywidgets controls and `LiveView`s) in a `VBox`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import anywidget
import ipywidgets
import traitlets

from kernel_server import formats

from .polling import Subscription, poller

__all__ = ["CSS", "JS_HELPERS", "LivePanel", "LiveView", "in_kernel", "run_action"]

#: Without any view for this long after it was made, a widget in a kernel is taken to be shown nowhere
#: (a frontend without widgets, `jupyter console` say) and is not polled until a view appears.
NEVER_SHOWN_S = 60.0

#: A notice (the outcome of an eviction, a switch, a mix) clears after this many seconds.
NOTICE_S = 8.0


def in_kernel() -> bool:
    """Whether this process is an ipykernel with a frontend attached (views can appear)."""
    kernelbase = sys.modules.get("ipykernel.kernelbase")
    return bool(kernelbase is not None and kernelbase.Kernel.initialized())


def run_action(name: str, fn: Callable[[], None]) -> threading.Thread:
    """Run a control's action (evict, mix, generate) off the kernel's main thread.

    The thread's name starts with "overmind-" so that the extension's post-cell hook does not take it for a
    thread of the user's (see extension.Session._post_run_cell).
    """
    thread = threading.Thread(target=fn, name=f"overmind-widget-{name}", daemon=True)
    thread.start()
    return thread


class _Shown:
    """Counts the views of a widget that exist in frontends now."""

    def __init__(self) -> None:
        self.views = 0
        self.ever = False
        self.born = time.monotonic()

    def __call__(self) -> bool:
        if self.views > 0:
            return True
        if self.ever:
            return False  # every view went (output cleared, notebook closed)
        return not in_kernel() or time.monotonic() - self.born < NEVER_SHOWN_S

    def change(self, shown: bool) -> None:
        if shown:
            self.views += 1
            self.ever = True
        else:
            self.views = max(0, self.views - 1)


class LiveView(anywidget.AnyWidget):
    """A custom-drawn widget updated from a feed. Subclasses set `_esm`, `_css` and their traits.

    Frontend messages: `{"event": "view", "shown": bool}` from every view as it appears and goes; any other
    event goes to `on_event(event, content)`.
    """

    error = traitlets.Unicode("", help="why the last read of the feed failed, or ''").tag(sync=True)
    notice = traitlets.Unicode("", help="the outcome of the user's last action").tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shown = _Shown()
        self._subscriptions: list[Subscription] = []
        self._pending_notice: str | None = None
        self._notice_at = 0.0
        self.on_msg(self._on_frontend_msg)

    @property
    def shown(self) -> bool:
        """Whether some frontend shows this widget now (or may still show it soon)."""
        return self._shown()

    @property
    def views(self) -> int:
        return self._shown.views

    def subscribe(self, key: Hashable, fetch: Callable[[], Any],
                  deliver: Callable[[Any, Exception | None], None]) -> Subscription:
        sub = poller().subscribe(key, fetch, deliver, active=lambda: self.shown)
        self._subscriptions.append(sub)
        return sub

    def tell(self, notice: str) -> None:
        """Show `notice` at the next tick (from an action's thread; see Note [Widget polling])."""
        self._pending_notice = notice
        poller().kick()

    def take_notice(self) -> None:
        """On the poller's thread: publish what an action left, and clear a notice `NOTICE_S` old."""
        notice, self._pending_notice = self._pending_notice, None
        if notice is not None:
            self.notice = notice
            self._notice_at = time.monotonic()
        elif self.notice and time.monotonic() - self._notice_at > NOTICE_S:
            self.notice = ""

    def on_event(self, event: str, content: dict[str, Any]) -> None:
        """A message from a view (a button pressed in the custom drawing)."""

    def close(self) -> None:
        for sub in self._subscriptions:
            sub.close()
        self._subscriptions.clear()
        super().close()

    def _on_frontend_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict):
            return
        event = content.get("event")
        if event == "view":
            self._shown.change(bool(content.get("shown")))
            poller().kick()
        elif isinstance(event, str):
            self.on_event(event, content)


class LivePanel(ipywidgets.VBox):  # type: ignore[misc]
    """A panel of stock controls and `LiveView`s, shown while any of its views is; closes what it made."""

    def __init__(self, children: list[Any], views: list[LiveView], **kwargs: Any) -> None:
        super().__init__(children=children, **kwargs)
        self._views = views
        self._owned: list[Any] = []  # every widget the panel made, closed with it
        self._subscriptions: list[Subscription] = []

    @property
    def shown(self) -> bool:
        return any(view.shown for view in self._views)

    def own(self, *widgets: Any) -> None:
        self._owned.extend(widgets)

    def subscribe(self, key: Hashable, fetch: Callable[[], Any],
                  deliver: Callable[[Any, Exception | None], None]) -> Subscription:
        sub = poller().subscribe(key, fetch, deliver, active=lambda: self.shown)
        self._subscriptions.append(sub)
        return sub

    def close(self) -> None:
        for sub in self._subscriptions:
            sub.close()
        self._subscriptions.clear()
        try:
            for widget in [*self._views, *self._owned]:
                widget.close()
        finally:
            super().close()


def with_text(bundle: Any, text: str) -> Any:
    """A widget's mime bundle with `text` as its text/plain (what a frontend without widgets shows)."""
    if isinstance(bundle, tuple):
        data, *rest = bundle
        return (dict(data, **{"text/plain": text}), *rest)
    if isinstance(bundle, dict):
        return dict(bundle, **{"text/plain": text})
    return bundle


# -- shared by the ES modules (prepended to each widget's own code) -----------------------------------------

# Note [One banner]
# When a widget's kernel is gone, the widget manager marks every view of it disconnected: the panel's VBox
# and each of our views inside it. `gone()` (below) disables each view's controls, but says "this shows a
# kernel that is gone" once per output: on the first of our views (class `om-view`) inside the outermost
# view marked, so that `%overmind status` (a cache table over a units bar) does not say it twice.

JS_HELPERS = formats.JS + r"""
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "style") el.setAttribute("style", v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}
function ages(el) {
  // relative times, refreshed in place (a full redraw would replace a button under the pointer)
  for (const e of el.querySelectorAll("[data-ago]")) e.textContent = fmtAgo(Number(e.dataset.ago));
  for (const e of el.querySelectorAll("[data-idle-since]")) {
    e.textContent = "idle " + fmtSeconds(Math.max(0, Date.now() / 1000 - Number(e.dataset.idleSince)));
  }
}
function gone(el) {
  // The kernel this widget belongs to is gone (restarted or shut down): the widget manager marks its
  // views disconnected. Say so, and disable every control, instead of showing a live-looking dead kernel.
  // A panel (`%overmind status`, the adapter panel) holds several of our views, each marked: the banner
  // goes once, on the first of them in the outermost view marked (Note [One banner]).
  let top = el.closest(".jupyter-widgets-disconnected");
  for (let up = top; up && up.parentElement; ) {
    up = up.parentElement.closest(".jupyter-widgets-disconnected");
    if (up) top = up;
  }
  const banner = el.querySelector(":scope > .om-gone");
  const first = top ? top.querySelector(".om-view") || el : null;
  if (top) {
    el.classList.add("om-dead");
    for (const c of el.querySelectorAll("button, input, select, textarea")) c.disabled = true;
  } else {
    el.classList.remove("om-dead");
  }
  if (first === el && !banner) {
    el.prepend(h("div", { class: "om-w om-gone", "data-testid": "overmind-widget-gone" },
      "This shows a kernel that is gone (restarted or shut down): it no longer updates and its buttons " +
      "do nothing. Run %overmind status again for the kernel running now."));
  } else if (first !== el && banner) {
    banner.remove();
  }
}
function live(model, el, names, draw) {
  // draw now and on every change of the named traits; refresh relative times every second; tell the
  // kernel that this view exists, and that it went when the frontend disposes of it
  el.classList.add("om-view");  // one of ours, for gone()
  try { model.send({ event: "view", shown: true }); } catch (e) { /* comm closed */ }
  const redraw = () => {
    try { draw(); ages(el); gone(el); } catch (e) { el.textContent = "overmind widget: " + e; }
  };
  const check = () => gone(el);
  for (const name of names) model.on("change:" + name, redraw);
  model.on("comm_live_update", check);
  const timer = setInterval(() => { ages(el); gone(el); }, 1000);
  redraw();
  return () => {
    clearInterval(timer);
    model.off("comm_live_update", check);
    for (const name of names) model.off("change:" + name, redraw);
    try { model.send({ event: "view", shown: false }); } catch (e) { /* comm closed */ }
  };
}
"""

CSS = r"""
.om-w { font-family: var(--jp-ui-font-family, sans-serif); font-size: var(--jp-ui-font-size1, 13px);
  color: var(--jp-ui-font-color1, #222); }
.om-w .om-head { display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: baseline; margin: 2px 0 6px; }
.om-w .om-title { font-weight: 600; }
.om-w .om-muted { color: var(--jp-ui-font-color2, #666); }
.om-w .om-error { color: var(--jp-error-color1, #c62828); }
.om-w .om-notice { color: var(--jp-ui-font-color2, #555); font-style: italic; }
.om-w .om-sim { display: inline-block; padding: 0 5px; border-radius: 3px; font-size: 11px;
  background: var(--jp-layout-color2, #eee); color: var(--jp-ui-font-color1, #222);
  border: 1px solid var(--jp-warn-color1, #f57c00); }
.om-w table { border-collapse: collapse; width: 100%; }
.om-w th, .om-w td { text-align: left; padding: 3px 8px; border-bottom: 1px solid var(--jp-border-color2, #e0e0e0);
  vertical-align: top; }
.om-w th { font-weight: 600; color: var(--jp-ui-font-color2, #555); }
.om-w td.om-num, .om-w th.om-num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.om-w code, .om-w .om-mono { font-family: var(--jp-code-font-family, monospace); font-size: 11px; }
.om-w button.om-btn { font-size: 12px; padding: 1px 8px; cursor: pointer;
  border: 1px solid var(--jp-border-color1, #bbb); border-radius: 3px; background: var(--jp-layout-color1, #fff);
  color: var(--jp-ui-font-color1, #222); }
.om-w button.om-btn:hover { background: var(--jp-layout-color2, #eee); }
.om-w button.om-btn:disabled { opacity: 0.5; cursor: default; }
.om-w .om-section { margin-top: 8px; font-weight: 600; }
.om-w ul.om-list { margin: 2px 0; padding-left: 18px; }
.om-gone { margin: 2px 0 6px; padding: 4px 8px; border-left: 3px solid var(--jp-error-color1, #c62828);
  background: var(--jp-layout-color2, #eee); color: var(--jp-ui-font-color1, #222); }
"""
