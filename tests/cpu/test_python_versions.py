"""The runtime wheel works on every Python it declares: its floor (build/pins.toml) and the newest one here.

vLLM 0.26.0 runs on CPython 3.10-3.14 and SGLang 0.5.17 on 3.12, and both require the graphpersist wheel, so the
runtime must import on the oldest of those. `make check` checks that statically (gptools pyfloor: vermin and
ruff's target version); these tests install the built wheel into a fresh venv of the oldest and the newest CPython
that pyenv has on this machine and run it there. The runtime needs nothing outside the standard library to import,
so the wheel is installed with --no-deps --no-index. api.py needs torch, which those interpreters lack: it is
byte-compiled there instead, like every other module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpdist.pins import Pins
from gpdist.pins import load as load_pins
from gpdist.runtime import build_runtime
from gptools import pyfloor

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "archive_fixtures.py"
# These import torch at module level: without torch they are byte-compiled, not imported. (graphpersist.api binds
# their names on first use, so it imports without torch.)
NEEDS_TORCH = ("load", "save", "memory.setup", "memory.tensors")


def pyenv_roots() -> list[Path]:
    roots = [Path(os.environ["PYENV_ROOT"])] if os.environ.get("PYENV_ROOT") else []
    if shutil.which("pyenv"):
        proc = subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            roots.append(Path(proc.stdout.strip()))
    roots += [Path.home() / ".pyenv", Path("/root/.pyenv")]
    return list(dict.fromkeys(roots))


def pyenv_pythons(roots: list[Path]) -> dict[tuple[int, int], Path]:
    """CPython X.Y -> its newest patch release's python3 under pyenv's versions/."""
    found: dict[tuple[int, int], tuple[int, Path]] = {}
    for root in roots:
        for exe in (root / "versions").glob("*/bin/python3"):
            match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", exe.parent.parent.name)
            if not match or not os.access(exe, os.X_OK):
                continue
            minor, patch = (int(match[1]), int(match[2])), int(match[3])
            if minor not in found or found[minor][0] < patch:
                found[minor] = (patch, exe)
    return {minor: exe for minor, (_, exe) in sorted(found.items())}


FLOOR = load_pins().runtime_python_floor
ROOTS = pyenv_roots()
PYTHONS = pyenv_pythons(ROOTS)
WHERE = ", ".join(str(r / "versions") for r in ROOTS)


def _targets() -> list[object]:
    floor = ".".join(map(str, FLOOR))
    newer = [minor for minor in PYTHONS if minor > FLOOR]
    oldest = PYTHONS.get(FLOOR)
    newest = PYTHONS[newer[-1]] if newer else None
    skip_old = pytest.mark.skip(
        reason=f"no CPython {floor} (the runtime's floor, build/pins.toml) under {WHERE}: NOT RUN"
    )
    skip_new = pytest.mark.skip(reason=f"no CPython newer than {floor} under {WHERE}: NOT RUN")
    return [
        pytest.param(oldest, id=f"oldest-{floor}", marks=() if oldest else skip_old),
        pytest.param(
            newest,
            id=f"newest-{'.'.join(map(str, newer[-1]))}" if newer else "newest",
            marks=() if newest else skip_new,
        ),
    ]


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH: the installed wheel must be what runs, never the source tree."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.mark.parametrize("python", _targets())
def test_the_runtime_wheel_installs_imports_and_runs(
    runtime_wheel: Path, python: Path, pins: Pins, tmp_path: Path
) -> None:
    env = _clean_env()
    venv = tmp_path / "venv"
    subprocess.run([str(python), "-m", "venv", str(venv)], check=True, env=env)
    py = venv / "bin" / "python"
    install = [str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--disable-pip-version-check"]
    subprocess.run([*install, str(runtime_wheel)], check=True, env=env, capture_output=True, text=True)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(py), *args], capture_output=True, text=True, env=env, cwd=tmp_path)

    with zipfile.ZipFile(runtime_wheel) as zf:
        files = sorted(n for n in zf.namelist() if re.fullmatch(r"graphpersist/(\w+/)*\w+\.py", n))
    # dotted module names under graphpersist ("archive" for archive/__init__.py, "memory.region", ...)
    modules = [n.removeprefix("graphpersist/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
               for n in files]  # fmt: skip
    expected = {"archive", "archive.manifest", "archive.validate", "archive.liveenv", "cli", "engine", *NEEDS_TORCH}
    assert expected <= set(modules), modules
    importable = [f"graphpersist.{m}" for m in modules if m not in ("__init__", "__main__", *NEEDS_TORCH)]
    probe = "import sys, graphpersist, " + ", ".join(importable)
    proc = run("-c", probe + "; print('%d.%d' % sys.version_info[:2], graphpersist.__file__)")
    assert proc.returncode == 0, proc.stderr
    version, init = proc.stdout.split()
    assert Path(init).is_relative_to(venv), f"imported the sources, not the wheel: {init}"
    assert version == python.parent.parent.name.rsplit(".", 1)[0]
    # Every module, the torch ones too, byte-compiles under this interpreter.
    package = Path(init).parent
    compiled = run("-m", "py_compile", *(str(package.parent / f) for f in files))
    assert compiled.returncode == 0, compiled.stderr
    for module in NEEDS_TORCH:  # if one imported without torch, it would belong with the imports above
        assert "No module named 'torch'" in run("-c", f"import graphpersist.{module}").stderr

    cli = run("-m", "graphpersist", "--version")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(f"graphpersist {pins.runtime_version} (archive format "), cli.stdout
    # An archive written by this interpreter's graphpersist (the manifest records the Python that wrote it), read back.
    archive = tmp_path / "archive"
    wrote = subprocess.run(
        [str(py), str(FIXTURES), str(archive)], capture_output=True, text=True, env=env, cwd=FIXTURES.parent
    )
    assert wrote.returncode == 0, wrote.stderr
    shown = run("-m", "graphpersist", "inspect", str(archive))
    assert shown.returncode == 0, shown.stderr
    assert f"by graphpersist {pins.runtime_version} (python {version}." in shown.stdout, shown.stdout
    assert "parallel    world 2: tp 2, pp 1, ep 1" in shown.stdout
    data = json.loads(run("-m", "graphpersist", "inspect", "--json", str(archive)).stdout)
    assert sorted(data["ranks"]) == ["0", "1"]


def test_the_runtime_wheel_declares_the_floor_of_pins_toml(pins: Pins, tmp_path: Path) -> None:
    wheel = build_runtime(pins, tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"{pins.runtime_name}-{pins.runtime_version}.dist-info/METADATA").decode()
    assert f"Requires-Python: >={FLOOR[0]}.{FLOOR[1]}\n" in metadata
    with pytest.raises(SystemExit, match=r"MAJOR\.MINOR"):
        dataclasses.replace(pins, runtime_requires_python=">=3.10,<4").runtime_python_floor  # noqa: B018


def _pyfloor(*paths: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("build", "tools"))}
    return subprocess.run(
        [sys.executable, "-m", "gptools", "pyfloor", *map(str, paths)], capture_output=True, text=True, env=env
    )


def test_pyfloor_passes_the_runtime_and_names_what_needs_a_newer_python(tmp_path: Path) -> None:
    ok = _pyfloor()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"runs on Python >={FLOOR[0]}.{FLOOR[1]}" in ok.stdout
    newer = tmp_path / "newer.py"
    newer.write_text(
        "from datetime import UTC, datetime\nfrom typing import Self\n\n\ndef now() -> str:\n"
        "    return datetime.now(UTC).isoformat()\n"
    )
    bad = _pyfloor(newer)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "'datetime.UTC' member requires !2, 3.11" in bad.stdout and "'typing.Self'" in bad.stdout
    assert str(newer) in bad.stdout
    missing = _pyfloor(tmp_path / "absent.py")
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr


def test_pyfloor_wants_ruffs_runtime_target_to_be_the_same_floor() -> None:
    assert pyfloor.ruff_findings(FLOOR, REPO / "pyproject.toml") == []
    [finding] = pyfloor.ruff_findings((FLOOR[0], FLOOR[1] + 1), REPO / "pyproject.toml")
    assert f'set it to "py{FLOOR[0]}{FLOOR[1] + 1}"' in finding
