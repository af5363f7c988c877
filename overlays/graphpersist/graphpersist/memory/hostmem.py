"""Pinned host memory that graphs read through its host address (mapped memory under unified addressing, e.g.
DeepEP's receive counters in its dispatch kernels' parameters): which of it SAVE accepts, what the archive records,
and what LOAD checks.

The interposer places cuMemHostAlloc/cuMemAllocHost at fixed host addresses (native/gp_host.c), so setup code that
allocates the same way gets the same addresses in every process. SAVE accepts a graph word in such an allocation
made during setup and still live, records the allocations graphs read (`extra.host_memory`), and LOAD refuses
before any replay unless each is live at the same address with the same size. Any other pinned memory a graph
reads is refused at SAVE with the reason (graph/walk.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from graphpersist.errors import PersistError
from graphpersist.memory import region
from graphpersist.records import HostMemory, HostMemoryRecord

AFTER_SETUP = "allocated after mark_setup(), so LOAD's setup does not make it again: allocate it during setup"


def for_save(setup_host_events: int) -> HostMemory:
    """The pinned host memory live now: restorable (placed during setup, i.e. among the first `setup_host_events`
    host events) or not, with why."""
    evs = region.host_events()
    in_setup = {e.addr for e in evs[:setup_host_events] if e.kind == "host_alloc"}
    restorable, others = [], []
    for addr, size in region.host_live(evs):
        if addr in in_setup:
            restorable.append((addr, size))
        else:
            others.append((addr, size, AFTER_SETUP))
    why = {e.addr: region.HOST_OUTSIDE_WHY.get(e.detail, f"reason {e.detail}") for e in evs if e.kind == "host_outside"}
    others += [(a, s, why.get(a, "left to the driver")) for a, s in region.host_live(evs, placed=False)]
    return HostMemory(sorted(restorable), sorted(others))


def record(words: Iterable[int], hm: HostMemory) -> dict[str, Any]:
    """What the archive keeps: the restorable allocations graph words point into, and how many words there are."""
    words = sorted(set(words))
    ranges = sorted({(a, s) for a, s in hm.restorable for w in words if a <= w < a + s})
    return {"ranges": [list(r) for r in ranges], "words": len(words)}


def check_load(saved: HostMemoryRecord | None) -> int:
    """LOAD, after setup: every pinned host allocation graphs read at SAVE is live at the same address with the
    same size. Refuses naming the first that is not (saved and live). Returns how many were checked. The record was
    checked for its types when the archive was read (archive.manifest.RankExtra)."""
    if saved is None:
        return 0
    ranges = saved.ranges
    live = region.host_live(region.host_events())
    live_at = dict(live)
    for addr, size in ranges:
        if live_at.get(addr) != size:
            near = [f"{a:#x}+{s}" for a, s in live if a <= addr + size and addr <= a + s] or ["none there"]
            raise PersistError(
                f"pinned host memory: graphs read {addr:#x}+{size} at SAVE, but LOAD's setup has "
                f"{', '.join(near[:4])} (live host allocations at LOAD: {len(live)}). The setup must allocate the "
                "same pinned memory in the same order (cudaHostAlloc/cudaMallocHost) with the interposer's host "
                "range at the same GP_HOST_BASE: LOAD refused"
            )
    return len(ranges)
