"""The fields of every operation's request and reply (operations.PAYLOADS names them per operation), and
the one check of a request against its declared type.

Requests are TypedDicts whose fields may carry bounds (`Annotated[int, Range(2, MAX_FDS)]`). The daemon
checks each request against its type before any handler runs (`check`): a missing field, a field of the
wrong type or out of its bounds gets the error reply "bad_request", naming the operation, the field and
what it must be; it never reaches a handler, an assert, or the daemon's life. Fields a request does not
declare are ignored (a newer client may send more). What a handler still checks itself is what no type
says: descriptors against the fields that describe them, pieces against their arena.
"""

from __future__ import annotations

import functools
import itertools
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from .catalogue import MAX_LISTED
from .errors import RemoteError
from .ledger import MAX_DEVICES, MAX_UNITS
from .protocol import MAX_FDS

__all__ = [
    "MAX_META",
    "MAX_WATCHED",
    "Range",
    "Size",
    "check",
]

MAX_META = 16 * 1024  # characters an entry's description ("meta") may take
MAX_WATCHED = 64  # checkpoint paths a publish may name (Note [Orphaned entries] in store.py)
MAX_PARTS = 8  # files of its own an arena may come in besides its own (Note [Arena parts] in arena.py)


@dataclass(frozen=True)
class Range:
    """The values a number may take, bounds included (None: unbounded)."""

    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class Size:
    """The lengths a string or list may have, bounds included; of an object, the length of its text."""

    low: int = 0
    high: int | None = None


MAX_KEY = 256  # characters
Key = Annotated[str, Size(1, MAX_KEY)]
Count = Annotated[int, Range(0)]
Id = int  # a request's or a holding's id


# -- requests -----------------------------------------------------------------------------------------

class HelloRequest(TypedDict):
    protocol: int
    role: NotRequired[str]  # "kernel", "worker", "cli", "copier"
    label: NotRequired[str]
    pid: NotRequired[int]


class Empty(TypedDict):
    pass


class StatusRequest(TypedDict):
    """Note [Status with many entries] in catalogue.py."""

    limit: NotRequired[Annotated[int, Range(0, MAX_LISTED)]]  # entries to carry at most (STATUS_ENTRIES if absent)


class LsRequest(TypedDict):
    """A page of the entries by key (Note [Status with many entries] in catalogue.py)."""

    after: NotRequired[Annotated[str, Size(0, 256)]]  # the previous page's `next`; absent or "": the first page
    limit: NotRequired[Annotated[int, Range(1, MAX_LISTED)]]  # entries on the page at most (LS_PAGE if absent)


class LookupRequest(TypedDict):
    key: Key
    wait: NotRequired[bool]  # wait while another connection loads it (true when absent)


class CancelRequest(TypedDict):
    request: Id  # the lookup to stop waiting in


class ReserveRequest(TypedDict):
    key: Key
    bytes: Count
    descriptors: NotRequired[Annotated[int, Range(2, MAX_FDS)]]  # graph, arena, one per source (2 when absent)
    backing: NotRequired[Literal["memfd", "file"]]  # of its arena: a memfd takes no disk ("file" when absent)
    evict: NotRequired[bool]  # False: only if it fits without evicting (Note [Reserving ahead] in store.py)


