"""Serialize a captured CUDA graph's DAG and rebuild it in another process: the graph modules' public names.

`graphformat` (description format, fingerprints, kernel-table packing, verification; no CUDA needed),
`graphwalk` (SAVE: walk a CUgraph into a description) and `graphbuild` (LOAD: events, native rebuild, instantiate)
hold the code; this module re-exports what callers use.
"""

from __future__ import annotations

from graphpersist.graph.build import LiveFuncs, create_events, instantiate, rebuild_native
from graphpersist.graph.format import (
    EVENT_DISABLE_TIMING,
    NODE_KINDS,
    EventNumbering,
    GraphFormatError,
    address_fingerprint,
    check_events,
    check_memcpy_kinds,
    event_node,
    event_table,
    node_kind,
    node_type_name,
    pack_kernel_table,
    topology_fingerprint,
    verify_blob,
)
from graphpersist.graph.walk import SavedGraph, serialize

__all__ = [
    "EVENT_DISABLE_TIMING",
    "NODE_KINDS",
    "EventNumbering",
    "GraphFormatError",
    "LiveFuncs",
    "SavedGraph",
    "address_fingerprint",
    "check_events",
    "check_memcpy_kinds",
    "create_events",
    "event_node",
    "event_table",
    "instantiate",
    "node_kind",
    "node_type_name",
    "pack_kernel_table",
    "rebuild_native",
    "serialize",
    "topology_fingerprint",
    "verify_blob",
]
