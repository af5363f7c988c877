"""The JIT caches both engines share (Inductor, Triton, FlashInfer), and a session's carrying and restoring of them.

Each engine's `graphpersist_caches` names its folders (its own plus these) as resolvers; this module resolves them,
packs them at SAVE and puts back at LOAD what the host lacks (`graphpersist.archive.jitcache` does the packing). A resolver
answers None where its library is not installed; one that raises leaves its folder out, never fails the start.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from graphpersist.archive import ArchiveError, jitcache, read_shared
from graphpersist.errors import PersistError

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


def record(sess: Any, resolvers: Mapping[str, Resolver]) -> None:
    """Records the process's cache folders on the session (`sess.caches`), at start, and logs what is left out."""
    sess.caches, left_out = resolve_all(resolvers)
    if left_out:
        sess.log("JIT caches not carried: %s", "; ".join(f"{n} ({why})" for n, why in left_out.items()))


def carry(sess: Any) -> dict[str, bytes]:
    """SAVE, rank 0 (the ranks of one host share the caches): the archive's shared JIT-cache file."""
    started = time.perf_counter()
    blob, stats = jitcache.collect(sess.caches)
    sess.log("carrying JIT caches (%.1f MiB, %.2f s): %s", len(blob) / 2**20, time.perf_counter() - started,
             stats.describe())  # fmt: skip
    return {jitcache.SHARED_NAME: blob}


def restore(sess: Any) -> None:
    """LOAD, every rank, before anything compiles: puts back the cache files this host lacks, keeps its own."""
    started = time.perf_counter()
    try:
        blob = read_shared(sess.directory, jitcache.SHARED_NAME)
    except ArchiveError as exc:
        raise PersistError(f"graphpersist: cannot LOAD {sess.directory}: {exc}") from None
    if blob is None:
        sess.log("%s carries no JIT caches (saved by an older release): what is missing here compiles again",
                 sess.directory)  # fmt: skip
        return
    stats = jitcache.restore(blob, sess.caches)
    sess.restored_files = stats.written  # not compiled here: the proof tells them from what a LOAD compiles
    took = sess.timed("jitcache", started)
    sess.log("JIT caches restored in %.2f s: %s", took, stats.describe())
