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
from typing import Any, ClassVar

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
#
# What is kept is what a kernel at the libraries' default verbosity and Python's default warning filters
# is shown, whatever the missing kernel's own settings (Note [A quiet kernel's miss]).
_LIBRARY_LOGGERS = ("transformers", "diffusers", "peft")
_LIBRARY_CHILDREN = tuple(f"{name}." for name in _LIBRARY_LOGGERS)
_MAX_SAID = 8 * 1024
# .saids: the Said of each load_log open on this thread; .once: in warning_once; .quiet: in a quiet load;
# .through: a warning let through by the quiet load's filter; .again: one warned again past that filter
_this_thread = threading.local()

# Note [A quiet kernel's miss]
# A miss keeps what a kernel at the libraries' default verbosity (WARNING: transformers', diffusers', and
# Python's for PEFT's loggers) and Python's default warning filters is shown, so that a hit in another
# kernel shows what its own settings let through of it; the missing kernel itself shows what its own
# settings let through, as its plain load does. A kernel quieter than that (`transformers.logging.
# set_verbosity_error()`, TRANSFORMERS_VERBOSITY=error, `warnings.simplefilter("ignore")`, -W ignore)
# makes nothing to keep: a logger's level is checked before a record is made, and an ignored warning never
# reaches showwarning. So there, and only there (`_quieter`, a microsecond: a miss in a kernel at the
# defaults does nothing more), while the load runs:
# - `Logger.isEnabledFor` stands in for logging's: on the loading thread, a library's loggers make the
#   records of WARNING and above, whatever their levels (no level is changed: other threads, and the
#   library's own reading of its verbosity, see the kernel's). And `Logger.callHandlers` stands in for
#   logging's: such a record that the kernel's own levels would not have made reaches the loads' handlers
#   (`_Logged`) only, not the kernel's. It must be there, not in a filter: a logger's filters see only the
#   records logged on it, not those its children propagate, and a handler's filters are its owner's;
# - a filter first in `warnings.filters`, whose message pattern matches on the loading thread only, lets
#   that thread's warnings through ("always", which leaves the registries alone; the list is changed in
#   place, which resets no registry). The showwarning stand-in keeps what Python's default filters show,
#   once per place, and warns it again from where it was warned, past that filter, so that the kernel's
#   own filters and registries decide whether it is shown (or raised, for "error"). A block that records
#   warnings itself (`catch_warnings(record=True)`) gets what the kernel's filters let through, as before.
# Not noticed as quieter: `logging.disable`, a level set on one of a library's loggers but not on its
# root, and a filter that ignores some warnings by message or module (a targeted silence, which then
# holds for the hits of what was loaded under it too).
_DEFAULT_LEVEL = logging.WARNING
_IGNORED_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


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


