"""Build the graph-persistence runtime wheel (package graphpersist) from overlays/graphpersist/.

The wheel is written directly (no setuptools run) so that it is reproducible byte for byte, like the engines.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpdist import REPO_ROOT
from gpdist.pins import Pins
from gpdist.wheelmeta import WheelName, record_digest, render_record
from gpdist.wheelzip import ReproducibleZip

SOURCE = REPO_ROOT / "overlays" / "graphpersist"
PACKAGE = SOURCE / "graphpersist"
SKIP_SUFFIXES = (".pyc", ".o", ".so")


def package_files() -> list[Path]:
    """The runtime's files: everything under the package except caches, dotfiles and local build outputs
    (the interposer is compiled on the GPU host from the shipped C sources: graphpersist.region)."""
    if not (PACKAGE / "__init__.py").is_file():
        raise SystemExit(f"gpdist: {PACKAGE}/__init__.py is missing: the runtime package is not there")
    files = []
    for p in PACKAGE.rglob("*"):
        rel = p.relative_to(PACKAGE)
        if not p.is_file() or p.name.endswith(SKIP_SUFFIXES) or any(part.startswith(".") for part in rel.parts):
            continue
        if "__pycache__" in rel.parts or rel.parts[:2] == ("native", "build"):
            continue
        files.append(p)
    return sorted(files)


def metadata(pins: Pins) -> str:
    readme = SOURCE / "README.md"
    major, minor = pins.runtime_python_floor
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {pins.runtime_name}",
        f"Version: {pins.runtime_version}",
        "Summary: Persist captured CUDA graphs of inference engines and restore them on the next start",
        f"Requires-Python: >={major}.{minor}",
        "License: Apache-2.0",
    ]
    if readme.is_file():
        lines.append("Description-Content-Type: text/markdown")
        return "\n".join(lines) + "\n\n" + readme.read_text()
    return "\n".join(lines) + "\n"


def build_runtime(pins: Pins, out_dir: Path) -> Path:
    name = WheelName(pins.runtime_name, pins.runtime_version, "py3-none-any")
    info = name.dist_info
    generated = {
        f"{info}/METADATA": metadata(pins).encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: gpdist\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": b"[console_scripts]\ngraphpersist = graphpersist.cli:main\n",
        f"{info}/top_level.txt": b"graphpersist\n",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / name.filename
    tmp = wheel.with_name(wheel.name + ".partial")
    rows: list[tuple[str, str, str]] = []
    with ReproducibleZip(tmp, pins.source_date_epoch) as out:
        for path in package_files():
            rel = path.relative_to(SOURCE).as_posix()
            data = path.read_bytes()
            out.add_bytes(rel, data, executable=bool(path.stat().st_mode & 0o111))
            rows.append((rel, record_digest(data), str(len(data))))
        for rel, data in generated.items():
            out.add_bytes(rel, data)
            rows.append((rel, record_digest(data), str(len(data))))
        rows.append((f"{info}/RECORD", "", ""))
        out.add_bytes(f"{info}/RECORD", render_record(rows))
    tmp.replace(wheel)
    print(f"gpdist[runtime]: wrote {wheel} ({len(rows) - 1} files)", file=sys.stderr)
    return wheel
