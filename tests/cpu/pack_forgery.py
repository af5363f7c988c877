"""Forged graph packs, every digest recomputed as a forger would: a kernel part replaced by a decompression bomb, and
a rank's graphs written again from edited descriptions (what `graphpersist diff` must tell from the original).

`forge` is archive_fixtures.forge unless given; the archive fuzz passes its own, which replaces the files it rewrites
instead of writing through the hard links its cases share with the original.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archive_fixtures import forge as forge_file
from archive_fixtures import redigest

from graphpersist.graph import format as graphformat
from graphpersist.graph import pack as graphpack

Forge = Callable[[Path, str, bytes], None]
MIB = 1 << 20


def deflate_bomb(mib: int, byte: int = 0x20) -> bytes:
    """A zlib stream of about `mib` KiB that inflates to `mib` MiB of `byte`, made in milliseconds: one MiB
    compressed and fully flushed (after a full flush the next MiB compresses to the same bytes), repeated, then an
    empty last block and the Adler-32 of the whole, computed rather than inflated."""
    chunk = bytes([byte]) * MIB
    c = zlib.compressobj(9)
    head = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    unit = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    n = mib * MIB
    a = (1 + n * byte) % 65521
    b = (n + byte * n * (n + 1) // 2) % 65521
    return head + unit * (mib - 1) + b"\x03\x00" + ((b << 16) | a).to_bytes(4, "big")


def _paths(rank: int) -> tuple[str, str, str]:
    return f"rank_{rank}/{graphpack.INDEX_NAME}", f"rank_{rank}/{graphpack.PACK_NAME}", f"rank_{rank}/rank.json"


def replace_kernel_part(
    root: Path, rank: int, graph: int, part: bytes, kernels_size: int, forge: Forge = forge_file
) -> None:
    """Graph number `graph` of rank `rank` gets `part` as its kernel part, its index entry declaring `kernels_size`
    (the parts after it move; the index and the pack forged)."""
    index_rel, pack_rel, _ = _paths(rank)
    index = json.loads((root / index_rel).read_bytes())
    pack = (root / pack_rel).read_bytes()
    entry = index["graphs"][graph]
    off, n = entry["kernels"]
    for other in index["graphs"]:
        for key in ("kernels", "params", "table"):
            if other[key][0] > off:
                other[key][0] += len(part) - n
    entry["kernels"], entry["kernels_size"] = [off, len(part)], kernels_size
    data = pack[:off] + part + pack[off + n :]
    index["pack_size"] = len(data)
    forge(root, pack_rel, data)
    forge(root, index_rel, json.dumps(index, indent=2).encode())


@dataclass
class Graph:
    """One graph as resave() hands it to an edit: its rank-record entry and what SAVE packed of it."""

    record: dict[str, Any]  # GraphRecord's fields
    desc: dict[str, Any]  # the full description, as graphwalk wrote it
    blob: bytes
    inputs: list[Any]
    outputs: Any


def read_graphs(root: Path, rank: int) -> list[Graph]:
    index_rel, pack_rel, rec_rel = _paths(rank)
    index = json.loads((root / index_rel).read_bytes())
    pack = (root / pack_rel).read_bytes()
    records = {g["name"]: g for g in json.loads((root / rec_rel).read_bytes())["graphs"]}
    return [
        Graph(records[g.name], g.full_desc_of(pack), bytes(g.part(pack, "params")), g.inputs, g.outputs)
        for g in graphpack.parse_index(index, len(pack))
    ]


def resave(root: Path, rank: int, edit: Callable[[list[Graph]], None], forge: Forge = forge_file) -> None:
    """Rank `rank`'s graphs read back, changed by `edit`, and written again as SAVE writes them: each graph's kernel
    table, blob and table sha256s, topology fingerprint and node counts recomputed; pack, index and rank record
    forged."""
    graphs = read_graphs(root, rank)
    edit(graphs)
    writer = graphpack.PackWriter()
    for g in graphs:
        g.desc["blob_size"], g.desc["blob_sha256"] = len(g.blob), hashlib.sha256(g.blob).hexdigest()
        table = graphformat.pack_kernel_table(g.desc)
        g.desc["table_size"], g.desc["table_sha256"] = len(table), hashlib.sha256(table).hexdigest()
        writer.add(g.record["name"], g.desc, g.blob, table, inputs=g.inputs, outputs=g.outputs)
        by_type = graphformat.node_types(g.desc)
        g.record.update(topology_fingerprint=graphformat.topology_fingerprint(g.desc), node_count=len(g.desc["nodes"]),
                        nodes_by_type=by_type, kernel_count=by_type.get("kernel", 0))  # fmt: skip
    index_rel, pack_rel, rec_rel = _paths(rank)
    forge(root, pack_rel, writer.data())
    forge(root, index_rel, json.dumps(writer.index(), indent=2).encode())
    record = json.loads((root / rec_rel).read_bytes())
    record["graphs"] = [g.record for g in graphs]
    forge(root, rec_rel, json.dumps(redigest(record), indent=2).encode())
