"""Serialize a captured CUDA graph's DAG and rebuild it in another process.

Supported nodes: kernel (parameters read through kernelParams or the `extra` buffer, laid out by
cuFuncGetParamInfo; every readable launch attribute copied byte for byte), memset, device-to-device memcpy,
empty, event record and event wait nodes, plus edges with their edge data. Anything else makes SAVE fail naming
the node: a silent archive would replay something different. The description is JSON; parameter bytes go in one
binary blob.

Events: a CUevent handle is process-local, so the description holds only an event *index* (distinct handles
numbered in order of first appearance). LOAD creates one fresh event per index (`create_events`) and the loaded
graph records/waits on those; an engine that records or waits on the same events outside the graph must use the
live ones (`LoadedGraph.events`). The driver has no call to read an event's creation flags, so every event is
recreated with CU_EVENT_DISABLE_TIMING, what torch.cuda.Event() uses by default (external events included):
an engine that times such events with cuEventElapsedTime would get an error, not a wrong number.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from graphpersist.images import ImageTable, check, func_attributes

# Launch attributes whose values are process-local handles: they cannot be persisted.
_EVENT_ATTRS = {"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT", "CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT"}
_ATTR_BYTES = 64  # sizeof(CUlaunchAttributeValue)
_MEMCPY_FIELDS = (
    "srcXInBytes", "srcY", "srcZ", "srcLOD", "srcPitch", "srcHeight", "srcDevice",
    "dstXInBytes", "dstY", "dstZ", "dstLOD", "dstPitch", "dstHeight", "dstDevice",
    "WidthInBytes", "Height", "Depth",
)  # fmt: skip
_DEVICE_MEMORY = (2, 4)  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED
EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING: the flags every event is recreated with (see above)

# CUgraphNodeType name -> the description's node kind, for the node types the format persists.
NODE_KINDS = {
    "CU_GRAPH_NODE_TYPE_KERNEL": "kernel",
    "CU_GRAPH_NODE_TYPE_MEMCPY": "memcpy",
    "CU_GRAPH_NODE_TYPE_MEMSET": "memset",
    "CU_GRAPH_NODE_TYPE_EMPTY": "empty",
    "CU_GRAPH_NODE_TYPE_EVENT_RECORD": "event_record",
    "CU_GRAPH_NODE_TYPE_WAIT_EVENT": "event_wait",
}
# Why the other node types are refused; each names what would be lost or replayed differently.
_REFUSED = {
    "CU_GRAPH_NODE_TYPE_HOST": "a host callback: its function pointer and user data exist only in this process",
    "CU_GRAPH_NODE_TYPE_GRAPH": "child graphs are not walked",
    "CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL": "external semaphores are process-local handles",
    "CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT": "external semaphores are process-local handles",
    "CU_GRAPH_NODE_TYPE_MEM_ALLOC": "graph-owned allocations are not placed in the fixed region",
    "CU_GRAPH_NODE_TYPE_MEM_FREE": "graph-owned allocations are not placed in the fixed region",
    "CU_GRAPH_NODE_TYPE_BATCH_MEM_OP": "batched memory operations are not serialized",
    "CU_GRAPH_NODE_TYPE_CONDITIONAL": "conditional handles and their body graphs are not serialized",
}


class GraphFormatError(RuntimeError):
    """The graph holds something the format cannot persist, or a saved graph file is damaged."""


def node_kind(i: int, type_name: str) -> str:
    """The description kind for node `i` of CUgraphNodeType `type_name`; refuses unsupported types naming it."""
    kind = NODE_KINDS.get(type_name)
    if kind is None:
        why = _REFUSED.get(type_name, "unknown node type")
        raise GraphFormatError(f"node {i} ({type_name}): node type cannot be persisted (SAVE refused): {why}")
    return kind


def check_memcpy_kinds(where: str, src_type: int, dst_type: int) -> None:
    """Refuses memcpy nodes touching host or array memory: host pointers do not survive the process."""
    if src_type not in _DEVICE_MEMORY or dst_type not in _DEVICE_MEMORY:
        raise GraphFormatError(
            f"{where}: memcpy with host or array memory (types {(src_type, dst_type)}) is not supported"
        )


class EventNumbering:
    """Numbers distinct CUevent handles in order of first appearance; only the numbers reach the archive.

    Handle values differ in every process (and between two captures), so they must never enter a description
    or a fingerprint: two SAVEs of the same code give the same description.
    """

    def __init__(self) -> None:
        self._index: dict[int, int] = {}

    def index(self, handle: int) -> int:
        return self._index.setdefault(int(handle), len(self._index))

    def __len__(self) -> int:
        return len(self._index)


def event_node(kind: str, handle: int, numbering: EventNumbering) -> dict[str, Any]:
    """The description of an event record/wait node: its kind and event index, never the handle."""
    if kind not in ("event_record", "event_wait"):
        raise ValueError(f"not an event node kind: {kind!r}")
    return {"type": kind, "event": numbering.index(handle)}


def event_table(numbering: EventNumbering) -> list[dict[str, int]]:
    """One entry per event index: the creation flags LOAD uses (not queryable from the driver, see above)."""
    return [{"flags": EVENT_DISABLE_TIMING} for _ in range(len(numbering))]


def check_events(name: str, desc: dict[str, Any]) -> list[int]:
    """Flags of each event index; refuses a description whose event nodes and event table disagree."""
    table = desc.get("events", [])
    try:
        flags = [int(e["flags"]) for e in table]
    except (KeyError, TypeError, ValueError):
        raise GraphFormatError(f"graph {name!r}: malformed event table {table!r}") from None
    used = set()
    for i, nd in enumerate(desc["nodes"]):
        if nd["type"] in ("event_record", "event_wait"):
            idx = nd.get("event")
            if not isinstance(idx, int) or not 0 <= idx < len(flags):
                raise GraphFormatError(
                    f"graph {name!r} node {i} ({nd['type']}): event index {idx!r} outside the event table "
                    f"({len(flags)} events)"
                )
            used.add(idx)
    if used != set(range(len(flags))):
        raise GraphFormatError(f"graph {name!r}: event table lists {len(flags)} events, nodes use {sorted(used)}")
    return flags


def _drv() -> Any:
    from cuda.bindings import driver

    return driver


_type_names: dict[int, str] = {}


def node_type_name(t: Any) -> str:
    """The CUgraphNodeType's name as NODE_KINDS spells it, matched by value (whatever the bindings print)."""
    if not _type_names:
        T = _drv().CUgraphNodeType
        _type_names.update({int(getattr(T, n)): n for n in (*NODE_KINDS, *_REFUSED) if hasattr(T, n)})
    return _type_names.get(int(t), getattr(t, "name", str(t)))


