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
same time) is kept. The tar is read by this module's own parser (read_members), every header field checked, before
anything is written: only regular files and folders with plain relative names below a named cache folder, each
listed once, in a POSIX (pax) tar that ends where it should; anything else is a JitCacheError. The files are then
written into a staging folder inside each cache folder and renamed into place, so a reader never sees half a
file, and a restore that fails (a folder that cannot be written, a link below a cache folder: no link is followed
there) takes back everything it put in: the cache folders are left as they were.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import secrets
import shutil
import stat
import tarfile
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from graphpersist.archive.shown import shown
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

    The whole tar is read and checked first (read_members); the files are then written into a staging folder
    inside each cache folder and renamed into place from there. A refusal, or a folder that cannot be written,
    undoes every change: the cache folders are left as they were. A name whose folder is not configured here (say
    FlashInfer is not installed on this host) is skipped and counted. Several processes may restore the same blob
    into the same folders at once.
    """
    for name in dirs:
        _check_name(name)
    members = read_members(blob)
    stats = CacheStats()
    unconfigured = sum(1 for m in members if m.cache not in dirs and not m.folder)
    if unconfigured:
        stats.skipped["unconfigured"] += unconfigured
    job = _Job(blob, stats)
    try:
        for name in sorted({m.cache for m in members if m.cache in dirs}):
            job.stage(Path(dirs[name]), [m for m in members if m.cache == name])
        job.place()
    except BaseException as exc:
        job.undo()
        if isinstance(exc, OSError):
            raise JitCacheError(_unwritable(job.at, exc)) from None
        raise
    return stats


def validate(blob: bytes) -> int:
    """Refuses (JitCacheError, as restore() words it) the blobs restore() refuses, writing nothing: the same reading
    (read_members). What `graphpersist check` runs, so that it refuses the caches a LOAD would. Returns the number
    of members."""
    return len(read_members(blob))


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

_BLOCK = 512
_MAX_PAX = 1 << 16  # collect's extended headers hold a path and a time: a longer one is not one of them
_MAX_PATH, _MAX_COMPONENT = 4096, 255  # Linux's PATH_MAX and NAME_MAX, in bytes
_PAX_KEYS = frozenset({"path", "mtime", "hdrcharset"})  # what collect's tarfile writes (hdrcharset: a non-UTF-8 name)
_HDRCHARSETS = frozenset({"BINARY", "ISO-IR 10646 2000 UTF-8"})
_PAX_RECORD = re.compile(rb"([1-9][0-9]{0,5}) ")
_PAX_TIME = re.compile(r"(-?)([0-9]{1,11})(?:\.([0-9]{1,9}))?")
_OCTAL = re.compile(rb"[0-7]*")
_NS_LIMIT = 1 << 63  # os.utime takes nanoseconds as a 64-bit number: 1677 to 2262
_NOT_FILES = {
    b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device", b"4": "a block device", b"6": "a FIFO",
    b"7": "a contiguous file", b"g": "a global pax header", b"S": "a GNU sparse file", b"L": "a GNU long name",
    b"K": "a GNU long link name", b"D": "a GNU folder dump", b"M": "a GNU multi-volume part",
    b"N": "a GNU old long name", b"V": "a GNU volume label",
}  # fmt: skip
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\xfd7zXZ\x00": "xz", b"BZh": "bzip2", b"\x28\xb5\x2f\xfd": "zstd"}
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FOLDERS = 256  # folders a restore keeps open at once (a cache has thousands; the descriptors are limited)
_REFUSAL_ADVICE = "nothing was restored. The archive was not written by graphpersist's SAVE: re-run with mode=save"


@dataclass(frozen=True)
class Member:
    """One member of a JIT-cache tar, read and checked: a regular file or a folder below a named cache folder."""

    name: str  # <cache name>/<path in the folder>
    folder: bool
    offset: int  # where its bytes start in the blob
    size: int
    executable: bool
    mtime_ns: int

    @property
    def cache(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def rel(self) -> str:
        return self.name.split("/", 1)[1]


@dataclass(frozen=True)
class _Header:
    """The fields of one 512-byte tar header that restore uses, each parsed (the others are parsed and checked)."""

    name: str
    kind: bytes
    size: int
    mode: int
    mtime: int


class _Refused(Exception):
    """Why the tar is refused, as the sentence's end: "are not a readable tar: ..." or "hold a member ..."."""


