"""What uses each declared name: `make check` fails on a declaration nothing uses and on a `used_by` that does not
hold, each with the line to change; gpdiag's own contract (tools/gpdiag/contract.toml) is checked like an engine's.

Most tests write a small engine ("fakeeng") in a temporary repository: a pristine tree, a patch series that edits it,
glue under overlays/fakeeng/ and a hooks.toml, then run `gptools hooks` on it as `make check` does.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from gptools import gluelint, hooks
from gptools.contract import load_contract

RUNNER = """\
class Runner:
    def __init__(self):
        self.model = None
        self.rank = 0

    def capture(self):
        return None

    def warmup(self, size):
        return size


def relied_on(x):
    return x
"""

PATCH_NAME = "0001-call-the-glue.patch"
PATCH = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: Test <test@example.invalid>
Date: Mon, 30 Nov 2026 00:00:00 +0000
Subject: [PATCH] Call the glue

Runner.capture reports each capture to the glue, which relies on
relied_on keeping its argument.

Upstream: not forwarded
Drop-when: never
---
diff --git a/fakeeng/runner.py b/fakeeng/runner.py
--- a/fakeeng/runner.py
+++ b/fakeeng/runner.py
@@ -6,2 +6,3 @@ class Runner:
     def capture(self):
+        graphpersist_glue.captured(self)
         return None
"""

GLUE = """\
FIELDS = ("rank",)  # what the archive records of a Runner, read by name below


def captured(runner):
    return runner.model, {name: getattr(runner, name) for name in FIELDS}
"""

GLUE_FILE = "overlays/fakeeng/fakeeng/graphpersist_glue.py"


def table(kind: str, target: str, **keys: object) -> str:
    """One hooks.toml table, a line per key."""
    return (
        "\n".join([f"[[{kind}]]", f'target = "{target}"', *(f"{k} = {json.dumps(v)}" for k, v in keys.items())]) + "\n"
    )


CAPTURE = table("hook", "fakeeng.runner:Runner.capture", params=["self"], used_by=PATCH_NAME)  # lines 1-4
MODEL = table("attrs", "fakeeng.runner:Runner", names=["model"])  # lines 5-7
RANK = table("attrs", "fakeeng.runner:Runner", names=["rank"], computed_in=["fakeeng/graphpersist_glue.py:captured"])
# lines 8-11; what a test adds starts at line 12


