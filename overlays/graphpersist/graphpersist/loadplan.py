"""What LOAD reads from an archive for one rank, read and checked on CPU before the first GPU call.

LOAD replays kernel parameters and raw device addresses out of these files, and native code indexes arrays with
the numbers they hold. So every value LOAD (and `graphpersist check`, `inspect`, `diff`) reads is checked for its
type and range once, and any problem is an ArchiveError naming the file and the field. rank.json's `extra` (phases,
declared state, torch's blocks graphs read, the engine's notes) is checked by its parser, RankExtra, when the archive
is opened; here what spans files: the phases against the allocation log (`alloc_log.json`; `extra.setup_events`/
`setup_cursor` required before phases), each "bytes" state against its payload, the graph pack and its index
(graphpack), the setup tensors (`setup_tensors.json`), the pointer inventory (`pointers.json`), each graph's static
input and output tensors, and the records in the engine's notes that LOAD resolves: an archive is data, never code,
so every output dataclass and every call an engine makes again must name its type or function by a registry id
(graph.structure); whether the live engine's registry holds that id is LOAD's question, which check cannot answer
without the engine. Needs neither torch nor CUDA.

`read_plan(archive, rank)` is LOAD's fast path: shapes, ranges and sizes, the bytes hashed once by open_archive.
`read_plan(..., every_byte=True)` is `graphpersist check`: it also parses every kernel node, recomputes each graph's
topology fingerprint, requires each kernel table to be what its nodes pack into, recomputes every graph's blob and
table sha256, and reads and hashes every kernel image and declared-state payload the rank's LOAD would use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphpersist.archive import Archive, ArchiveError, archive_path, notedsections
from graphpersist.archive.fields import I64, U64, Refusal, kind, list_at, uint_at
from graphpersist.archive.manifest import RANK_RECORD_NAME, RankRecord, rank_dir
from graphpersist.archive.shown import shown
from graphpersist.errors import PersistError
from graphpersist.graph import format as graphformat
from graphpersist.graph import pack as graphpack
from graphpersist.graph import structure
from graphpersist.memory import phases, state
from graphpersist.memory.region import Event
from graphpersist.memory.savedlayout import read_layout

# torch's dtypes as tensor specs name them (str(dtype) without "torch.", torch 2.9-2.11), with their size in bytes:
# LOAD looks a name up in its table of torch's dtypes (memory.tensors.dtypes()), never on the torch module; any other
# name (`complex`, `float_power`: functions) is refused.
TORCH_DTYPES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bits16": 2,
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},
}  # fmt: skip
_MAX_DIMS = 64


@dataclass
class LoadPlan:
    """Everything one rank's LOAD takes from the archive, checked: the record, each graph's (description, blob,
    kernel table, index entry), the pointer inventory, setup tensors, torch blocks, phases and allocation log,
    declared state and the engine's notes."""

    rank: int
    record: RankRecord
    graphs: dict[str, tuple[dict[str, Any], memoryview, memoryview, graphpack.PackedGraph]]
    pointers: list[int]
    setup_tensors: list[list[Any]]
    torch_blocks: list[tuple[int, int]]
    phases: list[phases.Phase]
    events: list[Event]
    states: list[state.StateRecord]
    notes: dict[str, Any] = field(default_factory=dict)


# An archive that names code other than by a registry id was not written by a SAVE (graph.structure).
NAMES_ADVICE = (
    "An archive names code only by an id of the live engine's registry, never by a module path: this one was edited "
    "or written by something else than a SAVE of this release. Take archives only from a trusted SAVE, or re-run "
    "with mode=save."
)


def read_plan(archive: Archive, rank: int, *, full: bool = False, every_byte: bool = False) -> LoadPlan:
    """Rank `rank`'s LOAD inputs, checked (see the module's docstring); ArchiveError naming file and field.

    `full`: parse and check every kernel node and the topology fingerprint (what the reference rebuild in
    tools/gpdiag reads). `every_byte` implies `full` and hashes every part and payload LOAD would use."""
    full = full or every_byte
    record = archive.rank_facts(rank)
    rec_rel = f"{rank_dir(rank)}/{RANK_RECORD_NAME}"
    try:
        events, saved_phases = read_layout(archive, rank)
        states = _states(archive, rank, record, rec_rel, every_byte)
        blocks = list(record.extra.torch_blocks or ())
        setup_rel = f"{rank_dir(rank)}/setup_tensors.json"
        setup_tensors = _setup_tensors(archive.read_json(rank, "setup_tensors.json"), setup_rel)
        graphs, pointers = _graphs_and_pointers(archive, rank, record, full, every_byte)
        unbacked = phases.unbacked(pointers, events)
        if unbacked is not None:
            rel = f"{rank_dir(rank)}/pointers.json"
            raise Refusal(rel, "", f"graph address {unbacked:#x} lies in no memory the allocation log leaves live")
        if every_byte:
            for im in record.images:
                archive.read_path(im.file)  # verified against its table entry, which equals the image's sha256
        notes = record.engine_notes()
        _engine_notes(notes, rec_rel, (record.region.base, record.region.base + record.region.size))
    except Refusal as exc:
        raise ArchiveError(archive.root, str(exc), advice=exc.advice) from None
    return LoadPlan(rank, record, graphs, pointers, setup_tensors, blocks, saved_phases, events, states, notes)


