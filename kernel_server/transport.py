"""Frames over a Unix stream socket: descriptors by SCM_RIGHTS, peers identified by SO_PEERCRED."""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import struct
from collections.abc import Sequence
from typing import Any

from .errors import DescriptorsLost, ProtocolError
from .protocol import HEADER, MAX_FDS, Frame, FrameKind, decode_header, decode_payload, encode, frame_kind

__all__ = ["close_fds", "peer_credentials", "recv_frame", "send_frame"]

_CREDS = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel saw it at connect time."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    pid, uid, gid = _CREDS.unpack(raw)
    return pid, uid, gid


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def send_frame(sock: socket.socket, kind: FrameKind, payload: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one frame. The caller serialises concurrent senders on the same socket."""
    data = encode(kind, payload, len(fds))
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, fds: list[int], *, first: bool,
                stall: float | None = None) -> tuple[bytes | None, bool]:
    """`n` bytes (None at a clean end of stream), and whether descriptors attached to them were cut
    off (MSG_CTRUNC). `stall`: how long the rest of a frame begun may keep the reader waiting."""
    buf = bytearray()
    truncated = False
    while len(buf) < n:
        if stall is not None and (buf or not first) and not _readable(sock, stall):
            raise ProtocolError(f"the peer sent part of a frame and nothing more for {stall:g} s", fatal=True)
        if first and not buf:
            # The sender attaches descriptors to the header's first byte, so they arrive here.
            chunk, got, flags, _ = socket.recv_fds(sock, n, MAX_FDS)
            fds.extend(got)
            truncated = bool(flags & socket.MSG_CTRUNC)
        else:
            chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ProtocolError(f"connection closed inside a frame ({len(buf)} of {n} bytes)", fatal=True)
            return None, truncated
        buf += chunk
    return bytes(buf), truncated


def _readable(sock: socket.socket, seconds: float) -> bool:
    """Whether `sock` has bytes to read within `seconds` (poll: a process's descriptors may number past
    select's 1024). A socket closed meanwhile by another thread (a client's `close()` while its reader
    thread is inside a frame) raises OSError, as its read would, not poll's ValueError for descriptor -1."""
    fd = sock.fileno()
    if fd < 0:
        raise OSError(errno.EBADF, "the socket was closed while a frame was read")
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(math.ceil(seconds * 1000)))


def recv_frame(sock: socket.socket, *, stall: float | None = None) -> Frame | None:
    """Read one frame; None at a clean end of stream. `stall`: how long the rest of a frame, once its
    first bytes came, may take to come (a fatal ProtocolError past it; None: as long as it takes).

    Raises ProtocolError for a frame that cannot be accepted; descriptors that came with it are closed
    first. When the error is not fatal, the stream is positioned at the next frame. DescriptorsLost is
    a whole frame whose descriptors this process had no room for (Note [Descriptor budget] in
    descriptors.py).
    """
    fds: list[int] = []
    try:
        raw, truncated = _recv_exact(sock, HEADER.size, fds, first=True, stall=stall)
        if raw is None:
            return None
        version, kind, nfds, length = decode_header(raw)
        # Cut off with the buffer full, or announcing more than it may: the sender broke the protocol.
        # Cut off short of MAX_FDS: the kernel had no descriptor to give us, and the bytes are all there.
        if truncated and (nfds > MAX_FDS or len(fds) >= MAX_FDS):
            raise ProtocolError(f"more than {MAX_FDS} descriptors attached to one frame", fatal=True)
        body, _ = _recv_exact(sock, length, fds, first=False, stall=stall) if length else (b"", False)
        if body is None:
            raise ProtocolError("connection closed inside a frame", fatal=True)
        checked_kind = frame_kind(kind)
        if truncated:
            raise DescriptorsLost(f"{nfds - len(fds)} of the {nfds} descriptors attached to a frame were lost: "
                                  "this process has no descriptor free (EMFILE)", decode_payload(body))
        if nfds != len(fds):
            raise ProtocolError(f"header announces {nfds} descriptors, {len(fds)} arrived")
        return Frame(checked_kind, decode_payload(body), fds, version)
    except BaseException:
        close_fds(fds)
        raise