class Repo:
    """A temporary repository holding one fake engine: its pristine tree, series, glue and hooks.toml."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import gpdist

        self.root = root
        self.tree = root / "tree"
        (self.tree / "fakeeng").mkdir(parents=True)
        (self.tree / "fakeeng" / "__init__.py").write_text("")
        (self.tree / "fakeeng" / "runner.py").write_text(RUNNER)
        self.patches = root / "patches" / "fakeeng"
        self.patches.mkdir(parents=True)
        (self.patches / PATCH_NAME).write_text(PATCH)
        (self.patches / "series").write_text(PATCH_NAME + "\n")
        self.glue = root / "overlays" / "fakeeng"
        (self.glue / "fakeeng").mkdir(parents=True)
        self.write_glue(GLUE)
        monkeypatch.setattr(gpdist, "REPO_ROOT", root)

    def write_glue(self, text: str) -> None:
        (self.glue / "fakeeng" / "graphpersist_glue.py").write_text(textwrap.dedent(text))

    def findings(self, declared: str) -> list[str]:
        """What `gptools hooks --engine fakeeng` reports with these declarations (the tree matches them all)."""
        (self.patches / "hooks.toml").write_text(declared)
        report = hooks.run("fakeeng", self.tree)
        assert report.changes == [], "the fake tree defines every declared name"
        return report.findings


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Repo:
    return Repo(tmp_path, monkeypatch)


def test_a_contract_whose_every_name_is_used_passes(repo: Repo) -> None:
    assert repo.findings(CAPTURE + MODEL + RANK) == []


def test_a_declared_name_the_glue_no_longer_touches_is_dead(repo: Repo) -> None:
    repo.write_glue("def captured(runner):\n    return runner.model\n")
    findings = repo.findings(CAPTURE + '[[attrs]]\ntarget = "fakeeng.runner:Runner"\nnames = ["model", "rank"]\n')
    assert findings == [
        "patches/fakeeng/hooks.toml:5 [[attrs]] fakeeng.runner:Runner: used by nothing: rank (no glue line touches "
        "them, no used_by entry names them). Remove them from its names."
    ]


def test_a_declaration_nothing_uses_at_all_is_dead(repo: Repo) -> None:
    warmup = table("hook", "fakeeng.runner:Runner.warmup", params=["self", "size"])
    assert repo.findings(CAPTURE + MODEL + RANK + warmup) == [
        "patches/fakeeng/hooks.toml:12 [[hook]] fakeeng.runner:Runner.warmup: used by nothing: no glue line touches "
        "it and no used_by entry holds. Remove the table."
    ]


def test_a_used_by_naming_a_deleted_glue_file_is_stale(repo: Repo) -> None:
    deleted = "overlays/fakeeng/fakeeng/graphpersist_session.py"
    capture = table("hook", "fakeeng.runner:Runner.capture", params=["self"], used_by=[PATCH_NAME, deleted])
    assert repo.findings(capture + MODEL + RANK) == [
        "patches/fakeeng/hooks.toml:1 [[hook]] fakeeng.runner:Runner.capture: used_by names "
        "overlays/fakeeng/fakeeng/graphpersist_session.py, which is neither a patch of patches/fakeeng/series nor a "
        'glue file (its path from the repository root: overlays/...). Write used_by = ["0001-call-the-glue.patch"].'
    ]


def test_a_used_by_naming_the_glue_the_lint_reads_is_stale(repo: Repo) -> None:
    """The glue's own uses are the lint's to find: written down, they would only go stale."""
    model = table("attrs", "fakeeng.runner:Runner", names=["model"], used_by=GLUE_FILE)
    assert repo.findings(CAPTURE + model + RANK) == [
        "patches/fakeeng/hooks.toml:5 [[attrs]] fakeeng.runner:Runner: used_by names "
        "overlays/fakeeng/fakeeng/graphpersist_glue.py, whose use the lint sees "
        "(overlays/fakeeng/fakeeng/graphpersist_glue.py:5): used_by adds nothing. Delete its used_by line."
    ]


def test_a_patch_dropped_from_the_series_vouches_for_nothing(repo: Repo) -> None:
    (repo.patches / "series").write_text("")
    assert repo.findings(CAPTURE + MODEL + RANK) == [
        "patches/fakeeng/hooks.toml:1 [[hook]] fakeeng.runner:Runner.capture: used by nothing: no glue line touches "
        "it and no used_by entry holds: used_by names 0001-call-the-glue.patch, which is not in "
        "patches/fakeeng/series. Remove the table."
    ]


def test_a_patch_vouches_for_what_it_edits_or_names_and_nothing_else(repo: Repo) -> None:
    relied = table("hook", "fakeeng.runner:relied_on", params=["x"], used_by=PATCH_NAME)
    assert repo.findings(CAPTURE + MODEL + RANK + relied) == [], "the patch's header names relied_on"
    warmup = table("hook", "fakeeng.runner:Runner.warmup", params=["self", "size"], used_by=PATCH_NAME)
    assert repo.findings(CAPTURE + MODEL + RANK + warmup) == [
        "patches/fakeeng/hooks.toml:12 [[hook]] fakeeng.runner:Runner.warmup: used by nothing: no glue line touches "
        "it and no used_by entry holds: used_by names 0001-call-the-glue.patch, which does not name Runner.warmup "
        "nor edits it. Remove the table."
    ]


def test_a_glue_file_vouches_for_a_name_the_lint_cannot_see_while_it_names_it(repo: Repo) -> None:
    """Keywords passed through a **dict are out of the lint's sight: used_by names the file, which must name them."""
    repo.write_glue(
        """\
        SETTINGS = {"rank": 0}  # a Runner's keywords


        def captured(runner):
            return runner.model
        """
    )
    rank = table("attrs", "fakeeng.runner:Runner", names=["rank"], used_by=GLUE_FILE)
    assert repo.findings(CAPTURE + MODEL + rank) == []
    repo.write_glue("def captured(runner):\n    return runner.model\n")
    assert repo.findings(CAPTURE + MODEL + rank) == [
        "patches/fakeeng/hooks.toml:8 [[attrs]] fakeeng.runner:Runner: used by nothing (rank): no glue line touches "
        "it and no used_by entry holds: used_by names overlays/fakeeng/fakeeng/graphpersist_glue.py, which does not "
        "name Runner.rank. Remove the table."
    ]


def test_a_computed_in_naming_a_function_without_a_computed_getattr_is_stale(repo: Repo) -> None:
    sites = ["fakeeng/graphpersist_glue.py:captured", "fakeeng/graphpersist_glue.py:gone"]
    rank = table("attrs", "fakeeng.runner:Runner", names=["rank"], computed_in=sites)
    assert repo.findings(CAPTURE + MODEL + rank) == [
        "patches/fakeeng/hooks.toml:8 [[attrs]] fakeeng.runner:Runner: computed_in names "
        "fakeeng/graphpersist_glue.py:gone, where the lint finds no computed getattr on an upstream value. Write "
        'computed_in = ["fakeeng/graphpersist_glue.py:captured"].'
    ]


