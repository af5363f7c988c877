"""The diagnosis tools (tools/gpdiag): outside the product wheel, attached to a worker's session as an observer.

The observer's wiring is tested against a real persistence session in the vLLM CPU venv
(test_engine_vllm_persist_cpu.py); what needs no engine is tested here.
"""

from __future__ import annotations

import cProfile
import os
from pathlib import Path
from typing import Any

import pytest
from gpdiag import startprofile


def busy_function_to_find() -> int:
    return sum(i * i for i in range(20000))


def test_start_profile_writes_the_ranks_profile_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GP_DIAG_CPROFILE: cProfile from the session's opening to the end of the warm-up, one file pair per rank."""
    monkeypatch.delenv(startprofile.CPROFILE_ENV, raising=False)
    startprofile.start()
    startprofile.stop(0)
    assert not list(tmp_path.rglob("cprofile.*"))
    monkeypatch.setenv(startprofile.CPROFILE_ENV, str(tmp_path / "prof"))
    startprofile.start()
    busy_function_to_find()
    startprofile.stop(3)
    startprofile.stop(3)  # a second stop writes nothing more
    text = (tmp_path / "prof" / "cprofile.rank3.txt").read_text()
    assert sorted(p.name for p in tmp_path.rglob("cprofile.*")) == ["cprofile.rank3.pstats", "cprofile.rank3.txt"]
    assert "busy_function_to_find" in text and text.count("Ordered by") == 2


def test_start_profile_gives_way_to_another_profiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12+ refuses a second profiling tool: the start goes on unprofiled, and says so."""

    class Refusing(cProfile.Profile):
        def enable(self, *args: Any, **kwargs: Any) -> None:
            raise ValueError("Another profiling tool is already active")

    monkeypatch.setenv(startprofile.CPROFILE_ENV, str(tmp_path))
    monkeypatch.setattr(startprofile.cProfile, "Profile", Refusing)
    startprofile.start()
    assert startprofile._profiler is None
    startprofile.stop(4)
    assert not list(tmp_path.iterdir())


def test_the_product_never_reads_a_diagnosis_switch() -> None:
    """Diagnosis lives in tools/: nothing under overlays/ (what the wheels ship) names a GP_DIAG variable."""
    overlays = Path(__file__).resolve().parents[2] / "overlays"
    found = [str(p.relative_to(overlays)) for p in overlays.rglob("*.py") if "GP_DIAG" in p.read_text()]
    assert found == []
    assert os.environ.get("GRAPHPERSIST_PLUGINS") is None  # the test process itself runs no observer
