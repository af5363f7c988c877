"""Graph records packed into two files per rank: a JSON index and one binary pack.

An engine captures thousands of graphs (vLLM: about 1900 per worker, mostly small piecewise pieces); one set of
files per graph would mean thousands of fsync'd files at SAVE and thousands of opens and hashes at LOAD. The
pack holds, per graph in capture order, its description (compact JSON), its kernel parameter blob and its packed
kernel table; the index names each graph with the byte span of each part and its static-tensor records:

    rank_<r>/graphs/index.json   {"format": 1, "pack": "graphs/pack.bin", "pack_size": N,
                                  "graphs": [{"name", "desc": [off, len], "kernels": [off, len],
                                              "params": [off, len], "table": [off, len],
                                              "inputs": [...], "outputs": {...}}, ...]}
    rank_<r>/graphs/pack.bin     the parts, back to back

The description is stored in two parts so that LOAD's native path parses only what it needs: `desc` is the
description with every kernel node reduced to {"type": "kernel"} (edges, functions, events, non-kernel nodes,
sizes: small), `kernels` the full kernel nodes in node order (names, launch shapes, attributes: most of the
bytes, and all already in the binary kernel table). full_desc() puts them back together (inspection, the
reference rebuild, the topology fingerprint).

Both files go through ArchiveWriter (atomic, listed in the manifest with their sha256), so every byte is covered
by the file table; parse_index() checks the index's own shape (spans inside the pack, not overlapping, names
unique) so a damaged or hand-edited index is refused with a message rather than slicing garbage. Needs neither
torch nor CUDA.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from graphpersist.archive import Archive, ArchiveError, archive_path

PACK_FORMAT = 1
INDEX_NAME = "graphs/index.json"
PACK_NAME = "graphs/pack.bin"
_PARTS = ("desc", "kernels", "params", "table")
_KERNEL_STUB = {"type": "kernel"}


class PackError(ValueError):
    """A graph index that cannot be trusted; `problems` lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class PackedGraph:
    """One graph's entry in the index: byte spans into the pack and its static-tensor records."""

    name: str
    desc: tuple[int, int]
    kernels: tuple[int, int]
    params: tuple[int, int]
    table: tuple[int, int]
    inputs: list[Any]
    outputs: Any

    def part(self, pack: bytes, which: str) -> bytes:
        off, n = getattr(self, which)
        return pack[off : off + n]

    def desc_of(self, pack: bytes) -> dict[str, Any]:
        """The description with kernel nodes reduced to {"type": "kernel"} (what the native rebuild needs)."""
        return json.loads(self.part(pack, "desc"))

    def full_desc_of(self, pack: bytes) -> dict[str, Any]:
        """The whole description, as graphwalk.serialize wrote it."""
        return full_desc(self.desc_of(pack), json.loads(self.part(pack, "kernels")))