def read_graphs(
    archive: Archive, rank: int, *, full: bool = False, every_byte: bool = False
) -> tuple[dict[str, tuple[dict[str, Any], memoryview, memoryview, graphpack.PackedGraph]], list[int]]:
    """Only the rank's graphs (as LoadPlan.graphs) and pointer inventory, checked as read_plan checks them: what
    `graphpersist diff` compares. ArchiveError naming file and field."""
    try:
        return _graphs_and_pointers(archive, rank, archive.rank_facts(rank), full or every_byte, every_byte)
    except Refusal as exc:
        raise ArchiveError(archive.root, str(exc), advice=exc.advice) from None


def _graphs_and_pointers(
    archive: Archive, rank: int, record: RankRecord, full: bool, every_byte: bool
) -> tuple[dict[str, tuple[dict[str, Any], memoryview, memoryview, graphpack.PackedGraph]], list[int]]:
    region = (record.region.base, record.region.base + record.region.size)
    graphs = _graphs(archive, rank, record, region, full, every_byte)
    pointers = _pointers(archive, rank, record)
    _node_addresses(graphs, f"{rank_dir(rank)}/{graphpack.INDEX_NAME}", region, set(pointers))
    return graphs, pointers


# ------------------------------------------------------------------------------------------------ the parts


def _states(archive: Archive, rank: int, record: RankRecord, rel: str, every_byte: bool) -> list[state.StateRecord]:
    """The record's declared state (RankExtra checked each), each "bytes" state's payload a file of the rank."""
    out = list(record.extra.state or ())
    for i, r in enumerate(out):
        if r.how == "bytes":
            _state_payload(archive, rank, r, rel, f"extra.state[{i}]", every_byte)
    return out


def _state_payload(archive: Archive, rank: int, r: state.StateRecord, rel: str, where: str, every_byte: bool) -> None:
    """A "bytes" state's payload must be a file of the rank, of its size (and, reading every byte, its sha256)."""
    assert r.file is not None
    try:
        path = f"{rank_dir(rank)}/{r.file}"
        entry = archive.manifest.files.get(path) if archive_path(rank, r.file) == path else None
    except ValueError:
        entry = None
    if entry is None:
        raise Refusal(rel, f"{where}.file", f"{shown(r.file, 80)} is not a file of rank {rank}")
    if entry.size != r.nbytes:
        raise Refusal(rel, where, f"payload {shown(r.file, 80)} has {entry.size} bytes, the state {r.nbytes}")
    if every_byte and hashlib.sha256(archive.read(rank, r.file)).hexdigest() != r.sha256:
        raise Refusal(rel, where, f"payload {shown(r.file, 80)} does not hash to the state's sha256")


def _ints(value: Any, rel: str, where: str, limit: int = I64) -> list[int]:
    if type(value) is not list or len(value) > _MAX_DIMS or not all(type(v) is int and 0 <= v <= limit for v in value):
        raise Refusal(rel, where, f"must be a list of at most {_MAX_DIMS} non-negative integers, got {kind(value)}")
    return value


def _spec_problem(spec: Any, rel: str, where: str, region: tuple[int, int]) -> None:
    """A static tensor's spec (tensors.tensor_spec): LOAD makes a tensor of it at its address in the region."""
    if type(spec) is not dict or set(spec) != {"addr", "dtype", "shape", "stride"}:
        raise Refusal(rel, where, "must be a tensor spec {addr, dtype, shape, stride}")
    addr = uint_at(spec["addr"], rel, f"{where}.addr")
    if not region[0] <= addr < region[1]:
        raise Refusal(rel, f"{where}.addr", f"{addr:#x} lies outside the rank's region")
    if not isinstance(spec["dtype"], str) or spec["dtype"] not in TORCH_DTYPES:
        raise Refusal(rel, f"{where}.dtype", f"{kind(spec['dtype'])} is not a torch dtype name")
    shape = _ints(spec["shape"], rel, f"{where}.shape")
    stride = _ints(spec["stride"], rel, f"{where}.stride")
    if len(stride) != len(shape):
        raise Refusal(rel, where, "shape and stride differ in length")
    # the bytes the tensor spans (tensor_at's extent): inside the region, so torch is never asked for more
    items = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
    if items * TORCH_DTYPES[spec["dtype"]] > region[1] - addr:
        raise Refusal(rel, where, f"its {items} {spec['dtype']} elements from {addr:#x} run past the region")


def _setup_tensors(rows: Any, rel: str) -> list[list[Any]]:
    for i, row in enumerate(list_at(rows, rel, "")):
        if type(row) is not list or len(row) != 5 or not isinstance(row[0], str):
            raise Refusal(rel, f"tensor {i}", f"must be [name, address, dtype, shape, stride], got {kind(row)}")
        spec = dict(zip(("addr", "dtype", "shape", "stride"), row[1:], strict=True))
        _spec_problem(spec, rel, f"tensor {i}", (0, U64 + 1))  # LOAD compares them with the live tensors
    return rows


