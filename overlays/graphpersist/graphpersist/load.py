"""LOAD: validate an archive against this process, restore memory and images, rebuild the graphs.

Process B (LOAD) runs the same setup code as SAVE, so every setup allocation lands at the same address, then
load() validates the archive, recreates the memory the graphs reference beyond the setup, loads the kernel
images and rebuilds the graphs. No warm-up and no capture happen in B.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphpersist import loadstage, ranks
from graphpersist.archive import Archive, ArchiveError, open_archive
from graphpersist.archive.liveenv import collect_live
from graphpersist.archive.validate import LoadRefused, check_or_refuse, evaluate
from graphpersist.collective import collective, parallel_layout
from graphpersist.errors import PersistError
from graphpersist.gcpause import paused_gc
from graphpersist.graph import build as graphbuild
from graphpersist.graph import images, structure
from graphpersist.graph.graphset import GraphSet
from graphpersist.loadahead import ReadAhead
from graphpersist.loadplan import LoadPlan
from graphpersist.memory import hostmem, layout, phases, region, setup
from graphpersist.memory.tensors import tensor_at
from graphpersist.records import Facts

Opened = Callable[[], Archive]  # the archive of a LOAD: read ahead (graphpersist.loadahead) or opened now


@dataclass
class LoadedGraph:
    """A rebuilt graph, replayable like torch.cuda.CUDAGraph, with its static tensors at the saved addresses.

    `outputs` has the structure the captured function returned at SAVE (tensor, tuple, list, dict, dataclass,
    None and plain values; see graphpersist.graph.structure), with each tensor at its saved address. `events[i]` is the
    live CUevent (cuda-bindings) standing for event index i of the saved graph (distinct events numbered in order
    of first appearance at SAVE). The graph's event record/wait nodes use these fresh events, not the ones
    captured in the SAVE process: an engine that records or waits on those events outside the graph must use
    these (e.g. `cuEventRecord(lg.events[i], stream)` before replay, `cuStreamWaitEvent` after). They are created
    with CU_EVENT_DISABLE_TIMING and live as long as this object.

    The graph, its executable and its events are released by close() or when the object is collected
    (cuGraphExecDestroy, cuGraphDestroy, cuEventDestroy), once; replay() after close() refuses.
    """

    name: str
    exec: Any
    graph: Any
    inputs: list[torch.Tensor]
    outputs: Any
    node_count: int
    rebuild_s: float
    instantiate_s: float
    events: list[Any] = field(default_factory=list)
    _release: weakref.finalize = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._release = weakref.finalize(self, _destroy, self.name, self.exec, self.graph, list(self.events))
        self._release.atexit = False  # at exit the driver frees everything; its teardown order is not ours

    @property
    def closed(self) -> bool:
        return not self._release.alive

    def close(self) -> None:
        """Destroys the executable, the graph and the events now; later calls do nothing."""
        self._release()

    def replay(self) -> None:
        from cuda.bindings import driver as drv

        if self.closed:
            raise PersistError(f"graph {self.name!r} was closed: it cannot be replayed")
        if layout.needs_verify():  # post-capture memory and declared state are proven before the first replay
            layout.verify_state()
        images.check(drv.cuGraphLaunch(self.exec, torch.cuda.current_stream().cuda_stream), f"replay {self.name}")


def _destroy(name: str, exec_: Any, graph: Any, events: list[Any]) -> None:
    """Releases what a LoadedGraph owns (executable first: it refers to the graph's nodes and the events)."""
    from cuda.bindings import driver as drv

    images.check(drv.cuGraphExecDestroy(exec_), f"graph {name!r}: cuGraphExecDestroy")
    images.check(drv.cuGraphDestroy(graph), f"graph {name!r}: cuGraphDestroy")
    for i, ev in enumerate(events):
        images.check(drv.cuEventDestroy(ev), f"graph {name!r}: cuEventDestroy(event {i})")


@dataclass
class LoadResult:
    """The loaded graphs of this rank, by name in capture order, and the time of each LOAD phase.

    `res["b8"]` and `res.get("b8")` raise a KeyError listing the closest names for an unknown name
    (`res.get(name, default)` returns the default instead); iteration yields the names in capture order.
    `skipped_phases`: SAVE's skip_on_load phases this LOAD did not run (their memory was mapped from the
    archive); `post_capture_phases`: phases the engine must now re-run before the first replay (then
    verify_state(), or the replay itself, checks them and the declared state). `notes`: the engine's own
    bookkeeping SAVE stored for this rank (`Saver.save(notes=...)`).
    """

    graphs: GraphSet[LoadedGraph]
    timings: dict[str, float]
    skipped_phases: list[str] = field(default_factory=list)
    post_capture_phases: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> LoadedGraph:
        return self.graphs[name]

    def get(self, name: str, *default: Any) -> Any:
        if name in self.graphs or not default:
            return self.graphs[name]
        return default[0]

    def __contains__(self, name: object) -> bool:
        return name in self.graphs

    def __iter__(self) -> Iterator[str]:
        return iter(self.graphs)

    def __len__(self) -> int:
        return len(self.graphs)

    def close(self) -> None:
        """Releases every loaded graph (see LoadedGraph.close)."""
        for g in self.graphs.values():
            g.close()


def _restore_memory(archive: Any, plan: LoadPlan) -> tuple[list[str], layout.Pending | None]:
    """Proves setup matches SAVE phase by phase, maps what capture and skipped phases left live at SAVE, and
    checks every graph address lies in memory at its saved address with its saved size. Addresses in memory of
    post-capture phases (re-run by the engine after load()) are checked when those phases end. Returns the
    skipped phases and the checks still pending."""
    rec, pointers = plan.record, plan.pointers
    info = region.info()
    if info.base != rec.region.base:
        raise PersistError(f"region base: saved {rec.region.base:#x}, live {info.base:#x}")
    saved, saved_evs = plan.phases, plan.events
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
        hostmem.check_load(rec.extra.host_memory)
    except (phases.PhaseError, region.RegionError) as exc:
        raise PersistError(f"{exc}: LOAD refused") from None
    layout.recorder().adopt(saved, saved_evs)
    states = plan.states
    pending = layout.Pending(archive, plan.rank, saved, saved_evs, later, states) if post or states else None
    return skipped, pending


def check_before_setup(archive_dir: Path | str, facts: Facts, rank: int) -> Archive:
    """LOAD, before the engine sets anything up: opens the archive (load() verifies its checksums later) and
    refuses, naming each field with its saved and live value, what the facts known this early (the engine's `facts`
    and the process's GPU, versions and environment) already contradict; facts not known yet are skipped. Returns
    the archive for the engine's own early reads."""
    live = collect_live(
        device=torch.cuda.current_device(),
        engine=dict(facts.engine),
        model=dict(facts.model),
        parallel=dict(facts.parallel or {}),
        flags=dict(facts.flags or {}),
    )
    try:
        archive = open_archive(archive_dir, verify_checksums=False)
    except ArchiveError as exc:
        raise PersistError(f"graphpersist: cannot LOAD {archive_dir}: {exc}") from None
    result = evaluate(archive, live, rank, skip_unknown=True)
    if result.mismatches:
        raise LoadRefused(archive_dir, result.mismatches, rank)
    return archive


def load(
    archive_dir: Path | str,
    facts: Facts,
    *,
    sizes: Sequence[int],
    modes: Sequence[str] = (),
    rank: int = 0,
    setup_tensors: Mapping[str, torch.Tensor] | None = None,
    gather: ranks.Gather | None = None,
    output_types: Mapping[str, type] | None = None,
    ahead: ReadAhead | None = None,
) -> LoadResult:
    """Validates the archive against this process, restores memory, images and graphs. Raises before replay.

    `facts` (engine, model, parallel layout, flags) and the captured `sizes` and `modes` are compared with the
    archive's, beside what LOAD reads of the process itself. With `facts.parallel["world_size"] > 1` every rank
    calls it: a rank that refuses makes all of them raise (a PersistError naming each failing rank), so no rank goes
    on to replay collectives its peers never join.

    Every graph's node counts are checked against its record and kernel table (`graphpersist check` also parses
    every kernel node and recomputes each graph's topology fingerprint, which costs about as much as the rest of
    LOAD for engine-sized archives: recipes/runtime-scale). `output_types` (id -> dataclass) is the live engine's
    registry, the only place an output dataclass the archive names by id is looked up (Saver's, at SAVE); an id it
    lacks refuses the LOAD. `ahead` (graphpersist.loadahead): the archive as a thread already read it, used where it
    is this folder's and rank's and still the archive in the folder.
    """
    par = parallel_layout(facts.parallel)
    coll = collective(par, rank, gather)
    try:
        with paused_gc():  # see graphpersist.gcpause: LOAD makes many small objects and no cycles
            result = _load_rank(
                archive_dir,
                facts,
                sizes,
                modes,
                rank,
                par,
                setup_tensors,
                output_types or {},
                ahead,
            )
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
    archive_dir: Path | str,
    facts: Facts,
    sizes: Sequence[int],
    modes: Sequence[str],
    rank: int,
    par: dict[str, int],
    setup_tensors: Mapping[str, torch.Tensor] | None,
    output_types: Mapping[str, type],
    ahead: ReadAhead | None,
) -> LoadResult:
    """This rank's LOAD: validate, restore memory, load images, rebuild and instantiate its graphs."""
    t0 = time.perf_counter()
    read = ahead.archive_for(archive_dir, rank) if ahead is not None else None
    opened = (lambda: read) if read is not None else functools.partial(open_archive, archive_dir, keep_rank=rank)
    archive, t_open, t_facts = _open_checked(opened, facts, sizes, modes, rank, par)
    # LOAD's CPU stage (the one `graphpersist check` runs): everything LOAD takes from the archive is read and
    # checked before anything is mapped or loaded; the native path never looks at kernel nodes' JSON.
    plan = ahead.plan() if read is not None else loadstage.rank_stage(archive, rank)  # ArchiveError naming the field
    setup.check_setup_tensors(plan.setup_tensors, setup_tensors)
    setup.check_pointer_blocks(plan.torch_blocks)
    t_validate = time.perf_counter()

    skipped, pending = _restore_memory(archive, plan)
    t_memory = time.perf_counter()

    resolved = _live_functions(archive, plan)
    t_images = time.perf_counter()

    out, spent = _restore_graphs(plan, resolved, output_types)
    t_end = time.perf_counter()
    layout.set_pending(pending)
    return LoadResult(
        out,
        {
            "open_archive_s": t_open - t0,
            "read_ahead_s": ahead.seconds if read is not None and ahead.seconds is not None else 0.0,
            "collect_live_s": t_facts - t_open,
            "validate_s": t_validate - t0,
            "memory_s": t_memory - t_validate,
            "images_s": t_images - t_memory,
            **spent,
            "graphs_s": t_end - t_images,
            "total_s": t_end - t0,
        },
        skipped,
        [p.name for p in pending.saved if p.post_capture] if pending else [],
        plan.notes,
    )