def split_desc(desc: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(description with kernel nodes reduced to stubs, the kernel nodes in node order)."""
    kernels = [nd for nd in desc["nodes"] if nd["type"] == "kernel"]
    light = {**desc, "nodes": [_KERNEL_STUB if nd["type"] == "kernel" else nd for nd in desc["nodes"]]}
    return light, kernels


def full_desc(light: Mapping[str, Any], kernels: list[dict[str, Any]]) -> dict[str, Any]:
    """Inverse of split_desc; refuses parts that do not fit together."""
    stubs = sum(1 for nd in light["nodes"] if nd["type"] == "kernel")
    if stubs != len(kernels):
        raise PackError([f"the description has {stubs} kernel nodes, its kernel part {len(kernels)}"])
    it = iter(kernels)
    return {**light, "nodes": [next(it) if nd["type"] == "kernel" else nd for nd in light["nodes"]]}


@dataclass
class PackWriter:
    """Collects graph records in capture order; `index()` and `data()` are what SAVE writes."""

    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    entries: list[dict[str, Any]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)

    def _put(self, data: bytes) -> list[int]:
        span = [self.size, len(data)]
        self.parts.append(data)
        self.size += len(data)
        return span

    def add(
        self, name: str, desc: Mapping[str, Any], params: bytes, table: bytes, *, inputs: list[Any], outputs: Any
    ) -> None:
        if name in self.names:
            raise ValueError(f"graph {name!r} is already in the pack")
        self.names.add(name)
        light, kernels = split_desc(desc)
        entry = {"name": name, "desc": self._put(_compact(light)), "kernels": self._put(_compact(kernels))}
        entry["params"], entry["table"] = self._put(bytes(params)), self._put(bytes(table))
        entry["inputs"], entry["outputs"] = inputs, outputs
        self.entries.append(entry)

    def index(self) -> dict[str, Any]:
        return {"format": PACK_FORMAT, "pack": PACK_NAME, "pack_size": self.size, "graphs": self.entries}

    def data(self) -> bytes:
        return b"".join(self.parts)


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _span(value: Any) -> tuple[int, int] | None:
    ok = (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )
    return (value[0], value[1]) if ok else None


def parse_index(index: Any, pack_size: int) -> list[PackedGraph]:
    """The graphs of a parsed index.json, in capture order; PackError lists every problem with it."""
    if not isinstance(index, dict):
        raise PackError([f"the graph index is a {type(index).__name__}, not an object"])
    if index.get("format") != PACK_FORMAT:
        raise PackError(
            [f"graph index format {index.get('format')!r} is not {PACK_FORMAT} (written by another release)"]
        )
    problems = []
    if index.get("pack") != PACK_NAME:
        problems.append(f"the index names pack {index.get('pack')!r}, expected {PACK_NAME!r}")
    if index.get("pack_size") != pack_size:
        problems.append(f"the index says the pack has {index.get('pack_size')!r} bytes, it has {pack_size}")
    rows = index.get("graphs")
    if not isinstance(rows, list):
        raise PackError([*problems, "the index has no list of graphs"])
    out: list[PackedGraph] = []
    seen: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for i, row in enumerate(rows):
        name = row.get("name") if isinstance(row, dict) else None
        if not isinstance(name, str) or not name:
            problems.append(f"graph entry {i} has no name")
            continue
        if name in seen:
            problems.append(f"graph {name!r} is listed twice")
        seen.add(name)
        parts = {}
        for part in _PARTS:
            span = _span(row.get(part))
            if span is None:
                problems.append(f"graph {name!r}: {part} span {row.get(part)!r} is not [offset, length]")
            elif span[0] + span[1] > pack_size:
                problems.append(
                    f"graph {name!r}: {part} bytes {span[0]}..{span[0] + span[1]} lie past the end of the pack "
                    f"({pack_size} bytes): the pack is truncated or the index is damaged"
                )
            else:
                parts[part] = span
                spans.append((span[0], span[1], f"{name!r} {part}"))
        if not isinstance(row.get("inputs"), list) or "outputs" not in row:
            problems.append(f"graph {name!r}: no static tensor records (inputs, outputs)")
        elif len(parts) == len(_PARTS):
            out.append(PackedGraph(name, *(parts[p] for p in _PARTS), row["inputs"], row["outputs"]))
    spans.sort()
    for (a_off, a_len, a), (b_off, _b_len, b) in itertools.pairwise(spans):
        if b_off < a_off + a_len:
            problems.append(f"graph parts overlap in the pack: {a} and {b}")
    if problems:
        raise PackError(problems)
    return out


@dataclass
class GraphPack:
    """A rank's verified pack bytes and its graphs in capture order."""

    pack: bytes
    graphs: list[PackedGraph]


def read_graphs(archive: Archive, rank: int, names: list[str]) -> GraphPack:
    """Rank `rank`'s graph pack and index, checked against the rank record's graph names and their order.

    Raises ArchiveError naming every problem (a missing, malformed or inconsistent index).
    """
    index_rel = archive_path(rank, INDEX_NAME)
    if index_rel not in archive.manifest.files:
        raise ArchiveError(
            archive.root, f"it has no {index_rel}: written by a graphpersist release that stored one file per graph"
        )
    index = archive.read_json(rank, INDEX_NAME)
    pack = archive.read(rank, PACK_NAME)
    try:
        graphs = parse_index(index, len(pack))
    except PackError as exc:
        raise ArchiveError(archive.root, [f"{index_rel}: {p}" for p in exc.problems]) from None
    listed = [g.name for g in graphs]
    if listed != names:
        raise ArchiveError(
            archive.root, f"{index_rel} lists graphs {_short(listed)}, rank {rank}'s record lists {_short(names)}"
        )
    return GraphPack(pack, graphs)


def _short(names: list[str]) -> str:
    return repr(names) if len(names) <= 6 else f"{names[:3]!r} ... ({len(names)} graphs)"
