"""The sections of an engine's notes whose form the runtime knows, read the same way by LOAD (through the engine's
glue) and by `graphpersist check` (without the engine, graphpersist.loadplan): so check refuses every damaged entry
LOAD refuses. An archive is data, never code: each is plain strings, numbers and booleans, only compared with what
the live engine made. vLLM's glue notes them (overlays/vllm/vllm/graphpersist_compiled.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphpersist.archive.shown import shown
from graphpersist.archive.validate import ADVICE
from graphpersist.errors import PersistError

COMPILED_MODEL = "compiled_model"  # model name -> {"folder": ..., "pieces": [[name, [SymInt positions], tuple?, keys]]}


def read_models(section: str, saved: Any) -> dict[str, dict[str, Any]]:
    """SAVE's compiled models by name, each its compile cache folder and its pieces in compile order (name, SymInt
    argument positions, whether it returns a tuple, its artifacts' keys by compile range); {} where the archive noted
    none."""
    return _read(section, saved, "compiled models by name", _is_model,
                 "{'folder': a string, 'pieces': [[a name, [integers], a boolean, {range: key}], ...]}")  # fmt: skip


def _read(section: str, saved: Any, of: str, fits: Callable[[Any], bool], expected: str) -> dict[str, Any]:
    """`saved` when it is an object whose every entry `fits`; else refused: one line per damaged entry (its name, the
    saved value, what was `expected`), then the advice."""
    if saved is None:
        return {}
    if not isinstance(saved, dict):
        lines = [f"notes.{section}: saved {shown(repr(saved), 120)}, expected an object of {of}"]
    else:
        lines = [
            f"notes.{section}[{shown(repr(name), 80)}]: saved {shown(repr(value), 120)}, expected {expected}"
            for name, value in saved.items()
            if not fits(value)
        ]
    if lines:
        raise PersistError("\n".join([*(f"graphpersist: cannot LOAD: {line}" for line in lines), ADVICE]))
    return dict(saved)


def _is_model(model: Any) -> bool:
    if not isinstance(model, dict) or set(model) != {"folder", "pieces"} or not isinstance(model["folder"], str):
        return False
    return isinstance(model["pieces"], list) and all(
        isinstance(p, list) and len(p) == 4 and isinstance(p[0], str) and isinstance(p[1], list)
        and all(type(i) is int for i in p[1]) and isinstance(p[2], bool) and isinstance(p[3], dict)
        and all(isinstance(part, str) for part in (*p[3], *p[3].values()))
        for p in model["pieces"]
    )  # fmt: skip


READERS: dict[str, Callable[[str, Any], Any]] = {COMPILED_MODEL: read_models}


def check(notes: dict[str, Any]) -> None:
    """Every known section of a rank's notes read as LOAD reads it (`graphpersist check`); the first refused raises."""
    for section, read in READERS.items():
        read(section, notes.get(section))
