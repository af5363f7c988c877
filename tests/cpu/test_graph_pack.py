"""Graph records packed per rank, read back with each byte hashed once; output structures; graph names.

The pack and index are written through the real ArchiveWriter and read through open_archive; descriptions are
built like graphwalk.serialize writes them (no driver here), so the kernel table and fingerprints are the real
format's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from archive_fixtures import REGION_BASE, REGION_SIZE, device, world

from graphpersist.archive import ArchiveError, ArchiveWriter, open_archive
from graphpersist.archive.base import ADVICE_DAMAGED
from graphpersist.archive.manifest import GraphRecord
from graphpersist.errors import PersistError
from graphpersist.graph import format as graphformat
from graphpersist.graph import pack as graphpack
from graphpersist.graph import structure
from graphpersist.graph.graphset import DuplicateGraph, GraphNotFound, GraphSet

# --------------------------------------------------------------------------------------------- pack round trip


def _graph(n_kernels: int, seed: int) -> tuple[dict[str, Any], bytes, bytes]:
    """A description, parameter blob and kernel table shaped like serialize()'s output."""
    nodes, blob = [], bytearray()
    for i in range(n_kernels):
        params = struct.pack("<QQ", REGION_BASE + 4096 * (seed + i), seed * 1000 + i)
        nodes.append({"type": "kernel", "func": i % 2, "image": "ab" * 32, "name": f"k{i % 2}",
                      "grid": [seed + 1, 1, 1], "block": [128, 1, 1], "smem": 0, "layout": [[0, 8], [8, 8]],
                      "params": [len(blob), len(params)], "attrs": {}})  # fmt: skip
        blob += params
    edges = [[i, i + 1, 0, 0, 0] for i in range(n_kernels - 1)]
    desc = {"format": 1, "nodes": nodes, "edges": edges, "funcs": [["ab" * 32, "k0", {}], ["ab" * 32, "k1", {}]],
            "blob_size": len(blob), "blob_sha256": hashlib.sha256(blob).hexdigest()}  # fmt: skip
    table = graphformat.pack_kernel_table(desc)
    desc["table_size"], desc["table_sha256"] = len(table), hashlib.sha256(table).hexdigest()
    return desc, bytes(blob), table


SPEC = {"addr": REGION_BASE + 64, "dtype": "float16", "shape": [8, 16], "stride": [16, 1]}
GRAPHS = {f"PIECEWISE/bs{b}/piece{p}": (p + 1) * 3 for b in (1, 8) for p in range(3)} | {"FULL/bs8": 40}


def _rank_facts(rel: str, names: list[str]) -> dict[str, Any]:
    record = {"file": rel, "topology_fingerprint": "00" * 32, "node_count": 1, "nodes_by_type": {"kernel": 1},
              "kernel_count": 1, "images": []}  # fmt: skip
    return {
        "device": device(0),
        "region": {"base": REGION_BASE, "size": REGION_SIZE, "final_offset": 0},
        "pointers": {"fingerprint": "00" * 32, "count": 0},
        "graphs": [{"name": n, **record} for n in names],
        "images": [],
    }


def _write(root: Path, pack: graphpack.PackWriter, index: Any = None) -> Path:
    with ArchiveWriter(root, world(**{"parallel.world_size": 1, "parallel.tp_size": 1})) as w:
        rel = w.add_json(0, graphpack.INDEX_NAME, pack.index() if index is None else index)
        w.add_file(0, graphpack.PACK_NAME, pack.data())
        w.set_rank_facts(0, _rank_facts(rel, [e["name"] for e in pack.entries]))
        return w.commit()


def _packed() -> tuple[graphpack.PackWriter, dict[str, tuple[dict[str, Any], bytes, bytes]]]:
    pack = graphpack.PackWriter()
    made = {}
    for seed, (name, n) in enumerate(GRAPHS.items()):
        made[name] = _graph(n, seed)
        desc, blob, table = made[name]
        pack.add(name, desc, blob, table, inputs=[SPEC], outputs={"kind": "tensor", "spec": SPEC})
    return pack, made