def _attr_ids() -> list[Any]:
    drv = _drv()
    return [a for a in drv.CUkernelNodeAttrID if a.name != "CU_LAUNCH_ATTRIBUTE_IGNORE"]


def _param_layout(func: Any, name: str) -> list[tuple[int, int]]:
    """(offset, size) of each kernel parameter. The driver answers CUDA_ERROR_INVALID_VALUE past the last
    one; any other error would silently truncate the parameters, so it refuses."""
    drv = _drv()
    out = []
    i = 0
    while True:
        err, off, size = drv.cuFuncGetParamInfo(func, i)
        if err == drv.CUresult.CUDA_ERROR_INVALID_VALUE:
            return out
        if int(err) != 0:
            raise GraphFormatError(f"kernel {name!r}: cuFuncGetParamInfo(parameter {i}) failed: {err!r}")
        out.append((int(off), int(size)))
        i += 1


# Values that can be user-space addresses on x86-64/aarch64 (48- or 57-bit); smaller words are counts or flags.
_ADDR_LO, _ADDR_HI = 1 << 32, 1 << 57


class _ForeignPointers:
    """Refuses device addresses outside the fixed region: LOAD cannot recreate them (pinned host memory, managed
    memory, module globals, allocations made before the region existed). A parameter word counts as an address
    when the driver knows it (cuPointerGetAttribute succeeds); answers are cached per value."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.known: dict[int, str | None] = {}

    def kind(self, v: int) -> str | None:
        """The memory type of a CUDA-known address, or None for a plain number."""
        if v not in self.known:
            drv = _drv()
            attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
            err, mtype = drv.cuPointerGetAttribute(attr, v)
            if err == drv.CUresult.CUDA_ERROR_INVALID_VALUE:
                self.known[v] = None
            elif int(err) != 0:
                raise GraphFormatError(f"cuPointerGetAttribute({v:#x}) failed: {err!r}")
            else:
                self.known[v] = _MEMORY_TYPES.get(int(mtype), str(int(mtype)))
        return self.known[v]

    def scan_params(self, where: str, data: bytes) -> set[int]:
        """The in-region addresses among a kernel's 8-byte parameter words; refuses any known memory outside."""
        n = len(data) // 8
        inside = set()
        for j, v in enumerate(struct.unpack_from(f"<{n}Q", data) if n else ()):
            if self.lo <= v < self.hi:
                inside.add(v)
            elif _ADDR_LO <= v < _ADDR_HI and self.kind(v) is not None:
                raise GraphFormatError(
                    f"{where}: parameter bytes {8 * j}..{8 * j + 7} hold {v:#x}, {self.kind(v)} memory outside the "
                    f"fixed region [{self.lo:#x}, {self.hi:#x}) that LOAD cannot recreate (SAVE refused)"
                )
        return inside

    def check_address(self, where: str, field: str, v: int) -> None:
        """A memset/memcpy address is always an address: outside the region it is refused outright."""
        if not self.lo <= v < self.hi:
            kind = self.kind(v) if _ADDR_LO <= v < _ADDR_HI else None
            raise GraphFormatError(
                f"{where}: {field} {v:#x} ({kind or 'unknown'} memory) lies outside the fixed region "
                f"[{self.lo:#x}, {self.hi:#x}) that LOAD recreates (SAVE refused)"
            )


