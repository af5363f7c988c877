"""The reference rebuild of a saved graph: one cuda-bindings call per node, where LOAD makes one native call per graph.

LOAD rebuilds every graph with the interposer's builder (graphpersist.graph.build.rebuild_native). This is the
rebuild it was checked against, kept for diagnosis and for the tests that compare the two: `rebuild` makes a CUgraph
from a saved description node by node (every kernel node's saved layout held to its live function's first, with the
same refusal as the native builder's), and `in_load()` makes load() use it for every graph it restores, from every
kernel node's full description (what `load(native=False)` did while the product had it): about 5x slower, the same
graphs. Every edge is added as a full dependency, as the native builder adds them (graph/build.py says why).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from graphpersist import loadplan, loadstage
from graphpersist.graph import build
from graphpersist.graph.build import _add_plain_node, _cbuf, _check_event_count, _layout_refusal
from graphpersist.graph.format import ATTR_BYTES, GraphFormatError, attr_ids, driver, verify_blob
from graphpersist.graph.images import ParamLayout, check


def rebuild(
    name: str,
    desc: dict[str, Any],
    blob: bytes | memoryview,
    funcs: Any,
    events: Sequence[Any] = (),
    *,
    hashed: bool = False,
    layouts: Callable[[str, str, dict[str, int]], ParamLayout] | None = None,
) -> Any:
    """Re-creates the graph: nodes without dependencies first, then all edges in one call. Returns a CUgraph.

    `funcs(sha, name, func_attrs)` returns the live CUfunction for a kernel node; `events[i]` is the live
    CUevent for event index i (graph.build.create_events). `hashed` as for verify_blob. `layouts(sha, name,
    func_attrs)` (LoadedImages.layout) is each function's live parameter layout: every kernel node's saved layout must
    equal it and end inside the blob before any node is added, as the native builder requires.
    """
    verify_blob(name, desc, blob, hashed=hashed)
    _check_event_count(name, desc, events)
    if layouts is not None:
        _check_layouts(name, desc, len(blob), layouts)
    drv = driver()
    graph = check(drv.cuGraphCreate(0), "cuGraphCreate")
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    keep = _cbuf(blob)
    base = ctypes.addressof(keep)
    made: list[Any] = []
    defaults: dict[int, dict[str, bytes]] = {}  # per function index; only differing saved values are set
    kp = drv.CUDA_KERNEL_NODE_PARAMS()
    attr_val = drv.CUkernelNodeAttrValue()
    val_ptr = attr_val.getPtr()
    for i, nd in enumerate(desc["nodes"]):
        kind = nd["type"]
        if kind == "kernel":
            off, _size = nd["params"]
            layout = nd["layout"]
            ptrs = (ctypes.c_void_p * max(len(layout), 1))(*[base + off + o for o, _s in layout])
            kp.func = funcs(*desc["funcs"][nd["func"]])
            kp.gridDimX, kp.gridDimY, kp.gridDimZ = nd["grid"]
            kp.blockDimX, kp.blockDimY, kp.blockDimZ = nd["block"]
            kp.sharedMemBytes = nd["smem"]
            kp.kernelParams = ctypes.addressof(ptrs) if layout else None
            kp.extra = 0
            node = check(drv.cuGraphAddKernelNode(graph, None, 0, kp), f"graph {name!r} node {i} ({nd['name']})")
            if nd["func"] not in defaults:  # what a fresh node of this function reads back, attribute by attribute
                fresh = {}
                for a in attr_ids():
                    err, v = drv.cuGraphKernelNodeGetAttribute(node, a)
                    if int(err) == 0:
                        fresh[str(int(a))] = ctypes.string_at(v.getPtr(), ATTR_BYTES)
                defaults[nd["func"]] = fresh
            for aid, hexval in nd["attrs"].items():
                raw = bytes.fromhex(hexval).ljust(ATTR_BYTES, b"\0")
                if defaults[nd["func"]].get(aid) == raw:
                    continue
                ctypes.memmove(val_ptr, raw, ATTR_BYTES)
                check(
                    drv.cuGraphKernelNodeSetAttribute(node, drv.CUkernelNodeAttrID(int(aid)), attr_val),
                    f"graph {name!r} node {i}: set launch attribute {aid}",
                )
        else:
            node = _add_plain_node(drv, graph, ctx, name, i, nd, events)
        made.append(node)
    if desc["edges"]:
        _add_edges(drv, graph, name, made, desc["edges"])
    del keep
    return graph


@contextlib.contextmanager
def in_load() -> Iterator[None]:
    """load() rebuilds each graph with `rebuild` instead of the native builder while the block runs, reading every
    kernel node's full description for it (as `graphpersist check` reads them)."""
    stage, native = loadstage.rank_stage, build.rebuild_native

    def full_stage(archive: Any, rank: int, *, every_byte: bool = False) -> loadplan.LoadPlan:
        return loadplan.read_plan(archive, rank, full=True, every_byte=every_byte)

    def reference(name: str, desc: dict[str, Any], blob: Any, table: Any, funcs: build.LiveFuncs,
                  events: Sequence[Any] = (), *, hashed: bool = False) -> Any:  # fmt: skip
        index = {json.dumps(f): i for i, f in enumerate(desc["funcs"])}

        def handle(*f: Any) -> Any:
            return driver().CUfunction(funcs.handles[index[json.dumps(list(f))]])

        def layout(*f: Any) -> ParamLayout:
            return funcs.layouts[index[json.dumps(list(f))]]

        return rebuild(name, desc, blob, handle, events, hashed=hashed, layouts=layout)

    loadstage.rank_stage, build.rebuild_native = full_stage, reference
    try:
        yield
    finally:
        loadstage.rank_stage, build.rebuild_native = stage, native


