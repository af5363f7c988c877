"""Deterministic setup: the region before any library allocates, the end of setup, and what it owns.

Everything allocated before mark_setup() (weights, static buffers, KV cache, peer mappings) is re-created by
LOAD running the same setup code; SAVE proves the graphs use only memory LOAD can recreate exactly
(check_ownership) and LOAD proves the named setup tensors sit where SAVE had them (check_setup_tensors).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphpersist import run
from graphpersist.errors import PersistError
from graphpersist.memory import alloctrace, layout, region
from graphpersist.memory.phases import block_problems, find_range, held_blocks
from graphpersist.memory.tensors import tensor_key


@dataclass(frozen=True)
class SetupMark:
    """What mark_setup() recorded: the allocation log length and cursor, the named tensors, torch's memory."""

    events: int
    cursor: int
    tensors: list[list[Any]]
    segments: list[tuple[int, int]]  # torch's segments, sorted (addr, size)
    blocks: list[tuple[int, int]]  # torch's live blocks at mark_setup(), sorted (addr, size)
    host_events: int = 0  # the pinned host memory log's length (memory.hostmem)


def current() -> SetupMark | None:
    """The mark of this process's run, or None before mark_setup()."""
    mark: SetupMark | None = run.current().mark
    return mark


def start_region() -> region.RegionInfo:
    """Creates the CUDA context and the fixed region now (before any library allocates on its own)."""
    torch.cuda.init()
    torch.cuda.current_device()
    torch.empty(0, device="cuda")  # context is current on this thread
    info = region.start()
    alloctrace.start()  # GRAPHPERSIST_ALLOC_TRACE: torch's allocation history from here on
    return info


def mark_setup(tensors: Mapping[str, torch.Tensor], *, allow_unnamed: bool = False) -> int:
    """Marks the end of deterministic setup (weights, static buffers): allocations after it are capture-time.

    `tensors` names the setup tensors the graphs use (parameters, buffers, KV cache, static inputs). Identical
    driver-level allocations do not prove identical tensors (torch's caching allocator sub-allocates segments),
    so LOAD compares each named tensor's address, dtype and shape too; an empty mapping is refused unless
    `allow_unnamed=True` says the setup has no torch tensors worth naming. It also records which parts of
    torch's segments hold live blocks now: SAVE refuses graph addresses in the rest (see Saver.save). Returns the
    number of allocation events.
    """
    if tensors is None or (not tensors and not allow_unnamed):
        raise PersistError(
            "mark_setup() needs the named setup tensors the graphs use (parameters, buffers, static inputs), so "
            "LOAD can prove they sit where SAVE had them; pass allow_unnamed=True only if there are none"
        )
    torch.cuda.synchronize()
    layout.finish_setup()  # ends setup's last phase (the whole setup is one exact phase when none was named)
    evs = region.events()
    segments, blocks = _torch_blocks()
    alloctrace.dump()
    named = [[name, *tensor_key(t)] for name, t in tensors.items()]
    run.current().mark = SetupMark(len(evs), region.info().cursor, named, segments, blocks,
                                   region.host_info().n_events)  # fmt: skip
    return len(evs)


def _torch_blocks() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(segments, live blocks) of torch's caching allocator on this device, each sorted (addr, size)."""
    dev = torch.cuda.current_device()
    segments, blocks = [], []
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", dev) != dev:
            continue
        segments.append((int(seg["address"]), int(seg["total_size"])))
        for b in seg["blocks"]:
            if b["state"] != "inactive":
                blocks.append((int(b["address"]), int(b["size"])))
    return sorted(segments), sorted(blocks)


def check_ownership(name: str, pointers: set[int], live: list[tuple[int, int]]) -> None:
    """Every in-region address a graph uses must be memory LOAD recreates exactly and nobody else can take:
    live at SAVE, and, inside a torch segment that existed at mark_setup(), inside a block that was live then
    (the rest of such a segment is free space torch may hand to any later tensor at LOAD)."""
    mark = current()
    segments, blocks = (mark.segments, mark.blocks) if mark is not None else ([], [])
    for p in sorted(pointers):
        if find_range(live, p) is None:
            raise PersistError(f"graph {name!r}: address {p:#x} is not backed by live region memory at SAVE "
                               "(freed before SAVE?): SAVE refused")  # fmt: skip
        seg = find_range(segments, p)
        if seg is not None and find_range(blocks, p) is None:
            raise PersistError(
                f"graph {name!r}: address {p:#x} lies in free space of torch segment {seg[0]:#x}+{seg[1]} as it "
                "was at mark_setup(): memory allocated there after mark_setup() is not recreated at LOAD and could "
                "be handed to another tensor. Allocate it before mark_setup() (and name it) or inside the graph "
                "pool: SAVE refused"
            )


def pointer_blocks(pointers: Iterable[int]) -> list[tuple[int, int]]:
    """SAVE: the torch blocks, live at mark_setup(), that hold graph addresses (phases.held_blocks); LOAD checks
    them (check_pointer_blocks)."""
    mark = current()
    found = held_blocks(pointers, mark.segments, mark.blocks) if mark is not None else []
    run.current().graph_blocks = found
    return found


def check_pointer_blocks(saved: Sequence[Sequence[int]]) -> None:
    """LOAD: refuses when a torch block holding graph addresses at SAVE's end of setup is not live at LOAD's."""
    run.current().graph_blocks = sorted((int(a), int(s)) for a, s in saved)
    if not saved:
        return
    mark = current()
    segments, blocks = (mark.segments, mark.blocks) if mark is not None else _torch_blocks()
    problems = block_problems(saved, blocks, segments)
    if problems:
        shown = "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")
        raise PersistError(
            f"{len(problems)} of {len(saved)} torch block(s) that graphs read and that were live at the end of "
            f"SAVE's setup are not live at LOAD's: {shown}. A tensor SAVE's setup kept (a warm-up or profiling "
            "leftover) was not recreated at LOAD, so another tensor could take its memory while the graphs still "
            "read it. Name that tensor in mark_setup() and create it at LOAD too, or allocate it inside the graph "
            "pool: LOAD refused"
        )


def check_setup_tensors(saved: list[list[Any]], live: Mapping[str, torch.Tensor] | None) -> None:
    """Aborts at the first named setup tensor whose address, dtype, shape or stride differs from SAVE's."""
    if saved and live is None:
        raise PersistError(f"the archive records {len(saved)} setup tensors: pass setup_tensors= to load()")
    live_rows = [[name, *tensor_key(t)] for name, t in (live or {}).items()]
    for i, (want, got) in enumerate(zip(saved, live_rows, strict=False)):
        if want != got:
            moved = want[1] != got[1]  # then say which allocation holds the saved address, or how to find it
            held = alloctrace.holder(want[1]) if moved else ""
            raise PersistError(
                f"setup tensor {i} differs: saved {want[0]!r} at {want[1]:#x} {want[2]} {want[3]}, "
                f"live {got[0]!r} at {got[1]:#x} {got[2]} {got[3]} (setup code or its order differs)"
                + (f"; {held}" if held else "")
                + (f". {alloctrace.advice()}" if moved else "")
            )
    if len(saved) != len(live_rows):
        raise PersistError(f"setup tensors: SAVE recorded {len(saved)}, LOAD passed {len(live_rows)}")
