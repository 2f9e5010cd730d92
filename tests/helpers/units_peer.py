"""A stand-in kernel for the units tests: a bare client of the daemon (no torch), driven by JSON lines.

    python -m tests.helpers.units_peer LABEL
stdin:  {"op": "units_acquire", "units": 5, "timeout_s": 2, "busy": true}   (any request, one per line)
stdout: {"ready": CONN, "pid": PID} first, then one JSON answer per request: the reply, or
        {"ok": false, "code": ..., "message": ...}. Release requests from the daemon are ignored.
"""

from __future__ import annotations

import json
import os
import sys

from kernel_server import Client
from kernel_server.errors import RemoteError


def main() -> None:
    client = Client(role="test", label=sys.argv[1] if len(sys.argv) > 1 else "peer")
    print(json.dumps({"ready": client.conn_id, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            answer = dict(client.request(op, timeout=60, **request).payload)
        except RemoteError as exc:
            answer = {"ok": False, "code": exc.code, "message": str(exc)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
