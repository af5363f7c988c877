"""How the ranks of one SAVE or LOAD agree before any of them goes on.

Why: a TP graph holds collectives, so a rank that refuses alone leaves its peers blocked in the first replay (or
in the next collective) instead of failing. Every rank therefore reports success or its error, and all of them
raise together, naming each failing rank. SAVE also proves that all ranks describe the same world (versions,
layout, pins) before rank 0 writes it into the manifest once, and publishes the archive only after every rank has
written its part.

`gather` is the transport: torch.distributed's all_gather_object by default (the engine's process group must be
initialised), or any function with the same contract (tests use threads).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from graphpersist.archive import ArchiveWriter
from graphpersist.archive.validate import flatten, render

Gather = Callable[[Any], list[Any]]


class RanksRefused(RuntimeError):
    """One or more ranks refused (or disagree); the message names each rank and why."""


def torch_gather(group: Any = None) -> Gather:
    """all_gather_object over `group` (default: the world group)."""

    def gather(obj: Any) -> list[Any]:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RanksRefused("world_size > 1 needs an initialised torch.distributed process group")
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


class Ranks:
    """One rank's view of the agreement protocol; with world_size 1 every step is local."""

    def __init__(self, world_size: int, rank: int, gather: Gather | None = None, group: Any = None) -> None:
        if not 0 <= rank < world_size:
            raise RanksRefused(f"rank {rank} is outside world_size {world_size}")
        self.world_size, self.rank = world_size, rank
        self._gather = gather if gather is not None else (torch_gather(group) if world_size > 1 else None)

    def gather(self, obj: Any) -> list[Any]:
        if self._gather is None:
            return [obj]
        got = self._gather(obj)
        if len(got) != self.world_size:
            raise RanksRefused(f"{len(got)} ranks answered, world_size is {self.world_size}")
        return got

    def check(self, error: str | None, what: str) -> None:
        """Raises on every rank if any rank reports an error (this one included)."""
        errors = self.gather(error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
            raise RanksRefused(f"{what} refused on {len(failed)} of {self.world_size} rank(s):\n{lines}")

    def same_world(self, world: Mapping[str, Any], what: str) -> None:
        """Raises unless every rank's world facts equal rank 0's, listing each differing field."""
        worlds = self.gather(dict(world))
        base = flatten(worlds[0])
        problems = []
        for r, w in enumerate(worlds[1:], start=1):
            flat = flatten(w)
            for key in sorted(set(base) | set(flat)):
                if base.get(key, "<missing>") != flat.get(key, "<missing>"):
                    problems.append(
                        f"  {key}: rank 0 {render(key, base.get(key))}, rank {r} {render(key, flat.get(key))}"
                    )
        if problems:
            raise RanksRefused(f"{what} refused: the ranks describe different worlds:\n" + "\n".join(problems))

    def writer(self, archive_dir: Path | str, world: Mapping[str, Any], *, overwrite: bool) -> ArchiveWriter:
        """Rank 0 creates the staging folder; the others write into it (same host, same file system)."""
        writer: ArchiveWriter | None = None
        error = None
        if self.rank == 0:
            try:
                writer = ArchiveWriter(archive_dir, world, overwrite=overwrite)
            except Exception as exc:  # reported to every rank below
                error = f"cannot stage the archive: {exc}"
        staging = self.gather(str(writer.staging) if writer else None)[0]
        if self.rank != 0 and staging is not None:
            try:
                writer = ArchiveWriter(archive_dir, world, overwrite=overwrite, staging=staging)
            except Exception as exc:
                error = f"cannot write into rank 0's staging folder: {exc}"
        try:
            self.check(error, "SAVE")
        except RanksRefused:
            if writer is not None:
                writer.abort()
            raise
        assert writer is not None  # rank 0 reported no error, so every rank has its writer
        return writer

    def commit(self, writer: ArchiveWriter, error: str | None) -> None:
        """Every rank reports its part; rank 0 publishes only when all succeeded, then everyone learns the result."""
        try:
            self.check(error, "SAVE")
        except RanksRefused:
            writer.abort()
            raise
        result = None
        if self.rank == 0:
            try:
                writer.commit()
            except Exception as exc:
                result = str(exc)
        outcome = self.gather(result)[0]
        if outcome:
            raise RanksRefused(f"SAVE refused: rank 0 could not publish the archive: {outcome}")
