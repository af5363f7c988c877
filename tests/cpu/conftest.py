"""Fixtures shared by several CPU test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_cpu_venv import built_wheels, make_vllm_venv


@pytest.fixture(scope="session")
def vllm_venv(tmp_path_factory: pytest.TempPathFactory, dist_dir: Path, repo_root: Path) -> Path:
    """The BUILT vLLM and graphpersist wheels in a CPU venv, built once per session (a minute or two)."""
    return make_vllm_venv(tmp_path_factory.mktemp("vllm-cpu") / "venv", repo_root, built_wheels(dist_dir))
