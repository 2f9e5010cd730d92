"""The units ledger's operations (kernel_server/ledger.py holds the state machine), in the shape of
every handler: `(peer, request) -> Reply | None` (operations.py)."""

from __future__ import annotations

from typing import Any

from .errors import RemoteError
from .ledger import MAX_DEVICES, MAX_UNITS, Ledger
from .operations import Handler, Op, Peer, Reply, Request
from .settings import GiB

__all__ = ["UnitsService"]


class UnitsService:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def handlers(self) -> dict[Op, Handler]:
        return {Op.UNITS_REGISTER: self.register, Op.UNITS_ACQUIRE: self.acquire, Op.UNITS_RELEASE: self.release,
                Op.UNITS_TOUCH: self.touch, Op.UNITS_CANCEL: self.cancel, Op.UNITS_STATE: self.state}

    def register(self, conn: Peer, req: Request) -> Reply:
        self.ledger.check_config()
        raw = req.get("devices", [])
        if not isinstance(raw, list) or len(raw) > MAX_DEVICES:
            raise RemoteError("bad_request", f"'devices' must be a list of at most {MAX_DEVICES} devices")
        devices = [_device_spec(d) for d in raw]
        views = self.ledger.register(devices)
        return Reply({"devices": views, "simulated": self.ledger.simulated, "unit_bytes": GiB,
                      "reserve_gib": self.ledger.reserve_gib, "fake_gpus": self.ledger.fake_spec})

    def acquire(self, conn: Peer, req: Request) -> None:
        self.ledger.check_config()
        request_id = req.id
        units = req.get("units")
        if not isinstance(units, int) or isinstance(units, bool) or not 1 <= units <= MAX_UNITS:
            raise RemoteError("bad_request",
                              f"'units' must be an integer from 1 to {MAX_UNITS}, not {units!r}")
        devices = req.get("devices")
        if devices is not None and (not isinstance(devices, list) or not devices
                                    or len(devices) > MAX_DEVICES
                                    or not all(isinstance(d, str) for d in devices)):
            raise RemoteError("bad_request",
                              "'devices' must be null (any device) or a non-empty list of device ids")
        timeout = req.get("timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout < 1e9):
            raise RemoteError("bad_request", f"'timeout_s' must be null (wait forever) or seconds >= 0, "
                                             f"not {timeout!r}")

        def answer(result: dict[str, Any] | RemoteError) -> None:
            if isinstance(result, RemoteError):
                conn.error(request_id, result.code, str(result))
            else:
                conn.reply(request_id, Reply(result))

        self.ledger.acquire(conn.id, conn.pid, request_id, units=units, devices=devices,
                            timeout=None if timeout is None else float(timeout),
                            label=str(req.get("label", ""))[:200], busy=bool(req.get("busy", False)),
                            answer=answer, push=conn.push)

    def release(self, conn: Peer, req: Request) -> Reply:
        return Reply({"released": self.ledger.release(conn.id, _holding_id(req))})

    def touch(self, conn: Peer, req: Request) -> Reply:
        busy = req.get("busy")
        if not isinstance(busy, bool):
            raise RemoteError("bad_request", "'busy' must be true or false")
        self.ledger.touch(conn.id, _holding_id(req), busy)
        return Reply({})

    def cancel(self, conn: Peer, req: Request) -> Reply:
        target = req.get("request")
        if not isinstance(target, int) or isinstance(target, bool):
            raise RemoteError("bad_request", "units_cancel needs the integer 'request' to cancel")
        cancelled, revoked = self.ledger.cancel(conn.id, target)
        return Reply({"cancelled": cancelled, "revoked": revoked})

    def state(self, conn: Peer, req: Request) -> Reply:
        return Reply(self.ledger.snapshot())


def _holding_id(req: Request) -> int:
    holding = req.get("holding")
    if not isinstance(holding, int) or isinstance(holding, bool):
        raise RemoteError("bad_request", "'holding' must be the integer id an acquire returned")
    return holding


def _device_spec(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise RemoteError("bad_request", "each device must be an object {id, name, total_bytes, model}")
    dev_id, name, total = raw.get("id"), raw.get("name", ""), raw.get("total_bytes")
    if not isinstance(dev_id, str) or not 0 < len(dev_id) <= 128:
        raise RemoteError("bad_request",
                          "a device's 'id' must be a non-empty string of at most 128 characters")
    if not isinstance(total, int) or isinstance(total, bool) or not 0 <= total < 1 << 60:
        raise RemoteError("bad_request", f"device {dev_id!r}: 'total_bytes' must be a non-negative integer")
    return {"id": dev_id, "name": str(name)[:64] or dev_id, "model": str(raw.get("model", ""))[:128],
            "total_bytes": total, "simulated": bool(raw.get("simulated", False))}
