"""The command line every source lint of `make check` shares (imports, names, funclen): one subcommand, its help,
the description from its module's docstring, `--json` for machines; exit 0 clean, 1 on a finding."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register_lint(
    subparsers: argparse._SubParsersAction, name: str, help_text: str, module_doc: str | None,
    run: Callable[[argparse.Namespace], int]
) -> None:  # fmt: skip
    """Add lint `name` to `python -m gptools`: its description is the second paragraph of `module_doc`."""
    p = subparsers.add_parser(name, help=help_text, description=(module_doc or "").split("\n\n")[1].replace("\n", " "))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
