"""What a load logged, kept with its entry so that a hit logs it again (Note [What the load said])."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["load_log"]

# Note [What the load said]
# A hit shows what the plain load would have logged: the libraries' warnings during the miss (transformers'
# load report of weights newly initialized, a deprecated argument) are kept in the entry's meta, at most
# _MAX_SAID bytes, and logged again, through the same loggers, on every hit (loading.py). Only the loading
# thread's records count: other threads' loads log for themselves.
_LIBRARY_LOGGERS = ("transformers", "diffusers", "peft")
_MAX_SAID = 8 * 1024


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.records: list[list[Any]] = []
        self.size = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread:
            return
        message = record.getMessage()[:_MAX_SAID // 2]
        if self.size + len(message) <= _MAX_SAID:
            self.records.append([record.name, record.levelno, message])
            self.size += len(message)


@contextlib.contextmanager
def load_log() -> Iterator[list[list[Any]]]:
    """The library warnings logged by this thread inside the block: [logger, level, message] each."""
    said = _Said()
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    for logger in loggers:
        logger.addHandler(said)
    try:
        yield said.records
    finally:
        for logger in loggers:
            logger.removeHandler(said)
