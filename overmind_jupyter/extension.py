"""The IPython extension: `load_ipython_extension` builds one `Session` that records everything it installs
(the magic, the event callback), and `unload_ipython_extension` removes it in reverse, after `disable()`.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from .api import disable, enable, start

__all__ = ["Session", "load_ipython_extension", "unload_ipython_extension"]


class Session:
    """Everything the extension installs in one IPython shell, removed in reverse by `close`."""

    def __init__(self, shell: Any) -> None:
        from .config import Overmind
        from .magics import OvermindMagics

        self.shell = shell
        self._undo: list[Any] = []
        with self._held_while_the_kernel_starts() as held:
            self.config = Overmind(parent=shell)
            shell.register_magics(OvermindMagics(shell, session=self))
            self._undo.append(lambda: shell.magics_manager.magics["line"].pop("overmind", None))
            shell.events.register("post_run_cell", self._post_run_cell)
            self._undo.append(lambda: shell.events.unregister("post_run_cell", self._post_run_cell))
            if self.config.enabled:
                enable(self.config)
        if held:
            self._on_the_first_cell(held)

    def enable(self) -> str | None:
        """`enable`, returning why no daemon could be started instead of warning it (None: one runs)."""
        return start(self.config)

    def close(self) -> None:
        try:
            disable()
        finally:
            while self._undo:
                undo = self._undo.pop()
                try:
                    undo()
                except (KeyError, ValueError):
                    pass  # already gone

    @contextlib.contextmanager
    def _held_while_the_kernel_starts(self) -> Iterator[list[warnings.WarningMessage]]:
        """The warnings of loading the extension, held where nobody would see them: a kernel loading it from
        its config (`c.InteractiveShellApp.extensions`) runs no cell yet, so ipykernel sends what it prints
        with no parent, and no notebook shows that. A bad setting is reported once (Note [Bad settings]):
        it must not go there. Shown as they come in a cell (`%load_ext`) or a terminal."""
        if getattr(self.shell, "parent_header", None) != {}:
            yield []
            return
        with warnings.catch_warnings(record=True) as held:
            yield held

    def _on_the_first_cell(self, held: list[warnings.WarningMessage]) -> None:
        """Show `held` before the output of the first cell that runs."""

        def show(*_: Any) -> None:
            self.shell.events.unregister("pre_run_cell", show)
            for w in held:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
            sys.stderr.flush()  # above the cell's own output

        self.shell.events.register("pre_run_cell", show)
        self._undo.append(lambda: self.shell.events.unregister("pre_run_cell", show))

    def _post_run_cell(self, result: Any) -> None:
        """After each cell: the warnings of loads that ran in other threads, and the cell's hit times
        (Note [Hit times] in progress.py)."""
        from . import loading, progress

        loading.flush_warnings()
        progress.flush_hit_times()


_session: Session | None = None


def load_ipython_extension(shell: Any) -> None:
    global _session
    if _session is not None:
        return
    _session = Session(shell)


def unload_ipython_extension(shell: Any) -> None:
    global _session
    session, _session = _session, None
    if session is not None:
        session.close()