_MEMORY_TYPES = {1: "host", 2: "device", 3: "array", 4: "unified"}


class _AttrProbe:
    """Decides whether a launch attribute that cannot be read from a captured node is simply not a kernel-node
    attribute: it must fail the same way on a fresh node of the same kernel in a scratch graph. Anything else
    (readable on a fresh node, or another error) refuses SAVE, because a value that was set would be lost."""

    def __init__(self) -> None:
        self.graph: Any = None
        self.answers: dict[tuple[int, int], int] = {}

    def unreadable_on_fresh(self, p: Any, layout: list[tuple[int, int]], params: bytes, attr: Any) -> int:
        """The error code a fresh node of `p.func` gives for `attr` (0 when it reads fine)."""
        drv = _drv()
        key = (int(p.func), int(attr))
        if key not in self.answers:
            if self.graph is None:
                self.graph = check(drv.cuGraphCreate(0), "cuGraphCreate (attribute probe)")
            keep = ctypes.create_string_buffer(params, len(params) or 1)
            ptrs = (ctypes.c_void_p * max(len(layout), 1))(*[ctypes.addressof(keep) + o for o, _s in layout])
            kp = drv.CUDA_KERNEL_NODE_PARAMS()
            kp.func = p.func
            kp.gridDimX, kp.gridDimY, kp.gridDimZ = p.gridDimX, p.gridDimY, p.gridDimZ
            kp.blockDimX, kp.blockDimY, kp.blockDimZ = p.blockDimX, p.blockDimY, p.blockDimZ
            kp.sharedMemBytes = p.sharedMemBytes
            kp.kernelParams = ctypes.addressof(ptrs) if layout else None
            node = check(drv.cuGraphAddKernelNode(self.graph, None, 0, kp), "cuGraphAddKernelNode (attribute probe)")
            self.answers[key] = int(drv.cuGraphKernelNodeGetAttribute(node, attr)[0])
        return self.answers[key]

    def close(self) -> None:
        if self.graph is not None:
            _drv().cuGraphDestroy(self.graph)
            self.graph = None


