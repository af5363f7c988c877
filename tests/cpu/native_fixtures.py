"""The interposer over the fake CUDA driver (tests/cpu/native/fakecuda.c), built once per caller: what the native
tests that run a child process under LD_PRELOAD share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphpersist.memory import region

NATIVE = Path(__file__).resolve().parent / "native"  # fakecuda.c and the fakegp.py helpers the children import


def build_fake_driver(folder: Path) -> dict[str, str]:
    """Compiles fakecuda.c (warnings are errors) and the interposer into `folder`: {"interposer", "fake"} paths."""
    fake = folder / "libfakecuda.so"
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
                    "-Wl,-Bsymbolic", "-o", str(fake), str(NATIVE / "fakecuda.c")], check=True)  # fmt: skip
    return {"interposer": str(region.build_interposer(folder / "gp")), "fake": str(fake)}


def child_env(libs: dict[str, str], base: int, *, paths: Sequence[Path] = (), **extra: str) -> dict[str, str]:
    """The environment of a child under the interposer over the fake driver: this process's, without any GP_ variable,
    plus a 256 MiB region at `base`, NATIVE (and `paths`) on PYTHONPATH, then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GP_")}
    env.update(LD_PRELOAD=libs["interposer"], GP_LIBCUDA=libs["fake"], GP_REGION_BASE=hex(base),
               GP_REGION_SIZE=str(256 << 20), PYTHONPATH=os.pathsep.join(str(p) for p in (NATIVE, *paths)))  # fmt: skip
    env.update(extra)
    return env


def run_child(prelude: str, code: str, env: dict[str, str], timeout: float = 60) -> tuple[dict[str, Any], str]:
    """Runs `prelude` + `code` in a new interpreter with `env`; the child fills the dict `out`, printed as its RESULT
    line. Returns that dict and the child's stderr; a child that fails fails the test, showing its output."""
    script = prelude + textwrap.dedent(code) + "\nprint('RESULT ' + json.dumps(out))\n"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :]), proc.stderr
