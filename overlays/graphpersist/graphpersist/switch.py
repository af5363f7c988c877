"""The persistence switch: which mode (off, save, load) and which archive directory an engine start uses.

Both engines expose the same three spellings of the switch: a CLI flag, a Python keyword and an environment
variable. This module is the single place that decides between them (explicit flag/keyword beats environment,
environment beats the default ``off``), validates the result and describes it in one log line. The engine glue
(``vllm/graphpersist_switch.py``, ``sglang/srt/graphpersist_switch.py``) only forwards values here.

No torch, no CUDA: this runs while the engine parses its arguments, before any device work, so that a bad value
is refused at start-up with one clear line instead of a traceback minutes later.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODE_FLAG = "--graph-persist"
DIR_FLAG = "--graph-persist-dir"
MODE_KWARG = "graph_persist"
DIR_KWARG = "graph_persist_dir"
MODE_ENV = "GRAPHPERSIST_MODE"
DIR_ENV = "GRAPHPERSIST_DIR"
DEFAULT_SOURCE = "default"


class Mode(str, enum.Enum):
    """What the engine does with its CUDA graphs."""

    OFF = "off"  # behave exactly like upstream
    SAVE = "save"  # capture as usual, then write the archive
    LOAD = "load"  # restore from the archive instead of capturing

    def __str__(self) -> str:
        return self.value


ALLOWED = ", ".join(m.value for m in Mode)


class SwitchError(ValueError):
    """A user error in the switch. A ValueError so that engines' own argument validation surfaces it as such."""


class Given(str):
    """A value tagged with where it came from, so that later messages can name the flag rather than the keyword.

    Argparse ``type=`` callables return it; it is an ordinary ``str`` for everything else (equality, pickling).
    """

    source: str

    def __new__(cls, value: str, source: str) -> Given:
        obj = super().__new__(cls, value)
        obj.source = source
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (Given, (str(self), self.source))


@dataclass(frozen=True)
class Switch:
    """The resolved switch: the mode, the archive directory (absolute; None when off) and where each came from."""

    mode: Mode
    directory: Path | None
    mode_source: str
    dir_source: str | None

    @property
    def enabled(self) -> bool:
        return self.mode is not Mode.OFF

    def describe(self) -> str:
        """The one log line an engine prints at start-up when persistence is on."""
        if not self.enabled:
            return f"graphpersist: mode=off (from {self.mode_source})"
        return (
            f"graphpersist: mode={self.mode.value} dir={self.directory} "
            f"(from {_sources(self.mode_source, self.dir_source)})"
        )


def _sources(mode_source: str, dir_source: str | None) -> str:
    if dir_source is None or dir_source == mode_source:
        return mode_source
    return f"{mode_source}, {dir_source}"


def _pick(explicit: object, explicit_source: str, env: Mapping[str, str], env_name: str) -> tuple[object, str] | None:
    """Explicit value (flag or keyword) first, then a non-empty environment variable; None when neither is set."""
    if explicit is not None:
        return explicit, getattr(explicit, "source", explicit_source)
    from_env = env.get(env_name)
    if from_env:  # an empty variable counts as unset, as shells make it easy to export one by accident
        return from_env, env_name
    return None


def parse_mode(value: object, source: str) -> Mode:
    """One mode value to the enum, or SwitchError naming the value, its source and the allowed set."""
    if isinstance(value, Mode):
        return value
    if isinstance(value, str):
        try:
            return Mode(value)
        except ValueError:
            pass
    raise SwitchError(f"graphpersist: invalid persistence mode {value!r} (from {source}); expected one of: {ALLOWED}")


def parse_dir(value: object, source: str) -> Path:
    """One directory value to an absolute path (no file-system access), or SwitchError."""
    if not isinstance(value, str | os.PathLike):
        raise SwitchError(
            f"graphpersist: invalid archive directory {value!r} (from {source}); expected a path (str or os.PathLike)"
        )
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise SwitchError(f"graphpersist: empty archive directory {value!r} (from {source}); expected a path")
    return Path(os.path.abspath(os.path.expanduser(text)))


def resolve(
    mode: object = None,
    archive_dir: object = None,
    *,
    env: Mapping[str, str] | None = None,
    mode_source: str = f"keyword {MODE_KWARG}",
    dir_source: str = f"keyword {DIR_KWARG}",
) -> Switch:
    """Decide the switch from explicit values (None = not given) and the environment; raise SwitchError if bad.

    ``mode_source``/``dir_source`` name where explicit values came from; values returned by the CLI ``type=``
    callables carry their flag with them and override these labels.
    """
    env = os.environ if env is None else env
    picked_mode = _pick(mode, mode_source, env, MODE_ENV)
    if picked_mode is None:
        resolved_mode, resolved_mode_source = Mode.OFF, DEFAULT_SOURCE
    else:
        resolved_mode, resolved_mode_source = parse_mode(*picked_mode), picked_mode[1]
    if resolved_mode is Mode.OFF:
        # Off does no further work: a directory given alongside is neither checked nor kept.
        return Switch(Mode.OFF, None, resolved_mode_source, None)

    picked_dir = _pick(archive_dir, dir_source, env, DIR_ENV)
    if picked_dir is None:
        raise SwitchError(
            f"graphpersist: persistence mode {resolved_mode.value!r} (from {resolved_mode_source}) needs an archive "
            f"directory; set {DIR_FLAG}, keyword {DIR_KWARG} or {DIR_ENV}"
        )
    path = parse_dir(*picked_dir)
    where = picked_dir[1]
    if resolved_mode is Mode.LOAD and not path.is_dir():
        raise SwitchError(
            f"graphpersist: cannot LOAD {path} (from {where}): no such directory; "
            f"run once with {MODE_FLAG} save to create the archive"
        )
    if resolved_mode is Mode.SAVE and path.exists() and not path.is_dir():
        raise SwitchError(f"graphpersist: cannot SAVE to {path} (from {where}): it exists and is not a directory")
    return Switch(resolved_mode, path, resolved_mode_source, where)


def _cli_mode(text: str) -> Given:
    try:
        return Given(parse_mode(text, MODE_FLAG).value, MODE_FLAG)
    except SwitchError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _cli_dir(text: str) -> Given:
    try:
        parse_dir(text, DIR_FLAG)
    except SwitchError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return Given(text, DIR_FLAG)


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add both flags to an engine's parser (or one of its groups). Defaults are None so the environment can apply."""
    parser.add_argument(
        MODE_FLAG,
        dest=MODE_KWARG,
        type=_cli_mode,
        default=None,
        metavar="{" + ",".join(m.value for m in Mode) + "}",
        help=(
            "CUDA-graph persistence: 'off' behaves like upstream; 'save' captures and writes the graphs to the "
            f"archive; 'load' restores them instead of capturing. Default: ${MODE_ENV}, else off."
        ),
    )
    parser.add_argument(
        DIR_FLAG,
        dest=DIR_KWARG,
        type=_cli_dir,
        default=None,
        metavar="DIR",
        help=f"Archive directory for {MODE_FLAG} save/load. Default: ${DIR_ENV}.",
    )
