"""`python -m gptools <subcommand>`: the dispatcher. Exit 0 success, 1 finding, 2 misuse."""

from __future__ import annotations

import argparse
import importlib
import sys

from gptools import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gptools",
        description="Patch-series tooling (lint, apply, edit/export, rebase, hooks), offline bundles and proofs.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    from gpdist.fetch import FetchError
    from gptools.apply import PatchApplyError
    from gptools.series import SeriesError

    try:
        return int(args.func(args) or 0)
    except (FetchError, SeriesError, PatchApplyError) as exc:
        print(f"gptools {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gptools: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
