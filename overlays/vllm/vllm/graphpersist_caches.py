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
(`report_late`).

Artifacts that embed absolute paths (FlashInfer's ninja files name their build folder) are reused only where the
folders have the same paths as on the SAVE host; elsewhere the engine compiles them again, as it would without this.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from graphpersist import cachefolders
from graphpersist.archive import ArchiveError, jitcache, read_shared


def _vllm_root() -> Path:
    import vllm.envs as envs

    return Path(envs.VLLM_CACHE_ROOT)


def _vllm_sub(variable: str, sub: str) -> Path:
    """A folder vLLM takes from `variable` when set and non-empty (user-expanded), else from its cache root."""
    value = os.environ.get(variable)
    return Path(value).expanduser() if value else _vllm_root() / sub


RESOLVERS: dict[str, cachefolders.Resolver] = {
    "vllm_compile": lambda: _vllm_root() / "torch_compile_cache",
    "vllm_modelinfos": lambda: _vllm_root() / "modelinfos",
    "vllm_flashinfer_autotune": lambda: _vllm_sub("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", "flashinfer_autotune_cache"),
    "deep_gemm": lambda: _vllm_sub("DG_JIT_CACHE_DIR", "deep_gemm"),
    "inductor": cachefolders.inductor,
    "triton": cachefolders.triton,
    "flashinfer": cachefolders.flashinfer,
    "flashinfer_cubins": cachefolders.flashinfer_cubins,
}


def cache_dirs() -> tuple[dict[str, Path], dict[str, str]]:
    """(name -> absolute folder, name -> why it is left out) for this process, as its environment stands now."""
    return cachefolders.resolve_all(RESOLVERS)


def resolve(sess: Any) -> None:
    """Records the worker's cache folders on the session: at start, before vLLM's compile redirects Inductor's
    and Triton's caches into its own folder (process-wide, through their environment variables)."""
    cachefolders.record(sess, RESOLVERS)


def carry(sess: Any) -> dict[str, bytes]:
    """SAVE, rank 0: the archive's shared JIT-cache file; what it carries is kept for `report_late`."""
    shared = cachefolders.carry(sess)
    sess.carried = jitcache.listing(sess.caches)
    return shared


def report_late(sess: Any) -> None:
    """SAVE, rank 0, once the engine's warm-up is done: names what it compiled after the archive was written (the
    V2 runner warms its kernels after the capture), which a LOAD on a fresh host would compile again."""
    if sess.carried is None:
        return
    late = sorted(jitcache.listing(sess.caches) - sess.carried)
    if late:
        sess.log("%d JIT cache file(s) were compiled after the archive was written, so it lacks them (e.g. %s): a "
                 "LOAD on a fresh host compiles them again. SAVE once more on this host (its caches hold them now) "
                 "to carry them", len(late), ", ".join(late[:3]))  # fmt: skip


BEFORE_ENGINE = ("vllm_modelinfos",)  # read by the process that builds the configuration, before any worker


def restore_before_engine(directory: Path) -> jitcache.CacheStats | None:
    """LOAD, in the process that resolves the switch: puts back the caches vLLM reads before it starts a worker.
    None when the archive carries no JIT caches or cannot be read: the workers check the archive before anything
    else and refuse the LOAD naming why, so this early restore only saves time, never decides."""
    try:
        blob = read_shared(directory, jitcache.SHARED_NAME)
    except ArchiveError:
        return None
    if blob is None:
        return None
    found, _left_out = cache_dirs()
    return jitcache.restore(blob, {name: found[name] for name in BEFORE_ENGINE if name in found})


def restore(sess: Any) -> None:
    """LOAD, every rank, before anything compiles: puts back the cache files this host lacks, keeps its own."""
    cachefolders.restore(sess)
