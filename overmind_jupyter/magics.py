"""`%overmind`: a thin line magic over the functions of extension.py."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .errors import DaemonError, OvermindError, RemoteError

__all__ = ["OvermindMagics"]


@magics_class
class OvermindMagics(Magics):
    def __init__(self, shell: Any, session: Any) -> None:
        super().__init__(shell)
        self.session = session

    @magic_arguments()
    @argument("command", choices=["on", "off", "status", "evict", "units", "adapters"],
              help="on: cache from_pretrained; off: restore it; status: the cache; evict KEY|--all; "
                   "units: GPU units; adapters VAR: the adapter panel of the model in VAR")
    @argument("target", nargs="?", help="the KEY (or a unique prefix) for evict; the variable for adapters")
    @argument("--all", action="store_true", help="evict every entry")
    @argument("--json", action="store_true", help="status as a dict")
    @line_magic
    def overmind(self, line: str) -> Any:
        """Control the overmind cache of from_pretrained (see `%overmind?`)."""
        args = parse_argstring(self.overmind, line)
        from . import extension

        try:
            if args.command == "on":
                self.session.enable()
                return None
            if args.command == "off":
                extension.disable()
                return None
            if args.command == "status":
                state = extension.status()
                if args.json:
                    return state
                print(extension.format_status(state))
                return None
            if args.command == "evict":
                if args.all == bool(args.target):
                    raise UsageError("%overmind evict takes a KEY or --all")
                evicted = extension.evict(None if args.all else args.target)
                print(f"evicted {len(evicted)} entr{'y' if len(evicted) == 1 else 'ies'}")
                return None
            if args.command == "units":
                from . import units

                state = units.state()
                if args.json:
                    return state
                print(units.format_state(state))
                return None
            raise UsageError(f"%overmind {args.command} is not available yet in this version")
        except (DaemonError, OvermindError, RemoteError) as exc:
            raise UsageError(str(exc)) from exc
