"""Reading an archive: total (any folder gives an Archive or an ArchiveError naming each problem) and verified.

The reader accepts a folder only if the manifest parses and every file matches it, with no file missing or
extra; JSON goes through graphpersist.safejson.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from graphpersist import safejson
from graphpersist.archive_base import (
    ADVICE_OLDER_FORMAT,
    ADVICE_OTHER_FORMAT,
    MAX_RECORD_BYTES,
    ArchiveError,
    _content_problem,
    _entry_of,
    _name,
    _plain,
    _reference_problems,
    archive_path,
)
from graphpersist.archive_side import _missing_root
from graphpersist.manifest import (
    MANIFEST_NAME,
    RANK_DIR,
    RANK_RECORD_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    RankRecord,
    UnsupportedFormat,
    rank_dir,
)


class Archive:
    """A verified archive. read() returns bytes checked against the manifest: those open_archive kept while
    verifying (keep_rank) once without reading or hashing them again, any other read re-checked."""

    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        records: Mapping[int, RankRecord],
        verified: dict[str, bytes] | None = None,
    ) -> None:
        self.root = root
        self.manifest = manifest
        self._records = dict(records)
        self._verified = verified if verified is not None else {}

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.manifest.ranks

    def rank_facts(self, rank: int) -> RankRecord:
        if rank not in self._records:
            raise ArchiveError(self.root, f"it holds no rank {rank} (ranks {list(self.ranks)})", advice="")
        return self._records[rank]

    def names(self, rank: int | None) -> list[str]:
        """Payload names of one rank (or the top level), as add_file() took them."""
        prefix = "" if rank is None else f"{rank_dir(rank)}/"
        out = []
        for rel in self.manifest.files:
            if rank is None and RANK_DIR.fullmatch(rel.split("/", 1)[0]):
                continue
            if rel.startswith(prefix) and rel != f"{prefix}{RANK_RECORD_NAME}":
                out.append(rel.removeprefix(prefix))
        return out

    def file_path(self, rank: int | None, name: str) -> Path:
        """Where a payload file lies, for callers that map it instead of reading it (verify it yourself)."""
        return self.root / self._entry(archive_path(rank, name))[0]

    def read(self, rank: int | None, name: str) -> bytes:
        return self.read_path(archive_path(rank, name))

    def read_json(self, rank: int | None, name: str) -> Any:
        """A payload file's JSON, verified like read(); any text it refuses raises ArchiveError naming the file.

        Parsed by safejson without its per-object checks (payloads can be megabytes): their shape is the caller's.
        """
        rel = archive_path(rank, name)
        try:
            return safejson.loads(self.read_path(rel), strict=False)
        except safejson.JsonError as exc:
            raise ArchiveError(self.root, f"{rel} is not valid JSON: {exc}") from None

    def read_path(self, rel: str) -> bytes:
        """Reads an archive-relative path (as records name them), verified against size and sha256."""
        rel, entry = self._entry(rel)
        kept = self._verified.pop(rel, None)
        if kept is not None:
            return kept
        return _verified_bytes(self.root, rel, entry)

    def _entry(self, rel: str) -> tuple[str, FileEntry]:
        entry = self.manifest.files.get(rel)
        if entry is None:
            raise ArchiveError(self.root, f"it has no file {_name(rel)}", advice="")
        return rel, entry


def open_archive(root: Path | str, *, verify_checksums: bool = True, keep_rank: int | None = None) -> Archive:
    """Opens and verifies an archive; raises ArchiveError listing every problem, never a bare traceback.

    Sizes, presence and unexpected files are always checked, and so is the manifest's own consistency (ranks
    exactly 0 .. world_size-1, each with its record, whose rank matches its folder). verify_checksums=False skips
    hashing every file up front (read() still verifies what it returns; rank records are always verified), for
    callers that read all files anyway. keep_rank=r keeps the bytes of rank r's files and of the shared top-level
    ones as they were hashed, so that rank's LOAD hashes each byte once: the first read() of each returns them (and
    drops them), later ones read and verify again.
    """
    root = Path(os.path.abspath(root))
    try:
        is_dir = stat.S_ISDIR(root.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        raise _missing_root(root) from None
    except OSError as exc:
        raise ArchiveError(root, f"cannot read it: {exc.strerror or exc}") from None
    if not is_dir:
        raise ArchiveError(root, "it is not a directory")
    manifest = _read_manifest(root)

    problems = [f"{MANIFEST_NAME} contradicts itself: {p}" for p in manifest.consistency_problems()]
    kept: dict[str, bytes] = {}
    keep = None
    if keep_rank is not None and verify_checksums:
        own = f"{rank_dir(keep_rank)}/"
        keep = lambda rel: rel.startswith(own) or not RANK_DIR.fullmatch(rel.split("/", 1)[0])  # noqa: E731
    bad_files = dict(_file_problems(root, manifest, verify_checksums, keep, kept))
    problems += bad_files.values()
    records: dict[int, RankRecord] = {}
    for rank in sorted(set(manifest.ranks)):
        rel = f"{rank_dir(rank)}/{RANK_RECORD_NAME}"
        entry = manifest.files.get(rel)
        if entry is None or rel in bad_files:
            continue  # named above (no entry in the file table, or a file that does not match it)
        if entry.size > MAX_RECORD_BYTES:
            problems.append(f"{rel} is {entry.size} bytes, more than a rank record may be ({MAX_RECORD_BYTES})")
            continue
        try:
            record = RankRecord.from_json(_verified_bytes(root, rel, entry))
        except ArchiveError as exc:
            problems += exc.problems
            continue
        except ManifestError as exc:
            problems.append(f"{rel}: {exc}")
            continue
        if record.rank != rank:
            problems.append(f"{rel} says rank {record.rank}, but it lies in the folder of rank {rank}")
        records[rank] = record
    problems += _reference_problems(records, manifest.files)
    if problems:
        raise ArchiveError(root, problems)
    return Archive(root, manifest, records, kept)


def _read_manifest(root: Path) -> Manifest:
    """manifest.json parsed and type-checked, or ArchiveError saying why not (with the advice that fits)."""
    path = root / MANIFEST_NAME
    try:
        info = path.lstat()
        if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_RECORD_BYTES:
            with open(path, "rb") as fh:
                data = fh.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        raise ArchiveError(
            root, f"no {MANIFEST_NAME}: the SAVE did not finish, or this is not a graphpersist archive"
        ) from None
    except OSError as exc:
        raise ArchiveError(root, f"cannot read {MANIFEST_NAME}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ArchiveError(root, f"{MANIFEST_NAME} is not a regular file")
    if info.st_size > MAX_RECORD_BYTES or len(data) > MAX_RECORD_BYTES:
        raise ArchiveError(root, f"{MANIFEST_NAME} is larger than a manifest may be ({MAX_RECORD_BYTES} bytes)")
    try:
        return Manifest.from_json(data)
    except UnsupportedFormat as exc:
        raise ArchiveError(root, str(exc), advice=ADVICE_OLDER_FORMAT if exc.older else ADVICE_OTHER_FORMAT) from None
    except ManifestError as exc:
        raise ArchiveError(root, f"{MANIFEST_NAME} is unreadable: {exc}") from None


def _verified_bytes(root: Path, rel: str, entry: FileEntry) -> bytes:
    """The bytes of one listed file, checked against its size and sha256; ArchiveError when they differ."""
    try:
        data = (root / rel).read_bytes()
    except FileNotFoundError:
        raise ArchiveError(root, f"missing file {_name(rel)} (listed in {MANIFEST_NAME})") from None
    except OSError as exc:
        raise ArchiveError(root, f"cannot read {_name(rel)}: {exc.strerror or exc}") from None
    problem = _content_problem(rel, entry, len(data), lambda: hashlib.sha256(data).hexdigest())
    if problem:
        raise ArchiveError(root, problem)
    return data


def _file_problems(
    root: Path,
    manifest: Manifest,
    verify_checksums: bool,
    keep: Any = None,
    kept: dict[str, bytes] | None = None,
) -> Iterator[tuple[str, str]]:
    """(path, problem) for every listed file that is missing, unsafe, resized or altered, and every extra file.

    Files for which `keep(rel)` is true are read whole and, when they verify, their bytes stored in `kept`.
    """
    for rel, entry in manifest.files.items():
        if not _plain(rel) or rel == MANIFEST_NAME:
            yield rel, f"{MANIFEST_NAME} lists an invalid path {_name(repr(rel))}"
            continue
        problem, size = _listed_file(root, rel)
        data = None
        keep_it = verify_checksums and keep is not None and kept is not None and keep(rel)
        if problem is None and keep_it and size == entry.size:  # read once, hash these bytes, hand them to read()
            try:
                data = (root / rel).read_bytes()
            except OSError as exc:
                problem = f"cannot read {_name(rel)}: {exc.strerror or exc}"
            else:
                size = len(data)
        if problem is None:
            if data is not None:
                digest = lambda d=data: hashlib.sha256(d).hexdigest()  # noqa: E731
            else:
                digest = (lambda p=root / rel: _entry_of(p).sha256) if verify_checksums else None
            try:
                problem = _content_problem(rel, entry, size, digest)
            except OSError as exc:
                problem = f"cannot read {_name(rel)}: {exc.strerror or exc}"
        if problem:
            yield rel, problem
        elif data is not None:
            kept[rel] = data
    for rel, problem in _unlisted(root, manifest.files):
        yield rel, problem


def _listed_file(root: Path, rel: str) -> tuple[str | None, int]:
    """(problem, size) of a listed path: it must be a regular file reached through real folders, no link."""
    path = root
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = path / part
        try:
            info = path.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return f"missing file {_name(rel)} (listed in {MANIFEST_NAME})", 0
        except OSError as exc:
            return f"cannot read {_name(rel)}: {exc.strerror or exc}", 0
        if stat.S_ISLNK(info.st_mode) and i < len(parts) - 1:
            return f"{_name(rel)} is not a regular file ({_name('/'.join(parts[: i + 1]))} is a symbolic link)", 0
    if not stat.S_ISREG(info.st_mode):
        return f"{_name(rel)} is not a regular file", 0
    return None, info.st_size


def _unlisted(root: Path, files: Mapping[str, FileEntry]) -> list[tuple[str, str]]:
    """Everything under `root` that is not a folder, manifest.json or a listed file (links are never followed)."""
    found = []
    folders = [""]
    while folders:  # a loop, not recursion: the tree may be as deep as paths allow
        folder = folders.pop()
        try:
            with os.scandir(root / folder) as it:
                entries = list(it)
        except OSError as exc:
            found.append((folder, f"cannot list folder {_name(folder or '.')}: {exc.strerror or exc}"))
            continue
        for entry in entries:
            rel = f"{folder}/{entry.name}" if folder else entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                folders.append(rel)
            elif rel != MANIFEST_NAME and rel not in files:
                found.append((rel, f"unexpected file {_name(rel)} (not listed in {MANIFEST_NAME})"))
    return sorted(found)
