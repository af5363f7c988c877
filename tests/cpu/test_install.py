"""`make install`: after `make build`, the user gets a `graphpersist` command from the built runtime wheel.

The verb is run as a user runs it (make, from the repository root), into a fresh venv, with this test's own venv as
the Makefile's tool venv (VENV; `-o` keeps make from re-running its setup there). The command must run the installed
wheel, never the source tree the Makefile puts on PYTHONPATH, and say the wheel's version.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpdist.wheelmeta import WheelName


def make_install(repo_root: Path, dist: Path, venv: Path) -> subprocess.CompletedProcess[str]:
    prefix = Path(sys.prefix)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "PYTHONPATH")}
    cmd = ["make", "-o", f"{prefix}/.ready", "install", f"VENV={prefix}", f"DIST={dist}", f"INSTALL_VENV={venv}"]
    return subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)


def test_make_install_gives_a_graphpersist_command_of_the_wheels_version(
    runtime_wheel: Path, repo_root: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    proc = make_install(repo_root, runtime_wheel.parent, venv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"install: installing {runtime_wheel.name}" in proc.stderr  # it says what it does
    version = WheelName.parse(runtime_wheel.name).version
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    shown = subprocess.run([str(venv / "bin" / "graphpersist"), "--version"], capture_output=True, text=True, env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"graphpersist {version} (archive format "), shown.stdout
    assert shown.stdout.strip() in proc.stdout
    probe = "import importlib.metadata as m, graphpersist; print(m.version('graphpersist'), graphpersist.__file__)"
    installed, where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, env=env, check=True, cwd=tmp_path
    ).stdout.split()
    assert installed == version and Path(where).is_relative_to(venv), (installed, where)
    again = make_install(repo_root, runtime_wheel.parent, venv)  # a second run reuses the venv
    assert again.returncode == 0 and f"install: reusing the venv {venv}" in again.stderr, again.stderr


def test_make_install_without_a_build_says_to_build_first(repo_root: Path, tmp_path: Path) -> None:
    (tmp_path / "dist").mkdir()
    proc = make_install(repo_root, tmp_path / "dist", tmp_path / "venv")
    assert proc.returncode != 0
    assert "holds no graphpersist-" in proc.stderr and "run `make build` first" in proc.stderr, proc.stderr
    assert not (tmp_path / "venv").exists()
