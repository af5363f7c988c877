"""A module loaded from its file under a name of its own: recipe drivers, overlays and pinned upstream files that
tests cannot import by their package path (the package's __init__ needs torch or CUDA, or two recipes both name
their file `driver.py`)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def load_module(path: Path, name: str, register: Callable[[str, ModuleType], object] | None = None) -> ModuleType:
    """Executes `path` as module `name`. `register(name, module)` runs before it does, for files that look
    themselves up in sys.modules (dataclasses do): `sys.modules.__setitem__`, or
    `functools.partial(monkeypatch.setitem, sys.modules)` for a test's lifetime only."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"no module in {path}"
    module = importlib.util.module_from_spec(spec)
    if register is not None:
        register(name, module)
    spec.loader.exec_module(module)
    return module
