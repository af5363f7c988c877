"""Diagnosis only: where a persisting worker's start-up goes, as Python's own profiler sees it.

`GP_DIAG_CPROFILE=DIR` (never set in production) makes each persisting worker run `cProfile` from the start of
`init_device` to the end of vLLM's warm-up after the graphs, and write `DIR/cprofile.rank<N>.pstats` (for `python -m
pstats`) and `DIR/cprofile.rank<N>.txt` (the functions with the most cumulative and the most own time). It profiles
the worker's thread only. Unlike a stack sampler it keeps no frame alive, so the frees inside the exact phases
happen where they happen unprofiled (a sampler holding a frame for a moment kept a temporary's memory alive and made
a LOAD refuse its setup phase: recipes/diagnosis/vllm-qwen3-8b-tp1-startup/README.md). It slows Python-heavy steps: its
timings say where, not how long.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

CPROFILE_ENV = "GP_DIAG_CPROFILE"
TOP = 70

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
    (where / f"cprofile.rank{rank}.txt").write_text(text.getvalue())
    _profiler = None
