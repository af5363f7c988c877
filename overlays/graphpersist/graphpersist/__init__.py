"""graphpersist: save an inference engine's captured CUDA graphs once, restore them on every later start.

The package is engine-agnostic; vLLM and SGLang call into it through small patches. Importing it must stay
cheap and must not need torch or CUDA, because the CLI and the CPU tests run where neither exists: modules
that touch the GPU import it lazily.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from pathlib import Path as _Path

SOURCE_VERSION = "0+source"


def _own_version() -> str:
    """The installed wheel's version, or SOURCE_VERSION when this copy is not the installed one.

    The version lands in every archive's manifest, so a source checkout must not borrow the version of a
    different graphpersist that happens to be installed in the same environment.
    """
    try:
        dist = _metadata.distribution("graphpersist")
    except _metadata.PackageNotFoundError:
        return SOURCE_VERSION
    installed = _Path(str(dist.locate_file("graphpersist/__init__.py")))
    try:
        same = installed.resolve() == _Path(__file__).resolve()
    except OSError:
        same = False
    return dist.version if same else SOURCE_VERSION


__version__ = _own_version()
