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

__all__ = ["Said", "load_log", "log_again", "warn_again"]

# Note [What the load said]
# A hit shows what the plain load would have shown: the libraries' warnings during the miss (transformers'
# load report of weights newly initialized, a deprecated argument) are kept in the entry's meta, at most
# _MAX_SAID bytes, and logged again, through the same loggers, on every hit (loading.py). So are the
# Python warnings the load showed (a FutureWarning of a deprecated attribute that PEFT reads): each is
# warned again from the place that warned it, with that module's registry, so that the user's filters
# and "once per place" hold as they do for the plain load; ours (a fallback of a load inside it) are
# not the load's. Only the loading thread's count: other threads' loads say theirs themselves.
#
# transformers says some messages once per process (`Logger.warning_once`, an lru_cache over its
# arguments). Kept as logged, a hit would say them again each time, and a miss in a process that had said
# them already kept nothing, so that a hit in a fresh process said nothing. So while a load runs,
# `warning_once` stands in for the library's: it keeps each call's arguments, said or not, and the hit
# calls the library's `warning_once` with them, which says the message only where this process has not
# said it yet, and remembers it as said.
_LIBRARY_LOGGERS = ("transformers", "diffusers", "peft")
_MAX_SAID = 8 * 1024
_this_thread = threading.local()  # .saids: the Said of each load_log open on this thread; .once: in warning_once


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
        if (record.thread == self.thread and not getattr(_this_thread, "once", False)
                and (message := self.said.keep(record.getMessage())) is not None):
            self.said.log.append([record.name, record.levelno, message])


class _StandIn:
    """What a load says goes through these while any thread is inside `load_log`: the library's
    `Logger.warning_once` and `warnings.showwarning`, put back when the last load ends (loads in threads
    end in any order). Each keeps what it saw for the `Said` of every `load_log` open on its thread."""

    lock = threading.Lock()
    users = 0
    once: Any = None  # the library's warning_once (None: transformers not imported, nothing said once)
    shown: Any = None  # the showwarning it stands in for

    @classmethod
    def enter(cls) -> None:
        with cls.lock:
            if cls.users == 0:
                cls.once = vars(logging.Logger).get("warning_once")
                if cls.once is not None:
                    logging.Logger.warning_once = _warning_once  # type: ignore[attr-defined]
                cls.shown, warnings.showwarning = warnings.showwarning, _showwarning
            cls.users += 1

    @classmethod
    def leave(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users:
                return
            if cls.once is not None and vars(logging.Logger).get("warning_once") is _warning_once:
                logging.Logger.warning_once = cls.once  # type: ignore[attr-defined]
            if warnings.showwarning is _showwarning:  # (not where something replaced it meanwhile)
                warnings.showwarning = cls.shown


def _warning_once(self: logging.Logger, *args: Any, **kwargs: Any) -> None:
    """transformers' `warning_once`, keeping its arguments for the hits of each load this thread is in."""
    saids = getattr(_this_thread, "saids", ())
    if saids and not kwargs and args and self.name.split(".")[0] in _LIBRARY_LOGGERS and all(
            a is None or isinstance(a, str | int | float) for a in args):
        try:
            text = str(args[0]) % args[1:] if len(args) > 1 else str(args[0])
        except (TypeError, ValueError):
            text = " ".join(map(str, args))
        for said in saids:
            if (message := said.keep(text)) is not None:
                said.log.append([self.name, logging.WARNING, message, list(args)])
    _this_thread.once = True
    try:
        _StandIn.once(self, *args, **kwargs)
    finally:
        _this_thread.once = False


def _showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
    """`warnings.showwarning`, keeping what it shows (not ours) for the hits of each load this thread is in."""
    saids = getattr(_this_thread, "saids", ())
    if saids and not issubclass(category, OvermindWarning):
        module = _module_of(filename)
        for said in saids:
            if (text := said.keep(str(message))) is not None:
                said.warned.append([category.__module__, category.__qualname__, text, filename, lineno, module])
    _StandIn.shown(message, category, filename, lineno, file, line)


@contextlib.contextmanager
def load_log() -> Iterator[Said]:
    """What this thread's library loggers logged and its warnings showed inside the block."""
    said = Said()
    logged = _Logged(said)
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    for logger in loggers:
        logger.addHandler(logged)
    saids = getattr(_this_thread, "saids", ())
    _this_thread.saids = (*saids, said)
    _StandIn.enter()
    try:
        yield said
    finally:
        _StandIn.leave()
        _this_thread.saids = saids
        for logger in loggers:
            logger.removeHandler(logged)


def _module_of(filename: str) -> str:
    """The name of the imported module whose file is `filename`; else "__main__", whose code a notebook's
    cells and `python -c` run."""
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return name
    return "__main__"


def log_again(log: list[list[Any]]) -> None:
    """Log what a load logged (`Said.log`) through the same loggers; what the library says once per
    process, through its `warning_once` with the load's arguments (Note [What the load said])."""
    for name, level, message, *once in log:
        logger = logging.getLogger(name)
        say_once = getattr(logger, "warning_once", None) if once else None
        if say_once is not None:
            say_once(*once[0])
        else:
            logger.log(level, message)


def warn_again(warned: list[list[Any]]) -> None:
    """Warn what a load warned (`Said.warned`), as from where it was warned (Note [What the load said])."""
    for category_module, category_name, message, filename, lineno, module_name in warned:
        category = getattr(sys.modules.get(category_module), category_name, None)
        if not (isinstance(category, type) and issubclass(category, Warning)):
            category = UserWarning
        module = sys.modules.get(module_name)
        registry = vars(module).setdefault("__warningregistry__", {}) if module is not None else None
        warnings.warn_explicit(message, category, filename, lineno, module=module_name, registry=registry)
