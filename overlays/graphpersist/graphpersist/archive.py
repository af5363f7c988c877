"""Writing and reading archives: atomic on write, verified on read.

Why the care: LOAD replays raw device addresses and kernel handles out of these files. A half-written or
bit-rotted archive must therefore never be loadable. The writer stages everything in a sibling folder, fsyncs
it, writes manifest.json (with every file's sha256 and size) last, and only then renames the folder into place;
the reader accepts a folder only if the manifest parses and every file matches it, with no file missing or extra.

Several processes (one per rank) can write one archive: the owner creates the writer, the other ranks open
writers on the owner's `staging` folder (`ArchiveWriter(root, world, staging=owner.staging)`), write their
files, and the owner calls `commit()` once all of them are done (the engine's barrier, not ours).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from graphpersist.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    RANK_RECORD_NAME,
    Creation,
    FileEntry,
    Manifest,
    ManifestError,
    RankRecord,
    UnsupportedFormat,
    World,
    rank_dir,
)

ADVICE = "Re-run with mode=save to write a fresh archive."
ADVICE_OTHER_FORMAT = "Use the graphpersist release that wrote it, or re-run with mode=save to write a fresh archive."
ADVICE_OLDER_FORMAT = (
    f"Re-run with mode=save to write it again in format {FORMAT_VERSION} "
    "(LOAD now compares facts that older formats did not record)."
)
_RANK_DIR = re.compile(r"rank_(0|[1-9][0-9]*)")
_CHUNK = 1 << 20


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
        if name == MANIFEST_NAME or _RANK_DIR.fullmatch(PurePosixPath(name).parts[0]):
            raise ValueError(f"file name {name!r} is reserved at the top of an archive")
        return name
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer or None, got {rank!r}")
    if name == RANK_RECORD_NAME:
        raise ValueError(f"{RANK_RECORD_NAME} is written by set_rank_facts(), not add_file()")
    return f"{rank_dir(rank)}/{name}"


# ---------------------------------------------------------------------------------------------------------
# Writing


class ArchiveWriter:
    """Stages one archive next to `root` and publishes it with one rename in commit().

    Use it as a context manager: leaving the block by an exception, or without commit(), discards the staged
    files, so the old archive (if any) stays untouched. With overwrite=True an existing archive is replaced only
    once the new one is complete.
    """

    def __init__(
        self,
        root: Path | str,
        world: Mapping[str, Any] | World,
        *,
        overwrite: bool = False,
        staging: Path | str | None = None,
    ) -> None:
        self.root = Path(os.path.abspath(root))
        self.overwrite = overwrite
        try:
            self.world = world if isinstance(world, World) else World.from_dict(world)
        except ManifestError as exc:
            raise ArchiveError(self.root, f"invalid world facts: {exc}", action="write", advice="") from None
        if self.root.exists() and not overwrite:
            raise ArchiveError(
                self.root, "it already exists (pass overwrite=True to replace it)", action="write", advice=""
            )
        if not self.root.exists() and not overwrite and (trash := _trash_folders(self.root)):
            raise ArchiveError(
                self.root,
                f"it is missing, but the previous archive is in {trash[0].path.name} (a SAVE replacing it moved "
                f"it there): rename it back (mv '{trash[0].path}' '{self.root}') or pass "
                "overwrite=True to replace it",
                action="write",
                advice="",
            )
        self.owner = staging is None
        if self.owner:
            remove_stale_partials(self.root)
            self.staging = _side_path(self.root, "partial")
            self.root.parent.mkdir(parents=True, exist_ok=True)
            self.staging.mkdir()
        else:
            self.staging = Path(os.path.abspath(staging))  # type: ignore[arg-type]
            if not self.staging.is_dir():
                raise ArchiveError(
                    self.root, f"staging folder {self.staging} does not exist", action="write", advice=""
                )
        self._written: dict[str, FileEntry] = {}
        self._rank_records: dict[int, str] = {}
        self._state = "open"

    # -- adding content

    def add_file(self, rank: int | None, name: str, data: bytes | bytearray | memoryview) -> str:
        """Writes one payload file durably; returns its archive-relative path (what records refer to)."""
        self._check_open()
        rel = archive_path(rank, name)
        self._write(rel, bytes(data))
        return rel

    def add_json(self, rank: int | None, name: str, obj: Any) -> str:
        """Writes `obj` as JSON (stable layout, so SAVE twice gives equal bytes); returns its path."""
        text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
        return self.add_file(rank, name, text.encode())

    def set_rank_facts(self, rank: int, facts: Mapping[str, Any] | RankRecord) -> RankRecord:
        """Records rank_<rank>/rank.json. `facts` is validated now, so a bad record fails the SAVE, not a LOAD."""
        self._check_open()
        if isinstance(facts, RankRecord):
            record = facts
        else:
            data = dict(facts)
            data.setdefault("rank", rank)
            device = data.get("device")
            if isinstance(device, int) and not isinstance(device, bool):
                data["device"] = self._device_facts(rank, device)
            try:
                record = RankRecord.from_dict(data)
            except ManifestError as exc:
                raise ArchiveError(
                    self.root, f"invalid facts for rank {rank}: {exc}", action="write", advice=""
                ) from None
        if record.rank != rank:
            raise ArchiveError(self.root, f"facts for rank {rank} say rank {record.rank}", action="write", advice="")
        rel = f"{rank_dir(rank)}/{RANK_RECORD_NAME}"
        self._write(rel, record.to_json().encode())
        self._rank_records[rank] = rel
        return record

    def _device_facts(self, rank: int, device: int) -> dict[str, Any]:
        """A bare device index (what api.py passes today) expanded to the GPU's identity, looked up here.

        Only right in the rank's own process (each rank records its own facts), after CUDA is initialised.
        """
        from graphpersist.world import WorldError, rank_device_facts

        try:
            return rank_device_facts(device)
        except WorldError as exc:
            raise ArchiveError(
                self.root, f"cannot record rank {rank}'s GPU: {exc}", action="write", advice=""
            ) from None

    def _write(self, rel: str, data: bytes) -> None:
        path = self.staging / rel
        if rel in self._written or path.exists():
            raise ArchiveError(self.root, f"{rel} was already written", action="write", advice="")
        new_dirs = [p for p in path.parents if p != self.staging and p.is_relative_to(self.staging) and not p.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        for directory in {path.parent, *(d.parent for d in new_dirs)}:
            _fsync_dir(directory)
        self._written[rel] = FileEntry(sha256=hashlib.sha256(data).hexdigest(), size=len(data))

    # -- finishing

    def commit(self) -> Path:
        """Checks completeness, writes manifest.json last, and renames the staged folder to `root`."""
        self._check_open()
        if not self.owner:
            raise ArchiveError(
                self.root, "only the writer that created the staging folder commits", action="write", advice=""
            )
        try:
            manifest = self._build_manifest()
            manifest_path = self.staging / MANIFEST_NAME
            with open(manifest_path, "x", encoding="utf-8") as fh:
                fh.write(manifest.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            for directory in sorted({p.parent for p in self.staging.rglob("*")}, key=lambda p: -len(p.parts)):
                _fsync_dir(directory)
            _publish(self.staging, self.root, overwrite=self.overwrite)
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        with contextlib.suppress(OSError):  # e.g. the old archive a stopped replace left: this one supersedes it
            remove_stale_partials(self.root)
        return self.root

    def abort(self) -> None:
        """Discards what this writer staged. The owner removes the whole staging folder."""
        if self._state != "open":
            return
        self._state = "aborted"
        if self.owner:
            shutil.rmtree(self.staging, ignore_errors=True)
        else:
            for rel in self._written:
                with contextlib.suppress(FileNotFoundError):
                    (self.staging / rel).unlink()

    def _check_open(self) -> None:
        if self._state != "open":
            raise ArchiveError(self.root, f"the writer is already {self._state}", action="write", advice="")

    def _build_manifest(self) -> Manifest:
        problems: list[str] = []
        files: dict[str, FileEntry] = {}
        for path in sorted(self.staging.rglob("*")):
            rel = path.relative_to(self.staging).as_posix()
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                problems.append(f"{rel} is not a regular file")
            elif path.is_file():
                files[rel] = self._written.get(rel) or _entry_of(path)
        top_dirs = {p.name for p in self.staging.iterdir() if p.is_dir() and _RANK_DIR.fullmatch(p.name)}
        ranks = sorted(int(d.removeprefix("rank_")) for d in top_dirs)
        expected = list(range(self.world.parallel.world_size))
        if ranks != expected:
            problems.append(f"ranks written {ranks}, expected {expected} (world_size {self.world.parallel.world_size})")
        records: dict[int, RankRecord] = {}
        for rank in ranks:
            rel = f"{rank_dir(rank)}/{RANK_RECORD_NAME}"
            if rel not in files:
                problems.append(f"rank {rank} has no {RANK_RECORD_NAME} (set_rank_facts was not called)")
                continue
            try:
                records[rank] = RankRecord.from_json((self.staging / rel).read_bytes())
            except ManifestError as exc:
                problems.append(f"{rel}: {exc}")
        problems += _reference_problems(records, files)
        if problems:
            raise ArchiveError(self.root, problems, action="write", advice="")
        return Manifest(
            format_version=FORMAT_VERSION,
            created=Creation.now(),
            world=self.world,
            ranks=tuple(ranks),
            files=files,
        )

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None or self.owner:
            self.abort()


# ---------------------------------------------------------------------------------------------------------
# Staging and trash folders next to an archive, and whether the writer that made one is still running.
#
# Their names carry the writer's identity: `<root>.partial-<pid>-<start>-<scope>-<random>` (also `.trash-`),
# where <start> is the process start time (field 22 of /proc/<pid>/stat, clock ticks since boot; 0 where
# unknown) and <scope> 8 hex digits of a hash of the boot id and the pid namespace. A folder is dead when its
# pid is gone, or now belongs to a process that started at another time (the pid was reused); a folder from
# another boot, host or pid namespace (other scope) is never judged: its pid means nothing here. The older
# `<root>.partial-<pid>-<random>` names are still read and judged by pid alone.

_SIDE_NAME = re.compile(r"\.(partial|trash)-([0-9]+)-(?:([0-9]+)-([0-9a-f]{8})-)?([0-9a-f]+)")


@dataclass(frozen=True)
class _SideFolder:
    path: Path
    kind: str  # "partial" or "trash"
    pid: int
    start: int | None  # None: old name (pid only); 0: the start time was unknown
    scope: str | None


def _side_path(root: Path, kind: str) -> Path:
    pid = os.getpid()
    return root.with_name(f"{root.name}.{kind}-{pid}-{_start_time(pid) or 0}-{_scope()}-{secrets.token_hex(4)}")


def _side_folders(root: Path) -> list[_SideFolder]:
    """Staging and trash folders next to `root`, newest first."""
    try:
        entries = list(root.parent.iterdir())
    except OSError:  # no parent folder, or one we may not list
        return []
    found = []
    for path in entries:
        if not path.name.startswith(f"{root.name}."):
            continue
        match = _SIDE_NAME.fullmatch(path.name[len(root.name) :])
        if match:
            kind, pid, start, scope, _ = match.groups()
            found.append(_SideFolder(path, kind, int(pid), None if start is None else int(start), scope))
    return sorted(found, key=lambda f: (_mtime(f.path), f.path.name), reverse=True)


def _trash_folders(root: Path) -> list[_SideFolder]:
    return [f for f in _side_folders(root) if f.kind == "trash"]


def _writer_state(folder: _SideFolder) -> str:
    """One of alive, dead, or foreign (made under another boot, host or pid namespace: not judged here)."""
    if folder.scope is not None and folder.scope != _scope():
        return "foreign"
    if not _pid_exists(folder.pid):
        return "dead"
    if folder.start:  # new-style name with a known start time: a different start means the pid was reused
        start = _start_time(folder.pid)
        if start is not None and start != folder.start:
            return "dead"
    return "alive"


def remove_stale_partials(root: Path | str) -> list[Path]:
    """Deletes staging/trash folders next to `root` whose writer is dead; returns what it deleted.

    A trash folder is never deleted while `root` is missing: it then holds the only whole archive (a replacing
    SAVE died between its two renames), and open_archive names it so it can be renamed back.
    """
    root = Path(os.path.abspath(root))
    removed = []
    for folder in _side_folders(root):
        if folder.kind == "trash" and not root.exists():
            continue
        if _writer_state(folder) == "dead":
            shutil.rmtree(folder.path, ignore_errors=True)
            removed.append(folder.path)
    return removed


def _missing_root(root: Path) -> ArchiveError:
    """The error for a missing archive, naming what a SAVE left next to it (and how to get the archive back)."""
    trash = _trash_folders(root)
    if trash:
        newest = trash[0]
        others = f" (older: {', '.join(f.path.name for f in trash[1:])})" if len(trash) > 1 else ""
        restore = f"mv '{newest.path}' '{root}'"
        state = _writer_state(newest)
        if state == "alive":
            return ArchiveError(
                root,
                f"no such directory: a SAVE (pid {newest.pid}) is replacing it right now; the previous archive "
                f"is in {newest.path.name}{others}",
                advice="Try again when that SAVE has finished.",
            )
        who = (
            "a SAVE that was replacing it stopped between its two renames"
            if state == "dead"
            else f"a SAVE on another host or container (pid {newest.pid} there) was replacing it"
        )
        return ArchiveError(
            root,
            f"no such directory: {who}; the previous archive is whole in {newest.path.name}{others}",
            advice=f"To load it, rename it back: {restore}" + ("" if state == "dead" else " (once no SAVE runs)"),
        )
    partials = [f for f in _side_folders(root) if f.kind == "partial"]
    hint = f" (an unfinished SAVE left {partials[0].path.name}; it is not loadable)" if partials else ""
    return ArchiveError(root, f"no such directory{hint}")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks after boot); None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])  # fields after "(comm)" start at field 3
    except (OSError, ValueError, IndexError):
        return None


def _scope() -> str:
    """8 hex digits naming this boot and pid namespace: where a (pid, start time) pair identifies a process."""
    parts = []
    for read in (_boot_id, lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _publish(staging: Path, root: Path, *, overwrite: bool) -> None:
    """Moves the complete staging folder to `root`; an old archive is swapped out, never half-replaced."""
    if not root.exists():
        os.rename(staging, root)
    elif not overwrite:
        raise ArchiveError(root, "it already exists (pass overwrite=True to replace it)", action="write", advice="")
    elif _exchange(staging, root):
        shutil.rmtree(staging)  # now holds the old archive
    else:
        # Two renames: a crash between them leaves no `root`, but the old archive whole in `trash`, which
        # remove_stale_partials keeps and open_archive names (with the command to rename it back).
        trash = _side_path(root, "trash")
        os.rename(root, trash)
        try:
            os.rename(staging, root)
        except BaseException:
            os.rename(trash, root)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    _fsync_dir(root.parent)


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
            if image.file not in files:
                problems.append(f"rank {rank}: image {image.sha256[:12]} names missing file {image.file}")
            elif files[image.file].sha256 != image.sha256:
                problems.append(f"rank {rank}: image file {image.file} does not hash to {image.sha256[:12]}")
        for graph in record.graphs:
            if graph.file not in files:
                problems.append(f"rank {rank}: graph {graph.name} names missing file {graph.file}")
            problems += [
                f"rank {rank}: graph {graph.name} uses image {h[:12]} that rank {rank} does not list"
                for h in graph.images
                if h not in hashes
            ]
    return problems


# ---------------------------------------------------------------------------------------------------------
# Reading


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
            if rank is None and _RANK_DIR.fullmatch(rel.split("/", 1)[0]):
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
        rel = archive_path(rank, name)
        try:
            return json.loads(self.read_path(rel))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArchiveError(self.root, f"{rel} is not valid JSON: {exc}") from None

    def read_path(self, rel: str) -> bytes:
        """Reads an archive-relative path (as records name them), verified against size and sha256."""
        rel, entry = self._entry(rel)
        kept = self._verified.pop(rel, None)
        if kept is not None:
            return kept
        try:
            data = (self.root / rel).read_bytes()
        except FileNotFoundError:
            raise ArchiveError(self.root, f"missing file {rel} (listed in {MANIFEST_NAME})") from None
        problem = _content_problem(rel, entry, len(data), lambda: hashlib.sha256(data).hexdigest())
        if problem:
            raise ArchiveError(self.root, problem)
        return data

    def _entry(self, rel: str) -> tuple[str, FileEntry]:
        entry = self.manifest.files.get(rel)
        if entry is None:
            raise ArchiveError(self.root, f"it has no file {rel}", advice="")
        return rel, entry


def open_archive(root: Path | str, *, verify_checksums: bool = True, keep_rank: int | None = None) -> Archive:
    """Opens and verifies an archive; raises ArchiveError listing every problem, never a bare traceback.

    Sizes, presence and unexpected files are always checked. verify_checksums=False skips hashing every file up
    front (read() still verifies what it returns), for callers that read all files anyway. keep_rank=r keeps the
    bytes of rank r's files and of the shared top-level ones as they were hashed, so that rank's LOAD hashes each
    byte once: the first read() of each returns them (and drops them), later ones read and verify again.
    """
    root = Path(os.path.abspath(root))
    if not root.exists():
        raise _missing_root(root)
    if not root.is_dir():
        raise ArchiveError(root, "it is not a directory")
    manifest_file = root / MANIFEST_NAME
    if not manifest_file.is_file():
        raise ArchiveError(root, f"no {MANIFEST_NAME}: the SAVE did not finish, or this is not a graphpersist archive")
    try:
        manifest = Manifest.from_json(manifest_file.read_bytes())
    except UnsupportedFormat as exc:
        raise ArchiveError(root, str(exc), advice=ADVICE_OLDER_FORMAT if exc.older else ADVICE_OTHER_FORMAT) from None
    except ManifestError as exc:
        raise ArchiveError(root, f"{MANIFEST_NAME} is unreadable: {exc}") from None

    kept: dict[str, bytes] = {}
    keep = None
    if keep_rank is not None and verify_checksums:
        own = f"{rank_dir(keep_rank)}/"
        keep = lambda rel: rel.startswith(own) or not _RANK_DIR.fullmatch(rel.split("/", 1)[0])  # noqa: E731
    bad_files = dict(_file_problems(root, manifest, verify_checksums, keep, kept))
    problems = list(bad_files.values())
    records: dict[int, RankRecord] = {}
    for rank in manifest.ranks:
        rel = f"{rank_dir(rank)}/{RANK_RECORD_NAME}"
        if rel not in manifest.files:
            problems.append(f"rank {rank} has no {rel} in {MANIFEST_NAME}")
            continue
        if rel in bad_files:
            continue
        try:
            record = RankRecord.from_json((root / rel).read_bytes())
        except ManifestError as exc:
            problems.append(f"{rel}: {exc}")
            continue
        if record.rank != rank:
            problems.append(f"{rel} says rank {record.rank}")
        records[rank] = record
    problems += _reference_problems(records, manifest.files)
    if problems:
        raise ArchiveError(root, problems)
    return Archive(root, manifest, records, kept)


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
            yield rel, f"{MANIFEST_NAME} lists an invalid path {rel!r}"
            continue
        path = root / rel
        if path.is_symlink() or (path.exists() and not path.is_file()):
            yield rel, f"{rel} is not a regular file"
            continue
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            yield rel, f"missing file {rel} (listed in {MANIFEST_NAME})"
            continue
        data = None
        if verify_checksums and keep is not None and kept is not None and keep(rel) and size == entry.size:
            data = path.read_bytes()
            size = len(data)
            digest = lambda d=data: hashlib.sha256(d).hexdigest()  # noqa: E731
        else:
            digest = (lambda p=path: _entry_of(p).sha256) if verify_checksums else None
        problem = _content_problem(rel, entry, size, digest)
        if problem:
            yield rel, problem
        elif data is not None:
            kept[rel] = data
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST_NAME and rel not in manifest.files and (path.is_symlink() or not path.is_dir()):
            yield rel, f"unexpected file {rel} (not listed in {MANIFEST_NAME})"


def _content_problem(rel: str, entry: FileEntry, size: int, digest: Any) -> str | None:
    if size < entry.size:
        return f"truncated file {rel}: {size} bytes, {MANIFEST_NAME} says {entry.size}"
    if size > entry.size:
        return f"oversized file {rel}: {size} bytes, {MANIFEST_NAME} says {entry.size}"
    if digest is not None:
        actual = digest()
        if actual != entry.sha256:
            return f"corrupted file {rel}: sha256 {actual[:16]}…, {MANIFEST_NAME} says {entry.sha256[:16]}…"
    return None
