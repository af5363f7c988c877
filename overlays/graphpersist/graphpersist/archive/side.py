"""Staging and trash folders next to an archive, and whether the writer that made one is still running.

Their names carry the writer's identity: `<root>.partial-<pid>-<start>-<scope>-<random>` (also `.trash-`),
where <start> is the process start time (field 22 of /proc/<pid>/stat, clock ticks since boot; 0 where
unknown) and <scope> 8 hex digits of a hash of the boot id and the pid namespace. A folder is dead when its
pid is gone, or now belongs to a process that started at another time (the pid was reused); a folder from
another boot, host or pid namespace (other scope) is never judged: its pid means nothing here. The older
`<root>.partial-<pid>-<random>` names are still read and judged by pid alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from graphpersist.archive.base import ArchiveError, Problem

_SIDE_NAME = re.compile(r"\.(partial|trash)-([0-9]+)-(?:([0-9]+)-([0-9a-f]{8})-)?([0-9a-f]+)")


@dataclass(frozen=True)
class _SideFolder:
    path: Path
    kind: str  # "partial" or "trash"
    pid: int
    start: int | None  # None: old name (pid only); 0: the start time was unknown
    scope: str | None


def _side_path(archive_dir: Path, kind: str) -> Path:
    pid = os.getpid()
    return archive_dir.with_name(
        f"{archive_dir.name}.{kind}-{pid}-{_start_time(pid) or 0}-{_scope()}-{secrets.token_hex(4)}"
    )


def _side_folders(archive_dir: Path) -> list[_SideFolder]:
    """Staging and trash folders next to `archive_dir`, newest first."""
    try:
        entries = list(archive_dir.parent.iterdir())
    except OSError:  # no parent folder, or one we may not list
        return []
    found = []
    for path in entries:
        if not path.name.startswith(f"{archive_dir.name}."):
            continue
        match = _SIDE_NAME.fullmatch(path.name[len(archive_dir.name) :])
        if match:
            kind, pid, start, scope, _ = match.groups()
            found.append(_SideFolder(path, kind, int(pid), None if start is None else int(start), scope))
    return sorted(found, key=lambda f: (_mtime(f.path), f.path.name), reverse=True)


def _trash_folders(archive_dir: Path) -> list[_SideFolder]:
    return [f for f in _side_folders(archive_dir) if f.kind == "trash"]


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


def remove_stale_partials(archive_dir: Path | str) -> list[Path]:
    """Deletes staging/trash folders next to `archive_dir` whose writer is dead; returns what it deleted.

    A trash folder is never deleted while `archive_dir` is missing: it then holds the only whole archive (a replacing
    SAVE died between its two renames), and open_archive names it so it can be renamed back.
    """
    archive_dir = Path(os.path.abspath(archive_dir))
    removed = []
    for folder in _side_folders(archive_dir):
        if folder.kind == "trash" and not archive_dir.exists():
            continue
        if _writer_state(folder) == "dead":
            shutil.rmtree(folder.path, ignore_errors=True)
            removed.append(folder.path)
    return removed


def _missing_root(archive_dir: Path) -> ArchiveError:
    """The error for a missing archive, naming what a SAVE left next to it (and how to get the archive back)."""
    trash = _trash_folders(archive_dir)
    if trash:
        newest = trash[0]
        others = f" (older: {', '.join(f.path.name for f in trash[1:])})" if len(trash) > 1 else ""
        restore = f"mv '{newest.path}' '{archive_dir}'"
        state = _writer_state(newest)
        if state == "alive":
            return ArchiveError(
                archive_dir,
                Problem(f"no such directory: a SAVE (pid {newest.pid}) is replacing it right now; the previous "
                        f"archive is in {newest.path.name}{others}", "changed"),
                advice="Try again when that SAVE has finished.",
            )  # fmt: skip
        who = (
            "a SAVE that was replacing it stopped between its two renames"
            if state == "dead"
            else f"a SAVE on another host or container (pid {newest.pid} there) was replacing it"
        )
        return ArchiveError(
            archive_dir,
            Problem(
                f"no such directory: {who}; the previous archive is whole in {newest.path.name}{others}", "missing"
            ),
            advice=f"To load it, rename it back: {restore}" + ("" if state == "dead" else " (once no SAVE runs)"),
        )
    partials = [f for f in _side_folders(archive_dir) if f.kind == "partial"]
    hint = f" (an unfinished SAVE left {partials[0].path.name}; it is not loadable)" if partials else ""
    return ArchiveError(archive_dir, Problem(f"no such directory{hint}", "missing"))


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
