"""Diagnosis only: where a persisting worker's start-up goes, as Python's own profiler sees it.

`GP_DIAG_CPROFILE=DIR` (never set in production) makes each persisting worker run `cProfile` from the start of
`init_device` to the end of vLLM's warm-up after the graphs, and write `DIR/cprofile.rank<N>.pstats` (for `python -m
pstats`) and `DIR/cprofile.rank<N>.txt` (the functions with the most cumulative and the most own time). It profiles
the worker's thread only. Unlike a stack sampler it keeps no frame alive, so the frees inside the exact phases
happen where they happen unprofiled (a sampler holding a frame for a moment kept a temporary's memory alive and made
a LOAD refuse its setup phase: recipes/diagnosis/vllm-qwen3-8b-tp1-startup/README.md). It slows Python-heavy steps: its
timings say where, not how long.

The text has three sections: the top functions by cumulative time, by own time, and the AOT load's steps
(recipes/diagnosis/vllm-qwen3-8b-tp1-startup/DEFER-COMPILE.md 8.1; what GP_DIAG_PIECES=count times unprofiled): what
each step function present in the profile called (pstats `print_callees`), who called torch's `torch_key` and
Triton's `triton_key` (`print_callers`), and which of them the profile does not hold.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re
import sys
from pathlib import Path

CPROFILE_ENV = "GP_DIAG_CPROFILE"
TOP = 70
# The AOT load's step functions (vllm_pieces' `count` steps) and the keys computed once per process, as pstats names
# them: (the end of the file's path, the function's name).
STEP_FUNCTIONS = (
    ("torch/_dynamo/aot_compile.py", "deserialize"),
    ("torch/_dynamo/aot_compile.py", "__post_init__"),
    ("torch/fx/_graph_pickler.py", "loads"),
    ("vllm/compilation/caching.py", "deserialize_graph_module"),
    ("torch/fx/graph_module.py", "recompile"),
    ("vllm/compilation/decorators.py", "_verify_source_unchanged"),
    ("vllm/envs.py", "compile_factors"),
    ("vllm/compilation/backends.py", "compute_hash"),
)
KEY_FUNCTIONS = (("torch/_inductor/codecache.py", "torch_key"), ("triton/runtime/cache.py", "triton_key"))

_profiler: cProfile.Profile | None = None


def start() -> None:
    """Begins profiling this thread when GP_DIAG_CPROFILE names a folder (once per process). Where another tool
    already holds the interpreter's profiling hook, it says so on stderr and the start goes on unprofiled."""
    global _profiler
    if _profiler is None and os.environ.get(CPROFILE_ENV):
        profiler = cProfile.Profile()
        try:
            profiler.enable()
        except ValueError as exc:  # Python 3.12+: "Another profiling tool is already active"
            sys.stderr.write(f"graphpersist: {CPROFILE_ENV}: cProfile cannot start ({exc}); not profiling\n")
            return
        _profiler = profiler


def stop(rank: int) -> None:
    """Ends profiling and writes the rank's files; nothing when profiling was not started."""
    global _profiler
    if _profiler is None:
        return
    _profiler.disable()
    where = Path(os.environ[CPROFILE_ENV])
    where.mkdir(parents=True, exist_ok=True)
    _profiler.dump_stats(where / f"cprofile.rank{rank}.pstats")
    text = io.StringIO()
    for order in ("cumulative", "tottime"):
        pstats.Stats(_profiler, stream=text).sort_stats(order).print_stats(TOP)
    steps_section(pstats.Stats(_profiler, stream=text).sort_stats("cumulative"), text)
    (where / f"cprofile.rank{rank}.txt").write_text(text.getvalue())
    _profiler = None


def steps_section(stats: pstats.Stats, text: io.StringIO) -> None:
    """The third section: callees of the step functions the profile holds, callers of the keys, and what is absent."""
    held = {(path, name) for path, _, name in stats.stats}  # type: ignore[attr-defined]

    def holds(file: str, name: str) -> bool:
        return any(path.endswith(file) and function == name for path, function in held)

    def pattern(file: str, name: str) -> str:  # pstats matches it against "path:line(function)"
        return rf"{re.escape(file)}:\d+\({re.escape(name)}\)"

    text.write("\n=== the AOT load's steps (DEFER-COMPILE.md 8.1): callees; callers of torch_key and triton_key\n")
    for file, name in STEP_FUNCTIONS:
        if holds(file, name):
            stats.print_callees(pattern(file, name))
    for file, name in KEY_FUNCTIONS:
        if holds(file, name):
            stats.print_callers(pattern(file, name))
    absent = [f"{file}:{name}" for file, name in STEP_FUNCTIONS + KEY_FUNCTIONS if not holds(file, name)]
    text.write(f"not in the profile: {', '.join(absent) or 'none'}\n")
