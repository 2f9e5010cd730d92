"""`%overmind status` in a notebook: the cache table over the GPU units bar, from one feed.

Both parts read the daemon's status reply (one request per tick, through the kernel's own connection); the
units part shows the ledger as the daemon sees it, so that opening the panel registers nothing.
"""

from __future__ import annotations

from typing import Any

from .cache import CacheTable, fetch_status
from .devices import UnitsBar
from .live import LivePanel, snapshot_now, with_text

__all__ = ["StatusPanel"]


class StatusPanel(LivePanel):
    """The cache table (`table`: a `CacheTable`) and the GPU units (`units`: a `UnitsBar`), kept live.

    `close()` stops the updates and closes both parts.
    """

    def __init__(self, **kwargs: Any) -> None:
        table = CacheTable(live=False)
        units = UnitsBar(live=False)
        super().__init__(children=[table, units], views=[table, units], **kwargs)
        self.table = table
        self.units = units
        self._last: dict[str, Any] | None = None
        self.subscribe("status", fetch_status, self.update)

    def update(self, snapshot: dict[str, Any] | None, error: Exception | None = None) -> None:
        """Show one `fetch_status()` snapshot in both parts (on the poller's thread)."""
        self._last = snapshot
        self.table.update(snapshot, error)
        if error is not None or snapshot is None:
            self.units.update(None, error or RuntimeError("no snapshot"))
        elif snapshot.get("daemon") is None:
            self.units.update(None, RuntimeError("the daemon is not running"))
        else:
            self.units.update(snapshot["daemon"].get("units"))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        from ..api import format_status

        snapshot, error = snapshot_now(self._last, fetch_status)
        text = format_status(snapshot) if snapshot else f"overmind status: cannot be read ({error})"
        return with_text(super()._repr_mimebundle_(**kwargs), text)
