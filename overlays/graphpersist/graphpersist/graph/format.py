"""The graph description format: node kinds, event numbering, fingerprints, the packed kernel table.

A saved graph is a JSON description (nodes, edges, kernel functions, event table), one binary blob of kernel
parameter bytes and a kernel table packed for the native rebuild (native/gp_core.h). This module holds what both
sides agree on and what can be checked without a GPU; graphwalk writes descriptions (SAVE), graphbuild rebuilds
them (LOAD). It imports no CUDA bindings at module level.

Events: a CUevent handle is process-local, so the description holds only an event *index* (distinct handles
numbered in order of first appearance). LOAD creates one fresh event per index (`create_events`) and the loaded
graph records/waits on those; an engine that records or waits on the same events outside the graph must use the
live ones (`LoadedGraph.events`). The driver has no call to read an event's creation flags, so every event is
recreated with CU_EVENT_DISABLE_TIMING, what torch.cuda.Event() uses by default (external events included):
an engine that times such events with cuEventElapsedTime would get an error, not a wrong number.
"""

from __future__ import annotations

import hashlib
import json
import struct
from operator import itemgetter
from typing import Any

ATTR_BYTES = 64  # sizeof(CUlaunchAttributeValue)
MEMCPY_FIELDS = (
    "srcXInBytes", "srcY", "srcZ", "srcLOD", "srcPitch", "srcHeight", "srcDevice",
    "dstXInBytes", "dstY", "dstZ", "dstLOD", "dstPitch", "dstHeight", "dstDevice",
    "WidthInBytes", "Height", "Depth",
)  # fmt: skip
_DEVICE_MEMORY = (2, 4)  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED
EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING: the flags every event is recreated with (see above)
# cuGraphInstantiate flags a LOAD may instantiate with: the ones torch gave the captured executable (measured on the
# GPU host, torch 2.11.0+cu130: AUTO_FREE_ON_LAUNCH; newer torch adds USE_NODE_PRIORITY, kernel nodes then run at their
# captured priority). UPLOAD is not a property of an executable; DEVICE_LAUNCH makes a graph the host could not
# replay as SAVE's.
INSTANTIATE_AUTO_FREE_ON_LAUNCH = 0x1
INSTANTIATE_USE_NODE_PRIORITY = 0x8
INSTANTIATE_FLAGS = INSTANTIATE_AUTO_FREE_ON_LAUNCH | INSTANTIATE_USE_NODE_PRIORITY

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
    if not flags and _EVENT_KINDS.isdisjoint(node_types(desc)):  # most graphs: no events, no per-node loop
        return flags
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


_EVENT_KINDS = frozenset(("event_record", "event_wait"))


def node_types(desc: dict[str, Any]) -> dict[str, int]:
    """How many nodes of each type, in first-seen order (counted in C: graphs have thousands of nodes)."""
    kinds = list(map(itemgetter("type"), desc["nodes"]))
    return {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}


def edge_ends(desc: dict[str, Any]) -> tuple[list[int], list[list[int]] | None]:
    """(from0, to0, from1, to1, ...) and each edge's [from_port, to_port, type] (None when all are 0), from a full
    description's `edges` or as a graph pack's light description stores them."""
    if "edges" not in desc:
        return desc["edge_ends"], desc.get("edge_data")
    edges = desc["edges"]
    data = [list(e[2:5]) for e in edges] if any(e[2] or e[3] or e[4] for e in edges) else None
    return [v for e in edges for v in e[:2]], data


def edge_lists(ends: list[int], data: list[list[int]] | None) -> list[list[int]]:
    """The description's `edges` ([from, to, from_port, to_port, type] each) from the stored ends and data."""
    it = iter(ends)
    if data is None:
        return [[a, b, 0, 0, 0] for a, b in zip(it, it, strict=False)]
    return [[a, b, *d] for (a, b), d in zip(zip(it, it, strict=False), data, strict=True)]


def driver() -> Any:
    """cuda.bindings.driver, imported on first use so this module loads without CUDA."""
    from cuda.bindings import driver

    return driver


_type_names: dict[int, str] = {}


def node_type_name(t: Any) -> str:
    """The CUgraphNodeType's name as NODE_KINDS spells it, matched by value (whatever the bindings print)."""
    if not _type_names:
        T = driver().CUgraphNodeType
        _type_names.update({int(getattr(T, n)): n for n in (*NODE_KINDS, *_REFUSED) if hasattr(T, n)})
    return _type_names.get(int(t), getattr(t, "name", str(t)))


def attr_ids() -> list[Any]:
    """Every kernel-node launch attribute id the bindings know (IGNORE excluded)."""
    drv = driver()
    return [a for a in drv.CUkernelNodeAttrID if a.name != "CU_LAUNCH_ATTRIBUTE_IGNORE"]


# Packed kernel-node table for the native fast path (native/gp_core.h: gp_knode_t, gp_kattr_t):
# header (4 x u64: kernel nodes, parameter offsets, attributes, 0), nodes, u32 offsets, attributes.
# Each node names its attributes by (attrs_off, n_attrs) into the attribute rows and its parameter offsets by
# (layout_off, n_params) into the offset rows; nodes with equal attribute sets (or equal layouts) share one run of
# rows. A kernel node reads back every launch attribute (14 on an H200, 72 bytes each, mostly zeros), so without
# sharing the rows were 90 % of an engine's graph pack; gp_add_kernel_nodes reads them by offset either way.
KNODE = struct.Struct("<II3I3IIIQIIII")
KATTR = struct.Struct("<II64s")
TABLE_HEADER = struct.Struct("<4Q")


