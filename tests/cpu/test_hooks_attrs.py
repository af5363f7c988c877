"""Declared attributes and module names ([[attrs]] in hooks.toml) against synthetic upstream trees, by AST: where an
attribute counts as existing, what a removed one looks like, and which new name a rename probably is."""

from __future__ import annotations

from pathlib import Path

import pytest
from gptools_fixtures import write_tree

from gptools import hooks
from gptools.contract import HooksFileError, load_contract

PKG = {
    "pkg/__init__.py": "from pkg.runner import Runner as Runner\n",
    "pkg/base.py": (
        "class Base:\n"
        "    shared: int = 0\n"
        "    def __init__(self):\n"
        "        self.rank = 0\n"
        "        self.a, (self.b, self.c) = 1, (2, 3)\n"
        "    @property\n"
        "    def device(self):\n"
        "        return 'cuda'\n"
    ),
    "pkg/runner.py": (
        "import dataclasses\n"
        "import enum\n"
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from .base import Base\n"
        "from . import base as base_mod\n"
        "if TYPE_CHECKING:\n"
        "    current: 'Runner'\n"
        "LIMIT = 4\n"
        "class Mode(enum.Enum):\n"
        "    FULL = 1\n"
        "class Runner(Base, torch.nn.Module):\n"
        "    __slots__ = ('slot_a', 'slot_b')\n"
        "    class Inner:\n"
        "        pass\n"
        "    def setup(self):\n"
        "        self._graphs = {}\n"
        "        setattr(self, 'late', None)\n"
        "        for self.cursor in range(2):\n"
        "            pass\n"
        "class Other(base_mod.Base):\n"
        "    pass\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Key:\n"
        "    size: int\n"
        "    def __post_init__(self):\n"
        "        object.__setattr__(self, 'derived', self.size * 2)\n"
    ),
    "pkg/reexport.py": "from pkg.runner import *\nfrom pkg.base import Base as Renamed\n",
}


def check(
    tmp_path: Path, toml: str, files: dict[str, str] | None = None, old: dict[str, str] | None = None
) -> list[hooks.Finding]:
    tree = write_tree(tmp_path / "tree", files if files is not None else PKG)
    old_tree = write_tree(tmp_path / "old", old) if old is not None else None
    (tmp_path / "hooks.toml").write_text(toml)
    return hooks.check_contract(tree, load_contract(tmp_path / "hooks.toml"), old_tree)


def test_an_attribute_exists_wherever_the_class_or_its_bases_in_the_tree_define_it(tmp_path: Path) -> None:
    names = ["rank", "a", "b", "c", "shared", "device", "slot_a", "slot_b", "Inner", "setup", "_graphs", "late",
             "cursor"]  # fmt: skip
    toml = f'[[attrs]]\ntarget = "pkg.runner:Runner"\nnames = {names!r}\n'.replace("'", '"')
    toml += '[[attrs]]\ntarget = "pkg.runner:Other"\nnames = ["rank", "device"]\n'  # base through `base_mod.Base`
    toml += '[[attrs]]\ntarget = "pkg.runner:Key"\nnames = ["size", "derived"]\n'  # dataclass field, frozen setattr
    toml += '[[attrs]]\ntarget = "pkg.runner:Mode"\nnames = ["FULL"]\n'  # enum member
    toml += '[[attrs]]\ntarget = "pkg:Runner"\nnames = ["rank"]\n'  # the class re-exported by the package
    assert check(tmp_path, toml) == []


def test_a_removed_attribute_names_the_classes_searched_and_the_bases_outside_the_tree(tmp_path: Path) -> None:
    [finding] = check(tmp_path, '[[attrs]]\ntarget = "pkg.runner:Runner"\nnames = ["rank", "model_runner"]\n')
    assert (finding.target, finding.name, finding.kind, finding.change) == (
        "pkg.runner:Runner", "model_runner", "attribute", "removed",
    )  # fmt: skip
    assert finding.declared == "pkg.runner:Runner.model_runner"
    assert finding.message == (
        "pkg.runner:Runner.model_runner: attribute not found (searched pkg.runner:Runner, pkg.base:Base; bases "
        "outside the tree: torch.nn.Module)"
    )


