"""LOAD: validate an archive against this process, restore memory and images, rebuild the graphs.

Process B (LOAD) runs the same setup code as SAVE, so every setup allocation lands at the same address, then
load() validates the archive, recreates the memory the graphs reference beyond the setup, loads the kernel
images and rebuilds the graphs. No warm-up and no capture happen in B.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphpersist import graphbuild, graphformat, images, layout, phases, ranks, region, setup, state
from graphpersist.archive import open_archive
from graphpersist.collective import collective, parallel_layout
from graphpersist.errors import PersistError
from graphpersist.liveenv import collect_live
from graphpersist.tensors import tensor_at
from graphpersist.validate import check_or_refuse


@dataclass
class LoadedGraph:
    """A rebuilt graph, replayable like torch.cuda.CUDAGraph, with its static tensors at the saved addresses.

    `events[i]` is the live CUevent (cuda-bindings) standing for event index i of the saved graph (distinct
    events numbered in order of first appearance at SAVE). The graph's event record/wait nodes use these fresh
    events, not the ones captured in the SAVE process: an engine that records or waits on those events outside
    the graph must use these (e.g. `cuEventRecord(lg.events[i], stream)` before replay, `cuStreamWaitEvent`
    after). They are created with CU_EVENT_DISABLE_TIMING and live as long as this object.
    """

    name: str
    exec: Any
    graph: Any
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    node_count: int
    rebuild_s: float
    instantiate_s: float
    events: list[Any] = field(default_factory=list)

    def replay(self) -> None:
        from cuda.bindings import driver as drv

        if layout.needs_verify():  # post-capture memory and declared state are proven before the first replay
            layout.verify_state()

        images.check(drv.cuGraphLaunch(self.exec, torch.cuda.current_stream().cuda_stream), f"replay {self.name}")


@dataclass
class LoadResult:
    """The restored graphs; `skipped_phases`: SAVE's skip_on_load phases this LOAD did not run (their memory
    was mapped from the archive); `post_capture_phases`: phases the engine must now re-run before the first
    replay (then verify_state(), or the replay itself, checks them and the declared state)."""

    graphs: dict[str, LoadedGraph]
    timings: dict[str, float]
    skipped_phases: list[str] = field(default_factory=list)
    post_capture_phases: list[str] = field(default_factory=list)


def _restore_memory(archive: Any, rank: int, pointers: list[int]) -> tuple[list[str], layout.Pending | None]:
    """Proves setup matches SAVE phase by phase, maps what capture and skipped phases left live at SAVE, and
    checks every graph address lies in memory at its saved address with its saved size. Addresses in memory of
    post-capture phases (re-run by the engine after load()) are checked when those phases end. Returns the
    skipped phases and the checks still pending."""
    rec = archive.rank_facts(rank)
    info = region.info()
    if info.base != rec.region.base:
        raise PersistError(f"region base: saved {rec.region.base:#x}, live {info.base:#x}")
    saved, saved_evs = layout.saved_phases(archive, rank)
    layout.finish_setup()  # an engine that did not call mark_setup() at LOAD: its setup ends here
    live_evs = region.events()
    post = [p for p in saved if p.post_capture]
    try:
        skipped = phases.compare_setup(saved, saved_evs, layout.recorder().phases, live_evs)
        to_map = phases.restore_ranges(saved, saved_evs, live_evs, skipped)
        region.restore(to_map, len(live_evs), post[0].start if post else rec.region.final_offset)
        post_names = {p.name for p in post}
        later = phases.check_backed(pointers, saved, saved_evs, region.live_ranges(region.events()),
                                    defer=post_names.__contains__)  # fmt: skip
    except (phases.PhaseError, region.RegionError) as exc:
        raise PersistError(f"{exc}: LOAD refused") from None
    layout.recorder().adopt(saved, saved_evs)
    states = [state.StateRecord.from_json(r) for r in rec.extra.get("state", [])]
    pending = layout.Pending(archive, rank, saved, saved_evs, later, states) if post or states else None
    return skipped, pending


def load(
    root: Path | str,
    *,
    engine: Mapping[str, str],
    model: Mapping[str, str],
    sizes: Sequence[int],
    modes: Sequence[str] = (),
    rank: int = 0,
    parallel: Mapping[str, int] | None = None,
    flags: Mapping[str, Any] | None = None,
    native: bool = True,
    setup_tensors: Mapping[str, torch.Tensor] | None = None,
    gather: ranks.Gather | None = None,
) -> LoadResult:
    """Validates the archive against this process, restores memory, images and graphs. Raises before replay.

    With `parallel["world_size"] > 1` every rank calls it: a rank that refuses makes all of them raise (a
    PersistError naming each failing rank), so no rank goes on to replay collectives its peers never join.
    """
    par = parallel_layout(parallel)
    coll = collective(par, rank, gather)
    try:
        result = _load_rank(root, engine, model, sizes, modes, rank, par, flags, native, setup_tensors)
    except Exception as exc:
        if coll.world_size > 1:
            try:
                coll.check(f"{type(exc).__name__}: {exc}", "LOAD")
            except ranks.RanksRefused as agreed:
                raise PersistError(str(agreed)) from exc
        raise
    try:
        coll.check(None, "LOAD")
    except ranks.RanksRefused as exc:
        raise PersistError(str(exc)) from None
    if not layout.needs_verify():  # else the layout is final once verify_state() ran
        region.freeze()
    return result


def _load_rank(
    root: Path | str,
    engine: Mapping[str, str],
    model: Mapping[str, str],
    sizes: Sequence[int],
    modes: Sequence[str],
    rank: int,
    par: dict[str, int],
    flags: Mapping[str, Any] | None,
    native: bool,
    setup_tensors: Mapping[str, torch.Tensor] | None,
) -> LoadResult:
    """This rank's LOAD: validate, restore memory, load images, rebuild and instantiate its graphs."""
    t0 = time.perf_counter()
    archive = open_archive(root)
    t_open = time.perf_counter()
    info = region.info()
    live = collect_live(
        device=torch.cuda.current_device(),
        engine=dict(engine),
        model=dict(model),
        capture={"sizes": sorted(set(sizes)), "modes": sorted(set(modes))},
        parallel=par,
        flags=dict(flags or {}),
        region={"base": info.base, "size": info.size},
    )
    t_facts = time.perf_counter()
    check_or_refuse(archive, live, rank)
    rec = archive.rank_facts(rank)
    # Graph files are checked before anything is mapped or loaded.
    descs = {}
    for g in rec.graphs:
        desc = archive.read_json(rank, f"graphs/{g.name}.json")
        blob = archive.read(rank, f"graphs/{g.name}.bin")
        table = archive.read(rank, f"graphs/{g.name}.knodes")
        graphformat.verify_blob(g.name, desc, blob)
        graphformat.check_events(g.name, desc)
        if graphformat.topology_fingerprint(desc) != g.topology_fingerprint:
            raise PersistError(f"graph {g.name!r}: description does not match its recorded topology fingerprint")
        descs[g.name] = (desc, blob, table)
    pointers = archive.read_json(rank, "pointers.json")
    if hashlib.sha256(json.dumps(pointers).encode()).hexdigest() != rec.pointers.fingerprint:
        raise PersistError("pointer inventory does not match its recorded fingerprint")
    setup.check_setup_tensors(archive.read_json(rank, "setup_tensors.json"), setup_tensors)
    t_validate = time.perf_counter()

    skipped, pending = _restore_memory(archive, rank, pointers)
    t_memory = time.perf_counter()

    loaded = images.LoadedImages()
    for im in rec.images:
        loaded.load(im.sha256, im.kind, archive.read_path(im.file))
    resolved = {name: [loaded.function(sha, kname, fattrs) for sha, kname, fattrs in d[0]["funcs"]]
                for name, d in descs.items()}  # fmt: skip
    t_images = time.perf_counter()

    tensors = archive.read_json(rank, "tensors.json")
    out: dict[str, LoadedGraph] = {}
    for name, (desc, blob, table) in descs.items():
        a = time.perf_counter()
        events = graphbuild.create_events(name, desc)
        if native:
            g = graphbuild.rebuild_native(name, desc, blob, table, resolved[name], events)
        else:  # reference path: one cuda-bindings call per node (about 5x slower)
            g = graphbuild.rebuild(name, desc, blob, loaded.function, events)
        b = time.perf_counter()
        ex = graphbuild.instantiate(name, g)
        c = time.perf_counter()
        out[name] = LoadedGraph(
            name,
            ex,
            g,
            [tensor_at(s) for s in tensors[name]["inputs"]],
            [tensor_at(s) for s in tensors[name]["outputs"]],
            len(desc["nodes"]),
            b - a,
            c - b,
            events,
        )
    t_end = time.perf_counter()
    layout.set_pending(pending)
    return LoadResult(
        out,
        {
            "open_archive_s": t_open - t0,
            "collect_live_s": t_facts - t_open,
            "validate_s": t_validate - t0,
            "memory_s": t_memory - t_validate,
            "images_s": t_images - t_memory,
            "graphs_s": t_end - t_images,
            "total_s": t_end - t0,
        },
        skipped,
        [p.name for p in pending.saved if p.post_capture] if pending else [],
    )
