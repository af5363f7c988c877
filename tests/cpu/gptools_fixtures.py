"""Small fake upstream packages and patch series for the gptools tests, written with git like an author would."""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpdist.pins import EnginePin
from gptools.worktree import CANONICAL_FORMAT, commit_tree_state, git, init_repo

WHY = "The engine needs a seam here so the runtime can hook in."
TRAILERS = "Upstream: not forwarded\nDrop-when: upstream grows the same hook"


def module(name: str, count: int = 12) -> str:
    """A Python module with `count` small functions: enough context lines for several separate hunks."""
    lines = [f'"""{name}: fake upstream module."""', ""]
    for i in range(count):
        lines += ["", f"def {name}_{i}(x):", f"    y = x + {i}", "    return y", ""]
    return "\n".join(lines) + "\n"


def upstream_files() -> dict[str, str]:
    return {
        "fakepkg/__init__.py": '"""fakepkg."""\n',
        "fakepkg/engine.py": module("engine"),
        "fakepkg/config.py": module("config"),
        "fakepkg/utils.py": module("utils", 4),
    }


def write_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


Edit = Callable[[str], str]


@dataclass
class Change:
    """One patch: a subject, a message body, and per-file text edits."""

    subject: str
    edits: dict[str, Edit | str]
    body: str = f"{WHY}\n\n{TRAILERS}"
    author: str = "Pat Author <pat@example.org>"
    date: str = "2026-01-02T03:04:05+01:00"


@dataclass
class SeriesFixture:
    patches_dir: Path
    names: list[str] = field(default_factory=list)


def replace(old: str, new: str) -> Edit:
    def edit(text: str) -> str:
        assert old in text, f"fixture edit: {old!r} not found"
        return text.replace(old, new, 1)

    return edit


def make_series(tmp: Path, upstream: dict[str, str], changes: list[Change], preamble: str = "") -> SeriesFixture:
    """Commit the upstream, then one commit per change, and write them as the canonical patch series."""
    repo = tmp / "authoring"
    init_repo(repo)
    write_tree(repo, upstream)
    commit_tree_state(repo, "upstream", "2000-01-01T00:00:00Z")
    git(repo, "tag", "gp-base")
    for ch in changes:
        for rel, edit in ch.edits.items():
            path = repo / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            old = path.read_text() if path.exists() else ""
            path.write_text(edit(old) if callable(edit) else edit)
        git(repo, "add", "-A")
        name, email = ch.author[: ch.author.index("<")].strip(), ch.author[ch.author.index("<") + 1 : -1]
        env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": ch.date}
        git(repo, "commit", "-q", "-m", f"{ch.subject}\n\n{ch.body}", env=env)
    pdir = tmp / "patches"
    pdir.mkdir()
    git(repo, *CANONICAL_FORMAT, "-o", str(pdir), "gp-base..HEAD")
    names = sorted(p.name for p in pdir.glob("*.patch"))
    (pdir / "series").write_text(preamble + "".join(n + "\n" for n in names))
    return SeriesFixture(pdir, names)


def standard_changes() -> list[Change]:
    """Two patches: one on config.py, one with two hunks on engine.py."""
    return [
        Change(
            "Add a persistence switch to the config",
            {"fakepkg/config.py": replace("y = x + 3\n", "y = x + 3\n    y = hook(y)\n")},
        ),
        Change(
            "Call the runtime around capture",
            {
                "fakepkg/engine.py": lambda t: t.replace(
                    "    y = x + 2\n", "    y = x + 2  # before capture\n", 1
                ).replace("    y = x + 9\n", "    y = x + 9  # after capture\n", 1)
            },
        ),
    ]


def make_wheel(
    path: Path, files: dict[str, str], *, name: str = "fakepkg", version: str, commit: str
) -> tuple[str, int]:
    """A minimal wheel (zip) with dist-info METADATA and a _version.py naming a commit; returns (sha256, size)."""
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in sorted(files.items()):
            zf.writestr(rel, text)
        zf.writestr(f"{name}/_version.py", f"__commit_id__ = commit_id = 'g{commit}'\n")
        zf.writestr(f"{name}/_C.abi3.so", b"\x7fELF\0\0binary")
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Dist: torch==2.12.0\n"
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest(), len(data)


PINS_TEMPLATE = """\
# test pins: comments must survive a rebase
[distribution]
label = "gp"
release = 1
source_date_epoch = 1795996800

[runtime]
name = "graphpersist"
requires_python = ">=3.10"

[engines.fakepkg]
project = "fakepkg"
version = "1.0.0"
python_tag = "py3-none"
# The wheel we patch.
wheel = {{ filename = "{filename}", size = {size}, sha256 = "{sha256}" }}
# The sdist of the same release.
sdist = {{ filename = "fakepkg-1.0.0.tar.gz", size = 10, sha256 = "{zeros}" }}
commit_wheel = "aaaaaaa"
commit_sdist = "bbbbbbb"
requires_torch = "2.11.0"

[engines.other]
project = "other"
version = "9.9"
wheel = {{ filename = "other-9.9-py3-none-any.whl", size = 1, sha256 = "{zeros}" }}
requires_torch = "2.11.0"
"""


def write_pins(path: Path, filename: str, size: int, sha256: str) -> Path:
    path.write_text(PINS_TEMPLATE.format(filename=filename, size=size, sha256=sha256, zeros="0" * 64))
    return path


@dataclass(frozen=True)
class ScratchEngine(EnginePin):
    """A pinned engine or package whose series and overlay live in a scratch folder instead of patches/, overlays/."""

    root: Path = Path()

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "overlay"
