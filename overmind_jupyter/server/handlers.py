"""The REST handlers of the side panel (the routes are listed in `overmind_jupyter.server`).

Every verb is `@tornado.web.authenticated` (no token, no cookie: 403) and `@authorized` against the
resource "overmind" (a server with a custom Authorizer decides who may read or evict). The daemon's
socket is blocking, so each request runs in the server's thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from kernel_server.errors import (
    DaemonError,
    PeerRefused,
    ProtocolMismatch,
    RemoteError,
    StateDirError,
    WaitTimeout,
)
from kernel_server.operations import Op
from kernel_server.payloads import MAX_KEY

from ..view import state_view
from .link import DaemonDown, DaemonLink
from .state import Names, ServerKernel, down_state

__all__ = ["EvictHandler", "StateHandler", "setup_handlers"]

AUTH_RESOURCE = "overmind"
_LINK_SETTING = "overmind_link"

# RemoteError codes of the daemon and the HTTP status each becomes.
_REMOTE_STATUS = {"no_entry": 404, "ambiguous_key": 409, "bad_request": 400}

T = TypeVar("T")


class _OvermindHandler(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def link(self) -> DaemonLink:
        return self.settings[_LINK_SETTING]  # type: ignore[no-any-return]

    async def call_daemon(self, fn: Callable[[], T]) -> T | None:
        """Run `fn` (blocking on the daemon's socket) in a worker thread; on a daemon error answer
        with its status and a readable message, and return None."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn)
        except DaemonDown as exc:
            self.reply(503, {"message": str(exc), "reason": "daemon_down", "home": exc.home})
        except (StateDirError, PeerRefused, ProtocolMismatch) as exc:
            self.reply(503, {"message": str(exc), "reason": type(exc).__name__})
        except WaitTimeout as exc:
            self.reply(504, {"message": f"the overmind daemon did not answer: {exc}", "reason": "timeout"})
        except RemoteError as exc:
            self.reply(_REMOTE_STATUS.get(exc.code, 500), {"message": str(exc), "reason": exc.code})
        except DaemonError as exc:
            self.reply(503, {"message": str(exc), "reason": type(exc).__name__})
        return None

    def reply(self, status: int, body: dict[str, Any]) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


class StateHandler(_OvermindHandler):
    """`GET overmind/state`: entries, budget, hits and misses, kernels, units, fallbacks; or, while no
    daemon runs, `{"state": "down"}` with a 200.

    # Note [No daemon is a state]
    A panel left open before any kernel ran `%overmind on` polls a server with no daemon for hours. That
    is the normal state of a fresh session, not a failure: answered with a 503, jupyter_server logged
    each poll as an error with the request's headers (about a thousand an hour). So it is a 200 whose
    `state` says "down", which jupyter_server logs at debug level only, and the link logs nothing.
    """

    @tornado.web.authenticated
    @authorized("read")
    async def get(self) -> None:
        link = self.link
        names = Names(await self._server_kernels())

        def read() -> dict[str, Any]:
            try:
                status = link.request(Op.STATUS).payload
            except DaemonDown as exc:  # Note [No daemon is a state]
                return down_state(exc.home, str(exc))
            return state_view(status, own_conn=link.conn_id, names=names)

        state = await self.call_daemon(read)
        if state is not None:
            self.reply(200, state)

    async def _server_kernels(self) -> list[ServerKernel]:
        """This server's kernels with their sessions' paths and their pids (Note [Kernels by notebook])."""
        kernels: dict[str, ServerKernel] = {}
        for session in await self.session_manager.list_sessions():
            kernel_id = (session.get("kernel") or {}).get("id")
            if kernel_id:
                kernels[kernel_id] = ServerKernel(kernel_id, _kernel_pid(self.kernel_manager, kernel_id),
                                                  str(session.get("path") or ""), str(session.get("type") or ""))
        return list(kernels.values())


class EvictHandler(_OvermindHandler):
    """`POST overmind/evict` with `{"key": KEY}` or `{"all": true}`: drop entries from the cache."""

    @tornado.web.authenticated
    @authorized("write")
    async def post(self) -> None:
        try:
            body = json.loads(self.request.body or b"{}")
        except (ValueError, RecursionError):  # (nested too deep to read)
            body = None
        if not isinstance(body, dict):
            self.reply(400, {"message": "the body must be a JSON object: {\"key\": KEY} or {\"all\": true}",
                             "reason": "bad_request"})
            return
        if body.get("all") is True:
            fields: dict[str, Any] = {"all": True}
        elif isinstance(body.get("key"), str) and len(body["key"]) > MAX_KEY:
            self.reply(400, {"message": f"a key of {len(body['key'])} characters names no entry (the longest is "
                             f"{MAX_KEY}): `overmind-daemon ls` lists the keys", "reason": "bad_request"})
            return
        elif isinstance(body.get("key"), str) and body["key"]:
            fields = {"key": body["key"]}
        else:
            self.reply(400, {"message": "say which entry to evict: {\"key\": KEY} or {\"all\": true}",
                             "reason": "bad_request"})
            return
        link = self.link
        reply = await self.call_daemon(lambda: link.request(Op.EVICT, **fields).payload)
        if reply is not None:
            self.log.info("overmind: evicted %s from the panel", reply.get("evicted"))
            self.reply(200, {"evicted": reply.get("evicted", [])})


def _kernel_pid(kernel_manager: Any, kernel_id: str) -> int | None:
    """The pid of a local kernel process of this server (None for a remote or gateway kernel)."""
    try:
        provisioner = kernel_manager.get_kernel(kernel_id).provisioner
    except (KeyError, AttributeError):
        return None
    pid = getattr(provisioner, "pid", None)
    return pid if isinstance(pid, int) else None


def setup_handlers(web_app: tornado.web.Application) -> None:
    """Add the routes under the server's base_url; one `DaemonLink` serves them all."""
    web_app.settings.setdefault(_LINK_SETTING, DaemonLink())
    base_url = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [
        (url_path_join(base_url, "overmind", "state"), StateHandler),
        (url_path_join(base_url, "overmind", "evict"), EvictHandler),
    ])
