"""The GPU host's stack sampler (recipes/gpu-host/stacksample, diagnosis only) samples every process but a LOAD's.

A sampled LOAD refused its setup phase on the GPU host (recipes/diagnosis/vllm-qwen3-8b-tp1-startup/README.md): the
sampler's frame references kept a temporary alive. These tests run real interpreters with the sampler on their path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLER = REPO / "recipes" / "gpu-host" / "stacksample"
SCRIPT = "import time\ndef napping_function():\n    time.sleep(0.3)\nnapping_function()\n"


def run_sampled(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHPERSIST_", "GP_STACKS"))}
    clean.update(PYTHONPATH=str(SAMPLER), GP_STACKS_DIR=str(tmp_path / "stacks"), GP_STACKS_PERIOD_MS="10", **env)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=clean, capture_output=True, text=True, timeout=60)


def test_a_process_is_sampled_with_its_stacks(tmp_path: Path) -> None:
    proc = run_sampled(tmp_path)
    assert proc.returncode == 0, proc.stderr
    files = list((tmp_path / "stacks").glob("*.stk"))
    assert len(files) == 1
    text = files[0].read_text()
    assert text.startswith(f"# pid {files[0].stem} ")
    assert ":napping_function:" in text


def test_a_load_process_is_not_sampled_and_says_why(tmp_path: Path) -> None:
    proc = run_sampled(tmp_path, GRAPHPERSIST_MODE="load")
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "stacks").glob("*.stk")) == []
    assert "not sampled: a LOAD process (GRAPHPERSIST_MODE=load)" in proc.stderr
    assert "GP_STACKS_LOAD=1 samples it anyway" in proc.stderr


def test_a_load_process_is_sampled_when_asked_explicitly(tmp_path: Path) -> None:
    proc = run_sampled(tmp_path, GRAPHPERSIST_MODE="load", GP_STACKS_LOAD="1")
    assert proc.returncode == 0, proc.stderr
    assert len(list((tmp_path / "stacks").glob("*.stk"))) == 1
    assert "not sampled" not in proc.stderr
