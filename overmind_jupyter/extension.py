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
        (Note [Hit times] in progress.py); a Ctrl-C that lands here is dropped (Note [A Ctrl-C after the cell])."""
        from . import loading, progress

        with contextlib.suppress(KeyboardInterrupt):
            loading.flush_warnings()
            progress.flush_hit_times()


# Note [A Ctrl-C after the cell]
# The work after each cell (`_post_run_cell`) runs in the cell's time as the user sees it: after the cell
# that imported torch it prepares the hit path (hit_tuning.prepare, milliseconds), so a Ctrl-C pressed as
# that cell ends lands in it. IPython then printed "Error in callback <bound method
# Session._post_run_cell ...> (for post_run_cell)" and a KeyboardInterrupt traceback through our frames,
# under a cell that had finished. The cell is over, so there is nothing left to stop: the interrupt is
# dropped, as a Ctrl-C between cells is. What it cut short is done later: the preparation at the next
# cell or call (`prepare` marks itself undone), and the deferred warnings and hit times not yet taken after
# the next cell (one being shown or sent as the interrupt lands can be lost). A dead mapping's cleanup is
# never cut short (Note [Cleanup that Ctrl-C cannot cut short] in mappings.py): its sweep raises the
# interrupt only once the work is done.


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
