"""The diagnosis tools (tools/gpdiag): outside the product wheel, wrapped around a worker's session from outside.

The wiring into a real vLLM worker is tested in the vLLM CPU venv (test_engine_vllm_persist_cpu.py); what needs no
engine is tested here.
"""

from __future__ import annotations

import cProfile
import json
import os
import subprocess
import sys
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
    plugins = [str(p.relative_to(overlays)) for p in overlays.rglob("*.py") if "GRAPHPERSIST_PLUGINS" in p.read_text()]
    assert plugins == []  # no observer hook either: gpdiag wraps the session from outside


REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "tools" / "gpdiag" / "site"


def _site_run(tmp_path: Path, environ: dict[str, str]) -> dict[str, Any]:
    """A fresh Python with gpdiag's site folder first on its path and another sitecustomize after it."""
    other = tmp_path / "other"
    other.mkdir(exist_ok=True)
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITE_RAN = True\n")
    code = (
        "import builtins, json\n"
        "from graphpersist.engine import session\n"
        "from graphpersist.memory import region\n"
        "print(json.dumps({'other': getattr(builtins, 'OTHER_SITE_RAN', False),"
        " 'begin': getattr(session.PersistSession.begin, '_gpdiag', False),"
        " 'restore': region.restore.__name__}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GP_DIAG_")}
    env.update(environ, PYTHONPATH=f"{SITE}:{other}:{REPO / 'overlays' / 'graphpersist'}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_a_diagnosis_run_wraps_the_session_from_its_site_folder_and_keeps_the_next_sitecustomize(
    tmp_path: Path,
) -> None:
    got = _site_run(tmp_path, {"GP_DIAG_DUMP": str(tmp_path)})
    assert got == {"other": True, "begin": True, "restore": "restored"}


def test_without_a_diagnosis_switch_the_site_folder_wraps_nothing(tmp_path: Path) -> None:
    assert _site_run(tmp_path, {}) == {"other": True, "begin": False, "restore": "restore"}
