"""The function-length lint (`python -m gptools funclen`, run by `make check`): no function of the product, Python or
the interposer's C, runs past 80 lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptools import funclen
from gptools.__main__ import main


def test_no_product_function_runs_past_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    functions = funclen.product_functions()
    names = {(f.path.rsplit("/", 1)[-1], f.name) for f in functions}
    assert {("save.py", "Saver.save"), ("gp_graph.c", "gp_add_kernel_nodes"), ("graphpersist_facts.py",
            "refuse_unsupported")} <= names  # fmt: skip
    assert funclen.too_long(functions) == []
    assert main(["funclen"]) == 0
    assert "(limit 80)" in capsys.readouterr().out


def body(lines: int) -> str:
    """A Python function of exactly `lines` lines."""
    return "def f():\n" + "    x = 1\n" * (lines - 2) + "    return x\n"


def test_a_function_of_81_lines_fails_the_check_naming_it_and_one_of_80_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "overlays").mkdir()
    (tmp_path / "overlays" / "ok.py").write_text(body(80))
    (tmp_path / "overlays" / "long.py").write_text(
        "class K:\n" + "\n".join("    " + line for line in body(81).split("\n"))
    )
    scan = funclen.product_functions
    monkeypatch.setattr(funclen, "product_functions", lambda: scan(tmp_path))
    assert main(["funclen"]) == 1
    out = capsys.readouterr().out
    assert "funclen: overlays/long.py:2 K.f: 81 lines, more than 80: split it into the steps it takes" in out
    assert "ok.py" not in out.split("\n", 1)[1]


C_SOURCE = """\
#define GP_WRAP(name) { return name(); }  /* a macro's braces are not a function's */
static const struct {
    const char *name;
} g_table[] = {{"a {"}, {"b"}};

/* a comment with a brace { */
GP_EXPORT int gp_long_name(void *graph,
                           size_t n) {
    const char *s = "}";
    if (n) {
        return 1;
    }
    return 0;
}
static int one_line(void) { return 2; }
ASYNC_HOOK(cuMemAllocAsync, (void *p), (p))
"""


def test_c_functions_run_from_their_signature_to_their_closing_brace() -> None:
    found = [(f.name, f.line, f.lines) for f in funclen.c_functions("x.c", C_SOURCE)]
    assert found == [("gp_long_name", 7, 8), ("one_line", 15, 1)]
