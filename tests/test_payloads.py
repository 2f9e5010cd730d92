"""Every operation's request has a declared type (kernel_server/payloads.py), and the daemon checks each
request against it before any handler runs: a missing field or a field of the wrong type gets the error
reply "bad_request" naming the operation and the field, and the daemon keeps serving."""

from __future__ import annotations

import sys
import typing
from typing import Any, Literal

import pytest

from kernel_server import Client
from kernel_server.errors import RemoteError
from kernel_server.operations import PAYLOADS, Op
from kernel_server.payloads import check

# A request of each operation that fits its type (what is sent is always one field away from it).
VALID: dict[Op, dict[str, Any]] = {
    Op.HELLO: {"protocol": 2, "role": "test", "label": "x", "pid": 1},
    Op.LOOKUP: {"key": "k", "wait": False},
    Op.CANCEL: {"request": 1},
    Op.RESERVE: {"key": "k", "bytes": 16, "descriptors": 2, "backing": "file", "evict": False},
    Op.PUBLISH: {"key": "k", "graph_bytes": 16, "arena_bytes": 4096, "meta": {}, "deps": [],
                 "sources": [{"path": "/x", "dev": 1, "ino": 2, "size": 3, "mtime_ns": 4, "ctime_ns": 5}],
                 "pieces": [[0, 1, 0, 0]], "pin": True, "marker": False,
                 "watch": [{"path": "/x", "dev": 1, "ino": 2, "ctime_ns": 5}]},
    Op.ABANDON: {"key": "k"},
    Op.UNPIN: {"key": "k", "count": 1},
    Op.EVICT: {"key": "k", "all": False},
    Op.PROGRESS: {"key": "k", "label": "Loading weights m", "done": 1, "total": 4.5, "unit": "B"},
    Op.HITS: {"hits": [{"key": "k", "t": 1.5, "hit_s": 0.004}]},
    Op.FALLBACK: {"call": "c", "kind": "k", "reason": "r"},
    Op.UNITS_REGISTER: {"devices": [{"id": "sim:0", "total_bytes": 1 << 30, "name": "n", "model": "m",
                                     "simulated": True}]},
    Op.UNITS_ACQUIRE: {"units": 1, "devices": ["sim:0"], "timeout_s": 1.5, "label": "x", "busy": False,
                       "context_units": 1},
    Op.UNITS_RELEASE: {"holding": 1},
    Op.UNITS_TOUCH: {"holding": 1, "busy": True},
    Op.UNITS_CANCEL: {"request": 1},
    Op.STATUS: {"limit": 50},
    Op.LS: {"after": "k", "limit": 10},
}
WRONG = [None, "x", 1.5, -1, True, [], {}, ["x"], [{}]]


def wrong_value(op: Op, name: str) -> Any:
    """A value of `name` that its declared type refuses (the first of WRONG)."""
    for value in WRONG:
        try:
            check(PAYLOADS[op].request, {**VALID[op], name: value}, op.value)
        except RemoteError:
            return value
    raise AssertionError(f"{op.value}'s {name!r} takes every value")


def cases() -> list[tuple[Op, str]]:
    return [(op, name) for op in VALID for name in VALID[op]]


def test_every_operation_declares_its_payloads_and_the_examples_fit_them() -> None:
    assert set(PAYLOADS) == set(Op)
    for op, payload in VALID.items():
        check(PAYLOADS[op].request, payload, op.value)
    fieldless = {op for op in Op if not PAYLOADS[op].request.__annotations__}
    assert fieldless == set(Op) - set(VALID), "VALID has an example of every operation that has fields"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="typing.get_overloads is Python 3.11's")
def test_the_client_types_each_reply_as_the_operations_table_declares() -> None:
    typed: dict[Op, Any] = {}
    for overload in typing.get_overloads(Client.request):
        hints = typing.get_type_hints(overload)
        if typing.get_origin(hints["op"]) is Literal:
            for op in typing.get_args(hints["op"]):
                typed[op] = typing.get_args(hints["return"])[0]
    assert typed == {op: PAYLOADS[op].reply for op in Op}


def test_a_reply_carries_its_fields_without_the_frames_id_and_ok(daemon: Client) -> None:
    assert set(daemon.request(Op.PING).payload) == {"pong"}
    assert set(daemon.request(Op.EVICT, all=True).payload) == {"evicted", "entries", "bytes"}


