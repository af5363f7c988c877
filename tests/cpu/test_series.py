"""Series lint: every defect a reviewer must not miss is reported on its own line; good series pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gptools_fixtures import Change, make_series, replace, standard_changes, upstream_files

from gptools.series import lint, load_series, read_series


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return make_series(tmp_path, upstream_files(), standard_changes(), preamble="# order matters\n\n").patches_dir


def findings(pdir: Path) -> list[str]:
    return [str(f) for f in lint(pdir)]


def test_good_series_is_clean_and_parsed(good: Path) -> None:
    assert findings(good) == []
    patches = load_series(good)
    assert [p.header.subject for p in patches] == [
        "Add a persistence switch to the config",
        "Call the runtime around capture",
    ]
    assert [p.hunk_count for p in patches] == [1, 2]
    assert patches[1].files[0].path == "fakepkg/engine.py"
    assert read_series(good).preamble == ["# order matters"]


def test_empty_series_is_clean(tmp_path: Path) -> None:
    (tmp_path / "series").write_text("# no patches yet\n")
    assert findings(tmp_path) == []


def test_missing_series_file_is_a_finding(tmp_path: Path) -> None:
    assert any("no series file" in f for f in findings(tmp_path))


def test_listed_but_missing_patch(good: Path) -> None:
    (good / "series").write_text((good / "series").read_text() + "0003-gone.patch\n")
    assert any("0003-gone.patch is listed but missing" in f for f in findings(good))


def test_unlisted_patch(good: Path) -> None:
    (good / "0009-stray.patch").write_text("x")
    assert any("0009-stray.patch: not listed in series" in f for f in findings(good))


def test_duplicate_entry(good: Path) -> None:
    first = read_series(good).names[0]
    (good / "series").write_text((good / "series").read_text() + first + "\n")
    assert any(f"{first} listed again" in f for f in findings(good))


def _rewrite(pdir: Path, name: str, old: str, new: str) -> None:
    path = pdir / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_missing_upstream_trailer(good: Path) -> None:
    name = read_series(good).names[0]
    _rewrite(good, name, "Upstream: not forwarded\n", "")
    assert [f for f in findings(good) if "Upstream:" in f] == [
        f"{name}: no `Upstream:` trailer (not forwarded | forwarded <link> | merged <commit>)"
    ]


def test_invalid_upstream_trailer(good: Path) -> None:
    name = read_series(good).names[0]
    _rewrite(good, name, "Upstream: not forwarded", "Upstream: maybe later")
    assert any("invalid 'Upstream: maybe later'" in f for f in findings(good))


def test_missing_drop_when(good: Path) -> None:
    name = read_series(good).names[1]
    _rewrite(good, name, "Drop-when: upstream grows the same hook\n", "")
    assert any(f.startswith(name) and "no `Drop-when:` trailer" in f for f in findings(good))


def test_empty_why_text(tmp_path: Path) -> None:
    pdir = make_series(
        tmp_path,
        upstream_files(),
        [
            Change(
                "Only trailers",
                {"fakepkg/utils.py": replace("y = x + 1\n", "y = x + 11\n")},
                body="Upstream: not forwarded\nDrop-when: never",
            )
        ],
    ).patches_dir
    assert [f for f in findings(pdir) if "why" in f] == [
        f"{read_series(pdir).names[0]}: empty description: say in plain words why this patch exists"
    ]


def test_every_defect_reported_at_once(good: Path) -> None:
    names = read_series(good).names
    _rewrite(good, names[0], "Upstream: not forwarded\n", "")
    _rewrite(good, names[1], "Drop-when: upstream grows the same hook\n", "")
    (good / "stray.patch").write_text("x")
    got = findings(good)
    assert len(got) == 3, got
    assert any(f.startswith(names[0]) and "Upstream" in f for f in got)
    assert any(f.startswith(names[1]) and "Drop-when" in f for f in got)
    assert any("stray.patch: not listed" in f for f in got)


def test_mixed_numbering_and_order(good: Path) -> None:
    names = read_series(good).names
    (good / "series").write_text("".join(n + "\n" for n in reversed(names)))
    assert any("not strictly increasing" in f for f in findings(good))
    (good / names[0]).rename(good / "plain-name.patch")
    (good / "series").write_text(f"plain-name.patch\n{names[1]}\n")
    assert any("mixes NNNN-slug.patch names" in f for f in findings(good))


def test_conflict_markers_are_findings(good: Path) -> None:
    name = read_series(good).names[0]
    _rewrite(good, name, "+    y = hook(y)\n", "+<<<<<<< HEAD\n")
    assert any("conflict marker" in f for f in findings(good))


def test_cli_exit_codes(good: Path, repo_root: Path) -> None:
    env_path = f"{repo_root}/build:{repo_root}/tools:{repo_root}/overlays/graphpersist"

    def run(*a: str) -> subprocess.CompletedProcess:
        env = {"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}
        return subprocess.run([sys.executable, "-m", "gptools", *a], capture_output=True, text=True, env=env)

    assert run("lint", "--engine", "vllm", "--patches-dir", str(good)).returncode == 0
    (good / "stray.patch").write_text("x")
    bad = run("lint", "--engine", "vllm", "--patches-dir", str(good))
    assert bad.returncode == 1 and "stray.patch: not listed in series" in bad.stdout
    assert run("lint", "--patches-dir", str(good)).returncode == 2  # --engine all with one folder is misuse
    assert run("lint", "--bogus").returncode == 2
    for sub in ("lint", "apply", "edit", "export", "rebase", "install"):
        assert run(sub, "--help").returncode == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_real_series_lints_clean(engine: str, repo_root: Path) -> None:
    pdir = repo_root / "patches" / engine
    assert findings(pdir) == []


@pytest.mark.parametrize(
    ("trailer", "ok"),
    [
        ("Upstream: forwarded https://github.com/vllm-project/vllm/pull/1", True),
        ("Upstream: merged 0123abcd", True),
        ("Upstream: forwarded", False),
        ("Upstream: merged", False),
    ],
)
def test_upstream_trailer_forms(good: Path, trailer: str, ok: bool) -> None:
    name = read_series(good).names[0]
    _rewrite(good, name, "Upstream: not forwarded", trailer)
    assert (findings(good) == []) is ok


def test_a_line_outside_every_hunk_is_refused_not_dropped(tmp_path: Path) -> None:
    """git apply and GNU patch both ignore lines a hunk header does not count: lint must catch them."""
    from gptools.series import SeriesError, parse_diff

    diff = "diff --git a/f.txt b/f.txt\n--- a/f.txt\n+++ b/f.txt\n@@ -1,3 +1,4 @@\n a\n+X\n b\n c\n+Y\n"
    with pytest.raises(SeriesError, match="outside every hunk"):
        parse_diff(diff)
    assert len(parse_diff(diff.replace("+Y\n", ""))[0].hunks) == 1
