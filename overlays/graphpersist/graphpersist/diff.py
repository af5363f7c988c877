"""`graphpersist diff A B`: where two archives' graphs differ, down to the kernel parameter word.

Two SAVEs of one configuration must write the same archive (the proof's check "archives a = b"). The manifests say
which fields differ, a rank's pointer inventory for instance, but not which graph or kernel makes the difference.
This compares, per rank, the pointer inventories (and where in the graphs each address only one archive has is
used) and each graph of the same name: its kernel sequence, then what the topology fingerprint covers (node kinds,
launch shapes, attributes, events, edges with their data), then each kernel node's parameter bytes, 8-byte word by
word, marking the words that are addresses in the rank's region, then every other field LOAD reads of the graph
(load_fields: its rank-record entry, its index entry with the static tensor records, its description with the
function table, every node's fields with memset and memcpy addresses, its kernel table), derived from the records
themselves so that a field added to one is compared without being listed here. SAVE counts a parameter word as a
pointer when it lies in the region (graphwalk), so a pointer can also be two 32-bit numbers that happen to look like
one. Last, the Inductor launch configs each SAVE chose (graphpersist.graph.kernelchoice, in the rank's notes) where
they differ. Before all that, the archives' layouts: ranks one archive has and the other lacks, and world facts that
differ (a TP=2 and a TP=4 archive are never "equal" because their common ranks are). Each rank's graphs are read as
`graphpersist check` reads them (loadplan, every kernel node checked), and every archive string in the output is
shown escaped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from graphpersist.archive import Archive, codec
from graphpersist.archive.manifest import GraphRecord
from graphpersist.archive.shown import shown
from graphpersist.archive.validate import flatten
from graphpersist.graph import format as graphformat
from graphpersist.graph import kernelchoice
from graphpersist.graph.pack import PackedGraph
from graphpersist.loadplan import read_graphs

WORD = 8


@dataclass(frozen=True)
class Use:
    """Where a parameter word sits: graph, node index, kernel name and byte offset in the node's parameters."""

    graph: str
    node: int
    kernel: str
    offset: int

    def __str__(self) -> str:
        return f"{self.graph} node {self.node} kernel {self.kernel!r} bytes {self.offset}..{self.offset + 7}"


@dataclass
class RankGraphs:
    """One rank's kernel nodes: per graph, (node index, kernel name, parameter bytes)."""

    region: tuple[int, int]
    pointers: set[int]
    graphs: dict[str, list[tuple[int, str, bytes]]] = field(default_factory=dict)
    shapes: dict[str, dict[str, Any]] = field(default_factory=dict)  # per graph, graphformat.topology
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)  # per graph, load_fields

    def in_region(self, value: int) -> bool:
        return self.region[0] <= value < self.region[1]

    def word_at(self, use: Use) -> int | None:
        """The parameter word at `use`'s place in this rank's graphs, None where it has no such node or bytes."""
        for index, kernel, params in self.graphs.get(use.graph, []):
            if index == use.node and kernel == use.kernel and use.offset + WORD <= len(params):
                return int(struct.unpack_from("<Q", params, use.offset)[0])
        return None

    def uses(self, addresses: set[int], limit: int) -> dict[int, list[Use]]:
        """Where each of `addresses` appears as a parameter word (at most `limit` uses per address)."""
        found: dict[int, list[Use]] = {a: [] for a in addresses}
        for name, nodes in self.graphs.items():
            for index, kernel, params in nodes:
                for offset, value in _words(params):
                    if value in found and len(found[value]) < limit:
                        found[value].append(Use(name, index, kernel, offset))
        return found


def _words(params: bytes) -> Iterator[tuple[int, int]]:
    n = len(params) // WORD
    yield from ((WORD * i, v) for i, v in enumerate(struct.unpack_from(f"<{n}Q", params) if n else ()))


