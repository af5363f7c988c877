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
# Function attributes a library may raise on its kernels before launching them (cuFuncSetAttribute); a freshly
# loaded copy starts from the defaults, so LOAD sets them again: 8 MAX_DYNAMIC_SHARED_SIZE_BYTES,
# 9 PREFERRED_SHARED_MEMORY_CARVEOUT, 11-13 REQUIRED_CLUSTER_WIDTH/HEIGHT/DEPTH,
# 14 NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 15 CLUSTER_SCHEDULING_POLICY_PREFERENCE. SAVE records only these, and a
# description naming another is refused (LOAD would hand its number to the driver's enum).
SETTABLE_FUNC_ATTRS = (8, 9, 11, 12, 13, 14, 15)
_FUNC_ATTR_KEYS = frozenset(map(str, SETTABLE_FUNC_ATTRS))
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
        raise GraphFormatError(f"graph {name!r}: malformed event table {repr(table)[:80]}") from None
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


def kernel_row(table: bytes | memoryview, row: int) -> tuple[int, int, int, list[int]]:
    """(node index, function index, parameter blob offset, parameter offsets) of row `row` of a packed kernel table
    (one checked by table_problem): what LOAD names when a row does not fit its live function."""
    n_k = TABLE_HEADER.unpack_from(table)[0]
    f = KNODE.unpack_from(table, TABLE_HEADER.size + row * KNODE.size)
    node, func, n_params, params_off, layout_off = f[0], f[1], f[9], f[10], f[11]
    at = TABLE_HEADER.size + n_k * KNODE.size + 4 * layout_off
    return node, func, params_off, list(struct.unpack_from(f"<{n_params}I", table, at))


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
    fingerprint needs; `graphpersist check` parses them). Works on descriptions with kernel nodes reduced to stubs.
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


# What LOAD checks of a description before the native rebuild indexes arrays with its numbers: every field a
# rebuild reads has its type and range, and the kernel table's counts and offsets stay inside the table, the
# parameter blob, the node list and the function table (gp_add_kernel_nodes trusts them). Descriptions from a graph
# pack whose hashes match were written by SAVE; these checks keep a damaged or forged one from reaching C.
_U64 = (1 << 64) - 1
_PLAIN_FIELDS = {
    "memset": ("dst", "pitch", "value", "elementSize", "width", "height"),
    "memcpy": ("srcMemoryType", "dstMemoryType", *MEMCPY_FIELDS),
    "empty": (),
    "event_record": ("event",),
    "event_wait": ("event",),
}
_MAX_PARAMS = 4096  # gp_add_kernel_nodes' parameter array
_WORDS = KNODE.size // 4  # a kernel row as u32 words: index, func, grid[3], block[3], smem, n_params,
# params_off (2 words), layout_off, n_attrs, attrs_off, padding


