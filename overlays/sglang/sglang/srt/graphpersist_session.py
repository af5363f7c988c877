"""One scheduler process's persistence session: mode, archive, rank, the SAVE collector and what LOAD restored.

`graphpersist_engine.before_distributed` opens it in the scheduler (TP worker) process before distributed init;
the capture sites (`graphpersist_capture`), custom all-reduce's registration (`graphpersist_customar`) and the
memory-pool sizing ask it what to do. With persistence off there is no session and every hook does exactly what
upstream does; the runtime (`graphpersist.api`, torch-heavy) is imported only once a session opens.

The per-rank stats file has the keys of vLLM's session (`rank`, `mode`, `captured`, `restored`, `capture_calls`,
`phases`, `jitcache_restored`), which the proof runner and the recipe drivers read; a SAVE adds `kernel_warmup` (what
its first requests ran and, on rank 0, the JIT cache files they added).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpersist import rankstats, switch

logger = logging.getLogger(__name__)


@dataclass
class Session:
    """What this scheduler process persists or restores. `timings` are the persistence phases, in seconds, in order."""

    mode: switch.Mode
    directory: Path
    rank: int
    world_size: int
    saver: Any = None  # graphpersist.api.Saver while saving
    notes: dict[str, Any] = field(default_factory=lambda: {"decode": {}, "prefill": {}})
    timings: dict[str, float] = field(default_factory=dict)
    captured: int = 0
    restored: int = 0
    capture_calls: int = 0
    model: dict[str, str] = field(default_factory=dict)  # model facts, computed at start in SAVE and LOAD alike
    restored_files: list[str] = field(default_factory=list)  # LOAD: JIT cache files put back from the archive
    pool: dict[str, Any] | None = None  # the memory pool SAVE sized (MemoryPoolConfig fields + budget); LOAD reuses it
    caches: dict[str, Path] = field(default_factory=dict)  # JIT cache folders by name (graphpersist_caches)
    deferred: list[Any] = field(default_factory=list)  # graph runners whose capture waits for every runner's setup
    runners: dict[str, Any] = field(default_factory=dict)  # the graph runners by phase ("decode", "prefill")
    kernel_warmup: dict[str, Any] | None = None  # SAVE: what the kernel warm-up before writing ran and compiled
    capturing: str | None = None  # "decode" or "prefill" while SAVE runs that runner's capture
    breaks: list[dict[str, Any]] = field(default_factory=list)  # SAVE: breaks of the graph being captured
    attn_shapes: dict[str, Any] = field(default_factory=dict)  # per-shape attention state (tensor inventories)
    done: bool = False
    kept: list[Any] = field(default_factory=list)  # objects LOAD must keep alive (loaded graphs)
    setup_started: float = 0.0  # when distributed init began (timing of the setup phase)
    kv_started: float = 0.0  # when the memory pool's sizing began

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
        stats: dict[str, Any] = {
            "rank": self.rank,
            "mode": self.mode.value,
            "captured": self.captured,
            "restored": self.restored,
            "capture_calls": self.capture_calls,
            "phases": self.timings,
            "jitcache_restored": self.restored_files,
        }
        if self.kernel_warmup is not None:
            stats["kernel_warmup"] = self.kernel_warmup
        rankstats.write(self.rank, stats)


_session: Session | None = None


def current() -> Session | None:
    """The session of this process, or None when persistence is off (or this process runs no model)."""
    return _session


def open_session(mode: switch.Mode, directory: Path, rank: int, world_size: int) -> Session:
    from graphpersist import api

    global _session
    if _session is not None:
        raise api.PersistError(
            "graphpersist: a second model runner in one scheduler process (a draft model?) cannot be persisted: "
            "serve without speculative decoding"
        )
    _session = Session(mode, directory, rank, world_size, saver=api.Saver() if mode is switch.Mode.SAVE else None)
    _count_captures(_session)
    return _session


def _count_captures(sess: Session) -> None:
    """Counts every CUDA-graph capture this process begins: LOAD must begin none, and the proof reads it."""

    def counted() -> None:
        sess.capture_calls += 1

    rankstats.count_captures(counted)