def _open_checked(
    opened: Opened, facts: Facts, sizes: Sequence[int], modes: Sequence[str], rank: int, par: dict[str, int]
) -> tuple[Archive, float, float]:
    """The archive `opened` for `rank`, its facts checked against the live ones (LoadRefused naming each that
    differs); with the times the open and the live facts were done."""
    info = region.info()
    # The live facts (nvidia-smi runs as a subprocess: tens of ms) are collected while the archive is read.
    with ThreadPoolExecutor(max_workers=1) as pool:
        live_job = pool.submit(
            collect_live,
            device=torch.cuda.current_device(),
            engine=dict(facts.engine),
            model=dict(facts.model),
            capture={"sizes": sorted(set(sizes)), "modes": sorted(set(modes))},
            parallel=par,
            flags=dict(facts.flags or {}),
            region={"base": info.base, "size": info.size},
        )
        archive = opened()
        t_open = time.perf_counter()
        live = live_job.result()
    t_facts = time.perf_counter()  # collect_live_s: what it took beyond the open it overlapped
    check_or_refuse(archive, live, rank)
    return archive, t_open, t_facts


def _live_functions(archive: Archive, plan: LoadPlan) -> dict[str, graphbuild.LiveFuncs]:
    """The rank's kernel images loaded, and each graph's live functions (handle and parameter layout), packed once
    per graph shape (its graphs share one list)."""
    loaded = images.LoadedImages()
    for im in plan.record.images:  # open_archive checked each image file's sha256 against the image's
        loaded.load(im.sha256, im.kind, archive.read_path(im.file), verified=True)
    by_shape: dict[int, graphbuild.LiveFuncs] = {}
    resolved = {}
    for name, d in plan.graphs.items():
        funcs = d[0]["funcs"]
        if id(funcs) not in by_shape:
            by_shape[id(funcs)] = graphbuild.LiveFuncs.of(loaded, funcs)
        resolved[name] = by_shape[id(funcs)]
    return resolved