def test_pack_round_trip_through_the_archive(tmp_path: Path) -> None:
    pack, made = _packed()
    root = _write(tmp_path / "a", pack)
    assert sorted(p.name for p in (root / "rank_0" / "graphs").iterdir()) == ["index.json", "pack.bin"]
    archive = open_archive(root, keep_rank=0)
    got = graphpack.read_graphs(archive, 0, list(GRAPHS))
    assert [g.name for g in got.graphs] == list(GRAPHS)  # capture order
    for g in got.graphs:
        desc, blob, table = made[g.name]
        back = g.full_desc_of(got.pack)
        assert back == desc
        light = g.desc_of(got.pack)  # what the native path parses: kernel nodes reduced to stubs
        assert light["nodes"] == [{"type": "kernel"}] * len(desc["nodes"]) and "edges" not in light
        assert graphformat.edge_lists(*graphformat.edge_ends(light)) == desc["edges"] == back["edges"]
        assert len(g.part(got.pack, "kernels")) < g.kernels_size  # the kernel nodes' JSON, compressed
        assert b'"type":"kernel"' not in graphpack._compact(pack.index()["descs"])  # stubs: only counted
        graphformat.check_shape(g.name, light, table, len(desc["nodes"]), {"kernel": len(desc["nodes"])})
        assert graphformat.topology_fingerprint(back) == graphformat.topology_fingerprint(desc)
        params = g.part(got.pack, "params")
        assert params == blob and g.part(got.pack, "table") == table
        graphformat.verify_blob(g.name, back, params, hashed=True)
        assert g.inputs == [SPEC]


def test_shape_check_refuses_counts_that_disagree() -> None:
    desc, _blob, table = _graph(4, 1)
    light = graphpack.split_desc(desc)[0]
    with pytest.raises(graphformat.GraphFormatError, match=r"description has 4 nodes \{'kernel': 4\}, its record 5"):
        graphformat.check_shape("g", light, table, 5, {"kernel": 5})
    other_table = _graph(3, 1)[2]
    with pytest.raises(graphformat.GraphFormatError, match="kernel table lists 3 kernel nodes"):
        graphformat.check_shape("g", light, other_table, 4, {"kernel": 4})
    with pytest.raises(graphpack.PackError, match="4 kernel nodes, its kernel part 3"):
        graphpack.full_desc(light, desc["nodes"][:3])


def test_functions_are_stored_once_per_rank_and_edge_data_survives(tmp_path: Path) -> None:
    pack = graphpack.PackWriter()
    plain, blob, table = _graph(3, 0)
    ported = json.loads(json.dumps(plain))
    ported["edges"][1][2:5] = [1, 0, 2]  # an edge with data (port, type) takes the stored edge_data
    ported["nodes"].append({"type": "empty"})
    for name, desc in (("a", plain), ("b", ported)):
        pack.add(name, desc, blob, table, inputs=[], outputs={"kind": "value", "value": None})
    assert pack.index()["funcs"] == plain["funcs"]  # both graphs use the same two functions: listed once
    root = _write(tmp_path / "a", pack)
    got = graphpack.read_graphs(open_archive(root, keep_rank=0), 0, ["a", "b"])
    assert got.graphs[1].full_desc_of(got.pack) == ported
    light = got.graphs[1].desc_of(got.pack)
    assert light["edge_data"] == [[0, 0, 0], [1, 0, 2]] and light["nodes"][-1] == {"type": "empty"}
    assert graphformat.edge_lists(*graphformat.edge_ends(light)) == ported["edges"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d.update(other_nodes=[[99, {"type": "empty"}]]), "node entry 99"),
        (lambda d: d.update(edge_data=[[0, 0, 0]]), "2 edges for 1 edge data"),
        (lambda d: d.update(edge_ends=[0, 1, 2]), "edge ends are not pairs of node indices"),
        (lambda d: d.update(edge_ends=[0, "1"]), "edge ends are not pairs of node indices"),
        (lambda d: d.update(edge_ends=[0, 3]), "an edge end outside the 3 nodes"),
        (lambda d: d.update(func_ids=[7]), r"function indices \[7\] outside the 2 functions"),
        (lambda d: d.update(func_ids=[-1]), r"function indices \[-1\] outside"),
        (lambda d: d.update(node_count=10**12), r"node count 1000000000000 \(at most 1000 here\)"),
        (lambda d: d.update(edge_data=[[0, 0, 0], [0, "1", 0]]), r"edge data are not \[from_port, to_port, type\]"),
        (lambda d: d.pop("node_count"), "KeyError"),
    ],
)
def test_a_malformed_stored_description_is_refused(damage: Any, message: str) -> None:
    desc, _blob, _table = _graph(3, 0)
    light, kernels = graphpack.split_desc(desc)
    stored = graphpack.compact_desc(light, [0, 1])
    back = graphpack.expand_desc("g", json.loads(json.dumps(stored)), desc["funcs"], 1000)
    own = {k: desc[k] for k in ("blob_size", "blob_sha256", "table_size", "table_sha256")}
    assert graphpack.full_desc({**back, **own}, kernels) == desc
    damage(stored)
    with pytest.raises(graphpack.PackError, match=rf"g: malformed description in the pack .*{message}"):
        graphpack.expand_desc("g", stored, desc["funcs"], 1000)


