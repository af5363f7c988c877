"""`python -m gptools <subcommand>`: the dispatcher. Exit 0 success, 1 finding, 2 misuse."""

from __future__ import annotations

import argparse
import importlib
import sys

from gptools import CORE_COMMANDS

# >>> Extension point: modules listed here register their own subcommands through `register(subparsers)`.
# They are imported only if present, so `hooks` and `bundle` can be added by their owners without editing this
# file further. Add new optional subcommand modules to this tuple.
OPTIONAL_COMMANDS = ("gptools.hooks", "gptools.bundle")
# <<< Extension point.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gptools",
        description="Patch-series tooling: lint, apply, edit/export and rebase patches/<engine>/series.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for name in CORE_COMMANDS:
        importlib.import_module(name).register(subparsers)
    for name in OPTIONAL_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # not landed yet
            raise
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("gptools: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