def _restore_graphs(
    plan: LoadPlan, resolved: dict[str, graphbuild.LiveFuncs], output_types: Mapping[str, type]
) -> tuple[GraphSet[LoadedGraph], dict[str, float]]:
    """Every graph rebuilt, instantiated and uploaded, with its static tensors at their saved addresses; and the
    seconds rebuilding, instantiating and uploading took in all."""
    views: dict[tuple[Any, ...], torch.Tensor] = {}  # graphs sharing a static buffer share its tensor, as at SAVE

    def view(spec: Mapping[str, Any]) -> torch.Tensor:
        key = (spec["addr"], spec["dtype"], tuple(spec["shape"]), tuple(spec["stride"]))
        t = views.get(key)
        if t is None:
            t = views[key] = tensor_at(spec)
        return t

    out: GraphSet[LoadedGraph] = GraphSet()
    rebuild_s = instantiate_s = upload_s = 0.0
    exec_flags = {g.name: g.instantiate_flags for g in plan.record.graphs}
    stream = torch.cuda.current_stream().cuda_stream
    for name, (desc, blob, table, entry) in plan.graphs.items():
        try:
            outputs = structure.decode(entry.outputs, view, f"graph {name!r} outputs", output_types)
        except structure.StructureError as exc:
            raise PersistError(str(exc)) from None
        inputs = [view(s) for s in entry.inputs]
        a = time.perf_counter()
        events = graphbuild.create_events(name, desc)
        g = graphbuild.rebuild_native(name, desc, blob, table, resolved[name], events, hashed=True)
        b = time.perf_counter()
        ex = graphbuild.instantiate(name, g, exec_flags[name])
        c = time.perf_counter()
        graphbuild.upload(name, ex, stream)
        rebuild_s += b - a
        instantiate_s += c - b
        upload_s += time.perf_counter() - c
        out.add(name, LoadedGraph(name, ex, g, inputs, outputs, len(desc["nodes"]), b - a, c - b, events))
    return out, {"rebuild_s": rebuild_s, "instantiate_s": instantiate_s, "upload_s": upload_s}