def test_uses_lists_each_declared_name_with_the_glue_lines_touching_it(repo: Repo) -> None:
    (repo.patches / "hooks.toml").write_text(CAPTURE + MODEL + RANK)
    report = hooks.run("fakeeng", repo.tree)
    assert report.usage is not None
    assert report.usage.lines() == [
        "patches/fakeeng/hooks.toml:1 [[hook]] fakeeng.runner:Runner.capture",
        "    fakeeng.runner:Runner.capture: 0001-call-the-glue.patch",
        "patches/fakeeng/hooks.toml:5 [[attrs]] fakeeng.runner:Runner",
        "    model: overlays/fakeeng/fakeeng/graphpersist_glue.py:5",
        "patches/fakeeng/hooks.toml:8 [[attrs]] fakeeng.runner:Runner",
        "    rank: overlays/fakeeng/fakeeng/graphpersist_glue.py:5",
    ]


@pytest.mark.network  # reads the pristine upstream trees (downloaded unless cached)
@pytest.mark.parametrize("contract", ["vllm", "sglang", "deep_ep", hooks.GPDIAG])
def test_the_real_contracts_are_used_as_they_say(contract: str, upstream_tree: Callable[[str], Path]) -> None:
    upstream_tree("deep_ep" if contract == "deep_ep" else "sglang" if contract == "sglang" else "vllm")
    report = hooks.run(contract)
    assert report.usage is not None, "checked against the pinned tree"
    assert report.findings == []
    assert report.usage.used == report.checked + report.declared, "every declared name is used"


# ------------------------------------------------------------------------------------------------------- gpdiag


def test_gpdiag_contract_declares_the_product_names_it_wraps() -> None:
    contract = load_contract(hooks.subject(hooks.GPDIAG).hooks_file)
    session = "graphpersist.engine.session:PersistSession"
    declared = {f"{session}.{n}" for n in contract.members(session)}
    wrapped = ("begin", "_save", "_restore", "ready", "finish")
    assert {f"{session}.{n}" for n in wrapped} <= declared
    assert "_kernel_warmup" in contract.members("vllm.graphpersist_worker:PersistWorker")
    assert "compile_forward" in contract.members("vllm.graphpersist_facts")
    assert "restore" in contract.members("graphpersist.memory.region")


def test_a_renamed_product_method_breaks_gpdiags_contract(repo_root: Path, tmp_path: Path) -> None:
    """The product's names are checked against the overlays' source, so renaming a step gpdiag wraps fails `make
    check` rather than a diagnosis run on a GPU host."""
    layer = tmp_path / "product"
    session = layer / "graphpersist" / "engine" / "session.py"
    session.parent.mkdir(parents=True)
    source = (repo_root / "overlays" / "graphpersist" / "graphpersist" / "engine" / "session.py").read_text()
    assert source.count("    def ready(self) -> None:") == 1
    session.write_text(source.replace("    def ready(self) -> None:", "    def serving(self) -> None:"))
    sub = hooks.subject(hooks.GPDIAG)
    contract = load_contract(sub.hooks_file)
    upstream = tmp_path / "no-vllm"  # gpdiag's vLLM names are the network test's; here only the product's count
    upstream.mkdir()
    found = [f.message for f in hooks.check_contract(upstream, contract, layers=(layer, *sub.layers))]
    product = [m for m in found if not m.startswith("vllm.") or m.startswith("vllm.graphpersist_")]
    assert product == [
        "graphpersist.engine.session:PersistSession.ready: attribute not found (searched "
        "graphpersist.engine.session:PersistSession)"
    ]


def test_gpdiag_touching_a_product_name_its_contract_lacks_fails(repo_root: Path, tmp_path: Path) -> None:
    sub = hooks.subject(hooks.GPDIAG)
    tables = sub.hooks_file.read_text().split("\n\n")
    kept = [t for t in tables if 'target = "graphpersist.engine.session:PersistSession.finish"' not in t]
    assert len(kept) == len(tables) - 1
    (tmp_path / "contract.toml").write_text("\n\n".join(kept))
    report = gluelint.lint(hooks.GPDIAG, load_contract(tmp_path / "contract.toml"), sub.glue, runtime=sub.runtime,
                           root=sub.root)  # fmt: skip
    assert {(u.path, u.name) for u in report.undeclared} == {("tools/gpdiag/vllm.py", "finish")}


def test_diagnosis_does_not_vouch_for_an_engines_declaration(repo: Repo) -> None:
    """What only tools/gpdiag reads belongs in gpdiag's contract: an engine's used_by names the product's glue only."""
    diag = repo.root / "tools" / "gpdiag" / "probe.py"
    diag.parent.mkdir(parents=True)
    diag.write_text("def probe(runner):  # a Runner\n    return runner.rank\n")
    repo.write_glue("def captured(runner):\n    return runner.model\n")
    rank = table("attrs", "fakeeng.runner:Runner", names=["rank"], used_by="tools/gpdiag/probe.py")
    assert repo.findings(CAPTURE + MODEL + rank) == [
        "patches/fakeeng/hooks.toml:8 [[attrs]] fakeeng.runner:Runner: used by nothing (rank): no glue line touches "
        "it and no used_by entry holds: used_by names tools/gpdiag/probe.py, which is neither a patch of "
        "patches/fakeeng/series nor a glue file (its path from the repository root: overlays/...). Remove the table."
    ]
