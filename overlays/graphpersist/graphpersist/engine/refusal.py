"""A refusal raised in an engine's model process, raised again in the user's process.

The runtime refuses in the processes that hold the model (a LOAD whose archive does not fit, a configuration it
cannot restore), and upstream turns such a child's death into an error of its own that names nothing (vLLM:
"Engine core initialization failed. See root cause above."; SGLang's launcher even kills the user's process). So
the switch, where it resolves first in a start (`export`), names a file for the start in the environment every
engine process inherits; the first refusal any of them raises from a session step or a glue seam (`recording`) is
written there (type, message, and a refused LOAD's mismatches; the first writer wins); and the seam where upstream
turns the child's failure into its own error raises that refusal instead, chained to upstream's error (`refusal_or`).
With persistence off nothing is named, read or written.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphpersist import switch
from graphpersist.archive.validate import MISSING, LoadRefused, Mismatch
from graphpersist.errors import PersistError

ENV = "GRAPHPERSIST_REFUSAL_FILE"
_MISSING_TAG = {"graphpersist": "missing"}  # a side of a mismatch that had no value (validate.MISSING)


class RefusedInEngine(PersistError):
    """A refusal an engine's process raised (other than a refused LOAD, which comes back as `LoadRefused`): its
    message as the engine wrote it; `kind` names the type raised there."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class _Named:
    """The refusal file this process named for its starts (a forked child inherits the value, not the role)."""

    pid: int
    path: str


_named: _Named | None = None


def export(environ: MutableMapping[str, str]) -> None:
    """Names the start's refusal file in `environ` (the switch, with persistence on): a new one in the process that
    launches the engine, kept as it is in an engine process that inherited it."""
    global _named
    named = _named if _named is not None and _named.pid == os.getpid() else None
    inherited = environ.get(ENV)
    if inherited and (named is None or inherited != named.path):
        return  # an engine process, or a fork of the launcher: the launcher's file
    if named is None:
        name = f"graphpersist-refusal-{os.getpid()}-{secrets.token_hex(8)}"
        named = _named = _Named(os.getpid(), str(Path(tempfile.gettempdir()) / name))
    environ[ENV] = named.path


def is_refusal(exc: BaseException) -> bool:
    """The runtime's own refusals: an exception of a type defined in `graphpersist` (what the runtime and the glue
    raise to say no), not an engine's or Python's error."""
    return any(c.__module__.split(".")[0] == "graphpersist" for c in type(exc).__mro__)


def record(exc: BaseException) -> None:
    """Writes `exc` to the start's refusal file unless one is there already. Never raises: the engine's log has the
    refusal anyway, and an error here must not hide it."""
    path = os.environ.get(ENV)
    if not path:
        return
    doc: dict[str, Any] = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc)}
    if isinstance(exc, LoadRefused):
        doc["archive_dir"], doc["rank"] = str(exc.archive_dir), exc.rank
        doc["mismatches"] = [[m.field, _side(m.saved), _side(m.live)] for m in exc.mismatches]
    with contextlib.suppress(OSError, TypeError, ValueError):
        _write_first(Path(path), json.dumps(doc, default=repr).encode())


def _side(value: Any) -> Any:
    return _MISSING_TAG if value is MISSING else value


def _write_first(path: Path, data: bytes) -> None:
    """`data` at `path` unless a file is there: written aside, then linked (atomic; fails when one exists)."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Records a refusal that leaves the block (or the function it decorates), then lets it go on."""
    try:
        yield
    except BaseException as exc:
        if is_refusal(exc):
            record(exc)
        raise


def _own_path() -> Path | None:
    """The refusal file this process named, if it launched the engine with persistence on (only it reads one)."""
    if os.environ.get(switch.MODE_ENV, "off") in ("", "off"):
        return None  # persistence off now, whatever an earlier start in this process named
    if _named is None or _named.pid != os.getpid() or os.environ.get(ENV) != _named.path:
        return None
    return Path(_named.path)


def recorded() -> bool:
    """Whether an engine process of this start has recorded a refusal (not consumed)."""
    path = _own_path()
    return path is not None and path.is_file()


def refusal_or(error: BaseException) -> BaseException:
    """What the process that launched the engine raises where upstream raises `error` for a failed engine process:
    the refusal an engine process recorded for this start (consumed), chained to `error`; else `error` itself."""
    path = _own_path()
    if path is None:
        return error
    doc = _read(path)
    if doc is None:
        return error
    refusal = _rebuilt(doc)
    refusal.__cause__ = error
    return refusal


def _read(path: Path) -> dict[str, Any] | None:
    """The recorded refusal, removed once read; None when there is none (or it is not this user's, or unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                return None
            doc = json.loads(f.read())
        path.unlink(missing_ok=True)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("message"), str) else None


def _rebuilt(doc: dict[str, Any]) -> BaseException:
    """A refused LOAD as `LoadRefused` with the engine's message word for word; any other refusal as
    `RefusedInEngine`."""
    message, kind = doc["message"], str(doc.get("type", ""))
    if "mismatches" not in doc:
        return RefusedInEngine(message, kind)
    mismatches = [
        Mismatch(str(field), MISSING if saved == _MISSING_TAG else saved, MISSING if live == _MISSING_TAG else live)
        for field, saved, live in doc["mismatches"]
    ]
    rank = doc.get("rank")
    refused = LoadRefused(str(doc.get("archive_dir", "")), mismatches, rank if isinstance(rank, int) else None)
    refused.args = (message,)  # the engine's lines exactly, whatever JSON made of the values
    return refused
