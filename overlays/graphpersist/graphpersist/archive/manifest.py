"""The archive's manifest: every fact LOAD must match, as typed records that round-trip through JSON.

An archive is one directory::

    manifest.json          format, creation info, the world facts all ranks share, the ranks, the file table
    rank_<r>/rank.json     that rank's own facts: its GPU, region, pointer inventory, graphs, kernel images
    rank_<r>/...           that rank's payload files (graphs, images, allocation log ...)
    <name>                 payload shared by all ranks (optional)

The records are strict on purpose: a field that is missing, mistyped or unknown to this format version makes
the manifest unreadable, because LOAD must never guess what a SAVE meant. A change to the meaning of any field
bumps FORMAT_VERSION; a reader refuses versions it does not know instead of half-understanding them.

Reading is total: any bytes give a record or a ManifestError naming the problem. The JSON itself is read by
safejson (strict: UTF-8, no duplicate keys, no NaN/Infinity, integers within 64 bits, bounded nesting); then
every field is type-checked, and every integer field (all are counts, sizes, indices, ranks or addresses) must
lie in 0 .. 2**64-1. Free-form fields (`flags` values, `extra.engine_notes`) take any JSON that passes safejson;
the rest of a rank's `extra` is the typed RankExtra, checked key by key.
Manifest.consistency_problems() adds the checks that span fields (ranks against parallel.world_size).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import platform
import re
import socket
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from graphpersist.archive import safejson
from graphpersist.archive.shown import shown
from graphpersist.records import STATE_HOWS, HostMemoryRecord, Phase, StateRecord

FORMAT_NAME = "graphpersist-archive"
# 2: rank.json's `device` became {index, uuid, pci_bus_id} (which physical GPU each rank drove), compared at LOAD.
# 3: every rank record commits to its files and itself (`extra.digests`, required), rank 0's also to manifest.json
#    (graphpersist.archive.digests): a format-2 archive may lack them, and an archive without them is refused.
# 3: names are registry ids, never module paths: an output dataclass is {"kind": "dataclass", "type": <id>} (was
#    "class": "module:Qual.Name"), an engine's call record (SGLang's breaks) {"kind": "call", "fn": <id>} (was
#    "fn": "module:Qual.Name" or "torch.ops:ns.op"). Older archives are refused as older ("re-run with mode=save").
FORMAT_VERSION = 3
SUPPORTED_FORMAT_VERSIONS: frozenset[int] = frozenset({FORMAT_VERSION})
MANIFEST_NAME = "manifest.json"
RANK_RECORD_NAME = "rank.json"
RANK_DIR = re.compile(r"rank_(0|[1-9][0-9]*)")  # a rank's folder at the top of an archive
IMAGES_DIR = "images"  # kernel images at the top of an archive, one file per sha256 whichever ranks load it
UINT_MAX = 2**64 - 1  # the largest value of an integer field
# What the world facts may hold (World.limit_problem): every saved fact is compared with its live value at LOAD and by
# `graphpersist check`, so the counts and sizes are capped far above what an engine records (vLLM and SGLang record
# about 25 flags and 10 pins, the longest value a list of a few hundred batch sizes) and far below what would cost
# time: a padded manifest is refused at once, naming the cap.
MAX_FLAGS = 1024  # flag fields (a nested flag counts each of its leaves, as they are compared)
MAX_ENV = 1024  # environment pins
MAX_FIELD_NAME = 256  # characters of a fact's dotted name ("flags.memory_pool.max_total_num_tokens")
MAX_FIELD_BYTES = 64 << 10  # one fact's value as JSON text
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """A manifest or rank record that cannot be trusted: malformed JSON, a missing or mistyped field."""


class UnsupportedFormat(ManifestError):
    """An archive written in a format version this graphpersist does not read.

    `older` tells the two cases apart: an older archive lacks facts this release compares (re-run SAVE), a newer
    one needs a newer graphpersist.
    """

    def __init__(self, message: str, *, version: int, older: bool) -> None:
        super().__init__(message)
        self.version = version
        self.older = older


def rank_dir(rank: int) -> str:
    """The folder of one rank inside the archive."""
    return f"rank_{rank}"


# ---------------------------------------------------------------------------------------------------------
# World facts: shared by every rank, recorded once in manifest.json and compared field by field at LOAD.
# The dotted path of each leaf (e.g. "parallel.tp_size") is the field name users see in mismatch messages.


@dataclass(frozen=True)
class EngineFacts:
    """Which engine build captured the graphs; a different build may lay out memory or kernels differently."""

    name: str
    version: str
    commit: str


@dataclass(frozen=True)
class DistributionFacts:
    """The distribution release (= graphpersist's version): the runtime that wrote the archive."""

    version: str


@dataclass(frozen=True)
class TorchFacts:
    """torch's own version; its allocator and kernels shape every address and image in the archive."""

    version: str | None


@dataclass(frozen=True)
class CudaFacts:
    """CUDA runtime torch was built with, the driver release, and the CUDA version the driver implements.

    Saved graphs embed driver-specific kernel handles and parameter layouts, so all three must match.
    """

    runtime: str | None
    driver: str | None
    driver_api: str | None


@dataclass(frozen=True)
class NcclFacts:
    """NCCL's version decides its buffers, channels and algorithms, i.e. what collectives the graphs replay."""

    version: str | None


@dataclass(frozen=True)
class GpuFacts:
    """The GPU model and compute capability: kernel images are compiled for, and tuned on, exactly these."""

    model: str | None
    compute_capability: str | None


@dataclass(frozen=True)
class ParallelFacts:
    """The parallel layout: it decides how many ranks exist and what each rank's graphs communicate."""

    world_size: int
    tp_size: int
    pp_size: int
    ep_size: int


@dataclass(frozen=True)
class ModelFacts:
    """The model: dtype plus a fingerprint of the engine's model config (weights' shapes decide addresses)."""

    dtype: str
    config_fingerprint: str


@dataclass(frozen=True)
class CaptureFacts:
    """Which graphs the engine captures: batch sizes and modes (e.g. full / piecewise)."""

    sizes: tuple[int, ...]
    modes: tuple[str, ...]


@dataclass(frozen=True)
class World:
    """Facts shared by all ranks of one SAVE. Every leaf is compared with the live value before LOAD.

    `env` maps each pinned environment variable to its value, None when it was unset (unset is a value too:
    setting NCCL_ALGO later changes the collectives). `flags` holds engine flags that change what is captured
    and are not covered above; the engine integration chooses them.
    """

    engine: EngineFacts
    distribution: DistributionFacts
    torch: TorchFacts
    cuda: CudaFacts
    nccl: NcclFacts
    gpu: GpuFacts
    parallel: ParallelFacts
    model: ModelFacts
    capture: CaptureFacts
    env: dict[str, str | None] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> World:
        """Builds the world from a nested mapping (e.g. liveenv.collect_live's); unknown keys and facts past the caps
        (MAX_FLAGS, MAX_ENV, MAX_FIELD_NAME, MAX_FIELD_BYTES) are refused."""
        return _from_json(cls, data, "world")

    def limit_problem(self, where: str = "world") -> str | None:
        """Which cap the facts exceed, or None: counted and measured before anything compares them."""
        if len(self.env) > MAX_ENV:
            return f"{where}.env holds {len(self.env)} pins, more than the {MAX_ENV} an archive may record (MAX_ENV)"
        leaves: list[tuple[str, Any]] = []
        pending: list[tuple[str, Any]] = [("flags", self.flags)]
        while pending:  # the flags' leaves, named as validate.flatten names them, counted before the walk goes on
            prefix, mapping = pending.pop()
            for key, value in mapping.items():
                if isinstance(value, Mapping):
                    pending.append((f"{prefix}.{key}", value))
                else:
                    leaves.append((f"{prefix}.{key}", value))
            if len(leaves) + len(pending) > MAX_FLAGS:
                return f"{where}.flags holds more than the {MAX_FLAGS} flags an archive may record (MAX_FLAGS)"
        facts = _to_json({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "flags"})
        leaves += [(f"{section}.{key}", value) for section, values in facts.items() for key, value in values.items()]
        for name, value in leaves:
            if len(name) > MAX_FIELD_NAME:
                return (f"{where}.{_clip(name)}: a name of {len(name)} characters, more than {MAX_FIELD_NAME} "
                        "(MAX_FIELD_NAME)")  # fmt: skip
            size = len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
            if size > MAX_FIELD_BYTES:
                return (f"{where}.{_clip(name)}: a value of {size} characters, more than {MAX_FIELD_BYTES} "
                        "(MAX_FIELD_BYTES)")  # fmt: skip
        return None


# ---------------------------------------------------------------------------------------------------------
# Per-rank facts: rank_<r>/rank.json.


@dataclass(frozen=True)
class RegionFacts:
    """The rank's fixed virtual range and how far SAVE's bump cursor got; LOAD must land on the same bytes."""

    base: int
    size: int
    final_offset: int


@dataclass(frozen=True)
class PointerInventory:
    """A digest of every device address the graphs reference, so LOAD can prove it recreated all of them."""

    fingerprint: str
    count: int


@dataclass(frozen=True)
class GraphRecord:
    """One saved graph: where its serialized DAG lives and what LOAD must rebuild.

    `file` and the image hashes point into the archive; `topology_fingerprint` lets LOAD check the rebuilt DAG
    and lets graphs of equal topology share instantiation work.
    """

    name: str
    file: str
    topology_fingerprint: str
    node_count: int
    nodes_by_type: dict[str, int]
    kernel_count: int
    images: tuple[str, ...]
    capture_size: int | None = None
    mode: str | None = None
    instantiate_flags: int = 0  # what torch instantiated SAVE's executable with; 0 in archives written before it


@dataclass(frozen=True)
class ImageRecord:
    """One kernel image (cubin / fatbin / PTX / library) keyed by its content hash, with its kernel names.

    `file` is archive-relative, so ranks with identical images may share one top-level file.
    """

    sha256: str
    file: str
    size: int
    kind: str
    entries: tuple[str, ...]


@dataclass(frozen=True)
class DeviceFacts:
    """Which GPU the rank drove: its CUDA device index in the process, its UUID and its PCI bus id.

    Saved graphs hold this GPU's addresses, its peers' IPC mappings and NCCL's topology-dependent choices, so a
    rank that comes back in another slot (ranks swapped, CUDA_VISIBLE_DEVICES reordered) must not replay them.
    `uuid` is nvidia-smi's form ("GPU-<hex>"); `pci_bus_id` is sysfs' form ("0000:19:00.0", lower-case hex,
    4-digit domain). `device.index` and `device.pci_bus_id` are compared at LOAD; `uuid` is recorded only (which
    card saved it), so the archive loads on another node of the same kind with its GPUs in the same slots.
    """

    index: int
    uuid: str
    pci_bus_id: str


@dataclass(frozen=True)
class RecordDigests:
    """What a rank record commits to (graphpersist.archive.digests): the sha256 of every file it owns, by archive
    path, of the record itself as canonical JSON without `record`, and (rank 0's only) of manifest.json without
    its file table and creation info."""

    files: dict[str, str]
    record: str
    manifest: str | None = None


@dataclass(frozen=True)
class RankExtra:
    """The runtime's own notes in a rank record (rank.json's `extra`): LOAD lays memory out, restores declared state
    and hands the engine its notes from them, but never compares them as facts.

    Every key is optional (None: absent) because SAVEs of format 2 wrote fewer of them as the runtime grew; an
    absent key stays absent when the record is written back, so the JSON keeps its keys. What LOAD needs but an
    older archive may lack (`setup_events`/`setup_cursor` without `phases`) is loadplan's to require. Parsed once,
    by from_dict: a mistyped, out-of-range or unknown key is a ManifestError naming it (`extra.phases[1].start: ...`),
    so nothing downstream meets a value of the wrong type.
    """

    setup_events: int | None = None  # before phases: how many log events setup made
    setup_cursor: int | None = None  # before phases: the cursor when setup ended
    address_fingerprints: dict[str, str] | None = None  # graph name -> graph.format.address_fingerprint
    granularity: int | None = None  # the region's allocation granularity
    phases: tuple[Phase, ...] | None = None  # memory.phases, in order; None: one exact phase (phases.legacy)
    state: tuple[StateRecord, ...] | None = None  # declared device state (memory.state)
    engine_notes: dict[str, Any] | None = None  # the engine glue's free-form notes (save(notes=...))
    pointer_phases: dict[str, int] | None = None  # graph addresses per phase that made their memory
    variable_pointers: tuple[tuple[int, str], ...] | None = None  # the first 64 (address, phase) in variable phases
    torch_blocks: tuple[tuple[int, int], ...] | None = None  # (address, size) of torch's blocks graphs read
    host_memory: HostMemoryRecord | None = None  # pinned host memory graphs read (memory.hostmem); absent if none
    digests: RecordDigests | None = None  # written by the archive writer (graphpersist.archive.digests)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object rank.json holds: the keys present, in the order SAVE has always written them."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in ("phases", "state"):
                out[f.name] = [row.to_json() for row in value]
            elif f.name == "digests":  # `manifest` only in rank 0's
                out[f.name] = {k: v for k, v in _to_json(value).items() if v is not None}
            else:
                out[f.name] = _to_json(value)
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "extra") -> RankExtra:
        """Checks and converts rank.json's `extra`; ManifestError naming the key (and item) that is wrong."""
        if not isinstance(data, Mapping):
            raise ManifestError(f"{where}: must be an object, got {_show(data)}")
        unknown = [str(k) for k in data if k not in _EXTRA_PARSERS]
        if unknown:
            raise _unknown_fields(where, unknown)
        values = {}
        for key, value in data.items():
            if value is None and key == "engine_notes":
                continue  # as loadplan always read it: no notes
            values[key] = _EXTRA_PARSERS[key](value, f"{where}.{key}")
        return cls(**values)


