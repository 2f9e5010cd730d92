"""What a load logged and warned, kept with its entry so that a hit says it again (Note [What the load
said])."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import OvermindWarning

__all__ = ["Said", "load_log", "warn_again"]

# Note [What the load said]
# A hit shows what the plain load would have shown: the libraries' warnings during the miss (transformers'
# load report of weights newly initialized, a deprecated argument) are kept in the entry's meta, at most
# _MAX_SAID bytes, and logged again, through the same loggers, on every hit (loading.py). So are the
# Python warnings the load showed (a FutureWarning of a deprecated attribute that PEFT reads): each is
# warned again from the place that warned it, with that module's registry, so that the user's filters
# and "once per place" hold as they do for the plain load; ours (a fallback of a load inside it) are
# not the load's. Only the loading thread's count: other threads' loads say theirs themselves.
_LIBRARY_LOGGERS = ("transformers", "diffusers", "peft")
_MAX_SAID = 8 * 1024


@dataclass
class Said:
    """What the loading thread logged ([logger, level, message] each) and warned ([category's module,
    its name, message, file, line, module] each) inside `load_log`."""

    log: list[list[Any]] = field(default_factory=list)
    warned: list[list[Any]] = field(default_factory=list)
    size: int = 0

    def keep(self, message: str) -> str | None:
        message = message[:_MAX_SAID // 2]
        if self.size + len(message) > _MAX_SAID:
            return None
        self.size += len(message)
        return message


class _Logged(logging.Handler):
    def __init__(self, said: Said) -> None:
        super().__init__(logging.WARNING)
        self.said = said
        self.thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread and (message := self.said.keep(record.getMessage())) is not None:
            self.said.log.append([record.name, record.levelno, message])


@contextlib.contextmanager
def load_log() -> Iterator[Said]:
    """What this thread's library loggers logged and its warnings showed inside the block."""
    said = Said()
    logged = _Logged(said)
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    for logger in loggers:
        logger.addHandler(logged)
    shown = warnings.showwarning

    def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: Any = None, line: str | None = None) -> None:
        if (threading.get_ident() == logged.thread and not issubclass(category, OvermindWarning)
                and (text := said.keep(str(message))) is not None):
            said.warned.append([category.__module__, category.__qualname__, text, filename, lineno,
                                _module_of(filename)])
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    try:
        yield said
    finally:
        if warnings.showwarning is showwarning:  # (not where something replaced it meanwhile)
            warnings.showwarning = shown
        for logger in loggers:
            logger.removeHandler(logged)


def _module_of(filename: str) -> str:
    """The name of the imported module whose file is `filename`; else "__main__", whose code a notebook's
    cells and `python -c` run."""
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return name
    return "__main__"


def warn_again(warned: list[list[Any]]) -> None:
    """Warn what a load warned (`Said.warned`), as from where it was warned (Note [What the load said])."""
    for category_module, category_name, message, filename, lineno, module_name in warned:
        category = getattr(sys.modules.get(category_module), category_name, None)
        if not (isinstance(category, type) and issubclass(category, Warning)):
            category = UserWarning
        module = sys.modules.get(module_name)
        registry = vars(module).setdefault("__warningregistry__", {}) if module is not None else None
        warnings.warn_explicit(message, category, filename, lineno, module=module_name, registry=registry)
