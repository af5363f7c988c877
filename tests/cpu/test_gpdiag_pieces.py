"""tools/gpdiag/vllm_pieces.py (GP_DIAG_PIECES) without vLLM: which compile calls `reuse` answers itself, what
`record` writes, how a call's path is told, and what the rank's report holds. Its wiring into the real vLLM classes is
tested in the vLLM CPU venv (test_engine_vllm_persist_cpu.py)."""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpdiag import vllm_pieces as vp


@dataclass(frozen=True)
class Range:  # vllm.config.utils.Range: hashable, start and end inclusive
    start: int
    end: int


@dataclass
class Compiler:
    name: str = "inductor_standalone"


@dataclass
class Counter:  # the vllm.compilation.counter fields the wrapper reads and moves
    num_compiled_artifacts_loaded: int = 0
    num_compiled_artifacts_saved: int = 0
    num_backend_compilations: int = 0
    num_inductor_compiles: int = 0


@dataclass
class Manager:
    """A CompilerManager as the wrapper sees it: its cache-file entries, the artifacts it loaded by key, where the cache
    file lies, and an upstream `compile` that loads, hashes or saves as `plan` says (and counts like vLLM's)."""

    cache_file_path: str
    counter: Counter
    plan: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (path, key)
    cache: dict[tuple[Range, int, str], Any] = field(default_factory=dict)
    loaded_artifacts: dict[str, Any] = field(default_factory=dict)
    compiler: Compiler = field(default_factory=Compiler)
    upstream_calls: list[int] = field(default_factory=list)

    def compile(self, graph: Any, example_inputs: Any, additional_inductor_config: Any, compilation_config: Any,
                compile_range: Range, graph_index: int = 0, num_graphs: int = 1,
                is_encoder: bool = False) -> Any:  # fmt: skip
        self.upstream_calls.append(graph_index)
        path, key = self.plan[graph_index]
        if key not in self.loaded_artifacts:  # loaded or compiled: a new object under its key
            self.loaded_artifacts[key] = object()
        if path == "loaded":
            self.counter.num_compiled_artifacts_loaded += 1
        elif path == "saved":
            self.counter.num_compiled_artifacts_saved += 1
        self.counter.num_backend_compilations += 1
        return self.loaded_artifacts[key]


ALL = Range(1, 16384)
# Qwen3-8B's warm start in small: pieces 0, 1 and 4 have cache-file entries; 2 and 3 equal piece 1 (key "a-mid").
PLAN = {0: ("loaded", "a-first"), 1: ("loaded", "a-mid"), 2: ("hashed", "a-mid"), 3: ("hashed", "a-mid"),
        4: ("loaded", "a-last")}  # fmt: skip


def _manager_class(tmp_path: Path, how: str) -> tuple[type, vp.Tally, Counter]:
    """A fresh Manager class with gpdiag's wrapper on it, and the tally and counter it feeds."""
    counter = Counter()
    cls = type("Manager", (Manager,), {})
    tally = vp.Tally(how)
    vp._wrap_compile(cls, counter, how, tally)
    vp._keys.clear()
    return cls, tally, counter


def _start(cls: type, tmp_path: Path, counter: Counter) -> tuple[Any, list[Any]]:
    """One warm start: every piece in order, as PiecewiseCompileInterpreter hands them to compile()."""
    manager = cls(str(tmp_path / "vllm_compile_cache.py"), counter, dict(PLAN))
    manager.cache = {(ALL, i, "inductor_standalone"): {} for i in (0, 1, 4)}
    artifacts = [manager.compile(f"graph{i}", [], {}, None, compile_range=ALL, graph_index=i, num_graphs=5)
                 for i in range(5)]  # fmt: skip
    return manager, artifacts


def test_record_writes_every_pieces_key_beside_vllms_cache_file(tmp_path: Path) -> None:
    cls, tally, counter = _manager_class(tmp_path, "record")
    _start(cls, tmp_path, counter)
    written = json.loads((tmp_path / vp.KEYS_FILE).read_text())
    assert written == {"pieces": {f"1-16384/{i}": key for i, (_, key) in PLAN.items()}}
    assert {p: len(s) for p, s in tally.seconds.items()} == {"loaded": 3, "hashed": 2, "saved": 0, "reused": 0}


def test_reuse_hands_a_recorded_piece_the_artifact_already_loaded_without_upstreams_path(tmp_path: Path) -> None:
    record, _, counter = _manager_class(tmp_path, "record")
    _, recorded = _start(record, tmp_path, counter)
    reuse, tally, counter = _manager_class(tmp_path, "reuse")
    manager, got = _start(reuse, tmp_path, counter)
    assert manager.upstream_calls == [0, 1, 4]  # the pieces vLLM's cache file lists are vLLM's to load
    assert got[2] is got[3] is got[1] is manager.loaded_artifacts["a-mid"]
    assert got[2] is not recorded[2]  # this start's own artifact, not the recording start's
    assert {p: len(s) for p, s in tally.seconds.items()} == {"loaded": 3, "hashed": 0, "saved": 0, "reused": 2}
    assert (counter.num_backend_compilations, counter.num_inductor_compiles) == (5, 2)  # as upstream's path counts