def read_members(blob: bytes | memoryview) -> list[Member]:
    """Every member of a JIT-cache tar, in order, each header field parsed and checked; JitCacheError for anything
    but a POSIX (pax) tar of regular files and folders with plain names below a named cache folder, each listed
    once, its bytes inside the blob, ended by two zero blocks. Writes nothing. Not tarfile: its parsing raises bare
    ValueError or OverflowError on a pax `mtime` of `nan`, `inf` or 25 digits or a malformed sparse member."""
    view = memoryview(blob)
    members: list[Member] = []
    pos, pax = 0, None  # pax: the extended header that applies to the next member
    try:
        packed = next((kind for magic, kind in _COMPRESSED.items() if view[: len(magic)] == magic), None)
        if packed:
            raise _Refused(f"are not a readable tar: it is compressed ({packed}); SAVE writes an uncompressed tar")
        while True:
            if pos + _BLOCK > len(view):
                raise _Refused(f"are not a readable tar: it ends at byte {len(view)} without its end-of-archive "
                               "blocks (truncated)")  # fmt: skip
            block = bytes(view[pos : pos + _BLOCK])
            if block.count(0) == _BLOCK:  # the end-of-archive marker
                _check_end(view, pos, pax is not None)
                break
            header = _header(block, pos)
            data_end = pos + _BLOCK + -(-header.size // _BLOCK) * _BLOCK
            if header.kind == b"x":
                if pax is not None:
                    raise _Refused(f"are not a readable tar: two pax headers in a row at byte {pos}")
                _inside(view, pos, header.size, data_end, "the pax header")
                pax = _pax(view[pos + _BLOCK : pos + _BLOCK + header.size], pos)
            else:
                member = _read_member(header, pax or {}, pos)
                _inside(view, pos, header.size, data_end, f"member {_shown_name(member.name)}")
                members.append(member)
                pax = None
            pos = data_end
    except _Refused as exc:
        raise JitCacheError(f"graphpersist: the archive's JIT caches {exc}: {_REFUSAL_ADVICE}") from None
    _check_tree(members)
    return members


def _shown_name(name: str) -> str:
    return shown(repr(name[:200]))


def _check_end(view: memoryview, pos: int, pending_pax: bool) -> None:
    """The end of the archive: two zero blocks, then nothing but zeros to a whole block."""
    if pending_pax:
        raise _Refused(f"are not a readable tar: the pax header before byte {pos} has no member")
    chunks = (bytes(view[at : at + (1 << 20)]) for at in range(pos, len(view), 1 << 20))  # never the rest at once
    if len(view) - pos < 2 * _BLOCK or len(view) % _BLOCK or any(c.count(0) != len(c) for c in chunks):
        raise _Refused(f"are not a readable tar: its end at byte {pos} is not two zero blocks and zero padding "
                       "(truncated, or bytes after its end)")  # fmt: skip


def _inside(view: memoryview, pos: int, size: int, end: int, what: str) -> None:
    if end > len(view):
        raise _Refused(f"are not a readable tar: {what} (header at byte {pos}) claims {size} bytes, past the tar's "
                       f"end at byte {len(view)} (truncated)")  # fmt: skip


def _header(block: bytes, pos: int) -> _Header:
    """One ustar header's fields, each parsed strictly (octal numbers, the checksum, the magic)."""
    if block[257:265] != b"ustar\x0000":
        raise _Refused(f"are not a readable tar: the block at byte {pos} is not a POSIX tar header (magic "
                       f"{block[257:265]!r})")  # fmt: skip
    declared = _octal(block, 148, 8, "checksum", pos)
    outside = block[:148] + block[156:]
    unsigned = sum(outside) + 8 * 0x20  # the checksum field counts as spaces
    # Some writers sum signed bytes; that sum is only computed when the usual one does not match (it was most of a
    # restore's time for a JIT cache of 654 files).
    if declared != unsigned and declared != unsigned - 256 * sum(1 for b in outside if b & 0x80):
        raise _Refused(f"are not a readable tar: the header at byte {pos} says checksum {declared}, its bytes sum "
                       f"to {unsigned} (damaged)")  # fmt: skip
    for field_name, start, length in (("uid", 108, 8), ("gid", 116, 8), ("devmajor", 329, 8), ("devminor", 337, 8)):
        _octal(block, start, length, field_name, pos)  # unused, but a header with garbage in them is no header
    name, prefix = _text(block[0:100]), _text(block[345:500])
    return _Header(
        name=f"{prefix}/{name}" if prefix else name,
        kind=block[156:157],
        size=_octal(block, 124, 12, "size", pos),
        mode=_octal(block, 100, 8, "mode", pos),
        mtime=_octal(block, 136, 12, "mtime", pos),
    )


def _octal(block: bytes, start: int, length: int, what: str, pos: int) -> int:
    raw = block[start : start + length]
    text = raw.rstrip(b"\0 ").lstrip(b" ")
    if raw[0] & 0x80 or not _OCTAL.fullmatch(text):
        raise _Refused(f"are not a readable tar: the header at byte {pos} has {what} {raw!r}, not an octal number")
    return int(text, 8) if text else 0


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: memoryview, pos: int) -> dict[str, str]:
    """A pax extended header's records ("<length> <key>=<value>\\n" each); only the keys collect writes."""
    if len(data) > _MAX_PAX:
        raise _Refused(f"are not a readable tar: the pax header at byte {pos} holds {len(data)} bytes (at most "
                       f"{_MAX_PAX})")  # fmt: skip
    raw, at, records = bytes(data), 0, {}
    while at < len(raw):
        m = _PAX_RECORD.match(raw, at)
        stop = at + int(m[1]) if m else 0
        key, sep, value = raw[m.end() : stop - 1].partition(b"=") if m else (b"", b"", b"")
        if not m or stop > len(raw) or stop <= m.end() or raw[stop - 1] != 0x0A or not sep:
            raise _Refused(f"are not a readable tar: the pax header at byte {pos} is malformed at its byte {at}")
        name = key.decode("ascii", "backslashreplace")
        if name not in _PAX_KEYS or name in records:
            why = "twice" if name in records else "a key SAVE does not write (path, mtime, hdrcharset)"
            raise _Refused(f"are not a readable tar: the pax header at byte {pos} holds {shown(repr(name), 60)}: {why}")
        records[name] = value.decode("utf-8", "surrogateescape")
        at = stop
    if records.get("hdrcharset", "BINARY") not in _HDRCHARSETS:
        raise _Refused(f"are not a readable tar: the pax header at byte {pos} names an unknown character set")
    return records


