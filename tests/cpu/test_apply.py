"""Strict apply: zero fuzz, zero offset, whole patches only; classify says how far off each hunk is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gptools_fixtures import make_series, standard_changes, upstream_files, write_tree

from gptools.apply import CLEAN, CONFLICT, FUZZY, PatchApplyError, apply_series, classify_series
from gptools.series import load_series, read_series


@pytest.fixture
def series(tmp_path: Path) -> Path:
    return make_series(tmp_path, upstream_files(), standard_changes()).patches_dir


def tree_with(tmp_path: Path, files: dict[str, str], name: str = "tree") -> Path:
    return write_tree(tmp_path / name, files)


def snapshot(tree: Path) -> dict[str, bytes]:
    return {p.relative_to(tree).as_posix(): p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}


def test_clean_apply_changes_exactly_what_the_series_says(tmp_path: Path, series: Path) -> None:
    tree = tree_with(tmp_path, upstream_files())
    results = apply_series(tree, series)
    assert [r.name for r in results] == read_series(series).names
    assert [r.hunks for r in results] == [1, 2]
    assert "    y = hook(y)\n" in (tree / "fakepkg/config.py").read_text()
    engine = (tree / "fakepkg/engine.py").read_text()
    assert "# before capture" in engine and "# after capture" in engine
    assert (tree / "fakepkg/utils.py").read_text() == upstream_files()["fakepkg/utils.py"]


def test_dry_run_checks_the_whole_series_and_writes_nothing(tmp_path: Path, series: Path) -> None:
    tree = tree_with(tmp_path, upstream_files())
    before = snapshot(tree)
    results = apply_series(tree, series, dry_run=True)
    assert len(results) == 2 and not any(r.applied for r in results)
    assert snapshot(tree) == before


def test_offset_is_refused_and_nothing_is_written(tmp_path: Path, series: Path) -> None:
    files = upstream_files()
    files["fakepkg/engine.py"] = "import os\nimport sys\nimport re\n" + files["fakepkg/engine.py"]
    tree = tree_with(tmp_path, files)
    with pytest.raises(PatchApplyError) as err:
        apply_series(tree, series)
    msg = str(err.value)
    second = read_series(series).names[1]
    assert f"patch {second}" in msg
    assert "fakepkg/engine.py hunk #1" in msg and "offset +3 lines" in msg
    assert "fakepkg/engine.py hunk #2" in msg
    assert "make edit ENGINE=patches" in msg or "make edit ENGINE=" in msg
    # The first patch applied; the refused one left its file untouched (no half patch).
    assert (tree / "fakepkg/engine.py").read_text() == files["fakepkg/engine.py"]


def test_conflicting_hunk_names_patch_file_and_hunk(tmp_path: Path, series: Path) -> None:
    files = upstream_files()
    files["fakepkg/engine.py"] = files["fakepkg/engine.py"].replace("    y = x + 9\n", "    y = x - 9\n")
    tree = tree_with(tmp_path, files)
    with pytest.raises(PatchApplyError) as err:
        apply_series(tree, series)
    msg = str(err.value)
    assert read_series(series).names[1] in msg
    assert "fakepkg/engine.py hunk #2 (@@ -" in msg and "FAILED" in msg
    assert "hunk #1" not in msg  # the first hunk is fine; only the failing one is named
    assert err.value.classification is not None and err.value.classification.status == CONFLICT
    # hunk #1 would apply, but the patch is refused as a whole: nothing of it was written.
    assert (tree / "fakepkg/engine.py").read_text() == files["fakepkg/engine.py"]


def test_missing_file_is_a_failure_not_a_skip(tmp_path: Path, series: Path) -> None:
    files = upstream_files()
    del files["fakepkg/config.py"]
    tree = tree_with(tmp_path, files)
    with pytest.raises(PatchApplyError) as err:
        apply_series(tree, series)
    assert "fakepkg/config.py hunk #1" in str(err.value) and "FAILED" in str(err.value)


def test_tree_inside_another_git_repository_still_applies_everything(tmp_path: Path, series: Path) -> None:
    """git apply run below a repository root would silently skip paths; the tree must be the patch root."""
    outer = tmp_path / "outer"
    outer.mkdir()
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    tree = tree_with(outer, upstream_files(), name="nested/tree")
    apply_series(tree, series)
    assert "hook(y)" in (tree / "fakepkg/config.py").read_text()


def test_classify_reports_offset_fuzz_and_conflict_per_hunk(tmp_path: Path, series: Path) -> None:
    files = upstream_files()
    files["fakepkg/config.py"] = "import os\n" + files["fakepkg/config.py"]  # offset +1
    # Outermost context line of engine hunk #1 changed: applies with fuzz; hunk #2's changed line conflicts.
    files["fakepkg/engine.py"] = (
        files["fakepkg/engine.py"]
        .replace("\n\ndef engine_3(x):", "\n# note\ndef engine_3(x):")
        .replace("    y = x + 9\n", "    y = 9\n")
    )
    tree = tree_with(tmp_path, files)
    config, engine = classify_series(tree, series)
    assert config.status == FUZZY
    assert [(h.status, h.offset) for h in config.hunks] == [("offset", 1)]
    assert engine.status == CONFLICT
    assert engine.hunks[0].status == "fuzz" and engine.hunks[0].fuzz >= 1
    assert engine.hunks[1].status == "failed" and engine.hunks[1].file == "fakepkg/engine.py"


def test_classify_clean(tmp_path: Path, series: Path) -> None:
    tree = tree_with(tmp_path, upstream_files())
    assert [c.status for c in classify_series(tree, series)] == [CLEAN, CLEAN]


def test_cli_apply_exit_codes(tmp_path: Path, series: Path, repo_root: Path) -> None:
    env = {"PYTHONPATH": f"{repo_root}/build:{repo_root}/tools", "PATH": "/usr/bin:/bin"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gptools", *args], capture_output=True, text=True, env=env)

    good = tree_with(tmp_path, upstream_files(), "good")
    ok = run("apply", "--engine", "vllm", "--tree", str(good), "--patches-dir", str(series))
    assert ok.returncode == 0, ok.stderr
    assert "2 patch(es) apply with zero fuzz and zero offset" in ok.stdout
    files = upstream_files()
    files["fakepkg/config.py"] = files["fakepkg/config.py"].replace("    y = x + 3\n", "    y = x * 3\n")
    bad = run(
        "apply", "--engine", "vllm", "--tree", str(tree_with(tmp_path, files, "bad")), "--patches-dir", str(series)
    )
    assert bad.returncode == 1 and "fakepkg/config.py hunk #1" in bad.stderr
    assert run("apply", "--engine", "vllm", "--tree", str(tmp_path / "nowhere")).returncode == 2


@pytest.mark.network
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_real_series_applies_with_zero_fuzz_to_the_pinned_upstream(
    engine: str, pins, upstream_tree, tmp_path: Path
) -> None:
    pdir = pins.engine(engine).patches_dir
    listed = read_series(pdir).names
    pristine = upstream_tree(engine)
    patches = load_series(pdir)
    touched = {f.old_path for p in patches for f in p.files if f.old_path}
    scratch = tmp_path / "tree"
    for rel in touched:
        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine / rel, scratch / rel)
    results = apply_series(scratch, pdir)
    assert [r.name for r in results] == listed
    for patch in patches:  # every patched file really changed
        for f in patch.files:
            if f.old_path and f.new_path:
                assert (scratch / f.new_path).read_bytes() != (pristine / f.old_path).read_bytes(), f.path


def test_a_missing_series_file_is_an_error_not_an_empty_series(tmp_path: Path) -> None:
    """A deleted or mis-pathed series must never let the build ship unpatched wheels."""
    (tmp_path / "tree").mkdir()
    with pytest.raises(PatchApplyError, match="no series file"):
        apply_series(tmp_path / "tree", tmp_path / "no-such-patches")