class Source(TypedDict):
    """A checkpoint file a publish attaches, with the identity the daemon checks (arena.file_identity)."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


class Watched(TypedDict):
    path: Annotated[str, Size(1, 4096)]
    dev: int
    ino: int
    ctime_ns: int


Piece = Annotated[list[Count], Size(4, 4)]  # [arena offset, bytes, source index, file offset]
Part = Annotated[list[Count], Size(2, 2)]  # [arena offset, bytes]: Note [Arena parts] in arena.py


class PublishRequest(TypedDict):
    key: Key
    graph_bytes: Count
    arena_bytes: Count
    meta: NotRequired[Annotated[dict[str, Any], Size(0, MAX_META)]]
    times: NotRequired[MissTimes]  # what the miss cost its caller (the daemon's own measure when absent)
    deps: NotRequired[list[str]]  # the keys of the entries its graph refers to
    parts: NotRequired[Annotated[list[Part], Size(0, MAX_PARTS)]]
    sources: NotRequired[list[Source]]
    pieces: NotRequired[list[Piece]]
    pin: NotRequired[bool]
    marker: NotRequired[bool]  # an entry without bytes (Note [Random loads] in overmind_jupyter/randomness.py)
    watch: NotRequired[Annotated[list[Watched], Size(0, MAX_WATCHED)]]


class KeyRequest(TypedDict):
    key: Key


class UnpinRequest(TypedDict):
    key: Key
    count: NotRequired[Annotated[int, Range(1)]]


class EvictRequest(TypedDict):
    key: NotRequired[Key]  # an entry, or the prefix of one entry's key
    all: NotRequired[bool]  # every unpinned entry instead


class ProgressRequest(TypedDict):
    """How far the sender's load of `key` got (Note [Progress] in store.py)."""

    key: Key
    label: NotRequired[str]  # what runs, with the model's name: "Loading weights llama-0.1b"
    done: Annotated[float, Range(0)]
    total: Annotated[float, Range(0)]  # 0: unknown
    unit: NotRequired[str]  # "B" for bytes, "it" for steps


class HitTime(TypedDict):
    key: Key
    t: float  # when the hit ended (seconds since the epoch)
    hit_s: Annotated[float, Range(0)]  # how long it took


class HitsRequest(TypedDict):
    """The sender's hit times, reported after the hits (Note [Load time saved] in store.py)."""

    hits: Annotated[list[HitTime], Size(0, 1000)]


class FallbackRequest(TypedDict):
    call: NotRequired[str]
    kind: NotRequired[str]
    reason: NotRequired[str]


class DeviceSpec(TypedDict):
    id: Annotated[str, Size(1, 128)]  # the physical device (a CUDA UUID)
    total_bytes: Annotated[int, Range(0, (1 << 60) - 1)]
    name: NotRequired[str]
    model: NotRequired[str]
    simulated: NotRequired[bool]


class UnitsRegisterRequest(TypedDict):
    devices: NotRequired[Annotated[list[DeviceSpec], Size(0, MAX_DEVICES)]]


class UnitsAcquireRequest(TypedDict):
    units: Annotated[int, Range(1, MAX_UNITS)]
    devices: NotRequired[Annotated[list[str], Size(1, MAX_DEVICES)] | None]  # null: any device
    timeout_s: NotRequired[Annotated[float, Range(0, 1e9)] | None]  # null: wait forever
    label: NotRequired[str]
    busy: NotRequired[bool]
    context_units: NotRequired[Annotated[int, Range(0, MAX_UNITS)]]  # Note [CUDA contexts] in ledger.py
    spare: NotRequired[bool]  # asked to release before any other holding (Note [Spare holdings] in ledger.py)


class HoldingRequest(TypedDict):
    holding: Id  # the id an acquire returned


class UnitsTouchRequest(TypedDict):
    holding: Id
    busy: bool


# -- replies ------------------------------------------------------------------------------------------

Snapshot = dict[str, Any]  # a reply not typed field by field


class Connection(TypedDict):
    """A connection as the daemon describes it (daemon.Connection.describe); one that went away meanwhile
    is `{"conn", "pid": null, "role": "gone", "label": ""}`."""

    conn: int
    pid: int | None
    role: str  # "kernel", "worker", "cli", "?" before its hello, "gone"
    label: str  # a kernel's notebook path, "kernel ID", "preload for pid N"
    command: NotRequired[str]
    connected: NotRequired[float]


class Pinning(Connection):
    pins: int  # how many times this connection pins the entry


class Progress(TypedDict):
    """Note [Progress] in store.py."""

    label: str
    done: float
    total: float  # 0: unknown
    unit: str  # "B", "it"
    eta_s: float | None


class Pending(TypedDict):
    """What is left to copy of an entry into its arena (Note [Pending pieces] in store.py)."""

    bytes: int
    done: int
    copying: bool
    queued: bool  # False: never copied (OVERMIND_COMPACT=0)
    short_of_disk: bool  # the copy waits for room on the disk (Note [Disk room] in disk.py)
    eta: float | None
    sources: list[str]


