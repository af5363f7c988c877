"""The process's phases and declared state, wired to the interposer (phases.py and state.py hold the logic).

SAVE: `begin_phase` / `end_phase` / `phase()` record where each phase starts and which allocation events it
makes, leaving headroom after variable phases; `declare_state` names device memory graphs read but no graph
writes. LOAD: `use_layout(archive)` before setup makes every phase start at its saved anchor; after `load()`
the engine re-runs its post-capture phases (anchored the same way) and `verify_state()` (or the first replay)
proves the post-capture memory the graphs read and the declared state equal SAVE's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpersist import run
from graphpersist.archive import Archive, open_archive
from graphpersist.errors import PersistError
from graphpersist.memory import phases, region, state
from graphpersist.memory.savedlayout import read_layout

# torch is imported where device memory is read or written: the bookkeeping runs (and is tested) without it.
# What a SAVE or LOAD gathers here (recorder, declarations, pending checks) lives on the process's run
# (graphpersist.run), so a new session starts from nothing.


@dataclass
class Pending:
    """LOAD's checks that wait for the post-capture phases: run by verify_state() or the first replay."""

    archive: Any
    rank: int
    saved: list[phases.Phase]
    saved_events: list[region.Event]
    pointers: list[int]
    states: list[state.StateRecord]
    done: list[str] = field(default_factory=list)


def recorder() -> phases.Recorder:
    """The phase recorder of the process's run, made at its first use."""
    now = run.current()
    if now.recorder is None:
        now.recorder = phases.Recorder()
    return now.recorder


def _refuse(exc: Exception) -> PersistError:
    return PersistError(f"{exc}: refused")


def _move(target: int, n_events: int) -> None:
    if target != region.info().cursor:
        try:
            region.set_cursor(target, n_events)
        except region.RegionError as exc:
            raise PersistError(f"moving the allocation cursor to offset {target:#x}: {exc}") from None


def _step(call: Any) -> int:
    """Runs one step of the run's recorder, `call(recorder, events, cursor, granularity)`, over the current log and
    cursor, then moves the native cursor where it says."""
    evs = region.events()
    info = region.info()
    try:
        target = call(recorder(), evs, info.cursor, info.granularity)
    except phases.PhaseError as exc:
        raise _refuse(exc) from None
    _move(target, len(evs))
    return target


def saved_phases(archive: Any, rank: int) -> tuple[list[phases.Phase], list[region.Event]]:
    """The archive's phases (one exact phase for archives written before phases) and its allocation log, checked
    (savedlayout.read_layout: ArchiveError naming the file and the field)."""
    evs, saved = read_layout(archive, rank)
    return saved, evs


def use_layout(archive: Archive | Path | str, *, rank: int = 0) -> list[str]:
    """LOAD: reads the archive's phases before setup, so each phase begins at its saved anchor and a variable
    phase cannot shift the ones after it. Call it after start_region(), before the first phase. Returns the
    saved phase names. `archive`: its folder, or the archive already open (an engine's early check opened it)."""
    rec = recorder()
    if rec.phases or rec.setup_done:
        raise PersistError("use_layout() must come before the first phase and before mark_setup()")
    if not isinstance(archive, Archive):  # load() verifies it all; read() checks what it returns
        archive = open_archive(archive, verify_checksums=False)
    saved, evs = saved_phases(archive, rank)
    rec.saved, rec.saved_events = saved, evs
    return [p.name for p in saved]


def begin_phase(
    name: str, *, exact: bool = True, skip_on_load: bool = False, headroom: int | None = None, span: int | None = None
) -> int:
    """Starts phase `name` (ending the open one). `exact=False`: its allocations may differ between runs (SAVE
    leaves `headroom` bytes of address space after it, default as much as it used and at least 1 GiB); `span`: a
    variable phase owns exactly that much address space from its anchor (the next anchor is then the same whatever
    this run allocated, e.g. a cold and a warm compile); `skip_on_load=True`: LOAD may leave it out (capture-only
    work; its memory still live at SAVE is mapped from the archive). After mark_setup() it is a post-capture
    phase, which LOAD re-runs after load(). Returns the region offset the phase starts at."""
    return _step(lambda rec, evs, cur, gran: rec.begin(name, evs, cur, gran, exact=exact, skip_on_load=skip_on_load,
                                                       headroom=headroom, span=span))  # fmt: skip


