"""Edit loop: upstream + series as git commits, exported back byte for byte; new commits become new patches."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gptools_fixtures import Change, make_series, replace, standard_changes, upstream_files, write_tree

from gptools.series import lint, load_series, read_series
from gptools.worktree import BASE_TAG, WorktreeError, WorktreeMeta, export, git, materialize

AUTHOR = {"GIT_AUTHOR_NAME": "Ed", "GIT_AUTHOR_EMAIL": "ed@example.org"}


def changes_with_odd_cases() -> list[Change]:
    """The standard two patches plus a new file, a non-ASCII author and subject, and a long subject."""
    return [
        *standard_changes(),
        Change(
            "Add the glue module that the runtime calls into from the engine's startup path (and say why)",
            {"fakepkg/glue.py": '"""glue."""\n\nVALUE = 1\n'},
            author="Zoë Ünïcode <zoe@example.org>",
            date="2026-03-04T05:06:07-07:00",
        ),
        Change("Tweak utils — with an em dash", {"fakepkg/utils.py": replace("y = x + 1\n", "y = x + 100\n")}),
    ]


@pytest.fixture
def upstream(tmp_path: Path) -> Path:
    files: dict[str, str | bytes] = dict(upstream_files())
    files["fakepkg/_C.abi3.so"] = b"\x7fELF\x00\x00native"
    files["fakepkg/big.bin"] = b"\x00" * 100
    return write_tree(tmp_path / "upstream", files)


def meta(pdir: Path) -> WorktreeMeta:
    return WorktreeMeta("fakepkg", "fakepkg", "1.0.0", str(pdir))


def snapshot(pdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pdir.iterdir())}


def test_materialize_makes_one_commit_per_patch_on_a_text_only_base(tmp_path: Path, upstream: Path) -> None:
    pdir = make_series(tmp_path, upstream_files(), changes_with_odd_cases()).patches_dir
    wt = tmp_path / "edit"
    result = materialize(wt, upstream, pdir, meta(pdir), progress=False)
    assert result.applied == read_series(pdir).names and not result.stopped_at
    tracked = git(wt, "ls-files").stdout.split()
    assert "fakepkg/engine.py" in tracked and "fakepkg/_C.abi3.so" not in tracked and "fakepkg/big.bin" not in tracked
    subjects = git(wt, "log", "--reverse", "--format=%s", f"{BASE_TAG}..HEAD").stdout.splitlines()
    assert subjects == [p.header.subject for p in load_series(pdir)]
    assert git(wt, "log", "-1", "--format=%an|%aI", "HEAD~1").stdout.strip() == "Zoë Ünïcode|2026-03-04T05:06:07-07:00"


def test_export_of_an_unmodified_tree_reproduces_the_series_byte_for_byte(tmp_path: Path, upstream: Path) -> None:
    pdir = make_series(tmp_path, upstream_files(), changes_with_odd_cases(), preamble="# keep this\n\n").patches_dir
    before = snapshot(pdir)
    wt = tmp_path / "edit"
    materialize(wt, upstream, pdir, meta(pdir), progress=False)
    result = export(wt, pdir)
    assert not result.modified and result.findings == []
    assert snapshot(pdir) == before


def test_a_new_commit_becomes_a_new_patch(tmp_path: Path, upstream: Path) -> None:
    pdir = make_series(tmp_path, upstream_files(), standard_changes()).patches_dir
    before = snapshot(pdir)
    wt = tmp_path / "edit"
    materialize(wt, upstream, pdir, meta(pdir), progress=False)
    path = wt / "fakepkg/utils.py"
    path.write_text(path.read_text().replace("y = x + 1\n", "y = x + 1  # traced\n"))
    message = "Trace utils\n\nTracing shows where time goes.\n\nUpstream: not forwarded\nDrop-when: never"
    git(wt, "commit", "-q", "-am", message, env=AUTHOR)
    result = export(wt, pdir)
    assert result.added == ["0003-trace-utils.patch"] and result.changed == [] and result.removed == []
    assert read_series(pdir).names == [*before_names(before), "0003-trace-utils.patch"]
    assert all((pdir / n).read_bytes() == before[n] for n in before_names(before))
    assert lint(pdir) == []
    assert "+    y = x + 1  # traced" in (pdir / "0003-trace-utils.patch").read_text()


def before_names(snap: dict[str, bytes]) -> list[str]:
    return [n for n in snap if n.endswith(".patch")]


def test_dropping_a_commit_removes_its_patch(tmp_path: Path, upstream: Path) -> None:
    pdir = make_series(tmp_path, upstream_files(), standard_changes()).patches_dir
    first, second = read_series(pdir).names
    wt = tmp_path / "edit"
    materialize(wt, upstream, pdir, meta(pdir), progress=False)
    git(wt, "reset", "-q", "--hard", "HEAD~1")
    result = export(wt, pdir)
    assert result.removed == [second] and read_series(pdir).names == [first]
    assert not (pdir / second).exists()


def test_export_check_reports_without_writing(tmp_path: Path, upstream: Path) -> None:
    pdir = make_series(tmp_path, upstream_files(), standard_changes()).patches_dir
    wt = tmp_path / "edit"
    materialize(wt, upstream, pdir, meta(pdir), progress=False)
    git(wt, "commit", "-q", "--amend", "-m", "Reworded\n\nBetter words.\n\nUpstream: not forwarded\nDrop-when: never")
    before = snapshot(pdir)
    result = export(wt, pdir, check=True)
    assert result.modified and result.added == ["0002-reworded.patch"]
    assert snapshot(pdir) == before


def test_export_refuses_uncommitted_work_and_conflict_markers(tmp_path: Path, upstream: Path) -> None:
    pdir = make_series(tmp_path, upstream_files(), standard_changes()).patches_dir
    wt = tmp_path / "edit"
    materialize(wt, upstream, pdir, meta(pdir), progress=False)
    (wt / "fakepkg/utils.py").write_text("changed\n")
    with pytest.raises(WorktreeError, match="uncommitted changes"):
        export(wt, pdir)
    (wt / "fakepkg/utils.py").write_text(upstream_files()["fakepkg/utils.py"] + "<<<<<<< HEAD\n=======\n>>>>>>> x\n")
    git(wt, "commit", "-q", "-am", "oops\n\nwhy\n\nUpstream: not forwarded\nDrop-when: never", env=AUTHOR)
    with pytest.raises(WorktreeError, match="conflict marker"):
        export(wt, pdir)


def test_edit_refuses_to_overwrite_a_tree(tmp_path: Path, upstream: Path) -> None:
    pdir = make_series(tmp_path, upstream_files(), standard_changes()).patches_dir
    wt = tmp_path / "edit"
    materialize(wt, upstream, pdir, meta(pdir), progress=False)
    with pytest.raises(WorktreeError, match="already exists"):
        materialize(wt, upstream, pdir, meta(pdir), progress=False)
    assert materialize(wt, upstream, pdir, meta(pdir), force=True, progress=False).applied


def test_edit_on_a_drifted_upstream_stops_with_markers(tmp_path: Path, upstream: Path) -> None:
    pdir = make_series(tmp_path, upstream_files(), standard_changes()).patches_dir
    drifted = tmp_path / "drifted"
    shutil.copytree(upstream, drifted)
    engine = drifted / "fakepkg/engine.py"
    engine.write_text(engine.read_text().replace("    y = x + 9\n", "    y = x - 9\n"))
    wt = tmp_path / "edit"
    result = materialize(wt, drifted, pdir, meta(pdir), progress=False)
    first, second = read_series(pdir).names
    assert result.applied == [first] and result.stopped_at == second
    assert "git am --continue" in result.message


@pytest.mark.network
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_real_series_round_trips_byte_for_byte(engine: str, pins, upstream_tree, tmp_path: Path) -> None:
    """The committed patches are in canonical form: edit + export changes nothing (names included)."""
    pin = pins.engine(engine)
    wt = tmp_path / "edit"
    result = materialize(wt, upstream_tree(engine), pin.patches_dir, meta(pin.patches_dir), progress=False)
    assert result.applied == read_series(pin.patches_dir).names and not result.inexact
    check = export(wt, pin.patches_dir, check=True)
    assert not check.modified, (check.added, check.changed, check.removed)
    assert check.unchanged == read_series(pin.patches_dir).names
