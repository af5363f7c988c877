"""The built SGLang wheel's persistence switch, checked on CPU WITHOUT importing SGLang.

`sglang.srt.server_args` imports torch and torchvision at module level (via sglang.srt.utils.common) and the
pinned wheel is CPython 3.12 only; no CPU torch for 3.12 is on disk and PyPI's is several GB. So instead of
importing ServerArgs these tests (1) read the patched server_args.py from the built wheel and check by AST that
the fields and both calls are where the patch means them to be, and that it compiles, and (2) run the SGLang
overlay module from the wheel against a stand-in with the same two fields. What this does NOT prove: that the
real ServerArgs accepts `sglang.Engine(graph_persist=...)` at run time; the GPU tests cover that.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import logging
import shutil
import subprocess
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from graphpersist.switch import SwitchError

pytestmark = pytest.mark.network  # every test reads the built SGLang wheel (dist/)

PY312 = Path("/root/.pyenv/versions/3.12.1/bin/python")
SERVER_ARGS = "sglang/srt/server_args.py"
OVERLAY = "sglang/srt/graphpersist_switch.py"


@pytest.fixture(scope="module")
def built(dist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two files this patch touches, extracted from the built SGLang wheel."""
    [wheel] = sorted(dist_dir.glob("sglang-0.5.17+gp.*.whl"))
    out = tmp_path_factory.mktemp("sglang-built")
    with zipfile.ZipFile(wheel) as zf:
        for name in (SERVER_ARGS, OVERLAY):
            zf.extract(name, out)
    return out


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    [node] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return node


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    [node] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return node


def _calls(node: ast.AST) -> list[tuple[int, str]]:
    return [(c.lineno, c.func.id) for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]


@pytest.fixture(scope="module")
def server_args_class(built: Path) -> ast.ClassDef:
    return _class(ast.parse((built / SERVER_ARGS).read_text()), "ServerArgs")


def test_fields_are_declared_with_default_none(server_args_class: ast.ClassDef) -> None:
    fields = {
        n.target.id: n
        for n in server_args_class.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    for name in ("graph_persist", "graph_persist_dir"):
        assert name in fields, f"ServerArgs has no field {name}"
        assert ast.unparse(fields[name].annotation) == "Optional[str]"
        assert isinstance(fields[name].value, ast.Constant) and fields[name].value.value is None


def test_post_init_resolves_the_switch_before_the_dummy_model_return(server_args_class: ast.ClassDef) -> None:
    post_init = _method(server_args_class, "__post_init__")
    [call_line] = [line for line, name in _calls(post_init) if name == "resolve_server_args"]
    first_return = min(n.lineno for n in ast.walk(post_init) if isinstance(n, ast.Return))
    assert call_line < first_return, "the switch must be validated even for dummy models, before any device work"
    imports = [n for n in ast.walk(post_init) if isinstance(n, ast.ImportFrom)]
    assert any(n.module == "sglang.srt.graphpersist_switch" for n in imports)


def test_add_cli_args_adds_the_flags_last(server_args_class: ast.ClassDef) -> None:
    add_cli_args = _method(server_args_class, "add_cli_args")
    last = add_cli_args.body[-1]
    assert isinstance(last, ast.Expr) and ast.unparse(last) == "add_gp_args(parser)"


@pytest.mark.skipif(not PY312.exists(), reason=f"{PY312} not found: the 3.12 compile check is NOT RUN")
def test_patched_files_compile_with_python_312(built: Path, tmp_path: Path) -> None:
    for name in (SERVER_ARGS, OVERLAY):
        target = tmp_path / Path(name).name
        shutil.copyfile(built / name, target)
        proc = subprocess.run([str(PY312), "-m", "py_compile", str(target)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def overlay(built: Path) -> ModuleType:
    """The overlay module from the wheel, loaded on its own (it needs only argparse, logging and graphpersist)."""
    spec = importlib.util.spec_from_file_location("gp_sglang_overlay_under_test", built / OVERLAY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class StandInServerArgs:
    """The two fields the patch adds to ServerArgs, with the same defaults."""

    graph_persist: str | None = None
    graph_persist_dir: str | None = None


def test_overlay_logs_one_line_for_cli_values(
    overlay: ModuleType, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRAPHPERSIST_MODE", raising=False)
    parser = argparse.ArgumentParser(prog="sglang serve")
    overlay.add_cli_args(parser)
    ns = parser.parse_args(["--graph-persist", "save", "--graph-persist-dir", str(tmp_path)])
    args = StandInServerArgs(ns.graph_persist, ns.graph_persist_dir)
    with caplog.at_level(logging.INFO):
        resolved = overlay.resolve_server_args(args)
    assert resolved.mode.value == "save" and resolved.directory == tmp_path
    assert [r.getMessage() for r in caplog.records] == [
        f"graphpersist: mode=save dir={tmp_path} (from --graph-persist, --graph-persist-dir)"
    ]


def test_overlay_help_and_bad_cli_value(overlay: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="sglang serve")
    overlay.add_cli_args(parser)
    assert "--graph-persist {off,save,load}" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--graph-persist", "sav"])
    assert "invalid persistence mode 'sav' (from --graph-persist); expected one of: off, save, load" in (
        capsys.readouterr().err
    )


def test_overlay_environment_and_keywords(overlay: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPERSIST_MODE", "load")
    monkeypatch.setenv("GRAPHPERSIST_DIR", str(tmp_path))
    assert overlay.resolve_server_args(StandInServerArgs()).mode_source == "GRAPHPERSIST_MODE"
    assert overlay.resolve_server_args(StandInServerArgs("off")).enabled is False
    monkeypatch.setenv("GRAPHPERSIST_MODE", "sav")
    with pytest.raises(SwitchError, match=r"'sav' \(from GRAPHPERSIST_MODE\)"):
        overlay.resolve_server_args(StandInServerArgs())


def test_overlay_off_logs_nothing(
    overlay: ModuleType, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRAPHPERSIST_MODE", raising=False)
    with caplog.at_level(logging.DEBUG):
        assert not overlay.resolve_server_args(StandInServerArgs()).enabled
    assert caplog.records == []
