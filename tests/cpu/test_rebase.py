"""Rebase onto a new upstream: per-patch and per-hunk classification, conflicts left as markers, pins updated only
when the whole series is clean (always on a temporary copy of a pins file)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from gptools_fixtures import make_series, make_wheel, standard_changes, upstream_files, write_pins, write_tree

from gpdist import pins as pins_mod
from gptools.apply import CLEAN, CONFLICT, FUZZY
from gptools.rebase import (
    NewWheel,
    PatchOutcome,
    RebaseError,
    RebaseReport,
    finish,
    pick_wheel,
    rebase,
    update_pins_text,
)
from gptools.series import read_series
from gptools.worktree import git

OLD_WHEEL = "fakepkg-1.0.0-py3-none-any.whl"
NEW_WHEEL = "fakepkg-1.1.0-py3-none-any.whl"


class Setup:
    def __init__(self, tmp: Path, new_files: dict[str, str], old_files: dict[str, str] | None = None) -> None:
        self.patches = make_series(tmp, upstream_files(), standard_changes()).patches_dir
        self.names = read_series(self.patches).names
        old_files = old_files if old_files is not None else upstream_files()
        old_sha, old_size = make_wheel(tmp / OLD_WHEEL, old_files, version="1.0.0", commit="1111111")
        self.pins = write_pins(tmp / "pins.toml", OLD_WHEEL, old_size, old_sha)
        self.pins_before = self.pins.read_text()
        self.old_tree = write_tree(tmp / "old-tree", dict(old_files))
        sha, size = make_wheel(tmp / NEW_WHEEL, new_files, version="1.1.0", commit="abcdef1234")
        self.wheel = NewWheel(NEW_WHEEL, tmp / NEW_WHEEL, sha, size)
        self.work = tmp / "rebase"

    def run(self, version: str = "1.1.0"):
        return rebase(
            "fakepkg",
            version,
            pins_path=self.pins,
            work_root=self.work,
            patches_dir=self.patches,
            old_tree=self.old_tree,
            new_wheel=self.wheel,
        )


def with_unrelated_change() -> dict[str, str]:
    files = upstream_files()
    files["fakepkg/utils.py"] += "\n\ndef utils_new(x):\n    return x\n"
    files["fakepkg/extra.py"] = "VALUE = 2\n"
    return files


def test_conflict_is_classified_left_with_markers_and_pins_stay(tmp_path: Path) -> None:
    files = with_unrelated_change()
    files["fakepkg/engine.py"] = files["fakepkg/engine.py"].replace("    y = x + 9\n", "    y = x + 9 * 2\n")
    s = Setup(tmp_path, files)
    report = s.run()
    first, second = report.patches
    assert (first.name, first.status) == (s.names[0], CLEAN)
    assert (second.name, second.status) == (s.names[1], CONFLICT)
    assert [(h.file, h.index, h.status) for h in second.hunks] == [
        ("fakepkg/engine.py", 1, "exact"),
        ("fakepkg/engine.py", 2, "failed"),
    ]
    assert second.conflict_files == ["fakepkg/engine.py"]
    # The editable tree: first patch carried, stopped at the second with markers in the conflicting file.
    tree = Path(report.worktree)
    assert report.stopped_at == s.names[1] and report.conflict_markers == ["fakepkg/engine.py"]
    engine = (tree / "fakepkg/engine.py").read_text()
    assert "<<<<<<<" in engine and ">>>>>>>" in engine and "# after capture" in engine and "9 * 2" in engine
    assert "hook(y)" in (tree / "fakepkg/config.py").read_text()
    assert "def utils_new" in (tree / "fakepkg/utils.py").read_text()
    # Pins untouched; reports written.
    assert not report.pins_updated and s.pins.read_text() == s.pins_before
    md = (s.work / "fakepkg-1.1.0/report.md").read_text()
    assert md.splitlines()[0] == f"1 of 2 patches need work on fakepkg 1.1.0: {s.names[1]} (conflict)"
    assert "fakepkg/engine.py hunk #2" in md and "FAILED" in md
    data = json.loads((s.work / "fakepkg-1.1.0/report.json").read_text())
    assert data["counts"] == {CLEAN: 1, FUZZY: 0, CONFLICT: 1} and data["pins_updated"] is False


def test_offset_makes_a_patch_fuzzy_and_blocks_the_pin_update(tmp_path: Path) -> None:
    files = with_unrelated_change()
    files["fakepkg/config.py"] = "import os\n\n" + files["fakepkg/config.py"]
    s = Setup(tmp_path, files)
    report = s.run()
    assert [p.status for p in report.patches] == [FUZZY, CLEAN]
    assert [(h.status, h.offset) for h in report.patches[0].hunks] == [("offset", 2)]
    assert report.patches[0].merge == "applied" and not report.stopped_at
    assert not report.pins_updated and s.pins.read_text() == s.pins_before


def test_clean_series_updates_the_pins_copy(tmp_path: Path) -> None:
    s = Setup(tmp_path, with_unrelated_change())
    report = s.run()
    assert [p.status for p in report.patches] == [CLEAN, CLEAN] and report.clean
    assert report.pins_updated
    text = s.pins.read_text()
    assert "# test pins: comments must survive a rebase" in text and "# The wheel we patch." in text
    assert pins_mod.load(s.pins).engine("fakepkg").sdist is None, "the old sdist pin must not survive a re-pin"
    pin = pins_mod.load(s.pins).engine("fakepkg")
    assert (pin.version, pin.wheel.filename, pin.wheel.sha256, pin.wheel.size) == (
        "1.1.0",
        NEW_WHEEL,
        s.wheel.sha256,
        s.wheel.size,
    )
    assert pin.commit_wheel == "abcdef1234" and pin.requires_torch == "2.12.0"
    other = pins_mod.load(s.pins).engine("other")
    assert other.version == "9.9"  # other engines untouched
    assert (s.work / "fakepkg-1.1.0/report.md").read_text().startswith("all 2 patches apply cleanly to fakepkg 1.1.0")


def test_a_rebase_onto_the_pinned_release_keeps_its_sdist_pin(tmp_path: Path) -> None:
    """The same-version control (`make rebase VERSION=<the pinned one>`) re-pins the same release: its sdist pin
    still names that release and must survive, with its comment and commit."""
    s = Setup(tmp_path, upstream_files())
    before = pins_mod.load(s.pins).engine("fakepkg")
    s.wheel = NewWheel(OLD_WHEEL, tmp_path / OLD_WHEEL, before.wheel.sha256, before.wheel.size)
    report = s.run("1.0.0")
    assert report.clean and report.pins_updated
    after = pins_mod.load(s.pins).engine("fakepkg")
    assert after.sdist == before.sdist and after.sdist is not None
    assert after.commit_sdist == before.commit_sdist == "bbbbbbb"
    assert (after.version, after.wheel) == (before.version, before.wheel)
    assert after.commit_wheel == "1111111"  # what the wheel's _version.py says
    assert "# The sdist of the same release.\nsdist = " in s.pins.read_text()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_update_pins_text_onto_the_pinned_release_changes_nothing(repo_root: Path, engine: str) -> None:
    """On the real pins, re-pinning an engine to exactly what it pins is byte-for-byte a no-op."""
    real = (repo_root / "build/pins.toml").read_text()
    pin = pins_mod.load(repo_root / "build/pins.toml").engine(engine)
    wheel = NewWheel(pin.wheel.filename, Path(pin.wheel.filename), pin.wheel.sha256, pin.wheel.size)
    same = update_pins_text(
        real, engine, version=pin.version, wheel=wheel, commit=pin.commit_wheel, torch=pin.requires_torch
    )
    assert same == real


def test_hunk_placed_with_fuzz_where_the_merge_conflicts_is_reported_as_a_conflict(tmp_path: Path) -> None:
    # Upstream inserts two lines where the first patch inserts its line; the second ends like the hunk's leading
    # context, so GNU patch places the hunk after them with fuzz 2, while git's 3-way merge sees both sides insert
    # at the same point and conflicts. The report must call that hunk a conflict, not fuzz.
    files = with_unrelated_change()
    files["fakepkg/config.py"] = files["fakepkg/config.py"].replace(
        "    y = x + 3\n", "    y = x + 3\n    x = -x\n    y = x + 3\n", 1
    )
    s = Setup(tmp_path, files)
    report = s.run()
    first = report.patches[0]
    assert first.status == CONFLICT and first.conflict_files == ["fakepkg/config.py"]
    [hunk] = first.hunks
    assert (hunk.status, hunk.fuzz, hunk.offset) == (CONFLICT, 2, 2)
    assert hunk.message == (
        "GNU patch alone would apply it at line 20 (offset +2 lines, fuzz 2), but the 3-way merge conflicts at "
        "lines 21-22"
    )
    assert first.note == (
        "GNU patch alone would apply every hunk (fuzzy), but the 3-way merge conflicts in hunk(s) fakepkg/config.py #1"
    )
    md = (s.work / "fakepkg-1.1.0/report.md").read_text()
    assert md.splitlines()[0] == f"1 of 2 patches need work on fakepkg 1.1.0: {s.names[0]} (conflict)"
    assert f"- fakepkg/config.py hunk #1 (@@ -18,6 +18,7 @@ def config_2(x):): CONFLICT: {hunk.message}" in md
    assert "applies at line" not in md
    data = json.loads((s.work / "fakepkg-1.1.0/report.json").read_text())
    assert data["counts"] == {CLEAN: 1, FUZZY: 0, CONFLICT: 1}
    assert data["patches"][0]["hunks"][0]["status"] == CONFLICT


def test_change_already_upstream_is_not_reported_clean(tmp_path: Path) -> None:
    files = with_unrelated_change()
    files["fakepkg/config.py"] = files["fakepkg/config.py"].replace("y = x + 3\n", "y = x + 3\n    y = hook(y)\n")
    s = Setup(tmp_path, files)
    report = s.run()
    assert report.patches[0].status != CLEAN and "already upstream" in report.patches[0].merge
    assert s.pins.read_text() == s.pins_before


def test_next_steps_give_the_make_form_with_the_default_paths() -> None:
    report = RebaseReport(
        engine="vllm",
        project="vllm",
        old_version="0.26.0",
        new_version="0.33.0",
        wheel="vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        sha256="ab" * 32,
        wheel_size=1,
        generated="2026-11-30 00:00:00 UTC",
        host="h",
        worktree=".work/rebase/vllm-0.33.0/tree",
        pins_path=str(pins_mod.PINS_PATH),
    )
    assert report.finish_command() == "make rebase ENGINE=vllm VERSION=0.33.0 FINISH=1"
    assert (
        report.markdown()
        .rstrip()
        .endswith(
            "Refresh the patches' index lines with `make rebase ENGINE=vllm VERSION=0.33.0 FINISH=1` (from the "
            "repository root): it exports the rebased tree and checks it against the new upstream."
        )
    )
    report.patches.append(PatchOutcome("0001-x.patch", "x", FUZZY, merge="applied"))
    assert "then `make rebase ENGINE=vllm VERSION=0.33.0 FINISH=1` (from the repository root) refreshes" in (
        report.markdown()
    )


def test_update_pins_text_on_the_real_pins_keeps_everything_else(repo_root: Path, tmp_path: Path) -> None:
    real = (repo_root / "build/pins.toml").read_text()
    wheel = NewWheel("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl", tmp_path / "x", "ab" * 32, 123)
    new = update_pins_text(real, "vllm", version="0.33.0", wheel=wheel, commit="deadbeef", torch="2.12.0")
    copy = tmp_path / "pins.toml"
    copy.write_text(new)
    loaded = pins_mod.load(copy)
    vllm = loaded.engine("vllm")
    assert (vllm.version, vllm.wheel.filename, vllm.wheel.sha256, vllm.commit_wheel) == (
        "0.33.0",
        wheel.filename,
        "ab" * 32,
        "deadbeef",
    )
    assert vllm.sdist is None and vllm.requires_torch == "2.12.0"
    assert loaded.engine("sglang") == pins_mod.load(repo_root / "build/pins.toml").engine("sglang")
    assert loaded.dependencies == pins_mod.load(repo_root / "build/pins.toml").dependencies
    assert "# The only place where upstream versions" in new
    assert (repo_root / "build/pins.toml").read_text() == real


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        (["vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl"], 0),
        (["vllm-0.33.0-cp38-abi3-manylinux_2_31_aarch64.whl", "vllm-0.33.0-cp38-abi3-manylinux_2_34_x86_64.whl"], 1),
    ],
)
def test_pick_wheel_matches_tags_and_architecture(candidates: list[str], expected: int) -> None:
    pinned = "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert (
        pick_wheel(
            pinned, "0.33.0", [*candidates, "vllm-0.33.0.tar.gz", "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"]
        )
        == candidates[expected]
    )


def test_pick_wheel_refuses_when_nothing_matches() -> None:
    with pytest.raises(RebaseError, match=r"no wheel for version 0\.33\.0"):
        pick_wheel(
            "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", "0.33.0", ["vllm-0.33.0-cp312-cp312-win_amd64.whl"]
        )


def test_resolve_then_finish_refreshes_the_series_and_repins(tmp_path: Path, repo_root: Path) -> None:
    files = with_unrelated_change()
    files["fakepkg/engine.py"] = files["fakepkg/engine.py"].replace("    y = x + 9\n", "    y = x + 9 * 2\n")
    s = Setup(tmp_path, files)
    report = s.run()
    tree = Path(report.worktree)
    with pytest.raises(RebaseError):  # nothing is exported or re-pinned while the conflict is open
        finish("fakepkg", "1.1.0", pins_path=s.pins, work_root=s.work)
    assert s.pins.read_text() == s.pins_before
    resolved = files["fakepkg/engine.py"].replace("    y = x + 2\n", "    y = x + 2  # before capture\n")
    resolved = resolved.replace("    y = x + 9 * 2\n", "    y = x + 9 * 2  # after capture\n")
    (tree / "fakepkg/engine.py").write_text(resolved)
    git(tree, "add", "fakepkg/engine.py")
    git(tree, "cherry-pick", "--continue", env={"GIT_EDITOR": "true"})
    # The report's next step, run exactly as printed from the repository root (the Makefile supplies the venv and
    # PYTHONPATH; nothing from this test's environment is needed).
    md = (s.work / "fakepkg-1.1.0/report.md").read_text()
    command = f'make rebase ENGINE=fakepkg VERSION=1.1.0 FINISH=1 REBASE_ARGS="--work-root {s.work} --pins {s.pins}"'
    assert f"then run `{command}` from the repository root to export the refreshed patches" in md
    assert "python -m gptools" not in md
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "MAKELEVEL")}
    proc = subprocess.run(command, shell=True, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 patch(es) refreshed and applying exactly to 1.1.0; pins updated" in proc.stdout
    names = read_series(s.patches).names
    assert names == s.names  # same names: subjects unchanged
    assert "+    y = x + 9 * 2  # after capture" in (s.patches / s.names[1]).read_text()
    assert pins_mod.load(s.pins).engine("fakepkg").version == "1.1.0"


def test_clean_series_with_a_changed_hooked_function_is_reported_and_not_repinned(tmp_path: Path) -> None:
    files = with_unrelated_change()
    files["fakepkg/utils.py"] = files["fakepkg/utils.py"].replace("def utils_2(x):", "def utils_2(x, *, mode):")
    s = Setup(tmp_path, files)
    (s.patches / "hooks.toml").write_text(
        '[[hook]]\ntarget = "fakepkg.utils:utils_2"\nparams = ["x"]\nused_by = "test"\nwhy = "the overlay calls it"\n'
        '[[hook]]\ntarget = "fakepkg.utils:utils_3"\nparams = ["x"]\nused_by = "test"\nwhy = "unchanged"\n'
    )
    report = s.run()
    assert report.clean, "the series itself still applies cleanly"
    assert len(report.hook_findings) == 1 and "utils_2" in report.hook_findings[0]
    assert not report.pins_updated and s.pins.read_text() == s.pins_before
    md = (s.work / "fakepkg-1.1.0/report.md").read_text()
    assert md.splitlines()[0].endswith("but 1 declared upstream name(s) changed")
    assert "## Declared upstream names that changed (patches/fakepkg/hooks.toml)" in md
    assert md.rstrip().endswith(
        "update patches/fakepkg/hooks.toml and the glue that uses them (overlays/fakepkg), then run "
        f'`make rebase ENGINE=fakepkg VERSION=1.1.0 FINISH=1 REBASE_ARGS="--work-root {s.work} --pins {s.pins}"` '
        "from the repository root."
    )
    with pytest.raises(RebaseError, match="declared upstream names changed"):
        finish("fakepkg", "1.1.0", pins_path=s.pins, work_root=s.work)
    assert s.pins.read_text() == s.pins_before
    hooks = (s.patches / "hooks.toml").read_text()
    (s.patches / "hooks.toml").write_text(hooks.replace('params = ["x"]', 'params = ["x", "*", "mode"]', 1))
    finish("fakepkg", "1.1.0", pins_path=s.pins, work_root=s.work)
    assert pins_mod.load(s.pins).engine("fakepkg").version == "1.1.0"


def test_finish_refuses_when_a_patch_was_lost_from_the_rebased_tree(tmp_path: Path) -> None:
    files = with_unrelated_change()
    files["fakepkg/engine.py"] = files["fakepkg/engine.py"].replace("    y = x + 9\n", "    y = x + 9 * 2\n")
    s = Setup(tmp_path, files)
    report = s.run()
    series_before = (s.patches / "series").read_text()
    git(Path(report.worktree), "cherry-pick", "--abort")  # the user gives up instead of resolving
    with pytest.raises(RebaseError, match=r"holds 0 patch\(es\), the series had 2; missing: Add a persistence"):
        finish("fakepkg", "1.1.0", pins_path=s.pins, work_root=s.work)
    assert s.pins.read_text() == s.pins_before
    assert (s.patches / "series").read_text() == series_before
    assert all((s.patches / name).is_file() for name in s.names)


RUNNER = """\
class Runner:
    def __init__(self):
        self.model_runner = None
        self.kv_caches = []

    def capture(self, size):
        return size
