"""Graph records packed into two files per rank: a JSON index and one binary pack.

An engine captures thousands of graphs (vLLM: about 1900 per worker, mostly small piecewise pieces); one set of
files per graph would mean thousands of fsync'd files at SAVE and thousands of opens and hashes at LOAD. The
pack holds, per graph in capture order, three binary parts back to back; the index names each graph with the
byte span of each part, its description and its static-tensor records:

    rank_<r>/graphs/index.json   {"format": 2, "pack": "graphs/pack.bin", "pack_size": N,
                                  "funcs": [[image sha256, kernel name, function attributes], ...],
                                  "descs": [{"node_count", "other_nodes", "edge_ends", "func_ids", ...}, ...],
                                  "graphs": [{"name", "desc": i, "own": {"blob_size", "blob_sha256", "table_size",
                                              "table_sha256"}, "kernels": [off, len], "kernels_size": n,
                                              "params": [off, len], "table": [off, len],
                                              "inputs": [...], "outputs": {...}}, ...]}
    rank_<r>/graphs/pack.bin     the parts, back to back

Laid out for what LOAD's native path reads, which is little. A graph's description without its kernel nodes is
`descs[desc]` (node count, the non-kernel nodes with their indices, the edges' ends as one flat list, edge data
only when some edge has any, events, the indices of its functions in `funcs`) plus its `own` sizes and hashes:
graphs of equal shape (every batch size of a piece, every FULL graph) share one entry of `descs`, so LOAD parses
and checks each shape once, not 1900 times. `params` is the kernel parameter blob, `table` the packed kernel
table (graphformat), `kernels` the full kernel nodes in node order (names, launch shapes, attributes: all already
in the table) as zlib-compressed JSON of `kernels_size` bytes, read only by full_desc_of() (inspection, the
reference rebuild, the topology fingerprint). desc_of() gives the description with kernel nodes as
{"type": "kernel"} stubs and the edges as stored (parts shared between graphs: read-only); full_desc_of() the
description graphwalk.serialize wrote. Format 1 packs (every part JSON in the pack, kernel stubs and five-number
edges parsed per graph) are refused: written by an older release, SAVE again.

Both files go through ArchiveWriter (atomic, listed in the manifest with their sha256), so every byte is covered
by the file table; parse_index() checks the index's own shape (spans inside the pack, not overlapping, names
unique) so a damaged or hand-edited index is refused with a message rather than slicing garbage. Needs neither
torch nor CUDA.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphpersist.archive import ADVICE, Archive, ArchiveError, archive_path, safejson
from graphpersist.archive.manifest import GraphRecord
from graphpersist.archive.shown import shown
from graphpersist.errors import PersistError
from graphpersist.graph import format as graphformat

PACK_FORMAT = 2  # 2: the kernel nodes' part is zlib-compressed, its JSON size in `kernels_size`
INDEX_NAME = "graphs/index.json"
PACK_NAME = "graphs/pack.bin"
_PARTS = ("kernels", "params", "table")
_KERNEL_STUB = {"type": "kernel"}


class PackError(ValueError):
    """A graph index that cannot be trusted; `problems` lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass
class PackedGraph:
    """One graph's entry in the index: byte spans into the pack, its description and static-tensor records."""

    name: str
    kernels: tuple[int, int]
    params: tuple[int, int]
    table: tuple[int, int]
    inputs: list[Any]
    outputs: Any
    kernels_size: int
    shared: dict[str, Any] = field(repr=False)  # its entry of the index's `descs`, expanded (expand_desc)
    own: dict[str, Any] = field(repr=False)  # its blob and table sizes and hashes

    def part(self, pack: bytes, which: str) -> memoryview:
        """One part ("kernels", "params", "table") of this graph, without copying it."""
        off, n = getattr(self, which)
        return memoryview(pack)[off : off + n]

    def desc_of(self, pack: bytes) -> dict[str, Any]:
        """The description with kernel nodes reduced to {"type": "kernel"} (what the native rebuild needs)."""
        return {**self.shared, **self.own}

    def full_desc_of(self, pack: bytes) -> dict[str, Any]:
        """The whole description, as graphwalk.serialize wrote it."""
        return full_desc(self.desc_of(pack), json.loads(self.kernels_json(pack)))

    def kernels_json(self, pack: bytes) -> bytes:
        """The kernel nodes' JSON, inflated; PackError when it does not inflate to exactly kernels_size bytes.

        Inflating stops at kernels_size (the size check_graphs held to what the graph's kernel table can describe,
        and parse_index the rank's total to MAX_KERNEL_JSON): a stream that holds more is refused, never inflated."""
        inflate = zlib.decompressobj()
        try:
            text = inflate.decompress(self.part(pack, "kernels"), self.kernels_size)
            whole = inflate.eof and not inflate.unconsumed_tail and len(text) == self.kernels_size
        except zlib.error as exc:
            raise PackError([f"graph {self.name!r}: its kernel nodes do not inflate: {exc}"]) from None
        if not whole:
            raise PackError([f"graph {self.name!r}: its kernel nodes do not inflate to {self.kernels_size} bytes"])
        if inflate.unused_data:
            raise PackError([f"graph {self.name!r}: its kernel part holds {len(inflate.unused_data)} bytes after its "
                             "compressed stream"])  # fmt: skip
        return text


