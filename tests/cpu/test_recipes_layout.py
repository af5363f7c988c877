"""recipes/: validated configurations at recipes/<name>, diagnosis records under recipes/diagnosis/<name>, and no
large files committed (proof reports are gzipped: recipes/README.md says why).

A validated configuration is one a user may rely on once its report says so: it has a README, a proof (proof.toml
for the proof runner, or proof.py for the runtime recipes) and a Makefile, so `make prove RECIPE=<name>` runs it.
A diagnosis record is an investigation kept as it was measured; it needs only its README.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gptools import jsonfile

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
NOT_RECIPES = {"gpu-host", "diagnosis"}  # the GPU host's procedure, and the diagnosis records
MAX_COMMITTED_BYTES = 200_000  # the largest committed file today is a 94 KB gzipped report


def committed(under: Path) -> list[Path]:
    """The files git tracks under `under` (every file there when this is not a git checkout)."""
    proc = subprocess.run(["git", "ls-files", "-z", str(under)], cwd=REPO, capture_output=True)
    if proc.returncode != 0:
        return [p for p in under.rglob("*") if p.is_file()]
    return [REPO / name for name in proc.stdout.decode().split("\0") if name]


VALIDATED = sorted(p.name for p in RECIPES.iterdir() if p.is_dir() and p.name not in NOT_RECIPES)
DIAGNOSIS = sorted(p.name for p in (RECIPES / "diagnosis").iterdir() if p.is_dir())


@pytest.mark.parametrize("name", VALIDATED)
def test_a_validated_recipe_has_a_readme_a_proof_and_make_prove(name: str) -> None:
    folder = RECIPES / name
    assert (folder / "README.md").is_file(), f"recipes/{name}: no README.md"
    assert (folder / "proof.toml").is_file() or (folder / "proof.py").is_file(), f"recipes/{name}: no proof"
    assert "prove:" in (folder / "Makefile").read_text() or "engine.mk" in (folder / "Makefile").read_text()


@pytest.mark.parametrize("name", DIAGNOSIS)
def test_a_diagnosis_record_says_what_it_was(name: str) -> None:
    assert (RECIPES / "diagnosis" / name / "README.md").is_file(), f"recipes/diagnosis/{name}: no README.md"


def test_no_large_file_is_committed_under_recipes() -> None:
    files = committed(RECIPES)
    big = [f"{p.relative_to(REPO)} ({p.stat().st_size} bytes)" for p in files if p.stat().st_size > MAX_COMMITTED_BYTES]
    assert big == [], "gzip it (proof reports: report.json.gz) or leave it out of git"
    plain = [str(p.relative_to(REPO)) for p in files if p.name == "report.json"]
    assert plain == [], "proof reports are committed gzipped, as report.json.gz (gptools.jsonfile reads both)"


def test_each_committed_report_json_matches_its_report_md() -> None:
    """The gzipped machine-readable report and the human one are the same run: same first line."""
    reports = [p for p in committed(RECIPES) if p.name == "report.json.gz"]
    assert reports
    for gz in reports:
        md = gz.with_name("REPORT.md")
        assert md.is_file(), f"{gz.relative_to(REPO)} has no REPORT.md beside it"
        assert jsonfile.load(gz)["headline"] == md.read_text().splitlines()[0], gz.relative_to(REPO)


def test_recipes_readme_lists_every_recipe_and_diagnosis_record() -> None:
    """recipes/README.md is the index a user reads first: every folder is named there, validated or diagnosis."""
    text = (RECIPES / "README.md").read_text()
    missing = [n for n in VALIDATED if f"`{n}`" not in text and f"({n}/" not in text]
    missing += [f"diagnosis/{n}" for n in DIAGNOSIS if f"diagnosis/{n}" not in text]
    assert missing == []
