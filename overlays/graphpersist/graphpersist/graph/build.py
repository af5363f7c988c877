"""LOAD side of a graph: fresh events, the rebuilt CUgraph (native or one cuda-bindings call per node), its exec.

Every edge is rebuilt as a full dependency, also the programmatic ones (edge data from_port 1 or 2, type 1) that
stream capture records where a library launched a kernel with programmatic stream serialization (cuBLASLt's
split-K reduction after its GEMM). The archive keeps the edge data as captured; only the rebuild drops it, because
on the reference host (driver 580.159.04, CUDA 13.0) an explicitly added programmatic edge does not behave like the
captured one: the graph runs faster than the captured graph and kernels after the programmatic target read its
output before it is complete (recipes/diagnosis/runtime-probes/SPLITK.md: a split-K GEMM, a torch elementwise kernel, a
second split-K GEMM; wrong in the process that captured it, at every replay). Rebuilt with plain edges the same
graph is bit-identical to the captured one and as fast (481.7 µs captured, 476.1 µs plain, 36 such links).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from graphpersist.graph.format import (
    ATTR_BYTES,
    KNODE,
    MEMCPY_FIELDS,
    TABLE_HEADER,
    GraphFormatError,
    attr_ids,
    check_events,
    driver,
    edge_ends,
    kernel_row,
    verify_blob,
)
from graphpersist.graph.images import LoadedImages, ParamLayout, check


def create_events(name: str, desc: dict[str, Any]) -> list[Any]:
    """One fresh CUevent per event index of `desc`, in index order (empty when the graph has no event nodes).

    The caller keeps them alive as long as the graph and its executable exist: the nodes hold the handles.
    """
    drv = driver()
    return [check(drv.cuEventCreate(flags), f"graph {name!r}: cuEventCreate(event {i}, flags {flags:#x})")
            for i, flags in enumerate(check_events(name, desc))]  # fmt: skip


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
    CUevent for event index i (from create_events). `hashed` as for verify_blob. `layouts(sha, name, func_attrs)`
    (LoadedImages.layout; LOAD always passes it) is each function's live parameter layout: every kernel node's saved
    layout must equal it and end inside the blob before any node is added, as in rebuild_native.
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


class LiveFuncs:
    """A description's function table as gp_add_kernel_nodes takes it: each live CUfunction with its parameter layout
    (cuFuncGetParamInfo), packed once per graph shape (the graphs of one shape share their function table)."""

    def __init__(self, handles: Sequence[Any], layouts: Sequence[ParamLayout]) -> None:
        if len(handles) != len(layouts):
            raise ValueError(f"{len(handles)} functions, {len(layouts)} layouts")
        self.layouts = list(layouts)
        n = max(len(handles), 1)
        self.handles = (ctypes.c_void_p * n)(*[int(f) for f in handles])
        # one u32 array for all (filling a ctypes array element by element costs 10x more): per function its
        # parameter count, then the offset and size of each parameter
        words, starts = array.array("I"), []
        for lay in self.layouts:
            starts.append(len(words))
            words.append(len(lay))
            words.extend(itertools.chain.from_iterable(lay))
        self._words = (ctypes.c_uint32 * max(len(words), 1)).from_buffer(words or array.array("I", [0]))
        base = ctypes.addressof(self._words)
        self.layout_ptrs = (ctypes.c_void_p * n)(*[base + 4 * s for s in starts])

    def __len__(self) -> int:
        return len(self.layouts)

    @classmethod
    def of(cls, loaded: LoadedImages, funcs: Sequence[Sequence[Any]]) -> LiveFuncs:
        """The live functions of a description's `funcs` ([image sha256, kernel name, attributes] each)."""
        return cls([loaded.function(*f) for f in funcs], [loaded.layout(*f) for f in funcs])


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


def _layout_refusal(
    name: str, node: int, kernel: str, why: str, saved: Sequence[int], params_off: int, blob_size: int,
    live: ParamLayout,
) -> str:  # fmt: skip
    """LOAD's refusal of a kernel row whose layout is not its live function's: graph, node, kernel, both layouts."""
    return (
        f"graph {name!r} node {node} kernel {kernel!r}: its saved parameter layout does not fit the live function "
        f"({why}): saved {len(saved)} parameters at offsets {_clip(list(saved))} from byte {params_off} of the "
        f"{blob_size}-byte parameter blob; live (offset, size) {_clip([list(p) for p in live])}. The archive was "
        "altered after SAVE (its hashes recomputed) or damaged: take archives only from where you would take code, "
        "or SAVE again"
    )