class MissTimes(TypedDict):
    """What the miss that made an entry cost the user, in seconds (Note [Load time saved] in store.py):
    `waited_s`, from the call's start to the publish that ended it, is `load_s` (the load itself) plus
    `cache_s` (key, lookup, staging, packing, publishing)."""

    waited_s: Annotated[float, Range(0, 1e7)]
    load_s: Annotated[float, Range(0, 1e7)]
    cache_s: Annotated[float, Range(0, 1e7)]


class EntryStatus(MissTimes):
    key: str
    meta: dict[str, Any]  # what the loader published: "label", "log", "devices", "made"...
    bytes: int
    arena_bytes: int
    backing: str  # "memfd", "file"
    hits: int
    created: float
    last_used: float
    deps: list[str]
    pending: Pending | None
    progress: Progress | None  # the compactor's copy
    pinned_by: list[Pinning]


class LoadStatus(TypedDict):
    """A load in flight."""

    key: str
    since: float
    reserved: int
    loader: Connection
    waiters: int
    progress: Progress | None


class LoggedHit(MissTimes):
    """A hit in status's `hits_log`, with the times of the miss that made its entry."""

    t: float
    key: str
    label: str  # cut at catalogue.LABEL_CHARS
    pid: int
    hit_s: float | None  # the hit's whole wait, as its kernel timed it; null until it reported it


class TimeSaved(TypedDict):
    """The sums behind "load time saved", since the daemon started (Note [Load time saved] in store.py)."""

    misses: int  # the misses published
    cache_s: float  # what caching added to their waits
    hits: int  # the hits whose time their kernel reported
    plain_s: float  # the plain loads those hits replaced (their entries' load_s)
    hit_s: float  # those hits' waits
    untimed_ended: NotRequired[int]  # the other hits: of kernels that ended before reporting their times
    untimed_waiting: NotRequired[int]  # and of kernels that run and have not reported them yet


class DiskStatus(TypedDict):
    """The disk under file arenas (disk.DiskRoom.describe)."""

    directory: str
    used: int
    free: int
    size: int
    reserve: int


class DescriptorsStatus(TypedDict):
    limit: int
    cap: int
    entries: int
    reserved: int
    connections: int
    open: int | None  # the daemon's open descriptors (null where /proc cannot tell)


class DaemonInfo(TypedDict):
    pid: int
    version: str
    protocol: int
    home: str
    started: float


class FallbackStatus(TypedDict):
    time: float
    pid: int
    label: str  # the reporting connection's label
    call: str
    kind: str
    reason: str


class Holder(TypedDict):
    """A holding of GPU units (ledger.Ledger.snapshot)."""

    holding: int
    kernel: Connection
    pid: int | None
    label: str  # the model the units are for
    model: str  # the same
    units: int
    busy: bool
    idle_s: float | None
    granted: float
    release_requested: bool
    context: bool
    spare: bool  # a device copy kept for speed, given up first (Note [Spare holdings] in ledger.py)


class DeviceStatus(TypedDict):
    id: str  # the physical device (a CUDA UUID)
    name: str  # as the first reporter addresses it ("cuda:0")
    model: str
    simulated: bool
    total_bytes: int
    capacity: int  # units the ledger may hand out
    used: int
    free: int
    holders: list[Holder]  # least recently used first


class UnitsWaiter(TypedDict):
    kernel: Connection
    model: str
    units: int
    devices: list[str]
    device_ids: list[str]
    waited_s: float
    timeout: float | None


class UnitsSnapshot(TypedDict):
    """The units ledger's snapshot (ledger.Ledger.snapshot): status's `units`, units_state's reply."""

    unit_bytes: int
    reserve_gib: float
    simulated: bool
    fake_gpus: str | None
    config_error: str | None
    devices: list[DeviceStatus]
    waiters: list[UnitsWaiter]
    stats: dict[str, int]


