"""The committed lock of an engine's bundle (e.g. recipes/gpu-host/vllm.lock): every wheel by name, version and
sha256, so that a bundle made from it brings exactly those files and never asks an index which version to take.

Why: the closure walk (bundle_closure) takes the newest version that fits, so a release on the registry can break a
bundle that worked days before (2026-12-06: opentelemetry-api 1.45.3 against opentelemetry-sdk 1.45.2). With a lock,
only an explicit refresh (`gptools bundle --write-lock`, `make bundle-lock`) resolves again.

- Index wheels are locked by file name and sha256. The file comes from a cache keyed by that sha256 (the one
  `make build` uses: <GP_CACHE_DIR>/sha256/<sha256>/<file>), else it is downloaded by its file name from the index
  ($GP_INDEX_URL) and checked before it enters the cache: a warm cache needs no network. A file whose sha256 is not
  the lock's fails closed, naming the file, the expected and the actual sha256; nothing is fetched again silently.
- Our own dist/ wheels (engine, runtime, libraries such as deep_ep) are outputs of this commit's `make build`: locked
  by name and version only (their sha256 changes with every commit).
- The lock records the inputs the resolution depended on (target, host freeze, the resolution options); a bundle whose
  inputs differ is refused as stale, one line per input, so an edit of the options file is never silently ignored.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import threading
import tomllib
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

from gpdist import fetch as gpfetch
from gptools.bundle_closure import DIST

FORMAT = "gpbundle-lock/1"
CHUNK = 1 << 20


class LockError(Exception):
    """The lock cannot be used as it is: one line per problem, then one line of advice."""

    def __init__(self, lines: list[str], advice: str):
        super().__init__("\n".join([*lines, advice]))
        self.lines = lines
        self.advice = advice


@dataclass(frozen=True)
class Inputs:
    """What the resolution depended on; a bundle made from the lock must be asked for with the same."""

    python: str
    glibc: str
    host_freeze_sha256: str  # "" without --host-freeze
    prefer: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    require: tuple[str, ...] = ()
    with_library: tuple[str, ...] = ()
    accept_host: tuple[str, ...] = ()

    def differences(self, live: Inputs) -> list[str]:
        """One line per input that differs: `prefer: locked [...], live [...]`."""
        out = []
        for f in fields(self):
            locked, now = getattr(self, f.name), getattr(live, f.name)
            if locked != now:
                out.append(f"{f.name}: locked {_show(locked)}, live {_show(now)}")
        return out


def _show(value: str | tuple[str, ...]) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(value) + "]"
    return value or "none"


@dataclass(frozen=True)
class Entry:
    """One bundled wheel. Index wheels carry `file`, `sha256` and `size`; dist/ wheels (source "dist") only name and
    version."""

    name: str
    version: str
    source: str
    why: str = ""
    note: str = ""
    required_by: tuple[str, ...] = ()
    file: str = ""
    sha256: str = ""
    size: int = 0

    @property
    def from_dist(self) -> bool:
        return self.source == DIST


@dataclass(frozen=True)
class Held:
    """A requirement the bundle does not carry (the host's, excluded, accepted): recorded so the lock tells it all."""

    name: str
    version: str
    source: str
    note: str = ""
    required_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lock:
    engine: str
    locked: str  # when the resolution ran (UTC)
    host_freeze: str  # the freeze file's path as given (its sha256 is an input)
    inputs: Inputs
    wheels: tuple[Entry, ...]
    not_bundled: tuple[Held, ...] = field(default=())


# --------------------------------------------------------------------------------------------------------------------
# The file: TOML, written here (a fixed schema of strings, ints and string lists)

HEADER = """\
# The {engine} bundle's lock: every wheel it carries by name, version and sha256 (dist/ wheels, built from this
# commit, by name and version). `make bundle ENGINE={engine}` brings exactly these files (cached by sha256; offline
# once cached) and never asks an index which version to take. Written by `make bundle-lock ENGINE={engine}`, the only
# step that resolves against the index; do not edit by hand (tools/gptools/bundle_lock.py says why).
"""


def _toml(value: str | int | tuple[str, ...]) -> str:
    """A JSON string or list of strings is a valid TOML basic string or array; a long array gets one item a line,
    so that a refresh's diff shows what changed."""
    if not isinstance(value, tuple):
        return json.dumps(value, ensure_ascii=False)
    flat = json.dumps(list(value), ensure_ascii=False)
    if len(flat) <= 100:
        return flat
    return "[\n" + "".join(f"  {json.dumps(v, ensure_ascii=False)},\n" for v in value) + "]"


def _table(record: object, skip_empty: Iterable[str] = ()) -> str:
    lines = []
    for f in fields(record):
        value = getattr(record, f.name)
        if f.name in skip_empty and not value:
            continue
        lines.append(f"{f.name} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def render(lock: Lock) -> str:
    out = [HEADER.format(engine=lock.engine)]
    out.append(f"format = {_toml(FORMAT)}\nengine = {_toml(lock.engine)}\nlocked = {_toml(lock.locked)}\n")
    out.append(f"host_freeze = {_toml(lock.host_freeze)}\n\n[inputs]\n{_table(lock.inputs)}")
    for w in lock.wheels:
        out.append("\n[[wheel]]\n" + _table(w, skip_empty=("file", "sha256", "size") if w.from_dist else ()))
    for h in lock.not_bundled:
        out.append("\n[[not_bundled]]\n" + _table(h))
    return "".join(out)


def write(path: Path, lock: Lock) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(lock))
    tmp.replace(path)


def _record(cls: type, raw: dict, where: str):
    names = {f.name for f in fields(cls)}
    if unknown := sorted(set(raw) - names):
        raise ValueError(f"{where}: unknown keys {', '.join(unknown)}")
    try:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def load(path: Path) -> Lock:
    """Read and check a lock file; a missing, garbled or incomplete one is a LockError naming what is wrong."""
    advice = "refresh it with `make bundle-lock ENGINE=<engine>` (gptools bundle --write-lock)"
    if not path.is_file():
        raise LockError([f"lock {path}: no such file"], advice)
    try:
        raw = tomllib.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
        wheels = tuple(_record(Entry, w, f"wheel {i}") for i, w in enumerate(raw.get("wheel", [])))
        lock = Lock(
            engine=raw["engine"],
            locked=raw.get("locked", ""),
            host_freeze=raw.get("host_freeze", ""),
            inputs=_record(Inputs, raw["inputs"], "inputs"),
            wheels=wheels,
            not_bundled=tuple(_record(Held, h, f"not_bundled {i}") for i, h in enumerate(raw.get("not_bundled", []))),
        )
    except (tomllib.TOMLDecodeError, KeyError, ValueError, UnicodeDecodeError) as exc:
        raise LockError([f"lock {path}: unreadable ({exc})"], advice) from None
    bad = [w.name for w in wheels if not w.from_dist and (len(w.sha256) != 64 or not w.file.endswith(".whl"))]
    if bad:
        raise LockError([f"lock {path}: {name}: an index wheel needs its file and a sha256" for name in bad], advice)
    return lock


# --------------------------------------------------------------------------------------------------------------------
# Files by sha256: the cache, the download, the check that the index still serves them


def cached_path(entry: Entry) -> Path:
    """Where the file lives in gpdist's cache: the same layout `make build` uses for pinned artifacts."""
    return gpfetch.cache_dir() / "sha256" / entry.sha256 / entry.file


def fetch(entry: Entry, offline: bool = False, log: Callable[[str], None] = lambda s: None) -> Path:
    """The locked file, verified: from the cache, else downloaded by its name (never a cached or downloaded file whose
    sha256 differs from the lock's; such a file is refused, not replaced)."""
    path = cached_path(entry)
    if path.exists():
        got = gpfetch.sha256_file(path)
        if got != entry.sha256:
            raise LockError([f"{entry.file}: cached copy {path} has sha256 {got}, the lock says {entry.sha256}"], "")
        return path
    if offline:
        raise LockError([f"{entry.file}: not in the cache ({path}) and --offline was given"], "")
    try:
        url, advertised = gpfetch.resolve_url(entry.name, entry.file)
    except gpfetch.FetchError as exc:
        raise LockError([f"{entry.file}: {exc}"], "") from None
    if advertised and advertised.lower() != entry.sha256:
        raise LockError(
            [f"{entry.file}: the index advertises sha256 {advertised.lower()}, the lock says {entry.sha256}"], ""
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"  downloading {entry.file} ({entry.size / 2**20:.1f} MiB)")
    _download(url, path, entry)
    return path


def _download(url: str, dest: Path, entry: Entry) -> None:
    """Download to a temporary name, hashing as it goes; only a file with the lock's sha256 gets the cache's name."""
    tmp = dest.with_name(f"{dest.name}.part.{os.getpid()}.{threading.get_ident()}")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, tmp.open("wb") as out:
            while chunk := resp.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
        if digest.hexdigest() != entry.sha256:
            raise LockError(
                [f"{entry.file}: downloaded sha256 {digest.hexdigest()}, the lock says {entry.sha256} (not used)"], ""
            )
        tmp.replace(dest)
    except (OSError, http.client.HTTPException) as exc:
        raise LockError([f"{entry.file}: download failed ({exc})"], "") from None
    finally:
        tmp.unlink(missing_ok=True)


def fetch_all(
    entries: Iterable[Entry], offline: bool = False, log: Callable[[str], None] = lambda s: None, workers: int = 6
) -> dict[str, Path]:
    """{file: verified path} for every index wheel; every failure is collected, then one LockError lists them all."""
    todo = [e for e in entries if not e.from_dist]
    problems: list[str] = []
    out: dict[str, Path] = {}

    def one(entry: Entry) -> None:
        try:
            out[entry.file] = fetch(entry, offline, log)
        except LockError as exc:
            problems.extend(exc.lines)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(one, todo))
    if problems:
        raise LockError(
            sorted(problems),
            "refusing to bundle: a locked file is never replaced by another. Delete a corrupted cached copy and run "
            "again (it is downloaded and checked); if the index serves other bytes, review it and refresh the lock "
            "with `make bundle-lock`",
        )
    return out


def check_on_index(entries: Iterable[Entry], workers: int = 8) -> list[str]:
    """Problems that would stop a later bundle from downloading the locked files: each index wheel must be listed by
    the index ($GP_INDEX_URL) with the same sha256 (a wheel pip found elsewhere, e.g. a find-links folder, is not)."""
    todo = [e for e in entries if not e.from_dist]

    def one(entry: Entry) -> str:
        try:
            _, advertised = gpfetch.resolve_url(entry.name, entry.file)
        except gpfetch.FetchError as exc:
            return f"{entry.file}: {exc}"
        if advertised.lower() != entry.sha256:
            got = advertised.lower() or "none"
            return f"{entry.file}: the index advertises sha256 {got}, the file has {entry.sha256}"
        return ""

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return [p for p in pool.map(one, todo) if p]


def seed_cache(entry: Entry, path: Path) -> None:
    """Put a resolved file where the lock path looks for it, so the bundle after a refresh needs no second download."""
    dest = cached_path(entry)
    if dest.exists() and (dest.samefile(path) or gpfetch.sha256_file(dest) == entry.sha256):
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.part.{os.getpid()}")
    shutil.copyfile(path, tmp)
    tmp.replace(dest)