@dataclass(frozen=True)
class RankRecord:
    """What one rank saved. `extra` holds the runtime's own notes (RankExtra): read by LOAD, never compared."""

    rank: int
    device: DeviceFacts
    region: RegionFacts
    pointers: PointerInventory
    graphs: tuple[GraphRecord, ...] = ()
    images: tuple[ImageRecord, ...] = ()
    extra: RankExtra = field(default_factory=RankExtra)

    def engine_notes(self) -> dict[str, Any]:
        """A copy of the notes the engine's glue had SAVE keep for this rank (save(notes=...)); empty if none."""
        return dict(self.extra.engine_notes or {})

    def to_dict(self) -> dict[str, Any]:
        return _to_json(self)

    def to_json(self) -> str:
        return _dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankRecord:
        return _from_json(cls, data, "rank")

    @classmethod
    def from_json(cls, text: str | bytes) -> RankRecord:
        return cls.parsed(text)[0]

    @classmethod
    def parsed(cls, text: str | bytes) -> tuple[RankRecord, dict[str, Any]]:
        """The record and the JSON object it was read from (what graphpersist.archive.digests hashes)."""
        doc = _loads(text, RANK_RECORD_NAME)
        return cls.from_dict(doc), doc


# ---------------------------------------------------------------------------------------------------------
# The manifest itself.