class StoreSnapshot(TypedDict):
    """The store's part of status (store.Store.snapshot). It carries some of the entries, with
    `entries_total` and `entries_more` (Note [Status with many entries] in catalogue.py)."""

    budget: int
    used: int
    disk: DiskStatus | None
    reserved: int
    loading: list[LoadStatus]
    hits_log: list[LoggedHit]  # the recent hits, oldest first (store.HITS_LOG at most)
    time_saved: TimeSaved
    stats: dict[str, int]
    descriptors: DescriptorsStatus
    entries: list[EntryStatus]  # the largest, then the most recently used
    entries_total: int
    entries_more: int


class StatusReply(StoreSnapshot):
    daemon: DaemonInfo
    kernels: list[Connection]
    fallbacks: list[FallbackStatus]
    units: UnitsSnapshot
    errors: dict[str, int]  # error replies by code


class HelloReply(TypedDict):
    protocol: int
    version: str
    pid: int
    home: str
    budget: int
    conn: int


class PingReply(TypedDict):
    pong: float


class LsReply(TypedDict):
    entries: list[dict[str, Any]]  # by key
    total: int  # entries listed in all
    next: str | None  # the `after` of the next page; null after the last one


class HitEntry(TypedDict):
    key: str
    arena_bytes: int
    graph_bytes: int
    meta: dict[str, Any]
    parts: list[list[int]]
    sources: list[dict[str, Any]]
    pieces: list[list[int]]


class LookupReply(TypedDict):
    status: str  # "hit", "load", "busy" (another connection loads it; wait was false), "cancelled"
    key: NotRequired[str]
    entries: NotRequired[list[HitEntry]]  # on a hit, with the descriptors


class CancelReply(TypedDict):
    cancelled: bool


class EvictedEntry(TypedDict):
    key: str
    label: str  # its meta's label, cut at catalogue.LABEL_CHARS
    bytes: int


class EvictedReply(TypedDict):
    evicted: list[str]  # the keys, in the order they went
    # an explicit evict's (not a reserve's): the first EVICTED_DESCRIBED of them as status names them, and
    # the bytes of all of them; an older daemon sends neither
    entries: NotRequired[list[EvictedEntry]]
    bytes: NotRequired[int]


class PublishReply(TypedDict):
    published: str
    served_waiters: int


class ShutdownReply(TypedDict):
    stopping: int


class UnitsRegisterReply(TypedDict):
    devices: list[dict[str, Any]]
    simulated: bool
    unit_bytes: int
    reserve_gib: float
    fake_gpus: str | None


Grant = dict[str, Any]  # units_acquire: the holding the ledger made (ledger.py)


class UnitsReleaseReply(TypedDict):
    released: int


class UnitsCancelReply(TypedDict):
    cancelled: bool  # it was still waiting
    revoked: int | None  # the holding it had been granted, now released


# -- the check ----------------------------------------------------------------------------------------

Check = Callable[[Any, str], None]  # raises RemoteError("bad_request") unless the value fits; str: where


def check(declared: Any, payload: Mapping[str, Any], op: str) -> None:
    """Raise RemoteError("bad_request") unless `payload` has every field `declared` (a TypedDict)
    requires, each of its declared type and within its bounds. Asked first without naming where a
    value fails (`_accepts`: a publish's few hundred pieces took the daemon 0.7-1.3 ms, most of it
    the names of places that were not wrong); only a request it does not accept is checked again by
    `_checker`, which says what is wrong, or lets it through where the quick check was stricter."""
    if not _accepts(declared)(payload):
        _checker(declared)(payload, op)


@functools.cache
def _fields(declared: Any) -> tuple[frozenset[str], dict[str, Any]]:
    """The required fields of a TypedDict, and the type of each field. Read from the resolved hints, not
    from `__required_keys__`, which takes every field as required when annotations are strings."""
    hints = typing.get_type_hints(declared, include_extras=True)
    total = getattr(declared, "__total__", True)
    required = {name for name, hint in hints.items()
                if typing.get_origin(hint) is typing.Required or (total and typing.get_origin(hint) is not NotRequired)}
    return frozenset(required), {name: _unwrap_required(hint) for name, hint in hints.items()}


