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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpersist import rankstats, switch


@dataclass
class Session(rankstats.RankSession):
    """What this scheduler process persists or restores (graphpersist.rankstats.RankSession), plus SGLang's state."""

    logger = logging.getLogger(__name__)

    notes: dict[str, Any] = field(default_factory=lambda: {"decode": {}, "prefill": {}})
    pool: dict[str, Any] | None = None  # the memory pool SAVE sized (MemoryPoolConfig fields + budget); LOAD reuses it
    deferred: list[Any] = field(default_factory=list)  # graph runners whose capture waits for every runner's setup
    runners: dict[str, Any] = field(default_factory=dict)  # the graph runners by phase ("decode", "prefill")
    kernel_warmup: dict[str, Any] | None = None  # SAVE: what the kernel warm-up before writing ran and compiled
    capturing: str | None = None  # "decode" or "prefill" while SAVE runs that runner's capture
    breaks: list[dict[str, Any]] = field(default_factory=list)  # SAVE: breaks of the graph being captured
    attn_shapes: dict[str, Any] = field(default_factory=dict)  # per-shape attention state (tensor inventories)
    setup_started: float = 0.0  # when distributed init began (timing of the setup phase)
    kv_started: float = 0.0  # when the memory pool's sizing began

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        if self.kernel_warmup is not None:
            stats["kernel_warmup"] = self.kernel_warmup
        return stats


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
    _session.count_every_capture()
    return _session
