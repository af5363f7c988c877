"""An archive is data, never code (issue 41): what an engine calls again or rebuilds at LOAD is named by an id of the
live engine's registry (graphpersist.graph.structure), and `check`/LOAD's CPU stage (graphpersist.loadplan) refuse
any other name without the engine. The SGLang glue's side (its registry, its breaks) is in
test_engine_sglang_persist_cpu.py; hostile variants in test_archive_fuzz.py ("name resolution")."""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from archive_fixtures import REGION_BASE, forge, redigest, write_loadable_archive

from graphpersist.archive import ArchiveError, open_archive
from graphpersist.archive.manifest import FORMAT_VERSION
from graphpersist.errors import PersistError
from graphpersist.graph import structure
from graphpersist.loadplan import NAMES_ADVICE, read_plan

calls: list[Any] = []


def recorded(*args: Any, **kwargs: Any) -> str:
    calls.append((args, kwargs))
    return "done"


@dataclass
class Pair:
    a: Any
    b: Any = None


FUNCTIONS = {"test.recorded": recorded}
TYPES = {"test.pair": Pair}


def leaf(x: Any) -> dict[str, Any] | None:
    return {"addr": x} if isinstance(x, int) and not isinstance(x, bool) and x >= REGION_BASE else None


@pytest.fixture
def sinks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """os.system and eval record instead of running: nothing an archive names may reach them."""
    called: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: called.append(("system", a)))
    monkeypatch.setattr(builtins, "eval", lambda *a: called.append(("eval", a)))
    yield called


@pytest.mark.parametrize(
    ("value", "ok"),
    [("sglang.attention", True), ("a", True), ("a.b_2.c", True), ("os:system", False), ("os.system", True),
     ("__import__", False), ("a.__class__", False), ("torch.ops:aten.empty", False), ("A.B", False), ("", False),
     ("a..b", False), ("a.", False), ("a" * 65, False), (7, False), (None, False), ("a\nb", False)],
)  # fmt: skip
def test_an_id_is_lowercase_dotted_words_nothing_else(value: Any, ok: bool) -> None:
    """The shape check can know: "os.system" has it (and is refused at LOAD, by the registry, which lacks it)."""
    assert structure.is_id(value) is ok


def test_a_call_round_trips_by_its_registry_id() -> None:
    tree = structure.encode_call(recorded, (REGION_BASE, 3), {"k": Pair(1)}, None, leaf, "break", FUNCTIONS, TYPES)
    assert tree["kind"] == "call" and tree["fn"] == "test.recorded"
    assert tree["kwargs"]["items"][0]["type"] == "test.pair"
    fn, args, kwargs, output = structure.decode_call(json.loads(json.dumps(tree)), dict, "break", FUNCTIONS, TYPES)
    assert fn is recorded and args == ({"addr": REGION_BASE}, 3) and kwargs == {"k": Pair(1)} and output is None


def test_save_refuses_a_function_the_registry_lacks_naming_it() -> None:
    with pytest.raises(structure.StructureError, match=r"break: builtins\.len is not in the engine's registry .*"
                       r"\(it holds test\.recorded\)"):  # fmt: skip
        structure.encode_call(len, (), {}, None, leaf, "break", FUNCTIONS)


