"""GPU test: GRAPHPERSIST_ALLOC_TRACE names the allocation that moved a setup tensor (graphpersist.memory.alloctrace).

Each start runs in its own process under the interposer: a 4 MiB weight and a 512-byte parameter, then a graph over
both. SAVE and LOAD with the trace on: the parameter keeps its address (the trace moves nothing) and the replay is
identical. A LOAD that makes one small tensor more before the parameter (`stray_allocation`) is refused naming the
block at the saved address and its caller, and `graphpersist allocdiff` names that allocation; without the trace the
refusal says how to record one.

Run: `python3 -m pytest -m gpu tests/gpu/test_alloctrace_gpu.py` on a GPU host (torch, cuda-bindings, gcc).
"""

from __future__ import annotations

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


def step(args: list[str]) -> dict[str, Any]:
    mode, archive, trace, stray = args[0], Path(args[1]), args[2], args[3] == "1"
    if trace != "-":
        os.environ["GRAPHPERSIST_ALLOC_TRACE"] = trace
    import torch

    from graphpersist import api

    api.start_region()
    if mode == "load":
        api.use_layout(archive)
    w = torch.linspace(0, 1, 1 << 20, device="cuda")
    kept = stray_allocation() if stray else None
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


def _start(tmp: Path, name: str, mode: str, trace: Path | None, stray: bool) -> dict[str, Any]:
    folder = tmp / name
    folder.mkdir()
    args = [mode, str(tmp / "archive"), str(trace or "-"), str(int(stray))]
    data, _ = run_step(__file__, args, folder / "result.json")
    data["traces"] = sorted(trace.glob("setup-*.json.gz")) if trace is not None else []
    return data


@pytest.mark.gpu
def test_the_trace_moves_nothing_and_names_the_allocation_that_moved_a_setup_tensor(tmp_path: Path) -> None:
    saved = _start(tmp_path, "save", "save", tmp_path / "trace-save", stray=False)
    assert len(saved["traces"]) == 1, saved
    same = _start(tmp_path, "load", "load", tmp_path / "trace-load", stray=False)
    assert "refused" not in same and same["q"] == saved["q"] and same["y"] == saved["y"], same

    moved = _start(tmp_path, "load-stray", "load", tmp_path / "trace-stray", stray=True)
    refused = moved.get("refused", "")
    assert "setup tensor 1 differs: saved 'q'" in refused, moved
    assert "stray_allocation" in refused and "graphpersist allocdiff" in refused, refused
    env = {**os.environ, "PYTHONPATH": str(OVERLAY)}
    argv = [sys.executable, "-m", "graphpersist", "allocdiff", str(saved["traces"][0]), str(moved["traces"][0])]
    diff = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    print(diff.stdout)
    assert diff.returncode == 1 and "LOAD has 1 action(s) here" in diff.stdout, diff.stdout + diff.stderr
    assert "stray_allocation" in diff.stdout.split("LOAD has", 1)[1], diff.stdout

    untraced = _start(tmp_path, "load-untraced", "load", None, stray=True)
    assert "GRAPHPERSIST_ALLOC_TRACE=DIR" in untraced.get("refused", ""), untraced


if __name__ == "__main__":
    sys.exit(step_main(step))
