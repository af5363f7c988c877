"""What the archive's writer and reader share: the error type, its advice, payload paths, content checks.

See graphpersist.archive for the archive as a whole (writing is in archive_write, reading in archive_read, the
staging/trash folders next to an archive in archive_side).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from graphpersist.archive.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    RANK_DIR,
    RANK_RECORD_NAME,
    FileEntry,
    RankRecord,
    rank_dir,
)

ADVICE = "Re-run with mode=save to write a fresh archive."
ADVICE_OTHER_FORMAT = "Use the graphpersist release that wrote it, or re-run with mode=save to write a fresh archive."
ADVICE_OLDER_FORMAT = (
    f"Re-run with mode=save to write it again in format {FORMAT_VERSION} "
    "(LOAD now compares facts that older formats did not record)."
)
_CHUNK = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # manifest.json and rank.json are small: a larger one is refused before it is read


class ArchiveError(Exception):
    """An archive that cannot be written or trusted. The message lists every problem found, then advice."""

    def __init__(self, root: Path | str, problems: list[str] | str, *, action: str = "open", advice: str = ADVICE):
        self.root = Path(root)
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.action = action
        head = f"graphpersist: cannot {action} archive {self.root}"
        if len(self.problems) == 1:
            lines = [f"{head}: {self.problems[0]}"]
        else:
            lines = [f"{head}: {len(self.problems)} problems", *(f"  {p}" for p in self.problems)]
        if advice:
            lines.append(advice)
        super().__init__("\n".join(lines))


def _plain(rel: str) -> bool:
    """True for a relative posix path that cannot escape the archive or alias another name."""
    parts = PurePosixPath(rel).parts
    return (
        bool(rel)
        and "\\" not in rel
        and "\0" not in rel
        and not rel.startswith("/")
        and not any(p in (".", "..") for p in parts)
        and rel == str(PurePosixPath(*parts))
    )


def archive_path(rank: int | None, name: str) -> str:
    """The archive-relative posix path of a payload file: `name` at the top, or under `rank_<rank>/`."""
    if not _plain(name):
        raise ValueError(f"file name {name!r} must be a plain relative path (no '..', '.', '//', '\\' or leading '/')")
    if rank is None:
        if name == MANIFEST_NAME or RANK_DIR.fullmatch(PurePosixPath(name).parts[0]):
            raise ValueError(f"file name {name!r} is reserved at the top of an archive")
        return name
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer or None, got {rank!r}")
    if name == RANK_RECORD_NAME:
        raise ValueError(f"{RANK_RECORD_NAME} is written by set_rank_facts(), not add_file()")
    return f"{rank_dir(rank)}/{name}"


def _entry_of(path: Path) -> FileEntry:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(sha256=digest.hexdigest(), size=size)


def _reference_problems(records: Mapping[int, RankRecord], files: Mapping[str, FileEntry]) -> list[str]:
    """Files and images that rank records name but the archive lacks: caught at SAVE, not at a later LOAD."""
    problems = []
    for rank, record in sorted(records.items()):
        hashes = {image.sha256 for image in record.images}
        for image in record.images:
            sha, file = _name(image.sha256[:12]), _name(image.file)
            if image.file not in files:
                problems.append(f"rank {rank}: image {sha} names missing file {file}")
            elif files[image.file].sha256 != image.sha256:
                problems.append(f"rank {rank}: image file {file} does not hash to {sha}")
        for graph in record.graphs:
            if graph.file not in files:
                problems.append(f"rank {rank}: graph {_name(graph.name)} names missing file {_name(graph.file)}")
            problems += [
                f"rank {rank}: graph {_name(graph.name)} uses image {_name(h[:12])} that rank {rank} does not list"
                for h in graph.images
                if h not in hashes
            ]
    return problems


def _name(text: str, limit: int = 200) -> str:
    """A name from an archive as messages show it: as is when short and printable, else quoted and clipped."""
    if len(text) <= limit and text.isprintable():
        return text
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[: limit - 1]}…"


# ---------------------------------------------------------------------------------------------------------
# Reading


def _content_problem(rel: str, entry: FileEntry, size: int, digest: Any) -> str | None:
    if size < entry.size:
        return f"truncated file {_name(rel)}: {size} bytes, {MANIFEST_NAME} says {entry.size}"
    if size > entry.size:
        return f"oversized file {_name(rel)}: {size} bytes, {MANIFEST_NAME} says {entry.size}"
    if digest is not None:
        actual = digest()
        if actual != entry.sha256:
            return (
                f"corrupted file {_name(rel)}: sha256 {actual[:16]}…, {MANIFEST_NAME} says {_name(entry.sha256[:16])}…"
            )
    return None