def _pointers(archive: Archive, rank: int, record: RankRecord) -> list[int]:
    rel = f"{rank_dir(rank)}/pointers.json"
    try:
        pointers = graphpack.read_pointers(archive, rank, record.pointers.fingerprint)
    except PersistError as exc:
        raise Refusal(rel, "", str(exc)) from None
    values = list_at(pointers, rel, "")
    if not all(type(v) is int and 0 <= v <= U64 for v in values):
        raise Refusal(rel, "", "must list addresses (integers from 0 to 2**64-1)")
    if len(values) != record.pointers.count:
        raise Refusal(rel, "", f"{len(values)} addresses, the rank record says {record.pointers.count}")
    return values


def _graphs(
    archive: Archive, rank: int, record: RankRecord, region: tuple[int, int], full: bool, every_byte: bool
) -> dict[str, tuple[dict[str, Any], memoryview, memoryview, graphpack.PackedGraph]]:
    index_rel = f"{rank_dir(rank)}/{graphpack.INDEX_NAME}"
    packed = graphpack.read_graphs(archive, rank, [g.name for g in record.graphs])  # ArchiveError naming the index
    images = {im.sha256 for im in record.images}
    try:
        descs = graphpack.check_graphs(record.graphs, packed, full=full, images=images, hashes=every_byte)
    except (PersistError, graphformat.GraphFormatError) as exc:
        raise Refusal(index_rel, "", str(exc)) from None
    for name, (_desc, _blob, _table, entry) in descs.items():
        where = f"graph {shown(repr(name), 80)}"
        spec = _spec_checker(index_rel, where, region)
        for i, item in enumerate(list_at(entry.inputs, index_rel, f"{where} inputs")):
            spec(item, f"inputs[{i}]")
        try:
            structure.check(entry.outputs, spec, "outputs")
        except structure.StructureError as exc:
            advice = NAMES_ADVICE if isinstance(exc, structure.NotAnId) else None
            raise Refusal(index_rel, where, str(exc), advice) from None
    return descs


_ADDRESSES = {"memset": ("dst",), "memcpy": ("srcDevice", "dstDevice")}


def _node_addresses(
    descs: dict[str, tuple[dict[str, Any], memoryview, memoryview, graphpack.PackedGraph]],
    rel: str,
    region: tuple[int, int],
    pointers: set[int],
) -> None:
    """Each memset and memcpy address lies in the rank's region and in its pointer inventory, as SAVE requires
    (graphwalk refuses others and records every one in the inventory, which LOAD proves backed by memory). Once per
    graph shape: the graphs of one shape share their non-kernel nodes."""
    shapes: set[int] = set()
    for name, (_desc, _blob, _table, entry) in descs.items():
        if id(entry.shared) in shapes:
            continue
        shapes.add(id(entry.shared))
        for i, nd in enumerate(entry.shared["nodes"]):
            for key in _ADDRESSES.get(nd["type"], ()):
                addr, at = nd[key], f"graph {shown(repr(name), 80)} node {i} ({nd['type']}) {key}"
                if not region[0] <= addr < region[1]:
                    raise Refusal(rel, at, f"{addr:#x} lies outside the rank's region")
                if addr not in pointers:
                    raise Refusal(rel, at, f"{addr:#x} is not in the pointer inventory (pointers.json)")


def _engine_notes(notes: dict[str, Any], rel: str, region: tuple[int, int]) -> None:
    """The engine's notes name code only by registry id (structure.check_notes: a call record's function, a
    dataclass's type); each leaf of their records is a tensor spec in the rank's region or the engine's own leaf, an
    object of strings (SGLang's `{"module": <name in the model>}`). Whether the live engine's registry holds an id is
    LOAD's question: the engine's glue asks it (structure.decode_call), check cannot. The sections whose form the
    runtime knows (graphpersist.archive.notedsections: vLLM's compiled models) are read as LOAD reads them.
    """

    def leaf(spec: Any, where: str) -> None:
        if type(spec) is dict and set(spec) == {"addr", "dtype", "shape", "stride"}:
            _spec_problem(spec, rel, f"extra.{where}", region)
        elif type(spec) is not dict or not spec or not all(isinstance(v, str) for v in spec.values()):
            raise Refusal(rel, f"extra.{where}", "a leaf must be a tensor spec or an object of strings")

    try:
        structure.check_notes(notes, leaf, "engine_notes")
    except structure.StructureError as exc:
        raise Refusal(rel, "", f"extra.{exc}", NAMES_ADVICE) from None
    try:  # the sections whose form the runtime knows, read as LOAD's glue reads them
        notedsections.check(notes)
    except PersistError as exc:
        line = str(exc).splitlines()[0].removeprefix("graphpersist: cannot LOAD: ")
        raise Refusal(rel, "", f"extra.engine_{line}") from None


def _spec_checker(rel: str, where: str, region: tuple[int, int]) -> Callable[[Any, str], None]:
    def check(spec: Any, at: str) -> None:
        _spec_problem(spec, rel, f"{where} {at}", region)

    return check
