"""The allocation trace that explains a moved setup tensor (graphpersist.memory.alloctrace) and `graphpersist
allocdiff`: what is kept of torch's trace entries, where two starts part and how that reads. The snapshots here have
the form torch.cuda.memory._snapshot() documents; recording them for real is tests/gpu/test_alloctrace_gpu.py."""

from __future__ import annotations

import gc
import gzip
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from graphpersist import run
from graphpersist.memory import alloctrace
from graphpersist.memory.alloctrace import Action

REPO = Path(__file__).resolve().parents[2]
TORCH_FRAME = {"filename": "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", "line": 9, "name": "_apply"}
BASE = 0x500000000000


def frame(name: str, line: int = 1) -> dict[str, Any]:
    return {"filename": "/venv/lib/python3.12/site-packages/vllm/model.py", "line": line, "name": name}


def entry(action: str, addr: int, size: int, *names: str) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [TORCH_FRAME, *map(frame, names)]}


def start(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    """A start's trace entries: a segment, a weight, a small parameter after `extra`, in torch's form."""
    return [
        entry("segment_alloc", BASE, 2 << 20, "make_segment"),
        entry("alloc", BASE, 1 << 20, "make_weight"),
        *extra,
        entry("alloc", BASE + (1 << 20) + 512 * len(extra), 512, "make_q_norm"),
    ]


def actions(entries: list[dict[str, Any]]) -> list[Action]:
    return alloctrace.actions_of({"segments": [], "device_traces": [entries]}, 0)


def test_actions_keep_what_moves_the_allocator_and_the_callers_outside_torch() -> None:
    got = actions([*start(), {"action": "snapshot", "addr": 0, "size": 0, "frames": []},
                   {"action": "oom", "size": 1 << 40, "device_free": 0, "frames": []}])  # fmt: skip
    assert [a.kind for a in got] == ["segment_alloc", "alloc", "alloc"]
    assert got[2].frames == ("/venv/lib/python3.12/site-packages/vllm/model.py:1 make_q_norm",)
    only_torch = actions([{"action": "alloc", "addr": BASE, "size": 512, "frames": [TORCH_FRAME]}])
    assert only_torch[0].frames == (f"{TORCH_FRAME['filename']}:9 _apply",)
    assert alloctrace.actions_of({"device_traces": [[]]}, 3) == []  # a device the snapshot has no trace of


def test_the_same_starts_do_not_part_and_a_trace_file_reads_back(tmp_path: Path) -> None:
    saved = actions(start())
    assert alloctrace.parting(saved, actions(start())) == ""
    alloctrace.write(tmp_path / "t.json.gz", "save-rank0", saved)
    assert alloctrace.read(tmp_path / "t.json.gz") == saved


def test_an_allocation_only_load_made_is_named_with_its_caller() -> None:
    extra = entry("alloc", BASE + (1 << 20), 512, "hash_sources", "thread_run")
    found = alloctrace.parting(actions(start()), actions(start(extra)))
    assert found.startswith("SAVE and LOAD part at allocator action 2 (of 3 and 4)"), found
    assert "LOAD has 1 action(s) here" in found and "alloc 512 B at 0x500000100000" in found, found
    assert "model.py:1 hash_sources\n      <- /venv/lib/python3.12/site-packages/vllm/model.py:1 thread_run" in found
    assert "SAVE has" not in found, found
    freed = entry("free_completed", BASE, 1 << 20, "drop_weight")
    assert "SAVE has 1 action(s) here" in alloctrace.parting(actions(start(freed)), actions(start()))


def test_other_requests_at_the_parting_list_both_sides() -> None:
    saved = actions(start(entry("alloc", BASE + (1 << 20), 512, "a")))
    found = alloctrace.parting(saved, actions(start(entry("alloc", BASE + (1 << 20), 1024, "b"))))
    assert "SAVE made instead 1 action(s)" in found and "LOAD made instead 1 action(s)" in found, found
    assert "512 B" in found and "1024 B" in found


def test_the_same_request_at_another_address_says_the_allocators_state_differed() -> None:
    saved = actions(start())
    moved = [*saved[:2], Action("alloc", saved[2].addr + 512, 512, saved[2].frames)]
    found = alloctrace.parting(saved, moved)
    assert "The same request landed elsewhere" in found and "memory torch does not trace" in found, found
    assert f"SAVE: alloc 512 B at {saved[2].addr:#x}" in found and f"LOAD: alloc 512 B at {moved[2].addr:#x}" in found


def test_a_start_that_stops_early_and_a_full_trace_are_said(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = actions(start())
    assert "LOAD has 1 action(s) here" in alloctrace.parting(saved[:2], saved)
    monkeypatch.setattr(alloctrace, "MAX_ENTRIES", 3)
    assert "SAVE's trace is full (3 actions)" in alloctrace.parting(saved, saved[:2])


def test_the_collectors_passes_are_recorded_and_a_free_inside_one_is_marked() -> None:
    """GcPasses times real passes (gc.callbacks); a free whose time_us lies in a pass carries GC_FRAME, an allocation
    or a free outside every pass does not. allocdiff's text then says which free the collector made."""
    passes = alloctrace.GcPasses()
    gc.callbacks.append(passes.callback)
    try:
        before = time.time_ns() // 1000
        gc.collect()
        gc.collect()
    finally:
        gc.callbacks.remove(passes.callback)
    assert len(passes.spans) == 2 and passes.began is None, passes
    (b1, e1), (b2, e2) = passes.spans
    assert before <= b1 <= e1 <= b2 <= e2, passes.spans
    assert passes.covers(b1) and passes.covers(e2) and not passes.covers(b1 - 1) and not passes.covers(e2 + 1)
    assert not alloctrace.GcPasses().covers(b1)

    def at(e: dict[str, Any], us: int) -> dict[str, Any]:
        return {**e, "time_us": us}

    cycle = entry("alloc", BASE + (1 << 20), 512, "cyclic_holder")
    by_gc = [at(entry(k, BASE + (1 << 20), 512, "unrelated_line"), e1) for k in ("free_requested", "free_completed")]
    saved = alloctrace.actions_of({"device_traces": [start(at(cycle, b1), *by_gc)]}, 0, passes)
    assert [a.frames[0] for a in saved[2:5]] == ["/venv/lib/python3.12/site-packages/vllm/model.py:1 cyclic_holder",
                                                 alloctrace.GC_FRAME, alloctrace.GC_FRAME]  # fmt: skip
    outside = alloctrace.actions_of({"device_traces": [[at(e, e2 + 1) for e in by_gc]]}, 0, passes)
    assert all(alloctrace.GC_FRAME not in a.frames for a in outside)
    assert all(alloctrace.GC_FRAME not in a.frames for a in alloctrace.actions_of({"device_traces": [by_gc]}, 0))
    found = alloctrace.parting(saved, actions(start(cycle)))  # LOAD: the holder not yet collected
    assert "SAVE has 2 action(s) here, first:\n  free_requested 512 B" in found, found
    assert f"<- {alloctrace.GC_FRAME}\n      <- /venv/lib/python3.12/site-packages/vllm/model.py:1 unrelated" in found
    assert "LOAD has" not in found, found


def test_the_refusals_advice_names_the_files_to_compare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(alloctrace.ENV, raising=False)
    with run.activated(run.Run(session=SimpleNamespace(rank=1, mode=SimpleNamespace(value="load")))):
        off = alloctrace.advice()
        assert alloctrace.ENV + "=DIR" in off and "DIR/save-rank1.json.gz DIR/load-rank1.json.gz" in off, off
        assert alloctrace.holder(BASE) == "" and alloctrace.start() is False and alloctrace.dump() is None
        monkeypatch.setenv(alloctrace.ENV, str(tmp_path))
        assert alloctrace.path_for(alloctrace.label()) == tmp_path / "load-rank1.json.gz"
        assert f"`graphpersist allocdiff {tmp_path}/save-rank1.json.gz {tmp_path}/load-rank1.json.gz`" in (
            alloctrace.advice()
        )
    with run.activated(run.Run()):
        assert alloctrace.label() == f"setup-{os.getpid()}"


def allocdiff(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "overlays" / "graphpersist")}
    return subprocess.run([sys.executable, "-m", "graphpersist", "allocdiff", *args], env=env, capture_output=True,
                          text=True)  # fmt: skip


def test_allocdiff_exits_1_naming_the_parting_0_when_equal_and_2_on_what_is_no_trace(tmp_path: Path) -> None:
    save, load, same = tmp_path / "save.json.gz", tmp_path / "load.json.gz", tmp_path / "same.json.gz"
    alloctrace.write(save, "save-rank0", actions(start()))
    alloctrace.write(load, "load-rank0", actions(start(entry("alloc", BASE + (1 << 20), 512, "stray"))))
    alloctrace.write(same, "load-rank0", actions(start()))
    parted = allocdiff(str(save), str(load))
    assert parted.returncode == 1 and "LOAD has 1 action(s) here" in parted.stdout and "stray" in parted.stdout
    equal = allocdiff(str(save), str(same))
    assert equal.returncode == 0 and "made the same 3 allocator actions" in equal.stdout, equal.stdout
    plain = tmp_path / "plain.json.gz"
    plain.write_text("{}")
    other = tmp_path / "other.json.gz"
    with gzip.open(other, "wt") as fh:
        fh.write('{"format": 99, "actions": []}')
    for bad, why in ((plain, "Not a gzipped file"), (other, "format 99"), (tmp_path / "none", "No such file")):
        refused = allocdiff(str(save), str(bad))
        assert refused.returncode == 2 and "not an allocation trace" in refused.stderr and why in refused.stderr
