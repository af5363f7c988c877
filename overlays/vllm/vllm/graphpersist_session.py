"""One worker process's persistence session: mode, archive, rank, the SAVE collector and what LOAD restored.

The worker (`vllm/graphpersist_worker.py`) opens the session before distributed init; the capture sites
(`CUDAGraphWrapper.__call__`, `CudaGraphManager.capture`, patched) and custom all-reduce's registration ask it
what to do. With persistence off there is no session and every hook does exactly what upstream does; the
runtime (`graphpersist.api`, torch-heavy) is imported only once a session opens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

from graphpersist import rankstats, switch

logger = init_logger(__name__)


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
        stats = {
            "rank": self.rank,
            "mode": self.mode.value,
            "captured": self.captured,
            "restored": self.restored,
            "capture_calls": self.capture_calls,
            "phases": self.timings,
            "jitcache_restored": self.restored_files,
        }
        rankstats.write(self.rank, stats)


_session: Session | None = None


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

    def counted() -> None:
        sess.capture_calls += 1

    rankstats.count_captures(counted)
