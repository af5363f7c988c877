"""What LOAD reads from an archive, read and checked on CPU (graphpersist.loadplan): an archive as SAVE writes it
reads back whole, and a damaged or forged one is refused naming the file and the field before any native code or
GPU call would index with its numbers."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from archive_fixtures import REGION_BASE, REGION_SIZE, forge, write_loadable_archive
from pack_forgery import resave

from graphpersist.archive import ArchiveError, open_archive
from graphpersist.graph import format as graphformat
from graphpersist.loadplan import read_graphs, read_plan


@pytest.fixture
def loadable(tmp_path: Path) -> Path:
    return write_loadable_archive(tmp_path / "archive")


def test_an_archive_as_save_writes_it_reads_back_whole(loadable: Path) -> None:
    archive = open_archive(loadable, keep_rank=1)
    plan = read_plan(archive, 1)
    assert list(plan.graphs) == ["full-bs1", "full-bs2", "full-bs4", "full-bs8"]
    assert [p.name for p in plan.phases] == ["(setup)", "kv_cache", "custom_all_reduce"]
    assert [e.kind for e in plan.events] == ["alloc"] * 4 and plan.events[0].addr == REGION_BASE
    assert [s.name for s in plan.states] == ["rank_data", "peer_ptrs"]
    assert plan.torch_blocks == [(REGION_BASE + 4096, 1 << 20)]
    assert plan.notes["dispatch"] == {"full-bs8": [8, 8, True]}
    assert plan.pointers == sorted(plan.pointers) and len(plan.pointers) == plan.record.pointers.count
    full = read_plan(open_archive(loadable), 1, every_byte=True)
    desc = full.graphs["full-bs8"][0]
    assert [n["type"] for n in desc["nodes"][:5]] == ["kernel", "memset", "event_record", "event_wait", "kernel"]


def _edit(root: Path, rel: str, change: Callable[[Any], None]) -> None:
    doc = json.loads((root / rel).read_bytes())
    change(doc)
    forge(root, rel, json.dumps(doc, indent=2).encode())


def _table_of(root: Path, graph: str) -> tuple[int, bytearray]:
    index = json.loads((root / "rank_0" / "graphs" / "index.json").read_bytes())
    offset, _n = next(g["table"] for g in index["graphs"] if g["name"] == graph)
    return offset, bytearray((root / "rank_0" / "graphs" / "pack.bin").read_bytes())


@pytest.mark.parametrize(
    ("word", "value", "problem"),
    [
        (1, 7, "kernel table names function 7 of 2"),  # func index
        (0, 3, "kernel table rows do not name the description's kernel nodes in order"),  # node index
        (12, 1 << 20, "parameter-offset run past its offsets"),  # layout_off
        (10, 1 << 30, "kernel table has a parameter at byte"),  # params_off
        (13, 1 << 16, "attribute run past its attributes"),  # n_attrs
        (9, 5000, "a node of 5000 parameters"),  # n_params
    ],
)
def test_a_kernel_table_the_native_rebuild_would_index_out_of_bounds_is_refused(
    loadable: Path, word: int, value: int, problem: str
) -> None:
    """The pack's bytes forged consistently (its file hash and record commitment match): LOAD's own checks of the
    table still refuse before gp_add_kernel_nodes would read past the blob, the offsets or the functions."""
    offset, pack = _table_of(loadable, "full-bs2")
    struct.pack_into("<I", pack, offset + graphformat.TABLE_HEADER.size + 4 * word, value)
    forge(loadable, "rank_0/graphs/pack.bin", bytes(pack))
    with pytest.raises(ArchiveError) as info:
        read_plan(open_archive(loadable, keep_rank=0), 0)
    assert "rank_0/graphs/index.json: graph 'full-bs2': " in str(info.value) and problem in str(info.value)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda d: d["descs"][0]["other_nodes"][0][1].update(srcDevice="0x1"), "srcDevice must be integers"),
        (lambda d: d["descs"][0]["other_nodes"][0][1].update(dst=1), "fields"),
        (lambda d: d["descs"][0]["other_nodes"][0][1].update(type="host"), "unknown node type 'host'"),
        (lambda d: d["funcs"][0].__setitem__(0, "ef" * 32), "names image 'efefefefefefefef'"),
        (lambda d: d["funcs"][1][2].update({"8": "big"}), "attributes must map attribute numbers"),
        (lambda d: d["graphs"][1]["inputs"][0].update(addr=1), "lies outside the rank's region"),
        (lambda d: d["graphs"][1]["inputs"][0].update(dtype="cuda"), "is not a torch dtype name"),
        (
            lambda d: d["graphs"][1].update(outputs={"kind": "dataclass", "class": "os:system", "fields": []}),
            "damaged output record",
        ),
        (lambda d: d["graphs"][0]["own"].update(blob_size="16"), "own must hold byte counts"),
    ],
)
def test_a_forged_index_is_refused_naming_what_is_wrong(
    loadable: Path, change: Callable[[Any], None], problem: str
) -> None:
    _edit(loadable, "rank_0/graphs/index.json", change)
    with pytest.raises(ArchiveError) as info:
        read_plan(open_archive(loadable, keep_rank=0), 0)
    assert "rank_0/graphs/index.json" in str(info.value) and problem in str(info.value)


def test_a_pack_with_bytes_no_graph_names_is_refused(loadable: Path) -> None:
    pack = (loadable / "rank_0" / "graphs" / "pack.bin").read_bytes() + b"\0" * 16
    forge(loadable, "rank_0/graphs/pack.bin", pack)
    _edit(loadable, "rank_0/graphs/index.json", lambda d: d.update(pack_size=len(pack)))
    with pytest.raises(ArchiveError, match=r"the graphs' parts cover \d+ of the pack's \d+ bytes"):
        read_plan(open_archive(loadable), 0)


def test_every_byte_recomputes_each_graphs_hashes_and_its_kernel_nodes(loadable: Path) -> None:
    """LOAD relies on the pack's file hash (each byte hashed once); `check` (every_byte) recomputes what the index
    says of each graph, so a pack changed behind the index's back is named by graph."""
    index = json.loads((loadable / "rank_0" / "graphs" / "index.json").read_bytes())
    kernels = next(g["kernels"] for g in index["graphs"] if g["name"] == "full-bs4")
    pack = bytearray((loadable / "rank_0" / "graphs" / "pack.bin").read_bytes())
    pack[kernels[0] + kernels[1] // 2] ^= 0x40  # inside the compressed kernel nodes, which native LOAD never reads
    forge(loadable, "rank_0/graphs/pack.bin", bytes(pack))
    read_plan(open_archive(loadable, keep_rank=0), 0)  # LOAD's native path: not its business
    with pytest.raises(ArchiveError, match=r"graph 'full-bs4'"):
        read_graphs(open_archive(loadable), 0, full=True)


@pytest.mark.parametrize(
    ("node", "key", "value", "problem"),
    [
        (12, "srcDevice", REGION_BASE - 4096, "lies outside the rank's region"),
        (12, "dstDevice", REGION_BASE + REGION_SIZE, "lies outside the rank's region"),
        (12, "srcDevice", REGION_BASE + 8192, r"is not in the pointer inventory \(pointers.json\)"),
        (1, "dst", 0x1000, "lies outside the rank's region"),
        (1, "dst", REGION_BASE + 12288, r"is not in the pointer inventory \(pointers.json\)"),
    ],
)
def test_a_memset_or_memcpy_address_save_could_not_have_written_is_refused(
    loadable: Path, node: int, key: str, value: int, problem: str
) -> None:
    """SAVE refuses memset and memcpy addresses outside the region and records every one in the pointer inventory
    (whose memory LOAD proves): an archive whose graph says otherwise is refused by LOAD's CPU stage and `check`."""
    resave(loadable, 0, lambda graphs: graphs[3].desc["nodes"][node].update({key: value}))
    kind = "memcpy" if node == 12 else "memset"
    for every_byte in (False, True):
        with pytest.raises(ArchiveError, match=rf"graph 'full-bs8' node {node} \({kind}\) {key}: {value:#x} {problem}"):
            read_plan(open_archive(loadable), 0, every_byte=every_byte)


def test_loads_cpu_stage_reads_every_kernel_node_only_inside_the_reference_rebuilds_block(loadable: Path) -> None:
    """LOAD's native builder needs no kernel node's JSON; the reference rebuild (gpdiag.rebuild.in_load) does, so
    inside its block LOAD's CPU stage parses each one."""
    from gpdiag import rebuild as reference

    from graphpersist import loadstage

    archive = open_archive(loadable, keep_rank=0)
    assert loadstage.rank_stage(archive, 0).graphs["full-bs8"][0]["nodes"][0] == {"type": "kernel"}
    with reference.in_load():
        node = loadstage.rank_stage(archive, 0).graphs["full-bs8"][0]["nodes"][0]
    assert node["name"] == "k_own" and node["layout"] == [[0, 8], [8, 8]]
    assert loadstage.rank_stage(archive, 0).graphs["full-bs8"][0]["nodes"][0] == {"type": "kernel"}
