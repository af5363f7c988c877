"""LOAD's CPU stage: everything LOAD decides from an archive before its first GPU call, as one unit that LOAD and
`graphpersist check` both call, so that check refuses whatever LOAD would refuse on CPU (and LOAD what check does).

* `rank_stage(archive, rank)`: one rank's LOAD inputs, read and checked by graphpersist.loadplan: every value's type
  and range and its allowlist (torch dtypes, node kinds, allocation-event kinds, attribute ids as ASCII digits), each
  graph's description against its kernel table, parameter blob and function table, and the saved layout LOAD's
  memory stage restores (phases, allocation log, every graph address in memory the log leaves live). load() calls it
  for its rank; `check` for every rank, with `every_byte` (also every hash LOAD's fast path leaves to the file table).
* `shared_stage(archive)`: the shared files each rank's engine reads before its LOAD proper: the JIT caches,
  walked by graphpersist.archive.jitcache.validate with the rules its restore applies, writing nothing.

Opening the archive (open_archive: sizes, hashes, the records' commitments) comes first and is the caller's. Not
here, because only the live process can tell: the facts compared with live values (archive.validate), setup
tensors and torch's blocks, the phases as this LOAD runs them, the output dataclasses the engine has loaded, and
the kernels and memory on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphpersist.archive import Archive, ArchiveError, jitcache
from graphpersist.archive.shown import shown
from graphpersist.errors import JitCacheError
from graphpersist.loadplan import LoadPlan, read_plan


def rank_stage(archive: Archive, rank: int, *, every_byte: bool = False) -> LoadPlan:
    """Rank `rank`'s LOAD inputs, checked (see the module's docstring); ArchiveError naming file and field.

    `every_byte` (check): also every kernel node parsed, every topology fingerprint recomputed, and every part, image
    and state payload hashed against its own sha256."""
    return read_plan(archive, rank, every_byte=every_byte)


def shared_stage(archive: Archive) -> list[str]:
    """The shared files an engine reads before LOAD, checked as it reads them; ArchiveError naming the file.
    Returns the names checked."""
    checked = []
    if jitcache.SHARED_NAME in archive.manifest.files:
        try:
            jitcache.validate(archive.read(None, jitcache.SHARED_NAME))
        except JitCacheError as exc:
            what = shown(str(exc).removeprefix("graphpersist: "))
            raise ArchiveError(archive.root, f"{jitcache.SHARED_NAME}: {what}", advice="") from None
        checked.append(jitcache.SHARED_NAME)
    return checked


@dataclass(frozen=True)
class Verified:
    """What `graphpersist check` verified: every rank's CPU stage and the shared files."""

    graphs: int
    images: int
    bytes: int
    shared: list[str]


def verify_all(archive: Archive) -> Verified:
    """Every rank's CPU stage with every byte, then the shared files: what `graphpersist check` runs (ArchiveError
    naming the first problem)."""
    plans = [rank_stage(archive, r, every_byte=True) for r in archive.ranks]
    shared = shared_stage(archive)
    return Verified(
        graphs=sum(len(p.graphs) for p in plans),
        images=len({im.sha256 for p in plans for im in p.record.images}),
        bytes=sum(e.size for e in archive.manifest.files.values()),
        shared=shared,
    )