# What LOAD reads of a graph and load_fields therefore does not compare as a field, each with why. Every other field
# of GraphRecord and PackedGraph, key of a description and key of a node is compared: a field added to them is too.
RECORD_NOT_COMPARED = {"name": "graphs are paired by their names"}
INDEX_NOT_COMPARED = {
    "name": "graphs are paired by their names",
    "kernels": "where the kernel nodes lie in the pack: the nodes are compared",
    "params": "where the parameter blob lies in the pack: its bytes are compared",
    "table": "where the kernel table lies in the pack: its bytes are compared",
    "kernels_size": "the size of the kernel nodes' JSON: the nodes are compared",
    "shared": "the description: compared key by key",
}
DESCRIPTION_NOT_COMPARED = {"nodes": "compared node by node"}
NODE_NOT_COMPARED = {"params": "a kernel node's place in the parameter blob: its parameter bytes are compared"}
_ADDRESS_KEYS = (frozenset(graphformat.VALUE_KEYS) - {"params"}) | {"addr"}  # memset, memcpy, tensor addresses


def load_fields(record: GraphRecord, desc: dict[str, Any], table: bytes, entry: PackedGraph) -> dict[str, Any]:
    """Every field LOAD reads of one graph that the kernel sequence, topology and parameter words do not already
    cover, by a name that says where it is: `record.<field>` (the rank record's entry), `index.<field>` (the graph
    index's: static tensor records, sizes and hashes), `description.<key>` (function table, events, ...), `node <i>`
    (each node's fields), `kernel table` (what the native rebuild reads)."""
    out = {f"record.{f.name}": getattr(record, f.name) for f in dataclasses.fields(record)
           if f.name not in RECORD_NOT_COMPARED}  # fmt: skip
    out |= {f"index.{f.name}": getattr(entry, f.name) for f in dataclasses.fields(entry)
            if f.name not in INDEX_NOT_COMPARED}  # fmt: skip
    out |= {f"description.{k}": v for k, v in desc.items() if k not in DESCRIPTION_NOT_COMPARED}
    for i, nd in enumerate(desc["nodes"]):
        out[f"node {i}"] = {k: v for k, v in nd.items() if k not in NODE_NOT_COMPARED}
    out["kernel table"] = table
    return out


def read_rank(archive: Archive, rank: int) -> RankGraphs:
    """One rank's graphs, read and checked as `graphpersist check` reads them (ArchiveError when damaged)."""
    graphs, pointers = read_graphs(archive, rank, full=True)
    rec = archive.rank_facts(rank)
    records = {g.name: g for g in rec.graphs}
    out = RankGraphs((rec.region.base, rec.region.base + rec.region.size), set(pointers))
    for name, (desc, blob_view, table, entry) in graphs.items():
        blob = bytes(blob_view)
        shown_name = shown(name, 120)
        out.shapes[shown_name] = graphformat.topology(desc)
        out.fields[shown_name] = load_fields(records[name], desc, bytes(table), entry)
        out.graphs[shown_name] = [
            (i, node["name"], blob[node["params"][0] : node["params"][0] + node["params"][1]])
            for i, node in enumerate(desc["nodes"])
            if node["type"] == "kernel"
        ]
    return out


def _value(rank: RankGraphs, value: int) -> str:
    return f"{value:#x}{' (region)' if rank.in_region(value) else ''}"


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 3] + "..."