"""
CONTRACT = """\
[[hook]]
target = "fakepkg.runner:Runner.capture"
params = ["self", "size"]
used_by = "glue"
why = "the glue wraps it"

[[attrs]]
target = "fakepkg.runner:Runner"
names = ["model_runner", "kv_caches"]
used_by = "glue"
why = "the glue reads them"
"""


def with_runner(**edits: str) -> dict[str, str]:
    files = upstream_files()
    text = RUNNER
    for old, new in edits.items():
        text = text.replace(old, new)
    files["fakepkg/runner.py"] = text
    return files


def test_a_declared_attribute_the_new_release_renamed_is_reported_and_blocks_the_pin(tmp_path: Path) -> None:
    new = with_runner(**{"self.model_runner = None": "self.runner_v2 = None"})
    s = Setup(tmp_path, new, old_files=with_runner())
    (s.patches / "hooks.toml").write_text(CONTRACT)
    report = s.run()
    assert report.clean and not report.pins_updated
    assert report.hook_findings == [
        "fakepkg.runner:Runner.model_runner: attribute not found (searched fakepkg.runner:Runner); renamed to "
        "runner_v2?"
    ]
    data = json.loads((s.work / "fakepkg-1.1.0/report.json").read_text())
    assert data["contract"] == [
        {
            "target": "fakepkg.runner:Runner",
            "name": "model_runner",
            "kind": "attribute",
            "change": "removed",
            "message": report.hook_findings[0],
            "renamed_to": ["runner_v2"],
            "declared": "fakepkg.runner:Runner.model_runner",
        }
    ]
    md = (s.work / "fakepkg-1.1.0/report.md").read_text()
    assert md.splitlines()[0].endswith("but 1 declared upstream name(s) changed")
    assert "| `fakepkg.runner:Runner.model_runner` | attribute | removed | `runner_v2` |" in md


def test_the_same_release_as_a_control_reports_no_declared_name_changed(tmp_path: Path) -> None:
    s = Setup(tmp_path, with_runner(), old_files=with_runner())
    (s.patches / "hooks.toml").write_text(CONTRACT)
    report = s.run()
    assert report.hook_findings == [] and report.contract == []
    assert "- upstream contract (hooks.toml): every declared name matches" in report.markdown()
