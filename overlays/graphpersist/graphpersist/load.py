"""LOAD: validate an archive against this process, restore memory and images, rebuild the graphs.

Process B (LOAD) runs the same setup code as SAVE, so every setup allocation lands at the same address, then
load() validates the archive, recreates the memory the graphs reference beyond the setup, loads the kernel
images and rebuilds the graphs. No warm-up and no capture happen in B.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphpersist import graphbuild, graphformat, images, ranks, region, setup
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

        images.check(drv.cuGraphLaunch(self.exec, torch.cuda.current_stream().cuda_stream), f"replay {self.name}")


@dataclass
class LoadResult:
    graphs: dict[str, LoadedGraph]
    timings: dict[str, float]


def _check_memory(archive: Any, rank: int) -> tuple[list[tuple[int, int]], int]:
    """Setup prefix must match exactly; then map every capture-time allocation live at SAVE. Returns ranges."""
    rec = archive.rank_facts(rank)
    saved = archive.read_json(rank, "alloc_log.json")
    setup_n = rec.extra["setup_events"]
    info = region.info()
    if info.base != rec.region.base:
        raise PersistError(f"region base: saved {rec.region.base:#x}, live {info.base:#x}")
    saved_evs = [region.Event(i, k, a, s, r) for i, (k, a, s, r) in enumerate(saved)]
    live_evs = region.events()
    try:
        to_map = region.plan_restore(saved_evs, setup_n, live_evs)
        region.restore(to_map, len(live_evs), rec.region.final_offset)
    except region.RegionError as exc:
        raise PersistError(str(exc)) from None
    return region.live_ranges(region.events()), setup_n


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

    ranges, _ = _check_memory(archive, rank)
    starts = [a for a, _ in ranges]
    for p in pointers:
        i = bisect.bisect_right(starts, p) - 1
        if i < 0 or p >= ranges[i][0] + ranges[i][1]:
            raise PersistError(f"graph address {p:#x} is not backed by memory after LOAD's mapping")
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
    )
