"""The JIT and compile caches an SGLang 0.5.17 scheduler process reads, carried by SAVE and put back by LOAD before
anything compiles.

SGLang builds its own kernels on first use (tvm-ffi modules compiled with nvcc, 9-14 s each on the reference host),
and Triton, FlashInfer and Inductor compile theirs; a LOAD on a host whose caches are empty would compile them all
again. The archive therefore carries these folders, as the scheduler process resolves them when it starts:

* `tvm_ffi`: `$TVM_FFI_CACHE_DIR`, else `~/.cache/tvm-ffi`: SGLang's JIT kernels (`sglang/kernels/jit/utils/compile.py`
  loads a built `.so` from there without running ninja), and FlashInfer's tvm-ffi builds.
* `sglang`: `$SGLANG_CACHE_DIR`, else `~/.cache/sglang`: SGLang's own cache (kernel lock files, autotune results).
* `flashinfer`: `$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`, else `~/.cache/flashinfer`: FlashInfer's JIT modules
  and cubins; `flashinfer_cubins`: `$FLASHINFER_CUBIN_DIR` when set.
* `triton`: `$TRITON_CACHE_DIR`, else Triton's default (`~/.triton/cache`).
* `inductor`: `$TORCHINDUCTOR_CACHE_DIR`, else torch's default (`/tmp/torchinductor_<user>`).
* `cute_dsl`: `$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`, else `<tmp>/<user>/flash_attention_cute_dsl_cache`.

A folder that cannot be determined (its library is not installed) is left out and logged. Rank 0 packs them at
SAVE (the ranks of one host share them); every rank of a LOAD puts back what its host lacks, before distributed
init, and keeps what it has (`graphpersist.jitcache`). Rank 0 packs them after SAVE ran SGLang's first requests
(`graphpersist_warmup`), so they hold what SGLang compiles only when it serves (batch preparation, sampling) as well
as what its start-up and capture compiled.

Not carried: the CUDA driver's PTX cache (`$CUDA_CACHE_PATH`, `~/.nv/ComputeCache`), which holds only what the driver
compiles from PTX for a GPU a library ships no machine code for (none of the kernels above: Triton, nvcc and
FlashInfer build machine code for the GPU they run on), and folders under `~` or `$XDG_CACHE_HOME` that no library
on this path writes to (DeepGEMM's `~/.cache/deep_gemm` serves FP8 models; torch's kernel cache its jiterator ops).
"""

from __future__ import annotations

import getpass
import importlib.util
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphpersist import jitcache
from graphpersist.archive import ArchiveError, read_shared
from graphpersist.errors import PersistError


def _env_or(variable: str, default: str) -> Path:
    value = os.environ.get(variable)
    return Path(value or default).expanduser()


def _triton() -> Path | None:
    if importlib.util.find_spec("triton") is None:
        return None
    from triton import knobs

    return Path(knobs.cache.dir)


def _inductor() -> Path:
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if value is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        value = default_cache_dir()
    return Path(value)


def _flashinfer() -> Path | None:
    if importlib.util.find_spec("flashinfer") is None:
        return None
    return Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home().as_posix())) / ".cache" / "flashinfer"


def _flashinfer_cubins() -> Path | None:
    value = os.environ.get("FLASHINFER_CUBIN_DIR")
    return Path(value) if value else None


def _cute_dsl() -> Path:
    value = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    return Path(value) if value else Path(tempfile.gettempdir()) / getpass.getuser() / "flash_attention_cute_dsl_cache"


RESOLVERS: dict[str, Callable[[], Path | None]] = {
    "tvm_ffi": lambda: _env_or("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi"),
    "sglang": lambda: _env_or("SGLANG_CACHE_DIR", "~/.cache/sglang"),
    "flashinfer": _flashinfer,
    "flashinfer_cubins": _flashinfer_cubins,
    "triton": _triton,
    "inductor": _inductor,
    "cute_dsl": _cute_dsl,
}


def cache_dirs() -> tuple[dict[str, Path], dict[str, str]]:
    """(name -> absolute folder, name -> why it is left out) for this process, as its environment stands now."""
    found: dict[str, Path] = {}
    left_out: dict[str, str] = {}
    for name, resolve in RESOLVERS.items():
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


def resolve(sess: Any) -> None:
    """Records the process's cache folders on the session, at start."""
    sess.caches, left_out = cache_dirs()
    if left_out:
        sess.log("JIT caches not carried: %s", "; ".join(f"{n} ({why})" for n, why in left_out.items()))


def carry(sess: Any) -> dict[str, bytes]:
    """SAVE, rank 0: the archive's shared JIT-cache file."""
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
        sess.log("%s carries no JIT caches: what is missing here compiles again", sess.directory)
        return
    stats = jitcache.restore(blob, sess.caches)
    sess.restored_files = stats.written
    took = sess.timed("jitcache", started)
    sess.log("JIT caches restored in %.2f s: %s", took, stats.describe())
