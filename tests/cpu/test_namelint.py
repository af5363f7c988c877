"""The name-resolution lint (`python -m gptools names`, run by `make check`): the product resolves names at run time
only in the reviewed places of tools/gptools/namelint_allow.toml, so no new place can look code up by a string read
from an archive without a reviewer seeing it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptools import namelint
from gptools.__main__ import main


def found(source: str) -> list[tuple[str, str]]:
    """(function, construct) of each finding in `source`."""
    return [(f.function, f.construct) for f in namelint.scan_source("overlays/x.py", source)]


def test_the_product_resolves_names_only_in_reviewed_places(capsys: pytest.CaptureFixture[str]) -> None:
    unlisted, stale = namelint.verdict(namelint.scan(), namelint.load_allow())
    assert unlisted == [] and stale == []
    assert main(["names"]) == 0
    assert "0 run-time name lookup(s) in overlays/, 0 of them in the 0 reviewed place(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("source", "construct"),
    [
        ("import importlib\ndef f(n):\n    return importlib.import_module(n)\n", "import by name"),
        ("from importlib import import_module as im\ndef f(n):\n    return im(n)\n", "import by name"),
        ("def f(n):\n    return __import__(n)\n", "import by name"),
        ("def f(s):\n    return eval(s)\n", "eval"),
        ("def f(s):\n    exec(s)\n", "eval"),
        ("import pickle\ndef f(b):\n    return pickle.loads(b)\n", "unpickling"),
        ("import marshal\ndef f(b):\n    return marshal.loads(b)\n", "unpickling"),
        ("def f(p):\n    import torch\n    return torch.load(p)\n", "unpickling"),
        ("import sys\ndef f(n):\n    return sys.modules[n]\n", "sys.modules lookup"),
        ("import sys\ndef f(n):\n    return sys.modules.get(n)\n", "sys.modules lookup"),
        ("import torch\ndef f(spec):\n    return getattr(torch, spec['dtype'])\n", "getattr on a module"),
        ("import os\ndef f(n):\n    return hasattr(os, n)\n", "getattr on a module"),
        ("import os\ndef f(n):\n    return vars(os)[n]\n", "getattr on a module"),
        ("import os\ndef f(n):\n    return os.__dict__[n]\n", "getattr on a module"),
        ("import operator\ndef f(n):\n    return operator.attrgetter(n)\n", "attrgetter"),
    ],
)
def test_each_construct_that_resolves_a_name_is_found(source: str, construct: str) -> None:
    assert found(source) == [("f", construct)]


def test_a_module_is_followed_through_assignments_and_getattr_walks() -> None:
    """The shapes issue 41 found: SGLang's torch.ops walk by a saved name, and the runtime's sys.modules walk."""
    torch_ops_walk = (
        "def resolve_callable(name):\n"
        "    import torch\n"
        "    obj = torch.ops\n"
        "    for part in name.split('.'):\n"
        "        obj = getattr(obj, part)\n"
        "    return obj\n"
    )
    modules_walk = (
        "import sys\n"
        "def _resolve(name):\n"
        "    module, _, qual = name.partition(':')\n"
        "    obj = sys.modules.get(module)\n"
        "    for part in qual.split('.'):\n"
        "        obj = getattr(obj, part)\n"
        "    return obj\n"
    )
    assert found(torch_ops_walk) == [("resolve_callable", "getattr on a module")]
    assert found(modules_walk) == [("_resolve", "sys.modules lookup"), ("_resolve", "getattr on a module")]


def test_literal_names_and_plain_objects_are_not_findings() -> None:
    source = (
        "import sys\nimport torch\n"
        "class C:\n"
        "    def f(self, obj, name):\n"
        "        t = sys.modules.get('torch')\n"
        "        return getattr(torch, 'float32'), getattr(obj, name), getattr(self, name), sys.modules['os'], t\n"
        "def g(spec):\n"
        "    import re\n"
        "    return re.compile(spec), {'a': 1}[spec]\n"
    )
    assert found(source) == []


def test_a_name_is_a_module_only_in_the_scope_that_binds_it() -> None:
    source = (
        "import sys\n"
        "def a(n):\n"
        "    obj = sys.modules.get('os')\n"
        "    return getattr(obj, n)\n"
        "def b(obj, n):\n"
        "    return getattr(obj, n)\n"
    )
    assert found(source) == [("a", "getattr on a module")]


def _tree(root: Path, source: str) -> Path:
    path = root / "overlays" / "pkg" / "mod.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


def _allow(root: Path, *entries: tuple[str, str, str, str]) -> Path:
    rows = "".join(
        f'[[allow]]\nfile = "{f}"\nfunction = "{fn}"\nconstruct = "{c}"\nreason = "{r}"\n\n' for f, fn, c, r in entries
    )
    path = root / "allow.toml"
    path.write_text(rows)
    return path


def test_a_new_offending_line_fails_and_the_allowlisted_ones_pass(tmp_path: Path) -> None:
    reviewed = "import importlib, os\ndef plugins(name):\n    return importlib.import_module(name)\n"
    allow = _allow(tmp_path, ("overlays/pkg/mod.py", "plugins", "import by name", "names from an env var"))
    path = _tree(tmp_path, reviewed)
    assert namelint.verdict(namelint.scan(tmp_path, [path]), namelint.load_allow(allow)) == ([], [])
    path.write_text(reviewed + "def from_archive(record):\n    return getattr(os, record['fn'])\n")
    unlisted, stale = namelint.verdict(namelint.scan(tmp_path, [path]), namelint.load_allow(allow))
    assert [str(f) for f in unlisted] == [
        "overlays/pkg/mod.py:5: getattr on a module in from_archive: getattr(os, record['fn'])"
    ]
    assert stale == []


def test_an_entry_that_matches_nothing_is_stale(tmp_path: Path) -> None:
    allow = _allow(tmp_path, ("overlays/pkg/mod.py", "gone", "eval", "it used to"))
    path = _tree(tmp_path, "def f():\n    return 1\n")
    unlisted, stale = namelint.verdict(namelint.scan(tmp_path, [path]), namelint.load_allow(allow))
    assert unlisted == [] and [a.function for a in stale] == ["gone"]


def test_an_entry_without_a_reason_or_with_another_construct_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gives no reason"):
        namelint.load_allow(_allow(tmp_path, ("overlays/pkg/mod.py", "f", "eval", " ")))
    with pytest.raises(ValueError, match="construct"):
        namelint.load_allow(_allow(tmp_path, ("overlays/pkg/mod.py", "f", "anything", "why")))
