"""The archive's manifest: every fact LOAD must match, as typed records (their JSON: graphpersist.archive.codec).

An archive is one directory::

    manifest.json          format, creation info, the world facts all ranks share, the ranks, the file table
    rank_<r>/rank.json     that rank's own facts: its GPU, region, pointer inventory, graphs, kernel images
    rank_<r>/...           that rank's payload files (graphs, images, allocation log ...)
    <name>                 payload shared by all ranks (optional)

The records are strict on purpose: a field that is missing, mistyped or unknown to this format version makes
the manifest unreadable, because LOAD must never guess what a SAVE meant. A change to the meaning of any field
bumps FORMAT_VERSION; a reader refuses versions it does not know instead of half-understanding them.

This module holds the records and the rules that span their fields (World.limit_problem: the caps on what the
world facts may hold; Manifest.consistency_problems: ranks against parallel.world_size); graphpersist.archive.codec
reads and writes them as JSON, refusing what it cannot trust with a ManifestError.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from graphpersist.archive.shown import shown
from graphpersist.records import HostMemoryRecord, Phase, StateRecord

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


class ManifestError(ValueError):
    """A manifest or rank record that cannot be trusted: malformed JSON, a missing or mistyped field (raised by
    graphpersist.archive.codec as it reads them)."""


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

    def limit_problem(self, where: str = "world") -> str | None:
        """Which cap (MAX_FLAGS, MAX_ENV, MAX_FIELD_NAME, MAX_FIELD_BYTES) the facts exceed, or None: counted and
        measured before anything compares them (the codec refuses a world read past one)."""
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
        facts = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "flags"}
        leaves += [(f"{section}.{key}", value) for section, values in facts.items() for key, value in values.items()]
        for name, value in leaves:
            if len(name) > MAX_FIELD_NAME:
                return (f"{where}.{shown(name, 60)}: a name of {len(name)} characters, more than {MAX_FIELD_NAME} "
                        "(MAX_FIELD_NAME)")  # fmt: skip
            size = len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))
            if size > MAX_FIELD_BYTES:
                return (f"{where}.{shown(name, 60)}: a value of {size} characters, more than {MAX_FIELD_BYTES} "
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
    by the codec: a mistyped, out-of-range or unknown key is a ManifestError naming it (`extra.phases[1].start:
    ...`), so nothing downstream meets a value of the wrong type.
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
        problems += [f"the file table lists {shown(folder, 60)}/, a rank that ranks do not name" for folder in strays]
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


def _plain(value: Any) -> Any:
    """A fact section as the JSON it is written as: a record's fields as a dict, anything else as it is."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