def test_graphs_of_one_shape_share_one_description(tmp_path: Path) -> None:
    """Every batch size of a piece has the same nodes, edges and functions: stored and checked once."""
    pack = graphpack.PackWriter()
    made = {}
    for seed in range(3):
        made[f"bs{seed}"] = _graph(4, seed)  # same shape, other launch sizes and parameters
        desc, blob, table = made[f"bs{seed}"]
        pack.add(f"bs{seed}", desc, blob, table, inputs=[], outputs={"kind": "value", "value": None})
    assert len(pack.index()["descs"]) == 1
    got = graphpack.read_graphs(open_archive(_write(tmp_path / "a", pack), keep_rank=0), 0, list(made))
    for g in got.graphs:
        assert g.full_desc_of(got.pack) == made[g.name][0]  # own sizes and hashes stay per graph


def test_kernel_nodes_that_do_not_inflate_are_refused() -> None:
    pack = graphpack.PackWriter()
    desc, blob, table = _graph(3, 0)
    pack.add("g", desc, blob, table, inputs=[], outputs={"kind": "value", "value": None})
    data = pack.data()
    (entry,) = graphpack.parse_index(json.loads(json.dumps(pack.index())), len(data))
    short = dataclasses.replace(entry, kernels_size=entry.kernels_size - 1)
    with pytest.raises(graphpack.PackError, match=rf"do not inflate to {entry.kernels_size - 1} bytes"):
        short.full_desc_of(data)
    off, n = entry.kernels
    garbled = data[:off] + bytes(n) + data[off + n :]
    with pytest.raises(graphpack.PackError, match="its kernel nodes do not inflate"):
        entry.full_desc_of(garbled)


def test_kernel_nodes_with_equal_attributes_share_their_table_rows() -> None:
    """A kernel node reads back every launch attribute: equal sets are stored once, each node points at them."""
    attrs = {"4": "01", "9": "0001", "1": ""}
    nodes = [{"type": "kernel", "func": i % 2, "grid": [1, 1, 1], "block": [32, 1, 1], "smem": 0,
              "params": [16 * i, 16], "layout": [[0, 8], [8, 8]], "attrs": dict(attrs) if i < 3 else {"4": "02"}}
             for i in range(4)]  # fmt: skip
    table = graphformat.pack_kernel_table({"nodes": nodes})
    n_k, n_off, n_attr, _ = graphformat.TABLE_HEADER.unpack_from(table)
    assert (n_k, n_off, n_attr) == (4, 2, 4)  # one layout, two attribute sets (3 + 1 rows)
    rows_at = graphformat.TABLE_HEADER.size + n_k * graphformat.KNODE.size + 4 * n_off
    for i, nd in enumerate(nodes):  # what gp_add_kernel_nodes reads for node i: attrs[attrs_off .. +n_attrs]
        knode = graphformat.KNODE.unpack_from(table, graphformat.TABLE_HEADER.size + i * graphformat.KNODE.size)
        layout_off, n_attrs, attrs_off = knode[11], knode[12], knode[13]
        assert layout_off == 0 and knode[9] == 2
        rows = [graphformat.KATTR.unpack_from(table, rows_at + (attrs_off + j) * graphformat.KATTR.size)
                for j in range(n_attrs)]  # fmt: skip
        want = sorted((int(k), bytes.fromhex(v).ljust(64, b"\0")) for k, v in nd["attrs"].items())
        assert [(r[0], r[2]) for r in rows] == want