class _WhileUsed:
    """Process-wide stand-ins in place while any thread uses them: `install` at the first `enter`,
    `restore` at the last `leave` (loads in threads end in any order)."""

    lock: threading.Lock
    users = 0

    @classmethod
    def enter(cls) -> None:
        with cls.lock:
            if cls.users == 0:
                cls.install()
            cls.users += 1

    @classmethod
    def leave(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                cls.restore()

    @classmethod
    def install(cls) -> None:
        raise NotImplementedError

    @classmethod
    def restore(cls) -> None:
        raise NotImplementedError


# Note [Stand-ins left behind]
# The stand-ins are process-wide, and other code saves and puts back the same attributes: a
# `warnings.catch_warnings()` block in another thread of the user's that starts during a load and ends
# after it puts `_showwarning` back after the load restored the original, for good. Outside a load a
# stand-in only passes on to what it stands in for, so that is harmless, as long as the next load never
# takes the stand-in for the original: it stood in for itself, and every warning of the process raised
# RecursionError from then on. A hook of the user's set during a load (`old = warnings.showwarning`, a hook
# that calls `old`) wraps the stand-in, and the next load stands in for that hook: the stand-in then calls
# the hook, which calls the stand-in again; called back so, it shows the warning as Python does, as the
# hook's `old` would have without the cache. (A block that starts before a load and ends during it takes
# the stand-in away for the rest of the load: what it warns then is not kept for its hits.)
class _StandIn(_WhileUsed):
    """What a load says goes through these while any thread is inside `load_log`: the library's
    `Logger.warning_once` and `warnings.showwarning`. Each keeps what it saw for the `Said` of every
    `load_log` open on its thread."""

    lock = threading.Lock()
    once: Any = None  # the library's warning_once (None: transformers not imported, nothing said once)
    shown: Any = None  # the showwarning it stands in for

    @classmethod
    def install(cls) -> None:
        # Never itself as what it stands in for: a `catch_warnings` block of another thread that spans the
        # end of a load puts the stand-in back for good, as it found it (Note [Stand-ins left behind])
        once = vars(logging.Logger).get("warning_once")
        if once is not _warning_once:
            cls.once = once
        if cls.once is not None:
            logging.Logger.warning_once = _warning_once  # type: ignore[attr-defined]
        if warnings.showwarning is not _showwarning:
            cls.shown = warnings.showwarning
        warnings.showwarning = _showwarning

    @classmethod
    def restore(cls) -> None:
        if cls.once is not None and vars(logging.Logger).get("warning_once") is _warning_once:
            logging.Logger.warning_once = cls.once  # type: ignore[attr-defined]
        if warnings.showwarning is _showwarning:  # (not where something replaced it meanwhile)
            warnings.showwarning = cls.shown


def _quieter() -> bool:
    """Whether this kernel shows less than a kernel at the libraries' default verbosity and Python's
    default warning filters (Note [A quiet kernel's miss])."""
    loggers = logging.Logger.manager.loggerDict  # (getLogger takes a lock, and makes a logger not there)
    for name in _LIBRARY_LOGGERS:
        logger = loggers.get(name)
        if (logger.getEffectiveLevel() if isinstance(logger, logging.Logger) else logging.root.level) > _DEFAULT_LEVEL:
            return True
    for action, message, category, module, lineno in _filters():
        if (action == "ignore" and message is None and module is None and not lineno
                and category.__module__ == "builtins" and not issubclass(category, _IGNORED_BY_DEFAULT)):
            return True
    return False


def _filters() -> list[Any]:
    """`warnings.filters`: a list (typeshed's is a Sequence)."""
    return warnings.filters  # type: ignore[return-value]


class _OnQuietLoad:
    """The message pattern of the filter a quiet load puts first: it matches on a thread inside a quiet
    load, for a warning not warned again past it and not recorded by a `catch_warnings(record=True)`."""

    def match(self, text: str) -> bool:
        if (getattr(_this_thread, "quiet", False) and not getattr(_this_thread, "again", False)
                and warnings.showwarning is _showwarning):
            _this_thread.through = True  # the filter is "always" for every category: showwarning comes next
            return True
        return False

    def __repr__(self) -> str:
        return "<overmind: the warnings of a load in a quiet kernel, kept for its hits>"


_QUIET_FILTER = ("always", _OnQuietLoad(), Warning, None, 0)


class _Quiet(_WhileUsed):
    """What loads in a quiet kernel change while any thread is inside one (Note [A quiet kernel's miss]):
    `Logger.isEnabledFor` and `Logger.callHandlers`, and a warnings filter."""

    lock = threading.Lock()
    enabled: Any = None  # the isEnabledFor it stands in for
    call_handlers: Any = None  # the callHandlers it stands in for
    filters: ClassVar[list[Any]] = []  # the list the filter went into

    @classmethod
    def install(cls) -> None:
        cls.enabled = vars(logging.Logger)["isEnabledFor"]
        cls.call_handlers = vars(logging.Logger)["callHandlers"]
        logging.Logger.isEnabledFor = _is_enabled_for  # type: ignore[method-assign]
        logging.Logger.callHandlers = _call_handlers  # type: ignore[method-assign]
        cls.filters = _filters()
        cls.filters.insert(0, _QUIET_FILTER)

    @classmethod
    def restore(cls) -> None:
        for filters in (cls.filters, _filters()):  # (the list may have been replaced meanwhile)
            for i, entry in enumerate(filters):
                if entry is _QUIET_FILTER:
                    del filters[i]
                    break
        # (not where something replaced them meanwhile)
        if vars(logging.Logger).get("isEnabledFor") is _is_enabled_for:
            logging.Logger.isEnabledFor = cls.enabled  # type: ignore[method-assign]
        if vars(logging.Logger).get("callHandlers") is _call_handlers:
            logging.Logger.callHandlers = cls.call_handlers  # type: ignore[method-assign]


def _made_for_a_load(logger: logging.Logger, level: int) -> bool:
    """Whether a record of `level` on `logger` is made for the load this thread is in only, past the
    kernel's own levels (Note [A quiet kernel's miss])."""
    return (level >= _DEFAULT_LEVEL and getattr(_this_thread, "quiet", False)
            and (logger.name in _LIBRARY_LOGGERS or logger.name.startswith(_LIBRARY_CHILDREN)))


def _is_enabled_for(self: logging.Logger, level: int) -> bool:
    """`Logger.isEnabledFor` while a load in a quiet kernel runs: a library logger on the loading thread
    makes the records of the libraries' default verbosity (Note [A quiet kernel's miss])."""
    if _made_for_a_load(self, level):
        return not self.disabled and self.manager.disable < level
    return bool(_Quiet.enabled(self, level))


def _call_handlers(self: logging.Logger, record: logging.LogRecord) -> None:
    """`Logger.callHandlers` while a load in a quiet kernel runs: a record that the kernel's own levels
    would not have made reaches the loads' handlers only (Note [A quiet kernel's miss])."""
    if record.levelno >= self.getEffectiveLevel() or not _made_for_a_load(self, record.levelno):
        _Quiet.call_handlers(self, record)
        return
    c: logging.Logger | None = self
    while c is not None:
        for handler in c.handlers:
            if isinstance(handler, _Logged) and record.levelno >= handler.level:
                handler.handle(record)
        c = c.parent if c.propagate else None


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
    """`warnings.showwarning`, keeping what it shows (not ours) for the hits of each load this thread is in;
    in a quiet kernel, what Python's default filters show (Note [A quiet kernel's miss])."""
    if getattr(_this_thread, "passing", False):  # called back by what it passed the warning on to
        _SHOWN_BY_PYTHON(message, category, filename, lineno, file, line)  # Note [Stand-ins left behind]
        return
    if getattr(_this_thread, "again", False):  # warned again past the quiet load's filter: kept already
        _pass_on(message, category, filename, lineno, file, line)
        return
    saids = getattr(_this_thread, "saids", ())
    through = getattr(_this_thread, "through", False)  # let through by the quiet load's filter, not the kernel's
    if through:
        _this_thread.through = False
    where = _warned_from(filename, lineno) if through else None
    if saids and not issubclass(category, OvermindWarning):
        module = str(where.get("__name__", "<string>")) if where is not None else _module_of(filename)
        place = [category.__module__, category.__qualname__, str(message)[:_MAX_SAID // 2], filename, lineno, module]
        kept = through and any(place in said.warned for said in saids)  # (the default filters: once per place)
        if not through or (_shown_by_default(category, module) and not kept):
            for said in saids:
                if (text := said.keep(str(message))) is not None:
                    said.warned.append([*place[:2], text, *place[3:]])
    if through:
        _warn_past(message, category, filename, lineno, where)
    else:
        _pass_on(message, category, filename, lineno, file, line)


def _pass_on(*shown: Any) -> None:
    """Show a warning with the `showwarning` the stand-in stands in for; with Python's own where that is a
    hook of the user's installed over the stand-in, which called it (Note [Stand-ins left behind])."""
    target = _StandIn.shown
    if target is warnings.showwarning:
        target = _SHOWN_BY_PYTHON
    _this_thread.passing = True
    try:
        target(*shown)
    finally:
        _this_thread.passing = False


_SHOWN_BY_PYTHON = getattr(warnings, "_showwarning_orig", warnings.showwarning)  # Python's own showwarning


def _shown_by_default(category: type[Warning], module: str) -> bool:
    """Whether Python's default filters show a warning of `category` warned from `module`."""
    if issubclass(category, DeprecationWarning):
        return module == "__main__"
    return not issubclass(category, _IGNORED_BY_DEFAULT)


def _warned_from(filename: str, lineno: int) -> dict[str, Any] | None:
    """The globals of the frame a warning showing now was warned from (as `warnings.warn` found it)."""
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_lineno == lineno and frame.f_code.co_filename == filename):
        frame = frame.f_back  # type: ignore[assignment]
    return frame.f_globals if frame is not None else None


def _warn_past(message: Warning | str, category: type[Warning], filename: str, lineno: int,
               where: dict[str, Any] | None) -> None:
    """Warn again, past the quiet load's filter, what it let through: the kernel's own filters and
    registries decide, as for the warning itself (Note [A quiet kernel's miss])."""
    module = str(where.get("__name__", "<string>")) if where is not None else _module_of(filename)
    registry = where.setdefault("__warningregistry__", {}) if where is not None else None
    _this_thread.again = True
    try:
        warnings.warn_explicit(message, category, filename, lineno, module=module, registry=registry,
                               module_globals=where)
    finally:
        _this_thread.again = False


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
    quiet, was_quiet = _quieter(), getattr(_this_thread, "quiet", False)
    if quiet:  # Note [A quiet kernel's miss]
        _Quiet.enter()
        _this_thread.quiet = True
    try:
        yield said
    finally:
        if quiet:
            _this_thread.quiet = was_quiet
            _Quiet.leave()
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
