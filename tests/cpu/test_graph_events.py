"""Event record/wait nodes in graph descriptions, and node-type refusals: the pure logic, no GPU or driver.

serialize() needs a live driver; what it writes for an event node comes from graphformat.event_node /
EventNumbering / event_table, and what it refuses from graphformat.node_kind / check_memcpy_kinds, tested here.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from gpdiag import rebuild as reference

from graphpersist.graph import build as graphbuild
from graphpersist.graph import format as graphformat

LO, HI = 0x500000000000, 0x500000000000 + (1 << 30)


def _describe(pattern: list[tuple[str, int]]) -> dict[str, Any]:
    """A description like serialize() writes: kernel, event nodes from (kind, raw handle), an empty join."""
    numbering = graphformat.EventNumbering()
    nodes: list[dict[str, Any]] = [
        {"type": "kernel", "func": 0, "image": "ab" * 32, "name": "k", "grid": [1, 1, 1], "block": [32, 1, 1],
         "smem": 0, "layout": [[0, 8]], "params": [0, 8], "attrs": {}},
    ]  # fmt: skip
    nodes += [graphformat.event_node(kind, handle, numbering) for kind, handle in pattern]
    nodes.append({"type": "empty"})
    edges = [[0, i, 0, 0, 0] for i in range(1, len(nodes) - 1)] + [[i, len(nodes) - 1, 0, 0, 0]
                                                                     for i in range(1, len(nodes) - 1)]  # fmt: skip
    blob = (LO + 4096).to_bytes(8, "little")
    desc = {"format": 1, "nodes": nodes, "edges": edges, "funcs": [["ab" * 32, "k", {}]], "blob_size": len(blob),
            "blob_sha256": hashlib.sha256(blob).hexdigest()}  # fmt: skip
    if len(numbering):
        desc["events"] = graphformat.event_table(numbering)
    return desc


# Two processes capturing the same code: same pattern of events, different raw handle values.
PROC_A = [("event_wait", 0x55D0C0DE1000), ("event_record", 0x55D0C0DE2000), ("event_record", 0x55D0C0DE1000)]
PROC_B = [("event_wait", 0x7F00BEEF9000), ("event_record", 0x7F00BEEF3000), ("event_record", 0x7F00BEEF9000)]


def test_events_numbered_by_first_appearance() -> None:
    desc = _describe(PROC_A)
    ev = [nd for nd in desc["nodes"] if nd["type"].startswith("event_")]
    assert ev == [{"type": "event_wait", "event": 0}, {"type": "event_record", "event": 1},
                  {"type": "event_record", "event": 0}]  # fmt: skip
    assert desc["events"] == [{"flags": graphformat.EVENT_DISABLE_TIMING}] * 2
    assert graphformat.check_events("g", desc) == [0x2, 0x2]


def test_event_descriptor_round_trips_through_json() -> None:
    desc = _describe(PROC_A)
    back = json.loads(json.dumps(desc))
    assert back == desc
    assert graphformat.check_events("g", back) == graphformat.check_events("g", desc)
    assert graphformat.topology_fingerprint(back) == graphformat.topology_fingerprint(desc)
    table = graphformat.pack_kernel_table(back)  # the native path: event nodes are not kernel rows
    assert graphformat.TABLE_HEADER.unpack_from(table)[0] == 1
    assert graphformat.KNODE.unpack_from(table, graphformat.TABLE_HEADER.size)[0] == 0  # kernel keeps its node index


def test_fingerprints_independent_of_handle_values() -> None:
    a, b = _describe(PROC_A), _describe(PROC_B)
    assert a == b
    blob = (LO + 4096).to_bytes(8, "little")
    assert graphformat.topology_fingerprint(a) == graphformat.topology_fingerprint(b)
    assert graphformat.address_fingerprint(a, blob, LO, HI) == graphformat.address_fingerprint(b, blob, LO, HI)
    text = json.dumps(a)
    for _kind, handle in PROC_A + PROC_B:
        assert str(handle) not in text and hex(handle) not in text


def test_fingerprint_sees_event_kinds_and_indices() -> None:
    base = graphformat.topology_fingerprint(_describe(PROC_A))
    other_event = [PROC_A[0], PROC_A[1], ("event_record", 0x1)]  # last record on a third event
    swapped = [("event_record", h) if k == "event_wait" else ("event_wait", h) for k, h in PROC_A]
    assert graphformat.topology_fingerprint(_describe(other_event)) != base
    assert graphformat.topology_fingerprint(_describe(swapped)) != base


def test_graphs_without_events_keep_their_old_fingerprint() -> None:
    """Archives written before event support still verify at LOAD: the formula is unchanged for them."""
    desc = _describe([])
    assert "events" not in desc
    topo = [{k: v for k, v in nd.items() if k not in ("params", "dst", "srcDevice", "dstDevice")}
            for nd in desc["nodes"]]  # fmt: skip
    old = json.dumps({"nodes": topo, "edges": desc["edges"]}, sort_keys=True, separators=(",", ":"))
    assert graphformat.topology_fingerprint(desc) == hashlib.sha256(old.encode()).hexdigest()
    assert graphformat.check_events("g", desc) == []


def test_damaged_event_table_refused_before_the_driver() -> None:
    desc = _describe(PROC_A)
    blob = (LO + 4096).to_bytes(8, "little")
    bad = json.loads(json.dumps(desc))
    bad["nodes"][3]["event"] = 5
    with pytest.raises(graphformat.GraphFormatError, match=r"node 3 \(event_record\): event index 5 outside"):
        graphformat.check_events("g", bad)
    short = {**desc, "events": desc["events"][:1]}
    with pytest.raises(graphformat.GraphFormatError, match="event index 1 outside the event table"):
        graphformat.check_events("g", short)
    extra = {**desc, "events": [*desc["events"], {"flags": 2}]}
    with pytest.raises(graphformat.GraphFormatError, match=r"lists 3 events, nodes use \[0, 1\]"):
        graphformat.check_events("g", extra)
    with pytest.raises(graphformat.GraphFormatError, match="malformed event table"):
        graphformat.check_events("g", {**desc, "events": [{}, {}]})
    # rebuild paths (the reference one is diagnosis's) refuse a wrong number of live events before touching the driver
    with pytest.raises(graphformat.GraphFormatError, match="2 events needed"):
        reference.rebuild("g", desc, blob, funcs=None, events=[])
    with pytest.raises(graphformat.GraphFormatError, match="2 events needed"):
        graphbuild.rebuild_native("g", desc, blob, b"", funcs=[], events=[object()])


def test_supported_node_kinds() -> None:
    assert graphformat.node_kind(0, "CU_GRAPH_NODE_TYPE_EVENT_RECORD") == "event_record"
    assert graphformat.node_kind(1, "CU_GRAPH_NODE_TYPE_WAIT_EVENT") == "event_wait"
    assert [graphformat.node_kind(i, t) for i, t in enumerate(graphformat.NODE_KINDS)] == list(
        graphformat.NODE_KINDS.values()
    )


@pytest.mark.parametrize(
    "type_name",
    ["CU_GRAPH_NODE_TYPE_HOST", "CU_GRAPH_NODE_TYPE_GRAPH", "CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL",
     "CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT", "CU_GRAPH_NODE_TYPE_MEM_ALLOC", "CU_GRAPH_NODE_TYPE_MEM_FREE",
     "CU_GRAPH_NODE_TYPE_BATCH_MEM_OP", "CU_GRAPH_NODE_TYPE_CONDITIONAL", "CU_GRAPH_NODE_TYPE_FUTURE"],
)  # fmt: skip
def test_unsupported_node_types_refused_naming_the_node(type_name: str) -> None:
    with pytest.raises(graphformat.GraphFormatError, match=rf"^node 7 \({type_name}\): .*SAVE refused"):
        graphformat.node_kind(7, type_name)


def test_host_memcpy_refused_naming_the_node() -> None:
    graphformat.check_memcpy_kinds("node 2 (CU_GRAPH_NODE_TYPE_MEMCPY)", 2, 4)  # device -> unified: fine
    with pytest.raises(graphformat.GraphFormatError, match=r"node 2 \(CU_GRAPH_NODE_TYPE_MEMCPY\): memcpy with host"):
        graphformat.check_memcpy_kinds("node 2 (CU_GRAPH_NODE_TYPE_MEMCPY)", 1, 2)  # CU_MEMORYTYPE_HOST source
    with pytest.raises(graphformat.GraphFormatError, match=r"types \(2, 3\)"):
        graphformat.check_memcpy_kinds("node 2 (CU_GRAPH_NODE_TYPE_MEMCPY)", 2, 3)  # CU_MEMORYTYPE_ARRAY target