def _unwrap_required(hint: Any) -> Any:
    while typing.get_origin(hint) in (NotRequired, typing.Required):
        hint = typing.get_args(hint)[0]
    return hint


_KINDS: dict[Any, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,),
                                       type(None): (type(None),), list: (list,), dict: (dict,)}


@functools.cache
def _checker(hint: Any) -> Check:  # noqa: C901 (one case per kind of hint, each making its check: read as a table)
    """The check of a value against `hint`, made once per type (a lookup's costs a few microseconds)."""
    text = _describe(hint)
    bounds: list[Any] = []
    if typing.get_origin(hint) is Annotated:
        hint, *bounds = typing.get_args(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)

    def refuse(value: Any, where: str) -> RemoteError:
        return RemoteError("bad_request", f"{where} must be {text}, not {_shown(value)}")

    if hint is Any:
        return lambda value, where: None
    if origin in (typing.Union, types.UnionType):
        options = [_checker(arg) for arg in args]

        def one_of(value: Any, where: str) -> None:
            for option in options:
                try:
                    return option(value, where)
                except RemoteError:
                    pass
            raise refuse(value, where)

        return one_of
    if origin is Literal:
        def literal(value: Any, where: str) -> None:
            if value not in args:
                raise refuse(value, where)

        return literal
    kind = _KINDS.get(origin or hint, (dict,) if typing.is_typeddict(hint) else ())
    item = _checker(args[0]) if origin is list and args and args[0] is not Any else None
    required, fields = _fields(hint) if typing.is_typeddict(hint) else (frozenset(), {})
    field_checks = {name: _checker(field) for name, field in fields.items()}

    def fits(value: Any, where: str) -> None:
        if not _of_kind(value, kind) or not all(_within(bound, value) for bound in bounds):
            raise refuse(value, where)
        if item is not None:
            for i, x in enumerate(value):
                item(x, f"{where}[{i}]")
        for name, field_check in field_checks.items():
            if name in value:
                field_check(value[name], f"{where}'s {name!r}")
            elif name in required:
                raise RemoteError("bad_request", f"{where} needs {name!r} ({_describe(fields[name])})")

    return fits


