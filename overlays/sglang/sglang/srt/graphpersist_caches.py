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
init, and keeps what it has (`graphpersist.archive.jitcache`). Rank 0 packs them after SAVE ran SGLang's first requests
(`graphpersist_warmup`), so they hold what SGLang compiles only when it serves (batch preparation, sampling) as well
as what its start-up and capture compiled.

Not carried: the CUDA driver's PTX cache (`$CUDA_CACHE_PATH`, `~/.nv/ComputeCache`), which holds only what the driver
compiles from PTX for a GPU a library ships no machine code for (none of the kernels above: Triton, nvcc and
FlashInfer build machine code for the GPU they run on), and folders under `~` or `$XDG_CACHE_HOME` that no library
on this path writes to (DeepGEMM's `~/.cache/deep_gemm` serves FP8 models; torch's kernel cache its jiterator ops).
"""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path
from typing import Any

from graphpersist import cachefolders


def _env_or(variable: str, default: str) -> Path:
    value = os.environ.get(variable)
    return Path(value or default).expanduser()


def _cute_dsl() -> Path:
    value = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    return Path(value) if value else Path(tempfile.gettempdir()) / getpass.getuser() / "flash_attention_cute_dsl_cache"


RESOLVERS: dict[str, cachefolders.Resolver] = {
    "tvm_ffi": lambda: _env_or("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi"),
    "sglang": lambda: _env_or("SGLANG_CACHE_DIR", "~/.cache/sglang"),
    "flashinfer": cachefolders.flashinfer,
    "flashinfer_cubins": cachefolders.flashinfer_cubins,
    "triton": cachefolders.triton,
    "inductor": cachefolders.inductor,
    "cute_dsl": _cute_dsl,
}


def cache_dirs() -> tuple[dict[str, Path], dict[str, str]]:
    """(name -> absolute folder, name -> why it is left out) for this process, as its environment stands now."""
    return cachefolders.resolve_all(RESOLVERS)


def resolve(sess: Any) -> None:
    """Records the process's cache folders on the session, at start."""
    cachefolders.record(sess, RESOLVERS)


def carry(sess: Any) -> dict[str, bytes]:
    """SAVE, rank 0: the archive's shared JIT-cache file."""
    return cachefolders.carry(sess)


def restore(sess: Any) -> None:
    """LOAD, every rank, before anything compiles: puts back the cache files this host lacks, keeps its own."""
    cachefolders.restore(sess)