def _clip(items: list[Any], most: int = 16) -> str:
    return repr(items) if len(items) <= most else f"{items[:most]!r} (the first {most} of {len(items)})"


def _cbuf(data: bytes | memoryview) -> ctypes.Array:
    """A ctypes copy of `data` (bytes or a memoryview into a graph pack), at least one byte long."""
    if not len(data):
        return ctypes.create_string_buffer(1)
    return (ctypes.c_char * len(data)).from_buffer_copy(data)


def _check_event_count(name: str, desc: dict[str, Any], events: Sequence[Any]) -> None:
    want = len(check_events(name, desc))
    if len(events) != want:
        raise GraphFormatError(f"graph {name!r}: {want} events needed (create_events), {len(events)} given")


def _add_plain_node(
    drv: Any, graph: Any, ctx: Any, name: str, i: int, nd: dict[str, Any], events: Sequence[Any]
) -> Any:
    """Adds one non-kernel node without dependencies (edges come afterwards, by node index)."""
    kind = nd["type"]
    if kind == "memset":
        m = drv.CUDA_MEMSET_NODE_PARAMS()
        for k in ("dst", "pitch", "value", "elementSize", "width", "height"):
            setattr(m, k, nd[k])
        return check(drv.cuGraphAddMemsetNode(graph, None, 0, m, ctx), f"graph {name!r} node {i} (memset)")
    if kind == "memcpy":
        c = drv.CUDA_MEMCPY3D()
        c.srcMemoryType = drv.CUmemorytype(nd["srcMemoryType"])
        c.dstMemoryType = drv.CUmemorytype(nd["dstMemoryType"])
        for k in MEMCPY_FIELDS:
            setattr(c, k, nd[k])
        return check(drv.cuGraphAddMemcpyNode(graph, None, 0, c, ctx), f"graph {name!r} node {i} (memcpy)")
    if kind == "empty":
        return check(drv.cuGraphAddEmptyNode(graph, None, 0), f"graph {name!r} node {i} (empty)")
    if kind == "event_record":
        ev = events[nd["event"]]
        return check(drv.cuGraphAddEventRecordNode(graph, None, 0, ev), f"graph {name!r} node {i} (event_record)")
    if kind == "event_wait":
        ev = events[nd["event"]]
        return check(drv.cuGraphAddEventWaitNode(graph, None, 0, ev), f"graph {name!r} node {i} (event_wait)")
    raise GraphFormatError(f"graph {name!r} node {i}: unknown node type {kind!r} in the archive")


def _add_edges(drv: Any, graph: Any, name: str, made: list[Any], edges: list[list[int]]) -> None:
    """Every edge as a full dependency, its saved edge data left out (see the module's docstring)."""
    frm = [made[e[0]] for e in edges]
    to = [made[e[1]] for e in edges]
    check(drv.cuGraphAddDependencies(graph, frm, to, None, len(frm)), f"graph {name!r}: cuGraphAddDependencies")


