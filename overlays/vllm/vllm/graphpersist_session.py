"""One worker process's persistence session: mode, archive, rank, the SAVE collector and what LOAD restored.

The worker (`vllm/graphpersist_worker.py`) opens the session before distributed init; the capture sites
(`CUDAGraphWrapper.__call__`, `CudaGraphManager.capture`, patched) and custom all-reduce's registration ask it
what to do. With persistence off there is no session and every hook does exactly what upstream does; the
runtime (`graphpersist.api`, torch-heavy) is imported only once a session opens.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

from graphpersist import switch

logger = init_logger(__name__)

STATS_ENV = "GRAPHPERSIST_STATS_DIR"


@dataclass
class Session:
    """What this worker persists or restores. `timings` are the persistence phases, in seconds, in order."""

    mode: switch.Mode
    directory: Path
    rank: int
    world_size: int
    saver: Any = None  # graphpersist.api.Saver while saving
    notes: dict[str, Any] = field(default_factory=lambda: {"full": {}, "pieces": {}})
    timings: dict[str, float] = field(default_factory=dict)
    captured: int = 0
    restored: int = 0
    capture_calls: int = 0
    model: dict[str, str] = field(default_factory=dict)  # model facts, computed at start in SAVE and LOAD alike
    restored_files: list[str] = field(default_factory=list)  # LOAD: JIT cache files put back from the archive
    kv_bytes: int | None = None  # the KV-cache size SAVE used (smallest rank's profile); LOAD reuses it
    caches: dict[str, Path] = field(default_factory=dict)  # JIT cache folders by name (graphpersist_caches)
    carried: set[str] | None = None  # SAVE, rank 0: the cache files the archive carries
    done: bool = False
    kept: list[Any] = field(default_factory=list)  # objects LOAD must keep alive (loaded graphs, peer mappings)

    @property
    def saving(self) -> bool:
        return self.mode is switch.Mode.SAVE and not self.done

    @property
    def loading(self) -> bool:
        return self.mode is switch.Mode.LOAD

    def log(self, message: str, *args: Any) -> None:
        logger.info("graphpersist: rank %d: " + message, self.rank, *args)

    def timed(self, name: str, started: float) -> float:
        took = time.perf_counter() - started
        self.timings[name] = round(took, 4)
        return took

    def write_stats(self) -> None:
        """Per-rank counts for the proof runner (only when GRAPHPERSIST_STATS_DIR is set)."""
        where = os.environ.get(STATS_ENV)
        if not where:
            return
        Path(where).mkdir(parents=True, exist_ok=True)
        stats = {
            "rank": self.rank,
            "mode": self.mode.value,
            "captured": self.captured,
            "restored": self.restored,
            "capture_calls": self.capture_calls,
            "phases": self.timings,
            "jitcache_restored": self.restored_files,
        }
        tmp = Path(where) / f".rank_{self.rank}.json.tmp"
        tmp.write_text(json.dumps(stats, indent=1))
        tmp.replace(Path(where) / f"rank_{self.rank}.json")


_session: Session | None = None


def seconds_since_process_start() -> float:
    """How long this process ran before the worker started (spawn + imports), from /proc; 0.0 where unknown."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - ticks / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return 0.0


def current() -> Session | None:
    """The session of this process, or None when persistence is off (or this process is not a worker)."""
    return _session


def open_session(mode: switch.Mode, directory: Path, rank: int, world_size: int) -> Session:
    from graphpersist import api

    global _session
    if _session is not None:
        raise RuntimeError("graphpersist: a worker process opened its persistence session twice")
    from vllm import graphpersist_customar as customar

    saver = api.Saver(unused_param_bytes=customar.unused_param_bytes) if mode is switch.Mode.SAVE else None
    _session = Session(mode, directory, rank, world_size, saver=saver)
    _count_captures(_session)
    return _session


def _count_captures(sess: Session) -> None:
    """Counts every CUDA-graph capture this process begins: LOAD must begin none, and the proof reads it."""
    import torch

    real_begin = torch.cuda.CUDAGraph.capture_begin

    def counting_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        sess.capture_calls += 1
        return real_begin(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = counting_begin  # type: ignore[method-assign]
