"""The Jupyter server extension behind the JupyterLab side panel: REST routes that read the daemon.

Routes (under the server's `base_url`, every one authenticated and authorized):

- `GET  {base_url}overmind/state`: the daemon's state for the panel (`view.state_view`), or
  `{"state": "down", "message": ..., "home": ...}` when no daemon runs (a 200: Note [No daemon is a
  state] in `handlers.py`).
- `POST {base_url}overmind/evict` with `{"key": KEY}` (a key or a unique prefix) or `{"all": true}`:
  `{"evicted": [keys]}`; 404 for an unknown key, 409 for an ambiguous prefix, 400 for a bad body.

The server never starts a daemon (see Note [The server never spawns] in `link.py`). It is enabled on
install by `jupyter-config/server-config/overmind_jupyter.json`, which names the package; the package's
`_jupyter_server_extension_points` points here, so importing `overmind_jupyter` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["_jupyter_server_extension_points", "_load_jupyter_server_extension"]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "overmind_jupyter.server"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Register the routes on the server's web application (called once by jupyter_server)."""
    from .handlers import setup_handlers

    setup_handlers(server_app.web_app)
    server_app.log.info("overmind_jupyter: side panel routes at %sovermind/", server_app.web_app.settings["base_url"])
