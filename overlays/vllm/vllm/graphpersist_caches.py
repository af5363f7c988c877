"""The JIT and compile caches a vLLM 0.26.0 worker reads, carried by SAVE and put back by LOAD before any compile.

A LOAD on a host whose caches are empty compiled everything again (torch.compile/Inductor, Triton, FlashInfer's
ninja-built sampling module): nearly three times a warm LOAD. The archive therefore carries these folders, as the
worker process resolves them when it starts, before vLLM redirects anything:

* `vllm_compile`: `$VLLM_CACHE_ROOT/torch_compile_cache`, vLLM's torch.compile artifacts (the AOT-compiled model,
  per rank). While vLLM compiles the model it points `TORCHINDUCTOR_CACHE_DIR` (and, without AOT compile,
  `TRITON_CACHE_DIR`) into this folder, process-wide.
* `vllm_modelinfos`: `$VLLM_CACHE_ROOT/modelinfos`, what vLLM learned inspecting the model class. The process that
  builds the engine's configuration reads it, before any worker starts; without it vLLM inspects the model in a
  subprocess (13.7 s of a fresh-host LOAD at TP=2 on the reference host). The switch restores it there
  (`restore_before_engine`), the workers restore everything else.
* `vllm_flashinfer_autotune`: `$VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR`, else `$VLLM_CACHE_ROOT/flashinfer_autotune_cache`:
  FlashInfer tactics vLLM tuned.
* `deep_gemm`: `$DG_JIT_CACHE_DIR`, else `$VLLM_CACHE_ROOT/deep_gemm`: DeepGEMM's JIT kernels (FP8 models).
* `inductor`: `$TORCHINDUCTOR_CACHE_DIR`, else torch's default (`/tmp/torchinductor_<user>`): what Inductor compiles
  before or besides vLLM's model compile, and its Triton kernels when `TRITON_CACHE_DIR` is unset.
* `triton`: `$TRITON_CACHE_DIR`, else Triton's default (`~/.triton/cache`): Triton kernels launched directly (the V2
  runner's, sampling) and their autotune results.
* `flashinfer`: `$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`, else `~/.cache/flashinfer`: FlashInfer's JIT-built
  modules (ninja) and downloaded cubins; `flashinfer_cubins`: `$FLASHINFER_CUBIN_DIR` when set.

A folder that cannot be determined (its library is not installed, or changed) is left out and logged.

Not carried: what vLLM keeps about the host rather than the model (the GPU peer-access cache, start-up plans).
The archive is written at the end of the capture, so SAVE runs the V2 runner's kernel warm-up (which builds
FlashInfer's sampling module and the sampler's Triton kernels) once before it (`graphpersist_worker`); whatever is
still compiled after the archive was written (by vLLM's own warm-up, or the first requests) is carried only when the
SAVE host's caches already held it from an earlier run. SAVE names such files once its warm-up is done
(the session's `report_late`).

Artifacts that embed absolute paths (FlashInfer's ninja files name their build folder) are reused only where the
folders have the same paths as on the SAVE host; elsewhere the engine compiles them again, as it would without this.
"""

from __future__ import annotations

import os
from pathlib import Path

from graphpersist import engine


def _vllm_root() -> Path:
    import vllm.envs as envs

    return Path(envs.VLLM_CACHE_ROOT)


def _vllm_sub(variable: str, sub: str) -> Path:
    """A folder vLLM takes from `variable` when set and non-empty (user-expanded), else from its cache root."""
    value = os.environ.get(variable)
    return Path(value).expanduser() if value else _vllm_root() / sub


def resolvers() -> dict[str, engine.Resolver]:
    """vLLM's cache folders and the ones every engine shares, by name (the session resolves them at start)."""
    return {
        "vllm_compile": lambda: _vllm_root() / "torch_compile_cache",
        "vllm_modelinfos": lambda: _vllm_root() / "modelinfos",
        "vllm_flashinfer_autotune": lambda: _vllm_sub(
            "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "flashinfer_autotune_cache"
        ),
        "deep_gemm": lambda: _vllm_sub("DG_JIT_CACHE_DIR", "deep_gemm"),
        **engine.cache_folders(),
    }


BEFORE_ENGINE = ("vllm_modelinfos",)  # read by the process that builds the configuration, before any worker


def restore_before_engine(directory: Path) -> list[str]:
    """LOAD, in the process that resolves the switch: puts back the caches vLLM reads before it starts a worker
    (BEFORE_ENGINE); returns the files written. The workers restore everything else."""
    return engine.restore_caches_early(directory, resolvers(), BEFORE_ENGINE)