def test_pack_writer_refuses_duplicate_names() -> None:
    pack = graphpack.PackWriter()
    desc, blob, table = _graph(2, 0)
    pack.add("g", desc, blob, table, inputs=[], outputs={"kind": "value", "value": None})
    with pytest.raises(ValueError, match="'g' is already in the pack"):
        pack.add("g", desc, blob, table, inputs=[], outputs={"kind": "value", "value": None})


def _damaged(index: dict[str, Any], how: str) -> dict[str, Any]:
    bad = json.loads(json.dumps(index))
    rows = bad["graphs"]
    if how == "past_end":
        rows[-1]["params"] = [bad["pack_size"] - 4, 64]
    elif how == "overlap":
        rows[1]["params"] = list(rows[0]["params"])
    elif how == "duplicate":
        rows[2]["name"] = rows[1]["name"]
    elif how == "not_span":
        rows[0]["table"] = [-1, 3]
    elif how == "size":
        bad["pack_size"] += 1
    elif how == "format":
        bad["format"] = 99
    elif how == "funcs":
        bad["funcs"] = [["ab" * 32, "k0"]]
    elif how == "kernels_size":
        rows[0]["kernels_size"] = -1
    elif how == "desc":
        rows[0]["desc"] = 5
    elif how == "own":
        rows[0]["own"] = {}
    elif how == "descs":
        del bad["descs"][0]["node_count"]
    return bad


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("past_end", r"params bytes \d+\.\.\d+ lie past the end of the pack \(\d+ bytes\)"),
        (
            "overlap",
            r"graph parts overlap in the pack: 'PIECEWISE/bs1/piece0' params and 'PIECEWISE/bs1/piece1' params",
        ),
        ("duplicate", r"graph 'PIECEWISE/bs1/piece1' is listed twice"),
        ("not_span", r"table span \[-1, 3\] is not \[offset, length\]"),
        ("size", r"the index says the pack has \d+ bytes, it has \d+"),
        ("format", r"graph index format 99 is not 2"),
        ("funcs", r"the index has no function table"),
        ("kernels_size", r"kernels_size -1 is not a byte count"),
        ("desc", r"graph 'PIECEWISE/bs1/piece0': desc 5 is not one of the \d+ descriptions"),
        ("own", r"graph 'PIECEWISE/bs1/piece0': own does not hold exactly blob_size"),
        ("descs", r"description 0: malformed description in the pack \(KeyError"),
    ],
)
def test_damaged_index_is_refused_naming_the_problem(tmp_path: Path, how: str, message: str) -> None:
    pack, _ = _packed()
    root = _write(tmp_path / how, pack, _damaged(pack.index(), how))  # consistent manifest: the index itself is bad
    archive = open_archive(root, keep_rank=0)
    names = list(GRAPHS)
    with pytest.raises(ArchiveError, match=message) as info:
        graphpack.read_graphs(archive, 0, names)
    assert "rank_0/graphs/index.json" in str(info.value)
    assert str(info.value).endswith(ADVICE_DAMAGED), "a damaged index is not fixed by a new SAVE"


def test_index_must_list_the_record_graphs_in_order(tmp_path: Path) -> None:
    pack, _ = _packed()
    archive = open_archive(_write(tmp_path / "a", pack))
    swapped = list(GRAPHS)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(ArchiveError, match=r"lists graphs .* rank 0's record lists"):
        graphpack.read_graphs(archive, 0, swapped)


def test_archive_without_index_names_the_old_layout(tmp_path: Path) -> None:
    with ArchiveWriter(tmp_path / "old", world(**{"parallel.world_size": 1, "parallel.tp_size": 1})) as w:
        rel = w.add_json(0, "graphs/g.json", {"nodes": []})
        w.set_rank_facts(0, _rank_facts(rel, ["g"]))
        root = w.commit()
    with pytest.raises(
        ArchiveError, match=r"no rank_0/graphs/index\.json: written by a graphpersist release that stored"
    ) as info:
        graphpack.read_graphs(open_archive(root), 0, ["g"])
    assert str(info.value).endswith("Re-run with mode=save to write a fresh archive."), "a new SAVE fixes an old layout"