@pytest.mark.parametrize(
    ("fn", "problem"),
    [
        ("os:system", "break.fn: 'os:system' is not a registry id"),
        ("builtins:eval", "break.fn: 'builtins:eval' is not a registry id"),
        ("torch.ops:sglang.unified_attention_with_output", "is not a registry id"),
        ("__import__", "break.fn: '__import__' is not a registry id"),
        ("os.system", "break.fn: function saved 'os.system', live registry holds test.recorded: LOAD refused"),
        ("test.unknown", "break.fn: function saved 'test.unknown', live registry holds test.recorded"),
    ],
)
def test_load_calls_no_function_the_registry_lacks(sinks: list[Any], fn: str, problem: str) -> None:
    tree = structure.encode_call(recorded, ("rm -rf /",), {}, None, leaf, "break", FUNCTIONS)
    calls.clear()
    with pytest.raises(structure.StructureError) as err:
        structure.decode_call({**tree, "fn": fn}, dict, "break", FUNCTIONS)
    assert problem in str(err.value)
    assert calls == [] and sinks == []


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"fn": "test.recorded", "args": [], "kwargs": {}, "output": None}, "damaged call record"),
        ({"kind": "call", "fn": "test.recorded"}, "damaged call record"),
        ({"kind": "call", "fn": "test.recorded", "args": {"kind": "list", "items": []},
          "kwargs": {"kind": "dict", "keys": [], "items": []}, "output": None}, "args: must be a tuple record"),
        ({"kind": "call", "fn": "test.recorded", "args": {"kind": "tuple", "items": []},
          "kwargs": {"kind": "dict", "keys": [1], "items": [{"kind": "value", "value": 1}]},
          "output": {"kind": "value", "value": None}}, "kwargs: must be a dict record with string keys"),
        ({"kind": "call", "fn": "test.recorded", "args": {"kind": "tuple", "items": [
            {"kind": "dataclass", "type": "graphpersist.load:LoadedGraph", "fields": {}}]},
          "kwargs": {"kind": "dict", "keys": [], "items": []}, "output": {"kind": "value", "value": None}},
         "args[0].type: 'graphpersist.load:LoadedGraph' is not a registry id"),
        ("os:system", "damaged call record"),
    ],
)  # fmt: skip
def test_a_damaged_call_record_is_a_refusal_never_a_lookup(record: Any, problem: str) -> None:
    with pytest.raises(structure.StructureError, match=problem.replace("[", r"\[").replace("(", r"\(")):
        structure.decode_call(record, dict, "break", FUNCTIONS, TYPES)


def test_notes_are_free_form_but_fn_and_kind_are_reserved_for_records() -> None:
    def no_leaf(spec: Any, where: str) -> None: ...

    good = structure.encode_call(recorded, (), {}, None, leaf, "break", FUNCTIONS)
    structure.check_notes({"decode": {"decode/8": {"size": 8}}, "x": [1, "os:system", {"breaks": [good]}]}, no_leaf)
    cases = [
        ({"p": [{**good, "fn": "os:system"}]}, r"engine_notes\.p\[0\]\.fn: 'os:system' is not a registry id"),
        ({"p": {"fn": "os:system"}}, r"engine_notes\.p: damaged call record"),  # no kind: still a call record
        ({"p": {"kind": "dataclass", "type": "os:system", "fields": {}}}, r"engine_notes\.p\.type: 'os:system'"),
        ({"p": {"kind": "eval"}}, r"engine_notes\.p: damaged output record \(kind 'eval'\)"),
    ]
    for notes, problem in cases:
        with pytest.raises(structure.StructureError, match=problem):
            structure.check_notes(notes, no_leaf)


# ------------------------------------------------------------------------------ what check and LOAD's CPU stage refuse


def _forge_notes(root: Path, notes: dict[str, Any]) -> None:
    """Rank 0's engine notes replaced, every digest recomputed (as a forger would)."""
    record = json.loads((root / "rank_0/rank.json").read_text())
    record["extra"]["engine_notes"] = notes
    forge(root, "rank_0/rank.json", json.dumps(redigest(record)).encode())


def _call(fn: str, *items: dict[str, Any]) -> dict[str, Any]:
    none = {"kind": "value", "value": None}
    return {"kind": "call", "fn": fn, "args": {"kind": "tuple", "items": list(items)},
            "kwargs": {"kind": "dict", "keys": [], "items": []}, "output": none}  # fmt: skip


SPEC = {"addr": REGION_BASE + 4096, "dtype": "bfloat16", "shape": [8], "stride": [1]}


def test_a_call_record_as_save_writes_it_reads_back(tmp_path: Path) -> None:
    root = write_loadable_archive(tmp_path / "a")
    notes = {
        "prefill": {
            "prefill/16": {
                "breaks": [
                    _call(
                        "sglang.attention",
                        {"kind": "tensor", "spec": SPEC},
                        {"kind": "tensor", "spec": {"module": "model.layers.0"}},
                    )
                ]
            }
        }
    }
    _forge_notes(root, notes)  # fmt: skip
    assert read_plan(open_archive(root, keep_rank=0), 0).notes == notes


