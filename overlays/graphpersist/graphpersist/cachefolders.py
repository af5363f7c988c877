"""The JIT cache folders both engines share (Inductor, Triton, FlashInfer), and how a resolver list becomes folders.

Each engine's adapter names its folders (its own plus these) as resolvers; the session's caches
(graphpersist.engine.caches) resolve them here, pack them at SAVE and put back at LOAD what the host lacks. A resolver
answers None where its library is not installed; one that raises leaves its folder out, never fails the start.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path

Resolver = Callable[[], Path | None]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def inductor() -> Path:
    """torch._inductor.runtime.cache_dir_utils.cache_dir(), without its side effects (it creates the folder and
    sets the variable)."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if value is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        value = default_cache_dir()
    return Path(value)


def triton() -> Path | None:
    if not installed("triton"):
        return None
    from triton import knobs

    return Path(knobs.cache.dir)  # TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache, read when asked


def flashinfer() -> Path | None:
    """flashinfer.jit.env.FLASHINFER_CACHE_DIR (0.6.14, 0.6.15), computed without importing flashinfer (its import
    loads its kernel modules and asks torch about the GPUs)."""
    if not installed("flashinfer"):
        return None
    return Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home().as_posix())) / ".cache" / "flashinfer"


def flashinfer_cubins() -> Path | None:
    """Where FlashInfer keeps downloaded cubins when FLASHINFER_CUBIN_DIR moves them out of its cache folder."""
    value = os.environ.get("FLASHINFER_CUBIN_DIR")
    return Path(value) if value and installed("flashinfer") else None


def resolve_all(resolvers: Mapping[str, Resolver]) -> tuple[dict[str, Path], dict[str, str]]:
    """(name -> absolute folder, name -> why it is left out) for this process, as its environment stands now."""
    found: dict[str, Path] = {}
    left_out: dict[str, str] = {}
    for name, resolve in resolvers.items():
        try:
            folder = resolve()
        except Exception as exc:  # a library that is missing or changed: its cache is not carried, never fatal
            left_out[name] = f"{type(exc).__name__}: {exc}"
            continue
        if folder is None:
            left_out[name] = "not used here"
        else:
            found[name] = Path(os.path.abspath(folder))
    return found, left_out
