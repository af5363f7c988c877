"""The JIT and compile cache folders a vLLM 0.26.0 worker reads, which an archive carries (patches/vllm/README.md,
"The caches an archive carries")."""

from __future__ import annotations

from pathlib import Path

from graphpersist import engine


def _vllm_root() -> Path:
    import vllm.envs as envs

    return Path(envs.VLLM_CACHE_ROOT)


def resolvers() -> dict[str, engine.Resolver]:
    """vLLM's cache folders and the ones every engine shares, by name (the session resolves them at start); a
    variable set and non-empty places a folder, else vLLM's cache root does."""
    return {
        "vllm_compile": lambda: _vllm_root() / "torch_compile_cache",
        "vllm_modelinfos": lambda: _vllm_root() / "modelinfos",
        "vllm_flashinfer_autotune": engine.env_folder(
            "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR", lambda: _vllm_root() / "flashinfer_autotune_cache"
        ),
        "deep_gemm": engine.env_folder("DG_JIT_CACHE_DIR", lambda: _vllm_root() / "deep_gemm"),
        **engine.cache_folders(),
    }


BEFORE_ENGINE = ("vllm_modelinfos",)  # read by the process that builds the configuration, before any worker


def restore_before_engine(archive_dir: Path) -> list[str]:
    """LOAD, in the process that resolves the switch: puts back the caches vLLM reads before it starts a worker
    (BEFORE_ENGINE); returns the files written. The workers restore everything else."""
    return engine.restore_caches_early(archive_dir, resolvers(), BEFORE_ENGINE)
