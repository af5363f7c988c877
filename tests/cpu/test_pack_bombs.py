"""Decompression bombs in a graph pack: a kernel part's declared size is held to what its graph's kernel table can
describe, and a rank's total to graphpack.MAX_KERNEL_JSON, before anything inflates; inflating stops at the declared
size (graphpersist.graph.pack).

The archives are write_loadable_archive's (what SAVE writes), forged: every digest recomputed, as a forger would.
"""

from __future__ import annotations

import json
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest
from archive_fixtures import write_loadable_archive
from pack_forgery import MIB, deflate_bomb, read_graphs, replace_kernel_part

from graphpersist.archive import ArchiveError, open_archive
from graphpersist.graph import format as graphformat
from graphpersist.graph import pack as graphpack
from graphpersist.loadplan import read_plan


def test_deflate_bomb_is_a_real_one() -> None:
    """The forged parts below would inflate (today's code did: 5.5 s and 2.1 GB per graph for `check`)."""
    bomb = deflate_bomb(3)
    assert zlib.decompress(bomb) == b" " * (3 * MIB)
    assert len(deflate_bomb(1050)) < 1100 * MIB // 1000


def test_a_forged_1_mib_kernel_part_declaring_a_gigabyte_is_refused_at_once(tmp_path: Path) -> None:
    """The issue's case: a kernel part of about 1 MiB that inflates to 1.1 GB (within the 1100x inflation cap).
    `check` (every byte) and LOAD's CPU stage refuse it before inflating: fast, and without the memory."""
    root = write_loadable_archive(tmp_path / "a")
    part = deflate_bomb(1050)
    replace_kernel_part(root, 0, 0, part, 1050 * MIB)
    archive = open_archive(root)
    tracemalloc.start()
    started = time.process_time()  # CPU: what inflating would cost (a loaded CI machine stretches wall time)
    for every_byte in (True, False):
        with pytest.raises(ArchiveError) as caught:
            read_plan(archive, 0, every_byte=every_byte)
        message = str(caught.value)
        assert f"graph 'full-bs1', its kernel part of {len(part)} bytes declares {1050 * MIB}" in message, message
    took = time.process_time() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert took < 0.5 and peak < 16 * MIB, (took, peak)


def test_a_kernel_part_declaring_more_than_its_kernel_table_can_describe_is_refused(tmp_path: Path) -> None:
    """Under the rank's cap, a graph's declared size is held to its own kernel nodes: each row of its kernel table
    (function, parameters, attributes) can take only so much JSON."""
    root = write_loadable_archive(tmp_path / "a")
    replace_kernel_part(root, 0, 2, deflate_bomb(64), 64 * MIB)
    started = time.process_time()
    with pytest.raises(ArchiveError, match=r"graph 'full-bs4': its kernel part of \d+ bytes declares 67108864 bytes "
                                           r"of kernel nodes, more than its 8 kernel nodes can take \(\d+ bytes at "
                                           r"most\)"):  # fmt: skip
        read_plan(open_archive(root), 0, every_byte=True)
    assert time.process_time() - started < 0.5


def test_inflating_stops_at_the_declared_size(tmp_path: Path) -> None:
    """A part that holds more than it declares is refused once the declared size is reached, never inflated on."""
    root = write_loadable_archive(tmp_path / "a")
    graph = read_graphs(root, 0)[0]
    text = json.dumps([nd for nd in graph.desc["nodes"] if nd["type"] == "kernel"], sort_keys=True,
                      separators=(",", ":")).encode()  # fmt: skip
    replace_kernel_part(root, 0, 0, zlib.compress(text + b" " * (8 * MIB)), len(text))
    with pytest.raises(ArchiveError, match=f"graph 'full-bs1': its kernel nodes do not inflate to {len(text)} bytes"):
        read_plan(open_archive(root), 0, every_byte=True)


def test_bytes_after_the_compressed_stream_are_refused(tmp_path: Path) -> None:
    root = write_loadable_archive(tmp_path / "a")
    graph = read_graphs(root, 0)[0]
    text = json.dumps([nd for nd in graph.desc["nodes"] if nd["type"] == "kernel"], sort_keys=True,
                      separators=(",", ":")).encode()  # fmt: skip
    replace_kernel_part(root, 0, 0, zlib.compress(text) + b"trailing", len(text))
    with pytest.raises(ArchiveError, match="its kernel part holds 8 bytes after its compressed stream"):
        read_plan(open_archive(root), 0, every_byte=True)


def test_the_rank_total_is_capped_naming_the_largest_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_loadable_archive(tmp_path / "a")
    index = json.loads((root / "rank_0/graphs/index.json").read_bytes())
    sizes = [g.kernels_size for g in graphpack.parse_index(index, (root / "rank_0/graphs/pack.bin").stat().st_size)]
    monkeypatch.setattr(graphpack, "MAX_KERNEL_JSON", sum(sizes) - 1)
    with pytest.raises(ArchiveError, match=f"declare {sum(sizes)} bytes of kernel nodes in all, more than the "
                                           f"{sum(sizes) - 1} a rank's graph pack may inflate to"):  # fmt: skip
        read_plan(open_archive(root), 0)
    monkeypatch.setattr(graphpack, "MAX_KERNEL_JSON", sum(sizes))
    read_plan(open_archive(root), 0, every_byte=True)


def test_the_bound_holds_the_largest_kernel_nodes_save_can_write() -> None:
    """Every number at its largest, a name escaped at its worst (outside the BMP), every parameter and attribute:
    the JSON SAVE writes for such nodes fits the bound kernels_bound gives for their table."""
    name = "\U0001f600\x01" * 300
    funcs = [["f" * 64, name, {}], ["e" * 64, "k", {"8": 65536}]]
    full = "ff" * graphformat.ATTR_BYTES
    nodes = [{"type": "kernel", "func": f, "image": funcs[f][0], "name": funcs[f][1], "grid": [2**32 - 1] * 3,
              "block": [2**32 - 1] * 3, "smem": 2**32 - 1, "layout": [[2**32 - 2, 1]] * n_params,
              "params": [0, 2**32 - 1], "attrs": {str(2**32 - 1 - a): full for a in range(n_attrs)}}
             for f, n_params, n_attrs in ((0, 4096, 20), (1, 0, 0), (0, 1, 1))]  # fmt: skip
    desc = {"nodes": nodes, "funcs": funcs, "edges": []}
    table = graphformat.pack_kernel_table(desc)
    text = json.dumps(nodes, sort_keys=True, separators=(",", ":")).encode()
    assert len(text) <= graphpack.kernels_bound(desc, table) < 2 * len(text)


def test_graphs_as_save_writes_them_fit_their_bound(tmp_path: Path) -> None:
    root = write_loadable_archive(tmp_path / "a")
    for rank in (0, 1):
        plan = read_plan(open_archive(root), rank, every_byte=True)
        for _name, (desc, _blob, table, entry) in plan.graphs.items():
            assert entry.kernels_size <= graphpack.kernels_bound(desc, table)