@functools.cache
def _accepts(hint: Any) -> Callable[[Any], bool]:
    """Whether a value fits `hint` by `_checker`'s rules, without saying where it does not: True only
    where `_checker` passes it (it may be stricter: exact ints in a list of numbers, as JSON makes them)."""
    bounds: list[Any] = []
    if typing.get_origin(hint) is Annotated:
        hint, *bounds = typing.get_args(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda value: True
    if origin in (typing.Union, types.UnionType):
        options = [_accepts(arg) for arg in args]
        return lambda value: any(option(value) for option in options)
    if origin is Literal:
        return lambda value: value in args
    kind = _KINDS.get(origin or hint, (dict,) if typing.is_typeddict(hint) else ())
    item = args[0] if origin is list and args and args[0] is not Any else None
    ints = _int_ranges(item) if item is not None else None  # a list of integers: asked of all at once
    rows = _int_rows(item) if item is not None and ints is None else None  # a list of such lists: the same
    each = _accepts(item) if item is not None and ints is None and rows is None else None
    required, fields = _fields(hint) if typing.is_typeddict(hint) else (frozenset(), {})
    field_accepts = [(name, _accepts(field), name in required) for name, field in fields.items()]

    def accepts(value: Any) -> bool:
        if not _of_kind(value, kind):
            return False
        for bound in bounds:
            if not _within(bound, value):
                return False
        if ints is not None and not _ints_within(value, ints):
            return False
        if rows is not None and not _rows_within(value, *rows):
            return False
        if each is not None and not all(map(each, value)):
            return False
        for name, field_accepts_, needed in field_accepts:
            if name in value:
                if not field_accepts_(value[name]):
                    return False
            elif needed:
                return False
        return True

    return accepts


_EXACT_INT = {int}
_EXACT_LIST = {list}


def _ints_within(values: list[Any], ranges: list[Range]) -> bool:
    """Whether `values` are all ints (as JSON makes them: no bools, no subclasses) within `ranges`."""
    if not values:
        return True
    if not _EXACT_INT.issuperset(map(type, values)):
        return False
    low, high = min(values), max(values)
    return all((r.low is None or low >= r.low) and (r.high is None or high <= r.high) for r in ranges)


def _rows_within(values: list[Any], length: int, ranges: list[Range]) -> bool:
    """Whether `values` are all lists (as JSON makes them) of `length` ints within `ranges`: a publish's
    pieces, a few hundred, asked of all at once (one by one they took the daemon 0.2 ms)."""
    return (_EXACT_LIST.issuperset(map(type, values)) and set(map(len, values)) <= {length}
            and _ints_within(list(itertools.chain.from_iterable(values)), ranges))


def _int_rows(hint: Any) -> tuple[int, list[Range]] | None:
    """(length, Range bounds) where `hint` is a list of integers of one length with no other bound
    (`Piece`, `Part`); else None."""
    bounds: list[Any] = []
    if typing.get_origin(hint) is Annotated:
        hint, *bounds = typing.get_args(hint)
    if (typing.get_origin(hint) is not list or len(bounds) != 1 or not isinstance(bounds[0], Size)
            or bounds[0].low != bounds[0].high):
        return None
    ranges = _int_ranges(typing.get_args(hint)[0])
    return None if ranges is None else (bounds[0].low, ranges)


def _int_ranges(hint: Any) -> list[Range] | None:
    """The Range bounds of `hint` where it is an integer with no other bound (`Count`); else None."""
    bounds: list[Any] = []
    if typing.get_origin(hint) is Annotated:
        hint, *bounds = typing.get_args(hint)
    if hint is not int or not all(isinstance(bound, Range) for bound in bounds):
        return None
    return bounds


def _of_kind(value: Any, kind: tuple[type, ...]) -> bool:
    """Whether `value` is one of `kind`, a bool counting as a bool only (JSON's true is no integer)."""
    return isinstance(value, kind) and (bool in kind or not isinstance(value, bool))


def _within(bound: Any, value: Any) -> bool:
    if isinstance(bound, Range):
        return (not isinstance(value, float) or math.isfinite(value)) and (
            bound.low is None or value >= bound.low) and (bound.high is None or value <= bound.high)
    if isinstance(bound, Size):
        size = len(str(value)) if isinstance(value, dict) else len(value)
        return size >= bound.low and (bound.high is None or size <= bound.high)
    return True


def _describe(hint: Any) -> str:
    bounds: list[Any] = []
    if typing.get_origin(hint) is Annotated:
        hint, *bounds = typing.get_args(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        text = " or ".join(_describe(arg) for arg in args)
    elif origin is Literal:
        text = "one of " + ", ".join(repr(a) for a in args)
    elif typing.is_typeddict(hint):
        text = "an object {" + ", ".join(_fields(hint)[1]) + "}"
    else:
        names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                 type(None): "null", list: "a list", dict: "an object"}
        text = names.get(origin or hint, "anything")
        if origin is list and args and args[0] is not Any:
            text += f" of {_plural(_describe(args[0]))}"
    for bound in bounds:
        if isinstance(bound, Size) and (origin or hint) is dict:
            text += f" of at most {bound.high} characters as text"
        else:
            text += _describe_bound(bound)
    return text


def _plural(text: str) -> str:
    return text.removeprefix("an ").removeprefix("a ").replace("integer", "integers", 1).replace(
        "string", "strings", 1).replace("object", "objects", 1).replace("list", "lists", 1)


def _describe_bound(bound: Any) -> str:
    if isinstance(bound, Range):
        if bound.low is not None and bound.high is not None:
            return f" from {_number(bound.low)} to {_number(bound.high)}"
        return f" >= {_number(bound.low)}" if bound.low is not None else f" <= {_number(bound.high)}"
    if isinstance(bound, Size):
        if bound.low == bound.high:
            return f" of length {bound.low}"
        return f" of length {bound.low} to {bound.high}" if bound.high is not None else f" of length >= {bound.low}"
    return ""


def _number(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
