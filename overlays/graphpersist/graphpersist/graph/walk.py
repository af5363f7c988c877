"""SAVE side of a graph: walk a captured CUgraph into a description, a parameter blob and a kernel table.

Kernel parameters are read through kernelParams or the `extra` buffer, laid out by cuFuncGetParamInfo; every
readable launch attribute is copied byte for byte. Node types the format cannot persist make SAVE fail naming the
node: a silent archive would replay something different.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphpersist.graph.format import (
    ATTR_BYTES,
    MEMCPY_FIELDS,
    EventNumbering,
    GraphFormatError,
    attr_ids,
    check_memcpy_kinds,
    driver,
    event_node,
    event_table,
    node_kind,
    node_type_name,
    pack_kernel_table,
)
from graphpersist.graph.images import ImageTable, check, func_attributes
from graphpersist.records import HostMemory

# Launch attributes whose values are process-local handles: they cannot be persisted.
_EVENT_ATTRS = {"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT", "CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT"}


def _param_layout(func: Any, name: str) -> list[tuple[int, int]]:
    """(offset, size) of each kernel parameter. The driver answers CUDA_ERROR_INVALID_VALUE past the last
    one; any other error would silently truncate the parameters, so it refuses."""
    drv = driver()
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


def _holding(ranges: list[Any], starts: list[int], v: int) -> Any:
    """The entry of sorted, disjoint (addr, size, ...) `ranges` (their addresses: `starts`) that holds `v`, or None."""
    i = bisect.bisect_right(starts, v) - 1
    return ranges[i] if i >= 0 and v < ranges[i][0] + ranges[i][1] else None


class _ForeignPointers:
    """Refuses device addresses outside the fixed region: LOAD cannot recreate them (pinned host memory, managed
    memory, module globals, allocations made before the region existed). A parameter word counts as an address
    when the driver knows it (cuPointerGetAttribute succeeds); answers are cached per value. Words in restorable
    pinned host memory (HostMemory) are collected in `host` instead."""

    def __init__(self, lo: int, hi: int, host_memory: HostMemory | None = None) -> None:
        self.lo, self.hi = lo, hi
        self.known: dict[int, str | None] = {}
        self.host_memory = host_memory or HostMemory()
        # the ranges' start addresses, once: every parameter word of every kernel node is looked up in them
        self._restorable_starts = [r[0] for r in self.host_memory.restorable]
        self._other_starts = [r[0] for r in self.host_memory.others]
        self.host: set[int] = set()

    def kind(self, v: int) -> str | None:
        """The memory type of a CUDA-known address, or None for a plain number."""
        if v not in self.known:
            drv = driver()
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
            elif _ADDR_LO <= v < _ADDR_HI and _holding(self.host_memory.restorable, self._restorable_starts, v):
                self.host.add(v)
            elif _ADDR_LO <= v < _ADDR_HI and (other := _holding(self.host_memory.others, self._other_starts, v)):
                raise GraphFormatError(
                    f"{where}: parameter bytes {8 * j}..{8 * j + 7} hold {v:#x}, in pinned host memory "
                    f"{other[0]:#x}+{other[1]} that LOAD cannot put at the same address: {other[2]} (SAVE refused)"
                )
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

    def __init__(self, answers: dict[tuple[int, int], int]) -> None:
        self.graph: Any = None
        self.answers = answers  # per SAVE (ImageTable.fresh_attrs): a kernel's answer is the same in every graph

    def unreadable_on_fresh(self, p: Any, layout: list[tuple[int, int]], params: bytes, attr: Any) -> int:
        """The error code a fresh node of `p.func` gives for `attr` (0 when it reads fine)."""
        key = (int(p.func), int(attr))
        if key not in self.answers:  # the driver is asked once per kernel and attribute; later nodes read the cache
            drv = driver()
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
            driver().cuGraphDestroy(self.graph)
            self.graph = None


class _AttrReader:
    """Every launch attribute of a kernel node as (attribute, driver error, 64 value bytes): one native call per
    node where the interposer is loaded (SAVE always runs under it), else one cuda-bindings call per attribute."""

    def __init__(self, attrs: list[Any]) -> None:
        from graphpersist.memory import region

        self.attrs = attrs
        self.ids = (ctypes.c_uint32 * max(len(attrs), 1))(*[int(a) for a in attrs])
        self.values = ctypes.create_string_buffer(ATTR_BYTES * max(len(attrs), 1))
        self.errs = (ctypes.c_int32 * max(len(attrs), 1))()
        self.native = region.lib().gp_kernel_node_attrs if region.loaded() else None

    def read(self, node: Any) -> list[tuple[Any, int, bytes]]:
        if self.native is None:
            drv = driver()
            out = []
            for a in self.attrs:
                err, v = drv.cuGraphKernelNodeGetAttribute(node, a)
                out.append((a, int(err), ctypes.string_at(v.getPtr(), ATTR_BYTES) if int(err) == 0 else b""))
            return out
        if self.native(ctypes.c_void_p(int(node)), self.ids, len(self.attrs), self.values, self.errs) != 0:
            from graphpersist.memory import region

            raise GraphFormatError(f"reading launch attributes: {region.last_error()}")
        raw = self.values.raw
        return [(a, self.errs[i], raw[i * ATTR_BYTES : (i + 1) * ATTR_BYTES]) for i, a in enumerate(self.attrs)]


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
    """A serialized graph: `desc` (JSON-able), `blob` (parameter bytes), and the in-region addresses it uses:
    `pointers` every one, `addresses` those that are addresses by their field (memset and memcpy nodes); the others
    are kernel-parameter words that lie in the region, which may also be numbers (setup.param_values)."""

    desc: dict[str, Any]
    blob: bytes
    pointers: set[int]
    table: bytes
    addresses: set[int] = field(default_factory=set)
    host: set[int] = field(default_factory=set)  # kernel-parameter words in restorable pinned host memory


def _kernel_info(table: ImageTable, func: Any) -> tuple[str, str, list[tuple[int, int]], dict[str, int], str]:
    """(image sha256, name, parameter layout, settable attributes, function key) of a CUfunction, read once per
    SAVE: an engine's graphs launch the same few hundred kernels hundreds of thousands of times, and all captures
    are done when SAVE reads them, so every node of one function would read the same answers."""
    key = int(func)
    info = table.kernels.get(key)
    if info is None:
        sha, name, _load = table.resolve(func)
        fattrs = func_attributes(func)
        info = (sha, name, _param_layout(func, name), fattrs, json.dumps([sha, name, fattrs], sort_keys=True))
        table.kernels[key] = info
    return info


# (kernel name, parameter layout) -> byte ranges [start, end) of the parameters the kernel never reads (save.Saver).
UnusedBytes = Callable[[str, list[tuple[int, int]]], list[tuple[int, int]]]


class CachedUnused:
    """An engine's `unused_param_bytes`, asked once per kernel of a SAVE (its graphs launch a few hundred kernels
    hundreds of thousands of times), its answer checked to lie within the parameters. `named` keeps the kernels it
    answered with bytes to zero, so SAVE can say which rules fired (a rule that never fires is visible in the log)."""

    def __init__(self, fn: UnusedBytes) -> None:
        self.fn = fn
        self.answers: dict[tuple[str, tuple[tuple[int, int], ...]], list[tuple[int, int]]] = {}

    def __call__(self, name: str, layout: list[tuple[int, int]]) -> list[tuple[int, int]]:
        key = (name, tuple(layout))
        if key not in self.answers:
            total = max((o + s for o, s in layout), default=0)
            ranges = [(int(a), int(b)) for a, b in self.fn(name, list(layout))]
            if bad := [(a, b) for a, b in ranges if not 0 <= a <= b <= total]:
                raise GraphFormatError(f"kernel {name!r}: unused parameter bytes {bad[0]} outside its {total} bytes")
            self.answers[key] = ranges
        return self.answers[key]

    @property
    def named(self) -> dict[str, list[tuple[int, int]]]:
        """Kernel name -> the byte ranges zeroed, for every kernel the engine named bytes of."""
        return {name: ranges for (name, _layout), ranges in self.answers.items() if ranges}


def cached_unused(fn: UnusedBytes | None) -> CachedUnused | None:
    """`fn` behind a CachedUnused; None stays None (nothing is zeroed)."""
    return None if fn is None else CachedUnused(fn)


def zero_ranges(params: bytes, ranges: list[tuple[int, int]]) -> bytes:
    """`params` with every byte in `ranges` set to zero."""
    if not ranges:
        return params
    buf = bytearray(params)
    for a, b in ranges:
        buf[a:b] = bytes(b - a)
    return bytes(buf)


def serialize(
    graph: Any,
    table: ImageTable,
    region_lo: int,
    region_hi: int,
    unused: UnusedBytes | None = None,
    host_memory: HostMemory | None = None,
) -> SavedGraph:
    """Walks `graph` (a CUgraph) into a SavedGraph; raises GraphFormatError naming any unsupported node."""
    drv = driver()
    n = check(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1]
    nodes = check(drv.cuGraphGetNodes(graph, n), "cuGraphGetNodes")[0] if n else []
    index = {int(nd): i for i, nd in enumerate(nodes)}
    walk = _Walk(table, unused, _ForeignPointers(region_lo, region_hi, host_memory))
    try:
        out_nodes = [walk.node(drv, i, nd) for i, nd in enumerate(nodes)]
    finally:
        walk.probe.close()
    return walk.saved(out_nodes, _edges(drv, graph, index))


class _Walk:
    """One graph's walk: each node's description, and what the nodes add up to (the parameter blob, the function
    table, the addresses in the region and in pinned host memory, the events)."""

    def __init__(self, table: ImageTable, unused: UnusedBytes | None, foreign: _ForeignPointers) -> None:
        self.table, self.unused, self.foreign = table, unused, foreign
        self.blob = bytearray()
        self.pointers: set[int] = set()
        self.addresses: set[int] = set()
        self.attr_reader = _AttrReader(attr_ids())
        self.funcs: dict[str, int] = {}
        self.func_list: list[list[Any]] = []
        self.numbering = EventNumbering()
        self.probe = _AttrProbe(table.fresh_attrs)

    def node(self, drv: Any, i: int, nd: Any) -> dict[str, Any]:
        """Node `i`'s description; GraphFormatError for a node the format cannot persist."""
        T = drv.CUgraphNodeType
        t = check(drv.cuGraphNodeGetType(nd), "cuGraphNodeGetType")
        type_name = node_type_name(t)
        where = f"node {i} ({type_name})"
        kind = node_kind(i, type_name)
        if t == T.CU_GRAPH_NODE_TYPE_KERNEL:
            return self.kernel(drv, where, nd)
        if t == T.CU_GRAPH_NODE_TYPE_MEMSET:
            m = check(drv.cuGraphMemsetNodeGetParams(nd), f"{where}: cuGraphMemsetNodeGetParams")
            fields = {k: int(getattr(m, k)) for k in ("dst", "pitch", "value", "elementSize", "width", "height")}
            self.foreign.check_address(where, "dst", fields["dst"])
            self.addresses.add(fields["dst"])
            return {"type": "memset", **fields}
        if t == T.CU_GRAPH_NODE_TYPE_MEMCPY:
            c = check(drv.cuGraphMemcpyNodeGetParams(nd), f"{where}: cuGraphMemcpyNodeGetParams")
            kinds = (int(c.srcMemoryType), int(c.dstMemoryType))
            check_memcpy_kinds(where, *kinds)
            fields = {k: int(getattr(c, k)) for k in MEMCPY_FIELDS}
            for k in ("srcDevice", "dstDevice"):
                self.foreign.check_address(where, k, fields[k])
                self.addresses.add(fields[k])
            return {"type": "memcpy", "srcMemoryType": kinds[0], "dstMemoryType": kinds[1], **fields}
        if t == T.CU_GRAPH_NODE_TYPE_EMPTY:
            return {"type": "empty"}
        if t == T.CU_GRAPH_NODE_TYPE_EVENT_RECORD:
            ev = check(drv.cuGraphEventRecordNodeGetEvent(nd), f"{where}: cuGraphEventRecordNodeGetEvent")
            return event_node(kind, int(ev), self.numbering)
        if t == T.CU_GRAPH_NODE_TYPE_WAIT_EVENT:
            ev = check(drv.cuGraphEventWaitNodeGetEvent(nd), f"{where}: cuGraphEventWaitNodeGetEvent")
            return event_node(kind, int(ev), self.numbering)
        # node_kind() only lets the kinds above through
        raise GraphFormatError(f"{where}: node type cannot be persisted (SAVE refused)")

    def kernel(self, drv: Any, where: str, nd: Any) -> dict[str, Any]:
        """A kernel node's description; its parameters go to the blob, its function to the function table."""
        p = check(drv.cuGraphKernelNodeGetParams(nd), f"{where}: cuGraphKernelNodeGetParams")
        sha, name, layout, fattrs, fkey = _kernel_info(self.table, p.func)
        params = _read_params(p, layout, name)
        if self.unused is not None:
            params = zero_ranges(params, self.unused(name, layout))
        self.pointers |= self.foreign.scan_params(f"{where} kernel {name!r}", params)
        attrs = self.launch_attrs(where, name, nd, p, layout, params)
        if fkey not in self.funcs:
            self.funcs[fkey] = len(self.func_list)
            self.func_list.append([sha, name, fattrs])
        out = {
            "type": "kernel",
            "func": self.funcs[fkey],
            "image": sha,
            "name": name,
            "grid": [p.gridDimX, p.gridDimY, p.gridDimZ],
            "block": [p.blockDimX, p.blockDimY, p.blockDimZ],
            "smem": p.sharedMemBytes,
            "layout": layout,
            "params": [len(self.blob), len(params)],
            "attrs": attrs,
        }
        self.blob += params
        return out

    def launch_attrs(
        self, where: str, name: str, nd: Any, p: Any, layout: list[tuple[int, int]], params: bytes
    ) -> dict[str, str]:
        """Every launch attribute the node reads back, as hex without trailing zeros (restored at LOAD); one it cannot
        read must be unreadable on a fresh node of the kernel too, or its value would be lost."""
        attrs: dict[str, str] = {}
        for a, err, raw in self.attr_reader.read(nd):
            if err != 0:
                fresh = self.probe.unreadable_on_fresh(p, layout, params, a)
                if fresh != err:
                    raise GraphFormatError(
                        f"{where} kernel {name!r}: reading launch attribute {a.name} failed (error {err}) but "
                        f"a fresh node of the same kernel answers {fresh}: its value would be lost (SAVE "
                        "refused)"
                    )
                continue
            if a.name in _EVENT_ATTRS and any(raw):
                raise GraphFormatError(f"{where} kernel {name!r}: launch attribute {a.name} holds an event")
            attrs[str(int(a))] = raw.rstrip(b"\0").hex()  # trailing zeros restored at LOAD
        return attrs

    def saved(self, out_nodes: list[dict[str, Any]], edges: list[list[int]]) -> SavedGraph:
        """The walked graph: its description (with its blob's and kernel table's sizes and hashes) and addresses."""
        blob = self.blob
        desc = {"format": 1, "nodes": out_nodes, "edges": edges, "funcs": self.func_list, "blob_size": len(blob)}
        if len(self.numbering):
            desc["events"] = event_table(self.numbering)
        desc["blob_sha256"] = hashlib.sha256(blob).hexdigest()
        table = pack_kernel_table(desc)
        desc["table_size"] = len(table)
        desc["table_sha256"] = hashlib.sha256(table).hexdigest()
        pointers = self.pointers | self.addresses
        return SavedGraph(desc, bytes(blob), pointers, table, self.addresses, self.foreign.host)


def _edges(drv: Any, graph: Any, index: dict[int, int]) -> list[list[int]]:
    """The graph's edges as [from node, to node, from port, to port, type], by node index."""
    edges: list[list[int]] = []
    count = drv.cuGraphGetEdges(graph, 0)[-1]
    if count:
        err, frm, to, data, count = drv.cuGraphGetEdges(graph, count)
        if int(err) != 0:
            raise GraphFormatError(f"cuGraphGetEdges failed: {err!r}")
        for a, b, d in zip(frm, to, data, strict=True):
            edges.append([index[int(a)], index[int(b)], int(d.from_port), int(d.to_port), int(d.type)])
    return edges
