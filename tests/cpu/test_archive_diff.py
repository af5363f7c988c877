"""`graphpersist diff A B`: two archives' graphs compared down to the parameter word (CPU, real archives)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from archive_fixtures import REGION_BASE, REGION_SIZE, device, world, write_loadable_archive
from pack_forgery import Graph, resave

from graphpersist import diff
from graphpersist.archive import ArchiveWriter, open_archive
from graphpersist.archive.manifest import GraphRecord
from graphpersist.graph import format as graphformat
from graphpersist.graph import pack as graphpack
from graphpersist.loadplan import read_plan

REPO = Path(__file__).resolve().parents[2]
BUF = REGION_BASE + (1 << 30)  # an address in the region
IMAGE = b"the kernel image both archives load"
EQUAL = (
    "the ranks, world facts, graphs (every field LOAD reads: nodes, edges, kernel parameters, functions, static "
    "tensors) and pointer inventories are equal"
)
SHA = hashlib.sha256(IMAGE).hexdigest()


def _graph(params: list[bytes], shape: dict | None = None) -> tuple[dict, bytes, bytes]:
    """A description, parameter blob and kernel table shaped like graphwalk.serialize's output; `shape` may give
    "blocks" (per node) and "edges" ([from, to, from_port, to_port, type] each; default: a chain)."""
    shape = shape or {}
    nodes, blob = [], bytearray()
    for i, p in enumerate(params):
        block = shape.get("blocks", {}).get(i, 32)
        nodes.append({"type": "kernel", "func": 0, "image": SHA, "name": f"k{i}", "grid": [1, 1, 1],
                      "block": [block, 1, 1], "smem": 0, "layout": [[o, 8] for o in range(0, len(p), 8)],
                      "params": [len(blob), len(p)], "attrs": {}})  # fmt: skip
        blob += p
    edges = shape.get("edges", [[i, i + 1, 0, 0, 0] for i in range(len(params) - 1)])
    desc = {"format": 1, "nodes": nodes, "edges": edges, "funcs": [[SHA, "k", {}]], "blob_size": len(blob),
            "blob_sha256": hashlib.sha256(blob).hexdigest()}  # fmt: skip
    table = graphformat.pack_kernel_table(desc)
    desc["table_size"], desc["table_sha256"] = len(table), hashlib.sha256(table).hexdigest()
    return desc, bytes(blob), table


def write(
    root: Path, graphs: dict[str, list[bytes]], shapes: dict[str, dict] | None = None, notes: dict | None = None
) -> Path:
    """An archive of one rank holding `graphs` (name -> kernel parameter bytes; `shapes`: name -> _graph's
    `shape`), with the pointer inventory SAVE would record (every in-region parameter word); `notes`: the rank's
    engine notes."""
    pack = graphpack.PackWriter()
    pointers: set[int] = set()
    records = []
    for name, params in graphs.items():
        desc, blob, table = _graph(params, (shapes or {}).get(name))
        pack.add(name, desc, blob, table, inputs=[], outputs={"kind": "value", "value": None})
        pointers |= {v for p in params for (v,) in struct.iter_unpack("<Q", p) if REGION_BASE <= v < BUF * 2}
        by_type = graphformat.node_types(desc)
        records.append({"name": name, "file": "rank_0/" + graphpack.INDEX_NAME,
                        "topology_fingerprint": graphformat.topology_fingerprint(desc),
                        "node_count": len(desc["nodes"]), "nodes_by_type": by_type,
                        "kernel_count": by_type["kernel"], "images": [SHA]})  # fmt: skip
    inventory = sorted(pointers)
    with ArchiveWriter(root, world(**{"parallel.world_size": 1, "parallel.tp_size": 1})) as w:
        image = w.add_image(SHA, IMAGE)
        w.add_json(0, graphpack.INDEX_NAME, pack.index())
        w.add_file(0, graphpack.PACK_NAME, pack.data())
        w.add_json(0, "pointers.json", inventory)
        w.set_rank_facts(0, {
            "device": device(0),
            "region": {"base": REGION_BASE, "size": REGION_SIZE, "final_offset": 0},
            "pointers": {"fingerprint": hashlib.sha256(json.dumps(inventory).encode()).hexdigest(),
                         "count": len(inventory)},
            "graphs": records,
            "images": [{"sha256": SHA, "file": image, "size": len(IMAGE), "kind": "cubin", "entries": ["k"]}],
            "extra": {"engine_notes": notes or {}},
        })  # fmt: skip
        return w.commit()


def words(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def graphpersist(*args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(REPO / "overlays" / "graphpersist"), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "graphpersist", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": path})  # fmt: skip


SAME = {"full/1": [words(BUF, 7), words(BUF + 64, 1)], "full/2": [words(BUF, 9)]}


def test_equal_archives_exit_0_saying_so(tmp_path: Path) -> None:
    a, b = write(tmp_path / "a", SAME), write(tmp_path / "b", SAME)
    ran = graphpersist("diff", str(a), str(b))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        f"graphpersist diff: {a} (A) vs {b} (B), rank(s) 0",
        EQUAL,
    ]


def test_a_pointer_only_one_archive_has_is_traced_to_its_kernel_parameter(tmp_path: Path) -> None:
    """What "archives a = b" could not say: which graph, kernel and parameter bytes hold the extra addresses."""
    other = {"full/1": [words(BUF, 7), words(BUF + 64, 1)], "full/2": [words(BUF + 4096, 9)]}
    a, b = write(tmp_path / "a", SAME), write(tmp_path / "b", other)
    ran = graphpersist("diff", str(a), str(b), "--rank", "0")
    assert ran.returncode == 1, ran.stderr
    assert ran.stdout.splitlines()[1:] == [
        "rank 0: pointers 2 vs 3: only in A 0, only in B 1",
        f"  only in B: {BUF + 4096:#x} used by full/2 node 0 kernel 'k0' bytes 0..7 (A has {BUF:#x} (region) there)",
        "rank 0: 1 of 2 graphs differ",
        f"  full/2: node 0 kernel 'k0': bytes 0..7: {BUF:#x} (region) vs {BUF + 4096:#x} (region)",
        "rank 0: the differing parameter words, by kernel and offset (1):",
        f"  'k0' bytes 0..7: in 1 graph(s), e.g. full/2: {BUF:#x} (region) vs {BUF + 4096:#x} (region)",
    ]


def test_numbers_kernels_and_lengths_that_differ_are_named(tmp_path: Path) -> None:
    other = {"full/1": [words(BUF, 8), words(BUF + 64, 1)], "full/2": [words(BUF, 9), words(1)]}
    a, b = write(tmp_path / "a", SAME), write(tmp_path / "b", other)
    lines = graphpersist("diff", str(a), str(b), "--limit", "1").stdout.splitlines()
    assert lines[1:] == [
        "rank 0: 2 of 2 graphs differ",
        "rank 0: 1 of them in their topology (what the topology fingerprint covers), e.g. full/2",
        "  full/2: kernel sequences differ (1 vs 2 kernel nodes, first at kernel node 1)",
        "  ... 1 more",
        "rank 0: the differing parameter words, by kernel and offset (1):",
        "  'k0' bytes 8..15: in 1 graph(s), e.g. full/1: 0x7 vs 0x8",
    ]
    lines = graphpersist("diff", str(a), str(b), "--limit", "5").stdout.splitlines()
    assert "  full/1: node 0 kernel 'k0': bytes 8..15: 0x7 vs 0x8" in lines


def test_launch_shapes_and_edges_that_differ_are_named_before_parameters(tmp_path: Path) -> None:
    """A vLLM SAVE pair differed in 127 graphs' topology fingerprints while every graph also differed in a host
    address word of cuBLASLt's split-K reduction: the diff names the topology first, with the field and values."""
    three = {"piecewise/8/036": [words(1), words(2), words(3)], "piecewise/8/001": [words(4), words(5)]}
    noisy = {"piecewise/8/036": [words(1), words(2), words(3)], "piecewise/8/001": [words(4), words(6)]}
    pdl = [[0, 1, 1, 0, 1], [1, 2, 0, 0, 0]]
    shapes = {"piecewise/8/036": {"blocks": {2: 128}}, "piecewise/8/001": {"edges": [[0, 1, 1, 0, 1]]}}
    a = write(tmp_path / "a", three, {"piecewise/8/036": {"edges": pdl}})
    b = write(tmp_path / "b", noisy, {**shapes, "piecewise/8/036": {"blocks": {2: 128}, "edges": pdl}})
    ran = graphpersist("diff", str(a), str(b))
    assert ran.returncode == 1, ran.stderr
    assert ran.stdout.splitlines()[1:4] == [
        "rank 0: 2 of 2 graphs differ",
        "rank 0: 2 of them in their topology (what the topology fingerprint covers), e.g. piecewise/8/036, "
        "piecewise/8/001",
        "  piecewise/8/036: node 2 kernel 'k2': block [32,1,1] vs [128,1,1]",
    ]
    assert ran.stdout.splitlines()[4] == (
        "  piecewise/8/001: edges differ (1 vs 1): only in A ['[0,1,0,0,0]'], only in B ['[0,1,1,0,1]']"
    )