def _check_layouts(
    name: str, desc: dict[str, Any], blob_size: int, layouts: Callable[[str, str, dict[str, int]], ParamLayout]
) -> None:
    """rebuild()'s copy of gp_add_kernel_nodes' row check, plus the sizes its full description also holds: every
    kernel node's saved layout is its live function's and ends inside the blob, or LOAD refuses naming the node."""
    for i, nd in enumerate(desc["nodes"]):
        if nd["type"] != "kernel":
            continue
        live = layouts(*desc["funcs"][nd["func"]])
        saved = [o for o, _s in nd["layout"]]
        why = _layout_problem(saved, nd["params"][0], live, blob_size)
        if why is None:
            sizes = [(j, s, size) for j, ((_o, s), (_lo, size)) in enumerate(zip(nd["layout"], live, strict=False))
                     if s != size]  # fmt: skip
            why = f"parameter {sizes[0][0]} is {sizes[0][1]} bytes, the function's {sizes[0][2]}" if sizes else None
        if why:
            raise GraphFormatError(_layout_refusal(name, i, nd["name"], why, saved, nd["params"][0], blob_size, live))


def _layout_problem(saved: Sequence[int], params_off: int, live: ParamLayout, blob_size: int) -> str | None:
    """What native/gp_core.c gp_knode_layout_check says of a kernel row (the reference rebuild's copy of it)."""
    if len(saved) != len(live):
        return f"{len(saved)} parameters, the function {len(live)}"
    for j, (s, (o, size)) in enumerate(zip(saved, live, strict=True)):
        if s != o:
            return f"parameter {j} at offset {s}, the function's at {o}"
        if params_off + o + size > blob_size:
            return f"parameter {j} ({size} bytes at offset {o}) ends past the {blob_size}-byte blob"
    return None


def _add_edges(drv: Any, graph: Any, name: str, made: list[Any], edges: list[list[int]]) -> None:
    """Every edge as a full dependency, its saved edge data left out (see the module's docstring)."""
    frm = [made[e[0]] for e in edges]
    to = [made[e[1]] for e in edges]
    check(drv.cuGraphAddDependencies(graph, frm, to, None, len(frm)), f"graph {name!r}: cuGraphAddDependencies")
