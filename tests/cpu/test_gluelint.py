"""The glue lint: an upstream name the glue touches that hooks.toml does not declare fails `make check`.

Each test writes a small engine ("fakeeng"): its glue under overlays/fakeeng/, a patch that calls into the glue (what
makes a glue function's arguments upstream's) and a hooks.toml. No upstream tree is needed: the lint compares the
glue with the declarations only.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gptools import gluelint, hooks
from gptools.contract import load_contract

PATCH = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] Call the glue

--- a/fakeeng/runner.py
+++ b/fakeeng/runner.py
@@ -1,2 +1,3 @@
 def capture(self):
+    graphpersist_glue.captured(self)
     return None
"""


class Engine:
    """A fake engine's glue, patches and declarations in a temporary folder."""

    def __init__(self, root: Path, glue: str, declared: str = "", runtime: str = "") -> None:
        self.root = root
        self.glue = root / "overlays" / "fakeeng"
        (self.glue / "fakeeng").mkdir(parents=True)
        (self.glue / "fakeeng" / "graphpersist_glue.py").write_text(textwrap.dedent(glue))
        self.patches = root / "patches" / "fakeeng"
        self.patches.mkdir(parents=True)
        (self.patches / "0001-call-the-glue.patch").write_text(PATCH)
        self.declare(declared)
        self.runtime = root / "runtime"
        self.runtime.mkdir()
        (self.runtime / "session.py").write_text(textwrap.dedent(runtime) or "class RankSession:\n    timings = {}\n")

    def declare(self, text: str) -> None:
        (self.patches / "hooks.toml").write_text('[[hook]]\ntarget = "fakeeng.runner:capture"\nparams = ["self"]\n'
                                                 + textwrap.dedent(text))  # fmt: skip

    def lint(self) -> gluelint.LintReport:
        return gluelint.lint("fakeeng", load_contract(self.patches / "hooks.toml"), self.glue, runtime=self.runtime)

    def undeclared(self) -> list[str]:
        """Each finding as `line: name (how)`."""
        return [f"{u.line}: {u.name} ({u.how})" for u in self.lint().undeclared]


def test_the_lint_catches_an_undeclared_private_name_and_an_undeclared_import(tmp_path: Path) -> None:
    engine = Engine(
        tmp_path,
        """\
        from fakeeng.ops import fused_op


        def captured(runner):
            fused_op(runner.model)
            return runner._secret
        """,
        '[[attrs]]\ntarget = "fakeeng.runner:Runner"\nnames = ["model"]\n',
    )
    report = engine.lint()
    hooks_file = engine.patches / "hooks.toml"
    glue_file = engine.glue / "fakeeng" / "graphpersist_glue.py"
    assert [u.text() for u in report.undeclared] == [
        f"{glue_file}:1: fakeeng.ops:fused_op is not declared in {hooks_file} (imported from upstream)",
        f"{glue_file}:6: _secret is not declared in {hooks_file} (read on an upstream value)",
    ]
    assert "--undeclared" in report.lines()[-1], "the last line says how to list what is missing"

    engine.declare(
        '[[attrs]]\ntarget = "fakeeng.runner:Runner"\nnames = ["model", "_secret"]\nused_by = "glue"\nwhy = "test"\n'
        '[[hook]]\ntarget = "fakeeng.ops:fused_op"\nparams = ["model"]\n'
    )
    report = engine.lint()
    assert report.undeclared == []
    assert report.touched == {"fakeeng.ops:fused_op", "model", "_secret"}
    assert report.lines() == [
        f"fakeeng: the glue ({engine.glue}, 1 modules) touches 3 upstream names, every one declared in {hooks_file}"
    ]


