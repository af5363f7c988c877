"""Reading an archive: total (any folder gives an Archive or an ArchiveError naming each problem) and verified.

The reader accepts a folder only if the manifest parses and every file matches it, with no file missing or
extra; JSON goes through graphpersist.archive.safejson.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from graphpersist.archive import codec, safejson
from graphpersist.archive import digests as archive_digests
from graphpersist.archive.base import (
    _CHUNK,
    ADVICE_OLDER_FORMAT,
    ADVICE_OTHER_FORMAT,
    MAX_RECORD_BYTES,
    ArchiveError,
    Problem,
    _content_problem,
    _name,
    _plain,
    _reference_problems,
    _size_problem,
    archive_path,
)
from graphpersist.archive.manifest import (
    IMAGES_DIR,
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
from graphpersist.archive.side import _missing_root


class Archive:
    """A verified archive. read() returns bytes checked against the manifest: those open_archive kept while
    verifying (keep_rank) once without reading or hashing them again, any other read re-checked."""

    def __init__(
        self,
        archive_dir: Path,
        manifest: Manifest,
        records: Mapping[int, RankRecord],
        verified: dict[str, bytes] | None = None,
        identity: tuple[int, ...] | None = None,
    ) -> None:
        self.root = archive_dir
        self.manifest = manifest
        self._records = dict(records)
        self._verified = verified if verified is not None else {}
        self._identity = identity

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.manifest.ranks

    def unchanged(self) -> bool:
        """Whether the folder still holds the archive that was opened (False where a SAVE replaced it or its manifest
        was rewritten since, or the open did not note what it read)."""
        return self._identity is not None and _identity(self.root) == self._identity

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
        try:
            return _verified_bytes(self.root, rel, entry)
        except ArchiveError as exc:
            if self._identity is not None and _identity(self.root) != self._identity:
                replaced = f"it was replaced after it was opened (reading {_name(rel)}: {exc.problems[0]})"
                raise ArchiveError(self.root, Problem(replaced, "changed")) from None
            raise

    def _entry(self, rel: str) -> tuple[str, FileEntry]:
        entry = self.manifest.files.get(rel)
        if entry is None:
            raise ArchiveError(self.root, f"it has no file {_name(rel)}", advice="")
        return rel, entry


_WORKERS = min(8, os.cpu_count() or 1)  # threads that read and hash an archive's files
_INLINE_BYTES = 4 << 20  # below this an archive is checked in the calling thread


class _Inline:
    """An executor that runs each task when it is submitted, in the calling thread."""

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def open_archive(archive_dir: Path | str, *, verify_checksums: bool = True, keep_rank: int | None = None) -> Archive:
    """Opens and verifies an archive; raises ArchiveError listing every problem, never a bare traceback.

    Sizes, presence and unexpected files are always checked, and so is the manifest's own consistency (ranks
    exactly 0 .. world_size-1, each with its record, whose rank matches its folder) and what the records commit to
    (graphpersist.archive.digests). verify_checksums=False skips
    hashing every file up front (read() still verifies what it returns; rank records are always verified), for
    callers that read all files anyway. keep_rank=r (a rank's LOAD) hashes only rank r's files, the kernel images
    (`images/`, shared by the ranks) and every rank record (other ranks' payloads and the other shared top-level
    files are checked for presence and size: each rank verifies its own, and a shared file is verified when it is
    read, e.g. by read_shared before LOAD) and keeps the
    bytes it hashed, so that rank hashes each byte once: the first read() of each returns them (and drops them),
    later ones read and verify again.

    An archive that a SAVE replaces while it is read (its folder or manifest.json is another one at the end than
    at the start) is read once more; when it changes during that read too, the error says so.
    """
    for _attempt in range(2):
        archive_dir = _archive_root(archive_dir)
        before = _identity(archive_dir)
        try:
            archive = _open_once(archive_dir, verify_checksums, keep_rank, before)
        except ArchiveError:
            if _identity(archive_dir) == before:
                raise
            continue  # replaced while read: the problems were the old and the new archive mixed
        if _identity(archive_dir) == before:
            return archive
    raise ArchiveError(
        archive_dir, Problem("it changed while it was read, twice: a SAVE is replacing it right now", "changed")
    )


def _identity(archive_dir: Path) -> tuple[int, ...]:
    """What changes when an archive is replaced (a SAVE renames a new folder into place) or its manifest rewritten:
    the folder's and manifest.json's device and inode, and manifest.json's size and times (() when unreadable)."""
    try:
        folder = os.stat(archive_dir)
        manifest = os.lstat(archive_dir / MANIFEST_NAME)
    except OSError:
        return ()
    return (folder.st_dev, folder.st_ino, manifest.st_ino, manifest.st_size, manifest.st_mtime_ns,
            manifest.st_ctime_ns)  # fmt: skip


def _open_once(archive_dir: Path, verify_checksums: bool, keep_rank: int | None, identity: tuple[int, ...]) -> Archive:
    manifest, manifest_doc = _read_manifest(archive_dir)

    problems = [f"{MANIFEST_NAME} contradicts itself: {p}" for p in manifest.consistency_problems()]
    own = None if keep_rank is None or not verify_checksums else f"{rank_dir(keep_rank)}/"

    def keep(rel: str) -> bool:  # keep_rank's files, and the kernel images (the ranks share them)
        return own is not None and (rel.startswith(own) or rel.startswith(f"{IMAGES_DIR}/"))

    record_files = {f"{rank_dir(rank)}/{RANK_RECORD_NAME}": rank for rank in sorted(set(manifest.ranks))}
    kept: dict[str, bytes] = {}
    records: dict[int, RankRecord] = {}
    docs: dict[int, dict[str, Any]] = {}  # the records as read: what their digests cover
    record_problems: list[str] = []
    # Every listed file is checked in a thread pool (reading and hashing release the GIL), biggest first, while
    # this thread parses the rank records as soon as their own files are verified; a small archive in this thread
    # (starting threads would cost more than its hashing).
    small = sum(min(e.size, MAX_RECORD_BYTES) for e in manifest.files.values()) < _INLINE_BYTES
    workers = 1 if small else max(1, min(_WORKERS, len(manifest.files)))
    with _Inline() if small else ThreadPoolExecutor(max_workers=workers) as pool:
        checks = {}
        for rel, entry in sorted(manifest.files.items(), key=lambda kv: -kv[1].size):
            is_record = rel in record_files and entry.size <= MAX_RECORD_BYTES  # a record is always hashed
            # With keep_rank, other ranks' payloads are that rank's to verify (their reads here still are): at TP=8
            # each rank would otherwise hash the whole archive.
            hash_it = is_record or (verify_checksums and (own is None or keep(rel)))
            checks[rel] = pool.submit(_check_listed, archive_dir, rel, entry, hash_it, is_record or keep(rel))
        unlisted = pool.submit(_unlisted, archive_dir, manifest.files)
        for rel, rank in record_files.items():
            entry = manifest.files.get(rel)
            if entry is None:
                continue  # named by the consistency check (no entry in the file table)
            if entry.size > MAX_RECORD_BYTES:
                record_problems.append(
                    f"{rel} is {entry.size} bytes, more than a rank record may be ({MAX_RECORD_BYTES})"
                )
                continue
            problem, data = checks[rel].result()
            if problem is not None:
                continue  # named with the file problems
            try:
                record, docs[rank] = codec.parsed(RankRecord, data)
            except ManifestError as exc:
                record_problems.append(f"{rel}: {exc}")
                continue
            if record.rank != rank:
                record_problems.append(f"{rel} says rank {record.rank}, but it lies in the folder of rank {rank}")
            records[rank] = record
        for rel in manifest.files:  # in the file table's order
            problem, data = checks[rel].result()
            if problem is not None:
                problems.append(problem)
            elif data is not None and keep(rel):
                kept[rel] = data
        problems += [problem for _rel, problem in unlisted.result()]
    problems += record_problems
    problems += _reference_problems(records, manifest.files)
    # A rank's LOAD relies on its own record and on rank 0's (which commits to the manifest and the shared files).
    check = None if keep_rank is None else {keep_rank, 0}
    problems += archive_digests.problems(records, manifest.files, manifest_doc, check, docs)
    if problems:
        raise ArchiveError(archive_dir, problems)
    return Archive(archive_dir, manifest, records, kept, identity)


def read_shared(archive_dir: Path | str, name: str) -> bytes | None:
    """One shared top-level file, verified against the manifest without hashing the rest; None when not listed.

    For what an engine needs before its LOAD proper, such as the JIT caches it restores before anything compiles:
    that LOAD opens and verifies the archive again (open_archive), reading the manifest costs little. Rank 0's record,
    which commits to the manifest and the shared files (archive_digests), is read and its commitments checked too.
    """
    archive_dir = _archive_root(archive_dir)
    rel = archive_path(None, name)
    manifest, manifest_doc = _read_manifest(archive_dir)
    entry = manifest.files.get(rel)
    if entry is None:
        return None
    problem, _ = _listed_file(archive_dir, rel)
    if problem is not None:
        raise ArchiveError(archive_dir, problem)
    record_rel = f"{rank_dir(0)}/{RANK_RECORD_NAME}"
    record_entry = manifest.files.get(record_rel)
    if record_entry is None or record_entry.size > MAX_RECORD_BYTES:
        raise ArchiveError(
            archive_dir, f"{record_rel}, which commits to {_name(rel)}, is not listed or larger than it may be"
        )
    try:
        record, doc = codec.parsed(RankRecord, _verified_bytes(archive_dir, record_rel, record_entry))
    except ManifestError as exc:
        raise ArchiveError(archive_dir, f"{record_rel}: {exc}") from None
    owned = {k: v for k, v in manifest.files.items() if archive_digests.owned(k, 0)}
    found = archive_digests.problems({0: record}, owned, manifest_doc, docs={0: doc})
    if found:
        raise ArchiveError(archive_dir, found)
    return _verified_bytes(archive_dir, rel, entry)


def _archive_root(archive_dir: Path | str) -> Path:
    """The archive folder as an absolute path, or ArchiveError when it is missing or not a folder."""
    archive_dir = Path(os.path.abspath(archive_dir))
    try:
        is_dir = stat.S_ISDIR(archive_dir.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        raise _missing_root(archive_dir) from None
    except OSError as exc:
        raise ArchiveError(archive_dir, _os_problem("cannot read it", exc)) from None
    if not is_dir:
        raise ArchiveError(archive_dir, Problem("it is not a directory", "missing"))
    return archive_dir


def _os_problem(what: str, exc: OSError) -> Problem:
    """`what: <reason>`, of kind "unreadable" where permissions refused it, else "damaged" (a failing disk...)."""
    kind = "unreadable" if exc.errno in (errno.EACCES, errno.EPERM) else "damaged"
    return Problem(f"{what}: {exc.strerror or exc}", kind)


def _read_manifest(archive_dir: Path) -> tuple[Manifest, dict[str, Any]]:
    """manifest.json parsed and type-checked, and its JSON object; or ArchiveError saying why not (with the advice
    that fits)."""
    rel = MANIFEST_NAME
    problem, data = _read_regular(archive_dir / rel, rel, None, MAX_RECORD_BYTES)
    if problem is not None:
        if problem.kind == "absent":
            problem = Problem(f"no {MANIFEST_NAME}: the SAVE did not finish, or this is not a graphpersist archive",
                              "incomplete")  # fmt: skip
        raise ArchiveError(archive_dir, problem)
    try:
        return codec.parsed(Manifest, data)
    except UnsupportedFormat as exc:
        raise ArchiveError(
            archive_dir, str(exc), advice=ADVICE_OLDER_FORMAT if exc.older else ADVICE_OTHER_FORMAT
        ) from None
    except ManifestError as exc:
        raise ArchiveError(archive_dir, f"{MANIFEST_NAME} is unreadable: {exc}") from None


def _read_regular(path: Path, rel: str, size: int | None, limit: int) -> tuple[Problem | None, bytes]:
    """(problem, bytes) of one regular file, opened without following a link or blocking on a FIFO, its size
    compared with `size` (the table's; None: at most `limit`) before a byte is read, then exactly that many bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return Problem(f"missing file {_name(rel)} (listed in {MANIFEST_NAME})", "absent"), b""
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return Problem(f"{_name(rel)} is not a regular file"), b""
        return _os_problem(f"cannot read {_name(rel)}", exc), b""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return Problem(f"{_name(rel)} is not a regular file"), b""
        if size is None and info.st_size > limit:
            return Problem(f"{_name(rel)} is larger than it may be ({limit} bytes)"), b""
        want = info.st_size if size is None else size
        if size is not None:
            problem = _size_problem(rel, FileEntry(sha256="", size=size), info.st_size)
            if problem is not None:
                return Problem(problem), b""
        chunks, got = [], 0
        while got < want:
            chunk = os.read(fd, min(want - got, 64 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got < want:
            return Problem(f"truncated file {_name(rel)}: {got} bytes, {MANIFEST_NAME} says {want}"), b""
        if os.read(fd, 1):
            return Problem(f"oversized file {_name(rel)}: it grew while it was read"), b""
    except OSError as exc:
        return _os_problem(f"cannot read {_name(rel)}", exc), b""
    finally:
        os.close(fd)
    return None, b"".join(chunks)


def _verified_bytes(archive_dir: Path, rel: str, entry: FileEntry) -> bytes:
    """The bytes of one listed file, checked against its size (before reading) and sha256; ArchiveError when they
    differ. Folders on the way must be real folders (no link is followed)."""
    problem, _size = _listed_file(archive_dir, rel)
    if problem is None:
        problem, data = _read_regular(archive_dir / rel, rel, entry.size, entry.size)
    if problem is None:
        problem = _content_problem(rel, entry, len(data), lambda: hashlib.sha256(data).hexdigest())
    if problem:
        raise ArchiveError(archive_dir, problem)
    return data


def _check_listed(
    archive_dir: Path, rel: str, entry: FileEntry, hash_it: bool, keep_it: bool
) -> tuple[str | None, bytes | None]:
    """(problem, bytes) for one listed file: a problem when it is missing, unsafe, resized or altered (hashed only
    when `hash_it`). Its size is compared with the table's (and with MAX_FILE_BYTES) before any byte is read. With
    `keep_it` it is read whole, hashed from those bytes, and they are returned when it verifies, so that nobody
    reads or hashes them again; otherwise it is hashed as it is read, a chunk at a time."""
    if not _plain(rel) or rel == MANIFEST_NAME:
        return f"{MANIFEST_NAME} lists an invalid path {_name(repr(rel))}", None
    problem, size = _listed_file(archive_dir, rel)
    if problem is None:
        problem = _size_problem(rel, entry, size)
    if problem is not None or not hash_it:
        return problem, None
    if keep_it:
        problem, data = _read_regular(archive_dir / rel, rel, entry.size, entry.size)
        if problem is None:
            problem = _content_problem(rel, entry, len(data), lambda: hashlib.sha256(data).hexdigest())
        return problem, None if problem else data
    problem = _streamed_problem(archive_dir / rel, rel, entry)
    return problem, None


def _streamed_problem(path: Path, rel: str, entry: FileEntry) -> str | None:
    """Hashes a listed file a chunk at a time (never whole in memory); the problem when it differs."""
    digest = hashlib.sha256()
    size = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return _os_problem(f"cannot read {_name(rel)}", exc)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"{_name(rel)} is not a regular file"
        while size <= entry.size and (chunk := os.read(fd, _CHUNK)):
            digest.update(chunk)
            size += len(chunk)
    except OSError as exc:
        return _os_problem(f"cannot read {_name(rel)}", exc)
    finally:
        os.close(fd)
    return _content_problem(rel, entry, size, digest.hexdigest)


def _listed_file(archive_dir: Path, rel: str) -> tuple[str | None, int]:
    """(problem, size) of a listed path: it must be a regular file reached through real folders, no link."""
    path = archive_dir
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = path / part
        try:
            info = path.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return f"missing file {_name(rel)} (listed in {MANIFEST_NAME})", 0
        except OSError as exc:
            return _os_problem(f"cannot read {_name(rel)}", exc), 0
        if stat.S_ISLNK(info.st_mode) and i < len(parts) - 1:
            return f"{_name(rel)} is not a regular file ({_name('/'.join(parts[: i + 1]))} is a symbolic link)", 0
    if not stat.S_ISREG(info.st_mode):
        return f"{_name(rel)} is not a regular file", 0
    return None, info.st_size


def _unlisted(archive_dir: Path, files: Mapping[str, FileEntry]) -> list[tuple[str, str]]:
    """Everything under `archive_dir` that is not a folder, manifest.json or a listed file (links never followed)."""
    found = []
    folders = [""]
    while folders:  # a loop, not recursion: the tree may be as deep as paths allow
        folder = folders.pop()
        try:
            with os.scandir(archive_dir / folder) as it:
                entries = list(it)
        except OSError as exc:
            found.append((folder, _os_problem(f"cannot list folder {_name(folder or '.')}", exc)))
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
