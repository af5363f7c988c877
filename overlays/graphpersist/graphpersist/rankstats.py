"""What one rank's persistence session reports to the proof runner: its stats file and the counts behind it.

Every engine's persistence session (graphpersist.engine.PersistSession) writes the same file with the same keys
(`rank`, `mode`, `captured`, `restored`, `capture_calls`, `phases`, `jitcache_restored`, engine extras), which the
proof runner and the recipe drivers read; only when GRAPHPERSIST_STATS_DIR is set. No torch at import: the engines
import this before they know whether persistence is on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

STATS_ENV = "GRAPHPERSIST_STATS_DIR"


def write(rank: int, stats: Mapping[str, Any]) -> None:
    """Writes `rank_<rank>.json` into $GRAPHPERSIST_STATS_DIR atomically (a reader never sees half a file)."""
    where = os.environ.get(STATS_ENV)
    if not where:
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    tmp = Path(where) / f".rank_{rank}.json.tmp"
    tmp.write_text(json.dumps(dict(stats), indent=1))
    tmp.replace(Path(where) / f"rank_{rank}.json")


def seconds_since_process_start() -> float:
    """How long this process ran before the caller asked (spawn + imports), from /proc; 0.0 where unknown."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - ticks / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return 0.0


def count_captures(on_capture: Callable[[], None]) -> None:
    """Calls `on_capture()` at every CUDA-graph capture this process begins: LOAD must begin none."""
    import torch

    real_begin = torch.cuda.CUDAGraph.capture_begin

    def counting_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        on_capture()
        return real_begin(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = counting_begin  # type: ignore[method-assign]