def test_misuse_exits_2_naming_the_problem(tmp_path: Path) -> None:
    a = write(tmp_path / "a", SAME)
    missing = graphpersist("diff", str(a), str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "nowhere" in missing.stderr
    wrong_rank = graphpersist("diff", str(a), str(a), "--rank", "3")
    assert wrong_rank.returncode == 2 and "not in both archives (A has [0], B has [0])" in wrong_rank.stderr


def test_words_that_differ_everywhere_are_listed_once_per_kernel_and_offset(tmp_path: Path) -> None:
    """vLLM's two SAVEs differed in every graph (custom all-reduce's unused peer slots) and in a few (FA3's combine
    kernel): the by-kernel list says both at once, most graphs first, with the other archive's word."""
    base = {f"g/{i}": [words(BUF, 5, 1), words(BUF + 64, 2)] for i in range(3)}
    other = {f"g/{i}": [words(BUF, 6, 1), words(BUF + 64, 2 if i else 3)] for i in range(3)}
    a, b = write(tmp_path / "a", base), write(tmp_path / "b", other)
    lines = graphpersist("diff", str(a), str(b), "--limit", "5").stdout.splitlines()
    at = lines.index("rank 0: the differing parameter words, by kernel and offset (2):")
    assert lines[at + 1 :] == [
        "  'k0' bytes 8..15: in 3 graph(s), e.g. g/0: 0x5 vs 0x6",
        "  'k1' bytes 8..15: in 1 graph(s), e.g. g/0: 0x2 vs 0x3",
    ]


def test_kernel_choices_that_differ_are_named_with_both_configs(tmp_path: Path) -> None:
    """Two SAVEs that launched another config of one Inductor kernel (what made a kernel image differ at TP=1)."""
    wide, half = "R0_BLOCK=4096,XBLOCK=1,num_warps=16,num_stages=1", "R0_BLOCK=2048,XBLOCK=1,num_warps=16,num_stages=1"

    def choice(chosen: str, how: str) -> dict:
        return {"kernel": "triton_red_fused_add_rms_norm_2", "candidates": [wide, half], "chosen": chosen, "how": how}

    same = {"kernel": "triton_poi_fused_1", "candidates": ["a", "b"], "chosen": "a", "how": "timed"}
    a = write(tmp_path / "a", SAME, notes={"kernel_choices": {"cabc": choice(half, "timed"), "cdef": same}})
    b = write(tmp_path / "b", SAME, notes={"kernel_choices": {"cabc": choice(wide, "timed"), "cdef": same}})
    out = graphpersist("diff", str(a), str(b))
    assert out.returncode == 1, out.stderr
    assert out.stdout.splitlines()[1:] == [
        "rank 0: Inductor's kernel choices differ in 1 of the 2 kernel(s) both chose for:",
        f"  triton_red_fused_add_rms_norm_2 (cabc): A {half} (timed), B {wide} (timed)",
    ]


def test_a_save_that_chose_nothing_does_not_differ_in_its_choices(tmp_path: Path) -> None:
    """A warm SAVE loads the compiled artifact and chooses nothing: the same kernels run as in the cold SAVE."""
    notes = {"kernel_choices": {"cabc": {"kernel": "k", "candidates": ["a", "b"], "chosen": "a", "how": "timed"}}}
    cold, warm = write(tmp_path / "cold", SAME, notes=notes), write(tmp_path / "warm", SAME)
    out = graphpersist("diff", str(cold), str(warm))
    assert out.returncode == 0, out.stdout
    assert out.stdout.splitlines()[1] == EQUAL


# ------------------------------------------------------------------- what LOAD reads that diff once did not compare
# Issue 41: two archives that differed only in these said "equal". Each edit is SAVE's archive written again with one
# field changed (pack_forgery.resave: every hash and digest recomputed), an archive `check` accepts.

B0, B1, B2 = REGION_BASE + 4096, REGION_BASE + (64 << 20) + 512, REGION_BASE + (96 << 20)  # the fixture's buffers
IN = r"\(region\)"


def _on(name: str, change: Callable[[Graph], None]) -> Callable[[list[Graph]], None]:
    def edit(graphs: list[Graph]) -> None:
        change(next(g for g in graphs if g.record["name"] == name))

    return edit


def _node(index: int, **fields: Any) -> Callable[[Graph], None]:
    return lambda g: g.desc["nodes"][index].update(fields)


BLIND_SPOTS: dict[str, tuple[Callable[[Graph], None], str]] = {
    "memcpy source": (_node(12, srcDevice=B2), rf"node 12 \(memcpy\): srcDevice {B0:#x} {IN} vs {B2:#x} {IN}"),
    "memcpy destination": (_node(12, dstDevice=B0), rf"node 12 \(memcpy\): dstDevice {B1:#x} {IN} vs {B0:#x} {IN}"),
    "memset destination": (_node(1, dst=B0), rf"node 1 \(memset\): dst {B2:#x} {IN} vs {B0:#x} {IN}"),
    "function-table name": (lambda g: g.desc["funcs"][0].__setitem__(1, "k_own_v2"),
                            r'description\.funcs\[0\]\[1\]: "k_own" vs "k_own_v2"'),
    "function attributes": (lambda g: g.desc["funcs"][1].__setitem__(2, {"8": 1024}),
                            r"description\.funcs\[1\]\[2\]\.8: 65536 vs 1024"),
    "function image": (lambda g: g.desc["funcs"][0].__setitem__(0, g.desc["funcs"][1][0]),
                       r'description\.funcs\[0\]\[0\]: "[0-9a-f]{64}" vs "[0-9a-f]{64}"'),
    "static input tensor": (lambda g: g.inputs[0].update(shape=[8, 32]), r"index\.inputs\[0\]\.shape\[1\]: 64 vs 32"),
    "static output tensor": (lambda g: g.outputs["items"][0]["spec"].update(addr=B0),
                             rf"index\.outputs\.items\[0\]\.spec\.addr: {B1:#x} {IN} vs {B0:#x} {IN}"),
    "output structure": (lambda g: g.outputs["items"][1].update(value=1),
                         r"index\.outputs\.items\[1\]\.value: null vs 1"),
    "instantiate flags": (lambda g: g.record.update(instantiate_flags=9), r"record\.instantiate_flags: 1 vs 9"),
}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_loadable_archive(tmp_path_factory.mktemp("diff") / "a")


@pytest.mark.parametrize("spot", sorted(BLIND_SPOTS))
def test_diff_names_every_field_load_reads_that_differs(saved: Path, tmp_path: Path, spot: str) -> None:
    change, line = BLIND_SPOTS[spot]
    other = tmp_path / "b"
    shutil.copytree(saved, other)
    resave(other, 0, _on("full-bs8", change))
    read_plan(open_archive(other), 0, every_byte=True)  # an archive `check` accepts
    lines = diff.diff_archives(open_archive(saved), open_archive(other), [0, 1], 5)
    assert re.fullmatch(r"rank 0: [14] of 4 graphs differ", lines[0]), lines  # a function: every graph that calls it
    assert [x for x in lines if re.fullmatch(rf"  full-bs8: {line}", x)], lines


def test_what_diff_compares_is_derived_from_the_records(saved: Path) -> None:
    """A field added to a graph's record, index entry or description is compared unless it is left out, with why."""
    plan = read_plan(open_archive(saved), 0, every_byte=True)
    desc, _blob, table, entry = plan.graphs["full-bs8"]
    fields = diff.load_fields(plan.record.graphs[3], desc, bytes(table), entry)
    for f in dataclasses.fields(GraphRecord):
        assert (f"record.{f.name}" in fields) != (f.name in diff.RECORD_NOT_COMPARED), f.name
    for f in dataclasses.fields(graphpack.PackedGraph):
        assert (f"index.{f.name}" in fields) != (f.name in diff.INDEX_NOT_COMPARED), f.name
    assert {k for k in fields if k.startswith("description.")} == {f"description.{k}" for k in desc if k != "nodes"}
    assert fields["node 12"] == {k: v for k, v in desc["nodes"][12].items()} and "params" not in fields["node 0"]