def test_what_the_glue_owns_is_exempt_and_what_it_got_from_upstream_is_not(tmp_path: Path) -> None:
    engine = Engine(
        tmp_path,
        """\
        from dataclasses import dataclass, field
        from typing import Any

        import torch
        from session import RankSession


        @dataclass
        class Session(RankSession):
            notes: dict = field(default_factory=dict)
            runner: Any = None


        def record(sess: Session, runner: Any) -> None:
            sess.notes["x"] = sess.timings              # ours: the glue's class and the runtime's
            sess.runner = runner
            sess.runner.model                           # upstream, declared
            runner.kv_pool                              # upstream, undeclared
            runner.model.named_parameters()             # a torch name on an upstream value
            runner.model.items()                        # a builtin type's name on an upstream value
            torch.cuda.synchronize()                    # a library's


        def helper(thing):
            return thing.timings, thing.secret_sauce    # a value no caller pins down: upstream's


        def captured(runner):
            record(Session(), runner)
            return [s.num_tokens for s in runner.sizes]  # items of upstream values are upstream's
        """,
        '[[attrs]]\ntarget = "fakeeng.runner:Runner"\nnames = ["model", "sizes"]\n',
    )
    assert engine.undeclared() == [
        "18: kv_pool (read on an upstream value)",
        "25: secret_sauce (read on an upstream value)",
        "25: timings (read on an upstream value)",
        "30: num_tokens (read on an upstream value)",
    ]


def test_a_glue_class_derived_from_an_upstream_class_and_monkeypatching_are_checked_exactly(tmp_path: Path) -> None:
    engine = Engine(
        tmp_path,
        """\
        from fakeeng.runner import Runner


        class PersistRunner(Runner):
            def capture(self, size):
                self.mine = size                # ours: assigned here
                self.model.to(self.mine)        # declared on Runner (`to`: torch's)
                super().capture(self.device)    # capture is a declared method; device is not declared


        def install(fn):
            Runner.capture = fn                 # a declared method, replaced
            Runner.forward = fn                 # undeclared, written
            del Runner._cache                   # undeclared, deleted
        """,
        '[[attrs]]\ntarget = "fakeeng.runner:Runner"\nnames = ["model"]\n'
        '[[hook]]\ntarget = "fakeeng.runner:Runner.capture"\nparams = ["self", "size"]\n',
    )
    assert engine.undeclared() == [
        "8: device (read on self, a fakeeng.runner:Runner)",
        "13: forward (written on the upstream class fakeeng.runner:Runner)",
        "14: _cache (deleted on the upstream class fakeeng.runner:Runner)",
    ]


def test_module_names_computed_attribute_names_and_keywords(tmp_path: Path) -> None:
    glue = """\
        import fakeeng
        import fakeeng.envs as envs
        from fakeeng import groups as ps
        from fakeeng.config import Config

        GROUPS = ("tp", "pp")


        def communicators():
            return [getattr(ps, f"_{g.upper()}") for g in GROUPS]


        def make():
            return Config(size=1, colour="red"), envs.CACHE_ROOT, getattr(fakeeng, "__version__", "")
        """
    engine = Engine(tmp_path, glue, '[[attrs]]\ntarget = "fakeeng.config:Config"\nnames = ["size"]\n')
    assert engine.undeclared() == [
        "2: fakeeng.envs (an imported upstream module)",
        "3: fakeeng:groups (imported from upstream)",
        "10: getattr(..., f'_{g.upper()}') (a computed attribute name on a value that is not ours: list "
        "fakeeng/graphpersist_glue.py:communicators in the computed_in of the [[attrs]] declaring the names it takes "
        "(or, for a generic walk, as reflective in gluelint_allow.toml))",
        "14: CACHE_ROOT (read on an upstream value)",
        "14: fakeeng.config:Config(colour=) (a keyword argument: declare it in the params/requires of that hook, or "
        "among the class's [[attrs]] when it is a dataclass field)",
        "14: fakeeng:__version__ (read (by getattr) on the upstream module fakeeng)",
    ]
    engine.declare(
        '[[attrs]]\ntarget = "fakeeng.config:Config"\nnames = ["size", "colour"]\n'
        '[[attrs]]\ntarget = "fakeeng.envs"\nnames = ["CACHE_ROOT"]\n'
        '[[attrs]]\ntarget = "fakeeng"\nnames = ["__version__"]\n'
        '[[attrs]]\ntarget = "fakeeng.groups"\nnames = ["_TP", "_PP"]\n'
        'computed_in = ["fakeeng/graphpersist_glue.py:communicators"]\n'
    )
    assert engine.undeclared() == []