def test_reuse_without_a_recorded_key_runs_upstreams_path(tmp_path: Path) -> None:
    reuse, tally, counter = _manager_class(tmp_path, "reuse")
    manager, _ = _start(reuse, tmp_path, counter)
    assert manager.upstream_calls == [0, 1, 2, 3, 4]
    assert {p: len(s) for p, s in tally.seconds.items()} == {"loaded": 3, "hashed": 2, "saved": 0, "reused": 0}


def test_reuse_leaves_a_piece_whose_key_no_artifact_has_yet_to_upstream(tmp_path: Path) -> None:
    """A recorded key names no artifact this start loaded (an entry missing, another order): upstream hashes it."""
    manager = Manager(str(tmp_path / "vllm_compile_cache.py"), Counter())
    assert vp.reusable(manager, ALL, 2, {"1-16384/2": "a-mid"}) is None
    manager.loaded_artifacts["a-mid"] = artifact = object()
    assert vp.reusable(manager, ALL, 2, {"1-16384/2": "a-mid"}) is artifact
    manager.cache[(ALL, 2, "inductor_standalone")] = {}
    assert vp.reusable(manager, ALL, 2, {"1-16384/2": "a-mid"}) is None  # vLLM's own entry wins


def test_a_compile_calls_path_is_told_by_vllms_artifact_counters() -> None:
    assert vp.path_of((3, 1), (4, 1)) == "loaded"
    assert vp.path_of((3, 1), (3, 2)) == "saved"
    assert vp.path_of((3, 1), (3, 1)) == "hashed"


def test_an_artifacts_key_is_found_by_identity_not_equality(tmp_path: Path) -> None:
    manager = Manager(str(tmp_path / "c.py"), Counter(), loaded_artifacts={"k1": [1], "k2": [1]})
    assert vp.artifact_key(manager, manager.loaded_artifacts["k2"]) == "k2"
    assert vp.artifact_key(manager, [1]) is None


def test_a_keys_file_that_is_not_one_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / vp.KEYS_FILE
    assert vp.read_keys(path) == {}
    vp.write_keys(path, {"1-8/2": "a2", "1-8/1": "a1"})
    assert vp.read_keys(path) == {"1-8/1": "a1", "1-8/2": "a2"}
    assert [p.name for p in tmp_path.iterdir()] == [vp.KEYS_FILE]  # no temporary file left
    path.write_text(json.dumps({"pieces": {"1-8/1": 7}}))
    with pytest.raises(ValueError, match=rf"{vp.KEYS_FILE}: not a gpdiag piece-key file.*GP_DIAG_PIECES=record"):
        vp.read_keys(path)


def test_an_unknown_switch_value_is_refused_naming_the_values() -> None:
    assert vp.mode({}) is None
    assert vp.mode({vp.PIECES_ENV: "reuse"}) == "reuse"
    with pytest.raises(ValueError, match=r"GP_DIAG_PIECES='lazy': use one of count, record, reuse"):
        vp.mode({vp.PIECES_ENV: "lazy"})


def test_the_report_writes_the_ranks_numbers_and_one_log_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vp.STATS_DIR_ENV, str(tmp_path / "stats"))
    tally = vp.Tally("reuse")
    tally.add("loaded", 0.5)
    tally.add("reused", 0.001)
    tally.add_span("split", 0.25)
    tally.loads.append({"seconds": 2.0, "loaded": True, "region_events": 0, "torch_allocated": 0})
    monkeypatch.setattr(vp, "_tally", tally)
    lines: list[str] = []
    data = vp.report(3, lambda message, *args: lines.append(message % args))
    assert json.loads((tmp_path / "stats" / "gpdiag-pieces.rank3.json").read_text()) == data
    assert data is not None and data["pieces"]["loaded"] == {"n": 1, "s": 0.5}
    assert data["pieces"]["hashed"] == {"n": 0, "s": 0}
    assert lines == [
        "gpdiag GP_DIAG_PIECES=reuse: compiled pieces: 1 loaded (0.50 s), 1 reused (0.00 s); AOT load 2.00 s; "
        "split 0.25 s"
    ]


def test_without_the_switch_nothing_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vp, "_tally", None)
    assert vp.report(0, lambda *a: pytest.fail("logged")) is None


def test_a_device_delta_compares_only_what_both_snapshots_hold() -> None:
    before = {"torch_allocated": 100, "region_events": 40}
    after = {"torch_allocated": 100, "region_events": 43, "region_cursor": 9}
    assert vp.delta(before, after) == {"torch_allocated": 0, "region_events": 3}


def test_the_collectors_passes_inside_a_block_are_counted_and_timed() -> None:
    with vp.collections() as seen:
        gc.collect()
        gc.collect(0)
    after = dict(seen)
    gc.collect()  # outside the block: not counted
    assert seen == after and seen["gc_passes"] >= 2 and seen["gc_s"] >= 0
    assert all(getattr(c, "__name__", "") != "callback" for c in gc.callbacks)  # the callback is gone again
