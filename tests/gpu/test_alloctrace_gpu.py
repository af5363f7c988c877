"""GPU test: GRAPHPERSIST_ALLOC_TRACE names the allocation that moved a setup tensor (graphpersist.memory.alloctrace).

Each start runs in its own process under the interposer: a 4 MiB weight and a 512-byte parameter, then a graph over
both. SAVE and LOAD with the trace on: the parameter keeps its address (the trace moves nothing) and the replay is
identical. A LOAD that makes one small tensor more before the parameter (`stray_allocation`) is refused naming the
block at the saved address and its caller, and `graphpersist allocdiff` names that allocation; without the trace the
refusal says how to record one. A tensor held in a reference cycle that SAVE's collector frees before the parameter
and LOAD's does not (`cyclic_garbage`) moves it too; allocdiff marks SAVE's free as made in a pass of the collector.

Run: `python3 -m pytest -m gpu tests/gpu/test_alloctrace_gpu.py` on a GPU host (torch, cuda-bindings, gcc).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from interposed import OVERLAY, run_step, step_main

ENGINE = {"name": "graphpersist-alloctrace-test", "version": "1", "commit": "none"}
MODEL = {"dtype": "float32", "config_fingerprint": "alloctrace-v1"}


def stray_allocation() -> Any:
    import torch

    return torch.zeros(16, device="cuda")


def cyclic_garbage() -> None:
    """A small tensor that only the cyclic garbage collector frees: its holder refers to itself."""
    import torch

    holder: dict[str, Any] = {"t": torch.zeros(16, device="cuda")}
    holder["self"] = holder


def step(args: list[str]) -> dict[str, Any]:
    mode, archive, trace, variant = args[0], Path(args[1]), args[2], args[3]
    if trace != "-":
        os.environ["GRAPHPERSIST_ALLOC_TRACE"] = trace
    import torch

    from graphpersist import api

    api.start_region()
    if mode == "load":
        api.use_layout(archive)
    w = torch.linspace(0, 1, 1 << 20, device="cuda")
    kept = stray_allocation() if variant == "stray" else None
    if variant.startswith("gc-"):
        gc.disable()  # the collector runs where the variant says: "gc-before" q (SAVE), "gc-after" it (LOAD)
        cyclic_garbage()
        if variant == "gc-before":
            gc.collect()
    q = torch.full((128,), 2.0, device="cuda")
    api.mark_setup({"w": w, "q": q})
    out: dict[str, Any] = {"q": q.data_ptr(), "stray": kept is not None}
    if mode == "save":
        (w[:128] + q).sum()  # warm-up
        torch.cuda.synchronize()
        g = api.PersistentCUDAGraph()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
            y = w[:128] + q
        g.instantiate()
        saver = api.Saver()
        saver.add("g", g, [], [y])
        saver.save(archive, api.Facts(ENGINE, MODEL))
        g.replay()
    else:
        try:
            res = api.load(archive, api.Facts(ENGINE, MODEL), sizes=[], setup_tensors={"w": w, "q": q})
        except api.PersistError as exc:
            return {**out, "refused": str(exc)}
        res.graphs["g"].replay()
        y = res.graphs["g"].outputs[0]
    torch.cuda.synchronize()
    out["y"] = y.cpu().tolist()
    return out


def _start(
    tmp: Path, name: str, mode: str, trace: Path | None, variant: str, archive: str = "archive"
) -> dict[str, Any]:
    folder = tmp / name
    folder.mkdir()
    args = [mode, str(tmp / archive), str(trace or "-"), variant]
    data, _ = run_step(__file__, args, folder / "result.json")
    data["traces"] = sorted(trace.glob("setup-*.json.gz")) if trace is not None else []
    return data


@pytest.mark.gpu
def test_the_trace_moves_nothing_and_names_the_allocation_that_moved_a_setup_tensor(tmp_path: Path) -> None:
    saved = _start(tmp_path, "save", "save", tmp_path / "trace-save", "plain")
    assert len(saved["traces"]) == 1, saved
    same = _start(tmp_path, "load", "load", tmp_path / "trace-load", "plain")
    assert "refused" not in same and same["q"] == saved["q"] and same["y"] == saved["y"], same

    moved = _start(tmp_path, "load-stray", "load", tmp_path / "trace-stray", "stray")
    refused = moved.get("refused", "")
    assert "setup tensor 1 differs: saved 'q'" in refused, moved
    assert "stray_allocation" in refused and "graphpersist allocdiff" in refused, refused
    diff = _allocdiff(saved["traces"][0], moved["traces"][0])
    assert diff.returncode == 1 and "LOAD has 1 action(s) here" in diff.stdout, diff.stdout + diff.stderr
    assert "stray_allocation" in diff.stdout.split("LOAD has", 1)[1], diff.stdout

    untraced = _start(tmp_path, "load-untraced", "load", None, "stray")
    assert "GRAPHPERSIST_ALLOC_TRACE=DIR" in untraced.get("refused", ""), untraced


@pytest.mark.gpu
def test_a_tensor_the_collector_frees_at_another_point_is_named_as_freed_by_it(tmp_path: Path) -> None:
    saved = _start(tmp_path, "save", "save", tmp_path / "trace-save", "gc-before", archive="gc-archive")
    late = _start(tmp_path, "load", "load", tmp_path / "trace-load", "gc-after", archive="gc-archive")
    assert "setup tensor 1 differs: saved 'q'" in late.get("refused", ""), late
    diff = _allocdiff(saved["traces"][0], late["traces"][0])
    assert diff.returncode == 1 and "SAVE has" in diff.stdout, diff.stdout + diff.stderr
    save_side = diff.stdout.split("SAVE has", 1)[1].split("LOAD has", 1)[0]
    assert "free" in save_side and "Python's cyclic garbage collector" in save_side, diff.stdout


def _allocdiff(save: Path, load: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(OVERLAY)}
    argv = [sys.executable, "-m", "graphpersist", "allocdiff", str(save), str(load)]
    diff = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    print(diff.stdout)
    return diff


if __name__ == "__main__":
    sys.exit(step_main(step))