@dataclass(frozen=True)
class Creation:
    """Who wrote the archive, when and where. Informational only: never compared at LOAD."""

    created_at: str
    host: str
    graphpersist_version: str
    python: str

    @classmethod
    def now(cls) -> Creation:
        from graphpersist import __version__

        return cls(
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            host=socket.gethostname(),
            graphpersist_version=__version__,
            python=platform.python_version(),
        )


@dataclass(frozen=True)
class FileEntry:
    """One payload file's checksum and size; LOAD trusts no byte that does not match both."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """The top-level manifest.json. `files` maps archive-relative posix paths to their checksums."""

    format_version: int
    created: Creation
    world: World
    ranks: tuple[int, ...]
    files: dict[str, FileEntry]

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, **_to_json(self)}

    def to_json(self) -> str:
        return _dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """Parses a manifest, refusing other formats and unknown versions before reading anything else."""
        if not isinstance(data, Mapping):
            raise ManifestError("the manifest must be a JSON object")
        if data.get("format") != FORMAT_NAME:
            given = _show(data.get("format"))
            raise ManifestError(f"not a graphpersist manifest (format {given}, want {FORMAT_NAME!r})")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= UINT_MAX:
            raise ManifestError(f"format_version must be a positive integer, got {_show(version)}")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            supported = ", ".join(str(v) for v in sorted(SUPPORTED_FORMAT_VERSIONS))
            older = version < max(SUPPORTED_FORMAT_VERSIONS)
            raise UnsupportedFormat(
                f"archive format version {version} is {'older' if older else 'newer'} than what this graphpersist "
                f"reads (format {supported})",
                version=version,
                older=older,
            )
        body = {k: v for k, v in data.items() if k != "format"}
        return _from_json(cls, body, "manifest")

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        return cls.parsed(text)[0]

    @classmethod
    def parsed(cls, text: str | bytes) -> tuple[Manifest, dict[str, Any]]:
        """The manifest and the JSON object it was read from (what rank 0's record commits to, without `files`)."""
        doc = _loads(text, MANIFEST_NAME)
        return cls.from_dict(doc), doc

    def consistency_problems(self) -> list[str]:
        """What contradicts itself across fields: ranks that are not exactly 0 .. parallel.world_size-1, a file
        table without a rank's record, files under a rank folder the manifest does not list. [] when consistent.
        """
        parallel = self.world.parallel
        problems = [
            f"parallel.{name} is {value}: it must be at least 1"
            for name, value in (
                ("world_size", parallel.world_size),
                ("tp_size", parallel.tp_size),
                ("pp_size", parallel.pp_size),
                ("ep_size", parallel.ep_size),
            )
            if value < 1
        ]
        problems += _rank_list_problems(self.ranks, parallel.world_size)
        listed = {rank_dir(rank) for rank in self.ranks}
        problems += [
            f"rank {rank} has no {rank_dir(rank)}/{RANK_RECORD_NAME} in the file table"
            for rank in sorted(set(self.ranks))
            if f"{rank_dir(rank)}/{RANK_RECORD_NAME}" not in self.files
        ]
        strays = sorted({top for rel in self.files if RANK_DIR.fullmatch(top := rel.split("/", 1)[0])} - listed)
        problems += [f"the file table lists {_clip(folder)}/, a rank that ranks do not name" for folder in strays]
        return problems


def _rank_list_problems(ranks: tuple[int, ...], world_size: int) -> list[str]:
    """Why `ranks` is not exactly [0, 1, .., world_size-1] (duplicates, gaps, strays, order); [] when it is."""
    seen: set[int] = set()
    twice: list[int] = []
    for rank in ranks:
        if rank in seen:
            twice.append(rank)
        else:
            seen.add(rank)
    issues = []
    if twice:
        issues.append(f"{_few(sorted(set(twice)))} listed more than once")
    missing = [r for r in range(min(world_size, len(seen) + 5)) if r not in seen][:5]
    n_missing = world_size - len([r for r in seen if r < world_size])
    if n_missing > 0:
        issues.append(f"missing {_few(missing, n_missing)}")
    outside = sorted(r for r in seen if r >= world_size)
    if outside:
        issues.append(f"{_few(outside)} outside the world")
    if not issues and list(ranks) != sorted(ranks):
        issues.append("not in ascending order")
    if not issues:
        return []
    return [
        f"ranks {_few(list(ranks))} must be exactly 0 .. {world_size - 1} (parallel.world_size {world_size}): "
        + "; ".join(issues)
    ]


def _few(items: list[int], total: int | None = None, limit: int = 8) -> str:
    """A list of ranks as messages show it: the first few, and how many there are in all."""
    total = len(items) if total is None else total
    listed = ", ".join(str(i) for i in items[:limit])
    return f"[{listed}]" if total <= limit and len(items) == total else f"[{listed}, …] ({total} in all)"


# ---------------------------------------------------------------------------------------------------------
# JSON <-> dataclass. Small and strict: the records above use only str, int, bool, float, None, tuples,
# str-keyed dicts, nested records and Any (free-form JSON).


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _loads(text: str | bytes, what: str) -> Any:
    try:
        return safejson.loads(text)
    except safejson.JsonError as exc:
        raise ManifestError(f"{what} is not valid JSON: {exc}") from None


def _show(value: Any) -> str:
    """A value for an error message: short, and safe for any value (no huge repr, no deep recursion)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) <= UINT_MAX else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float | str):
        return _clip(repr(value))
    if isinstance(value, Mapping):
        return f"an object of {len(value)} field{'s' if len(value) != 1 else ''}"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    return f"a {type(value).__name__}"


def _clip(text: str, limit: int = 60) -> str:
    """Archive text as messages show it: control characters escaped (graphpersist.archive.shown), clipped."""
    return shown(text, limit)


def _to_json(obj: Any) -> Any:
    if isinstance(obj, RankExtra):
        return obj.to_dict()  # absent keys stay absent
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _to_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_json(v) for v in obj]
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


@functools.cache
def _schema(tp: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    """A record class's resolved field types and fields, computed once per class: an archive of 2000 graphs parses
    2000 graph records, and resolving type hints each time cost more than the rest of opening it."""
    return typing.get_type_hints(tp), {f.name: f for f in dataclasses.fields(tp)}


def _from_json(tp: Any, value: Any, where: str) -> Any:
    return _converter(tp)(value, where)


# Each type gets a converter, built once: (value, where) -> the checked value, or ManifestError naming `where`.
# A rank record of an engine holds thousands of graph records; resolving each field's type on every call cost more
# than parsing the JSON. Scalars also get a predicate that is true exactly when the converter would return the
# value unchanged: the common case then costs one call, and the error path builds the same message as ever.
Converter = Callable[[Any, str], Any]


def _identity(value: Any, where: str) -> Any:
    return value


def _int_ok(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= UINT_MAX


def _check_int(value: Any, where: str) -> Any:
    if not _int_ok(value):
        raise ManifestError(f"{where} must be an integer from 0 to 2**64-1, got {_show(value)}")
    return value


def _float_ok(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _check_float(value: Any, where: str) -> Any:
    if not _float_ok(value):
        raise ManifestError(f"{where} must be a finite number, got {_show(value)}")
    return value


def _instance_check(tp: type) -> tuple[Callable[[Any], bool], Converter]:
    def ok(value: Any) -> bool:
        return isinstance(value, tp)

    def check(value: Any, where: str) -> Any:
        if not isinstance(value, tp):
            raise ManifestError(f"{where} must be a {_type_name(tp)}, got {_show(value)}")
        return value

    return ok, check


@functools.cache
def _scalar(tp: Any) -> tuple[Callable[[Any], bool], Converter] | None:
    """(predicate, converter) for the leaf types; None for containers, records and unions."""
    if tp is Any:
        return (lambda value: True), _identity
    if tp is int:
        return _int_ok, _check_int
    if tp is float:
        return _float_ok, _check_float
    if tp in (str, bool):
        return _instance_check(tp)
    return None


@functools.cache
def _converter(tp: Any) -> Converter:
    scalar = _scalar(tp)
    if scalar is not None:
        return scalar[1]
    if tp is RankExtra:  # its own parser, naming keys as rank.json does (`extra.phases[1].start`)
        return lambda value, where: RankExtra.from_dict(value)
    if tp is World:  # its fields, then its caps
        return _world_converter()
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_converter(tp)
    if dataclasses.is_dataclass(tp):
        return _record_converter(tp)
    if origin is tuple:
        return _tuple_converter(typing.get_args(tp)[0])
    if origin is dict:
        return _dict_converter(typing.get_args(tp)[1])
    return _identity  # a plain type this module does not check (none of the records use one)


def _world_converter() -> Converter:
    fields = _record_converter(World)

    def convert(value: Any, where: str) -> World:
        world = fields(value, where)
        problem = world.limit_problem(where)
        if problem:
            raise ManifestError(problem)
        return world

    return convert


def _union_converter(tp: Any) -> Converter:
    options = typing.get_args(tp)
    nullable = type(None) in options
    converters = [_converter(o) for o in options if o is not type(None)]

    def convert(value: Any, where: str) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for option in converters:
            try:
                return option(value, where)
            except ManifestError as exc:
                errors.append(str(exc))
        raise ManifestError(errors[0] if len(errors) == 1 else f"{where}: unexpected value {_show(value)}")

    return convert


def _exact_types(tp: Any) -> frozenset[type] | None:
    """The value types a field takes as they are (str, bool, an int in range, None where allowed): what the record
    converter accepts without calling the field's converter. None: always call it (containers, records, float)."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if not all(o in (str, bool, int, type(None)) for o in options):
        return None
    return frozenset(options)


def _record_converter(tp: Any) -> Converter:
    hints, known = _schema(tp)
    names = frozenset(known)
    fields = []
    for name, f in known.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        exact = frozenset([object]) if hints[name] is Any else _exact_types(hints[name])
        fields.append((name, required, exact, _converter(hints[name])))

    def convert(value: Any, where: str) -> Any:
        if not isinstance(value, Mapping):
            raise ManifestError(f"{where} must be an object, got {type(value).__name__}")
        if not value.keys() <= names:
            raise _unknown_fields(where, [str(k) for k in set(value) - names])
        kwargs = {}
        for name, required, exact, field_converter in fields:
            if name not in value:
                if required:
                    raise ManifestError(f"{where}.{name} is missing")
                continue
            item = value[name]
            kind = type(item)
            if exact is not None and (kind in exact or object in exact) and (kind is not int or 0 <= item <= UINT_MAX):
                kwargs[name] = item  # what the field's converter would return, without the call
            else:
                kwargs[name] = field_converter(item, f"{where}.{name}")
        return tp(**kwargs)

    return convert


def _unknown_fields(where: str, keys: list[str]) -> ManifestError:
    unknown = sorted(keys)
    listed = ", ".join(_clip(k) for k in unknown[:8])
    listed += f", … ({len(unknown)} in all)" if len(unknown) > 8 else ""
    return ManifestError(f"{where}: unknown field(s) {listed} for this format version")


def _tuple_converter(item_tp: Any) -> Converter:
    scalar = _scalar(item_tp)
    ok = scalar[0] if scalar else None
    item_converter = _converter(item_tp)

    def convert(value: Any, where: str) -> Any:
        if not isinstance(value, list | tuple):
            raise ManifestError(f"{where} must be a list, got {type(value).__name__}")
        if ok is not None and all(map(ok, value)):
            return tuple(value)
        return tuple(item_converter(v, f"{where}[{i}]") for i, v in enumerate(value))

    return convert


def _dict_converter(item_tp: Any) -> Converter:
    scalar = _scalar(item_tp)
    ok = scalar[0] if scalar else None
    item_converter = _converter(item_tp)

    def convert(value: Any, where: str) -> Any:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ManifestError(f"{where} must be an object with string keys, got {_show(value)}")
        if ok is not None and all(map(ok, value.values())):
            return dict(value)
        return {k: item_converter(v, f"{where}.{_clip(k)}") for k, v in value.items()}

    return convert


# ---------------------------------------------------------------------------------------------------------
# RankExtra's keys, one parser each: (value, where) -> the typed value, or ManifestError "<where>: <what is wrong>"
# (the wording LOAD's refusals have always used). Checks that need other files (a phase's events against the
# allocation log, a state's payload against the file table) are loadplan's.

_PHASE_INTS = ("start_event", "end_event", "start", "end", "limit")
_PHASE_BOOLS = ("exact", "skip_on_load", "post_capture", "implicit")
_PHASE_FIELDS = frozenset(f.name for f in dataclasses.fields(Phase))
_STATE_FIELDS = frozenset(f.name for f in dataclasses.fields(StateRecord))


def _uint(value: Any, where: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= UINT_MAX:
        raise ManifestError(f"{where}: must be an integer from {low} to 2**64-1, got {_show(value)}")
    return value


def _rows(value: Any, where: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise ManifestError(f"{where}: must be a list, got {_show(value)}")
    return value


def _str_keys(value: Any, where: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ManifestError(f"{where}: must be an object {what}, got {_show(value)}")
    return value


def _names_to_str(value: Any, where: str) -> dict[str, str]:
    found = _str_keys(value, where, "of graph names to fingerprints")
    for key, item in found.items():
        if not isinstance(item, str):
            raise ManifestError(f"{where}.{_clip(key)}: must be a string, got {_show(item)}")
    return dict(found)


def _names_to_uint(value: Any, where: str) -> dict[str, int]:
    found = _str_keys(value, where, "of phase names to counts")
    return {key: _uint(item, f"{where}.{_clip(key)}") for key, item in found.items()}


def _notes(value: Any, where: str) -> dict[str, Any]:
    """Free-form JSON (safejson checked it), but an object: the engine's glue looks its sections up by name."""
    return dict(_str_keys(value, where, "(the engine's notes)"))


def _pairs(value: Any, where: str, second: str) -> tuple[tuple[int, Any], ...]:
    """[[address, size]] (`second` "size") or [[address, phase name]] (`second` "phase")."""
    out = []
    for i, row in enumerate(_rows(value, where)):
        at = f"{where}[{i}]"
        if not isinstance(row, list | tuple) or len(row) != 2:
            raise ManifestError(f"{at}: must be [address, {second}], got {_show(row)}")
        address = _uint(row[0], f"{at}[0]")
        if second == "size":
            out.append((address, _uint(row[1], f"{at}[1]")))
        elif isinstance(row[1], str):
            out.append((address, row[1]))
        else:
            raise ManifestError(f"{at}[1]: must be a phase name, got {_show(row[1])}")
    return tuple(out)


def _phases(value: Any, where: str) -> tuple[Phase, ...]:
    out = []
    for i, row in enumerate(_rows(value, where)):
        at = f"{where}[{i}]"
        if not isinstance(row, Mapping):
            raise ManifestError(f"{at}: must be an object, got {_show(row)}")
        if set(row) - _PHASE_FIELDS or not isinstance(row.get("name"), str):
            raise ManifestError(f"{at}: needs a name and only Phase's fields, got {sorted(map(shown, row))[:8]}")
        for key in _PHASE_BOOLS:
            if key in row and type(row[key]) is not bool:
                raise ManifestError(f"{at}.{key}: must be true or false, got {_show(row[key])}")
        for key in _PHASE_INTS:
            if key in row:
                _uint(row[key], f"{at}.{key}")
        for key in ("headroom", "span"):
            if row.get(key) is not None:
                _uint(row[key], f"{at}.{key}")
        ph = Phase.from_json(row)
        if not ph.start_event <= ph.end_event:
            raise ManifestError(f"{at}: events {ph.start_event}..{ph.end_event} out of order")
        if not ph.start <= ph.end <= ph.limit:
            raise ManifestError(f"{at}: offsets start {ph.start}, end {ph.end}, limit {ph.limit} out of order")
        out.append(ph)
    return tuple(out)


def _states(value: Any, where: str) -> tuple[StateRecord, ...]:
    out = []
    for i, row in enumerate(_rows(value, where)):
        at = f"{where}[{i}]"
        if not isinstance(row, Mapping) or set(row) - _STATE_FIELDS:
            raise ManifestError(f"{at}: must be an object of StateRecord's fields")
        name, how, sha, file, ph = (row.get(k) for k in ("name", "how", "sha256", "file", "phase"))
        if not isinstance(name, str) or how not in STATE_HOWS or not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise ManifestError(f"{at}: needs a name, how (bytes or recreated) and a sha256")
        _uint(row.get("addr"), f"{at}.addr", 1)
        _uint(row.get("nbytes"), f"{at}.nbytes", 1)
        if ph is not None and not isinstance(ph, str):
            raise ManifestError(f"{at}.phase: must be a phase name or null, got {_show(ph)}")
        if (how == "bytes") != isinstance(file, str) or (file is not None and not isinstance(file, str)):
            raise ManifestError(f"{at}.file: names the payload of a 'bytes' state, and only of one")
        out.append(StateRecord.from_json(row))
    return tuple(out)


def _digests(value: Any, where: str) -> RecordDigests:
    if not isinstance(value, Mapping) or not {"files", "record"} <= set(value) <= {"files", "record", "manifest"}:
        raise ManifestError(f"{where}: must be an object with `files`, `record` and (rank 0's) `manifest`")
    for key in ("record", "manifest"):
        if key in value and (not isinstance(value[key], str) or not _SHA256.fullmatch(value[key])):
            raise ManifestError(f"{where}.{key}: must be a sha256 (64 lower-case hex digits)")
    files = value["files"]
    if not isinstance(files, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and _SHA256.fullmatch(v) for k, v in files.items()
    ):
        raise ManifestError(f"{where}.files: must map archive paths to sha256s")
    return RecordDigests(files=dict(files), record=value["record"], manifest=value.get("manifest"))


def _host_memory(value: Any, where: str) -> HostMemoryRecord:
    if not isinstance(value, Mapping) or set(value) != {"ranges", "words"}:
        raise ManifestError(f"{where}: must be an object with exactly `ranges` and `words`")
    return HostMemoryRecord(
        ranges=_pairs(value["ranges"], f"{where}.ranges", "size"), words=_uint(value["words"], f"{where}.words")
    )


_EXTRA_PARSERS: dict[str, Converter] = {
    "setup_events": _uint,
    "setup_cursor": _uint,
    "address_fingerprints": _names_to_str,
    "granularity": _uint,
    "phases": _phases,
    "state": _states,
    "engine_notes": _notes,
    "pointer_phases": _names_to_uint,
    "variable_pointers": lambda value, where: _pairs(value, where, "phase"),
    "torch_blocks": lambda value, where: _pairs(value, where, "size"),
    "digests": _digests,
    "host_memory": _host_memory,
}  # one per RankExtra field (test_rank_extra round-trips a record that has them all)
