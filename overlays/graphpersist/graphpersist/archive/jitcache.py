"""The engine's JIT and compile caches, carried in the archive so that a LOAD on a fresh host compiles nothing.

Why: restoring graphs skips capture, but an engine still compiles before and around it (torch.compile/Inductor,
Triton kernels, FlashInfer's ninja-built modules). On a host whose caches are empty that took longer than the whole
rest of a LOAD. SAVE therefore packs the cache folders the engine names into one shared archive file, and LOAD
puts back whatever its host lacks before anything compiles.

The blob is an uncompressed POSIX (pax) tar, written deterministically: members sorted, `<name>/<path in folder>`,
owner and group 0, mode 0o644 or 0o755 (the executable bit kept: JIT-built .so files), and each file's
modification time kept to the nanosecond. The times are content here, not noise: FlashInfer runs ninja on every
module it loads, and ninja rebuilds an output whose time differs from the one its logs recorded. Two collects of
an unchanged tree give identical bytes. Lock files, temporary files and symbolic links are left out (counted).

Restoring never overwrites: a file the live folder already has (a warm host, or another rank restoring at the
same time) is kept. Each new file is written to a temporary name in its folder and renamed into place, so a
reader never sees half a file. Hostile content cannot write outside the named folders: only regular-file members
with plain relative names are accepted, checked before anything is written, and folders below a live cache root
are opened without following symbolic links.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import secrets
import stat
import tarfile
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from graphpersist.errors import JitCacheError

SHARED_NAME = "jitcache.tar"  # the archive's shared top-level file that holds the blob
LIMIT_BYTES = 4 << 30
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a cache folder's name: one plain path component
_TRITON_STAGING = re.compile(r"tmp\.pid_\d+_.*")  # Triton writes a kernel into such a folder, then renames it


@dataclass
class CacheStats:
    """What a collect carried or a restore wrote, per cache name; for the log line."""

    files: dict[str, int] = field(default_factory=dict)  # collect: carried; restore: written
    bytes: dict[str, int] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)  # restore: already present live, left alone
    absent: list[str] = field(default_factory=list)  # collect: named folders that do not exist
    skipped: Counter[str] = field(default_factory=Counter)  # why -> count (lock, temporary, symlink, ...)
    written: list[str] = field(default_factory=list)  # restore: the files it created (absolute paths)

    def count(self, name: str, size: int) -> None:
        self.files[name] = self.files.get(name, 0) + 1
        self.bytes[name] = self.bytes.get(name, 0) + size

    def describe(self) -> str:
        """One line: per name its files and size (and kept files), then absent folders and skipped entries."""
        names = sorted(set(self.files) | set(self.kept))
        parts = []
        for name in names:
            text = f"{name} {self.files.get(name, 0)} files {_size(self.bytes.get(name, 0))}"
            if name in self.kept:
                text += f" ({self.kept[name]} kept)"
            parts.append(text)
        line = ", ".join(parts) or "no files"
        if self.absent:
            line += f"; absent: {', '.join(self.absent)}"
        if self.skipped:
            line += "; skipped: " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return line


def collect(dirs: Mapping[str, Path], *, limit_bytes: int = LIMIT_BYTES) -> tuple[bytes, CacheStats]:
    """Packs every regular file under each named folder into one deterministic tar; refuses more than the limit."""
    stats = CacheStats()
    found: list[tuple[str, Path, int]] = []  # (member name, path, size) in member order
    for name in sorted(dirs):
        _check_name(name)
        root = Path(dirs[name])
        if not root.is_dir():
            stats.absent.append(name)
            continue
        found += ((f"{name}/{rel}", path, size) for rel, path, size in _walk(root, stats.skipped))
    total = sum(size for _, _, size in found)
    if total > limit_bytes:
        raise JitCacheError(_too_large(found, dirs, total, limit_bytes))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member, path, _ in found:
            read = _read(path)
            if isinstance(read, str):
                stats.skipped[read] += 1
                continue
            data, info = read
            tar.addfile(_member(member, len(data), info), io.BytesIO(data))
            stats.count(member.split("/", 1)[0], len(data))
    return out.getvalue(), stats


def listing(dirs: Mapping[str, Path]) -> set[str]:
    """The member names a collect would carry now, nothing read: what was compiled after a collect is the
    difference of two listings."""
    names: set[str] = set()
    for name, root in dirs.items():
        _check_name(name)
        if Path(root).is_dir():
            names.update(f"{name}/{rel}" for rel, _, _ in _walk(Path(root), Counter()))
    return names


def restore(blob: bytes, dirs: Mapping[str, Path]) -> CacheStats:
    """Writes the blob's files that the live folders lack; never overwrites. Refuses hostile content, writing none.

    A name whose folder is not configured here (say FlashInfer is not installed on this host) is skipped and
    counted. Several processes may restore the same blob into the same folders at once.
    """
    for name in dirs:
        _check_name(name)
    stats = CacheStats()
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member)
            for member in members:
                name, rel = member.name.split("/", 1)
                if name not in dirs:
                    stats.skipped["unconfigured"] += 1
                    continue
                if _write_new(Path(dirs[name]), rel, tar, member):
                    stats.count(name, member.size)
                    stats.written.append(str(Path(dirs[name]) / rel))
                else:
                    stats.kept[name] = stats.kept.get(name, 0) + 1
    except tarfile.TarError as exc:
        raise JitCacheError(f"graphpersist: the archive's JIT caches are not a readable tar: {exc}") from None
    return stats


def validate(blob: bytes) -> int:
    """Refuses (JitCacheError, as restore() words it) the blobs restore() refuses, writing nothing: a tar that does
    not parse, or a member that breaks restore's rules (_check_member). What `graphpersist check` runs, so that it
    refuses the caches a LOAD would. Returns the number of members."""
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member)
    except tarfile.TarError as exc:
        raise JitCacheError(f"graphpersist: the archive's JIT caches are not a readable tar: {exc}") from None
    return len(members)


# ---------------------------------------------------------------------------------------------------- collect


def _check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise ValueError(f"cache name {name!r} must be one plain path component ({NAME.pattern})")


def _left_out(entry: str) -> str | None:
    """Why a file or folder name is not carried (None: carried)."""
    if entry == ".lock" or entry.endswith(".lock"):
        return "lock"
    if ".tmp" in entry or _TRITON_STAGING.fullmatch(entry):
        return "temporary"
    return None


def _walk(root: Path, skipped: Counter[str]) -> Iterator[tuple[str, Path, int]]:
    """(relative path, path, size) of every regular file below root, sorted by relative path; links not followed."""
    pending = [("", root)]
    files: list[tuple[str, Path, int]] = []
    while pending:  # a loop, not recursion: caches can be deep
        rel_dir, folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            skipped["unreadable"] += 1
            continue
        for entry in entries:
            rel = f"{rel_dir}{entry.name}"
            why = _left_out(entry.name)
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                why = why or "vanished"
            else:
                if why is None and stat.S_ISLNK(info.st_mode):
                    why = "symlink"
                elif why is None and stat.S_ISDIR(info.st_mode):
                    pending.append((f"{rel}/", Path(entry.path)))
                    continue
                elif why is None and not stat.S_ISREG(info.st_mode):
                    why = "special"
            if why is not None:
                skipped[why] += 1
                continue
            files.append((rel, Path(entry.path), info.st_size))
    yield from sorted(files)


def _read(path: Path) -> tuple[bytes, os.stat_result] | str:
    """The file's bytes and status, read without following a link; or why it was skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return "vanished"
    except OSError:
        return "unreadable"  # a link put in its place (ELOOP) or no permission
    with open(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "special"
        return fh.read(), info


def _member(name: str, size: int, info: os.stat_result) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.size = size
    member.mode = 0o755 if info.st_mode & 0o111 else 0o644
    member.mtime = info.st_mtime_ns // 1_000_000_000
    member.pax_headers = {"mtime": _pax_time(info.st_mtime_ns)}  # the header keeps seconds only
    return member


def _pax_time(ns: int) -> str:
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    return f"{sign}{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def _too_large(found: list[tuple[str, Path, int]], dirs: Mapping[str, Path], total: int, limit: int) -> str:
    per_name: Counter[str] = Counter()
    per_folder: Counter[str] = Counter()
    for member, _, size in found:
        parts = member.split("/")
        per_name[parts[0]] += size
        per_folder[str(Path(dirs[parts[0]], *parts[1:2]))] += size
    names = ", ".join(f"{n} {_size(s)} ({dirs[n]})" for n, s in per_name.most_common())
    biggest = ", ".join(f"{f} {_size(s)}" for f, s in per_folder.most_common(5))
    return (
        f"graphpersist: the JIT caches hold {_size(total)}, more than the {_size(limit)} an archive carries: {names}; "
        f"biggest folders: {biggest}. They hold other engines' or models' artifacts too: empty them (or point their "
        "variables at new folders) and SAVE again; that SAVE fills them with only what this engine needs"
    )


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------------------------- restore


def _check_member(member: tarfile.TarInfo) -> None:
    """Refuses a member that is not a regular file with a plain `<name>/<relative path>` (tarfile itself refuses
    one whose data run past the end of the blob)."""
    name = member.name
    parts = name.split("/")
    problem = None
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.issparse():
        problem = "is not a regular file"
    elif name.startswith("/"):
        problem = "has an absolute path"
    elif any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
        problem = "is not a plain relative path ('..', '.', '//' or '\\')"
    elif len(parts) < 2 or not NAME.fullmatch(parts[0]):
        problem = "does not lie in a named cache folder"
    elif _mtime_ns(member) is None:
        problem = f"has a modification time ({str(member.mtime)[:40]}) no file can have"
    if problem is not None:
        raise JitCacheError(
            f"graphpersist: the archive's JIT caches hold a member {name[:200]!r} that {problem}: nothing was "
            "restored. The archive was not written by graphpersist's SAVE: re-run with mode=save"
        )


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    reader = tar.extractfile(member)
    assert reader is not None  # a regular file (checked)
    return reader.read()


def _mtime_ns(member: tarfile.TarInfo) -> int | None:
    """The member's modification time in ns (its pax header's, else the header's seconds); None when no file can
    have it (NaN, infinite, past what os.utime takes)."""
    text = member.pax_headers.get("mtime")
    if text and re.fullmatch(r"-?[0-9]{1,12}\.[0-9]{9}", text):
        seconds, frac = text.split(".")
        sign = -1 if seconds.startswith("-") else 1
        ns = sign * (abs(int(seconds)) * 1_000_000_000 + int(frac))
    elif isinstance(member.mtime, int | float) and math.isfinite(member.mtime):
        ns = int(member.mtime) * 1_000_000_000
    else:
        return None
    return ns if -(2**63) <= ns < 2**63 else None


def _write_new(root: Path, rel: str, tar: tarfile.TarFile, member: tarfile.TarInfo) -> bool:
    """Writes root/rel unless something is there already (True: written). Below root no link is followed."""
    *folders, filename = rel.split("/")
    try:
        root.mkdir(parents=True, exist_ok=True)
        fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        try:
            for folder in folders:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, 0o755, dir_fd=fds[-1])
                fds.append(os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
            return _place(fds[-1], filename, tar, member)
        finally:
            for fd in fds:
                os.close(fd)
    except OSError as exc:
        raise JitCacheError(
            f"graphpersist: cannot restore the JIT cache file {root / rel}: {exc.strerror or exc}. Make the folder "
            "writable (or point its variable at one that is), or remove what stands in the way"
        ) from None


def _place(dir_fd: int, filename: str, tar: tarfile.TarFile, member: tarfile.TarInfo) -> bool:
    if _exists(filename, dir_fd):
        return False
    data = _member_bytes(tar, member)
    tmp = f".gp-{os.getpid()}-{secrets.token_hex(4)}.tmp"  # a name collect leaves out, should this process die
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    mode = 0o755 if member.mode & 0o111 else 0o644  # never set-user-ID or writable by others, whatever it says
    fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
    try:
        with open(fd, "wb", closefd=True) as fh:
            fh.write(data)
            fh.flush()
            mtime = _mtime_ns(member)
            assert mtime is not None  # _check_member refused any other
            os.utime(fh.fileno(), ns=(mtime, mtime))
        if _exists(filename, dir_fd):  # another rank (or the engine) put it there meanwhile: keep theirs
            os.unlink(tmp, dir_fd=dir_fd)
            return False
        os.replace(tmp, filename, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return True


def _exists(filename: str, dir_fd: int) -> bool:
    try:
        os.stat(filename, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
