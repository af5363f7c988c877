"""A stand-in `sglang` package for the drivers' CPU proofs: what the SGLang recipe drivers import, with the engine
module's source given by each test file (their fakes differ in what they stand in for)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine_source: str) -> Path:
    """Writes `sglang` (lazy `Engine` as SGLang's, `srt.entrypoints.engine` = `engine_source`) under tmp_path/site and
    puts it, the archive fixtures and the runtime on the children's PYTHONPATH; returns the site folder."""
    site = tmp_path / "site"
    engine_dir = site / "sglang" / "srt" / "entrypoints"
    engine_dir.mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text(
        textwrap.dedent("""\
            __version__ = "0.5.17+gp.1"


            def Engine(**kwargs):  # sglang.Engine is a lazy import of the engine module's class
                from sglang.srt.entrypoints.engine import Engine

                return Engine(**kwargs)
            """)
    )
    (site / "sglang" / "srt" / "__init__.py").write_text("")
    (engine_dir / "__init__.py").write_text("")
    (engine_dir / "engine.py").write_text(engine_source)
    paths = [str(site), str(REPO / "tests" / "cpu"), str(REPO / "overlays" / "graphpersist")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    return site
