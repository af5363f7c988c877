"""Download pinned artifacts once into a cache keyed by sha256, and never hand out a file that fails its hash.

The cache lives outside the repository ($GP_CACHE_DIR, else $XDG_CACHE_HOME/graphpersist-dist, else
~/.cache/graphpersist-dist). A cached file is re-hashed on every use, so a warm cache needs no network at all.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpdist.pins import Artifact

INDEX_URL = os.environ.get("GP_INDEX_URL", "https://pypi.org/simple")
CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A pinned artifact could not be obtained or failed verification."""


def cache_dir() -> Path:
    if os.environ.get("GP_CACHE_DIR"):
        return Path(os.environ["GP_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "graphpersist-dist"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cached_path(artifact: Artifact) -> Path:
    return cache_dir() / "sha256" / artifact.sha256 / artifact.filename


def resolve_url(project: str, filename: str) -> tuple[str, str]:
    """Ask the index (PEP 691 JSON) for the download URL and the sha256 it advertises for one file name."""
    req = urllib.request.Request(f"{INDEX_URL}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            listing = json.load(resp)
    except (urllib.error.URLError, TimeoutError) as exc:
        raise FetchError(
            f"cannot reach the package index for {project} ({exc}); "
            "check the network, or warm the cache on a connected machine and copy it to $GP_CACHE_DIR"
        ) from exc
    for entry in listing.get("files", []):
        if entry["filename"] == filename:
            return entry["url"], entry.get("hashes", {}).get("sha256", "")
    raise FetchError(f"the index lists no file {filename} for project {project}")


def _download(url: str, dest: Path, label: str) -> None:
    tmp = dest.with_name(dest.name + f".part.{os.getpid()}")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, tmp.open("wb") as out:
            total = int(resp.headers.get("Content-Length") or 0)
            done = 0
            last = 0.0
            while chunk := resp.read(CHUNK):
                out.write(chunk)
                done += len(chunk)
                now = time.monotonic()
                if now - last > 1.0 or done == total:
                    last = now
                    pct = f"{100 * done / total:5.1f}%" if total else ""
                    print(f"\r  {label}: {done / 2**20:8.1f} MiB {pct}", end="", file=sys.stderr, flush=True)
        print(f"  ({time.monotonic() - start:.1f} s)", file=sys.stderr)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)


def _download_or_explain(url: str, dest: Path, label: str) -> None:
    """A failed transfer (HTTP error, reset, time-out, short read) becomes one FetchError line, never a traceback."""
    try:
        _download(url, dest, label)
    except (OSError, http.client.HTTPException) as exc:
        raise FetchError(f"downloading {label} failed ({exc}); check the network and run the build again") from exc


def fetch(artifact: Artifact, offline: bool = False) -> Path:
    """Return a verified local copy of the artifact, downloading it at most once.

    Every call hashes the file: callers hash a file once per build by passing the returned path on (see
    gpdist.unpack.upstream_tree) instead of calling fetch again."""
    path = cached_path(artifact)
    if path.exists():
        actual = sha256_file(path)
        if actual == artifact.sha256:
            print(f"gpdist: using cached {artifact.filename} (sha256 verified)", file=sys.stderr)
            return path
        failed = f"cached {artifact.filename} failed its sha256 (expected {artifact.sha256}, got {actual})"
        if offline:
            raise FetchError(f"{failed}; not fetching again because --offline: delete {path} or build online")
        path.unlink()
        print(f"gpdist: {failed}; deleted it, fetching again", file=sys.stderr)
    if offline:
        raise FetchError(f"{artifact.filename} is not in the cache ({path}) and --offline was given")
    url, advertised = resolve_url(artifact.project, artifact.filename)
    if advertised and advertised.lower() != artifact.sha256:
        raise FetchError(
            f"{artifact.filename}: the index advertises sha256 {advertised}, pins.toml says {artifact.sha256}; "
            "refusing to download. If upstream re-published the file, review it and update build/pins.toml."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"gpdist: downloading {artifact.filename}", file=sys.stderr)
    _download_or_explain(url, path, artifact.filename)
    actual = sha256_file(path)
    if actual != artifact.sha256:
        path.unlink()
        raise FetchError(
            f"{artifact.filename}: sha256 mismatch: expected {artifact.sha256} (build/pins.toml), "
            f"got {actual}. The file was deleted and not used."
        )
    size = path.stat().st_size
    if artifact.size is not None and size != artifact.size:
        path.unlink()
        raise FetchError(f"{artifact.filename}: size {size} != pinned {artifact.size}; deleted")
    print(f"gpdist: verified {artifact.filename} sha256 {artifact.sha256[:16]}…", file=sys.stderr)
    return path


def fetch_unpinned(project: str, filename: str) -> tuple[Path, str]:
    """Fetch a file that is not pinned yet (rebase onto a new release); trust the index's sha256, say so."""
    url, advertised = resolve_url(project, filename)
    if not advertised:
        raise FetchError(f"the index gives no sha256 for {filename}; cannot verify it")
    artifact = Artifact(project=project, filename=filename, sha256=advertised.lower())
    path = cached_path(artifact)
    if not (path.exists() and sha256_file(path) == artifact.sha256):
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"gpdist: downloading {filename} (not pinned; verified against the index's sha256)", file=sys.stderr)
        _download_or_explain(url, path, filename)
        if sha256_file(path) != artifact.sha256:
            path.unlink()
            raise FetchError(f"{filename}: downloaded file does not match the index's sha256; deleted")
    return path, artifact.sha256