def test_an_index_of_an_older_format_advises_a_new_save(tmp_path: Path) -> None:
    pack, _ = _packed()
    root = _write(tmp_path / "a", pack, _damaged(pack.index(), "format") | {"format": 1})
    with pytest.raises(ArchiveError, match=r"graph index format 1 is not 2 \(written by another release\)") as info:
        graphpack.read_graphs(open_archive(root), 0, list(GRAPHS))
    assert str(info.value).endswith("Re-run with mode=save to write a fresh archive.")


# --------------------------------------------------------------------------------------------- hash once


def test_kept_bytes_are_the_verified_ones_and_served_once(tmp_path: Path) -> None:
    """keep_rank: the bytes hashed by open_archive are what read() returns first; a later read verifies again."""
    pack, _ = _packed()
    root = _write(tmp_path / "a", pack)
    original = (root / "rank_0" / graphpack.PACK_NAME).read_bytes()
    archive = open_archive(root, keep_rank=0)
    flipped = bytearray(original)
    flipped[10] ^= 0xFF  # same size, other content, after the open
    (root / "rank_0" / graphpack.PACK_NAME).write_bytes(bytes(flipped))
    assert archive.read(0, graphpack.PACK_NAME) == original  # the hashed bytes, not re-read from disk
    with pytest.raises(ArchiveError, match=r"corrupted file rank_0/graphs/pack\.bin"):
        archive.read(0, graphpack.PACK_NAME)  # served once; a second read reads and verifies again


def test_without_keep_rank_reads_verify_again(tmp_path: Path) -> None:
    pack, _ = _packed()
    root = _write(tmp_path / "a", pack)
    archive = open_archive(root)
    data = bytearray((root / "rank_0" / graphpack.PACK_NAME).read_bytes())
    data[0] ^= 0xFF
    (root / "rank_0" / graphpack.PACK_NAME).write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match=r"corrupted file rank_0/graphs/pack\.bin"):
        archive.read(0, graphpack.PACK_NAME)


def test_keep_rank_still_refuses_a_corrupted_archive(tmp_path: Path) -> None:
    pack, _ = _packed()
    root = _write(tmp_path / "a", pack)
    data = bytearray((root / "rank_0" / graphpack.PACK_NAME).read_bytes())
    data[-1] ^= 0xFF
    (root / "rank_0" / graphpack.PACK_NAME).write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match=r"corrupted file rank_0/graphs/pack\.bin"):
        open_archive(root, keep_rank=0)


# --------------------------------------------------------------------------------------------- output structure


@dataclasses.dataclass
class Leaf:
    """Stand-in for a tensor: structure code sees leaves only through the caller's functions."""

    addr: int


@dataclasses.dataclass
class ModelOutput:
    logits: Any
    aux: Any = None
    step: int = 0


@dataclasses.dataclass
class WithDerived:
    x: Any
    y: int = dataclasses.field(init=False, default=0)


TYPES = {"test.model_output": ModelOutput, "test.with_derived": WithDerived}  # the engine's registry, by id


def _spec(x: Any) -> dict[str, Any] | None:
    return {"addr": x.addr} if isinstance(x, Leaf) else None


def _leaf(spec: dict[str, Any]) -> Leaf:
    return Leaf(spec["addr"])


@pytest.mark.parametrize(
    "value",
    [
        Leaf(1),
        (Leaf(1), Leaf(2)),
        [Leaf(1), None, 3, 2.5, "s", True],
        {"hidden": Leaf(1), 7: (Leaf(2), [Leaf(3)]), "none": None},
        ModelOutput(logits=Leaf(1), aux={"a": (Leaf(2), None)}, step=4),
        (ModelOutput(Leaf(9)), []),
        (),
        None,
    ],
)
def test_output_structure_round_trips_through_json(value: Any) -> None:
    tree = structure.encode(value, _spec, types=TYPES)
    back = structure.decode(json.loads(json.dumps(tree)), _leaf, types=TYPES)
    assert back == value and type(back) is type(value)
    assert [s["addr"] for s in structure.leaves(tree)] == _addrs(value)


def _addrs(v: Any) -> list[int]:
    if isinstance(v, Leaf):
        return [v.addr]
    if isinstance(v, (tuple, list)):
        return [a for x in v for a in _addrs(x)]
    if isinstance(v, dict):
        return [a for x in v.values() for a in _addrs(x)]
    if dataclasses.is_dataclass(v):
        return [a for f in dataclasses.fields(v) for a in _addrs(getattr(v, f.name))]
    return []


