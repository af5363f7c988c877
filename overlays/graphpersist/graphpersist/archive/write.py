"""Writing an archive atomically: stage next to it, fsync, write manifest.json last, rename into place.

Several processes (one per rank) can write one archive: the owner creates the writer, the other ranks open
writers on the owner's `staging` folder (`ArchiveWriter(archive_dir, world, staging=owner.staging)`), write their
files, and the owner calls `commit()` once all of them are done (the engine's barrier, not ours).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from graphpersist.archive import codec, safejson
from graphpersist.archive import digests as archive_digests
from graphpersist.archive.base import (
    ADVICE_NO_SPACE,
    ADVICE_READ_ONLY,
    ArchiveError,
    Problem,
    _entry_of,
    _reference_problems,
    archive_path,
)
from graphpersist.archive.manifest import (
    FORMAT_VERSION,
    IMAGES_DIR,
    MANIFEST_NAME,
    RANK_DIR,
    RANK_RECORD_NAME,
    Creation,
    FileEntry,
    Manifest,
    ManifestError,
    RankRecord,
    World,
    rank_dir,
)
from graphpersist.archive.side import _side_path, _trash_folders, remove_stale_partials


class ArchiveWriter:
    """Stages one archive next to `archive_dir` and publishes it with one rename in commit().

    Use it as a context manager: leaving the block by an exception, or without commit(), discards the staged
    files, so the old archive (if any) stays untouched. With overwrite=True an existing archive is replaced only
    once the new one is complete.
    """

    def __init__(
        self,
        archive_dir: Path | str,
        world: Mapping[str, Any] | World,
        *,
        overwrite: bool = False,
        staging: Path | str | None = None,
    ) -> None:
        self.root = Path(os.path.abspath(archive_dir))
        self.overwrite = overwrite
        try:
            self.world = world if isinstance(world, World) else codec.from_dict(World, world)
            _reads_back(codec.to_dict(self.world))
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
            with _io_errors(self.root, self.staging, 0, "create the staging folder"):
                self.root.parent.mkdir(parents=True, exist_ok=True)
                self.staging.mkdir()
        else:
            self.staging = Path(os.path.abspath(staging))  # type: ignore[arg-type]
            if not self.staging.is_dir():
                raise ArchiveError(
                    self.root, f"staging folder {self.staging} does not exist", action="write", advice=""
                )
        self._written: dict[str, FileEntry] = {}
        self._images: dict[str, FileEntry] = {}  # images/ files this writer added (maybe written by another rank)
        self._rank_records: dict[int, str] = {}
        self._shared_closed = False  # rank 0's record commits to the shared files: none may come after it
        self._state = "open"

    # -- adding content

    def add_file(self, rank: int | None, name: str, data: bytes | bytearray | memoryview) -> str:
        """Writes one payload file durably; returns its archive-relative path (what records refer to)."""
        self._check_open()
        rel = archive_path(rank, name)
        if rank is None and self._shared_closed:
            raise ArchiveError(
                self.root,
                f"{rel}: shared files must be written before rank 0's record, which commits to them",
                action="write",
                advice="",
            )
        self._write(rel, bytes(data))
        return rel

    def add_image(self, sha256: str, data: bytes | bytearray | memoryview) -> str:
        """Writes a kernel image once per archive, `images/<sha256>.bin`; returns its archive-relative path.

        Any rank may add it: the first rank to write the file keeps it and the others find the same bytes there
        (its name is their sha256, checked here), so an image every rank loads is stored once, not once per rank.
        """
        self._check_open()
        data = bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise ArchiveError(
                self.root, f"kernel image {sha256[:16]}… hashes to {digest[:16]}…", action="write", advice=""
            )
        rel = archive_path(None, f"{IMAGES_DIR}/{sha256}.bin")
        if rel not in self._images:
            self._write_new(rel, data)  # False when another rank wrote it first: the same bytes
            self._images[rel] = FileEntry(sha256=sha256, size=len(data))
        return rel

    def add_shared(self, files: Mapping[str, bytes | bytearray | memoryview]) -> list[str]:
        """Writes payload files shared by all ranks (top level); returns their paths. One copy per archive, so only
        the owner writes them (the other ranks' writers refuse)."""
        self._check_open()
        if not self.owner:
            raise ArchiveError(
                self.root, "shared files are written by the owner (rank 0) only", action="write", advice=""
            )
        return [self.add_file(None, name, data) for name, data in sorted(files.items())]

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
                record = codec.from_dict(RankRecord, data)
            except ManifestError as exc:
                raise ArchiveError(
                    self.root, f"invalid facts for rank {rank}: {exc}", action="write", advice=""
                ) from None
        try:
            _reads_back(codec.to_dict(record))
        except ManifestError as exc:
            raise ArchiveError(self.root, f"invalid facts for rank {rank}: {exc}", action="write", advice="") from None
        if record.rank != rank:
            raise ArchiveError(self.root, f"facts for rank {rank} say rank {record.rank}", action="write", advice="")
        try:
            manifest = codec.to_dict(self._manifest({})) if rank == 0 else None
            record = archive_digests.committed(record, self._owned_files(rank), manifest)
        except ValueError as exc:
            raise ArchiveError(self.root, f"invalid facts for rank {rank}: {exc}", action="write", advice="") from None
        rel = f"{rank_dir(rank)}/{RANK_RECORD_NAME}"
        self._write(rel, codec.to_json(record).encode())
        self._rank_records[rank] = rel
        if rank == 0:
            self._shared_closed = True
        return record

    def _owned_files(self, rank: int) -> dict[str, str]:
        """sha256 of the staged files rank `rank`'s record commits to (archive_digests.owned), whichever writer
        staged them: those this writer wrote are known, others are hashed from the staging folder."""
        out = {}
        for path in sorted(self.staging.rglob("*")):
            rel = path.relative_to(self.staging).as_posix()
            if archive_digests.owned(rel, rank) and path.is_file() and not path.is_symlink():
                entry = self._written.get(rel) or self._images.get(rel) or _entry_of(path)
                out[rel] = entry.sha256
        return out

    def _device_facts(self, rank: int, device: int) -> dict[str, Any]:
        """A bare device index (what api.py passes today) expanded to the GPU's identity, looked up here.

        Only right in the rank's own process (each rank records its own facts), after CUDA is initialised.
        """
        from graphpersist.archive.world import WorldError, rank_device_facts

        try:
            return rank_device_facts(device)
        except WorldError as exc:
            raise ArchiveError(
                self.root, f"cannot record rank {rank}'s GPU: {exc}", action="write", advice=""
            ) from None

    def _write(self, rel: str, data: bytes) -> None:
        if rel in self._written or rel in self._images or not self._write_new(rel, data):
            raise ArchiveError(self.root, f"{rel} was already written", action="write", advice="")
        self._written[rel] = FileEntry(sha256=hashlib.sha256(data).hexdigest(), size=len(data))

    def _write_new(self, rel: str, data: bytes) -> bool:
        """Creates one staged file durably; False (nothing written) when it already exists."""
        path = self.staging / rel
        with _io_errors(self.root, path, len(data), f"write {rel}"):
            new_dirs = [p for p in path.parents if p != self.staging and p.is_relative_to(self.staging)
                        and not p.exists()]  # fmt: skip
            path.parent.mkdir(parents=True, exist_ok=True)  # another rank may create the same folder at the same time
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            except FileExistsError:
                return False
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
            except OSError:
                with contextlib.suppress(OSError):  # a half-written file must not look like another rank's copy
                    path.unlink()
                raise
            for directory in {path.parent, *(d.parent for d in new_dirs)}:
                _fsync_dir(directory)
        return True

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
            text = codec.to_json(manifest)
            with _io_errors(self.root, manifest_path, len(text.encode()), f"write {MANIFEST_NAME}"):
                with open(manifest_path, "x", encoding="utf-8") as fh:
                    fh.write(text)
                    fh.flush()
                    os.fsync(fh.fileno())
                for directory in sorted({p.parent for p in self.staging.rglob("*")}, key=lambda p: -len(p.parts)):
                    _fsync_dir(directory)
            with _io_errors(self.root, self.root, 0, "publish the archive (rename the staging folder into place)"):
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
                files[rel] = self._written.get(rel) or self._images.get(rel) or _entry_of(path)
        top_dirs = {p.name for p in self.staging.iterdir() if p.is_dir() and RANK_DIR.fullmatch(p.name)}
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
                records[rank] = codec.from_json(RankRecord, (self.staging / rel).read_bytes())
            except ManifestError as exc:
                problems.append(f"{rel}: {exc}")
        manifest = self._manifest(files)
        problems += _reference_problems(records, files)
        problems += archive_digests.problems(records, files, codec.to_dict(manifest))
        problems = problems or manifest.consistency_problems()  # what open_archive would refuse (e.g. no ranks)
        if problems:
            raise ArchiveError(self.root, problems, action="write", advice="")
        return manifest

    def _manifest(self, files: dict[str, FileEntry]) -> Manifest:
        """The manifest with this file table: its ranks are the world's (commit() refuses any other set of ranks)."""
        ranks = tuple(range(self.world.parallel.world_size))
        created = Creation.now()
        return Manifest(format_version=FORMAT_VERSION, created=created, world=self.world, ranks=ranks, files=files)

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None or self.owner:
            self.abort()


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def _io_errors(archive_dir: Path, path: Path, nbytes: int, what: str) -> Iterator[None]:
    """Turns a full disk, a quota, a read-only file system or a refused permission while writing into an
    ArchiveError naming the path, the bytes it needed, the space left there, and what to do, which SAVE shows
    instead of a bare OSError traceback. Other OSErrors (a failing disk) pass as they are."""
    try:
        yield
    except ArchiveError:
        raise
    except OSError as exc:
        where = Path(exc.filename) if isinstance(exc.filename, str) else path
        reason = exc.strerror or str(exc)
        if exc.errno in _NO_SPACE:
            free = _free_bytes(where)
            left = f"{free} bytes are free there" if free is not None else "the free space there is unknown"
            need = f"this file needs {nbytes} bytes (the rest of the archive more), " if nbytes else ""
            problem = Problem(f"cannot {what}: {where}: {reason}: {need}{left}", "no_space")
        elif exc.errno in _READ_ONLY:
            problem = Problem(f"cannot {what}: {where}: {reason}", "read_only")
        else:
            raise  # a failing disk, an interrupted rename: as it is
        advice = ADVICE_NO_SPACE if problem.kind == "no_space" else ADVICE_READ_ONLY
        raise ArchiveError(archive_dir, [problem], action="write", advice=advice) from exc


def _free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of `path` (or of its nearest existing parent)."""
    for folder in (path, *path.parents):
        try:
            info = os.statvfs(folder)
        except OSError:
            continue
        return info.f_bavail * info.f_frsize
    return None


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


def _publish(staging: Path, archive_dir: Path, *, overwrite: bool) -> None:
    """Moves the complete staging folder to `archive_dir`; an old archive is swapped out, never half-replaced."""
    if not archive_dir.exists():
        os.rename(staging, archive_dir)
    elif not overwrite:
        raise ArchiveError(
            archive_dir, "it already exists (pass overwrite=True to replace it)", action="write", advice=""
        )
    elif _exchange(staging, archive_dir):
        shutil.rmtree(staging)  # now holds the old archive
    else:
        # Two renames: a crash between them leaves no `archive_dir`, but the old archive whole in `trash`, which
        # remove_stale_partials keeps and open_archive names (with the command to rename it back).
        trash = _side_path(archive_dir, "trash")
        os.rename(archive_dir, trash)
        try:
            os.rename(staging, archive_dir)
        except BaseException:
            os.rename(trash, archive_dir)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    _fsync_dir(archive_dir.parent)


def _reads_back(facts: Any) -> None:
    """Raises ManifestError when `facts` (free-form parts included) would not read back: the reader is strict
    (no NaN, integers within 64 bits, bounded nesting ...), so a SAVE must fail now rather than a later LOAD.
    """
    try:
        text = json.dumps(facts, allow_nan=False)
    except (ValueError, RecursionError) as exc:  # NaN or Infinity, an integer too long to print, too deep
        raise ManifestError(f"it cannot be written as JSON: {str(exc)[:200]}") from None
    try:
        safejson.loads(text)
    except safejson.JsonError as exc:
        raise ManifestError(f"it would not read back: {exc}") from None
