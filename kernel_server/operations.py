"""What a client may ask the daemon: one table of operations, and one table of the error codes a reply
may carry, shared by the daemon and its clients (the frame format is protocol.py's).

Each operation has a declared request and reply type (PAYLOADS, payloads.py); the daemon checks a
request against its type before its handler runs (`parse`). Handlers have one shape,
`(peer, request) -> Reply | None` (None: the answer comes later, through `peer.reply`), whether the
store's (store_service.py), the units ledger's (units_service.py) or the daemon's own (daemon.py); the
dispatcher closes every descriptor a handler did not take.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from . import payloads
from .errors import BudgetExceeded, DescriptorsExhausted, RemoteError

__all__ = ["ERRORS", "PAYLOADS", "TAKES_DESCRIPTORS", "Handler", "Op", "Payloads", "Peer", "Reply", "Request",
           "error_for", "parse"]


class Op(str, enum.Enum):
    """The operations, as their names travel in a request's "op". Their fields: PAYLOADS."""

    HELLO = "hello"  # the first request on a connection: the protocol version is checked here
    PING = "ping"
    STATUS = "status"  # the daemon, its kernels, the largest and latest entries, loads, budget, units...
    LS = "ls"  # a page of the entries, by key
    LOOKUP = "lookup"  # a hit (with descriptors), or the load is this connection's, or another's (wait)
    CANCEL = "cancel"  # stop waiting in a lookup
    RESERVE = "reserve"  # room for the load this connection owns
    PUBLISH = "publish"  # the load's entry (with descriptors)
    ABANDON = "abandon"  # give up the load; the next waiter becomes the loader
    UNPIN = "unpin"
    EVICT = "evict"
    PROGRESS = "progress"  # how far a load got (Note [Progress] in store.py); sent without waiting
    HITS = "hits"  # hit times, reported late (Note [Load time saved] in store.py); sent without waiting
    FALLBACK = "fallback"  # a load that went the plain way, for status
    SHUTDOWN = "shutdown"
    UNITS_REGISTER = "units_register"  # the devices of a kernel, and the ledger's configuration
    UNITS_ACQUIRE = "units_acquire"  # a grant, when it is made
    UNITS_RELEASE = "units_release"
    UNITS_TOUCH = "units_touch"
    UNITS_CANCEL = "units_cancel"
    UNITS_STATE = "units_state"  # the ledger's snapshot


@dataclass(frozen=True)
class Payloads:
    """The types of an operation's request and reply payloads (payloads.py)."""

    request: Any
    reply: Any


PAYLOADS: dict[Op, Payloads] = {
    Op.HELLO: Payloads(payloads.HelloRequest, payloads.HelloReply),
    Op.PING: Payloads(payloads.Empty, payloads.PingReply),
    Op.STATUS: Payloads(payloads.StatusRequest, payloads.StatusReply),
    Op.LS: Payloads(payloads.LsRequest, payloads.LsReply),
    Op.LOOKUP: Payloads(payloads.LookupRequest, payloads.LookupReply),
    Op.CANCEL: Payloads(payloads.CancelRequest, payloads.CancelReply),
    Op.RESERVE: Payloads(payloads.ReserveRequest, payloads.EvictedReply),
    Op.PUBLISH: Payloads(payloads.PublishRequest, payloads.PublishReply),
    Op.ABANDON: Payloads(payloads.KeyRequest, payloads.Empty),
    Op.UNPIN: Payloads(payloads.UnpinRequest, payloads.Empty),
    Op.EVICT: Payloads(payloads.EvictRequest, payloads.EvictedReply),
    Op.PROGRESS: Payloads(payloads.ProgressRequest, payloads.Empty),
    Op.HITS: Payloads(payloads.HitsRequest, payloads.Empty),
    Op.FALLBACK: Payloads(payloads.FallbackRequest, payloads.Empty),
    Op.SHUTDOWN: Payloads(payloads.Empty, payloads.ShutdownReply),
    Op.UNITS_REGISTER: Payloads(payloads.UnitsRegisterRequest, payloads.UnitsRegisterReply),
    Op.UNITS_ACQUIRE: Payloads(payloads.UnitsAcquireRequest, payloads.Grant),
    Op.UNITS_RELEASE: Payloads(payloads.HoldingRequest, payloads.UnitsReleaseReply),
    Op.UNITS_TOUCH: Payloads(payloads.UnitsTouchRequest, payloads.Empty),
    Op.UNITS_CANCEL: Payloads(payloads.CancelRequest, payloads.UnitsCancelReply),
    Op.UNITS_STATE: Payloads(payloads.Empty, payloads.UnitsSnapshot),
}


TAKES_DESCRIPTORS = frozenset({Op.PUBLISH})  # every other request's descriptors are closed unread


P = TypeVar("P", bound=Mapping[str, Any])


@dataclass
class Request(Generic[P]):
    """A request as a handler sees it: its operation, id, payload (checked against the operation's
    declared request type: `parse`) and the descriptors it carried. A handler that keeps descriptors
    calls `take_descriptors`; the dispatcher closes the rest."""

    op: Op
    id: int
    payload: P
    descriptors: list[int] = field(default_factory=list)

    def take_descriptors(self) -> list[int]:
        taken, self.descriptors = self.descriptors, []
        return taken


def parse(op: Op, request_id: int, payload: dict[str, Any]) -> Request[Any]:
    """The request `payload` makes, once it fits the operation's declared request type; else
    RemoteError("bad_request") naming the field and what it must be."""
    payloads.check(PAYLOADS[op].request, payload, op.value)
    return Request(op, request_id, payload)


@dataclass
class Reply(Generic[P]):
    payload: P
    fds: list[int] = field(default_factory=list)  # closed by the daemon once sent


class Peer(Protocol):
    """What a handler may do with the connection a request came on."""

    id: int
    pid: int

    def reply(self, request_id: int, reply: Reply[Any]) -> bool: ...

    def error(self, request_id: int | None, code: str, message: str) -> bool: ...

    def push(self, op: str, payload: dict[str, Any]) -> bool: ...


Handler = Callable[[Peer, Request[Any]], "Reply[Any] | None"]

# Error code -> what the client raises for it (RemoteError for the rest). The codes, and who answers
# them: bad_frame, protocol_mismatch, unknown_op, no_hello, bad_request, internal, refused (the
# dispatcher); budget_exceeded, descriptors_exhausted, not_loading, missing_dependency,
# bad_arena, ambiguous_key, no_entry (the store); bad_config, no_device, unknown_device, units_too_large,
# units_timeout, no_holding (the units ledger, whose client maps them to overmind_jupyter.units errors).
ERRORS: dict[str, type[RemoteError]] = {
    "budget_exceeded": BudgetExceeded,
    "descriptors_exhausted": DescriptorsExhausted,
}


def error_for(code: str, message: str) -> RemoteError:
    return ERRORS.get(code, RemoteError)(code, message)