def test_module_names_follow_assignments_annotations_reexports_and_star_imports(tmp_path: Path) -> None:
    toml = (
        '[[attrs]]\ntarget = "pkg.runner"\nnames = ["LIMIT", "current", "Base", "Runner", "torch"]\n'
        '[[attrs]]\ntarget = "pkg.reexport"\nnames = ["LIMIT", "Runner", "Renamed"]\n'
        # `runner` is a submodule; __commit_id__ need not exist
        '[[attrs]]\ntarget = "pkg"\nnames = ["Runner", "runner"]\noptional = ["__commit_id__"]\n'
        '[[attrs]]\ntarget = "pkg.reexport:Renamed"\nnames = ["rank"]\n'  # a class found through the re-export
    )
    assert check(tmp_path, toml) == []
    [missing] = check(tmp_path, '[[attrs]]\ntarget = "pkg.runner"\nnames = ["LIMIT", "LIMITS"]\n')
    assert missing.message == (
        "pkg.runner:LIMITS: not found: module pkg.runner binds no name 'LIMITS' (pkg/runner.py); similar names here: "
        "LIMIT"
    )


def test_a_class_or_module_that_is_gone_takes_its_declared_attributes_with_it(tmp_path: Path) -> None:
    toml = (
        '[[attrs]]\ntarget = "pkg.runner:Gone"\nnames = ["rank", "model"]\n'
        '[[attrs]]\ntarget = "pkg.nowhere:Runner"\nnames = ["rank"]\n'
    )
    gone, nowhere = check(tmp_path, toml)
    assert gone.kind == "class" and gone.message.startswith("pkg.runner:Gone: not found: module pkg.runner has no ")
    assert gone.message.endswith("its declared attributes go with it: rank, model")
    assert "module pkg.nowhere not found (no pkg/nowhere.py in the tree)" in nowhere.message


def test_with_the_previous_release_a_removed_name_points_at_the_similar_name_that_is_new(tmp_path: Path) -> None:
    new = dict(PKG)
    new["pkg/base.py"] = PKG["pkg/base.py"].replace("self.rank = 0", "self.rank_id = 0")
    [finding] = check(tmp_path, '[[attrs]]\ntarget = "pkg.runner:Runner"\nnames = ["rank"]\n', new, old=PKG)
    assert finding.renamed_to == ("rank_id",)
    assert finding.message.endswith("; renamed to rank_id?")


def test_a_hooked_method_that_moved_points_at_its_new_name(tmp_path: Path) -> None:
    new = dict(PKG)
    new["pkg/runner.py"] = PKG["pkg/runner.py"].replace("def setup(self):", "def setup_buffers(self):")
    [finding] = check(tmp_path, '[[hook]]\ntarget = "pkg.runner:Runner.setup"\nparams = ["self"]\n', new, old=PKG)
    assert (finding.kind, finding.change, finding.renamed_to) == ("function", "removed", ("setup_buffers",))


@pytest.mark.parametrize(
    "body, message",
    [
        ('[[attrs]]\ntarget = "pkg.runner:Runner"\n', "names .or optional. must list at least one name"),
        ('[[attrs]]\ntarget = "pkg.runner:Runner"\nnames = ["a-b"]\n', "not attribute names: a-b"),
        ('[[attrs]]\ntarget = "pkg.runner:Runner"\nnames = ["a"]\nwhy_not = 1\n', "unknown keys why_not"),
        ('[[attrs]]\ntarget = "pkg.runner:"\nnames = ["a"]\n', "target must be"),
        ('[[attrs]]\ntarget = "m:C"\nnames = ["a"]\n[[attrs]]\ntarget = "m:C"\nnames = ["a"]\n', "declared already"),
        ('[[attrs]]\ntarget = "m:C"\nnames = ["a"]\ncomputed_in = ["f.py"]\n', "computed_in entries must be"),
        (
            '[[attr]]\ntarget = "m:C"\nnames = ["a"]\n',
            r"unknown tables attr \(use \[\[hook\]\], \[\[attrs\]\], \[budget\] or \[\[backport\]\]\)",
        ),
    ],
)
def test_malformed_attrs_tables_are_usage_errors(tmp_path: Path, body: str, message: str) -> None:
    (tmp_path / "hooks.toml").write_text(body)
    with pytest.raises(HooksFileError, match=message):
        load_contract(tmp_path / "hooks.toml")
