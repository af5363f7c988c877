"""The import graph (`python -m gptools imports`, run by `make check`): no loops of modules or of packages, and
engine glue that reaches the runtime only through its engine interface."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

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
    limit = sys.getrecursionlimit()
    assert importgraph.cycles(modules, graph) == []
    assert sys.getrecursionlimit() == limit  # the search's deeper limit does not outlive it (other tests share it)
    assert importgraph.package_loops(modules, graph) == []
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


# archive -> memory through one pair of modules, memory -> archive through another: no module loop, a package loop.
PACKAGE_LOOP = {
    "graphpersist.archive.manifest": "from graphpersist.memory.phases import Phase\n",
    "graphpersist.archive.base": "",
    "graphpersist.memory.phases": "",
    "graphpersist.memory.hostmem": "from graphpersist.archive import base\n",
    "graphpersist.records": "",
}


def test_a_loop_between_packages_without_a_loop_between_modules_is_found_with_the_imports_that_make_it(
    tmp_path: Path,
) -> None:
    modules = modules_in(tmp_path, PACKAGE_LOOP)
    graph = importgraph.edges(modules)
    assert importgraph.cycles(modules, graph) == []
    [(packages, crossing)] = importgraph.package_loops(modules, graph)
    assert packages == ["graphpersist.archive", "graphpersist.memory"]
    assert [(e.source, e.target) for e in crossing] == [
        ("graphpersist.archive.manifest", "graphpersist.memory.phases"),
        ("graphpersist.memory.hostmem", "graphpersist.archive.base"),
    ]


def test_make_check_fails_on_a_package_loop_naming_the_packages_and_the_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    modules = modules_in(tmp_path, PACKAGE_LOOP)
    monkeypatch.setattr(importgraph, "project_modules", lambda: modules)
    monkeypatch.setattr(importgraph, "client_imports", lambda repo, runtime: [])  # no recipes in this tree
    monkeypatch.setattr(importgraph, "load_allowances", lambda: [])
    assert importgraph.run(argparse.Namespace(json=False)) == 1
    out = capsys.readouterr().out
    assert "imports: package loop: graphpersist.archive <-> graphpersist.memory (" in out
    assert "graphpersist.archive.manifest:1 imports graphpersist.memory.phases" in out
    moved = {**PACKAGE_LOOP, "graphpersist.archive.manifest": "from graphpersist.records import Phase\n"}
    monkeypatch.setattr(importgraph, "project_modules", lambda: modules_in(tmp_path / "fixed", moved))
    assert importgraph.run(argparse.Namespace(json=False)) == 0


def test_recipes_and_tools_import_the_runtime_only_through_its_facade_or_a_reviewed_allowance() -> None:
    runtime = [m for m in importgraph.project_modules() if m.startswith("graphpersist")]
    imports = importgraph.client_imports(importgraph.REPO, runtime)
    allowances = importgraph.load_allowances()
    assert importgraph.facade_violations(imports, allowances) == []
    assert {"recipes/runtime-tp2/proof.py", "tools/gptools/hostkit.py"} <= {i.path for i in imports}
    unlisted = {i.target for i in imports if not any(a.covers(i.path) for a in allowances)}
    assert unlisted == {"graphpersist.api"}
    assert [a.path for a in allowances] == ["tools/gpdiag/", "recipes/diagnosis/", "recipes/runtime-scale/cpu_bench.py"]


def test_a_recipe_that_bypasses_the_facade_is_named_with_its_line_and_an_unused_allowance_is_stale(
    tmp_path: Path,
) -> None:
    files = {
        "recipes/a/proof.py": "from graphpersist import api\nfrom graphpersist.memory import region\n",
        "tools/gpdiag/wrap.py": "from graphpersist.memory import region, tensors\n",
        "tools/gptools/kit.py": "import graphpersist.archive\nfrom . import kit\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    runtime = ["graphpersist", "graphpersist.api", "graphpersist.archive", "graphpersist.memory.region",
               "graphpersist.memory.tensors"]  # fmt: skip
    imports = importgraph.client_imports(tmp_path, runtime)
    allowances = [importgraph.Allowance("tools/gpdiag/", ("graphpersist.memory.region", "graphpersist.run"), "why")]
    assert importgraph.facade_violations(imports, allowances) == [
        "recipes/a/proof.py:2: imports graphpersist.memory.region; recipes and tools use graphpersist.api",
        "tools/gpdiag/wrap.py:1: imports graphpersist.memory.tensors; recipes and tools use graphpersist.api",
        "tools/gptools/kit.py:1: imports graphpersist.archive; recipes and tools use graphpersist.api",
        "tools/gptools/facade_allow.toml: tools/gpdiag/ may import graphpersist.run, which nothing there imports any "
        "more",
    ]