def test_tuple_and_list_stay_distinct_and_shared_leaves_repeat() -> None:
    shared = Leaf(5)
    tree = structure.encode(((shared,), [shared]), _spec)
    assert [n["kind"] for n in tree["items"]] == ["tuple", "list"]
    assert structure.leaves(tree) == [{"addr": 5}, {"addr": 5}]


def test_save_refuses_what_load_could_not_rebuild() -> None:
    @dataclasses.dataclass
    class Local:
        x: Any

    with pytest.raises(
        structure.StructureError, match=r"outputs\[1\]: dataclass .*Local is not in the engine's registry"
    ):
        structure.encode((Leaf(1), Local(Leaf(2))), _spec, types=TYPES)
    with pytest.raises(structure.StructureError, match=r"ModelOutput is not in the engine's registry .*holds none"):
        structure.encode(ModelOutput(Leaf(1)), _spec)  # no registry: no dataclass at all
    with pytest.raises(structure.StructureError, match=r"fields outside __init__ \(y\)"):
        structure.encode(WithDerived(Leaf(1)), _spec, types=TYPES)
    with pytest.raises(structure.StructureError, match=r"outputs\['k'\]: builtins.set is not a tensor"):
        structure.encode({"k": {1, 2}}, _spec)
    with pytest.raises(structure.StructureError, match="nan"):
        structure.encode([float("nan")], _spec)
    with pytest.raises(structure.StructureError, match="dict key"):
        structure.encode({(1, 2): Leaf(1)}, _spec)


def test_load_finds_a_dataclass_only_in_the_live_registry_by_its_id() -> None:
    tree = structure.encode(ModelOutput(Leaf(1)), _spec, types=TYPES)
    assert tree["type"] == "test.model_output"
    gone = {**tree, "type": "test.no_such_output"}
    want = r"outputs\.type: output type saved 'test\.no_such_output', live registry holds test\.model_output, "
    with pytest.raises(structure.StructureError, match=want + r"test\.with_derived: LOAD refused\. Re-run"):
        structure.decode(gone, _leaf, types=TYPES)
    # a module path is never resolved, even to a module the process has imported (json) or could import (tabnanny)
    for name in ("json:JSONDecoder", "tabnanny:NannyNag", f"{__name__}:ModelOutput"):
        with pytest.raises(structure.StructureError, match="live registry holds"):
            structure.decode({**tree, "type": name}, _leaf, types=TYPES)
    assert "tabnanny" not in sys.modules
    not_dc = {**tree, "type": "test.not_a_dataclass"}
    with pytest.raises(structure.StructureError, match=r"the registry's test\.not_a_dataclass is not a dataclass"):
        structure.decode(not_dc, _leaf, types={"test.not_a_dataclass": dict})
    changed = {**tree, "fields": {"logits": tree["fields"]["logits"]}}
    with pytest.raises(structure.StructureError, match="now has fields"):
        structure.decode(changed, _leaf, types=TYPES)
    with pytest.raises(structure.StructureError, match="damaged output record"):
        structure.decode({"kind": "set"}, _leaf)


# --------------------------------------------------------------------------------------------- graph names


def test_graph_set_refuses_duplicates_and_keeps_capture_order() -> None:
    gs: GraphSet[int] = GraphSet()
    for i, name in enumerate(["FULL/bs8", "PIECEWISE/bs8/piece0", "FULL/bs1"]):
        gs.add(name, i)
    with pytest.raises(DuplicateGraph, match="'FULL/bs8' is already registered"):
        gs.add("FULL/bs8", 9)
    assert gs["FULL/bs8"] == 0
    assert list(gs) == ["FULL/bs8", "PIECEWISE/bs8/piece0", "FULL/bs1"]