def _read_member(header: _Header, pax: dict[str, str], pos: int) -> Member:
    """The member a header (and the pax header before it) describes, refused unless a regular file or a folder
    with a plain name below a named cache folder and a time os.utime can set."""
    name = pax.get("path", header.name)
    folder = header.kind == b"5"
    if folder and name.endswith("/"):
        name = name[:-1]
    if header.kind not in (b"0", b"\0", b"5"):
        kind = _NOT_FILES.get(header.kind, f"of type {header.kind!r}")
        raise _Refused(f"hold a member {_shown_name(name)} (header at byte {pos}) that is {kind}, not a regular "
                       "file or folder")  # fmt: skip
    problem = _name_problem(name)
    if problem is None and folder and header.size:
        problem = f"is a folder that claims {header.size} bytes"
    if problem is not None:
        raise _Refused(f"hold a member {_shown_name(name)} that {problem}")
    mtime_ns = header.mtime * 1_000_000_000
    if "mtime" in pax:
        mtime_ns = _pax_mtime(pax["mtime"], name)
    return Member(name, folder, pos + _BLOCK, header.size, bool(header.mode & 0o111), mtime_ns)


def _name_problem(name: str) -> str | None:
    parts = name.split("/")
    if name.startswith("/"):
        return "has an absolute path"
    if any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
        return "is not a plain relative path ('..', '.', '//' or '\\')"
    if len(parts) < 2 or not NAME.fullmatch(parts[0]):
        return "does not lie in a named cache folder"
    if len(os.fsencode(name)) > _MAX_PATH or any(len(os.fsencode(p)) > _MAX_COMPONENT for p in parts):
        return f"is longer than a path may be ({_MAX_PATH} bytes, {_MAX_COMPONENT} per name)"
    return None


def _pax_mtime(text: str, name: str) -> int:
    """A pax `mtime` (seconds since 1970, at most 9 decimals) in nanoseconds; refused unless os.utime can set it."""
    m = _PAX_TIME.fullmatch(text)
    if m:
        ns = int(m[2]) * 1_000_000_000 + int((m[3] or "").ljust(9, "0"))
        ns = -ns if m[1] else ns
        if -_NS_LIMIT < ns < _NS_LIMIT:
            return ns
    raise _Refused(f"hold a member {_shown_name(name)} whose pax mtime {shown(repr(text[:40]))} is not a time SAVE "
                   "writes (seconds since 1970 with at most 9 decimals, 1677 to 2262)")  # fmt: skip


def _check_tree(members: list[Member]) -> None:
    """Refuses a name listed twice and a file that other members lie below (it would have to be a folder too)."""
    ordered = sorted(members, key=lambda m: m.name.split("/"))  # a name's descendants follow it directly
    for a, b in itertools.pairwise(ordered):
        problem = None
        if a.name == b.name:
            problem = "is listed twice"
        elif not a.folder and b.name.startswith(a.name + "/"):
            problem = f"is a file, and {_shown_name(b.name)} lies below it"
        if problem:
            raise JitCacheError(
                f"graphpersist: the archive's JIT caches hold a member {_shown_name(a.name)} that {problem}: "
                f"{_REFUSAL_ADVICE}"
            )


