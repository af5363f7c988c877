"""The JIT and compile cache folders an SGLang 0.5.17 scheduler process reads, which an archive carries
(patches/sglang/README.md, "The caches an archive carries")."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

from graphpersist import engine


def _env_or(variable: str, default: str) -> Path:
    value = os.environ.get(variable)
    return Path(value or default).expanduser()


def _cute_dsl() -> Path:
    value = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    return Path(value) if value else Path(tempfile.gettempdir()) / getpass.getuser() / "flash_attention_cute_dsl_cache"


def resolvers() -> dict[str, engine.Resolver]:
    """SGLang's cache folders and the ones every engine shares, by name (the session resolves them at start)."""
    shared = engine.cache_folders()
    return {
        "tvm_ffi": lambda: _env_or("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi"),
        "sglang": lambda: _env_or("SGLANG_CACHE_DIR", "~/.cache/sglang"),
        "flashinfer": shared["flashinfer"],
        "flashinfer_cubins": shared["flashinfer_cubins"],
        "triton": shared["triton"],
        "inductor": shared["inductor"],
        "cute_dsl": _cute_dsl,
    }