def _read_params(p: Any, layout: list[tuple[int, int]], name: str) -> bytes:
    """The parameter buffer as the kernel sees it: each parameter at its offset."""
    total = max((o + s for o, s in layout), default=0)
    buf = bytearray(total)
    kp = int(p.kernelParams) if p.kernelParams else 0
    extra = int(p.extra) if p.extra else 0
    if kp:
        ptrs = (ctypes.c_void_p * len(layout)).from_address(kp)
        for i, (off, size) in enumerate(layout):
            buf[off : off + size] = ctypes.string_at(ptrs[i], size)
        return bytes(buf)
    if extra:
        # {CU_LAUNCH_PARAM_BUFFER_POINTER, ptr, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END}
        data_ptr, data_size, i = 0, None, 0
        while True:
            key = ctypes.c_void_p.from_address(extra + 8 * i).value or 0
            if key == 0:
                break
            val = ctypes.c_void_p.from_address(extra + 8 * (i + 1)).value or 0
            if key == 1:
                data_ptr = val
            elif key == 2:
                data_size = ctypes.c_size_t.from_address(val).value
            else:
                raise GraphFormatError(f"kernel {name!r}: unknown `extra` launch key {key:#x}")
            i += 2
        if not data_ptr or data_size is None or data_size > total:
            raise GraphFormatError(f"kernel {name!r}: `extra` buffer missing or larger than its parameters")
        # A launcher may pass fewer bytes than the declared parameter struct (NCCL sizes its args storage for the
        # largest work batch and passes only what it filled): the kernel reads only those, and the driver leaves
        # the rest unspecified. The rebuilt node gets them followed by zeros.
        return ctypes.string_at(data_ptr, data_size) + bytes(total - data_size)
    if layout:
        raise GraphFormatError(f"kernel {name!r}: has parameters but neither kernelParams nor extra")
    return b""


@dataclass
class SavedGraph:
    """A serialized graph: `desc` (JSON-able), `blob` (parameter bytes), and the in-region addresses it uses."""

    desc: dict[str, Any]
    blob: bytes
    pointers: set[int]
    table: bytes


