"""Patch-series tooling for the patched vLLM/SGLang distribution: lint, apply, edit/export, rebase.

Each subcommand lives in its own module that exposes `register(subparsers)`; `python -m gptools` wires them up.
"""

from __future__ import annotations

# Modules that register subcommands, in the order `--help` lists them. Optional modules are skipped when absent
# so helpers can land them independently (see __main__.OPTIONAL_COMMANDS).
CORE_COMMANDS = ("gptools.series", "gptools.apply", "gptools.worktree", "gptools.rebase")
