"""What one rank's persistence session reports to the proof runner: its stats file and the counts behind it.

Both engines' sessions (vLLM's worker, SGLang's scheduler process) write the same file with the same keys
(`rank`, `mode`, `captured`, `restored`, `capture_calls`, `phases`, `jitcache_restored`, engine extras), which the
proof runner and the recipe drivers read; only when GRAPHPERSIST_STATS_DIR is set. No torch at import: the engines
import this before they know whether persistence is on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from graphpersist import switch

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


@dataclass
class RankSession:
    """What both engines' per-rank sessions hold (vLLM's worker, SGLang's scheduler process): mode, archive, rank,
    the SAVE collector and the counts the stats file reports. `timings` are the persistence phases, in seconds, in
    order. An engine subclasses it with its own fields (each with a default), its `notes` layout and its logger."""

    logger: ClassVar[logging.Logger] = logging.getLogger("graphpersist")

    mode: switch.Mode
    directory: Path
    rank: int
    world_size: int
    saver: Any = None  # graphpersist.api.Saver while saving
    notes: dict[str, Any] = field(default_factory=dict)  # the engine's bookkeeping SAVE stores for this rank
    timings: dict[str, float] = field(default_factory=dict)
    captured: int = 0
    restored: int = 0
    capture_calls: int = 0
    model: dict[str, str] = field(default_factory=dict)  # model facts, computed at start in SAVE and LOAD alike
    restored_files: list[str] = field(default_factory=list)  # LOAD: JIT cache files put back from the archive
    caches: dict[str, Path] = field(default_factory=dict)  # JIT cache folders by name
    done: bool = False
    kept: list[Any] = field(default_factory=list)  # objects LOAD must keep alive (loaded graphs, peer mappings)

    @property
    def saving(self) -> bool:
        return self.mode is switch.Mode.SAVE and not self.done

    @property
    def loading(self) -> bool:
        return self.mode is switch.Mode.LOAD

    def log(self, message: str, *args: Any) -> None:
        self.logger.info("graphpersist: rank %d: " + message, self.rank, *args)

    def timed(self, name: str, started: float) -> float:
        took = time.perf_counter() - started
        self.timings[name] = round(took, 4)
        return took

    def stats(self) -> dict[str, Any]:
        """The stats file's keys; an engine adds its extras."""
        return {
            "rank": self.rank,
            "mode": self.mode.value,
            "captured": self.captured,
            "restored": self.restored,
            "capture_calls": self.capture_calls,
            "phases": self.timings,
            "jitcache_restored": self.restored_files,
        }

    def write_stats(self) -> None:
        """Per-rank counts for the proof runner (only when GRAPHPERSIST_STATS_DIR is set)."""
        write(self.rank, self.stats())

    def count_every_capture(self) -> None:
        """Counts every CUDA-graph capture this process begins: LOAD must begin none, and the proof reads it."""

        def counted() -> None:
            self.capture_calls += 1

        count_captures(counted)