class _Folders:
    """Folders below `root` (itself reached through links, as a cache folder on another disk is), each opened
    without following a link and made where missing; `made` records the ones made (None: not recorded)."""

    def __init__(self, root: Path, made: list[Path] | None) -> None:
        self.root, self.made = root, made
        self.fds = {"": os.open(root, _FOLDER)}

    def __enter__(self) -> _Folders:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def fd(self, rel: str) -> int:
        """The open folder `rel` below root ("": root)."""
        if rel in self.fds:
            return self.fds[rel]
        if len(self.fds) > _OPEN_FOLDERS:
            for key in [k for k in self.fds if k]:
                os.close(self.fds.pop(key))
        missing, at = [], rel
        while at not in self.fds:
            missing.append(at)
            at = at.rpartition("/")[0]
        fd = self.fds[at]
        for folder in reversed(missing):
            name = folder.rpartition("/")[2]
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
                if self.made is not None:
                    self.made.append(self.root / folder)
            except FileExistsError:
                pass
            fd = self.fds[folder] = os.open(name, _FOLDER | os.O_NOFOLLOW, dir_fd=fd)
        return fd


class _Job:
    """One restore's changes to the live cache folders, recorded so that a failure undoes every one of them: the
    members are first written into a staging folder inside each cache folder, then renamed into place."""

    def __init__(self, blob: bytes | memoryview, stats: CacheStats) -> None:
        self.view = memoryview(blob)
        self.stats = stats
        self.made: list[Path] = []  # folders this restore made, in order (cache folders and their parents too)
        self.placed: list[Path] = []  # files it renamed into place
        self.staged: list[tuple[Path, Path, list[Member]]] = []  # (cache folder, its staging folder, members)
        self.at: Path | None = None  # what it was writing: the error names it

    def stage(self, root: Path, members: list[Member]) -> None:
        """Writes the `members` that `root` lacks into a new staging folder inside it (made, with its parents, where
        missing); the others are kept. Nothing is made when it lacks none (a warm or read-only cache folder)."""
        self.at = root
        lacking = [m for m in members if not os.path.lexists(root / m.rel)]
        kept = sum(1 for m in members if not m.folder) - sum(1 for m in lacking if not m.folder)
        if kept:
            self.stats.kept[members[0].cache] = kept
        if not lacking:
            return
        members = lacking
        missing, up = [], root
        while not os.path.lexists(up):
            missing.append(up)
            up = up.parent
        root.mkdir(parents=True, exist_ok=True)
        self.made += reversed(missing)
        staging = root / f".gp-restore-{os.getpid()}-{secrets.token_hex(4)}.tmp"  # a name collect leaves out
        os.mkdir(staging, 0o700)
        self.staged.append((root, staging, members))
        with _Folders(staging, None) as folders:
            for m in members:
                self.at = root / m.rel
                parent, _, filename = m.rel.rpartition("/")
                if m.folder:
                    folders.fd(m.rel)
                    continue
                mode = 0o755 if m.executable else 0o644  # never set-user-ID or writable by others, whatever it says
                with open(os.open(filename, _CREATE, mode, dir_fd=folders.fd(parent)), "wb") as fh:
                    fh.write(self.view[m.offset : m.offset + m.size])
                    fh.flush()
                    os.utime(fh.fileno(), ns=(m.mtime_ns, m.mtime_ns))

    def place(self) -> None:
        """Renames each staged file into its cache folder unless something is there already (kept), then removes
        the staging folders. Below a cache folder no link is followed."""
        for root, staging, members in self.staged:
            with _Folders(root, self.made) as live, _Folders(staging, None) as staged:
                for m in members:
                    self.at = root / m.rel
                    if m.folder:
                        live.fd(m.rel)
                        continue
                    parent, _, filename = m.rel.rpartition("/")
                    into = live.fd(parent)
                    if _exists(filename, into):  # this host's own, or another rank's restore was first
                        self.stats.kept[m.cache] = self.stats.kept.get(m.cache, 0) + 1
                        continue
                    os.rename(filename, filename, src_dir_fd=staged.fd(parent), dst_dir_fd=into)
                    self.placed.append(self.at)
                    self.stats.count(m.cache, m.size)
                    self.stats.written.append(str(self.at))
        self.at = None
        while self.staged:
            shutil.rmtree(self.staged.pop()[1])

    def undo(self) -> None:
        """Takes back what this restore put into the cache folders, each step on its own (best effort)."""
        for path in reversed(self.placed):
            with contextlib.suppress(OSError):
                os.unlink(path)
        for _root, staging, _members in self.staged:
            shutil.rmtree(staging, ignore_errors=True)
        for path in reversed(self.made):
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _unwritable(at: Path | None, exc: OSError) -> str:
    return (
        f"graphpersist: cannot restore the JIT cache file {shown(str(at))}: {exc.strerror or exc}; nothing was "
        "restored. Make the folder writable (or point its variable at one that is), or remove what stands in the way"
    )


def _exists(filename: str, dir_fd: int) -> bool:
    try:
        os.stat(filename, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