def serialize(graph: Any, table: ImageTable, region_lo: int, region_hi: int) -> SavedGraph:
    """Walks `graph` (a CUgraph) into a SavedGraph; raises GraphFormatError naming any unsupported node."""
    drv = _drv()
    T = drv.CUgraphNodeType
    n = check(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1]
    nodes = check(drv.cuGraphGetNodes(graph, n), "cuGraphGetNodes")[0] if n else []
    index = {int(nd): i for i, nd in enumerate(nodes)}
    blob = bytearray()
    pointers: set[int] = set()
    out_nodes: list[dict[str, Any]] = []
    attr_ids = _attr_ids()
    funcs: dict[str, int] = {}
    func_list: list[list[Any]] = []
    numbering = EventNumbering()
    foreign = _ForeignPointers(region_lo, region_hi)
    probe = _AttrProbe()
    try:
        for i, nd in enumerate(nodes):
            t = check(drv.cuGraphNodeGetType(nd), "cuGraphNodeGetType")
            type_name = node_type_name(t)
            where = f"node {i} ({type_name})"
            kind = node_kind(i, type_name)
            if t == T.CU_GRAPH_NODE_TYPE_KERNEL:
                p = check(drv.cuGraphKernelNodeGetParams(nd), f"{where}: cuGraphKernelNodeGetParams")
                sha, name, _load = table.resolve(p.func)
                layout = _param_layout(p.func, name)
                params = _read_params(p, layout, name)
                pointers |= foreign.scan_params(f"{where} kernel {name!r}", params)
                attrs: dict[str, str] = {}
                for a in attr_ids:
                    err, v = drv.cuGraphKernelNodeGetAttribute(nd, a)
                    if int(err) != 0:
                        fresh = probe.unreadable_on_fresh(p, layout, params, a)
                        if fresh != int(err):
                            raise GraphFormatError(
                                f"{where} kernel {name!r}: reading launch attribute {a.name} failed ({err!r}) but a "
                                f"fresh node of the same kernel answers {fresh}: its value would be lost (SAVE refused)"
                            )
                        continue
                    raw = ctypes.string_at(v.getPtr(), _ATTR_BYTES)
                    if a.name in _EVENT_ATTRS and any(raw):
                        raise GraphFormatError(f"{where} kernel {name!r}: launch attribute {a.name} holds an event")
                    attrs[str(int(a))] = raw.rstrip(b"\0").hex()  # trailing zeros restored at LOAD
                fattrs = func_attributes(p.func)
                fkey = json.dumps([sha, name, fattrs], sort_keys=True)
                if fkey not in funcs:
                    funcs[fkey] = len(func_list)
                    func_list.append([sha, name, fattrs])
                out_nodes.append(
                    {
                        "type": "kernel",
                        "func": funcs[fkey],
                        "image": sha,
                        "name": name,
                        "grid": [p.gridDimX, p.gridDimY, p.gridDimZ],
                        "block": [p.blockDimX, p.blockDimY, p.blockDimZ],
                        "smem": p.sharedMemBytes,
                        "layout": layout,
                        "params": [len(blob), len(params)],
                        "attrs": attrs,
                    }
                )
                blob += params
            elif t == T.CU_GRAPH_NODE_TYPE_MEMSET:
                m = check(drv.cuGraphMemsetNodeGetParams(nd), f"{where}: cuGraphMemsetNodeGetParams")
                fields = {k: int(getattr(m, k)) for k in ("dst", "pitch", "value", "elementSize", "width", "height")}
                foreign.check_address(where, "dst", fields["dst"])
                pointers.add(fields["dst"])
                out_nodes.append({"type": "memset", **fields})
            elif t == T.CU_GRAPH_NODE_TYPE_MEMCPY:
                c = check(drv.cuGraphMemcpyNodeGetParams(nd), f"{where}: cuGraphMemcpyNodeGetParams")
                kinds = (int(c.srcMemoryType), int(c.dstMemoryType))
                check_memcpy_kinds(where, *kinds)
                fields = {k: int(getattr(c, k)) for k in _MEMCPY_FIELDS}
                for k in ("srcDevice", "dstDevice"):
                    foreign.check_address(where, k, fields[k])
                    pointers.add(fields[k])
                out_nodes.append({"type": "memcpy", "srcMemoryType": kinds[0], "dstMemoryType": kinds[1], **fields})
            elif t == T.CU_GRAPH_NODE_TYPE_EMPTY:
                out_nodes.append({"type": "empty"})
            elif t == T.CU_GRAPH_NODE_TYPE_EVENT_RECORD:
                ev = check(drv.cuGraphEventRecordNodeGetEvent(nd), f"{where}: cuGraphEventRecordNodeGetEvent")
                out_nodes.append(event_node(kind, int(ev), numbering))
            elif t == T.CU_GRAPH_NODE_TYPE_WAIT_EVENT:
                ev = check(drv.cuGraphEventWaitNodeGetEvent(nd), f"{where}: cuGraphEventWaitNodeGetEvent")
                out_nodes.append(event_node(kind, int(ev), numbering))
            else:  # node_kind() only lets the kinds above through
                raise GraphFormatError(f"{where}: node type cannot be persisted (SAVE refused)")
    finally:
        probe.close()
    edges: list[list[int]] = []
    count = drv.cuGraphGetEdges(graph, 0)[-1]
    if count:
        err, frm, to, data, count = drv.cuGraphGetEdges(graph, count)
        if int(err) != 0:
            raise GraphFormatError(f"cuGraphGetEdges failed: {err!r}")
        for a, b, d in zip(frm, to, data, strict=True):
            edges.append([index[int(a)], index[int(b)], int(d.from_port), int(d.to_port), int(d.type)])
    desc = {"format": 1, "nodes": out_nodes, "edges": edges, "funcs": func_list, "blob_size": len(blob)}
    if len(numbering):
        desc["events"] = event_table(numbering)
    desc["blob_sha256"] = hashlib.sha256(blob).hexdigest()
    table = pack_kernel_table(desc)
    desc["table_size"] = len(table)
    desc["table_sha256"] = hashlib.sha256(table).hexdigest()
    return SavedGraph(desc, bytes(blob), pointers, table)


# Packed kernel-node table for the native fast path (native/gp_core.h: gp_knode_t, gp_kattr_t):
# header (4 x u64: kernel nodes, parameter offsets, attributes, 0), nodes, u32 offsets, attributes.
_KNODE = struct.Struct("<II3I3IIIQIIII")
_KATTR = struct.Struct("<II64s")
_HEADER = struct.Struct("<4Q")


