"""The import graph (`python -m gptools imports`, run by `make check`): no loops, and engine glue that reaches the
runtime only through its engine interface."""

from __future__ import annotations

from pathlib import Path

from gptools import importgraph


def modules_in(root: Path, files: dict[str, str]) -> dict[str, Path]:
    found = {}
    for name, text in files.items():
        path = root / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        found[name] = path
    return found


def test_the_project_has_no_import_loop_and_its_glue_uses_only_the_engine_interface() -> None:
    modules = importgraph.project_modules()
    graph = importgraph.edges(modules)
    assert "graphpersist.engine.session" in modules and "vllm.graphpersist_worker" in modules
    assert "sglang.srt.graphpersist_engine" in modules and "gptools.prove" in modules
    assert importgraph.cycles(modules, graph) == []
    assert importgraph.glue_violations(modules, graph) == []
    glue = {e.target for e in graph if e.source.startswith(importgraph.GLUE_PREFIXES)}
    assert {t for t in glue if t.startswith("graphpersist")} <= {"graphpersist", "graphpersist.engine"}


def test_a_loop_through_a_type_only_or_function_level_import_is_found(tmp_path: Path) -> None:
    modules = modules_in(
        tmp_path,
        {
            "gptools.a": "from gptools import b\n",
            "gptools.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gptools.c import X\n",
            "gptools.c": "def f():\n    from . import a\n",
            "gptools.d": "import gptools.a\n",
        },
    )
    graph = importgraph.edges(modules)
    assert importgraph.cycles(modules, graph) == [["gptools.a", "gptools.b", "gptools.c"]]


def test_glue_that_imports_a_runtime_module_directly_is_named_with_its_line(tmp_path: Path) -> None:
    modules = modules_in(
        tmp_path,
        {
            "vllm.graphpersist_ok": "from graphpersist import engine\nfrom graphpersist.engine import switch\n",
            "vllm.graphpersist_bad": "import os\n\nfrom graphpersist.memory import region\n",
            "graphpersist.engine": "",
            "graphpersist.memory.region": "",
        },
    )
    bad = importgraph.glue_violations(modules, importgraph.edges(modules))
    assert [line.split(": ", 1)[1] for line in bad] == [
        "engine glue imports graphpersist.memory.region; use graphpersist.engine"
    ]
    assert bad[0].split(":")[1] == "3"
