"""Preloaded by the warm-kernel tests' spares: records where and with which environment it was imported,
and changes the environment at import, as some libraries do."""

from __future__ import annotations

import os

IMPORTED_IN = os.getpid()
SAW = os.environ.get("WARM_PROBE_SEEN")
os.environ["WARM_PROBE_SET"] = "by-import"