def pack_kernel_table(desc: dict[str, Any]) -> bytes:
    """The kernel nodes of `desc` in the native layout; written at SAVE so LOAD does no per-node Python."""
    nodes, offsets, attrs = bytearray(), [], bytearray()
    n_k = n_a = 0
    for i, nd in enumerate(desc["nodes"]):
        if nd["type"] != "kernel":
            continue
        a_off = n_a
        for aid, hexval in sorted(nd["attrs"].items(), key=lambda kv: int(kv[0])):
            attrs += _KATTR.pack(int(aid), 0, bytes.fromhex(hexval).ljust(_ATTR_BYTES, b"\0"))
            n_a += 1
        layout = nd["layout"]
        nodes += _KNODE.pack(i, nd["func"], *nd["grid"], *nd["block"], nd["smem"], len(layout), nd["params"][0],
                             len(offsets), n_a - a_off, a_off, 0)  # fmt: skip
        offsets += [o for o, _s in layout]
        n_k += 1
    head = _HEADER.pack(n_k, len(offsets), n_a, 0)
    return head + bytes(nodes) + struct.pack(f"<{len(offsets)}I", *offsets) + bytes(attrs)


def topology_fingerprint(desc: dict[str, Any]) -> str:
    """Hash of node kinds, kernels, launch shapes, attributes, event indices and edges (not parameter values).

    Event nodes enter as (kind, event index): handle values are never in a description. The event table is
    hashed only when present, so graphs without events keep the fingerprint they had before events existed.
    """
    topo = [
        {k: v for k, v in nd.items() if k not in ("params", "dst", "srcDevice", "dstDevice")} for nd in desc["nodes"]
    ]
    shape: dict[str, Any] = {"nodes": topo, "edges": desc["edges"]}
    if desc.get("events"):
        shape["events"] = desc["events"]
    text = json.dumps(shape, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def address_fingerprint(desc: dict[str, Any], blob: bytes, lo: int, hi: int) -> str:
    """Hash of the topology plus every in-region address each node embeds, with its position.

    Raw parameter bytes are not hashed: structs passed by value carry uninitialized padding from the launching
    host stack, which differs between two identical SAVEs without changing what the kernel does.
    """
    where = []
    for i, nd in enumerate(desc["nodes"]):
        if nd["type"] == "kernel":
            off, size = nd["params"]
            chunk = blob[off : off + size]
            words = struct.unpack_from(f"<{size // 8}Q", chunk) if size >= 8 else ()
            where.append([i, [[8 * j, v] for j, v in enumerate(words) if lo <= v < hi]])
        else:
            where.append([i, [nd.get(k) for k in ("dst", "srcDevice", "dstDevice") if k in nd]])
    text = json.dumps([topology_fingerprint(desc), where], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def verify_blob(name: str, desc: dict[str, Any], blob: bytes) -> None:
    """Refuses a graph whose parameter file is truncated or altered, before anything is rebuilt."""
    if len(blob) != desc["blob_size"]:
        raise GraphFormatError(
            f"graph {name!r}: parameter file is truncated or padded ({len(blob)} bytes, expected {desc['blob_size']})"
        )
    if hashlib.sha256(blob).hexdigest() != desc["blob_sha256"]:
        raise GraphFormatError(f"graph {name!r}: parameter file content does not match its recorded sha256")


def create_events(name: str, desc: dict[str, Any]) -> list[Any]:
    """One fresh CUevent per event index of `desc`, in index order (empty when the graph has no event nodes).

    The caller keeps them alive as long as the graph and its executable exist: the nodes hold the handles.
    """
    drv = _drv()
    return [check(drv.cuEventCreate(flags), f"graph {name!r}: cuEventCreate(event {i}, flags {flags:#x})")
            for i, flags in enumerate(check_events(name, desc))]  # fmt: skip


def rebuild(name: str, desc: dict[str, Any], blob: bytes, funcs: Any, events: Sequence[Any] = ()) -> Any:
    """Re-creates the graph: nodes without dependencies first, then all edges in one call. Returns a CUgraph.

    `funcs(sha, name, func_attrs)` returns the live CUfunction for a kernel node; `events[i]` is the live
    CUevent for event index i (from create_events).
    """
    verify_blob(name, desc, blob)
    _check_event_count(name, desc, events)
    drv = _drv()
    graph = check(drv.cuGraphCreate(0), "cuGraphCreate")
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    keep = ctypes.create_string_buffer(blob, len(blob) or 1)
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
                for a in _attr_ids():
                    err, v = drv.cuGraphKernelNodeGetAttribute(node, a)
                    if int(err) == 0:
                        fresh[str(int(a))] = ctypes.string_at(v.getPtr(), _ATTR_BYTES)
                defaults[nd["func"]] = fresh
            for aid, hexval in nd["attrs"].items():
                raw = bytes.fromhex(hexval).ljust(_ATTR_BYTES, b"\0")
                if defaults[nd["func"]].get(aid) == raw:
                    continue
                ctypes.memmove(val_ptr, raw, _ATTR_BYTES)
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
        for k in _MEMCPY_FIELDS:
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
    frm = [made[e[0]] for e in edges]
    to = [made[e[1]] for e in edges]
    data = None
    if any(e[2] or e[3] or e[4] for e in edges):
        data = []
        for e in edges:
            d = drv.CUgraphEdgeData()
            d.from_port, d.to_port, d.type = e[2], e[3], e[4]
            data.append(d)
    check(drv.cuGraphAddDependencies(graph, frm, to, data, len(frm)), f"graph {name!r}: cuGraphAddDependencies")


def rebuild_native(
    name: str, desc: dict[str, Any], blob: bytes, table: bytes, funcs: Sequence[Any], events: Sequence[Any] = ()
) -> Any:
    """rebuild() through the interposer's gp_add_kernel_nodes/gp_add_edges: one native call per graph.

    `funcs[i]` is the live CUfunction for desc["funcs"][i]; `events` as for rebuild(). Non-kernel nodes (event
    nodes included) are added from Python into the same node-index slots after the kernel nodes, so the edges,
    which refer to node indices, stay right; edges with edge data take the Python path.
    """
    from graphpersist import region

    verify_blob(name, desc, blob)
    _check_event_count(name, desc, events)
    drv = _drv()
    if len(table) != desc["table_size"] or hashlib.sha256(table).hexdigest() != desc["table_sha256"]:
        raise GraphFormatError(f"graph {name!r}: kernel table is truncated or altered")
    lib = region.lib()
    graph = check(drv.cuGraphCreate(0), "cuGraphCreate")
    n = len(desc["nodes"])
    out = (ctypes.c_void_p * max(n, 1))()
    n_k, n_off, _n_attr, _ = _HEADER.unpack_from(table)
    tbuf = ctypes.create_string_buffer(table, len(table))
    bbuf = ctypes.create_string_buffer(blob, len(blob) or 1)
    t0 = ctypes.addressof(tbuf) + _HEADER.size
    t_off = t0 + n_k * _KNODE.size
    t_attr = t_off + 4 * n_off
    fn = (ctypes.c_void_p * max(len(funcs), 1))(*[int(f) for f in funcs])
    rc = lib.gp_add_kernel_nodes(
        ctypes.c_void_p(int(graph)), ctypes.c_size_t(n_k), ctypes.c_void_p(t0), bbuf, ctypes.c_void_p(t_off),
        ctypes.c_void_p(t_attr), fn, ctypes.c_size_t(len(funcs)), out,
    )  # fmt: skip
    if rc != 0:
        raise GraphFormatError(f"graph {name!r}: {region.last_error()}")
    ctx = None
    for i, nd in enumerate(desc["nodes"]):
        if nd["type"] != "kernel":
            ctx = ctx or check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
            out[i] = int(_add_plain_node(drv, graph, ctx, name, i, nd, events))
    edges = desc["edges"]
    if edges and not any(e[2] or e[3] or e[4] for e in edges):
        frm = (ctypes.c_uint32 * len(edges))(*[e[0] for e in edges])
        to = (ctypes.c_uint32 * len(edges))(*[e[1] for e in edges])
        if lib.gp_add_edges(ctypes.c_void_p(int(graph)), out, ctypes.c_size_t(len(edges)), frm, to) != 0:
            raise GraphFormatError(f"graph {name!r}: {region.last_error()}")
    elif edges:
        nodes = [drv.CUgraphNode(out[i]) for i in range(n)]
        _add_edges(drv, graph, name, nodes, edges)
    return graph


def instantiate(name: str, graph: Any) -> Any:
    drv = _drv()
    return check(drv.cuGraphInstantiate(graph, 0), f"graph {name!r}: cuGraphInstantiate")
