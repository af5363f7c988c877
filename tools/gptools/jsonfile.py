"""JSON files that may be stored gzipped: `<name>.json` and `<name>.json.gz` read alike.

A proof report of an engine-sized run is up to 1 MB of JSON (every run's result, stats and log tail) and about
30 KB gzipped, so the proof runner writes `report.json.gz` and recipes commit that. Readers name the file either way
and get whichever of the two exists, so a plain `report.json` left by an older runner still reads. Standard library
only.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

GZ = ".gz"


def resolve(path: Path | str) -> Path:
    """The file that holds `path`'s JSON: `path` itself when it exists, else its gzipped or plain twin when that
    exists, else `path` (reading it then raises FileNotFoundError naming it)."""
    path = Path(path)
    if path.exists():
        return path
    twin = path.with_name(path.name[: -len(GZ)]) if path.name.endswith(GZ) else path.with_name(path.name + GZ)
    return twin if twin.exists() else path


def read_text(path: Path | str) -> str:
    """The JSON text of `path` or its twin (see `resolve`), gunzipped when the file is gzipped."""
    found = resolve(path)
    raw = found.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip's magic: decided by content, so a misnamed file still reads
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


def load(path: Path | str) -> Any:
    """The parsed JSON of `path` or its twin; FileNotFoundError when neither exists, ValueError when not JSON."""
    return json.loads(read_text(path))


def dump_gz(path: Path | str, data: Any, *, indent: int | None = 1) -> Path:
    """Writes `data` as gzipped JSON to `path` (`.gz` added when missing) and returns that path. The bytes depend on
    `data` alone (no file name or time in the gzip header), so an unchanged report commits as an unchanged file;
    values JSON cannot hold are written as their `str()`. The plain twin, if any, is removed: one report per folder."""
    path = Path(path)
    if not path.name.endswith(GZ):
        path = path.with_name(path.name + GZ)
    text = json.dumps(data, indent=indent, default=str)
    blob = gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)
    path.with_name(path.name[: -len(GZ)]).unlink(missing_ok=True)
    return path
