"""Install the wheels `make build` wrote into a venv, so that `graphpersist` is a command a user can run.

`make build` only writes dist/; nothing puts the runtime's CLI (`graphpersist inspect/check/diff/exec`) on a PATH.
`make install` (this module) creates a venv (default .venv-dist) and installs the runtime wheel into it. The runtime
needs nothing beyond the standard library, so that step is offline (--no-index --no-deps). `--engine vllm|sglang`
adds that engine's patched wheel with its dependencies from the package index (torch and the rest: the engine's own
pins, a GPU host's job). Then it runs the venv's `graphpersist --version` and checks it names the wheel's version.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from gpdist.pins import Pins, engine_names
from gpdist.pins import load as load_pins
from gpdist.runtime import wheel_tag
from gpdist.wheelmeta import WheelName


class InstallError(RuntimeError):
    """dist/ lacks a wheel, or the venv could not be made or filled."""


def say(msg: str) -> None:
    print(f"install: {msg}", file=sys.stderr, flush=True)


def runtime_wheel(dist: Path, pins: Pins) -> Path:
    """The runtime wheel `make build` wrote for this machine (a platform wheel: it carries the interposer)."""
    path = dist / WheelName(pins.runtime_name, pins.runtime_version, wheel_tag()).filename
    if not path.is_file():
        raise InstallError(f"{dist} holds no {path.name}: run `make build` first")
    return path


def engine_wheel(dist: Path, pins: Pins, engine: str) -> Path:
    """The patched engine wheel of the pinned release (its tags are upstream's)."""
    pin = pins.engine(engine)
    name = WheelName.parse(pin.wheel.filename).with_version(pins.dist_version(pin.version))
    path = dist / name.filename
    if not path.is_file():
        raise InstallError(f"{dist} holds no {path.name}: run `make build ENGINE={engine}` first")
    return path


def clean_env() -> dict[str, str]:
    """The Makefile puts the source trees on PYTHONPATH: the venv must run what it installed, not the sources."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def run(cmd: list[str], what: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise InstallError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc


def install(dist: Path, venv: Path, *, python: str, engine: str | None = None) -> str:
    """Create (or reuse) `venv`, install the runtime wheel (and an engine's), return `graphpersist --version`."""
    pins = load_pins()
    wheels = [runtime_wheel(dist, pins)]
    if engine:
        wheels.append(engine_wheel(dist, pins, engine))
    py = venv / "bin" / "python"
    if py.is_file():
        say(f"reusing the venv {venv}")
    else:
        say(f"creating the venv {venv} with {python}")
        run([python, "-m", "venv", str(venv)], "creating the venv")
    pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # --force-reinstall: a rebuilt wheel keeps its version, and pip would otherwise keep the old files.
    say(f"installing {wheels[0].name} (standard library only: no index, no dependencies)")
    run([*pip, "--no-index", "--no-deps", "--force-reinstall", str(wheels[0])], "installing the runtime wheel")
    if engine:
        say(f"installing {wheels[1].name} and its dependencies from the package index (torch: several GiB)")
        run([*pip, *map(str, wheels)], f"installing the {engine} wheel")
    version = run([str(venv / "bin" / "graphpersist"), "--version"], "graphpersist --version").stdout.strip()
    want = f"{pins.runtime_name} {WheelName.parse(wheels[0].name).version} "
    if not version.startswith(want):
        raise InstallError(f"{venv}/bin/graphpersist --version says {version!r}, the wheel is {wheels[0].name}")
    return version


def _cmd_install(args: argparse.Namespace) -> int:
    try:
        version = install(Path(args.dist), Path(args.venv), python=args.python, engine=args.engine)
    except InstallError as exc:
        print(f"gptools install: {exc}", file=sys.stderr)
        return 1
    print(version)
    print(f"`graphpersist` is {args.venv}/bin/graphpersist: `source {args.venv}/bin/activate` puts it on the PATH")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `install` subcommand to `python -m gptools`."""
    p = subparsers.add_parser(
        "install",
        help="install the built wheels of dist/ into a venv (the `graphpersist` command)",
        description="Create a venv (or reuse it) and install the runtime wheel from dist/ into it, offline; with "
        "--engine, also that engine's patched wheel and its dependencies from the package index. Checks that the "
        "venv's `graphpersist --version` names the wheel's version. Exit 1 when something is missing or fails.",
    )
    p.add_argument("--dist", default="dist", help="where `make build` wrote the wheels (default dist)")
    p.add_argument("--venv", default=".venv-dist", help="the venv to create or reuse (default .venv-dist)")
    p.add_argument("--python", default="python3", help="the interpreter that creates the venv (default python3)")
    p.add_argument(
        "--engine",
        choices=engine_names(),
        help="also install this engine's wheel with its dependencies (SGLang's wheel is for CPython 3.12: give "
        "--python python3.12, or PYTHON=python3.12 to make)",
    )
    p.set_defaults(func=_cmd_install)
