"""The layout SAVE recorded for one rank, read back and checked: its allocation log and its phases.

What `use_layout()` reads before setup and LOAD's memory stage maps from: the allocation log (`alloc_log.json`) and
the rank record's phases (`extra.phases`; archives written before phases have `extra.setup_events`/`setup_cursor`,
read as one exact phase), each phase within the log, and the layout alone free of what LOAD would refuse
(phases.phases_problem, phases.log_problem), so nothing is mapped before a problem is named. LOAD's CPU stage
(graphpersist.loadplan) reads it too. Needs neither torch nor CUDA.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from graphpersist.archive import Archive, ArchiveError
from graphpersist.archive.fields import Refusal, kind, list_at, uint_at
from graphpersist.archive.manifest import RANK_RECORD_NAME, RankRecord, rank_dir
from graphpersist.memory import phases
from graphpersist.memory.region import EVENT_KINDS, Event

_EVENT_KINDS = frozenset(EVENT_KINDS.values())
_NEW_KIND = re.compile(r"[0-9]{1,9}")  # a kind the native log has and EVENT_KINDS not yet: its number, in ASCII


def read_layout(archive: Archive, rank: int) -> tuple[list[Event], list[phases.Phase]]:
    """The rank's allocation log and phases (one exact phase for archives written before phases), checked: what
    use_layout() and LOAD's memory restore read. ArchiveError naming the file and the field."""
    record = archive.rank_facts(rank)
    rec_rel = f"{rank_dir(rank)}/{RANK_RECORD_NAME}"
    log_rel = f"{rank_dir(rank)}/alloc_log.json"
    try:
        events = _events(archive.read_json(rank, "alloc_log.json"), log_rel)
        extra = record.extra
        if extra.phases is not None:
            saved = _phases(extra.phases, rec_rel, len(events))
        else:
            n = uint_at(extra.setup_events, rec_rel, "extra.setup_events")
            cursor = uint_at(extra.setup_cursor, rec_rel, "extra.setup_cursor")
            if n > len(events):
                raise Refusal(rec_rel, "extra.setup_events", f"{n} events, the allocation log holds {len(events)}")
            saved = phases.legacy(n, cursor)
        _layout_problems(record, saved, events, rec_rel, log_rel)
    except Refusal as exc:
        raise ArchiveError(archive.root, str(exc)) from None
    return events, saved


def _layout_problems(record: RankRecord, saved: list[phases.Phase], events: list[Event], rec_rel: str,
                     log_rel: str) -> None:  # fmt: skip
    """What LOAD's memory stage would refuse of the saved layout alone (phases.phases_problem, log_problem): checked
    here, before setup (use_layout) and before anything is mapped."""
    region = record.region
    if region.final_offset > region.size:
        raise Refusal(rec_rel, "region.final_offset", f"{region.final_offset:#x} lies past its size {region.size:#x}")
    problem = phases.phases_problem(saved, region.size)
    if problem:
        raise Refusal(rec_rel, "", problem)
    problem = phases.log_problem(saved, events, region.base, region.size)
    if problem:
        raise Refusal(log_rel, "", problem)


def _events(log: Any, rel: str) -> list[Event]:
    out = []
    for i, row in enumerate(list_at(log, rel, "")):
        if type(row) is not list or len(row) != 4:
            raise Refusal(rel, f"event {i}", f"must be [kind, address, size, requested size], got {kind(row)}")
        what, addr, size, req = row
        if not isinstance(what, str) or (what not in _EVENT_KINDS and not _NEW_KIND.fullmatch(what)):
            raise Refusal(rel, f"event {i}", f"unknown kind {kind(what)}")
        for name, value in (("address", addr), ("size", size), ("requested size", req)):
            uint_at(value, rel, f"event {i} {name}")
        out.append(Event(i, what, addr, size, req))
    return out


def _phases(saved: tuple[phases.Phase, ...], rel: str, n_events: int) -> list[phases.Phase]:
    """The record's phases (RankExtra checked each), each within the allocation log; copies, for the Recorder."""
    for i, ph in enumerate(saved):
        if ph.end_event > n_events:
            where = f"extra.phases[{i}]"
            raise Refusal(rel, where, f"events {ph.start_event}..{ph.end_event} outside the log's {n_events}")
    return [dataclasses.replace(ph) for ph in saved]
