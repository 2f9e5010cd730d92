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
    @argument("--json", action="store_true", help="status or units as a dict")
    @argument("--tokenizer", metavar="TOKVAR",
              help="adapters: the variable holding the tokenizer of the prompt box")
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
                if not args.json and _shows_widgets(self.shell):
                    from . import widgets

                    return _display(widgets.status_panel())
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

                if not args.json and _shows_widgets(self.shell):
                    from . import widgets

                    return _display(widgets.units_bar())
                state = units.state()
                if args.json:
                    return state
                print(units.format_state(state))
                return None
            if args.command == "adapters":
                return self._adapters(args)
            raise UsageError(f"%overmind {args.command} is not available yet in this version")
        except (DaemonError, OvermindError, RemoteError) as exc:
            raise UsageError(str(exc)) from exc

    def _adapters(self, args: Any) -> Any:
        """`%overmind adapters VAR [--tokenizer TOKVAR]`: the adapter panel in a notebook, the gate's state
        as text in a terminal (`--json`: as a dict)."""
        from . import adapters

        if not args.target:
            raise UsageError("%overmind adapters takes the variable that holds the model: "
                             "%overmind adapters model")
        model = self._variable(args.target)
        tokenizer = self._variable(args.tokenizer) if args.tokenizer else None
        gate = model if isinstance(model, adapters.AdapterGate) else adapters.gate(model)
        if args.json:
            return gate.state()
        if _shows_widgets(self.shell):
            from . import widgets

            return _display(widgets.adapter_panel(gate, tokenizer))
        state = gate.state()
        print(repr(gate))
        for name in [*state["adapters"], adapters.BASE]:
            routing, in_flight = state["routing"].get(name, "?"), state["in_flight"].get(name, 0)
            print(f"  {name:<16} {routing:<9} in flight {in_flight}  queued {state['queued'].get(name, 0)}"
                  + ("  (default)" if name == state["default"] else ""))
        return None

    def _variable(self, name: str) -> Any:
        try:
            return self.shell.user_ns[name]
        except KeyError:
            raise UsageError(f"no variable named {name!r} in this kernel") from None


def _shows_widgets(shell: Any) -> bool:
    """Whether the shell is an ipykernel's, whose frontend can render widgets (a terminal cannot)."""
    return type(shell).__name__ == "ZMQInteractiveShell"


def _display(widget: Any) -> None:
    """Show the widget where the magic ran (it keeps itself live until closed; see widgets/polling.py)."""
    from IPython.display import display

    display(widget)
