"""What a roll costs: `make check` counts the glue's lines and the upstream names it touches against hooks.toml's
`[budget]`, a `[[backport]]` module apart (with the names only it uses), and fails over budget.

The tests reuse test_hooks_usage's fake engine: a pristine tree, a patch, glue under overlays/fakeeng/ and a
hooks.toml in a temporary repository.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from test_hooks_usage import CAPTURE, MODEL, RANK, Repo, table

from gptools import hooks
from gptools.contract import HooksFileError, load_contract

WARMUP = table("attrs", "fakeeng.runner:Runner", names=["warmup"])
DECLARED = CAPTURE + MODEL + RANK + WARMUP  # 4 names: capture (the patch), model, rank (the glue), warmup
BACKPORT_FILE = "fakeeng/graphpersist_backport.py"
BACKPORT_GLUE = """\
def warm(runner):
    return runner.warmup(1)
"""
SHARED_GLUE = """\
def warm(runner):
    return runner.warmup(1), runner.model
"""
BACKPORT = f'[[backport]]\nglue = "{BACKPORT_FILE}"\ndrop_when = "fakeeng 2.0 warms itself"\n'


def budget(lines: int, names: int) -> str:
    return f"[budget]\nglue_lines = {lines}\nupstream_names = {names}\n"


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Repo:
    return Repo(tmp_path, monkeypatch)


def roll(repo: Repo, declared: str, backport: str | None = BACKPORT_GLUE) -> hooks.Report:
    if backport is not None:
        (repo.glue / BACKPORT_FILE).write_text(textwrap.dedent(backport))
    (repo.patches / "hooks.toml").write_text(declared)
    report = hooks.run("fakeeng", repo.tree)
    assert report.changes == [], "the fake tree defines every declared name"
    return report


def glue_lines(repo: Repo) -> int:
    return len((repo.glue / "fakeeng" / "graphpersist_glue.py").read_text().splitlines())


def test_the_glue_within_its_budget_passes_and_the_backport_is_counted_apart(repo: Repo) -> None:
    report = roll(repo, DECLARED + budget(glue_lines(repo), 3) + BACKPORT)
    assert report.findings == []
    assert report.roll is not None
    assert (report.roll.glue.lines, report.roll.glue.names) == (glue_lines(repo), 3), "capture, model and rank"
    [(backport, part)] = report.roll.backports
    assert (backport.glue, part.lines, part.names) == (BACKPORT_FILE, 2, 1), "warmup is only the backport's"
    assert report.roll.line() == (
        f"fakeeng: a roll reads {glue_lines(repo)} glue lines (budget {glue_lines(repo)}) and 3 upstream names "
        f"(budget 3); backport {BACKPORT_FILE} apart: 2 lines, 1 names only it uses, dropped when fakeeng 2.0 warms "
        "itself"
    )


def test_glue_over_its_line_budget_fails_naming_the_count_and_the_key(repo: Repo) -> None:
    findings = roll(repo, DECLARED + budget(glue_lines(repo) - 1, 3) + BACKPORT).findings
    assert len(findings) == 1
    expected = f"takes {glue_lines(repo)} lines, over its budget of {glue_lines(repo) - 1} ([budget] glue_lines)"
    assert expected in findings[0]
    assert "raise the budget there and say why" in findings[0]


def test_without_the_backport_table_its_lines_and_names_count_against_the_budget(repo: Repo) -> None:
    findings = roll(repo, DECLARED + budget(glue_lines(repo), 3)).findings
    assert len(findings) == 2
    assert f"takes {glue_lines(repo) + 2} lines, over its budget of {glue_lines(repo)}" in findings[0]
    assert "takes 4 upstream names, over its budget of 3 ([budget] upstream_names)" in findings[1]


def test_a_name_the_backport_shares_with_the_rest_of_the_glue_stays_in_the_budget(repo: Repo) -> None:
    report = roll(repo, DECLARED + budget(100, 3) + BACKPORT, backport=SHARED_GLUE)
    assert report.roll is not None
    assert report.roll.glue.names == 3, "model is also the backport's, but the glue that stays reads it too"
    assert report.roll.backports[0][1].names == 1, "warmup alone"
    assert report.findings == []


def test_a_backport_naming_no_file_of_the_glue_fails(repo: Repo) -> None:
    gone = BACKPORT.replace("backport.py", "gone.py")
    findings = roll(repo, CAPTURE + MODEL + RANK + budget(100, 3) + gone, None).findings
    assert findings == [
        "patches/fakeeng/hooks.toml: [[backport]] names fakeeng/graphpersist_gone.py, which is not a file of "
        "overlays/fakeeng: fix its glue path, or delete the table once the module is gone"
    ]


def test_a_contract_without_budget_or_backports_counts_nothing(repo: Repo) -> None:
    report = roll(repo, DECLARED)
    assert report.roll is None
    assert report.findings == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("[budget]\nglue_lines = 700\n", "glue_lines and upstream_names must be positive integers"),
        ("[budget]\nglue_lines = 0\nupstream_names = 3\n", "must be positive integers, got [0, 3]"),
        ("[budget]\nglue_lines = 7\nupstream_names = 3\nowner = 1\n", "budget: unknown keys owner"),
        ('[[backport]]\nglue = "fakeeng/x.py"\n', "drop_when must say which upstream release lets it go"),
        ('[[backport]]\nglue = "../x.py"\ndrop_when = "2.0"\n', "glue must be a .py path under the engine's"),
        (BACKPORT + BACKPORT, "a glue module is named by two [[backport]] tables"),
        ("[budgets]\nglue_lines = 7\n", "unknown tables budgets"),
    ],
)
def test_a_malformed_budget_or_backport_is_refused_naming_it(tmp_path: Path, extra: str, message: str) -> None:
    path = tmp_path / "hooks.toml"
    path.write_text(DECLARED + extra)
    with pytest.raises(HooksFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_contract(path)


def test_the_engines_contracts_declare_a_budget_and_vllm_its_compiled_model_backport() -> None:
    """The pinned engines' own contracts (make check holds the glue to them): both declare a budget, vLLM the
    compiled-model module as a backport of a file that exists."""
    from gpdist import REPO_ROOT

    for engine in ("vllm", "sglang"):
        contract = load_contract(REPO_ROOT / "patches" / engine / "hooks.toml")
        assert contract.budget is not None, engine
    vllm = load_contract(REPO_ROOT / "patches" / "vllm" / "hooks.toml")
    assert [b.glue for b in vllm.backports] == ["vllm/graphpersist_compiled.py"]
    assert (REPO_ROOT / "overlays" / "vllm" / vllm.backports[0].glue).is_file()