@pytest.mark.parametrize(
    ("notes", "problem"),
    [
        ({"p": [_call("os:system", {"kind": "value", "value": "touch /tmp/x"})]},
         "extra.engine_notes.p[0].fn: 'os:system' is not a registry id"),
        ({"p": [{"fn": "builtins:eval", "args": [], "kwargs": {}, "output": None}]},
         "extra.engine_notes.p[0]: damaged call record"),
        ({"p": [_call("sglang.attention", {"kind": "dataclass", "type": "graphpersist.load:LoadedGraph",
                                           "fields": {}})]},
         "extra.engine_notes.p[0].args[0].type: 'graphpersist.load:LoadedGraph' is not a registry id"),
        ({"p": [_call("sglang.attention", {"kind": "tensor", "spec": {**SPEC, "addr": 4096}})]},
         "extra.engine_notes.p[0].args[0].addr: 0x1000 lies outside the rank's region"),
        ({"p": [_call("sglang.attention", {"kind": "tensor", "spec": {**SPEC, "dtype": "_dynamo"}})]},
         "is not a torch dtype name"),
        ({"p": [_call("sglang.attention", {"kind": "tensor", "spec": {"module": 3}})]},
         "a leaf must be a tensor spec or an object of strings"),
    ],
)  # fmt: skip
def test_check_and_load_refuse_engine_notes_that_name_code_otherwise(
    tmp_path: Path, notes: dict[str, Any], problem: str
) -> None:
    root = write_loadable_archive(tmp_path / "a")
    _forge_notes(root, notes)
    for every_byte in (False, True):  # LOAD's CPU stage, `graphpersist check`
        with pytest.raises(ArchiveError) as err:
            read_plan(open_archive(root, keep_rank=0), 0, every_byte=every_byte)
        assert problem in str(err.value)
    if "registry id" in problem or "damaged call" in problem:
        assert err.value.advice == NAMES_ADVICE


def test_an_output_naming_a_class_by_module_path_is_refused_with_the_names_advice(tmp_path: Path) -> None:
    root = write_loadable_archive(tmp_path / "a")
    index = json.loads((root / "rank_0/graphs/index.json").read_text())
    index["graphs"][0]["outputs"] = {"kind": "dataclass", "type": "graphpersist.load:LoadedGraph", "fields": {}}
    forge(root, "rank_0/graphs/index.json", json.dumps(index).encode())
    with pytest.raises(ArchiveError) as err:
        read_plan(open_archive(root, keep_rank=0), 0)
    assert "outputs.type: 'graphpersist.load:LoadedGraph' is not a registry id" in str(err.value)
    assert err.value.advice == NAMES_ADVICE


def test_an_archive_of_format_2_module_paths_is_refused_as_older_saying_re_run_save(tmp_path: Path) -> None:
    """Format 3 changed what names mean (ids, not module paths): a format 2 archive is never read as if it were 3."""
    assert FORMAT_VERSION == 3
    root = write_loadable_archive(tmp_path / "a")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["format_version"] = 2
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArchiveError) as err:
        open_archive(root)
    assert "archive format version 2 is older than what this graphpersist reads (format 3)" in str(err.value)
    assert "Re-run with mode=save" in str(err.value)


def test_nothing_here_imports_a_module_an_archive_names() -> None:
    assert "tabnanny" not in sys.modules
    with pytest.raises(structure.StructureError):
        structure.decode({"kind": "dataclass", "type": "tabnanny", "fields": {}}, dict, types=TYPES)
    assert "tabnanny" not in sys.modules


class _StandInDtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


def test_a_tensor_specs_dtype_is_looked_up_in_a_table_never_on_the_torch_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's module __getattr__ imports submodules by name (torch._dynamo): a saved dtype name must never reach it."""
    asked: list[str] = []

    def module_getattr(name: str) -> Any:
        asked.append(name)
        raise AttributeError(name)

    torch = ModuleType("torch")
    torch.__dict__.update(dtype=_StandInDtype, float32=_StandInDtype("float32"), __getattr__=module_getattr)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delitem(sys.modules, "graphpersist.memory.tensors", raising=False)
    tensors = importlib.import_module("graphpersist.memory.tensors")
    assert tensors.dtypes() == {"float32": torch.float32}
    for name in ("_dynamo", "load", "ops", "__class__"):
        with pytest.raises(PersistError, match=f"dtype '{name}' is not a torch dtype: LOAD refused"):
            tensors.tensor_at({"addr": REGION_BASE, "dtype": name, "shape": [1], "stride": [1]})
    assert asked == []
