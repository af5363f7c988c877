"""The interposer over the fake CUDA driver (tests/cpu/native/fakecuda.c), built once per caller: what the native
tests that run a child process under LD_PRELOAD share."""

from __future__ import annotations

import subprocess
from pathlib import Path

from graphpersist.memory import region

NATIVE = Path(__file__).resolve().parent / "native"  # fakecuda.c and the fakegp.py helpers the children import


def build_fake_driver(folder: Path) -> dict[str, str]:
    """Compiles fakecuda.c (warnings are errors) and the interposer into `folder`: {"interposer", "fake"} paths."""
    fake = folder / "libfakecuda.so"
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
                    "-Wl,-Bsymbolic", "-o", str(fake), str(NATIVE / "fakecuda.c")], check=True)  # fmt: skip
    return {"interposer": str(region.build_interposer(folder / "gp")), "fake": str(fake)}
