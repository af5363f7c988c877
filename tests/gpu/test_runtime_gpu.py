"""GPU proof of the runtime (recipes/runtime-single-gpu): SAVE twice, LOAD in a fresh process, drift refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "runtime-single-gpu"


@pytest.mark.gpu
def test_runtime_single_gpu_proof(tmp_path: Path) -> None:
    report = tmp_path / "REPORT.md"
    proc = subprocess.run([sys.executable, str(RECIPE / "proof.py"), "prove", "--out", str(tmp_path / "out"),
                           "--report", str(report)], capture_output=True, text=True, timeout=900)  # fmt: skip
    text = report.read_text() if report.exists() else proc.stdout + proc.stderr
    assert proc.returncode == 0 and text.startswith("all checks passed"), text[-4000:]
