"""`%overmind`: a thin line magic over the functions of api.py. Its docstring is its manual, as IPython's
own magics' are: `%overmind?` shows it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .errors import DaemonError, OvermindError, RemoteError

__all__ = ["OvermindMagics"]

SUBCOMMANDS = ("on", "off", "status", "evict", "units", "adapters")  # each with a line of the manual
_TAKES = {"on": (), "off": (), "status": ("json",), "evict": ("target", "all"), "units": ("json",),
          "adapters": ("target", "json", "tokenizer")}  # what else each subcommand reads of the line


@magics_class
class OvermindMagics(Magics):
    def __init__(self, shell: Any, session: Any) -> None:
        super().__init__(shell)
        self.session = session

    @magic_arguments()
    @argument("command", metavar="{" + ",".join(SUBCOMMANDS) + "}", help="what to do (the subcommands above)")
    @argument("target", nargs="?", help="the KEY (or a unique prefix) for evict; the variable for adapters")
    @argument("--all", action="store_true", help="evict every entry")
    @argument("--json", action="store_true", help="print the state of status, units or adapters as JSON")
    @argument("--tokenizer", metavar="TOKVAR",
              help="adapters: the variable holding the tokenizer of the prompt box")
    @line_magic
    def overmind(self, line: str) -> Any:
        """The overmind cache of `from_pretrained` in this kernel: turn it on and off, look at it, evict
        from it, and look at the GPU units and at a PEFT model's adapters.

        Subcommands:
          on                  cache from_pretrained of transformers, diffusers and peft (libraries
                              imported later too); start the daemon if none runs
          off                 restore every patched loader exactly
          status [--json]     the cache: entries, hits, kernels using them, loads in flight, budget,
                              GPU units, and every call that fell back with its reason
          evict KEY | --all   evict the entry KEY (or a unique prefix of it), or every entry; kernels
                              using an evicted model keep it
          units [--json]      GPU units per device: capacity, and each holder (kernel, model, units)
          adapters VAR [--tokenizer TOKVAR] [--json]
                              the adapter panel of the PEFT model in VAR: switch the default, mix
                              adapters, compare outputs (TOKVAR: the tokenizer of its prompt box)

        In a notebook status, units and adapters show a live widget; in a terminal they print text, and
        with --json the state as JSON. A `# comment` after the arguments is ignored.

        Examples::

            %overmind on
            %overmind status
            %overmind evict 3fa9c2
            %overmind evict --all
            %overmind units --json
            %overmind adapters model --tokenizer tokenizer
            %overmind adapters model --json
            %overmind off
        """
        line = _without_comment(line)
        if not line.strip():  # (argparse would say only "the following arguments are required: command")
            raise UsageError(f"%overmind takes a subcommand: {', '.join(SUBCOMMANDS)}; %overmind? shows what each does")
        args = parse_argstring(self.overmind, line)
        if args.command not in SUBCOMMANDS:  # `%overmind help` too: the manual is `%overmind?`, as IPython's own
            raise UsageError(f"%overmind has no subcommand {args.command!r}: it takes {', '.join(SUBCOMMANDS)}; "
                             "%overmind? shows what each does")
        extra = [repr(value) if name == "target" else f"--{name}" for name, value in vars(args).items()
                 if value and name != "command" and name not in _TAKES[args.command]]
        if extra:
            raise UsageError(f"%overmind {args.command} takes no {' or '.join(extra)}; %overmind? shows what each "
                             "subcommand takes")
        from . import api

        try:
            if args.command == "on":
                failed = self.session.enable()
                if failed is not None:  # said once, here, with its fix (not a warning besides)
                    print(f"overmind on: from_pretrained of transformers, diffusers and peft is patched, but {failed}; "
                          "%overmind status shows it")
                    return None
                state = api.status()
                where = (f"daemon pid {state['daemon']['daemon']['pid']} at {state['home']}" if state.get("daemon")
                         else f"no daemon yet: {state.get('daemon_error', '')}")
                print(f"overmind on: from_pretrained of transformers, diffusers and peft goes through the cache "
                      f"({where}); %overmind status shows it")
                return None
            if args.command == "off":
                api.disable()
                print("overmind off: every loader is as it was")
                return None
            if args.command == "status":
                return self._show(args.json, "status_panel", api.status, api.format_status)
            if args.command == "evict":
                if args.all == bool(args.target):
                    raise UsageError("%overmind evict takes a KEY or --all")
                from kernel_server import lifecycle
                from kernel_server.formats import evicted_text

                home = lifecycle.state_dir()
                if not lifecycle.running(home):  # (the CLI says the same)
                    print(f"no daemon runs at {home}: nothing to evict")
                    return None
                reply = api.evict_reply(None if args.all else args.target)
                print(evicted_text(reply))  # which entries went, named as `%overmind status` names them
                return None
            if args.command == "units":
                from . import units

                return self._show(args.json, "units_bar", units.state, units.format_state)
            return self._adapters(args)  # the last of the SUBCOMMANDS
        except (DaemonError, OvermindError, RemoteError) as exc:
            raise UsageError(str(exc)) from exc

    def _show(self, as_json: bool, widget: str, state: Callable[[], dict[str, Any]],
              text: Callable[[dict[str, Any]], str]) -> None:
        """The live widget `widget` of overmind_jupyter.widgets in a notebook; else the state as text,
        or as JSON."""
        if not as_json and _shows_widgets(self.shell):
            from . import widgets

            return _display(getattr(widgets, widget)())
        now = state()
        print(json.dumps(now, indent=1, default=str) if as_json else text(now))
        return None

    def _adapters(self, args: Any) -> Any:
        """`%overmind adapters VAR [--tokenizer TOKVAR]`: the adapter panel in a notebook, the gate's state
        as text in a terminal (`--json`: as a dict)."""
        from . import adapters

        if not args.target:
            raise UsageError("%overmind adapters takes the variable that holds the model: "
                             "%overmind adapters model")
        model = self._variable(args.target)
        tokenizer = self._variable(args.tokenizer) if args.tokenizer else None
        if not isinstance(model, adapters.AdapterGate) and not hasattr(model, "peft_config"):
            raise UsageError(f"{args.target} holds an object of type {type(model).__name__}, not a PEFT model or "
                             "an adapter gate: "
                             "%overmind adapters takes the variable of a model loaded with PeftModel.from_pretrained")
        gate = model if isinstance(model, adapters.AdapterGate) else adapters.gate(model)
        if args.json:
            print(json.dumps(gate.state(), indent=1, default=str))
            return None
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
            return self.shell.user_ns[name]  # type: ignore[union-attr]  # a magic runs in a shell
        except KeyError:
            raise UsageError(f"no variable named {name!r} in this kernel") from None


def _without_comment(line: str) -> str:
    """`line` up to a `#` that starts a word outside quotes, as a shell reads a comment: IPython hands a line
    magic the rest of its line, a trailing `# comment` too (`%overmind on  # start the cache`). Quotes as
    `parse_argstring` reads them (IPython's arg_split, a non-POSIX shlex: a quote opens only at a word's
    start, and no backslash escapes)."""
    quote = ""
    for i, char in enumerate(line):
        starts_word = i == 0 or line[i - 1].isspace()
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"" and starts_word:
            quote = char
        elif char == "#" and starts_word:
            return line[:i]
    return line


def _shows_widgets(shell: Any) -> bool:
    """Whether the shell is an ipykernel's, whose frontend can render widgets (a terminal cannot)."""
    return type(shell).__name__ == "ZMQInteractiveShell"


def _display(widget: Any) -> None:
    """Show the widget where the magic ran (it keeps itself live until closed; see widgets/polling.py)."""
    from IPython.display import display

    display(widget)
