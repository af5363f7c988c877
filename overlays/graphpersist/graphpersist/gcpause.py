"""Python's cyclic garbage collector paused while LOAD reads and rebuilds an archive.

LOAD allocates hundreds of thousands of small containers (records, descriptions, index entries) that it keeps,
and none of them form cycles. Every few hundred allocations the collector runs, and now and then a full pass
walks every object of the process: in an engine that has imported torch that is millions of objects, 50-100 ms
a pass (recipes/runtime-scale/cpu_bench.py --heap). Pausing it for the length of one LOAD changes no result;
whatever cycles arise meanwhile are collected by the first pass after it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


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
