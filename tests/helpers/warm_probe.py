"""Preloaded by the warm-kernel tests' spares: records where and with which environment it was imported,
changes the environment at import, and makes a temporary directory that a finalizer removes at exit, as
some libraries do."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

IMPORTED_IN = os.getpid()
SAW = os.environ.get("WARM_PROBE_SEEN")
os.environ["WARM_PROBE_SET"] = "by-import"


class _Owner:
    """What owns `TEMP_DIR` (a library's cache object, say)."""


OWNER = _Owner()
TEMP_DIR = tempfile.mkdtemp(prefix="warm-probe-")
weakref.finalize(OWNER, shutil.rmtree, TEMP_DIR, ignore_errors=True)
