"""Build-time tooling for the patched vLLM/SGLang distribution: series lint/apply, edit/export, rebase, hook-point
check, the product's run-time name resolution (names) and function lengths (funclen), the runtime's Python floor,
offline bundles and the engine-agnostic proof runner (with proofkit for engine drivers, and hostkit for the runtime
recipes' proofs).

Each subcommand lives in its own module that exposes `register(subparsers)`; `python -m gptools` wires them up.
"""

from __future__ import annotations

# Modules that register subcommands, in the order `--help` lists them.
COMMANDS = (
    "gptools.series",
    "gptools.apply",
    "gptools.worktree",
    "gptools.rebase",
    "gptools.hooks",
    "gptools.importgraph",
    "gptools.namelint",
    "gptools.funclen",
    "gptools.pyfloor",
    "gptools.bundle",
    "gptools.install",
    "gptools.prove",
)
