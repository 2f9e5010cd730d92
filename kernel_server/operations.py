"""What a client may ask the daemon: one table of operations, and one table of the error codes a reply
may carry, shared by the daemon and its clients (the frame format is protocol.py's).

Each operation names its handler's home and says whether its request carries descriptors. Handlers
have one shape, `(peer, request) -> Reply | None` (None: the answer comes later, through
`peer.reply`), whether the store's (store_service.py), the units ledger's (units_service.py) or the
daemon's own (daemon.py); the dispatcher closes every descriptor a handler did not take.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import BudgetExceeded, DescriptorsExhausted, RemoteError

__all__ = ["ERRORS", "TAKES_DESCRIPTORS", "Handler", "Op", "Peer", "Reply", "Request", "error_for"]


class Op(str, enum.Enum):
    """The operations, as their names travel in a request's "op"."""

    HELLO = "hello"  # {protocol, role, label, pid} -> {protocol, version, pid, home, budget, conn}
    PING = "ping"  # {} -> {pong}
    STATUS = "status"  # {} -> the daemon, its kernels, entries, loads, budget, descriptors, units, fallbacks
    LS = "ls"  # {} -> {entries}
    LOOKUP = "lookup"  # {key, wait} -> {status: hit|load|busy|cancelled, entries} + descriptors on a hit
    CANCEL = "cancel"  # {request} -> {cancelled}: stop waiting in a lookup
    RESERVE = "reserve"  # {key, bytes, descriptors?} -> {evicted}: room for the load this connection owns
    PUBLISH = "publish"  # {key, graph_bytes, arena_bytes, meta, deps, sources, pieces, pin, marker, watch} + fds
    ABANDON = "abandon"  # {key} -> {}: give up the load; the next waiter becomes the loader
    UNPIN = "unpin"  # {key, count?} -> {}
    EVICT = "evict"  # {key} or {all} -> {evicted}
    PROGRESS = "progress"  # {key, label, done, total, unit} -> {}: how far a load got (Note [Progress] in store.py)
    HITS = "hits"  # {hits: [[key, t, hit_s]]} -> {}: hit times, reported late (Note [Load time saved] in store.py)
    FALLBACK = "fallback"  # {call, kind, reason} -> {}: a load that went the plain way, for status
    SHUTDOWN = "shutdown"  # {} -> {stopping}
    UNITS_REGISTER = "units_register"  # {devices} -> {devices, simulated, unit_bytes, reserve_gib, fake_gpus}
    UNITS_ACQUIRE = "units_acquire"  # {units, devices?, timeout_s?, label, busy} -> a grant, when it is made
    UNITS_RELEASE = "units_release"  # {holding} -> {released}
    UNITS_TOUCH = "units_touch"  # {holding, busy} -> {}
    UNITS_CANCEL = "units_cancel"  # {request} -> {cancelled, revoked}
    UNITS_STATE = "units_state"  # {} -> the ledger's snapshot


TAKES_DESCRIPTORS = frozenset({Op.PUBLISH})  # every other request's descriptors are closed unread


@dataclass
class Request:
    """A request as a handler sees it: its operation, id, payload and the descriptors it carried.
    A handler that keeps descriptors calls `take_descriptors`; the dispatcher closes the rest."""

    op: Op
    id: int
    payload: dict[str, Any]
    descriptors: list[int] = field(default_factory=list)

    def take_descriptors(self) -> list[int]:
        taken, self.descriptors = self.descriptors, []
        return taken

    def get(self, name: str, default: Any = None) -> Any:
        return self.payload.get(name, default)


@dataclass
class Reply:
    payload: dict[str, Any]
    fds: list[int] = field(default_factory=list)  # closed by the daemon once sent


class Peer(Protocol):
    """What a handler may do with the connection a request came on."""

    id: int
    pid: int

    def reply(self, request_id: int, reply: Reply) -> bool: ...

    def error(self, request_id: int | None, code: str, message: str) -> bool: ...

    def push(self, op: str, payload: dict[str, Any]) -> bool: ...


Handler = Callable[[Peer, Request], "Reply | None"]

# Error code -> what the client raises for it (RemoteError for the rest). The codes, and who answers
# them: bad_frame, protocol_mismatch, unknown_op, no_hello, bad_request, internal, refused (the
# dispatcher); budget_exceeded, descriptors_exhausted, not_reserved, not_loading, missing_dependency,
# bad_arena, ambiguous_key, no_entry (the store); bad_config, no_device, unknown_device, units_too_large,
# units_timeout, no_holding (the units ledger, whose client maps them to overmind_jupyter.units errors).
ERRORS: dict[str, type[RemoteError]] = {
    "budget_exceeded": BudgetExceeded,
    "descriptors_exhausted": DescriptorsExhausted,
}


def error_for(code: str, message: str) -> RemoteError:
    return ERRORS.get(code, RemoteError)(code, message)
