"""What every live widget shares: knowing whether it is shown, its subscriptions, closing, text fallback.

`LiveView` is the base of the custom-drawn widgets (anywidget). Their front end is TypeScript beside the
side panel's, in labextension/src/widgets/ (one module per widget, drawing with the panel's `dom.ts` and
`charts.ts`), bundled by esbuild into one self-contained ES module and one stylesheet per widget in
overmind_jupyter/widgets/static/ (`jlpm build:widgets`, part of the `build:prod` that `pip install -e .`
runs); `frontend(name)` gives a widget its two files, and anywidget's prebuilt frontend loads them, without
network. Its views tell the kernel when they appear and go (a message from `render` and one from its
cleanup; labextension/src/widgets/live.ts), so that a widget whose output was cleared stops being polled
(see Note [Widget polling] in polling.py). `LivePanel` is the base of the panels made of several widgets
(stock ipywidgets controls and `LiveView`s) in a `VBox`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import anywidget
import ipywidgets
import traitlets

from ..errors import WidgetsNotBuilt
from .polling import Subscription, poller

__all__ = ["STATIC", "LivePanel", "LiveView", "frontend", "in_kernel", "run_action", "snapshot_now", "with_text"]

#: Where the widgets' bundles lie (built from labextension/src/widgets; see the module's docstring).
STATIC = Path(__file__).resolve().parent / "static"

#: Without any view for this long after it was made, a widget in a kernel is taken to be shown nowhere
#: (a frontend without widgets, `jupyter console` say) and is not polled until a view appears.
NEVER_SHOWN_S = 60.0

#: A notice (the outcome of an eviction, a switch, a mix) clears after this many seconds.
NOTICE_S = 8.0


def frontend(name: str) -> tuple[Path, Path]:
    """The ES module and the stylesheet of widget `name` ("cache", "units", "gate", "outputs"), for a
    `LiveView`'s `_esm` and `_css`.

    Raises:
        WidgetsNotBuilt: they were never built (a checkout not installed with `pip install -e .`).
    """
    files = (STATIC / f"{name}.js", STATIC / f"{name}.css")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WidgetsNotBuilt(
            f"the notebook widgets' front end is not built ({', '.join(missing)} missing): run `pip install -e .` "
            "(or `make setup`) in the checkout, which builds labextension/ with `jlpm build:prod` (Node.js "
            "needed), or `cd labextension && jlpm install && jlpm build:widgets`")
    return files


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
    """A custom-drawn widget updated from a feed. Subclasses set `_esm`, `_css` (`frontend(name)`'s files)
    and their traits.

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


def snapshot_now(last: Any, fetch: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """The snapshot a widget's text form shows: `last`, else one read now (a widget is displayed before its
    first tick, and a frontend without widgets keeps the text it got then); with the error that read raised."""
    if last is not None:
        return last, None
    try:
        return fetch(), None
    except Exception as exc:  # noqa: BLE001 - said in the text, as the widget says it: the daemon is down, ...
        return None, exc


def with_text(bundle: Any, text: str) -> Any:
    """A widget's mime bundle with `text` as its text/plain (what a frontend without widgets shows)."""
    if isinstance(bundle, tuple):
        data, *rest = bundle
        return (dict(data, **{"text/plain": text}), *rest)
    if isinstance(bundle, dict):
        return dict(bundle, **{"text/plain": text})
    return bundle
