"""Check that the runtime package needs no Python newer than the floor its wheel declares.

build/pins.toml `[runtime] requires_python` is the one place the floor lives: gpdist writes the runtime wheel's
Requires-Python from it and this check reads it too. Two checks, both against that floor:

- vermin (pinned in requirements-dev.txt) names every standard-library module, member, keyword argument and syntax
  the package uses that is newer than the floor (datetime.UTC, tomllib, typing.Self, enum.StrEnum, except*, ...);
- ruff lints the runtime with `per-file-target-version` (pyproject.toml), which flags newer syntax and stops fixes
  that need a newer Python; this check makes sure that setting names the same floor.

The CPU test tests/cpu/test_python_versions.py then imports the built wheel on the oldest and newest CPython found.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

from gpdist import REPO_ROOT

RUNTIME = REPO_ROOT / "overlays" / "graphpersist" / "graphpersist"
RUFF_KEY = "overlays/graphpersist/**"
# vermin takes `bytes.decode(errors=...)` for Python 2's `str.decode(errors)` when it cannot tell the type, and then
# gives up on the whole file ("versions could not be combined"): excluded so that such files are still checked.
VERMIN_EXCLUDES = ("str.decode(errors)",)


def vermin_command(floor: tuple[int, int], paths: list[Path]) -> list[str]:
    args = [f"-t={floor[0]}.{floor[1]}-", "--no-tips", "--violations", "--eval-annotations"]
    for name in VERMIN_EXCLUDES:
        args += ["--exclude", name]
    return [sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())", *args, *map(str, paths)]


def vermin_findings(floor: tuple[int, int], paths: list[Path]) -> list[str]:
    """vermin's violation lines; a file it cannot parse or cannot conclude on is a finding too (fail closed)."""
    proc = subprocess.run(vermin_command(floor, paths), capture_output=True, text=True)
    lines = [line.rstrip() for line in (proc.stdout + proc.stderr).splitlines()]
    inconclusive = any("File with incompatible versions" in line or " error: " in line for line in lines)
    if proc.returncode == 0 and not inconclusive:
        return []
    return [f"vermin: {line}" for line in lines if line.strip() and not line.startswith(("Detecting", "Analyzing"))]


def ruff_findings(floor: tuple[int, int], pyproject: Path) -> list[str]:
    want = f"py{floor[0]}{floor[1]}"
    with pyproject.open("rb") as f:
        got = tomllib.load(f).get("tool", {}).get("ruff", {}).get("per-file-target-version", {}).get(RUFF_KEY)
    if got == want:
        return []
    return [
        f'{pyproject.name}: [tool.ruff.per-file-target-version] "{RUFF_KEY}" is {got!r}, but build/pins.toml '
        f'says the runtime supports Python {floor[0]}.{floor[1]}: set it to "{want}"'
    ]


def _cmd_pyfloor(args: argparse.Namespace) -> int:
    from gpdist.pins import load

    floor = load().runtime_python_floor
    if importlib.util.find_spec("vermin") is None:
        print("gptools pyfloor: vermin is not installed in this Python: run `make setup`", file=sys.stderr)
        return 2
    paths = [Path(p) for p in args.paths] or [RUNTIME]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"gptools pyfloor: no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    findings = ruff_findings(floor, REPO_ROOT / "pyproject.toml") + vermin_findings(floor, paths)
    where = ", ".join(str(p) for p in paths)
    if findings:
        print(f"gptools pyfloor: {where} is not shown to run on Python {floor[0]}.{floor[1]} (build/pins.toml):")
        for line in findings:
            print(f"  {line}")
        print(
            f"Use only what Python {floor[0]}.{floor[1]} has (e.g. datetime.timezone.utc, not datetime.UTC), "
            "or raise the floor in build/pins.toml if the engines no longer support it."
        )
        return 1
    print(f"gptools pyfloor: {where} runs on Python >={floor[0]}.{floor[1]} (vermin, ruff target)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `pyfloor` subcommand to `python -m gptools`."""
    p = subparsers.add_parser(
        "pyfloor",
        help="check that the runtime needs no Python newer than its Requires-Python (build/pins.toml)",
        description="Run vermin over the runtime package with the floor of build/pins.toml [runtime] "
        "requires_python as target, and check that ruff's per-file target version for the runtime is that floor. "
        "Exit 1 on a finding, 2 when vermin is missing.",
    )
    p.add_argument("paths", nargs="*", help="files or folders to check (default: the runtime package)")
    p.set_defaults(func=_cmd_pyfloor)
