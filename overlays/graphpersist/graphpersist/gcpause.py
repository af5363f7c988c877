"""Python's cyclic garbage collector during persistence: paused while LOAD reads and rebuilds an archive and while
SAVE serializes and writes one, paused from a session's start to its memory budget (the setup window, below), and
the start-up heap frozen when a SAVE's or a LOAD's session starts (below).

LOAD allocates hundreds of thousands of small containers (records, descriptions, index entries) that it keeps,
and none of them form cycles; SAVE's serialization of every graph node and its writing do the same. Every few
hundred allocations the collector runs, and now and then a full pass walks every object of the process: in an
engine that has imported torch that is millions of objects, 50-100 ms a pass (recipes/runtime-scale/cpu_bench.py
--heap). Pausing it for the length of one LOAD, or of SAVE's own steps (not the engine's work between them),
changes no result; whatever cycles arise meanwhile are collected by the first pass after it.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disables the cyclic collector inside the block; re-enables it after only if it was enabled before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ------------------------------------------------------------------------------------------------- the setup window
#
# Everything allocated on the device from the region's start to the memory budget (the engine's buffers, the weights)
# must land where SAVE had it: LOAD's graphs read those addresses. A tensor held in a reference cycle is freed when an
# automatic pass of the collector runs, and when that is depends on how many objects the process made, threads
# included: LOAD runs Python work SAVE does not (the archive's early check, the read-ahead and source-hash threads),
# so such a free could come at another point, and a later tensor land elsewhere (a LOAD then refuses, naming it).
# PersistSession pauses the automatic passes for that window on both sides; explicit gc.collect() calls (vLLM makes
# them right before and after it loads the model) still run, at the same points on both sides; the cycles made
# meanwhile are collected there or by the first pass after the window.


# ---------------------------------------------------------------------------------------------- the start-up heap
#
# An engine process imports torch and the engine (millions of objects) before its persistence session starts, and
# the engine then runs about nine full collections during its start (memory snapshots, profiling, its own freeze
# at the end: 3.5 s measured in a vLLM TP=1 LOAD). gc.freeze() moves every object alive now into the permanent
# generation, which no collection walks: each later pass looks only at what the start created since. It frees
# nothing early and keeps nothing alive that a collection would not have kept, except cyclic garbage that already
# exists (the imports' own, no device memory: the session freezes before its region exists); the engines' own
# shutdown (gc.unfreeze) hands all of it back. SAVE freezes as LOAD does (since 2026-12-07; until then LOAD alone, and
# both laid out their memory identically, so the freeze moves no allocation): its 14 unfrozen full passes took 5.65 s
# of a TP=1 vLLM SAVE on an H100. With persistence off there is no session, and the collector is upstream's.


def freeze_at_start() -> int:
    """Freezes the heap as it stands (the imports); returns how many objects are frozen now."""
    gc.freeze()
    return gc.get_freeze_count()


class CollectionMeter:
    """Counts and times the collector's passes from `start()` to `stop()` (gc.callbacks), by generation: the
    per-rank stats say what collections cost a start, with and without the freeze."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._began: float | None = None

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        elif self._began is not None:
            generation = info.get("generation", 2)
            self.passes[generation] += 1
            self.seconds[generation] += now - self._began
            self._began = None

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        """`{"full_passes": n, "full_s": s, "passes": [g0, g1, g2], "seconds": [g0, g1, g2]}`."""
        return {
            "full_passes": self.passes[2],
            "full_s": round(self.seconds[2], 4),
            "passes": list(self.passes),
            "seconds": [round(s, 4) for s in self.seconds],
        }