def _uint(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _U64


def plain_node_problem(i: int, nd: Any) -> str | None:
    """Why non-kernel node `i` of a description cannot be rebuilt (graphbuild._add_plain_node reads these)."""
    if not isinstance(nd, dict):
        return f"node {i} is a {type(nd).__name__}, not an object"
    kind = nd.get("type")
    fields = _PLAIN_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return f"node {i}: unknown node type {kind!r}"[:200]
    if set(nd) != {"type", *fields}:
        return f"node {i} ({kind}): fields {sorted(map(str, nd))[:12]} are not {sorted(fields)}"[:300]
    bad = [k for k in fields if not _uint(nd.get(k))]
    if bad:
        return f"node {i} ({kind}): {', '.join(bad)} must be integers from 0 to 2**64-1"
    if kind == "memcpy" and (nd["srcMemoryType"] not in _DEVICE_MEMORY or nd["dstMemoryType"] not in _DEVICE_MEMORY):
        return f"node {i} (memcpy): memory types {nd['srcMemoryType']}, {nd['dstMemoryType']} are not device memory"
    return None


def func_problem(j: int, func: Any, images: set[str]) -> str | None:
    """Why entry `j` of a function table ([image sha256, kernel name, {attribute: value}]) cannot be resolved."""
    if type(func) is not list or len(func) != 3:
        return f"function {j} is not [image sha256, kernel name, attributes]"
    sha, name, attrs = func
    if not isinstance(sha, str) or sha not in images:
        return f"function {j} names image {str(sha)[:16]!r}, which the rank record does not list"
    if not isinstance(name, str) or not name or "\0" in name:
        return f"function {j}: kernel name {name!r:.80} is not a non-empty string without NUL"
    if not isinstance(attrs, dict) or not all(
        k in _FUNC_ATTR_KEYS and type(v) is int and -(2**31) <= v < 2**31 for k, v in attrs.items()
    ):
        return (f"function {j}: attributes must map attribute numbers ({', '.join(sorted(_FUNC_ATTR_KEYS, key=int))}) "
                "to 32-bit integers")  # fmt: skip
    return None


def table_problem(light: dict[str, Any], table: bytes | memoryview, blob_size: int, n_funcs: int) -> str | None:
    """Why a kernel table cannot drive gp_add_kernel_nodes for this light description (kernel nodes as stubs):
    its length against its header, each row's node index (exactly the kernel nodes, in order), function index,
    parameter offsets (their starts inside the blob), and its runs of offsets and attributes (inside the table). None
    when sound. How long each parameter is only the live function says: gp_add_kernel_nodes holds every row to its
    function's layout and every parameter's end to the blob's at LOAD (graph.build.rebuild_native)."""
    if len(table) < TABLE_HEADER.size:
        return f"kernel table of {len(table)} bytes has no header"
    n_k, n_off, n_attr, _zero = TABLE_HEADER.unpack_from(table)
    want = TABLE_HEADER.size + n_k * KNODE.size + 4 * n_off + n_attr * KATTR.size
    if len(table) != want:
        return f"kernel table is {len(table)} bytes, its header ({n_k} nodes, {n_off} offsets, {n_attr} attributes) " \
               f"says {want}"  # fmt: skip
    kernels = [i for i, nd in enumerate(light["nodes"]) if nd.get("type") == "kernel"]
    if n_k != len(kernels):
        return f"kernel table lists {n_k} kernel nodes, the description {len(kernels)}"
    if not n_k:
        return None
    view = memoryview(table)
    rows = view[TABLE_HEADER.size : TABLE_HEADER.size + n_k * KNODE.size].cast("I")
    offsets = view[TABLE_HEADER.size + n_k * KNODE.size : TABLE_HEADER.size + n_k * KNODE.size + 4 * n_off].cast("I")
    col = [rows[k::_WORDS].tolist() for k in range(_WORDS)]
    if col[0] != kernels:
        return "kernel table rows do not name the description's kernel nodes in order"
    if max(col[1]) >= n_funcs:
        return f"kernel table names function {max(col[1])} of {n_funcs}"
    n_params, layout_off, n_attrs, attrs_off = col[9], col[12], col[13], col[14]
    params_off = [lo | hi << 32 for lo, hi in zip(col[10], col[11], strict=True)]
    if max(n_params) > _MAX_PARAMS:
        return f"kernel table has a node of {max(n_params)} parameters (at most {_MAX_PARAMS})"
    if any(o + n > n_off for o, n in zip(layout_off, n_params, strict=True)):
        return "kernel table has a parameter-offset run past its offsets"
    if any(o + n > n_attr for o, n in zip(attrs_off, n_attrs, strict=True)):
        return "kernel table has an attribute run past its attributes"
    last: dict[tuple[int, int], int] = {}  # per offset run: its largest offset (runs are shared, few and short)
    for key in set(zip(layout_off, n_params, strict=True)):
        o, n = key
        last[key] = max(offsets[o : o + n].tolist()) if n else -1
    for off, o, n in zip(params_off, layout_off, n_params, strict=True):
        if n and off + last[(o, n)] >= blob_size:
            return f"kernel table has a parameter at byte {off + last[(o, n)]} of a {blob_size}-byte blob"
    return None


def kernel_node_problem(i: int, nd: Any, blob_size: int, n_funcs: int) -> str | None:
    """Why full kernel node `i` (from a graph pack's kernel part) is malformed: what pack_kernel_table, the topology
    fingerprint, the reference rebuild and `graphpersist diff` read of it."""
    if not isinstance(nd, dict) or nd.get("type") != "kernel":
        return f"node {i} is not a kernel node"
    func, name, image, attrs, layout, params = (nd.get(k) for k in ("func", "name", "image", "attrs", "layout",
                                                                     "params"))  # fmt: skip
    if type(func) is not int or not 0 <= func < n_funcs:
        return f"node {i}: function index {func!r:.40} outside the {n_funcs} functions"
    if not isinstance(name, str) or not isinstance(image, str):
        return f"node {i}: name and image must be strings"
    for key in ("grid", "block"):
        value = nd.get(key)
        if type(value) is not list or len(value) != 3 or not all(type(v) is int and 0 <= v < 2**32 for v in value):
            return f"node {i}: {key} must be three 32-bit unsigned integers"
    if type(nd.get("smem")) is not int or not 0 <= nd["smem"] < 2**32:
        return f"node {i}: smem must be a 32-bit unsigned integer"
    if type(params) is not list or len(params) != 2 or not all(_uint(v) for v in params) or sum(params) > blob_size:
        return f"node {i}: params must be [offset, length] inside the {blob_size}-byte blob"
    if (
        type(layout) is not list
        or len(layout) > _MAX_PARAMS
        or not all(
            type(p) is list
            and len(p) == 2
            and all(type(v) is int and 0 <= v < 2**32 for v in p)
            and p[0] + p[1] <= params[1]
            for p in layout
        )
    ):
        return f"node {i}: layout must be [offset, size] pairs inside its {params[1]} parameter bytes"
    if not isinstance(attrs, dict) or not all(_attr_ok(k, v) for k, v in attrs.items()):
        return f"node {i}: attributes must map attribute numbers to at most {ATTR_BYTES} hex-encoded bytes"
    return None


def _pair_in(pair: Any, size: int) -> bool:
    """[offset, size] of 32-bit numbers inside `size` bytes."""
    return (
        type(pair) is list and len(pair) == 2 and all(type(v) is int and 0 <= v < 2**32 for v in pair)
        and pair[0] + pair[1] <= size
    )  # fmt: skip


def attr_id(key: Any) -> bool:
    """Whether `key` names a launch attribute as descriptions do: ASCII digits of a 32-bit number (str.isdigit also
    takes "²", which int() refuses)."""
    return isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit() and int(key) < 2**32


def _attr_ok(key: Any, value: Any) -> bool:
    if not attr_id(key) or not isinstance(value, str):
        return False
    try:
        return len(bytes.fromhex(value)) <= ATTR_BYTES
    except ValueError:
        return False
