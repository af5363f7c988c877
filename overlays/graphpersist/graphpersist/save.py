"""SAVE: graphs captured with keep_graph=True, registered with their static tensors, written to one archive.

Process A (SAVE) runs under the interposer, builds its model, calls mark_setup(), warms up and captures with
PersistentCUDAGraph (or torch.cuda.CUDAGraph(keep_graph=True)), registers the graphs on a Saver and saves.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphpersist import ranks
from graphpersist.archive import ArchiveWriter, archive_path, world
from graphpersist.archive.liveenv import collect_live, world_facts
from graphpersist.collective import collective, parallel_layout, run_on_every_rank
from graphpersist.errors import PersistError
from graphpersist.gcpause import paused_gc
from graphpersist.graph import format as graphformat
from graphpersist.graph import images, structure
from graphpersist.graph import pack as graphpack
from graphpersist.graph import walk as graphwalk
from graphpersist.graph.graphset import DuplicateGraph, GraphSet
from graphpersist.memory import hostmem, layout, phases, region, setup, state
from graphpersist.memory.tensors import tensor_spec
from graphpersist.records import Facts, HostMemory


def _listed(evs: Sequence[region.Event]) -> str:
    """The first five events of a refusal, described."""
    return "; ".join(e.describe() for e in evs[:5]) + (" ..." if len(evs) > 5 else "")


class PersistentCUDAGraph(torch.cuda.CUDAGraph):
    """torch.cuda.CUDAGraph that keeps its cudaGraph_t so it can be saved; use with torch.cuda.graph(g)."""

    def __new__(cls, keep_graph: bool = True) -> PersistentCUDAGraph:
        return super().__new__(cls, True)

    def __init__(self, keep_graph: bool = True) -> None:
        super().__init__(True)  # the pybind constructor reads keep_graph again

    def persist(
        self, saver: Saver, name: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], **kw: Any
    ) -> None:
        saver.add(name, self, inputs, outputs, **kw)


Shared = Mapping[str, bytes] | Callable[[], Mapping[str, bytes]]


@dataclass
class _Entry:
    graph: Any
    inputs: list[torch.Tensor]
    outputs: dict[str, Any]  # structure.encode() tree: the output structure with a tensor spec at each leaf
    output_tensors: list[torch.Tensor]
    capture_size: int | None
    mode: str | None
    capture_s: float | None


def _instantiate_flags(drv: Any, name: str, graph: Any) -> int:
    """The flags torch instantiated `graph` with, which LOAD repeats (graphformat.INSTANTIATE_FLAGS).

    A graph nobody has replayed or instantiated yet is instantiated here, as its first replay would do.
    """
    if not hasattr(graph, "raw_cuda_graph_exec"):
        raise PersistError(f"graph {name!r}: this torch's CUDAGraph has no raw_cuda_graph_exec(), so SAVE cannot read "
                           "how it instantiates graphs; use the pinned torch. SAVE refused")  # fmt: skip
    try:
        raw = graph.raw_cuda_graph_exec()
    except RuntimeError:  # "until instantiate() has been called"
        graph.instantiate()
        raw = graph.raw_cuda_graph_exec()
    flags = int(images.check(drv.cuGraphExecGetFlags(drv.CUgraphExec(raw)), f"graph {name!r}: cuGraphExecGetFlags"))
    try:
        graphformat.check_instantiate_flags(name, flags)
    except graphformat.GraphFormatError as exc:
        raise PersistError(f"{exc}: SAVE refused") from None
    return flags


@dataclass
class _Prepared:
    """One rank's SAVE once every refusal has passed: what `_write` puts into the archive."""

    t0: float  # when the preparation began (after the device synchronised)
    serialize_s: float
    info: region.RegionInfo
    evs: list[region.Event]  # the region's allocation events
    saved: dict[str, graphwalk.SavedGraph]  # every graph, serialized
    used: dict[str, tuple[region.ImageLoad, set[str]]]  # kernel image sha256 -> (its load, the entries graphs use)
    exec_flags: dict[str, int]  # each graph's instantiate flags
    pointers: list[int]  # every graph address, sorted
    inv_fp: str  # their fingerprint
    world: dict[str, Any]  # the facts every rank must agree on
    mark: setup.SetupMark
    phases: list[phases.Phase]
    states: list[tuple[state.StateRecord, bytes]]  # declared state and its bytes
    numbers: set[int]  # kernel-parameter words that lie in the region but are numbers (setup.param_values)
    pointer_phases: dict[str, int]  # graph addresses per phase that made their memory
    variable_pointers: list[list[int]]  # the first 64 in variable phases LOAD runs again
    torch_blocks: list[tuple[int, int]]  # setup.pointer_blocks
    host_memory: dict[str, Any]  # hostmem.record: the pinned host allocations graphs read
    zeroed: dict[str, list[tuple[int, int]]]  # kernel -> the parameter bytes the engine named unread, written as zeros


