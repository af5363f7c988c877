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
from graphpersist.archive.shown import shown

# Advice: one line after the problems, saying what fixes them. A new SAVE fixes only what differs between the
# archive and this configuration or release (drift, an older format); damage, permissions, a full disk and a
# replace in progress each have their own way out.
ADVICE = "Re-run with mode=save to write a fresh archive."
ADVICE_OTHER_FORMAT = "Use the graphpersist release that wrote it, or re-run with mode=save to write a fresh archive."
ADVICE_OLDER_FORMAT = (
    f"Re-run with mode=save to write it again in format {FORMAT_VERSION} "
    "(LOAD now compares facts that older formats did not record)."
)
ADVICE_DAMAGED = (
    "Its content changed after SAVE wrote it (damage, an edit, a broken copy): copy the archive again from its "
    "source, and check the disk or the transfer that changed it."
)
ADVICE_UNREADABLE = "Make the archive readable by this user (folders listable, files readable), or run as its owner."
ADVICE_INCOMPLETE = "Point at a folder a finished SAVE wrote (manifest.json is written last, once all else is there)."
ADVICE_MISSING = "Check the path; if no SAVE has written this archive yet, run one (mode=save)."
ADVICE_CHANGED = "A SAVE replaced the archive while it was read: let that SAVE finish, then start again."
ADVICE_NO_SPACE = (
    "Free that much space there, or give the SAVE an archive folder on a larger file system, and run the SAVE "
    "again (an archive already in place is untouched)."
)
ADVICE_READ_ONLY = (
    "Give the SAVE an archive folder on a writable file system where this user may create files, and run it again."
)
# The advice for a refusal whose problems are of several kinds: the first kind in this order that occurs.
_ADVICE_BY_KIND = {
    "changed": ADVICE_CHANGED,
    "unreadable": ADVICE_UNREADABLE,
    "no_space": ADVICE_NO_SPACE,
    "read_only": ADVICE_READ_ONLY,
    "missing": ADVICE_MISSING,
    "incomplete": ADVICE_INCOMPLETE,
    "damaged": ADVICE_DAMAGED,
    "absent": ADVICE_DAMAGED,  # a listed file that is not there
}
_CHUNK = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # manifest.json and rank.json are small: a larger one is refused before it is read
# No archive file may be larger: its size is compared with this before a byte of it is read (a sparse file that
# claims terabytes is refused at once, not hashed for minutes or read into memory). The largest real files are the
# JIT caches (jitcache.MAX_BYTES, 4 GiB, refused at SAVE beyond that) and kernel images (megabytes).
MAX_FILE_BYTES = 8 << 30


class Problem(str):
    """One problem line that also knows its kind ("damaged", "unreadable", ...), so the error advises what fixes
    it. It is a str: code that lists or compares problems as text keeps working."""

    kind: str

    def __new__(cls, text: str, kind: str = "damaged") -> Problem:
        obj = super().__new__(cls, text)
        obj.kind = kind
        return obj


def advice_for(problems: list[str]) -> str:
    """The advice for these problems: by the first kind in _ADVICE_BY_KIND's order (plain text counts as damage)."""
    kinds = {getattr(p, "kind", "damaged") for p in problems}
    return next((advice for kind, advice in _ADVICE_BY_KIND.items() if kind in kinds), ADVICE_DAMAGED)


class ArchiveError(Exception):
    """An archive that cannot be written or trusted. The message lists every problem found, then advice.

    Without `advice` the problems' kinds choose it (advice_for); `advice=""` gives none."""

    def __init__(
        self, archive_dir: Path | str, problems: list[str] | str, *, action: str = "open", advice: str | None = None
    ):
        self.root = Path(archive_dir)
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.action = action
        if advice is None:
            advice = advice_for(self.problems)
        self.advice = advice
        head = f"graphpersist: cannot {action} archive {shown(str(self.root))}"
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
    quoted = repr(text)
    return quoted if len(quoted) <= limit else f"{quoted[: limit - 1]}…"


# ---------------------------------------------------------------------------------------------------------
# Reading


def _size_problem(rel: str, entry: FileEntry, size: int) -> str | None:
    """Why a file of `size` bytes cannot be the one the table lists, judged before a byte of it is read."""
    if entry.size > MAX_FILE_BYTES:
        return (
            f"file {_name(rel)}: {MANIFEST_NAME} says {entry.size} bytes, more than an archive file may hold "
            f"({MAX_FILE_BYTES})"
        )
    if size < entry.size:
        return f"truncated file {_name(rel)}: {size} bytes, {MANIFEST_NAME} says {entry.size}"
    if size > entry.size:
        return f"oversized file {_name(rel)}: {size} bytes, {MANIFEST_NAME} says {entry.size}"
    return None


def _content_problem(rel: str, entry: FileEntry, size: int, digest: Any) -> str | None:
    problem = _size_problem(rel, entry, size)
    if problem is not None:
        return problem
    if digest is not None:
        actual = digest()
        if actual != entry.sha256:
            return (
                f"corrupted file {_name(rel)}: sha256 {actual[:16]}…, {MANIFEST_NAME} says {_name(entry.sha256[:16])}…"
            )
    return None