def test_the_check_names_the_field_and_what_it_must_be() -> None:
    with pytest.raises(RemoteError, match=r"reserve's 'descriptors' must be an integer from 2 to \d+, not 1"):
        check(PAYLOADS[Op.RESERVE].request, {**VALID[Op.RESERVE], "descriptors": 1}, "reserve")
    with pytest.raises(RemoteError, match=r"lookup needs 'key' \(a string of length 1 to 256\)"):
        check(PAYLOADS[Op.LOOKUP].request, {"wait": True}, "lookup")
    with pytest.raises(RemoteError, match=r"units_register's 'devices'\[0\]'s 'total_bytes' must be"):
        check(PAYLOADS[Op.UNITS_REGISTER].request, {"devices": [{"id": "a", "total_bytes": "1"}]}, "units_register")
    with pytest.raises(RemoteError, match=r"publish's 'pieces'\[0\] must be a list of integers >= 0 of length 4"):
        check(PAYLOADS[Op.PUBLISH].request, {**VALID[Op.PUBLISH], "pieces": [[0, 1, 0]]}, "publish")
    with pytest.raises(RemoteError) as refused:
        check(PAYLOADS[Op.UNITS_ACQUIRE].request, {"units": 1, "timeout_s": float("nan")}, "units_acquire")
    assert refused.value.code == "bad_request"
    check(PAYLOADS[Op.UNITS_ACQUIRE].request, {"units": 1, "devices": None, "timeout_s": 3}, "units_acquire")
    check(PAYLOADS[Op.LOOKUP].request, {"key": "k", "from_a_newer_client": 1}, "lookup")  # more is ignored


@pytest.mark.parametrize(("op", "name"), cases(), ids=[f"{op.value}.{name}" for op, name in cases()])
def test_a_field_of_the_wrong_type_or_missing_gets_bad_request_and_the_daemon_serves_on(
        daemon: Client, op: Op, name: str) -> None:
    value = wrong_value(op, name)
    with pytest.raises(RemoteError) as refused:
        daemon.request(op, **{**VALID[op], name: value})
    assert refused.value.code == "bad_request", refused.value
    assert f"{op.value}'s {name!r}" in str(refused.value)
    without = {k: v for k, v in VALID[op].items() if k != name}
    try:
        check(PAYLOADS[op].request, without, op.value)
    except RemoteError:  # a required field: the daemon says it is missing
        with pytest.raises(RemoteError) as refused:
            daemon.request(op, **without)
        assert refused.value.code == "bad_request" and f"{op.value} needs {name!r}" in str(refused.value)
    assert daemon.request(Op.PING)["pong"] > 0
    assert daemon.request(Op.STATUS)["errors"].get("internal", 0) == 0


def test_the_quick_check_lets_through_only_what_the_full_check_does() -> None:
    """`check` asks `_accepts` first, which names nothing (a publish of a few hundred pieces took the
    daemon a millisecond to check by `_checker`): whatever it takes, the full check takes too, for every
    field of every operation set to each wrong value, to each nested wrong value, and to the valid one."""
    from kernel_server import payloads

    nested = [[0, 1, 0, -1], [0, 1, 0], [0, 1, 0, True], [0, 1, 0, 2.0], [0, 1, 0, 1 << 70], [0, "1", 0, 0],
              [], [0, 1], [0, -1], [0, None], (0, 1, 0, 0), (0, 1), {"0": 1}, "0101", 7]
    for op, name in cases():
        declared = PAYLOADS[op].request
        values = [VALID[op][name], *WRONG, *([[p] for p in nested] + [[[0, 1, 0, 0], p] for p in nested]
                                             if name in ("pieces", "parts") else [])]
        for value in values:
            payload = {**VALID[op], name: value}
            try:
                payloads._checker(declared)(payload, op.value)
                fits = True
            except RemoteError:
                fits = False
            assert fits or not payloads._accepts(declared)(payload), (op, name, value)
        assert payloads._accepts(declared)(VALID[op]), f"{op.value}: a valid request takes the quick way"
    pieces = [[i << 20, 1 << 20, 0, i << 20] for i in range(300)]
    assert payloads._accepts(PAYLOADS[Op.PUBLISH].request)({**VALID[Op.PUBLISH], "pieces": pieces})