def end_phase() -> None:
    """Ends the open phase (a variable phase's headroom is left now)."""
    _step(phases.Recorder.end)
    pending = run.current().pending
    if pending is not None and not any(p.post_capture for p in recorder().remaining_saved()):
        _verify_memory(pending)


@contextmanager
def phase(
    name: str, *, exact: bool = True, skip_on_load: bool = False, headroom: int | None = None, span: int | None = None
) -> Iterator[int]:
    """`with phase("weights"): ...` = begin_phase(...) ... end_phase(); an exception leaves the phase open."""
    start = begin_phase(name, exact=exact, skip_on_load=skip_on_load, headroom=headroom, span=span)
    yield start
    end_phase()


def finish_setup() -> None:
    """mark_setup() (or load() when the engine did not call it): ends setup's last phase."""
    if not recorder().setup_done:
        _step(phases.Recorder.finish_setup)


def close_open() -> None:
    """SAVE: ends a post-capture phase left open."""
    _step(phases.Recorder.close)


def declare_state(name: str, what: Any, how: str = "bytes") -> None:
    """Names device memory graphs read but no graph writes (rank data, registered peer pointers, planner
    buffers). "bytes": SAVE stores its content and LOAD writes it back; "recreated": the engine re-creates it at
    LOAD by the same calls and LOAD proves its content hashes equal SAVE's. Declare the same state, the same
    way, in both runs; LOAD checks it in verify_state() or before the first replay."""
    if hasattr(what, "data_ptr"):  # a torch tensor
        if not what.is_contiguous():
            raise PersistError(f"state {name!r}: declare a contiguous tensor (or an (addr, nbytes) pair)")
        addr, nbytes = what.data_ptr(), what.numel() * what.element_size()
    else:
        addr, nbytes = int(what[0]), int(what[1])
    cur = recorder().current
    try:
        state.declare(run.current().declared, state.Declared(name, addr, nbytes, how, cur.name if cur else None))
    except state.StateError as exc:
        raise _refuse(exc) from None


def declared() -> list[state.Declared]:
    return list(run.current().declared.values())


def read_bytes(addr: int, nbytes: int) -> bytes:
    import torch

    from graphpersist.memory.tensors import bytes_at

    torch.cuda.synchronize()
    return bytes_at(addr, nbytes).cpu().numpy().tobytes()


def write_bytes(addr: int, data: bytes) -> None:
    import torch

    from graphpersist.memory.tensors import bytes_at

    dst = bytes_at(addr, len(data))
    dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    torch.cuda.synchronize()


def records_for_save() -> list[tuple[state.StateRecord, bytes]]:
    """SAVE: each declared state with its content (stored for "bytes", hashed for both)."""
    out = []
    for i, d in enumerate(run.current().declared.values()):
        data = read_bytes(d.addr, d.nbytes)
        out.append((state.record(d, data, file=f"state/{i}.bin"), data))
    return out


def set_pending(p: Pending | None) -> None:
    run.current().pending = p


def needs_verify() -> bool:
    return run.current().pending is not None


def _verify_memory(p: Pending) -> None:
    """Graph addresses in post-capture memory, once the post-capture phases ran: saved address, saved size."""
    try:
        phases.check_backed(p.pointers, p.saved, p.saved_events, region.live_ranges(region.events()))
    except phases.PhaseError as exc:
        raise _refuse(exc) from None
    p.pointers = []


def verify_state() -> list[str]:
    """LOAD, after the post-capture phases: proves the memory they made where graphs read it, writes "bytes"
    state back and checks "recreated" state against SAVE's hashes; then the layout is final (freed ranges may
    be reused). Runs by itself before the first replay. Returns the names of the state it handled."""
    p = run.current().pending
    if p is None:
        return []
    rec = recorder()
    left = [q.name for q in rec.remaining_saved() if q.post_capture]
    if rec.current is not None and rec.current.post_capture:
        left.insert(0, rec.current.name)
    if left:
        raise PersistError(
            f"post-capture phase(s) {', '.join(map(repr, left))} of SAVE have not run (to their end) in this LOAD: "
            "run the engine's post-capture registration after load(), inside the same phases, before the first "
            "replay: refused"
        )
    _verify_memory(p)
    try:
        state.check_declarations(p.states, run.current().declared)
        done = state.restore(p.states, lambda r: p.archive.read(p.rank, r.file), write_bytes,
                             read_bytes)  # fmt: skip
    except state.StateError as exc:
        raise _refuse(exc) from None
    set_pending(None)
    region.freeze()
    return done
