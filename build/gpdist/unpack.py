"""Unpack a pinned upstream wheel into a pristine tree that patches are applied to.

Trees live under .work/ (git-ignored). A tree is reused only when its marker names the same sha256, so a stale
or half-written tree is never patched.
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile
from pathlib import Path

from gpdist import REPO_ROOT
from gpdist.fetch import fetch
from gpdist.pins import Artifact, EnginePin
from gpdist.wheelmeta import WheelName

WORK_DIR = REPO_ROOT / ".work"
MARKER = ".gpdist-unpacked"


def unpack_wheel(wheel: Path, dest: Path, marker: str = "") -> Path:
    """Extract every member of the wheel into dest (replacing it), keeping unix permission bits.

    The tree is written beside dest under a per-process name and renamed into place, so two processes unpacking
    at once (parallel tests, a build beside `make check`) never see each other's half-written tree.
    """
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            target = tmp / info.filename
            if not target.resolve().is_relative_to(tmp.resolve()):
                raise RuntimeError(f"{wheel.name}: member {info.filename} escapes the tree")
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode)
    (tmp / MARKER).write_text(marker)
    old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    try:
        tmp.rename(dest)
    except OSError:
        if not (dest / MARKER).is_file() or (dest / MARKER).read_text() != marker:
            raise
        shutil.rmtree(tmp)  # another process finished the same tree first: use theirs
    shutil.rmtree(old, ignore_errors=True)
    return dest


def tree_name(engine: EnginePin, artifact: Artifact | None = None) -> str:
    """`<engine>-<version>` for the primary wheel; the other wheels of a release add their Python tag."""
    if artifact is None or artifact == engine.wheel:
        return f"{engine.name}-{engine.version}"
    return f"{engine.name}-{engine.version}-{WheelName.parse(artifact.filename).tags.split('-')[0]}"


def upstream_tree(
    engine: EnginePin, offline: bool = False, wheel: Path | None = None, artifact: Artifact | None = None
) -> Path:
    """A pristine unpacked copy of one of the engine's pinned wheels (default: the primary; do not modify it: copy
    first).

    `wheel`: the copy fetch() just returned (verified), so that a build hashes the wheel once; else it is fetched.
    """
    artifact = artifact or engine.wheel
    dest = WORK_DIR / "upstream" / tree_name(engine, artifact)
    marker = dest / MARKER
    if marker.exists() and marker.read_text() == artifact.sha256:
        return dest
    wheel = wheel if wheel is not None else fetch(artifact, offline=offline)
    print(f"gpdist: unpacking {wheel.name}", file=sys.stderr)
    return unpack_wheel(wheel, dest, marker=artifact.sha256)


def tree_files(tree: Path) -> list[str]:
    """Relative POSIX paths of every file in a tree, sorted, without our marker."""
    return sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file() and p.name != MARKER)