def test_unknown_graph_names_the_closest_ones() -> None:
    gs: GraphSet[int] = GraphSet()
    for b in (1, 2, 4, 8):
        gs.add(f"FULL/bs{b}", b)
    with pytest.raises(GraphNotFound) as info:
        gs["FULL/bs16"]
    msg = str(info.value)
    assert msg.startswith("no graph 'FULL/bs16' among 4 loaded graphs (closest: ")
    assert "'FULL/bs1'" in msg
    assert isinstance(info.value, KeyError)
    with pytest.raises(KeyError, match=r"no graph 'decode/3' among 4 loaded graphs \(known: 'FULL/bs1'"):
        gs["decode/3"]
    assert "x" not in gs and gs.get("x") is None


# --------------------------------------------------------------------------------------------- LOAD's validation


def _records(made: dict[str, tuple[dict[str, Any], bytes, bytes]], **change: Any) -> list[GraphRecord]:
    """Rank-record entries that match the packed graphs; `change` applies to FULL/bs8's."""
    out = []
    for name, (desc, _blob, _table) in made.items():
        record = GraphRecord(
            name=name,
            file="rank_0/graphs/index.json",
            topology_fingerprint=graphformat.topology_fingerprint(desc),
            node_count=len(desc["nodes"]),
            nodes_by_type={"kernel": len(desc["nodes"])},
            kernel_count=len(desc["nodes"]),
            images=(),
        )
        out.append(dataclasses.replace(record, **change) if name == "FULL/bs8" else record)
    return out


def test_check_graphs_gives_each_graph_checked_against_its_record(tmp_path: Path) -> None:
    pack, made = _packed()
    got = graphpack.read_graphs(open_archive(_write(tmp_path / "a", pack), keep_rank=0), 0, list(GRAPHS))
    for full in (False, True):
        descs = graphpack.check_graphs(_records(made), got, full=full)
        assert list(descs) == list(GRAPHS)
        for name, (desc, blob, table, _entry) in descs.items():
            assert blob == made[name][1] and table == made[name][2]
            assert desc == (made[name][0] if full else got.graphs[list(GRAPHS).index(name)].desc_of(got.pack))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"node_count": 41}, graphformat.GraphFormatError, r"graph 'FULL/bs8': description has 40 nodes"),
        ({"nodes_by_type": {"kernel": 39, "empty": 1}}, graphformat.GraphFormatError, "its record 40"),
        ({"topology_fingerprint": "00" * 32}, PersistError, "does not match its recorded topology fingerprint"),
        # a device-launchable executable (0x4) is not one LOAD may make for a host-replayed graph
        ({"instantiate_flags": 0xD}, graphformat.GraphFormatError, r"'FULL/bs8': instantiated with flags 0xd;"),
    ],
)
def test_check_graphs_refuses_a_graph_that_differs_from_its_record(
    tmp_path: Path, change: dict[str, Any], error: type[Exception], message: str
) -> None:
    pack, made = _packed()
    got = graphpack.read_graphs(open_archive(_write(tmp_path / "a", pack), keep_rank=0), 0, list(GRAPHS))
    with pytest.raises(error, match=message):
        graphpack.check_graphs(_records(made, **change), got, full=True)  # full: the fingerprint is recomputed


def test_check_graphs_accepts_torchs_instantiate_flags(tmp_path: Path) -> None:
    pack, made = _packed()
    got = graphpack.read_graphs(open_archive(_write(tmp_path / "a", pack), keep_rank=0), 0, list(GRAPHS))
    records = _records(made, instantiate_flags=graphformat.INSTANTIATE_FLAGS)
    assert records[-1].instantiate_flags == 0x9 and records[0].instantiate_flags == 0  # 0: what older archives read as
    assert list(graphpack.check_graphs(records, got, full=False)) == list(GRAPHS)


def test_pointer_inventory_must_hash_to_its_fingerprint(tmp_path: Path) -> None:
    pointers = [REGION_BASE, REGION_BASE + 4096]
    with ArchiveWriter(tmp_path / "a", world(**{"parallel.world_size": 1, "parallel.tp_size": 1})) as w:
        w.add_json(0, "pointers.json", pointers)
        w.set_rank_facts(0, _rank_facts("rank_0/pointers.json", []))
        archive = open_archive(w.commit())
    fingerprint = hashlib.sha256(json.dumps(pointers).encode()).hexdigest()
    assert graphpack.read_pointers(archive, 0, fingerprint) == pointers
    with pytest.raises(PersistError, match="pointer inventory does not match its recorded fingerprint"):
        graphpack.read_pointers(archive, 0, "00" * 32)