def pack_kernel_table(desc: dict[str, Any]) -> bytes:
    """The kernel nodes of `desc` in the native layout; written at SAVE so LOAD does no per-node Python."""
    nodes, offsets, attrs = bytearray(), [], bytearray()
    attr_runs: dict[tuple[tuple[str, str], ...], int] = {}
    layout_runs: dict[tuple[int, ...], int] = {}
    n_k = n_a = 0
    for i, nd in enumerate(desc["nodes"]):
        if nd["type"] != "kernel":
            continue
        key = tuple(sorted(nd["attrs"].items(), key=lambda kv: int(kv[0])))
        a_off = attr_runs.get(key)
        if a_off is None:
            a_off = attr_runs[key] = n_a
            for aid, hexval in key:
                attrs += KATTR.pack(int(aid), 0, bytes.fromhex(hexval).ljust(ATTR_BYTES, b"\0"))
                n_a += 1
        layout = nd["layout"]
        offs = tuple(o for o, _s in layout)
        l_off = layout_runs.get(offs)
        if l_off is None:
            l_off = layout_runs[offs] = len(offsets)
            offsets += offs
        nodes += KNODE.pack(i, nd["func"], *nd["grid"], *nd["block"], nd["smem"], len(layout), nd["params"][0],
                             l_off, len(key), a_off, 0)  # fmt: skip
        n_k += 1
    head = TABLE_HEADER.pack(n_k, len(offsets), n_a, 0)
    return head + bytes(nodes) + struct.pack(f"<{len(offsets)}I", *offsets) + bytes(attrs)


# Node fields that hold values (parameter bytes, copy and memset addresses), not shape: outside the topology.
VALUE_KEYS = ("params", "dst", "srcDevice", "dstDevice")


def topology(desc: dict[str, Any]) -> dict[str, Any]:
    """Node kinds, kernels, launch shapes, attributes, event indices and edges (not parameter values): what
    topology_fingerprint hashes and `graphpersist diff` compares.

    Event nodes enter as (kind, event index): handle values are never in a description. The event table is
    included only when present, so graphs without events keep the fingerprint they had before events existed.
    """
    shape: dict[str, Any] = {
        "nodes": [{k: v for k, v in nd.items() if k not in VALUE_KEYS} for nd in desc["nodes"]],
        "edges": desc["edges"],
    }
    if desc.get("events"):
        shape["events"] = desc["events"]
    return shape


def topology_fingerprint(desc: dict[str, Any]) -> str:
    """Hash of the graph's topology (`topology`)."""
    text = json.dumps(topology(desc), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def address_fingerprint(desc: dict[str, Any], blob: bytes, lo: int, hi: int, topology_fp: str | None = None) -> str:
    """Hash of the topology plus every in-region address each node embeds, with its position.

    Raw parameter bytes are not hashed: structs passed by value carry uninitialized padding from the launching
    host stack, which differs between two identical SAVEs without changing what the kernel does. `topology_fp` is
    `topology_fingerprint(desc)` where the caller has it already (SAVE: a third of this function's time otherwise).
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
    text = json.dumps([topology_fp or topology_fingerprint(desc), where], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def verify_blob(name: str, desc: dict[str, Any], blob: bytes | memoryview, *, hashed: bool = False) -> None:
    """Refuses a graph whose parameter file is truncated or altered, before anything is rebuilt.

    `hashed=True`: the bytes come from an archive file whose sha256 was verified (a graph pack), so only the size
    is compared here; hashing them again would not catch anything the file hash did not.
    """
    if len(blob) != desc["blob_size"]:
        raise GraphFormatError(
            f"graph {name!r}: parameter file is truncated or padded ({len(blob)} bytes, expected {desc['blob_size']})"
        )
    if not hashed and hashlib.sha256(blob).hexdigest() != desc["blob_sha256"]:
        raise GraphFormatError(f"graph {name!r}: parameter file content does not match its recorded sha256")


def check_instantiate_flags(name: str, flags: int) -> None:
    """Refuses flags outside INSTANTIATE_FLAGS (SAVE reads them from torch's executable, LOAD repeats them)."""
    if flags & ~INSTANTIATE_FLAGS:
        raise GraphFormatError(
            f"graph {name!r}: instantiated with flags {flags:#x}; graphpersist repeats only {INSTANTIATE_FLAGS:#x} "
            "(auto-free-on-launch, use-node-priority)"
        )


def check_shape(
    name: str, desc: dict[str, Any], table: bytes | memoryview, node_count: int, nodes_by_type: dict[str, int]
) -> None:
    """Refuses a description whose node counts disagree with its rank record or its kernel table.

    What LOAD's native path checks of every graph without parsing each kernel node (that is what the topology
    fingerprint needs; see load(verify_topology=True)). Works on descriptions with kernel nodes reduced to stubs.
    """
    by_type = node_types(desc)
    if len(desc["nodes"]) != node_count or by_type != dict(nodes_by_type):
        raise GraphFormatError(
            f"graph {name!r}: description has {len(desc['nodes'])} nodes {by_type}, its record "
            f"{node_count} {dict(nodes_by_type)}"
        )
    n_k = TABLE_HEADER.unpack_from(table)[0] if len(table) >= TABLE_HEADER.size else None
    if n_k != by_type.get("kernel", 0):
        raise GraphFormatError(f"graph {name!r}: kernel table lists {n_k} kernel nodes, the description {by_type}")
