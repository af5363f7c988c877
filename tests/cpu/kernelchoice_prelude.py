"""Runs once in the vLLM CPU venv before the snippets of test_kernelchoice.py (see warm_python.py).

It imports torch's real Inductor runtime (CachingAutotuner, whose autotune_to_one_config the runtime wraps) and
graphpersist.graph.kernelchoice, and holds a stand-in for what a CPU host cannot make: a compiled Triton kernel with its
launchers. The tuner is a real CachingAutotuner object; only its GPU timing (benchmark_all_configs) is replaced by
given timings, counted. Not a test module: it needs the venv's torch.
"""

from __future__ import annotations

import types
from typing import Any

from torch._inductor.runtime.triton_heuristics import CachingAutotuner

from graphpersist.graph import kernelchoice  # noqa: F401 (the snippets use it)

UPSTREAM = CachingAutotuner.autotune_to_one_config


class Launcher:
    """What autotune_to_one_config reads of a launcher: its config and the counts it logs."""

    def __init__(self, r0_block: int) -> None:
        self.config = types.SimpleNamespace(kwargs={"XBLOCK": 1, "R0_BLOCK": r0_block}, num_warps=16, num_stages=1)
        self.n_regs, self.n_spills, self.shared = 96, 0, 0
        self.cache_hash = f"hash-{r0_block}"


def tuner(timings: dict[int, float], kernel_hash: str = "cabc123", name: str = "triton_red_fused_add_rms_norm_2",
          blocks: tuple[int, ...] = (2048, 1024)) -> Any:  # fmt: skip
    """A real CachingAutotuner holding one launcher per R0_BLOCK (a kernel compiled with several configs, as the
    final norm's rms_norm kernel is), that "times" them as `timings` says and counts how often it was timed."""
    t = CachingAutotuner.__new__(CachingAutotuner)
    t.fn = types.SimpleNamespace(__name__=name)
    t.kernel_hash = kernel_hash
    t.launchers = [Launcher(b) for b in blocks]
    t.precompile_time_taken_ns = 7
    t.save_cache_hook = None
    t.compile_results, t.inductor_meta = [], {}  # what torch's own bookkeeping after the choice reads
    t.timed = 0

    def benchmark_all_configs(*args: Any, **kwargs: Any) -> dict[Launcher, float]:
        t.timed += 1
        return {launcher: timings[launcher.config.kwargs["R0_BLOCK"]] for launcher in t.launchers}

    t.benchmark_all_configs = benchmark_all_configs
    return t


def kept(t: Any) -> int:
    """The R0_BLOCK of the one launcher left."""
    (launcher,) = t.launchers
    return launcher.config.kwargs["R0_BLOCK"]


LOGGED: list[str] = []
