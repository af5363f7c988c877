"""The READMEs point at files that exist, and the top-level README stays short.

Checked in every README.md of the repository: Markdown links `[text](path)` (relative to the README), and paths in
backticks that start at the repository root (`recipes/...`, `overlays/...`, ...) or at the README's folder
(`../...`). Paths with placeholders (`<engine>`, `*`, `{a,b}`, `…`) are patterns, not files, and are skipped. A file
that moved (a recipe into recipes/diagnosis/, a module into tools/) fails here until its mentions follow.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", ".work", ".bundle", "dist", "node_modules", "__pycache__", "out"}
TOP_LEVEL_MAX_LINES = 160  # "at most about 150": the rest belongs in the README of the folder it describes

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ROOTED = re.compile(r"`((?:build|overlays|patches|recipes|tests|tools)/[^`\s]*)`")
RELATIVE = re.compile(r"`(\.\./[^`\s]*)`")
PLACEHOLDER = re.compile(r"[<*{…$\[]|\.\.\.")


def readmes() -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # never walk into a venv or build output
        found += [Path(folder) / "README.md"] if "README.md" in files else []
    return sorted(found)


def broken(readme: Path) -> list[str]:
    text = readme.read_text(encoding="utf-8")
    problems = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        if not (readme.parent / target.split("#", 1)[0]).exists():
            problems.append(f"link ({target})")
    for pattern, base in ((ROOTED, REPO), (RELATIVE, readme.parent)):
        for match in pattern.finditer(text):
            target = match.group(1).rstrip(".,:;")
            if not PLACEHOLDER.search(target) and not (base / target).exists():
                problems.append(f"`{target}`")
    return problems


@pytest.mark.parametrize("readme", readmes(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_readme_names_exists(readme: Path) -> None:
    assert broken(readme) == []


def test_the_checker_finds_a_broken_link_and_path(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("[a](gone.md) [b](https://example.org) [c](#top) `recipes/no-such-recipe` `../nowhere`\n")
    assert broken(readme) == ["link (gone.md)", "`recipes/no-such-recipe`", "`../nowhere`"]


def test_the_top_level_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= TOP_LEVEL_MAX_LINES, f"README.md has {lines} lines: move detail into the folder it describes"


def test_the_support_matrix_links_only_passing_reports_with_their_dates() -> None:
    """A row of the top-level README that links a REPORT.md calls it proven: that report's first line must be `all
    checks passed`, and the row must show the report's date (its `- date:` line), so the matrix cannot drift from
    the reports it cites."""
    rows = [line for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines() if "REPORT.md)" in line]
    assert rows, "the support matrix links no report"
    for row in rows:
        for target in re.findall(r"\]\(([^)]*REPORT\.md)\)", row):
            lines = (REPO / target).read_text(encoding="utf-8").splitlines()
            assert lines[0] == "all checks passed", f"{target}: {lines[0][:80]}"
            date = next(line.split(":", 1)[1].strip()[:10] for line in lines if line.startswith("- date:"))
            assert f"proven {date}" in row or f" {date}: [report]({target})" in row, f"{target} is dated {date}: {row}"
