"""A rank's archive read ahead of its LOAD: opened (this rank's files hashed) and put through LOAD's CPU stage
(graphpersist.loadstage) in a thread started once the early checks pass and the JIT caches are back (both Python
work on the main thread, which the thread would slow through the GIL), while the engine builds its model, loads
its weights and compiled code. Inside the restore this reading took 0.22-0.74 s of a TP=1 vLLM LOAD on the
reference hosts (recipes/vllm-qwen3-8b-tp1, "open + validate"), all of it before the first GPU call.

Nothing is decided differently: the restore takes what was read only for the same folder and rank, and only while
the archive is the one that was read; where it is not (a SAVE replaced it since) or the open failed, the restore
opens it itself, as before, and meets any problem there. The stage's refusal of the archive it read is raised where
LOAD runs its stage. No torch here: the session starts it before the engine has set anything up.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

from graphpersist import loadstage
from graphpersist.archive import Archive, open_archive
from graphpersist.loadplan import LoadPlan


class ReadAhead:
    """One rank's archive, opened and staged in a daemon thread from construction on."""

    def __init__(self, archive_dir: Path | str, rank: int) -> None:
        self.directory = Path(archive_dir)
        self.rank = rank
        self.seconds: float | None = None  # the thread's own time, once it is done
        self._opened: Future[Archive] = Future()
        self._staged: Future[LoadPlan] = Future()
        threading.Thread(target=self._read, name="graphpersist-read-ahead", daemon=True).start()

    def _read(self) -> None:
        started = time.perf_counter()
        try:
            archive = open_archive(self.directory, keep_rank=self.rank)
        except Exception as exc:  # the restore opens the archive itself, and meets the problem if it lasts
            self.seconds = time.perf_counter() - started
            self._opened.set_exception(exc)
            return
        self._opened.set_result(archive)
        try:
            plan = loadstage.rank_stage(archive, self.rank)
        except Exception as exc:  # raised again by plan, where LOAD runs its CPU stage
            self.seconds = time.perf_counter() - started
            self._staged.set_exception(exc)
            return
        self.seconds = time.perf_counter() - started
        self._staged.set_result(plan)

    def archive_for(self, archive_dir: Path | str, rank: int) -> Archive | None:
        """The archive read ahead, once opened; None where it is not this folder's or rank's, the open failed or the
        archive was replaced since: the caller then opens it itself."""
        if Path(archive_dir) != self.directory or rank != self.rank or self._opened.exception() is not None:
            return None
        archive = self._opened.result()
        return archive if archive.unchanged() else None

    def plan(self) -> LoadPlan:
        """The rank's LOAD plan (loadstage.rank_stage) of the archive `archive_for` returned; what the stage raised,
        raised here."""
        return self._staged.result()
