"""The wire format between kernels and the daemon.

A frame is a fixed 12-byte header followed by a JSON payload::

    offset  size  field
    0       4     magic, the bytes b"OVMD"
    4       2     protocol version, unsigned big-endian (PROTOCOL_VERSION)
    6       1     frame kind: 1 request, 2 reply, 3 push (daemon to client, unsolicited)
    7       1     number of file descriptors attached to this frame
    8       4     payload length in bytes, unsigned big-endian
    12      n     payload: one UTF-8 JSON object

- A sender MUST send the header and payload of one frame in order, with the frame's file descriptors
  attached (SCM_RIGHTS) to the first byte of the header, and MUST NOT attach more than MAX_FDS.
- A payload MUST be a JSON object of at most MAX_PAYLOAD bytes. A request MUST carry "op" (a string)
  and "id" (an integer unique on its connection); its reply carries the same "id" and "ok" (a bool),
  and, when "ok" is false, "error": {"code": str, "message": str}. A push carries "op" and no "id".
- A receiver MUST answer a frame whose magic, length, kind or payload it cannot accept with an error
  reply; after a bad magic or an oversized length it MUST close the connection, since the stream can
  no longer be delimited. It MUST close every descriptor it did not ask for.
- The first request on a connection MUST be "hello"; the daemon checks the protocol version there and
  in every header. Replies MAY arrive in another order than their requests (a "lookup" that waits for
  another kernel's load is answered when that load ends).
- Pickled bytes never travel in a frame: object graphs and tensor bytes travel as descriptors of sealed
  memory files that only the user's own processes map and unpickle (docs/design.md, invariant 4).
- "publish" attaches the graph, the arena, one sealed descriptor per entry of its "parts" (ranges of the
  arena in files of their own, [arena offset, bytes]: Note [Arena parts] in arena.py), then one read-only
  descriptor per entry of its "sources" (checkpoint files that its "pieces" still lie in, each with the
  identity the daemon MUST check); a "lookup" answered "hit" attaches the graph, then for each listed
  entry its arena followed by its parts' and its sources' descriptors (see Note [Pending pieces] in
  store.py). A "publish" with "marker" true makes an
  entry without bytes that status and "ls" do not list (Note [Random loads] in overmind_jupyter/randomness.py).
  A "publish" MAY name the checkpoint paths its load read ("watch": [{path, dev, ino, ctime_ns}]); the daemon drops
  the entry once one of them is gone or another file (Note [Orphaned entries] in store.py).
- "status" carries at most "limit" entries (50 when absent): the largest, then the most recently used, with
  "entries_total" and "entries_more" (how many it leaves out); "ls" answers a page of the entries by key,
  those after the request's "after" (at most "limit"), with "total" and "next", the "after" of the next page
  (null after the last). Neither reply grows with the number of entries (Note [Status with many entries]
  in catalogue.py).
- The "reserve" before a "publish" MAY say how many descriptors it will attach ("descriptors"; 2 when
  absent), and whether its arena is a "memfd" or a "file" ("backing"; "file" when absent): only a file's
  bytes count against the disk's reserve (Note [Disk room] in disk.py). A receiver whose descriptor table
  is full gets a frame whole but without its descriptors (MSG_CTRUNC, the header announcing at most
  MAX_FDS): that request alone fails, with the error "descriptors_exhausted", and the connection stays
  (Note [Descriptor budget] in descriptors.py).

The operations (their request and reply fields: operations.PAYLOADS, typed in payloads.py): hello, ping,
status, ls, lookup, cancel, reserve, publish, abandon, unpin, evict, progress, hits, fallback, shutdown,
units_register, units_acquire, units_release, units_touch, units_cancel, units_state. A request that does
not fit its operation's type MUST be answered "bad_request". Error codes: operations.ERRORS. "progress"
and "hits" are reports that clients send without waiting for the answer (a daemon that predates them
answers "unknown_op", which nobody reads).

The protocol version is independent of the package version; bump it on any change to this format or to
the meaning of an existing operation. 3: "status" carries some of the entries and "ls" is paged (issue 38).
4: "publish" carries what the miss cost its caller ("times"), and "status" carries it on each entry and
hit, with "time_saved" (Note [Load time saved] in store.py); the views read it without a fallback, so a
daemon of protocol 3 is refused at hello rather than misread. 5: "units_acquire" takes "spare" and the
units snapshot's holders carry it (Note [Spare holdings] in ledger.py): a daemon of protocol 4 would refuse
the field. 6: "publish" carries "parts" and a hit their descriptors, between the arena's and the sources'
(Note [Arena parts] in arena.py): a kernel of protocol 5 would take a part for a source.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_FDS",
    "MAX_PAYLOAD",
    "PROTOCOL_VERSION",
    "Frame",
    "FrameKind",
    "decode_header",
    "decode_payload",
    "encode",
    "frame_kind",
]

MAGIC = b"OVMD"
PROTOCOL_VERSION = 7
HEADER = struct.Struct("!4sHBBI")
MAX_PAYLOAD = 1 << 20
MAX_FDS = 64


class FrameKind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    PUSH = 3


@dataclass
class Frame:
    kind: FrameKind
    payload: dict[str, Any]
    fds: list[int] = field(default_factory=list)
    version: int = PROTOCOL_VERSION


def encode(kind: FrameKind, payload: dict[str, Any], nfds: int = 0) -> bytes:
    """Serialise one frame (header and payload); the caller attaches `nfds` descriptors."""
    if nfds > MAX_FDS:
        raise ProtocolError(f"a frame carries at most {MAX_FDS} descriptors, not {nfds}")
    body = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {len(body)} bytes exceeds the {MAX_PAYLOAD}-byte frame limit")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(kind), nfds, len(body)) + body


def decode_header(raw: bytes) -> tuple[int, int, int, int]:
    """Check the parts of a header that delimit the stream; return (version, kind, nfds, length).

    Raises a fatal ProtocolError for a bad magic or an oversized length. The kind is checked by
    `frame_kind` once the payload has been read, so that the stream stays in step.
    """
    magic, version, kind, nfds, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not an overmind frame", fatal=True)
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_PAYLOAD}-byte limit", fatal=True)
    return version, kind, nfds, length


def frame_kind(kind: int) -> FrameKind:
    try:
        return FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None


def decode_payload(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"payload is not JSON: {exc}") from None
    except RecursionError:  # a payload nested deeper than the parser's stack: answer, do not die
        raise ProtocolError("payload is not JSON this daemon reads: nested too deeply") from None
    if not isinstance(payload, dict):
        raise ProtocolError(f"payload must be a JSON object, not {type(payload).__name__}")
    return payload
