"""LOAD side of a graph: fresh events, the CUgraph rebuilt by the interposer's native builder, its executable.

Every edge is rebuilt as a full dependency, also the programmatic ones (edge data from_port 1 or 2, type 1) that
stream capture records where a library launched a kernel with programmatic stream serialization (cuBLASLt's
split-K reduction after its GEMM). The archive keeps the edge data as captured; only the rebuild drops it, because
on the reference host (driver 580.159.04, CUDA 13.0) an explicitly added programmatic edge does not behave like the
captured one: the graph runs faster than the captured graph and kernels after the programmatic target read its
output before it is complete (recipes/diagnosis/runtime-probes/SPLITK.md: a split-K GEMM, a torch elementwise kernel, a
second split-K GEMM; wrong in the process that captured it, at every replay). Rebuilt with plain edges the same
graph is bit-identical to the captured one and as fast (481.7 µs captured, 476.1 µs plain, 36 such links).

The reference rebuild, one cuda-bindings call per node, which tests and diagnosis compare the native builder with,
is diagnosis's (tools/gpdiag/rebuild.py), not the product's.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

from graphpersist.graph.format import (
    KNODE,
    MEMCPY_FIELDS,
    TABLE_HEADER,
    GraphFormatError,
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
    """Re-creates the graph through the interposer's gp_add_kernel_nodes/gp_add_edges: one native call per graph.

    `funcs` holds the live CUfunction and parameter layout of each entry of desc["funcs"] (LiveFuncs.of); `events[i]`
    is the live CUevent for event index i (from create_events). Before any node is added, gp_add_kernel_nodes holds
    every kernel row to its function's live layout and the blob's end: the driver reads each parameter for as long as
    the live function says, whatever the archive says (the check is native because it runs for every row, ~80000 for
    an engine, where the pointers are made; the layouts are learned once per function). Non-kernel nodes (event nodes
    included) are added from Python into the same node-index slots after the kernel nodes, so the edges, which refer
    to node indices, stay right (all as full dependencies: see the module's docstring). `hashed=True` (bytes from a
    verified archive file) skips hashing the blob and the table again; their sizes are still compared.
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
