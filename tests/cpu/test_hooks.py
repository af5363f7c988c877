"""Hook points: every upstream function our patches/overlays hook exists with the parameters we expect."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gptools import hooks


def _copy_module(tree: Path, rel: str, dest: Path) -> Path:
    """Copy one upstream file into a scratch tree (the pristine tree is never modified)."""
    target = dest / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tree / rel, target)
    return target


@pytest.mark.network  # reads the pristine upstream trees (downloaded unless cached)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_hooks_match_the_pristine_pinned_tree(
    engine: str, upstream_tree: Callable[[str], Path], repo_root: Path
) -> None:
    hooks_file = repo_root / "patches" / engine / "hooks.toml"
    assert hooks.load_hooks(hooks_file), "no hook points declared"
    assert hooks.check_hooks(upstream_tree(engine), hooks_file) == []


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_patched_file_has_a_declared_hook(engine: str, repo_root: Path) -> None:
    """A patch that edits a module whose functions nobody declared would escape the check."""
    declared = {
        h.module.replace(".", "/") + ".py" for h in hooks.load_hooks(repo_root / "patches" / engine / "hooks.toml")
    }
    series = (repo_root / "patches" / engine / "series").read_text().split()
    for name in series:
        for line in (repo_root / "patches" / engine / name).read_text().splitlines():
            if line.startswith("+++ b/"):
                assert line[len("+++ b/") :] in declared, f"{name} edits {line[6:]} but hooks.toml declares none of it"


@pytest.mark.network  # reads the pristine upstream trees (downloaded unless cached)
def test_renamed_method_is_reported(upstream_tree: Callable[[str], Path], repo_root: Path, tmp_path: Path) -> None:
    rel = "vllm/engine/arg_utils.py"
    path = _copy_module(upstream_tree("vllm"), rel, tmp_path)
    path.write_text(
        path.read_text().replace(
            "    def add_cli_args(parser: FlexibleArgumentParser)",
            "    def add_engine_cli_args(parser: FlexibleArgumentParser)",
            1,
        )
    )
    hooks_file = tmp_path / "hooks.toml"
    hooks_file.write_text('[[hook]]\ntarget = "vllm.engine.arg_utils:EngineArgs.add_cli_args"\nparams = ["parser"]\n')
    assert hooks.check_hooks(tmp_path, hooks_file) == [
        "vllm.engine.arg_utils:EngineArgs.add_cli_args: not found: EngineArgs has no definition named "
        "'add_cli_args' (vllm/engine/arg_utils.py); similar names here: add_engine_cli_args, from_cli_args"
    ]


@pytest.mark.network  # reads the pristine upstream trees (downloaded unless cached)
def test_removed_parameter_is_reported(upstream_tree: Callable[[str], Path], repo_root: Path, tmp_path: Path) -> None:
    rel = "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py"
    path = _copy_module(upstream_tree("sglang"), rel, tmp_path)
    text = path.read_text()
    old = "def __init__(self, model_runner: ModelRunner):"
    assert text.count(old) == 1
    path.write_text(text.replace(old, "def __init__(self):"))
    findings = hooks.check_hooks(tmp_path, repo_root / "patches" / "sglang" / "hooks.toml")
    assert (
        "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.__init__: "
        "parameters changed: expected (self, model_runner), found (self) at line 255"
    ) in findings
    # Modules absent from the scratch tree are reported too, never silently skipped.
    assert any(
        "server_args:ServerArgs.__post_init__: not found: module sglang.srt.server_args not found" in f
        for f in findings
    )


@pytest.mark.network  # reads the pristine upstream trees (downloaded unless cached)
def test_lost_var_keyword_is_reported(upstream_tree: Callable[[str], Path], tmp_path: Path) -> None:
    rel = "vllm/entrypoints/llm.py"
    path = _copy_module(upstream_tree("vllm"), rel, tmp_path)
    text = path.read_text()
    assert text.count("        **kwargs: Any,\n    ) -> None:") == 1
    path.write_text(text.replace("        **kwargs: Any,\n    ) -> None:", "    ) -> None:"))
    hooks_file = tmp_path / "hooks.toml"
    hooks_file.write_text('[[hook]]\ntarget = "vllm.entrypoints.llm:LLM.__init__"\nrequires = ["model", "**kwargs"]\n')
    [finding] = hooks.check_hooks(tmp_path, hooks_file)
    assert finding.startswith("vllm.entrypoints.llm:LLM.__init__: missing parameter(s) **kwargs; found (self, model")


def test_class_turned_function_is_reported(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def Thing():\n    pass\n")
    hooks_file = tmp_path / "hooks.toml"
    hooks_file.write_text('[[hook]]\ntarget = "pkg.mod:Thing"\nkind = "class"\n')
    assert hooks.check_hooks(tmp_path, hooks_file) == ["pkg.mod:Thing: expected a class, found a function (line 1)"]


def test_definitions_inside_if_and_try_blocks_are_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        "import sys\nif sys.version_info < (3, 13):\n    def f(a, /, b, *c, d, **e):\n        pass\n"
        "try:\n    class K:\n        async def m(self, *, x):\n            pass\nexcept ImportError:\n    pass\n"
    )
    hooks_file = tmp_path / "hooks.toml"
    hooks_file.write_text(
        '[[hook]]\ntarget = "pkg:f"\nparams = ["a", "/", "b", "*c", "d", "**e"]\n'
        '[[hook]]\ntarget = "pkg:K.m"\nparams = ["self", "*", "x"]\n'
    )
    assert hooks.check_hooks(tmp_path, hooks_file) == []


@pytest.mark.parametrize(
    "body, message",
    [
        ('[[hook]]\ntarget = "no_colon.Name"\n', "target must be"),
        ('[[hook]]\ntarget = "m:f"\nparams = "self"\n', "params must be a list of strings"),
        ('[[hook]]\ntarget = "m:f"\nkind = "method"\n', "kind must be one of"),
        ('[[hook]]\ntarget = "m:f"\nparam = ["self"]\n', "unknown keys param"),
        ("", r"no \[\[hook\]\] tables"),
    ],
)
def test_malformed_hooks_file_is_a_usage_error(tmp_path: Path, body: str, message: str) -> None:
    hooks_file = tmp_path / "hooks.toml"
    hooks_file.write_text(body)
    with pytest.raises(hooks.HooksFileError, match=message):
        hooks.check_hooks(tmp_path, hooks_file)


@pytest.mark.network  # reads the pristine upstream trees (downloaded unless cached)
def test_cli_exit_codes(upstream_tree: Callable[[str], Path], repo_root: Path, tmp_path: Path) -> None:
    env_path = ":".join(str(repo_root / p) for p in ("build", "tools", "overlays/graphpersist"))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gptools.hooks", *args],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
            cwd=repo_root,
        )

    upstream_tree("vllm"), upstream_tree("sglang")  # unpacked before the subprocesses look for them
    ok = cli("--engine", "all")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "vllm: all" in ok.stdout and "sglang: all" in ok.stdout
    bad = cli("--engine", "vllm", "--tree", str(tmp_path), "--json")
    assert bad.returncode == 1
    assert '"findings"' in bad.stdout and "not found" in bad.stdout
    misuse = cli("--engine", "all", "--tree", str(tmp_path))
    assert misuse.returncode == 2