def test_attributes_a_patch_adds_to_upstream_classes_are_ours(tmp_path: Path) -> None:
    engine = Engine(tmp_path, "def captured(args):\n    return args.graph_persist, args.graph_persist_dir\n")
    assert len(engine.undeclared()) == 2
    (engine.patches / "0002-add-the-switch.patch").write_text(
        "--- a/fakeeng/args.py\n+++ b/fakeeng/args.py\n@@ -1,2 +1,4 @@\n class Args:\n"
        "+    graph_persist: str | None = None\n+    graph_persist_dir: str | None = None\n     model: str = ''\n"
    )
    assert engine.undeclared() == []


def test_undeclared_names_come_with_the_upstream_classes_that_define_them(tmp_path: Path) -> None:
    engine = Engine(
        tmp_path,
        "from fakeeng.runner import Runner\n\n\ndef captured(runner):\n    return runner.kv_pool\n",
        '[[attrs]]\ntarget = "fakeeng.runner:Runner"\nnames = ["model"]\n',
    )
    tree = tmp_path / "tree" / "fakeeng"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "runner.py").write_text("class Runner:\n    def __init__(self):\n        self.kv_pool = None\n")
    report = engine.lint()
    report.suggest(tmp_path / "tree")
    [u] = report.undeclared
    assert (u.name, u.candidates) == ("kv_pool", ["fakeeng.runner:Runner"])
    assert "    defined upstream by: fakeeng.runner:Runner" in report.lines()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_real_glue_touches_only_declared_upstream_names(engine: str, repo_root: Path) -> None:
    """`make check` runs this lint too (gptools hooks); here without the upstream tree."""
    report = gluelint.lint(engine, load_contract(repo_root / "patches" / engine / "hooks.toml"),
                           repo_root / "overlays" / engine)  # fmt: skip
    assert [u.text() for u in report.undeclared] == []
    assert len(report.touched) > 50, "the lint follows the glue into upstream objects (vLLM: 100, SGLang: 130)"


def test_an_engine_that_is_not_pinned_is_linted_but_has_no_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A new engine folder (patches/deep_ep/ with a hooks.toml) is checked as soon as it declares anything."""
    import gpdist

    engine = Engine(tmp_path, "def captured(buffer):\n    return buffer.num_sms\n")
    (tmp_path / "patches" / "deep_ep").mkdir()
    (tmp_path / "patches" / "deep_ep" / "hooks.toml").write_text('[[hook]]\ntarget = "deep_ep:Buffer"\n')
    monkeypatch.setattr(gpdist, "REPO_ROOT", tmp_path)
    assert hooks.engine_choices()[-2:] == ["deep_ep", "fakeeng"]
    report = hooks.run("fakeeng", hooks_file=engine.patches / "hooks.toml", glue=engine.glue)
    assert report.tree is None
    assert report.findings == [
        "overlays/fakeeng/fakeeng/graphpersist_glue.py:2: num_sms is not declared in patches/fakeeng/hooks.toml (read "
        "on an upstream value)"
    ]
    hooks._print_human(report, show_tree=True)
    assert "fakeeng: no pinned upstream tree" in capsys.readouterr().out


def test_an_adapter_our_runtime_calls_may_get_ours_or_upstreams(tmp_path: Path) -> None:
    """Methods of a glue class built on a runtime class are called by the runtime: their arguments may be ours
    (the session) or upstream's; annotating a parameter with its class says which."""
    engine = Engine(
        tmp_path,
        """\
        from session import RankSession


        class Adapter(RankSession):
            def facts(self, session, runner):
                return session.timings, runner.kv_pool     # unknown: a name of ours passes, an unknown one not


        def captured(runner):
            return runner.timings                          # a patch passes it: upstream's
        """,
    )
    assert engine.undeclared() == [
        "6: kv_pool (read on a value the lint cannot tell is ours)",
        "10: timings (read on an upstream value)",
    ]


def test_a_parameter_annotated_with_an_upstream_class_is_checked_against_that_class(tmp_path: Path) -> None:
    engine = Engine(
        tmp_path,
        """\
        from fakeeng.runner import Runner, Worker


        def step(runner: Runner, worker: Worker):
            return runner.model, runner.rank, worker.rank
        """,
        '[[attrs]]\ntarget = "fakeeng.runner:Runner"\nnames = ["model"]\n'
        '[[attrs]]\ntarget = "fakeeng.runner:Worker"\nnames = ["rank"]\n',
    )
    assert engine.undeclared() == ["5: rank (read on a fakeeng.runner:Runner)"]
