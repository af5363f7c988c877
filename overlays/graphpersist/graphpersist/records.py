"""The records the runtime's layers pass between them, at the bottom of the runtime.

The three packages form a line (archive, then memory, then graph: each imports only the ones before it), so a record
two of them share cannot live in either without one reaching up: a setup phase is recorded by memory and stored by
the archive, the pinned host memory graphs read is found by memory, checked by the graph walk and stored by the
archive. They live here, as plain data: no CUDA, no torch, no import of the runtime. So does what the engine tells
SAVE and LOAD about itself (Facts), which both pipelines and the engine session pass along.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

STATE_HOWS = ("bytes", "recreated")  # how LOAD gets a declared state's content (graphpersist.memory.state)


@dataclass(frozen=True)
class Facts:
    """What the engine tells SAVE and LOAD about itself, passed once: `engine` (name, version, commit), `model` (dtype,
    config_fingerprint), `parallel` (world_size, tp_size, pp_size, ep_size; None: one rank) and `flags` (the engine's
    flags that change what it captures). SAVE records them among the archive's world facts; LOAD compares them with
    the saved ones, beside what it reads of the process itself (GPU, versions, pinned environment)."""

    engine: Mapping[str, str]
    model: Mapping[str, str]
    parallel: Mapping[str, int] | None = None
    flags: Mapping[str, Any] | None = None


@dataclass
class Phase:
    """One phase as recorded: which events it made (`start_event` .. `end_event`), where it started (`start`,
    region offset = its anchor), where the cursor was when it ended (`end`), and how far LOAD's run of it may
    reach (`limit`: the next phase's anchor; `end` for an exact phase, `end` + headroom for a variable one)."""

    name: str
    exact: bool = True
    skip_on_load: bool = False
    post_capture: bool = False
    implicit: bool = False
    start_event: int = 0
    end_event: int = -1  # -1 while open
    start: int = 0
    end: int = -1
    limit: int = -1
    headroom: int | None = None  # requested gap after a variable phase (None: as much as it used, >= 1 GiB)
    span: int | None = None  # a variable phase's fixed reservation from its anchor (the next anchor = start + span)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Phase:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    def flags(self) -> str:
        words = ["exact" if self.exact else "variable"]
        words += ["skip_on_load"] if self.skip_on_load else []
        words += ["post_capture"] if self.post_capture else []
        return ", ".join(words)


@dataclass(frozen=True)
class StateRecord:
    """A declaration as SAVE recorded it, with the sha256 of its content (and, for "bytes", the payload file)."""

    name: str
    addr: int
    nbytes: int
    how: str
    sha256: str
    phase: str | None = None
    file: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StateRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class HostMemory:
    """Pinned host memory a kernel may read through its host address (mapped memory under unified addressing).

    `restorable`: (addr, size) placed at fixed host addresses by the interposer during setup and live now, which
    LOAD's setup makes again at the same addresses; `others`: (addr, size, why) live pinned memory that LOAD cannot
    put back where it is. Both sorted by address."""

    restorable: list[tuple[int, int]] = field(default_factory=list)
    others: list[tuple[int, int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class HostMemoryRecord:
    """The pinned host allocations a rank's graphs read (graphpersist.memory.hostmem): (address, size) of each, placed
    by the interposer during setup, and how many kernel-parameter words point into them. LOAD's setup must make each
    again at the same address with the same size."""

    ranges: tuple[tuple[int, int], ...]
    words: int