@dataclass
class Saver:
    """Collects captured graphs with their static tensors, then writes one archive.

    `unused_param_bytes(kernel name, parameter layout)` may name byte ranges [start, end) of a kernel's parameters
    that the kernel never reads, e.g. the peer slots of a fixed-size array beyond the world size, which the host
    leaves uninitialised: SAVE writes them as zeros, so two SAVEs write the same bytes and stray host memory is
    never mistaken for an address. The engine knows its kernels; the runtime only zeroes what it is told.

    `output_types` (id -> dataclass) is the engine's registry of the dataclasses its graphs may return: an output
    dataclass is stored by its id there, and one the registry lacks refuses the SAVE (graph.structure: an archive is
    data, never code, so LOAD finds the class again only in its own registry)."""

    entries: GraphSet[_Entry] = field(default_factory=GraphSet)
    unused_param_bytes: graphwalk.UnusedBytes | None = None
    output_types: Mapping[str, type] = field(default_factory=dict)

    def add(
        self,
        name: str,
        graph: Any,
        inputs: Sequence[torch.Tensor],
        outputs: Any,
        *,
        capture_size: int | None = None,
        mode: str | None = None,
        capture_s: float | None = None,
    ) -> None:
        if not hasattr(graph, "raw_cuda_graph"):
            raise PersistError(f"graph {name!r}: needs a torch CUDAGraph captured with keep_graph=True")
        tensors: list[torch.Tensor] = []

        def leaf(x: Any) -> dict[str, Any] | None:
            if not isinstance(x, torch.Tensor):
                return None
            tensors.append(x)
            return tensor_spec(x)

        try:
            tree = structure.encode(outputs, leaf, f"graph {name!r} outputs", self.output_types)
            self.entries.add(name, _Entry(graph, list(inputs), tree, tensors, capture_size, mode, capture_s))
        except (structure.StructureError, DuplicateGraph) as exc:
            raise PersistError(f"{exc}: SAVE refused") from None

    def save(
        self,
        archive_dir: Path | str,
        facts: Facts,
        *,
        rank: int = 0,
        overwrite: bool = False,
        gather: ranks.Gather | None = None,
        notes: Mapping[str, Any] | None = None,
        shared: Shared | None = None,
        before_write: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Serializes every graph; returns a summary (fingerprints, timings). Fails naming unsupported nodes.

        `facts` (engine, model, parallel layout, flags) become the archive's world facts with what SAVE reads of the
        process itself.

        `notes` is this rank's free-form engine bookkeeping (JSON), stored in its rank record and handed back
        by LOAD as `LoadResult.notes`; it is never compared as a fact.

        `shared` are files for the top of the archive (name -> bytes; read back with archive.read_shared), given
        by rank 0 only. A function returning them is called once every rank has prepared its part (their compiles
        are done, e.g. for the JIT caches), and its failure refuses the SAVE on every rank.

        `before_write` is work every rank runs once every rank has prepared its part, so after what the archive
        holds (allocation log, graphs, pointer inventory, declared state) is fixed and before any file is written or
        `shared` is called: what it allocates, maps or compiles leaves no trace in the archive except through
        `shared` (an engine's first-request kernel warm-up, whose compiles the JIT caches then carry). The ranks
        agree on it like on their preparation: its failure on any rank refuses the SAVE on every rank.

        With `facts.parallel["world_size"] > 1` every rank calls this (collectively, like a torch.distributed call):
        the ranks agree that all succeeded and describe one world, rank 0 stages the archive, each rank writes
        its `rank_<r>/` part, and rank 0 publishes it once all parts are there. Any rank's refusal refuses all.
        """
        par = parallel_layout(facts.parallel)
        coll = collective(par, rank, gather)
        prep, error = None, None
        try:
            with paused_gc():  # as LOAD (graphpersist.gcpause): serializing makes many small objects and no cycles
                prep = self._prepare(facts, par)
        except Exception as exc:
            if coll.world_size == 1:
                raise  # one rank: the refusal as it is, nobody to tell
            error = f"{type(exc).__name__}: {exc}"
        try:
            coll.check(error, "SAVE")
            assert prep is not None
            if before_write is not None:
                run_on_every_rank(coll, before_write, "SAVE")
            coll.same_world(prep.world, "SAVE")
            w = coll.writer(archive_dir, prep.world, overwrite=overwrite)
        except ranks.RanksRefused as exc:
            raise PersistError(str(exc)) from None
        t_shared = time.perf_counter()
        t_write = t_shared
        try:
            if shared is not None:  # before this rank's record: rank 0's record commits to the shared files
                w.add_shared(shared() if callable(shared) else shared)
            t_write = time.perf_counter()
            with paused_gc():
                summary = self._write(w, rank, prep, dict(notes or {}))
        except Exception as exc:  # every rank must hear about it before rank 0 publishes
            if coll.world_size == 1:
                w.abort()
                raise
            error = f"{type(exc).__name__}: {exc}"
        t_commit = time.perf_counter()
        try:
            coll.commit(w, error)
        except ranks.RanksRefused as exc:
            raise PersistError(str(exc)) from None
        region.freeze()
        end = time.perf_counter()
        summary["total_s"] = end - prep.t0
        # where SAVE's time went (before_write's own work included in the part before writing)
        summary["split_s"] = {"prepare": t_shared - prep.t0, "shared": t_write - t_shared,
                              "write": t_commit - t_write, "commit": end - t_commit}  # fmt: skip
        return summary

    def _prepare(self, facts: Facts, par: dict[str, int]) -> _Prepared:
        """This rank's part of SAVE up to writing: every refusal happens here, before any file exists."""
        mark = setup.current()
        if mark is None:
            raise PersistError("call graphpersist.api.mark_setup() after the model setup and before warm-up/capture")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        info = region.info()
        if not info.base:
            raise PersistError("no region: the interposer is not active (GP_REGION_BASE unset?)")
        layout.close_open()  # a post-capture phase still open ends here
        info = region.info()
        evs = region.events()
        rec_phases = list(layout.recorder().phases)
        _refuse_unplaced(evs, mark, rec_phases, par)
        live_mem = region.live_ranges(evs)
        table = images.ImageTable.current()
        unused = graphwalk.cached_unused(self.unused_param_bytes)
        host_mem = hostmem.for_save(mark.host_events)
        saved, exec_flags, in_region_numbers = self._serialize(info, table, live_mem, unused, host_mem)
        serialize_s = time.perf_counter() - t0

        sizes = sorted({e.capture_size for e in self.entries.values() if e.capture_size is not None})
        modes = sorted({e.mode for e in self.entries.values() if e.mode})
        live = collect_live(
            device=torch.cuda.current_device(),
            engine=dict(facts.engine),
            model=dict(facts.model),
            capture={"sizes": sizes, "modes": modes},
            parallel=par,
            flags=dict(facts.flags or {}),
        )
        used = _used_images(saved, table)
        pointers = sorted(set().union(*(sg.pointers for sg in saved.values())))
        inv_fp = hashlib.sha256(json.dumps(pointers).encode()).hexdigest()
        blocks = setup.pointer_blocks(pointers)
        by_phase, risky = phases.pointer_phases(pointers, rec_phases, evs, live_mem)
        if risky:
            shown = ", ".join(f"{a:#x} ({n})" for a, n in risky[:8])
            print(f"graphpersist: WARNING: {len(risky)} graph address(es) lie in memory a variable phase made, which "
                  f"LOAD runs again and can check only by extent, not by what it holds: {shown}",
                  file=sys.stderr, flush=True)  # fmt: skip
        states = _states_in_place(live_mem)
        return _Prepared(
            t0=t0, serialize_s=serialize_s, info=info, evs=evs, saved=saved, used=used, exec_flags=exec_flags,
            pointers=pointers, inv_fp=inv_fp, world=world_facts(live), mark=mark, phases=rec_phases,
            states=states, numbers=in_region_numbers, pointer_phases=by_phase,
            variable_pointers=[[a, n] for a, n in risky[:64]], torch_blocks=blocks,
            host_memory=hostmem.record(set().union(*(sg.host for sg in saved.values())), host_mem),
            zeroed=unused.named if unused is not None else {},
        )  # fmt: skip

    def _serialize(
        self,
        info: region.RegionInfo,
        table: images.ImageTable,
        live_mem: list[tuple[int, int]],
        unused: graphwalk.CachedUnused | None,
        host_mem: HostMemory,
    ) -> tuple[dict[str, graphwalk.SavedGraph], dict[str, int], set[int]]:
        """Every graph walked (graphwalk.serialize) with its instantiate flags, its static tensors in the region and
        its addresses owned by live region memory; returns them and the parameter words that are numbers."""
        from cuda.bindings import driver as drv

        lo, hi = info.base, info.base + info.size
        saved: dict[str, graphwalk.SavedGraph] = {}
        exec_flags: dict[str, int] = {}
        in_region_numbers: set[int] = set()
        for name, e in self.entries.items():
            g = drv.CUgraph(e.graph.raw_cuda_graph())
            try:
                saved[name] = graphwalk.serialize(g, table, lo, hi, unused, host_mem)
            except (graphformat.GraphFormatError, images.ImageError) as exc:
                raise PersistError(f"graph {name!r}: {exc}") from None
            exec_flags[name] = _instantiate_flags(drv, name, e.graph)
            for t in (*e.inputs, *e.output_tensors):
                if not lo <= t.data_ptr() < hi:
                    raise PersistError(f"graph {name!r}: static tensor at {t.data_ptr():#x} lies outside the region")
            numbers = phases.param_values(saved[name].pointers, saved[name].addresses, live_mem)
            saved[name].pointers -= numbers
            in_region_numbers |= numbers
            setup.check_ownership(name, saved[name].pointers, live_mem)
        return saved, exec_flags, in_region_numbers

    def _write(self, w: ArchiveWriter, rank: int, prep: _Prepared, notes: dict[str, Any]) -> dict[str, Any]:
        """Writes this rank's files and rank record into the (shared) staging folder."""
        started = time.perf_counter()
        image_records = []
        for sha, (load, names) in sorted(prep.used.items()):
            rel = w.add_image(sha, load.data())  # once per archive, whichever ranks load it
            image_records.append(
                {"sha256": sha, "file": rel, "size": load.size, "kind": load.kind, "entries": sorted(names)}
            )
        t_images = time.perf_counter()
        graph_records, content_fps, pack = self._graph_records(rank, prep)
        t_records = time.perf_counter()
        w.add_json(rank, "alloc_log.json", [[ev.kind, ev.addr, ev.size, ev.req] for ev in prep.evs])
        w.add_json(rank, "pointers.json", prep.pointers)
        w.add_json(rank, "setup_tensors.json", prep.mark.tensors)
        for r, data in prep.states:
            if r.how == "bytes":
                w.add_file(rank, r.file, data)
        w.add_file(rank, graphpack.PACK_NAME, pack.data())
        w.add_json(rank, graphpack.INDEX_NAME, pack.index())
        w.set_rank_facts(rank, _rank_facts(rank, prep, graph_records, image_records, content_fps, notes))
        info, saved, used = prep.info, prep.saved, prep.used
        # the write's parts: kernel images (hashed, written), graph records and pack, the rank's other files
        end = time.perf_counter()
        split = {"images": t_images - started, "records": t_records - t_images, "files": end - t_records}
        return {
            "serialize_s": prep.serialize_s,
            "write_split_s": split,
            "final_offset": info.cursor,
            "pointer_fingerprint": prep.inv_fp,
            "pointers": len(prep.pointers),
            "in_region_numbers": len(prep.numbers),  # kernel-parameter words read as numbers (setup.param_values)
            "pointer_phases": prep.pointer_phases,
            "torch_blocks": len(prep.torch_blocks),
            "host_memory": prep.host_memory,
            "images": len(used),
            "zeroed_params": prep.zeroed,
            "image_bytes": sum(ld.size for ld, _ in used.values()),
            "nodes": {n: len(sg.desc["nodes"]) for n, sg in saved.items()},
            "phases": [(p.name, p.start, p.end, p.limit) for p in prep.phases],
            "state": [r.name for r, _ in prep.states],
        }

    def _graph_records(
        self, rank: int, prep: _Prepared
    ) -> tuple[list[dict[str, Any]], dict[str, str], graphpack.PackWriter]:
        """Each graph's record (rank.json's `graphs`) and address fingerprint, and the rank's graph pack."""
        lo, hi = prep.info.base, prep.info.base + prep.info.size
        graph_records = []
        content_fps = {}
        pack = graphpack.PackWriter()
        index_rel = archive_path(rank, graphpack.INDEX_NAME)  # every graph record names the index
        for name, sg in prep.saved.items():
            e = self.entries[name]
            pack.add(name, sg.desc, sg.blob, sg.table, inputs=[tensor_spec(t) for t in e.inputs], outputs=e.outputs)
            by_type = graphformat.node_types(sg.desc)
            topology_fp = graphformat.topology_fingerprint(sg.desc)
            graph_records.append(
                {
                    "name": name,
                    "file": index_rel,
                    "topology_fingerprint": topology_fp,
                    "node_count": len(sg.desc["nodes"]),
                    "nodes_by_type": by_type,
                    "kernel_count": by_type.get("kernel", 0),
                    "images": sorted({nd["image"] for nd in sg.desc["nodes"] if nd["type"] == "kernel"}),
                    "capture_size": e.capture_size,
                    "mode": e.mode,
                    "instantiate_flags": prep.exec_flags[name],
                }
            )
            content_fps[name] = graphformat.address_fingerprint(sg.desc, sg.blob, lo, hi, topology_fp)
        return graph_records, content_fps, pack


def _refuse_unplaced(evs: list[region.Event], mark: setup.SetupMark, rec_phases: list[phases.Phase],
                     par: dict[str, int]) -> None:  # fmt: skip
    """Refuses an allocation log LOAD could not repeat: memory outside the region, mappings after setup outside a
    post-capture phase or after the post-capture phase began, mappings in phases LOAD skips, multicast at TP > 1."""
    bad = region.outside(evs)
    if bad:
        listed = _listed(bad)
        raise PersistError(
            f"{len(bad)} device allocation(s) bypassed or could not be placed in the fixed region, so a graph "
            f"could point at memory LOAD cannot recreate: {listed}. {region.last_error()} SAVE refused"
        )
    late = phases.late_mappings(evs, mark.events, rec_phases)
    if late:
        listed = _listed(late)
        raise PersistError(
            f"{len(late)} reservation/mapping event(s) after mark_setup() outside a post-capture phase: "
            f"{listed}. LOAD recreates only allocations made after setup, so connect every peer before "
            "mark_setup() (NCCL_RUNTIME_CONNECT=0, symmetric-memory rendezvous and cuIpcOpenMemHandle in setup), "
            "or open IPC handles after capture inside a declared phase (api.phase('post_capture')) that LOAD "
            "re-runs. SAVE refused"
        )
    after = phases.after_post_problems(rec_phases, evs)
    if after:
        listed = _listed(after)
        raise PersistError(
            f"{len(after)} allocation event(s) after the post-capture phase began, outside any phase: {listed}. "
            "LOAD maps capture-time memory before the engine re-runs its post-capture phases, so it would sit "
            "where they allocate again: allocate it before the post-capture phase or inside it. SAVE refused"
        )
    skip_bad = phases.skip_problems(rec_phases, evs)
    if skip_bad:
        raise PersistError(
            f"skip_on_load phases made mappings LOAD cannot recreate from the archive: {'; '.join(skip_bad[:5])}. "
            "Open IPC handles and reserve address space in phases LOAD runs. SAVE refused"
        )
    if par["world_size"] > 1 and (wrong := region.multicast_problems(os.environ)):
        raise PersistError(
            f"NVLink multicast must be off for multi-rank graphs (multicast objects are not placed in the "
            f"fixed region): {', '.join(wrong)}. SAVE refused"
        )


def _used_images(
    saved: dict[str, graphwalk.SavedGraph], table: images.ImageTable
) -> dict[str, tuple[region.ImageLoad, set[str]]]:
    """The kernel images the graphs launch, by sha256, with the entries they use; refuses a PTX image compiled with
    JIT options LOAD would not repeat."""
    used: dict[str, tuple[region.ImageLoad, set[str]]] = {}
    for gname, sg in saved.items():
        for nd in sg.desc["nodes"]:
            if nd["type"] == "kernel":
                load = table.by_sha[nd["image"]]
                if load.format == "ptx" and load.n_jit:
                    raise PersistError(
                        f"graph {gname!r}: kernel {nd['name']!r} comes from PTX compiled with {load.n_jit} JIT "
                        "option(s) at load time; LOAD would compile it without them: SAVE refused"
                    )
                used.setdefault(nd["image"], (load, set()))[1].add(nd["name"])
    return used


def _states_in_place(live_mem: list[tuple[int, int]]) -> list[tuple[state.StateRecord, bytes]]:
    """The declared state and its bytes (layout.records_for_save), each inside one live region allocation, where
    LOAD can put it back."""
    states = layout.records_for_save()
    for r, _ in states:
        rng = phases.find_range(live_mem, r.addr)
        if rng is None or r.addr + r.nbytes > rng[0] + rng[1]:
            raise PersistError(f"state {r.name!r} at {r.addr:#x}+{r.nbytes} is not inside one live region "
                               "allocation (LOAD could not put it back at its address): SAVE refused")  # fmt: skip
    return states


def _rank_facts(rank: int, prep: _Prepared, graph_records: list[dict[str, Any]], image_records: list[dict[str, Any]],
                content_fps: dict[str, str], notes: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """This rank's record (rank.json) as the writer takes it."""
    info, mark = prep.info, prep.mark
    return {
        "rank": rank,
        "device": world.rank_device_facts(torch.cuda.current_device()),
        "region": {"base": info.base, "size": info.size, "final_offset": info.cursor},
        "pointers": {"fingerprint": prep.inv_fp, "count": len(prep.pointers)},
        "graphs": graph_records,
        "images": image_records,
        "extra": {
            "setup_events": mark.events,
            "setup_cursor": mark.cursor,
            "address_fingerprints": content_fps,
            "granularity": info.granularity,
            "phases": [p.to_json() for p in prep.phases],
            "state": [r.to_json() for r, _ in prep.states],
            "engine_notes": notes,
            "pointer_phases": prep.pointer_phases,  # graph addresses per phase that made their memory
            "variable_pointers": prep.variable_pointers,  # the first 64 in variable phases LOAD runs
            "torch_blocks": [list(b) for b in prep.torch_blocks],  # setup.pointer_blocks
            # memory.hostmem: pinned host allocations graphs read; absent when they read none
            **({"host_memory": prep.host_memory} if prep.host_memory["ranges"] else {}),
        },
    }
