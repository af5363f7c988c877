"""Declared device state: memory graphs read but that no graph writes (registered peer pointers, rank data,
planner buffers), written by setup or post-capture code instead.

LOAD does not re-run warm-up, so such memory must be accounted for explicitly. `how="bytes"`: SAVE stores the
content and LOAD writes it back. `how="recreated"`: the engine re-creates it at LOAD by the same deterministic
calls and the runtime proves, before the first replay, that its content hashes equal SAVE's. Either way a
difference refuses, naming the buffer, its address and both hashes. This module is the pure bookkeeping; the
device reads and writes are passed in by `graphpersist.api`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from graphpersist.records import STATE_HOWS, StateRecord


class StateError(RuntimeError):
    """Declared state differs between SAVE and LOAD, or is declared the wrong way."""


@dataclass(frozen=True)
class Declared:
    """One declaration in this process: a named device range and how LOAD gets its content."""

    name: str
    addr: int
    nbytes: int
    how: str
    phase: str | None = None

    def __post_init__(self) -> None:
        if self.how not in STATE_HOWS:
            raise StateError(f"state {self.name!r}: how={self.how!r}, expected one of {', '.join(STATE_HOWS)}")
        if self.nbytes <= 0 or self.addr <= 0:
            raise StateError(f"state {self.name!r}: needs a device address and a positive size, got "
                             f"{self.addr:#x}+{self.nbytes}")  # fmt: skip

    def extent(self) -> str:
        return f"{self.addr:#x}+{self.nbytes}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def declare(table: dict[str, Declared], d: Declared) -> None:
    """Adds a declaration; the same name twice, or two overlapping ranges, is refused."""
    if d.name in table:
        raise StateError(f"state {d.name!r} is declared twice")
    for other in table.values():
        if other.addr < d.addr + d.nbytes and d.addr < other.addr + other.nbytes:
            raise StateError(f"state {d.name!r} ({d.extent()}) overlaps state {other.name!r} ({other.extent()})")
    table[d.name] = d


def record(d: Declared, data: bytes, file: str | None = None) -> StateRecord:
    if len(data) != d.nbytes:
        raise StateError(f"state {d.name!r}: read {len(data)} bytes of {d.nbytes}")
    return StateRecord(d.name, d.addr, d.nbytes, d.how, sha256(data), d.phase, file if d.how == "bytes" else None)


def check_declarations(saved: Sequence[StateRecord], live: Mapping[str, Declared]) -> None:
    """LOAD declares exactly SAVE's state: same names, addresses, sizes and kinds."""
    problems = []
    for r in saved:
        d = live.get(r.name)
        if d is None:
            problems.append(f"{r.name!r} ({r.how}, {r.addr:#x}+{r.nbytes}) was declared at SAVE, not at LOAD")
        elif (d.addr, d.nbytes, d.how) != (r.addr, r.nbytes, r.how):
            problems.append(f"{r.name!r}: saved {r.how} {r.addr:#x}+{r.nbytes}, live {d.how} {d.extent()}")
    names = {r.name for r in saved}
    problems += [f"{n!r} ({d.extent()}) is declared at LOAD but not at SAVE" for n, d in live.items() if n not in names]
    if problems:
        raise StateError("declared state differs from SAVE's: " + "; ".join(problems) +
                         ". Declare the same state in the same way in both runs")  # fmt: skip


def restore(saved: Sequence[StateRecord], payload: Callable[[StateRecord], bytes],
            write: Callable[[int, bytes], None], read: Callable[[int, int], bytes]) -> list[str]:  # fmt: skip
    """LOAD: writes each "bytes" state back (its payload's hash checked first) and checks that every "recreated"
    state hashes as at SAVE. Returns the names handled. Refuses on the first mismatch."""
    done = []
    for r in saved:
        if r.how == "bytes":
            data = payload(r)
            got = sha256(data)
            if got != r.sha256 or len(data) != r.nbytes:
                raise StateError(f"state {r.name!r} at {r.addr:#x}+{r.nbytes}: the archive's payload hashes {got}, "
                                 f"SAVE recorded {r.sha256}: the archive is damaged")  # fmt: skip
            write(r.addr, data)
            got = sha256(read(r.addr, r.nbytes))
        else:
            got = sha256(read(r.addr, r.nbytes))
        if got != r.sha256:
            verb = "written back" if r.how == "bytes" else "re-created"
            raise StateError(
                f"state {r.name!r} ({r.how}) at {r.addr:#x}+{r.nbytes}: content {verb} at LOAD hashes {got}, "
                f"SAVE's hashed {r.sha256}. The engine's deterministic re-creation differs (other peers, other "
                "order) or the memory is written elsewhere: LOAD refused"
            )
        done.append(r.name)
    return done
