"""One worker process's persistence session: mode, archive, rank, the SAVE collector and what LOAD restored.

The worker (`vllm/graphpersist_worker.py`) opens the session before distributed init; the capture sites
(`CUDAGraphWrapper.__call__`, `CudaGraphManager.capture`, patched) and custom all-reduce's registration ask it
what to do. With persistence off there is no session and every hook does exactly what upstream does; the
runtime (`graphpersist.api`, torch-heavy) is imported only once a session opens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

from graphpersist import rankstats, switch


@dataclass
class Session(rankstats.RankSession):
    """What this worker persists or restores (graphpersist.rankstats.RankSession), plus vLLM's own state."""

    logger = init_logger(__name__)

    notes: dict[str, Any] = field(default_factory=lambda: {"full": {}, "pieces": {}})
    kv_bytes: int | None = None  # the KV-cache size SAVE used (smallest rank's profile); LOAD reuses it
    carried: set[str] | None = None  # SAVE, rank 0: the cache files the archive carries
    saved_notes: dict[str, Any] = field(default_factory=dict)  # LOAD: the archive's notes of this rank (early_check)
    kernel_choices: Any = None  # graphpersist.graph.kernelchoice.Choices once the worker installed them

    def stats(self) -> dict[str, Any]:
        counts = dict(self.kernel_choices.counts) if self.kernel_choices is not None else None
        return {**super().stats(), "kernel_choices": counts}


_session: Session | None = None


def current() -> Session | None:
    """The session of this process, or None when persistence is off (or this process is not a worker)."""
    return _session


def open_session(mode: switch.Mode, directory: Path, rank: int, world_size: int) -> Session:
    from graphpersist import api

    global _session
    if _session is not None:
        raise RuntimeError("graphpersist: a worker process opened its persistence session twice")
    from vllm import graphpersist_unused as unused

    saver = api.Saver(unused_param_bytes=unused.unused_param_bytes) if mode is switch.Mode.SAVE else None
    _session = Session(mode, directory, rank, world_size, saver=saver)
    _session.count_every_capture()
    return _session