def split_desc(desc: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(description with kernel nodes reduced to stubs, the kernel nodes in node order)."""
    kernels = [nd for nd in desc["nodes"] if nd["type"] == "kernel"]
    light = {**desc, "nodes": [_KERNEL_STUB if nd["type"] == "kernel" else nd for nd in desc["nodes"]]}
    return light, kernels


_OWN = ("blob_size", "blob_sha256", "table_size", "table_sha256")  # what graphs of one shape do not share
_OWN_KEYS = frozenset(_OWN)
_MAX_OTHER_NODES = 1 << 20  # non-kernel nodes a description may list beyond what the pack's tables could back
_MAX_INFLATE = 1100  # zlib's deflate cannot compress better than about 1032:1: a larger kernels_size is a lie
# Decompression bombs. A kernel part inflates only to the size its index declares, and that size is held, before
# anything inflates, to what the graph's kernel table can describe (kernels_bound) and, for the rank's graphs
# together, to MAX_KERNEL_JSON (an engine's is tens of MB: runtime-scale's 70000 kernel nodes pack into 40 MB in
# all). A forged 1 MiB part declaring 1.1 GB (within _MAX_INFLATE) made `check` take 5.5 s and 2.1 GB per graph.
MAX_KERNEL_JSON = 1 << 30
_NODE_JSON = 256  # one kernel node's JSON (graphwalk) but its name, image, layout and attributes, at most
_PARAM_JSON = 24  # one parameter's [offset, size] (32-bit numbers) and its comma
_ATTR_JSON = 16 + 2 * graphformat.ATTR_BYTES  # one attribute: its number, its value in hex, quotes, comma
_CHAR_JSON = 12  # one character of a name as json.dumps escapes it (outside the BMP: two \uXXXX)
_SHA256 = re.compile(r"[0-9a-f]{64}")
# What compact_desc stores of a description: any other key would pass into the light description unchecked (an
# `edges` key, say, is what edge_ends() would read instead of the checked `edge_ends`).
_STORED_KEYS = frozenset({"format", "events", "node_count", "other_nodes", "edge_ends", "edge_data", "func_ids"})


def compact_desc(light: Mapping[str, Any], func_ids: list[int]) -> dict[str, Any]:
    """What the index stores of a light description (without its _OWN fields): the node count and only the
    non-kernel nodes (with their indices), the edges' ends as one flat list and their data only when some edge has
    any, and the functions as indices into the index's function table."""
    nodes, edges = light["nodes"], light["edges"]
    out = {k: v for k, v in light.items() if k not in ("nodes", "edges", "funcs", *_OWN)}
    out["node_count"] = len(nodes)
    out["other_nodes"] = [[i, nd] for i, nd in enumerate(nodes) if nd["type"] != "kernel"]
    out["edge_ends"] = [v for e in edges for v in e[:2]]
    if any(e[2] or e[3] or e[4] for e in edges):
        out["edge_data"] = [list(e[2:5]) for e in edges]
    out["func_ids"] = func_ids
    return out


def expand_desc(where: str, stored: Any, funcs: list[Any], max_nodes: int) -> dict[str, Any]:
    """The light description (without its _OWN fields) from what compact_desc stored: kernel nodes as stubs, the
    functions resolved, the edges as stored (`edge_ends`, `edge_data` when present: the native rebuild takes them
    as they are, full_desc() turns them back into `edges`). PackError naming `where` when the parts do not fit;
    `max_nodes` bounds the node count (a count no pack could back must not allocate a list that long)."""
    try:
        unknown = sorted(str(k)[:40] for k in stored if k not in _STORED_KEYS)
        if unknown:
            raise ValueError(f"unknown keys {unknown[:8]}")
        out = {k: v for k, v in stored.items() if k not in ("node_count", "other_nodes", "func_ids")}
        n, ids = stored["node_count"], stored["func_ids"]
        if type(n) is not int or not 0 <= n <= max_nodes:
            raise ValueError(f"node count {n!r} (at most {max_nodes} here)")
        if type(ids) is not list or not all(type(i) is int and 0 <= i < len(funcs) for i in ids):
            raise ValueError(f"function indices {ids!r} outside the {len(funcs)} functions")
        ends, data = stored["edge_ends"], stored.get("edge_data")
        nodes = [_KERNEL_STUB] * n
        for i, nd in stored["other_nodes"]:
            if type(i) is not int or not 0 <= i < n or not isinstance(nd, dict) or nd.get("type") == "kernel":
                raise ValueError(f"node entry {str(i)[:40]}")
            problem = graphformat.plain_node_problem(i, nd)
            if problem:
                raise ValueError(problem)
            nodes[i] = nd
        if type(ends) is not list or len(ends) % 2 or not all(type(v) is int for v in ends):
            raise ValueError("edge ends are not pairs of node indices")
        if data is not None and (type(data) is not list or len(data) * 2 != len(ends)):
            raise ValueError(f"{len(ends) // 2} edges for {len(data) if type(data) is list else data!r} edge data")
        if data is not None and not all(
            type(d) is list and len(d) == 3 and all(type(v) is int for v in d) for d in data
        ):
            raise ValueError("edge data are not [from_port, to_port, type] triples")
        if ends and (min(ends) < 0 or max(ends) >= n):
            raise ValueError(f"an edge end outside the {n} nodes")
        out["nodes"], out["funcs"] = nodes, [funcs[i] for i in ids]
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise PackError(
            [f"{where}: malformed description in the pack ({type(exc).__name__}: {str(exc)[:200]})"]
        ) from None
    return out


def full_desc(light: Mapping[str, Any], kernels: list[dict[str, Any]]) -> dict[str, Any]:
    """Inverse of split_desc; refuses parts that do not fit together."""
    stubs = sum(1 for nd in light["nodes"] if nd["type"] == "kernel")
    if stubs != len(kernels):
        raise PackError([f"the description has {stubs} kernel nodes, its kernel part {len(kernels)}"])
    it = iter(kernels)
    out = {k: v for k, v in light.items() if k not in ("edge_ends", "edge_data")}
    if "edges" not in out:
        out["edges"] = graphformat.edge_lists(light["edge_ends"], light.get("edge_data"))
    out["nodes"] = [next(it) if nd["type"] == "kernel" else nd for nd in light["nodes"]]
    return out


@dataclass
class PackWriter:
    """Collects graph records in capture order; `index()` and `data()` are what SAVE writes."""

    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    entries: list[dict[str, Any]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    funcs: list[Any] = field(default_factory=list)
    func_ids: dict[bytes, int] = field(default_factory=dict)
    descs: list[dict[str, Any]] = field(default_factory=list)
    desc_ids: dict[bytes, int] = field(default_factory=dict)

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
        ids = [_intern(self.funcs, self.func_ids, func) for func in light["funcs"]]  # one table for all graphs
        text = _compact(kernels)
        entry = {"name": name, "desc": _intern(self.descs, self.desc_ids, compact_desc(light, ids))}
        entry["own"] = {k: light[k] for k in _OWN}
        entry["kernels"], entry["kernels_size"] = self._put(zlib.compress(text, 6)), len(text)
        entry["params"], entry["table"] = self._put(bytes(params)), self._put(bytes(table))
        entry["inputs"], entry["outputs"] = inputs, outputs
        self.entries.append(entry)

    def index(self) -> dict[str, Any]:
        return {"format": PACK_FORMAT, "pack": PACK_NAME, "pack_size": self.size, "funcs": self.funcs,
                "descs": self.descs, "graphs": self.entries}  # fmt: skip

    def data(self) -> bytes:
        return b"".join(self.parts)


def _intern(items: list[Any], ids: dict[bytes, int], item: Any) -> int:
    """The index of `item` in `items` (equal JSON, equal index), appending it when new."""
    key = _compact(item)
    if key not in ids:
        ids[key] = len(items)
        items.append(item)
    return ids[key]


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _span(value: Any) -> tuple[int, int] | None:
    if type(value) is list and len(value) == 2:
        off, n = value
        if type(off) is int and type(n) is int and off >= 0 and n >= 0:
            return off, n
    return None


def parse_index(index: Any, pack_size: int) -> list[PackedGraph]:
    """The graphs of a parsed index.json, in capture order; PackError lists every problem with it."""
    if not isinstance(index, dict):
        raise PackError([f"the graph index is a {type(index).__name__}, not an object"])
    if index.get("format") != PACK_FORMAT:
        raise PackError(
            [f"graph index format {_r(index.get('format'))} is not {PACK_FORMAT} (written by another release)"]
        )
    problems = []
    if index.get("pack") != PACK_NAME:
        problems.append(f"the index names pack {_r(index.get('pack'))}, expected {PACK_NAME!r}")
    if index.get("pack_size") != pack_size:
        problems.append(f"the index says the pack has {_r(index.get('pack_size'))} bytes, it has {pack_size}")
    shared = _index_descs(index, pack_size, problems)
    rows = index.get("graphs")
    if not isinstance(rows, list):
        raise PackError([*problems, "the index has no list of graphs"])
    out, spans = _index_graphs(rows, shared, pack_size, problems)
    problems += _declared_problems(out)
    spans.sort()
    for (a_off, a_len, a, a_part), (b_off, _b_len, b, b_part) in itertools.pairwise(spans):
        if b_off < a_off + a_len:
            problems.append(
                f"graph parts overlap in the pack: {rows[a]['name']!r} {a_part} and {rows[b]['name']!r} {b_part}"
            )
    named = sum(n for _off, n, _i, _part in spans)
    if not problems and named != pack_size:  # SAVE writes the parts back to back: no byte belongs to no graph
        problems.append(f"the graphs' parts cover {named} of the pack's {pack_size} bytes")
    if problems:
        raise PackError(problems)
    return out


def _index_descs(index: dict[str, Any], pack_size: int, problems: list[str]) -> list[dict[str, Any] | None]:
    """The index's descriptions, each expanded against its function table (None where one is wrong); the problems
    found are appended to `problems`."""
    funcs = index.get("funcs")
    if not isinstance(funcs, list) or not all(
        type(f) is list and len(f) == 3 and type(f[0]) is str and type(f[1]) is str and type(f[2]) is dict
        for f in funcs
    ):
        problems.append("the index has no function table (a list of [image sha256, kernel name, attributes])")
        funcs = []
    stored = index.get("descs")
    shared: list[dict[str, Any] | None] = []
    max_nodes = pack_size // graphformat.KNODE.size + _MAX_OTHER_NODES  # kernel nodes need their table rows
    if not isinstance(stored, list):
        problems.append("the index has no list of descriptions")
        return shared
    for j, desc in enumerate(stored):
        try:
            shared.append(expand_desc(f"description {j}", desc, funcs, max_nodes))
        except PackError as exc:
            problems += exc.problems
            shared.append(None)
    return shared


Span = tuple[int, int, int, str]  # (offset, length, graph entry, part): named only when two overlap


def _index_graphs(
    rows: list[Any], shared: list[dict[str, Any] | None], pack_size: int, problems: list[str]
) -> tuple[list[PackedGraph], list[Span]]:
    """The index's graph entries that are whole, and the span of every part that lies in the pack; the problems
    found are appended to `problems`."""
    out: list[PackedGraph] = []
    seen: set[str] = set()
    spans: list[Span] = []
    for i, row in enumerate(rows):
        name = row.get("name") if isinstance(row, dict) else None
        if not isinstance(name, str) or not name:
            problems.append(f"graph entry {i} has no name")
            continue
        if name in seen:
            problems.append(f"graph {name!r} is listed twice")
        seen.add(name)
        parts = _entry_parts(name, row, i, pack_size, spans, problems)
        problem = _entry_problem(name, row, parts, len(shared), pack_size)
        if problem:
            problems.append(problem)
        elif len(parts) == len(_PARTS) and shared[row["desc"]] is not None:
            out.append(PackedGraph(name, *parts, row["inputs"], row["outputs"], row["kernels_size"],
                                   shared[row["desc"]], row["own"]))  # fmt: skip
    return out, spans


def _entry_parts(
    name: str, row: dict[str, Any], i: int, pack_size: int, spans: list[Span], problems: list[str]
) -> list[tuple[int, int]]:
    """A graph entry's parts that lie in the pack, as (offset, length), each also added to `spans`; a part that is
    not a span or runs past the pack is a problem appended to `problems`."""
    parts = []
    for part in _PARTS:
        value = row.get(part)
        if type(value) is list and len(value) == 2:  # the common case, inline: 1900 graphs x 5 parts
            off, n = value
            if type(off) is int and type(n) is int and off >= 0 and n >= 0 and off + n <= pack_size:
                parts.append((off, n))
                spans.append((off, n, i, part))
                continue
        span = _span(value)
        if span is None:
            problems.append(f"graph {name!r}: {part} span {_r(value)} is not [offset, length]")
        else:
            problems.append(
                f"graph {name!r}: {part} bytes {span[0]}..{span[0] + span[1]} lie past the end of the pack "
                f"({pack_size} bytes): the pack is truncated or the index is damaged"
            )
    return parts


def _declared_problems(graphs: list[PackedGraph]) -> list[str]:
    """The rank's kernel nodes' JSON, all graphs together, held to MAX_KERNEL_JSON before anything inflates."""
    declared = sum(g.kernels_size for g in graphs)
    if declared <= MAX_KERNEL_JSON:
        return []
    most = max(graphs, key=lambda g: g.kernels_size)
    return [
        f"its graphs' kernel parts declare {declared} bytes of kernel nodes in all, more than the {MAX_KERNEL_JSON} "
        f"a rank's graph pack may inflate to (the most: graph {most.name!r}, its kernel part of {most.kernels[1]} "
        f"bytes declares {most.kernels_size})"
    ]


def _entry_problem(
    name: str, row: dict[str, Any], parts: list[tuple[int, int]], n_descs: int, pack_size: int
) -> str | None:
    """What is wrong with a graph entry's kernels_size, desc, own and static tensor records (None: nothing)."""
    kernels_size, d, own = row.get("kernels_size"), row.get("desc"), row.get("own")
    if type(kernels_size) is not int or kernels_size < 0:
        return f"graph {name!r}: kernels_size {_r(kernels_size)} is not a byte count"
    if type(d) is not int or not 0 <= d < n_descs:
        return f"graph {name!r}: desc {_r(d)} is not one of the {n_descs} descriptions"
    if type(own) is not dict or own.keys() != _OWN_KEYS:
        return f"graph {name!r}: own does not hold exactly {', '.join(_OWN)}"
    if not all(type(own[k]) is int and 0 <= own[k] <= pack_size for k in ("blob_size", "table_size")) or not all(
        isinstance(own[k], str) and _SHA256.fullmatch(own[k]) for k in ("blob_sha256", "table_sha256")
    ):
        return f"graph {name!r}: own must hold byte counts within the pack and sha256s"
    if len(parts) == len(_PARTS) and kernels_size > _MAX_INFLATE * max(parts[0][1], 1):
        return f"graph {name!r}: kernels_size {kernels_size} is more than its kernel part can inflate to"
    if not isinstance(row.get("inputs"), list) or "outputs" not in row:
        return f"graph {name!r}: no static tensor records (inputs, outputs)"
    return None


def kernels_bound(light: Mapping[str, Any], table: bytes | memoryview) -> int:
    """The most bytes a graph's kernel nodes can take as the JSON SAVE writes (graphwalk, _compact), from its kernel
    table (one row per kernel node: its function, parameter count and attribute count; checked by
    graphformat.table_problem) and its function table (names and image hashes, escaped at worst). A kernels_size
    beyond it is refused before anything inflates."""
    n_k = graphformat.TABLE_HEADER.unpack_from(table)[0]
    start, words = graphformat.TABLE_HEADER.size, graphformat.KNODE.size // 4
    rows = memoryview(table)[start : start + n_k * graphformat.KNODE.size].cast("I")
    per_func = [_CHAR_JSON * (len(sha) + len(name)) for sha, name, _attrs in light["funcs"]]
    names = sum(per_func[f] for f in rows[1::words].tolist())
    params, attrs = sum(rows[9::words].tolist()), sum(rows[13::words].tolist())
    return 2 + n_k * _NODE_JSON + names + _PARAM_JSON * params + _ATTR_JSON * attrs


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
    if index_rel not in archive.manifest.files:  # an older layout: a new SAVE writes the current one
        raise ArchiveError(
            archive.root,
            f"it has no {index_rel}: written by a graphpersist release that stored one file per graph",
            advice=ADVICE,
        )
    index = archive.read_json(rank, INDEX_NAME)
    pack = archive.read(rank, PACK_NAME)
    try:
        graphs = parse_index(index, len(pack))
    except PackError as exc:
        older = isinstance(index, dict) and type(index.get("format")) is int and index["format"] < PACK_FORMAT
        problems = [f"{index_rel}: {p}" for p in exc.problems]
        raise ArchiveError(archive.root, problems, advice=ADVICE if older else None) from None
    listed = [g.name for g in graphs]
    if listed != names:
        raise ArchiveError(
            archive.root, f"{index_rel} lists graphs {_short(listed)}, rank {rank}'s record lists {_short(names)}"
        )
    return GraphPack(pack, graphs)


def check_graphs(
    records: Sequence[GraphRecord],
    packed: GraphPack,
    *,
    full: bool,
    images: set[str] | None = None,
    hashes: bool = False,
) -> dict[str, tuple[dict[str, Any], memoryview, memoryview, PackedGraph]]:
    """Each graph's (description, parameter blob, kernel table, index entry), checked against its record before
    anything is mapped or loaded (LOAD's validation; needs no GPU): node counts, events, instantiate flags, every
    non-kernel node's fields, and the kernel table's counts and offsets against the description, the blob and the
    function table (the native rebuild indexes with them). `images`: the rank record's image hashes, which every
    function must name. `full` parses the kernel nodes too, checks each, recomputes the topology fingerprint and
    requires the kernel table to be exactly what those nodes pack into (`graphpersist check`, the reference rebuild in
    tools/gpdiag). `hashes` recomputes each graph's blob and table sha256 (LOAD relies on the pack's file
    hash instead: each byte hashed once). Raises PersistError or GraphFormatError naming the graph.
    """
    pack = packed.pack
    descs = {}
    funcs_checked: set[int] = set()  # descriptions (shared by graphs of one shape) whose function table is checked
    for g, entry in zip(records, packed.graphs, strict=True):
        blob, table = entry.part(pack, "params"), entry.part(pack, "table")
        try:
            light = entry.desc_of(pack)
            if images is not None and id(entry.shared) not in funcs_checked:
                problem = next(filter(None, (graphformat.func_problem(j, f, images)
                                             for j, f in enumerate(light["funcs"]))), None)  # fmt: skip
                if problem:
                    raise graphformat.GraphFormatError(f"graph {g.name!r}: {problem}")
                funcs_checked.add(id(entry.shared))
            problem = graphformat.table_problem(light, table, len(blob), len(light["funcs"]))
            if problem:
                raise graphformat.GraphFormatError(f"graph {g.name!r}: {problem}")
            bound = kernels_bound(light, table)
            if entry.kernels_size > bound:  # before anything inflates
                raise graphformat.GraphFormatError(
                    f"graph {g.name!r}: its kernel part of {entry.kernels[1]} bytes declares {entry.kernels_size} "
                    f"bytes of kernel nodes, more than its {graphformat.TABLE_HEADER.unpack_from(table)[0]} kernel "
                    f"nodes can take ({bound} bytes at most)"
                )
            desc = _full(entry, pack, light, len(blob)) if full else light
            graphformat.verify_blob(g.name, desc, blob, hashed=not hashes)
            if len(table) != desc["table_size"] or (
                hashes and hashlib.sha256(table).hexdigest() != desc["table_sha256"]
            ):
                raise graphformat.GraphFormatError(f"graph {g.name!r}: kernel table is truncated or altered")
            graphformat.check_events(g.name, desc)
            graphformat.check_shape(g.name, desc, table, g.node_count, g.nodes_by_type)
            graphformat.check_instantiate_flags(g.name, g.instantiate_flags)
            if full and graphformat.pack_kernel_table(desc) != table:
                raise graphformat.GraphFormatError(
                    f"graph {g.name!r}: its kernel table is not what its kernel nodes pack into"
                )
            if full and graphformat.topology_fingerprint(desc) != g.topology_fingerprint:
                raise PersistError(f"graph {g.name!r}: description does not match its recorded topology fingerprint")
        except (PackError, ValueError) as exc:
            raise PersistError(f"graph {g.name!r}: damaged description in the graph pack: {exc}") from None
        descs[g.name] = (desc, blob, table, entry)
    return descs


def _full(entry: PackedGraph, pack: bytes, light: dict[str, Any], blob_size: int) -> dict[str, Any]:
    """The full description, each kernel node checked (graphformat.kernel_node_problem) before anything reads it."""
    try:
        kernels = safejson.loads(entry.kernels_json(pack), strict=False)
    except safejson.JsonError as exc:
        raise PackError([f"graph {entry.name!r}: its kernel nodes are not JSON: {exc}"]) from None
    if type(kernels) is not list:
        raise PackError([f"graph {entry.name!r}: its kernel nodes are not a list"])
    for i, nd in enumerate(kernels):
        problem = graphformat.kernel_node_problem(i, nd, blob_size, len(light["funcs"]))
        if problem:
            raise PackError([f"graph {entry.name!r}: kernel {problem}"])
    return full_desc(light, kernels)


def read_pointers(archive: Archive, rank: int, fingerprint: str) -> list[int]:
    """The rank's pointer inventory, refused when it does not hash to the rank record's fingerprint."""
    pointers = archive.read_json(rank, "pointers.json")
    if hashlib.sha256(json.dumps(pointers).encode()).hexdigest() != fingerprint:
        raise PersistError("pointer inventory does not match its recorded fingerprint")
    return pointers


def _r(value: Any) -> str:
    """A value from an index as messages show it: its repr, escaped and clipped (an index may hold anything)."""
    return shown(repr(value), 80)


def _short(names: list[str]) -> str:
    return repr(names) if len(names) <= 6 else f"{names[:3]!r} ... ({len(names)} graphs)"
