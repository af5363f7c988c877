"""A session's JIT and compile caches: which folders it carries, what SAVE packs, what LOAD puts back.

The adapter names its cache folders as resolvers (graphpersist.cachefolders has the ones every engine shares); the
session resolves them when it begins, before the engine redirects any. SAVE's rank 0 packs them into the archive's
shared file (the ranks of one host share them); every rank of a LOAD puts back what its host lacks before anything
compiles, and keeps what it has (graphpersist.archive.jitcache).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpersist import cachefolders
from graphpersist.errors import PersistError


def env_folder(variable: str, default: Callable[[], Path]) -> cachefolders.Resolver:
    """The resolver of a folder a library takes from `variable` when it is set and not empty (user-expanded), else
    from `default()`: how most JIT caches are placed."""

    def resolve() -> Path:
        value = os.environ.get(variable)
        return Path(value).expanduser() if value else default()

    return resolve


@dataclass
class SessionCaches:
    """The folders of one session and what it did with them."""

    folders: dict[str, Path] = field(default_factory=dict)  # JIT cache folders by name, as resolved at begin
    carried: set[str] | None = None  # SAVE, rank 0: the cache files the archive carries
    restored: list[str] = field(default_factory=list)  # LOAD: the files put back from the archive

    def record(self, resolvers: Mapping[str, cachefolders.Resolver], log: Callable[..., None]) -> None:
        """The folders as this process resolves them now, before the engine redirects any."""
        self.folders, left_out = cachefolders.resolve_all(resolvers)
        if left_out:
            log("JIT caches not carried: %s", "; ".join(f"{n} ({why})" for n, why in left_out.items()))

    def listing(self) -> set[str]:
        """The cache files the folders hold now (what a warm-up added is the difference)."""
        from graphpersist.archive import jitcache

        return jitcache.listing(self.folders)

    def carry(self, sess: Any) -> dict[str, bytes]:
        """SAVE, rank 0: the archive's shared JIT-cache file; what it carries is kept for `report_late`."""
        from graphpersist.archive import jitcache

        started = time.perf_counter()
        blob, stats = jitcache.collect(self.folders)
        self.carried = jitcache.listing(self.folders)
        sess.log("carrying JIT caches (%.1f MiB, %.2f s): %s", len(blob) / 2**20, time.perf_counter() - started,
                 stats.describe())  # fmt: skip
        return {jitcache.SHARED_NAME: blob}

    def restore(self, sess: Any) -> None:
        """LOAD, every rank, before anything compiles: puts back the cache files this host lacks, keeps its own."""
        from graphpersist.archive import ArchiveError, jitcache, read_shared

        started = time.perf_counter()
        try:
            blob = read_shared(sess.directory, jitcache.SHARED_NAME)
        except ArchiveError as exc:
            raise PersistError(f"graphpersist: cannot LOAD {sess.directory}: {exc}") from None
        if blob is None:
            sess.log("%s carries no JIT caches (saved by an older release): what is missing here compiles again",
                     sess.directory)  # fmt: skip
            return
        stats = jitcache.restore(blob, self.folders)
        self.restored = stats.written  # not compiled here: the proof tells them from what a LOAD compiles
        took = sess.timed("jitcache", started)
        sess.log("JIT caches restored in %.2f s: %s", took, stats.describe())

    def report_late(self, sess: Any) -> None:
        """SAVE, rank 0, once the engine's own warm-up is done: names what it compiled after the archive was written,
        which a LOAD on a fresh host would compile again."""
        if self.carried is None:
            return
        late = sorted(self.listing() - self.carried)
        if late:
            sess.log("%d JIT cache file(s) were compiled after the archive was written, so it lacks them (e.g. %s): "
                     "a LOAD on a fresh host compiles them again. SAVE once more on this host (its caches hold them "
                     "now) to carry them", len(late), ", ".join(late[:3]))  # fmt: skip
