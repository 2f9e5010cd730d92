"""`python -m overmind_jupyter.warm install|uninstall|status`: the warm kernelspec from the command line.

    python -m overmind_jupyter.warm install [--name overmind-warm] [--preload torch,transformers]
                                            [--display-name NAME] [--user | --sys-prefix | --prefix DIR]
    python -m overmind_jupyter.warm uninstall [--name overmind-warm]
"""

from __future__ import annotations

import argparse
import sys

from .kernelspec import DEFAULT_NAME, install, uninstall
from .zygote import DEFAULT_PRELOAD


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overmind_jupyter.warm",
                                     description="Kernels that start with torch and transformers already imported.")
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("install", help="install the warm kernelspec")
    add.add_argument("--name", default=DEFAULT_NAME)
    add.add_argument("--display-name", default=None)
    add.add_argument("--preload", default=",".join(DEFAULT_PRELOAD),
                     help="comma-separated modules the spare imports (default: %(default)s)")
    where = add.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user (the default)")
    where.add_argument("--sys-prefix", action="store_true", help=f"into this environment ({sys.prefix})")
    where.add_argument("--prefix", default=None, help="into PREFIX/share/jupyter/kernels")
    remove = commands.add_parser("uninstall", help="remove the warm kernelspec")
    remove.add_argument("--name", default=DEFAULT_NAME)
    args = parser.parse_args(argv)
    if args.command == "install":
        prefix = sys.prefix if args.sys_prefix else args.prefix
        preload = [m.strip() for m in args.preload.split(",") if m.strip()]
        path = install(args.name, preload=preload, display_name=args.display_name, user=prefix is None,
                       prefix=prefix)
        print(f"Installed kernelspec {args.name} in {path} (preloads {', '.join(preload) or 'nothing'})")
        return 0
    try:
        path = uninstall(args.name)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    print(f"Removed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