def rebuild_native(
    name: str,
    desc: dict[str, Any],
    blob: bytes | memoryview,
    table: bytes | memoryview,
    funcs: LiveFuncs,
    events: Sequence[Any] = (),
    *,
    hashed: bool = False,
) -> Any:
    """rebuild() through the interposer's gp_add_kernel_nodes/gp_add_edges: one native call per graph.

    `funcs` holds the live CUfunction and parameter layout of each entry of desc["funcs"] (LiveFuncs.of); `events` as
    for rebuild(). Before any node is added, gp_add_kernel_nodes holds every kernel row to its function's live
    layout and the blob's end: the driver reads each parameter for as long as the live function says, whatever the
    archive says (the check is native because it runs for every row, ~80000 for an engine, where the pointers are
    made; the layouts are learned once per function). Non-kernel nodes (event nodes included) are added from Python
    into the same node-index slots after the kernel nodes, so the edges, which refer to node indices, stay right (all
    as full dependencies: see the module's docstring). `hashed=True` (bytes from a verified archive file) skips
    hashing the blob and the table again; their sizes are still compared.
    """
    from graphpersist.memory import region

    verify_blob(name, desc, blob, hashed=hashed)
    _check_event_count(name, desc, events)
    drv = driver()
    if len(table) != desc["table_size"] or (not hashed and hashlib.sha256(table).hexdigest() != desc["table_sha256"]):
        raise GraphFormatError(f"graph {name!r}: kernel table is truncated or altered")
    n = len(desc["nodes"])
    ends, _data = edge_ends(desc)
    if ends and (min(ends) < 0 or max(ends) >= n):  # the native side indexes its node array with them
        raise GraphFormatError(f"graph {name!r}: an edge names a node outside its {n} nodes")
    if len(funcs) != len(desc["funcs"]):
        raise GraphFormatError(f"graph {name!r}: {len(funcs)} live functions for its {len(desc['funcs'])}")
    lib = region.lib()
    graph = check(drv.cuGraphCreate(0), "cuGraphCreate")
    out = (ctypes.c_void_p * max(n, 1))()
    n_k, n_off, _n_attr, _ = TABLE_HEADER.unpack_from(table)
    tbuf = _cbuf(table)
    bbuf = _cbuf(blob)
    t0 = ctypes.addressof(tbuf) + TABLE_HEADER.size
    t_off = t0 + n_k * KNODE.size
    t_attr = t_off + 4 * n_off
    bad = ctypes.c_size_t()
    rc = lib.gp_add_kernel_nodes(int(graph), n_k, t0, bbuf, len(blob), t_off, t_attr, funcs.handles,
                                 funcs.layout_ptrs, len(funcs), out, ctypes.byref(bad))  # fmt: skip
    if rc != 0:
        why = region.last_error()
        drv.cuGraphDestroy(graph)
        if rc == -2:
            raise GraphFormatError(_row_refusal(name, desc, table, bad.value, funcs, len(blob), why))
        raise GraphFormatError(f"graph {name!r}: {why}")
    ctx = None
    for i, nd in enumerate(desc["nodes"]):
        if nd["type"] != "kernel":
            ctx = ctx or check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
            out[i] = int(_add_plain_node(drv, graph, ctx, name, i, nd, events))
    if ends:
        n_e = len(ends) // 2
        frm = (ctypes.c_uint32 * n_e)(*ends[0::2])
        to = (ctypes.c_uint32 * n_e)(*ends[1::2])
        if lib.gp_add_edges(ctypes.c_void_p(int(graph)), out, ctypes.c_size_t(n_e), frm, to) != 0:
            raise GraphFormatError(f"graph {name!r}: {region.last_error()}")
    return graph


def _row_refusal(
    name: str, desc: dict[str, Any], table: bytes | memoryview, row: int, funcs: LiveFuncs, blob_size: int, why: str
) -> str:
    """_layout_refusal for kernel row `row` of a packed table that gp_add_kernel_nodes refused."""
    node, func, params_off, saved = kernel_row(table, row)
    return _layout_refusal(name, node, desc["funcs"][func][1], why, saved, params_off, blob_size, funcs.layouts[func])


def instantiate(name: str, graph: Any, flags: int) -> Any:
    """The executable of a rebuilt graph, made with the flags torch made SAVE's executable with (GraphRecord;
    graphpack.check_graphs refused flags LOAD cannot repeat before anything was mapped)."""
    drv = driver()
    return check(drv.cuGraphInstantiate(graph, flags), f"graph {name!r}: cuGraphInstantiate(flags {flags:#x})")


def upload(name: str, exec_: Any, stream: int) -> None:
    """Puts an executable on the device ahead of its first launch into `stream`, which would otherwise do it.

    LOAD uploads every restored graph before the engine reports ready, so the first request replays its graphs
    as a steady one does (a captured graph's first replay pays the same upload upstream).
    """
    drv = driver()
    check(drv.cuGraphUpload(exec_, drv.CUstream(stream)), f"graph {name!r}: cuGraphUpload")
