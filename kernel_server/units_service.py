"""The units ledger's operations (kernel_server/ledger.py holds the state machine), in the shape of
every handler: `(peer, request) -> Reply | None` (operations.py)."""

from __future__ import annotations

from typing import Any

from .errors import RemoteError
from .ledger import Ledger
from .operations import Handler, Op, Peer, Reply, Request
from .payloads import (
    CancelRequest,
    DeviceSpec,
    Empty,
    HoldingRequest,
    UnitsAcquireRequest,
    UnitsCancelReply,
    UnitsRegisterReply,
    UnitsRegisterRequest,
    UnitsReleaseReply,
    UnitsSnapshot,
    UnitsTouchRequest,
)
from .settings import GiB

__all__ = ["UnitsService"]


class UnitsService:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def handlers(self) -> dict[Op, Handler]:
        return {Op.UNITS_REGISTER: self.register, Op.UNITS_ACQUIRE: self.acquire, Op.UNITS_RELEASE: self.release,
                Op.UNITS_TOUCH: self.touch, Op.UNITS_CANCEL: self.cancel, Op.UNITS_STATE: self.state}

    def register(self, conn: Peer, req: Request[UnitsRegisterRequest]) -> Reply[UnitsRegisterReply]:
        self.ledger.check_config()
        devices = [_device_spec(d) for d in req.payload.get("devices", [])]
        views = self.ledger.register(devices)
        return Reply({"devices": views, "simulated": self.ledger.simulated, "unit_bytes": GiB,
                      "reserve_gib": self.ledger.reserve_gib, "fake_gpus": self.ledger.fake_spec})

    def acquire(self, conn: Peer, req: Request[UnitsAcquireRequest]) -> None:
        self.ledger.check_config()
        request_id, p = req.id, req.payload
        timeout = p.get("timeout_s")

        def answer(result: dict[str, Any] | RemoteError) -> None:
            if isinstance(result, RemoteError):
                conn.error(request_id, result.code, str(result))
            else:
                conn.reply(request_id, Reply(result))

        self.ledger.acquire(conn.id, conn.pid, request_id, units=p["units"], devices=p.get("devices"),
                            timeout=None if timeout is None else float(timeout),
                            label=p.get("label", "")[:200], busy=p.get("busy", False),
                            answer=answer, push=conn.push, context=p.get("context_units", 0),
                            spare=p.get("spare", False))

    def release(self, conn: Peer, req: Request[HoldingRequest]) -> Reply[UnitsReleaseReply]:
        return Reply({"released": self.ledger.release(conn.id, req.payload["holding"])})

    def touch(self, conn: Peer, req: Request[UnitsTouchRequest]) -> Reply[Empty]:
        self.ledger.touch(conn.id, req.payload["holding"], req.payload["busy"])
        return Reply({})

    def cancel(self, conn: Peer, req: Request[CancelRequest]) -> Reply[UnitsCancelReply]:
        cancelled, revoked = self.ledger.cancel(conn.id, req.payload["request"])
        return Reply({"cancelled": cancelled, "revoked": revoked})

    def state(self, conn: Peer, req: Request[Empty]) -> Reply[UnitsSnapshot]:
        return Reply(self.ledger.snapshot())


def _device_spec(raw: DeviceSpec) -> dict[str, Any]:
    dev_id = raw["id"]
    return {"id": dev_id, "name": raw.get("name", "")[:64] or dev_id, "model": raw.get("model", "")[:128],
            "total_bytes": raw["total_bytes"], "simulated": raw.get("simulated", False)}
