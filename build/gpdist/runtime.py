"""Build the graph-persistence runtime wheel (package graphpersist) from overlays/graphpersist/.

The wheel is written directly (no setuptools run) so that it is reproducible byte for byte, like the engines. It is
a platform wheel: it carries the interposer compiled here (native/build.sh: gcc only, fixed flags, no build id), so a
serving host needs neither a compiler nor CUDA headers; the C sources ship too, for the fallback build.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from gpdist import REPO_ROOT
from gpdist.pins import Pins
from gpdist.wheelmeta import WheelName, record_digest, render_record
from gpdist.wheelzip import ReproducibleZip

SOURCE = REPO_ROOT / "overlays" / "graphpersist"
PACKAGE = SOURCE / "graphpersist"
SKIP_SUFFIXES = (".pyc", ".o", ".so")
# The prebuilt interposer needs nothing newer than glibc 2.28 (native/gp_glibc.h; tests/cpu/test_native.py checks).
PLATFORM_TAGS = {"x86_64": "manylinux_2_28_x86_64", "aarch64": "manylinux_2_28_aarch64"}


def package_files() -> list[Path]:
    """The runtime's files: everything under the package except caches, dotfiles and local build outputs
    (native/build, native/prebuilt: the wheel's own build of the interposer is added by build_runtime)."""
    if not (PACKAGE / "__init__.py").is_file():
        raise SystemExit(f"gpdist: {PACKAGE}/__init__.py is missing: the runtime package is not there")
    files = []
    for p in PACKAGE.rglob("*"):
        rel = p.relative_to(PACKAGE)
        if not p.is_file() or p.name.endswith(SKIP_SUFFIXES) or any(part.startswith(".") for part in rel.parts):
            continue
        if "__pycache__" in rel.parts or rel.parts[:2] in (("native", "build"), ("native", "prebuilt")):
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


def wheel_tag() -> str:
    machine = platform.machine()
    if machine not in PLATFORM_TAGS:
        raise SystemExit(f"gpdist: no manylinux tag known for {machine}: build the runtime on x86_64 or aarch64")
    return f"py3-none-{PLATFORM_TAGS[machine]}"


def build_interposer() -> tuple[bytes, str]:
    """The interposer compiled from the package's sources, and the digest of those sources (region.py loads the
    prebuilt library only when the sources beside it still have that digest)."""
    sys.path.insert(0, str(SOURCE))
    try:
        from graphpersist.memory import region
    finally:
        sys.path.remove(str(SOURCE))
    with tempfile.TemporaryDirectory(prefix="gpdist-native-") as tmp:
        proc = subprocess.run(["sh", str(PACKAGE / "native" / "build.sh"), tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"gpdist: building the interposer failed (gcc is needed):\n{proc.stdout}{proc.stderr}")
        return (Path(tmp) / region.LIB_NAME).read_bytes(), region.sources_digest()


def build_runtime(pins: Pins, out_dir: Path) -> Path:
    tag = wheel_tag()
    name = WheelName(pins.runtime_name, pins.runtime_version, tag)
    info = name.dist_info
    lib, digest = build_interposer()
    generated = {
        "graphpersist/native/prebuilt/libgpinterpose.so": lib,
        "graphpersist/native/prebuilt/SOURCES.sha256": f"{digest}\n".encode(),
        f"{info}/METADATA": metadata(pins).encode(),
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: gpdist\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(),
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
