"""SAVE / LOAD of captured CUDA graphs across processes (single rank): the runtime's public surface.

Process A (SAVE) runs under the interposer (region.reexec_with_interposer or LD_PRELOAD), builds its model,
calls mark_setup(), warms up and captures with PersistentCUDAGraph (or torch.cuda.CUDAGraph(keep_graph=True)),
registers the graphs on a Saver with their static input/output tensors, and saves. Process B (LOAD) runs the
same setup code, so every setup allocation lands at the same address, then load() validates the archive,
recreates the memory the graphs reference beyond the setup, loads the kernel images and rebuilds the graphs.
No warm-up and no capture happen in B.

Caveat (by design for now): memory allocated after mark_setup() is recreated empty at LOAD. Graphs may use it
as scratch or outputs, and inputs the caller refills, but must not read values computed during A's warm-up.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphpersist import graphs, images, ranks, region, world
from graphpersist.archive import ArchiveWriter, open_archive
from graphpersist.liveenv import collect_live, world_facts
from graphpersist.validate import check_or_refuse

_setup_mark: tuple[int, int] | None = None
_setup_tensors: list[list[Any]] = []
_setup_torch: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])  # torch's segments, live blocks


class PersistError(RuntimeError):
    """SAVE or LOAD cannot proceed; the message names what differs or is unsupported."""


def start_region() -> region.RegionInfo:
    """Creates the CUDA context and the fixed region now (before any library allocates on its own)."""
    torch.cuda.init()
    torch.cuda.current_device()
    torch.empty(0, device="cuda")  # context is current on this thread
    return region.start()


def mark_setup(tensors: Mapping[str, torch.Tensor], *, allow_unnamed: bool = False) -> int:
    """Marks the end of deterministic setup (weights, static buffers): allocations after it are capture-time.

    `tensors` names the setup tensors the graphs use (parameters, buffers, KV cache, static inputs). Identical
    driver-level allocations do not prove identical tensors (torch's caching allocator sub-allocates segments),
    so LOAD compares each named tensor's address, dtype and shape too; an empty mapping is refused unless
    `allow_unnamed=True` says the setup has no torch tensors worth naming. It also records which parts of
    torch's segments hold live blocks now: SAVE refuses graph addresses in the rest (see Saver.save). Returns the
    number of allocation events.
    """
    global _setup_mark, _setup_tensors, _setup_torch
    if tensors is None or (not tensors and not allow_unnamed):
        raise PersistError(
            "mark_setup() needs the named setup tensors the graphs use (parameters, buffers, static inputs), so "
            "LOAD can prove they sit where SAVE had them; pass allow_unnamed=True only if there are none"
        )
    torch.cuda.synchronize()
    evs = region.events()
    _setup_mark = (len(evs), region.info().cursor)
    _setup_tensors = [[name, *_tensor_key(t)] for name, t in tensors.items()]
    _setup_torch = _torch_blocks()
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


def _find(ranges: list[tuple[int, int]], addr: int) -> tuple[int, int] | None:
    """The (start, size) in sorted, disjoint `ranges` holding `addr`, or None."""
    i = bisect.bisect_right(ranges, (addr, float("inf"))) - 1
    return ranges[i] if i >= 0 and addr < ranges[i][0] + ranges[i][1] else None


def check_ownership(name: str, pointers: set[int], live: list[tuple[int, int]]) -> None:
    """Every in-region address a graph uses must be memory LOAD recreates exactly and nobody else can take:
    live at SAVE, and, inside a torch segment that existed at mark_setup(), inside a block that was live then
    (the rest of such a segment is free space torch may hand to any later tensor at LOAD)."""
    segments, blocks = _setup_torch
    for p in sorted(pointers):
        if _find(live, p) is None:
            raise PersistError(f"graph {name!r}: address {p:#x} is not backed by live region memory at SAVE "
                               "(freed before SAVE?): SAVE refused")  # fmt: skip
        seg = _find(segments, p)
        if seg is not None and _find(blocks, p) is None:
            raise PersistError(
                f"graph {name!r}: address {p:#x} lies in free space of torch segment {seg[0]:#x}+{seg[1]} as it "
                "was at mark_setup(): memory allocated there after mark_setup() is not recreated at LOAD and could "
                "be handed to another tensor. Allocate it before mark_setup() (and name it) or inside the graph "
                "pool: SAVE refused"
            )


SINGLE = {"world_size": 1, "tp_size": 1, "pp_size": 1, "ep_size": 1}


def _parallel(parallel: Mapping[str, int] | None) -> dict[str, int]:
    """The parallel layout (world_size, tp/pp/ep sizes); a single rank when not given."""
    par = {**SINGLE, **(parallel or {})}
    if par["world_size"] < 1 or par["tp_size"] * par["pp_size"] > par["world_size"]:
        raise PersistError(f"inconsistent parallel layout {par}")
    return par


def _ranks(par: Mapping[str, int], rank: int, gather: ranks.Gather | None) -> ranks.Ranks:
    try:
        return ranks.Ranks(par["world_size"], rank, gather)
    except ranks.RanksRefused as exc:
        raise PersistError(str(exc)) from None


def _tensor_key(t: torch.Tensor) -> list[Any]:
    return [t.data_ptr(), str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride())]


def check_setup_tensors(saved: list[list[Any]], live: Mapping[str, torch.Tensor] | None) -> None:
    """Aborts at the first named setup tensor whose address, dtype, shape or stride differs from SAVE's."""
    if saved and live is None:
        raise PersistError(f"the archive records {len(saved)} setup tensors: pass setup_tensors= to load()")
    live_rows = [[name, *_tensor_key(t)] for name, t in (live or {}).items()]
    for i, (want, got) in enumerate(zip(saved, live_rows, strict=False)):
        if want != got:
            raise PersistError(
                f"setup tensor {i} differs: saved {want[0]!r} at {want[1]:#x} {want[2]} {want[3]}, "
                f"live {got[0]!r} at {got[1]:#x} {got[2]} {got[3]} (setup code or its order differs)"
            )
    if len(saved) != len(live_rows):
        raise PersistError(f"setup tensors: SAVE recorded {len(saved)}, LOAD passed {len(live_rows)}")


# ------------------------------------------------------------------------------------------- tensors


def tensor_spec(t: torch.Tensor) -> dict[str, Any]:
    return {
        "addr": t.data_ptr(),
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "stride": list(t.stride()),
    }


class _RawCuda:
    """A device pointer presented through __cuda_array_interface__ so torch can view it without copying."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def tensor_at(spec: Mapping[str, Any]) -> torch.Tensor:
    """A tensor over the recorded address (memory owned by the region, not by torch's allocator)."""
    dtype = getattr(torch, spec["dtype"])
    item = torch.empty(0, dtype=dtype).element_size()
    extent = 1 + sum((s - 1) * st for s, st in zip(spec["shape"], spec["stride"], strict=True) if s > 0)
    if any(s == 0 for s in spec["shape"]):
        extent = 0
    raw = torch.as_tensor(_RawCuda(spec["addr"], max(extent, 1) * item), device="cuda")
    return raw.view(dtype).as_strided(spec["shape"], spec["stride"])


# ------------------------------------------------------------------------------------------- SAVE


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


@dataclass
class _Entry:
    graph: Any
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    capture_size: int | None
    mode: str | None
    capture_s: float | None


@dataclass
class Saver:
    """Collects captured graphs with their static tensors, then writes one archive."""

    entries: dict[str, _Entry] = field(default_factory=dict)

    def add(
        self,
        name: str,
        graph: Any,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        *,
        capture_size: int | None = None,
        mode: str | None = None,
        capture_s: float | None = None,
    ) -> None:
        if not hasattr(graph, "raw_cuda_graph"):
            raise PersistError(f"graph {name!r}: needs a torch CUDAGraph captured with keep_graph=True")
        self.entries[name] = _Entry(graph, list(inputs), list(outputs), capture_size, mode, capture_s)

    def save(
        self,
        root: Path | str,
        *,
        engine: Mapping[str, str],
        model: Mapping[str, str],
        rank: int = 0,
        parallel: Mapping[str, int] | None = None,
        flags: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        gather: ranks.Gather | None = None,
    ) -> dict[str, Any]:
        """Serializes every graph; returns a summary (fingerprints, timings). Fails naming unsupported nodes.

        With `parallel["world_size"] > 1` every rank calls this (collectively, like a torch.distributed call):
        the ranks agree that all succeeded and describe one world, rank 0 stages the archive, each rank writes
        its `rank_<r>/` part, and rank 0 publishes it once all parts are there. Any rank's refusal refuses all.
        """
        par = _parallel(parallel)
        coll = _ranks(par, rank, gather)
        prep, error = None, None
        try:
            prep = self._prepare(engine, model, par, flags)
        except Exception as exc:
            if coll.world_size == 1:
                raise  # one rank: the refusal as it is, nobody to tell
            error = f"{type(exc).__name__}: {exc}"
        try:
            coll.check(error, "SAVE")
            assert prep is not None
            coll.same_world(prep["world"], "SAVE")
            w = coll.writer(root, prep["world"], overwrite=overwrite)
        except ranks.RanksRefused as exc:
            raise PersistError(str(exc)) from None
        try:
            summary = self._write(w, rank, prep)
        except Exception as exc:  # every rank must hear about it before rank 0 publishes
            if coll.world_size == 1:
                w.abort()
                raise
            error = f"{type(exc).__name__}: {exc}"
        try:
            coll.commit(w, error)
        except ranks.RanksRefused as exc:
            raise PersistError(str(exc)) from None
        region.freeze()
        summary["total_s"] = time.perf_counter() - prep["t0"]
        return summary

    def _prepare(
        self, engine: Mapping[str, str], model: Mapping[str, str], par: dict[str, int], flags: Any
    ) -> dict[str, Any]:
        """This rank's part of SAVE up to writing: every refusal happens here, before any file exists."""
        from cuda.bindings import driver as drv

        if _setup_mark is None:
            raise PersistError("call graphpersist.api.mark_setup() after the model setup and before warm-up/capture")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        info = region.info()
        if not info.base:
            raise PersistError("no region: the interposer is not active (GP_REGION_BASE unset?)")
        lo, hi = info.base, info.base + info.size
        evs = region.events()
        bad = region.outside(evs)
        if bad:
            listed = "; ".join(e.describe() for e in bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise PersistError(
                f"{len(bad)} device allocation(s) bypassed or could not be placed in the fixed region, so a graph "
                f"could point at memory LOAD cannot recreate: {listed}. {region.last_error()} SAVE refused"
            )
        late = region.late_mappings(evs, _setup_mark[0])
        if late:
            listed = "; ".join(e.describe() for e in late[:5]) + (" ..." if len(late) > 5 else "")
            raise PersistError(
                f"{len(late)} reservation/mapping event(s) after mark_setup(): {listed}. LOAD recreates only "
                "allocations made after setup, so connect every peer before mark_setup() (NCCL_RUNTIME_CONNECT=0, "
                "symmetric-memory rendezvous and cuIpcOpenMemHandle in setup). SAVE refused"
            )
        if par["world_size"] > 1 and (wrong := region.multicast_problems(os.environ)):
            raise PersistError(
                f"NVLink multicast must be off for multi-rank graphs (multicast objects are not placed in the "
                f"fixed region): {', '.join(wrong)}. SAVE refused"
            )
        live_mem = region.live_ranges(evs)
        table = images.ImageTable.current()
        saved: dict[str, graphs.SavedGraph] = {}
        for name, e in self.entries.items():
            g = drv.CUgraph(e.graph.raw_cuda_graph())
            try:
                saved[name] = graphs.serialize(g, table, lo, hi)
            except (graphs.GraphFormatError, images.ImageError) as exc:
                raise PersistError(f"graph {name!r}: {exc}") from None
            for t in (*e.inputs, *e.outputs):
                if not lo <= t.data_ptr() < hi:
                    raise PersistError(f"graph {name!r}: static tensor at {t.data_ptr():#x} lies outside the region")
            check_ownership(name, saved[name].pointers, live_mem)
        serialize_s = time.perf_counter() - t0

        sizes = sorted({e.capture_size for e in self.entries.values() if e.capture_size is not None})
        modes = sorted({e.mode for e in self.entries.values() if e.mode})
        live = collect_live(
            device=torch.cuda.current_device(),
            engine=dict(engine),
            model=dict(model),
            capture={"sizes": sizes, "modes": modes},
            parallel=par,
            flags=dict(flags or {}),
        )
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
        pointers = sorted(set().union(*(sg.pointers for sg in saved.values())))
        inv_fp = hashlib.sha256(json.dumps(pointers).encode()).hexdigest()
        return {
            "t0": t0, "serialize_s": serialize_s, "info": info, "evs": evs, "saved": saved, "used": used,
            "pointers": pointers, "inv_fp": inv_fp, "world": world_facts(live),
        }  # fmt: skip

    def _write(self, w: ArchiveWriter, rank: int, prep: dict[str, Any]) -> dict[str, Any]:
        """Writes this rank's files and rank record into the (shared) staging folder."""
        info, evs, saved, used = prep["info"], prep["evs"], prep["saved"], prep["used"]
        pointers, inv_fp = prep["pointers"], prep["inv_fp"]
        lo, hi = info.base, info.base + info.size
        image_records = []
        for sha, (load, names) in sorted(used.items()):
            rel = w.add_file(rank, f"images/{sha}.bin", load.data())
            image_records.append(
                {"sha256": sha, "file": rel, "size": load.size, "kind": load.kind, "entries": sorted(names)}
            )
        graph_records = []
        content_fps = {}
        for name, sg in saved.items():
            e = self.entries[name]
            rel = w.add_json(rank, f"graphs/{name}.json", sg.desc)
            w.add_file(rank, f"graphs/{name}.bin", sg.blob)
            w.add_file(rank, f"graphs/{name}.knodes", sg.table)
            by_type: dict[str, int] = {}
            for nd in sg.desc["nodes"]:
                by_type[nd["type"]] = by_type.get(nd["type"], 0) + 1
            graph_records.append(
                {
                    "name": name,
                    "file": rel,
                    "topology_fingerprint": graphs.topology_fingerprint(sg.desc),
                    "node_count": len(sg.desc["nodes"]),
                    "nodes_by_type": by_type,
                    "kernel_count": by_type.get("kernel", 0),
                    "images": sorted({nd["image"] for nd in sg.desc["nodes"] if nd["type"] == "kernel"}),
                    "capture_size": e.capture_size,
                    "mode": e.mode,
                }
            )
            content_fps[name] = graphs.address_fingerprint(sg.desc, sg.blob, lo, hi)
        w.add_json(rank, "alloc_log.json", [[ev.kind, ev.addr, ev.size, ev.req] for ev in evs])
        w.add_json(rank, "pointers.json", pointers)
        w.add_json(rank, "setup_tensors.json", _setup_tensors)
        w.add_json(
            rank,
            "tensors.json",
            {
                name: {"inputs": [tensor_spec(t) for t in e.inputs], "outputs": [tensor_spec(t) for t in e.outputs]}
                for name, e in self.entries.items()
            },
        )
        w.set_rank_facts(
            rank,
            {
                "rank": rank,
                "device": world.rank_device_facts(torch.cuda.current_device()),
                "region": {"base": info.base, "size": info.size, "final_offset": info.cursor},
                "pointers": {"fingerprint": inv_fp, "count": len(pointers)},
                "graphs": graph_records,
                "images": image_records,
                "extra": {
                    "setup_events": _setup_mark[0],
                    "setup_cursor": _setup_mark[1],
                    "address_fingerprints": content_fps,
                    "granularity": info.granularity,
                },
            },
        )
        return {
            "serialize_s": prep["serialize_s"],
            "final_offset": info.cursor,
            "pointer_fingerprint": inv_fp,
            "pointers": len(pointers),
            "images": len(used),
            "image_bytes": sum(ld.size for ld, _ in used.values()),
            "nodes": {n: len(sg.desc["nodes"]) for n, sg in saved.items()},
        }


# ------------------------------------------------------------------------------------------- LOAD


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
    par = _parallel(parallel)
    coll = _ranks(par, rank, gather)
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
        graphs.verify_blob(g.name, desc, blob)
        graphs.check_events(g.name, desc)
        if graphs.topology_fingerprint(desc) != g.topology_fingerprint:
            raise PersistError(f"graph {g.name!r}: description does not match its recorded topology fingerprint")
        descs[g.name] = (desc, blob, table)
    pointers = archive.read_json(rank, "pointers.json")
    if hashlib.sha256(json.dumps(pointers).encode()).hexdigest() != rec.pointers.fingerprint:
        raise PersistError("pointer inventory does not match its recorded fingerprint")
    check_setup_tensors(archive.read_json(rank, "setup_tensors.json"), setup_tensors)
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
        events = graphs.create_events(name, desc)
        if native:
            g = graphs.rebuild_native(name, desc, blob, table, resolved[name], events)
        else:  # reference path: one cuda-bindings call per node (about 5x slower)
            g = graphs.rebuild(name, desc, blob, loaded.function, events)
        b = time.perf_counter()
        ex = graphs.instantiate(name, g)
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