def shape_difference(name: str, a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first way two graphs' topologies (graphformat.topology) differ: node kinds, a node's launch shape or
    attributes, events, edges; None when they are equal."""
    kinds_a, kinds_b = [n["type"] for n in a["nodes"]], [n["type"] for n in b["nodes"]]
    if kinds_a != kinds_b:
        first = next((i for i, (x, y) in enumerate(zip(kinds_a, kinds_b, strict=False)) if x != y),
                     min(len(kinds_a), len(kinds_b)))  # fmt: skip
        return f"{name}: node kinds differ ({len(kinds_a)} vs {len(kinds_b)} nodes, first at node {first})"
    for index, (x, y) in enumerate(zip(a["nodes"], b["nodes"], strict=True)):
        if x == y:
            continue
        keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
        shown = "; ".join(f"{k} {_short(x.get(k))} vs {_short(y.get(k))}" for k in keys[:3])
        more = f" (+{len(keys) - 3} more fields)" if len(keys) > 3 else ""
        what = f"kernel {x['name']!r}" if x["type"] == "kernel" and "name" in x else x["type"]
        return f"{name}: node {index} {what}: {shown}{more}"
    if a.get("events") != b.get("events"):
        return f"{name}: events differ: {_short(a.get('events'))} vs {_short(b.get('events'))}"
    ea, eb = a["edges"], b["edges"]
    if ea != eb:
        only_a, only_b = [_short(e) for e in ea if e not in eb], [_short(e) for e in eb if e not in ea]
        return (f"{name}: edges differ ({len(ea)} vs {len(eb)}): only in A {only_a[:3]}, only in B {only_b[:3]}"
                if only_a or only_b else f"{name}: edges differ in order only")  # fmt: skip
    return None


def graph_difference(name: str, a: RankGraphs, b: RankGraphs) -> str | None:
    """The first way graph `name` differs between the two ranks (kernel sequence, then topology, then parameter
    words), or None when it is equal."""
    na, nb = a.graphs[name], b.graphs[name]
    if [k for _, k, _ in na] != [k for _, k, _ in nb]:
        first = next((i for i, (x, y) in enumerate(zip(na, nb, strict=False)) if x[1] != y[1]), min(len(na), len(nb)))
        return f"{name}: kernel sequences differ ({len(na)} vs {len(nb)} kernel nodes, first at kernel node {first})"
    if shape := shape_difference(name, a.shapes[name], b.shapes[name]):
        return shape
    for (index, kernel, pa), (_, _, pb) in zip(na, nb, strict=True):
        if pa == pb:
            continue
        if len(pa) != len(pb):
            return f"{name}: node {index} kernel {kernel!r}: {len(pa)} vs {len(pb)} parameter bytes"
        words = [(o, x, y) for (o, x), (_, y) in zip(_words(pa), _words(pb), strict=True) if x != y]
        shown = "; ".join(f"bytes {o}..{o + 7}: {_value(a, x)} vs {_value(b, y)}" for o, x, y in words[:3])
        tail = len(pa) % WORD
        if not words and tail:
            shown = f"the last {tail} bytes"
        more = f" (+{len(words) - 3} more words)" if len(words) > 3 else ""
        return f"{name}: node {index} kernel {kernel!r}: {shown}{more}"
    return field_difference(name, a, b)


def field_difference(name: str, a: RankGraphs, b: RankGraphs) -> str | None:
    """The first of graph `name`'s load_fields that differs, down to the first three values that differ in it
    (`node 12 (memcpy): srcDevice 0x... vs 0x...`, `index.outputs.items[1].value: null vs 1`), or None."""
    fa, fb = a.fields[name], b.fields[name]
    for key in [*fa, *(k for k in fb if k not in fa)]:
        x, y = fa.get(key, _ABSENT), fb.get(key, _ABSENT)
        if x == y:
            continue
        found: list[tuple[str, Any, Any]] = []
        _differences(x, y, "", found)
        if key.startswith("node ") and isinstance(x, dict):  # a node: its fields by name
            what = "; ".join(
                f"{shown(p.lstrip('.'), 80)} {_field(a, p, u)} vs {_field(b, p, v)}" for p, u, v in found[:3]
            )
            head = f"{key} ({x.get('type', '?')}): "
        else:
            what = "; ".join(f"{key}{shown(p, 80)}: {_field(a, p, u)} vs {_field(b, p, v)}" for p, u, v in found[:3])
            head = ""
        more = " (and more)" if len(found) > 3 else ""
        return f"{name}: {head}{what}{more}"
    return None


def _differences(x: Any, y: Any, path: str, found: list[tuple[str, Any, Any]]) -> None:
    """Where two values differ, as (path, x's value, y's value), descending into dicts and lists of equal length;
    stops after four."""
    if len(found) > 3 or x == y:
        return
    if isinstance(x, dict) and isinstance(y, dict):
        for k in [*x, *(k for k in y if k not in x)]:
            _differences(x.get(k, _ABSENT), y.get(k, _ABSENT), f"{path}.{k}", found)
    elif isinstance(x, list | tuple) and isinstance(y, list | tuple) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _differences(u, v, f"{path}[{i}]", found)
    else:
        found.append((path, x, y))


def _field(rank: RankGraphs, path: str, value: Any) -> str:
    """A value as a line shows it: an address in hex (marked when in the region), bytes by size and hash."""
    if value is _ABSENT:
        return "<absent>"
    if path.rpartition(".")[2] in _ADDRESS_KEYS and type(value) is int:
        return _value(rank, value)
    if isinstance(value, bytes):
        return f"{len(value)} bytes (sha256 {hashlib.sha256(value).hexdigest()[:16]})"
    return shown(_short(value, 80))


def diff_rank(rank: int, a: RankGraphs, b: RankGraphs, limit: int) -> list[str]:
    """Lines saying how rank `rank`'s graphs differ (none when they are equal)."""
    lines = []
    only_a, only_b = sorted(a.pointers - b.pointers), sorted(b.pointers - a.pointers)
    if only_a or only_b:
        lines.append(f"rank {rank}: pointers {len(a.pointers)} vs {len(b.pointers)}: only in A {len(only_a)}, "
                     f"only in B {len(only_b)}")  # fmt: skip
        for side, rank_graphs, other, only in (("A", a, b, only_a), ("B", b, a, only_b)):
            uses = rank_graphs.uses(set(only[:limit]), 2)
            for address in only[:limit]:
                where = "; ".join(map(str, uses[address])) or "no kernel parameter (a memset or memcpy address)"
                there = other.word_at(uses[address][0]) if uses[address] else None
                seen = f" ({'B' if side == 'A' else 'A'} has {_value(other, there)} there)" if there is not None else ""
                lines.append(f"  only in {side}: {address:#x} used by {where}{seen}")
    names_a, names_b = list(a.graphs), list(b.graphs)
    if names_a != names_b:
        lines.append(f"rank {rank}: graph names differ: only in A {sorted(set(names_a) - set(names_b))[:limit]}, "
                     f"only in B {sorted(set(names_b) - set(names_a))[:limit]}")  # fmt: skip
    shaped = [n for n in names_a if n in b.shapes and a.shapes[n] != b.shapes[n]]
    first = shaped + [n for n in names_a if n in b.graphs and n not in shaped]  # topology before parameters
    found = [d for d in (graph_difference(n, a, b) for n in first) if d]
    if found:
        lines.append(f"rank {rank}: {len(found)} of {len(names_a)} graphs differ")
        if shaped:
            lines.append(f"rank {rank}: {len(shaped)} of them in their topology (what the topology fingerprint "
                         f"covers), e.g. {', '.join(shaped[:limit])}")  # fmt: skip
        lines += [f"  {line}" for line in found[:limit]]
        if len(found) > limit:
            lines.append(f"  ... {len(found) - limit} more")
        by_word = words_by_kernel(a, b)
        if by_word:
            lines.append(f"rank {rank}: the differing parameter words, by kernel and offset ({len(by_word)}):")
        for (kernel, offset), (count, example, x, y) in list(by_word.items())[:limit]:
            lines.append(f"  {kernel!r} bytes {offset}..{offset + 7}: in {count} graph(s), e.g. {example}: "
                         f"{_value(a, x)} vs {_value(b, y)}")  # fmt: skip
    return lines


def words_by_kernel(a: RankGraphs, b: RankGraphs) -> dict[tuple[str, int], tuple[int, str, int, int]]:
    """Every (kernel, parameter offset) whose word differs in graphs of the same name and kernel sequence, with
    the number of graphs it differs in and one example (graph, A's word, B's word); most graphs first. Shows in
    one list what differs everywhere (custom all-reduce's unused peer slots) and what only in a few graphs."""
    found: dict[tuple[str, int], tuple[int, str, int, int]] = {}
    for name, na in a.graphs.items():
        nb = b.graphs.get(name)
        if nb is None or [k for _, k, _ in na] != [k for _, k, _ in nb]:
            continue
        seen: set[tuple[str, int]] = set()
        for (_, kernel, pa), (_, _, pb) in zip(na, nb, strict=True):
            if pa == pb or len(pa) != len(pb):
                continue
            for (offset, x), (_, y) in zip(_words(pa), _words(pb), strict=True):
                key = (kernel, offset)
                if x == y or key in seen:
                    continue
                seen.add(key)
                count, example, ex, ey = found.get(key, (0, name, x, y))
                found[key] = (count + 1, example, ex, ey)
    return dict(sorted(found.items(), key=lambda item: -item[1][0]))


def _choices(archive: Archive, rank: int) -> dict[str, Any]:
    choices = archive.rank_facts(rank).engine_notes().get(kernelchoice.NOTES_KEY)
    return choices if isinstance(choices, dict) else {}


def choice_difference(rank: int, a: Archive, b: Archive, limit: int) -> list[str]:
    """Inductor's launch configs the two SAVEs chose (graphpersist.graph.kernelchoice, the rank's notes) where both
    chose and chose differently: why one kernel's image can differ between two SAVEs of one configuration. A kernel only
    one SAVE chose for is no difference: a start that loads the compiled artifact chooses nothing and launches what
    the compiling one recorded."""
    ca, cb = _choices(a, rank), _choices(b, rank)
    both = sorted(set(ca) & set(cb))

    def described(choice: Any) -> str:
        return _text(f"{choice.get('chosen')} ({choice.get('how')})" if isinstance(choice, dict) else repr(choice))

    def chosen(choice: Any) -> Any:
        return choice.get("chosen") if isinstance(choice, dict) else choice

    differ = [k for k in both if chosen(ca[k]) != chosen(cb[k])]
    if not differ:
        return []
    lines = [
        f"rank {rank}: Inductor's kernel choices differ in {len(differ)} of the {len(both)} kernel(s) both chose for:"
    ]
    for key in differ[:limit]:
        name = ca[key].get("kernel", "?") if isinstance(ca[key], dict) else "?"
        lines.append(f"  {_text(name)} ({_text(key)}): A {described(ca[key])}, B {described(cb[key])}")
    if len(differ) > limit:
        lines.append(f"  ... {len(differ) - limit} more")
    return lines


def layout_difference(a: Archive, b: Archive, limit: int) -> list[str]:
    """How the two archives' layouts differ: the ranks each has, and their world facts (manifest.json's `world`)."""
    lines = []
    ra, rb = list(a.ranks), list(b.ranks)
    if ra != rb:
        only_a, only_b = [r for r in ra if r not in rb], [r for r in rb if r not in ra]
        lines.append(f"ranks differ: A has {len(ra)} ({_few(ra, limit)}), B has {len(rb)} ({_few(rb, limit)}); "
                     f"only in A {_few(only_a, limit)}, only in B {_few(only_b, limit)}")  # fmt: skip
    wa, wb = flatten(codec.to_dict(a.manifest.world)), flatten(codec.to_dict(b.manifest.world))
    differ = [k for k in sorted(wa.keys() | wb.keys()) if wa.get(k, _ABSENT) != wb.get(k, _ABSENT)]
    if differ:
        lines.append(f"world facts differ in {len(differ)} field(s):")
        lines += [
            f"  {shown(k, 80)}: A {_fact(wa.get(k, _ABSENT))}, B {_fact(wb.get(k, _ABSENT))}" for k in differ[:limit]
        ]
        if len(differ) > limit:
            lines.append(f"  ... {len(differ) - limit} more")
    return lines


_ABSENT = object()


def _fact(value: Any) -> str:
    return "<absent>" if value is _ABSENT else shown(_short(value))


def _few(ranks: list[int], limit: int) -> str:
    return "[" + ", ".join(map(str, ranks[:limit])) + (", ..." if len(ranks) > limit else "") + "]"


def diff_archives(a: Archive, b: Archive, ranks: list[int], limit: int) -> list[str]:
    lines = layout_difference(a, b, limit)
    for rank in ranks:
        lines += diff_rank(rank, read_rank(a, rank), read_rank(b, rank), limit)
        lines += choice_difference(rank, a, b, limit)
    return lines


def _text(value: Any) -> str:
    return shown(str(value), 200)


def describe(a: Any, b: Any, ranks: list[int], lines: list[str]) -> str:
    head = f"graphpersist diff: {shown(str(a))} (A) vs {shown(str(b))} (B), rank(s) {', '.join(map(str, ranks))}"
    equal = (
        "the ranks, world facts, graphs (every field LOAD reads: nodes, edges, kernel parameters, functions, static "
        "tensors) and pointer inventories are equal"
    )
    return "\n".join([head, *(lines or [equal])])
