"""Measurement only: how long replaying the graphs vLLM dispatches to takes, in the worker (`LLM.collective_rpc`).

The proof driver (`recipes/vllm-qwen3-8b-tp2/driver.py --replay-timing`) calls `replay_timing` once serving is
measured, in every run of a recipe, so a LOAD's restored graphs and a baseline's captured ones are timed the same way
in the same kind of process: the smallest FULL graph alone, and one round of every piece of the split model at the
smallest piecewise size (what one small forward replays; vLLM runs the attention eagerly between the pieces, which is
not timed here).

- `submit_us`: the host's time to launch one replay, each round launched onto an idle GPU. Timed back to back, the
  launches wait for a full launch queue and measure the GPU instead (the first version did that, 2026-12-01).
- `round_ms`: the wall time of one round over many rounds back to back, launch and GPU overlapping as in serving.
- `eager_op_us`: the host time of a small eager op (allocation, launch, free), the median of five timings, which the
  runtime's interposer or allocator would slow if they cost anything per op (one timing read 12.3 us in a LOAD
  against 8.5 us in its SAVE and baseline, 2026-12-01).
- `process`: what else could make host work slower in one run than in another: threads, a profile or trace hook,
  the allocator's configuration and segments, the current stream, the collector's objects and collections.

Replays write the graphs' static buffers: call this only after every output that is compared has been produced.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

ROUNDS = 200


def _time(replays: list[Callable[[], None]], rounds: int) -> dict[str, float]:
    for replay in replays:  # the first launch of an executable uploads it: not what a steady step pays
        replay()
    submit = 0.0
    for _ in range(rounds):  # launch cost alone: one round onto an idle GPU, far below the launch queue's depth
        torch.cuda.synchronize()
        t = time.perf_counter()
        for replay in replays:
            replay()
        submit += time.perf_counter() - t
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(rounds):  # throughput: rounds back to back, launch and GPU overlapping as in serving
        for replay in replays:
            replay()
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    return {
        "graphs": len(replays),
        "submit_us": round(submit / (rounds * len(replays)) * 1e6, 2),
        "round_ms": round(wall / rounds * 1e3, 4),
    }


def _full(runner: Any, rounds: int) -> dict[str, Any] | None:
    manager = getattr(runner, "cudagraph_manager", None)
    graphs = getattr(manager, "graphs", None) or {}
    if not graphs:
        return None
    desc = min(graphs, key=lambda d: (d.num_tokens, d.num_reqs))
    return {"tokens": desc.num_tokens, "type": type(graphs[desc]).__name__, **_time([graphs[desc].replay], rounds)}


def _pieces(rounds: int) -> dict[str, Any] | None:
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config.compilation import CUDAGraphMode

    wrappers = [w for w in CUDAGraphWrapper._all_instances if w.runtime_mode == CUDAGraphMode.PIECEWISE]
    wrappers.sort(key=lambda w: getattr(w.runnable, "piecewise_compile_index", 0))
    by_size = [{bd.num_tokens: e.cudagraph for bd, e in w.concrete_cudagraph_entries.items() if e.cudagraph is not None}
               for w in wrappers]  # fmt: skip
    complete = set.intersection(*(set(sizes) for sizes in by_size)) if by_size else set()
    if not complete:
        return None
    tokens = min(complete)
    graphs = [sizes[tokens] for sizes in by_size]
    return {"tokens": tokens, "type": type(graphs[0]).__name__, **_time([g.replay for g in graphs], rounds)}


def _eager_op_us(ops: int = 2000, repeats: int = 5) -> list[float]:
    """Host time of one small eager op that allocates its output (the kind vLLM runs between the pieces), in
    `repeats` timings of `ops` ops each."""
    x = torch.ones(1024, device="cuda")
    y = x + 1
    timings = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(ops):
            y = x + 1
        torch.cuda.synchronize()
        timings.append(round((time.perf_counter() - started) / ops * 1e6, 2))
    del y
    return timings


def _process() -> dict[str, Any]:
    """What else in this process could make host work slower than in another run's."""
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "profile_or_trace_hook": sys.getprofile() is not None or sys.gettrace() is not None,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "stream": torch.cuda.current_stream().cuda_stream,
        "allocator_segments": torch.cuda.memory_stats().get("segment.all.current"),
        "gc_objects": len(gc.get_objects()),
        "gc_collections": [s["collections"] for s in gc.get_stats()],
    }


def replay_timing(worker: Any, rounds: int = ROUNDS) -> dict[str, Any]:
    """Replay timings of this worker's graphs, an eager op's and facts of the process (see the module docstring)."""
    eager = _eager_op_us()
    return {
        "full": _full(worker.model_runner, rounds),
        "pieces": _pieces(rounds),
        "eager_op_us": statistics.median(eager),
        "eager_op_us_all": eager,
        "process": _process(),
    }
