"""Phase-anchored layout: setup (and post-capture registration) divided into named phases.

Engines allocate in phases (weights, profiling / warm-up scratch, KV cache, communicators, capture, post-capture
registration). Some phases allocate differently from run to run (torch.compile, autotuning, profiling), so a
cold SAVE and a warm LOAD need not repeat the same allocation sequence there. Each phase therefore starts at an
**anchor**: the region offset where it started at SAVE. LOAD moves the bump cursor to that anchor before the
phase allocates, so a variable phase cannot shift the addresses of the phases after it. SAVE leaves headroom
after a variable (non-exact) phase, and LOAD refuses when its run of that phase reached past the next anchor.

This module is the pure bookkeeping (no CUDA, no torch): the recorder both SAVE and LOAD run, the comparison of
LOAD's phases with SAVE's, what LOAD maps from the archive, and the check that every address a graph reads lies
in memory at its saved address with its saved size. `graphpersist.api` drives it with the interposer's events.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from graphpersist.memory.region import Event, live_ranges
from graphpersist.records import Phase

DEFAULT_MIN_HEADROOM = 1 << 30  # virtual address space only: a gap costs no device memory
IMPLICIT_FIRST = "(setup)"  # events before the first named phase (the whole setup when no phase is named)
ALLOC_FREE = ("alloc", "free")


class PhaseError(RuntimeError):
    """A phase's layout or events at LOAD differ from SAVE's, or phases are used the wrong way."""


def round_up(v: int, gran: int) -> int:
    return v if gran <= 0 else -(-v // gran) * gran


def headroom_for(extent: int, headroom: int | None, gran: int) -> int:
    """The gap SAVE leaves after a variable phase that used `extent` bytes of address space: `headroom` when
    given, else as much as the phase used (LOAD may allocate up to twice SAVE's amount) and at least 1 GiB."""
    want = max(extent, DEFAULT_MIN_HEADROOM) if headroom is None else headroom
    if want < 0:
        raise PhaseError(f"headroom must be >= 0 bytes, got {want}")
    return round_up(want, gran)


def describe(e: Event) -> str:
    return f"{e.kind} of {e.req} bytes ({e.size} mapped) at {e.addr:#x}"


# ------------------------------------------------------------------------------------------- recorder


@dataclass
class Recorder:
    """The phases of one process, fed by the caller with the event log so far and the cursor offset.

    SAVE and LOAD run the same recorder over the same engine code. Every setup event belongs to one phase: the
    implicit exact phase "(setup)" holds events before the first named phase, "(after NAME)" those between a
    phase that ended and the next one (empty implicit phases are dropped). Each call returns the offset the
    caller must move the cursor to. With `saved` (LOAD, the archive's phases) a phase starts at its saved
    anchor, a phase out of order or an overrun of the previous phase refuses, an ended phase is compared with
    SAVE's at once, and phases SAVE marked `skip_on_load` that LOAD does not run are listed in `skipped`.
    """

    saved: list[Phase] | None = None
    saved_events: list[Event] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    setup_done: bool = False
    _next_saved: int = 0
    _unmatched: set[int] = field(default_factory=set)  # LOAD: implicit phases SAVE did not have (must stay empty)

    @property
    def current(self) -> Phase | None:
        return self.phases[-1] if self.phases and self.phases[-1].end_event < 0 else None

    def begin(self, name: str, evs: Sequence[Event], cursor: int, gran: int, *, exact: bool = True,
              skip_on_load: bool = False, headroom: int | None = None, span: int | None = None) -> int:  # fmt: skip
        """Ends the open phase and opens `name`; returns the offset the cursor must move to (its anchor).

        `span` (variable phases): the phase owns exactly `span` bytes of address space from its anchor, so the
        next anchor does not depend on how much this run used (a cold and a warm SAVE give the same layout); SAVE
        refuses a run of it that goes past the span. Without it the next anchor is `end` + headroom."""
        if not name or name.startswith("("):
            raise PhaseError(f"phase name {name!r}: names must be non-empty and not start with '('")
        if any(p.name == name for p in self.phases) or name in self.skipped:
            raise PhaseError(f"phase {name!r} is used twice: phase names must be unique")
        if self.setup_done and skip_on_load:
            raise PhaseError(
                f"phase {name!r}: a post-capture phase cannot be skipped at LOAD (re-running it is how LOAD recreates "
                "the registration); capture-time allocations outside post-capture phases need no phase, LOAD maps "
                "them from the archive"
            )
        if (headroom is not None or span is not None) and exact:
            raise PhaseError(f"phase {name!r}: headroom and span are for variable phases (exact=False)")
        if headroom is not None and span is not None:
            raise PhaseError(f"phase {name!r}: give headroom or span, not both")
        if span is not None and span <= 0:
            raise PhaseError(f"phase {name!r}: span must be > 0 bytes, got {span}")
        cursor = self._close(evs, cursor, gran, reopen=False)
        return self._open(Phase(name, exact, skip_on_load, self.setup_done, False, len(evs), -1, cursor,
                                headroom=headroom, span=span), cursor)  # fmt: skip

    def end(self, evs: Sequence[Event], cursor: int, gran: int) -> int:
        """Ends the open named phase (in setup, events up to the next phase go to "(after NAME)")."""
        ph = self.current
        if ph is None or ph.implicit:
            raise PhaseError("end_phase(): no named phase is open")
        return self._close(evs, cursor, gran, reopen=not self.setup_done)

    def finish_setup(self, evs: Sequence[Event], cursor: int, gran: int) -> int:
        """mark_setup(): ends setup's last phase; phases begun later are post-capture phases."""
        if self.setup_done:
            raise PhaseError("mark_setup() was called twice")
        target = self._close(evs, cursor, gran, reopen=False)
        self.setup_done = True
        if self.saved is not None:  # LOAD: SAVE's remaining setup phases must be ones LOAD may skip
            while self._next_saved < len(self.saved) and not self.saved[self._next_saved].post_capture:
                want = self.saved[self._next_saved]
                if not want.skip_on_load:
                    raise PhaseError(f"setup phase {want.name!r} ({want.flags()}) of SAVE did not run at LOAD "
                                     "before mark_setup()")  # fmt: skip
                self.skipped.append(want.name)
                self._next_saved += 1
        return target

    def close(self, evs: Sequence[Event], cursor: int, gran: int) -> int:
        """Ends whatever phase is open (SAVE, LOAD's state check): no implicit phase follows."""
        return self._close(evs, cursor, gran, reopen=False)

    def _ensure_first(self) -> None:
        if not self.phases and not self.setup_done:
            self._open(Phase(IMPLICIT_FIRST, implicit=True), 0)  # retroactive: from the region's start

    def _open(self, ph: Phase, cursor: int) -> int:
        if self.saved is not None:
            ph.start = self._anchor(ph, cursor)
        self.phases.append(ph)
        return ph.start

    def _anchor(self, ph: Phase, cursor: int) -> int:
        """LOAD: the saved phase `ph` stands for, skipping SAVE's skip_on_load phases; refuses an overrun."""
        assert self.saved is not None
        k = self._next_saved
        skipped = []
        while k < len(self.saved) and self.saved[k].name != ph.name and self.saved[k].skip_on_load:
            skipped.append(self.saved[k].name)
            k += 1
        if k >= len(self.saved) or self.saved[k].name != ph.name:
            if ph.implicit:  # SAVE had nothing between these phases: LOAD must not allocate here either
                self._unmatched.add(len(self.phases))
                return cursor
            there = (
                f"SAVE ran phase {self.saved[k].name!r} ({self.saved[k].flags()})"
                if k < len(self.saved)
                else "SAVE recorded no further phase"
            )
            raise PhaseError(
                f"phase {ph.name!r} begins at LOAD where {there}: LOAD must run the same phases in the same order "
                "(only skip_on_load phases may be left out)"
            )
        want = self.saved[k]
        if (want.exact, want.post_capture) != (ph.exact, ph.post_capture):
            raise PhaseError(f"phase {ph.name!r}: saved {want.flags()}, live {ph.flags()}")
        if cursor > want.start:
            prev = self.phases[-1] if self.phases else None
            who = f"phase {prev.name!r}" if prev else "allocations before the first phase"
            if ph.post_capture and (prev is None or not prev.post_capture):
                who = "allocations made at LOAD after setup (before this post-capture phase)"
            raise PhaseError(
                f"{who} overran at LOAD: the cursor is at offset {cursor:#x}, past phase {ph.name!r}'s anchor "
                f"{want.start:#x} ({cursor - want.start} bytes too far). Give the variable phase more headroom "
                "(begin_phase(..., headroom=...)) and SAVE again"
            )
        self.skipped += skipped
        self._next_saved = k
        return want.start

    def _close(self, evs: Sequence[Event], cursor: int, gran: int, *, reopen: bool) -> int:
        self._ensure_first()
        ph = self.current
        if ph is None:
            return cursor
        idx = len(self.phases) - 1
        ph.end_event, ph.end = len(evs), cursor
        empty = ph.end_event == ph.start_event and cursor == ph.start
        if self.saved is None and not ph.exact and ph.span is not None:
            ph.limit = round_up(ph.start + ph.span, gran)
            if cursor > ph.limit:
                raise PhaseError(
                    f"phase {ph.name!r} used {cursor - ph.start} bytes of address space, more than its span of "
                    f"{ph.span} bytes: give it a larger span (begin_phase(..., span=...)) and SAVE again"
                )
        elif self.saved is None:
            ph.limit = cursor if ph.exact else round_up(cursor + headroom_for(cursor - ph.start, ph.headroom, gran),
                                                        gran)  # fmt: skip
        elif idx in self._unmatched:
            self._unmatched.discard(idx)
            if not empty:
                first = evs[ph.start_event] if ph.end_event > ph.start_event else None
                raise PhaseError(
                    f"LOAD allocated between phases where SAVE did not ({ph.name}): "
                    f"{describe(first) if first else f'cursor moved to {cursor:#x}'}; put that code inside a phase"
                )
            ph.limit = cursor
        else:
            want = self.saved[self._next_saved]
            self._next_saved += 1
            ph.limit = want.limit
            if want.exact:  # the first differing event says more than where the cursor ended
                compare_phase(want, self.saved_events, ph, evs)
            if cursor > want.limit:
                raise PhaseError(
                    f"phase {ph.name!r} overran at LOAD: it reached offset {cursor:#x}, past its limit "
                    f"{want.limit:#x} (saved extent {want.start:#x}..{want.end:#x}, headroom "
                    f"{want.limit - want.end} bytes, LOAD used {cursor - ph.start} bytes). Give it more headroom "
                    "(begin_phase(..., headroom=...)) and SAVE again"
                )
            compare_phase(want, self.saved_events, ph, evs)
            empty = False  # it stands for a saved phase: keep it
        if empty and ph.implicit:
            self.phases.pop()
        target = max(cursor, ph.limit)
        if reopen:
            target = self._open(Phase(implicit_name(ph.name), implicit=True, start_event=len(evs), start=target),
                                target)  # fmt: skip
        return target

    def adopt(self, saved: list[Phase], saved_events: list[Event]) -> None:
        """LOAD without use_layout(): after setup, take the archive's phases so post-capture phases anchor."""
        if self.saved is not None:
            return
        self.saved, self.saved_events = saved, saved_events
        self._next_saved = next((i for i, p in enumerate(saved) if p.post_capture), len(saved))

    def remaining_saved(self) -> list[Phase]:
        """LOAD: saved phases not reached yet (post-capture phases still to run, or setup phases left out)."""
        return [] if self.saved is None else self.saved[self._next_saved :]


# ------------------------------------------------------------------------------------------- comparison


def phase_events(ph: Phase, evs: Sequence[Event]) -> list[Event]:
    return list(evs[ph.start_event : ph.end_event if ph.end_event >= 0 else len(evs)])


def compare_phase(saved: Phase, saved_evs: Sequence[Event], live: Phase, live_evs: Sequence[Event]) -> None:
    """An exact phase must repeat SAVE's events (kind, address, mapped and requested size), frees included; a
    variable phase may allocate differently, but its IPC opens and reservations (peer mappings others rely
    on) must land where SAVE's did, in order."""
    want, got = phase_events(saved, saved_evs), phase_events(live, live_evs)
    if not saved.exact:
        want = [e for e in want if e.kind not in ALLOC_FREE]
        got = [e for e in got if e.kind not in ALLOC_FREE]
    what = "event" if saved.exact else "mapping event (IPC open / reservation)"
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        if w.key() != g.key():
            raise PhaseError(
                f"phase {saved.name!r} ({saved.flags()}): {what} {i} differs: saved {describe(w)}, live "
                f"{describe(g)} (the phase's code or its inputs differ)"
            )
    if len(want) != len(got):
        extra = got[len(want)] if len(got) > len(want) else want[len(got)]
        side = "LOAD made" if len(got) > len(want) else "LOAD did not make"
        raise PhaseError(
            f"phase {saved.name!r} ({saved.flags()}): SAVE recorded {len(want)} {what}s, LOAD made {len(got)}; "
            f"first unmatched: {side} {describe(extra)}"
        )


def compare_setup(saved: Sequence[Phase], saved_evs: Sequence[Event], live: Sequence[Phase],
                  live_evs: Sequence[Event]) -> list[str]:  # fmt: skip
    """All of SAVE's setup phases against LOAD's, after LOAD's setup: each ran (same order, same anchor) and
    matches, or was skipped with skip_on_load. Returns the names of the skipped phases."""
    saved_setup = [p for p in saved if not p.post_capture]
    live_setup = [p for p in live if not p.post_capture]
    skipped = []
    j = 0
    for want in saved_setup:
        got = live_setup[j] if j < len(live_setup) else None
        if got is None or got.name != want.name:
            if want.skip_on_load:
                skipped.append(want.name)
                continue
            here = f"LOAD ran {got.name!r} there" if got else "LOAD's setup ended before it"
            raise PhaseError(f"setup phase {want.name!r} ({want.flags()}) of SAVE is missing at LOAD: {here}")
        j += 1
        if got.start != want.start:
            raise PhaseError(
                f"phase {want.name!r} started at offset {got.start:#x} at LOAD, {want.start:#x} at SAVE: start "
                "LOAD's phases at their anchors (graphpersist.api.use_layout before setup)"
            )
        if got.end > want.limit:
            raise PhaseError(f"phase {want.name!r} reached offset {got.end:#x} at LOAD, past its limit "
                             f"{want.limit:#x}")  # fmt: skip
        compare_phase(want, saved_evs, got, live_evs)
    if j < len(live_setup):
        raise PhaseError(f"LOAD ran setup phase {live_setup[j].name!r}, which SAVE did not record")
    return skipped


def late_mappings(evs: Sequence[Event], setup_n: int, phases: Iterable[Phase]) -> list[Event]:
    """Reservations, IPC mappings and other non-allocation events after setup that no declared post-capture
    phase covers: LOAD recreates only plain allocations made after setup, so SAVE refuses these."""
    inside = set()
    for p in phases:
        if p.post_capture:
            inside.update(range(p.start_event, p.end_event if p.end_event >= 0 else len(evs)))
    return [e for i, e in enumerate(evs) if i >= setup_n and i not in inside and e.kind not in ALLOC_FREE]


def after_post_problems(phases: Sequence[Phase], evs: Sequence[Event]) -> list[Event]:
    """Events after the first post-capture phase began that no phase holds: LOAD maps capture-time memory before
    the engine re-runs its post-capture phases, so memory allocated after them would sit where those phases
    allocate again."""
    post = [p for p in phases if p.post_capture]
    if not post:
        return []
    inside = set()
    for p in phases:
        inside.update(range(p.start_event, p.end_event if p.end_event >= 0 else len(evs)))
    return [e for i, e in enumerate(evs) if i >= post[0].start_event and i not in inside]


def skip_problems(phases: Iterable[Phase], evs: Sequence[Event]) -> list[str]:
    """skip_on_load phases whose events LOAD could not recreate by mapping memory (IPC opens, reservations)."""
    out = []
    for p in phases:
        if p.skip_on_load:
            out += [f"phase {p.name!r}: {describe(e)}" for e in phase_events(p, evs) if e.kind not in ALLOC_FREE]
    return out


def owners(phases: Sequence[Phase], evs: Sequence[Event]) -> dict[int, str]:
    """Address -> name of the phase whose event last created a range there ("(capture)" outside any phase)."""
    by_event = {}
    for p in phases:
        for i in range(p.start_event, p.end_event if p.end_event >= 0 else len(evs)):
            by_event[i] = p.name
    return {e.addr: by_event.get(i, "(capture)") for i, e in enumerate(evs)
            if e.kind in ("alloc", "map_fixed", "reserve", "ipc_open", "lib_map")}  # fmt: skip


def restore_ranges(saved: Sequence[Phase], saved_evs: Sequence[Event], live_evs: Sequence[Event],
                   skipped: Iterable[str]) -> list[tuple[int, int]]:  # fmt: skip
    """What LOAD maps from the archive: SAVE's ranges live at its end that capture made (events after setup
    outside post-capture phases) or that a phase LOAD skipped made. Post-capture phases are re-run by the
    engine after LOAD instead. Refuses a range that the live layout already covers differently."""
    skipped = set(skipped)
    setup_end = max((p.end_event for p in saved if not p.post_capture), default=0)
    from_archive = set()
    for i, e in enumerate(saved_evs):
        ph = next((p for p in saved if p.start_event <= i < p.end_event), None)
        if (ph is None and i >= setup_end) or (ph is not None and ph.name in skipped):
            from_archive.add(e.addr)
    for i, e in enumerate(saved_evs):
        if i >= setup_end and e.addr in from_archive and e.kind not in ALLOC_FREE:
            ph = next((p for p in saved if p.start_event <= i < p.end_event), None)
            if ph is None:
                raise PhaseError(f"capture-time {describe(e)} is not restorable: reservations and IPC mappings "
                                 "after setup need a declared post-capture phase")  # fmt: skip
    late = after_post_problems(saved, saved_evs)
    if late:
        raise PhaseError(f"{describe(late[0])} happened at SAVE after a post-capture phase began, outside any phase: "
                         "LOAD cannot map it before the engine re-runs its post-capture phases")  # fmt: skip
    live = live_ranges(list(live_evs))
    out = []
    for a, s in live_ranges(list(saved_evs)):
        if a not in from_archive:
            continue
        clash = [(la, ls) for la, ls in live if la < a + s and a < la + ls]
        if clash:
            la, ls = clash[0]
            raise PhaseError(f"range {a:#x}+{s} that LOAD maps from the archive (made by "
                             f"{owners(saved, saved_evs).get(a, '(capture)')} at SAVE) overlaps memory LOAD already "
                             f"has at {la:#x}+{ls}")  # fmt: skip
        out.append((a, s))
    return out


# ------------------------------------------------------------------------------------------- saved layout
# What no SAVE writes and LOAD's memory stage would refuse (or trip over) later, decided from the archive alone, so
# that LOAD's CPU stage (graphpersist.loadstage) and `graphpersist check` refuse it before anything is mapped. Each
# check is linear in the log (n log n with the sorts): a padded log costs no more than an engine's.

MAPPINGS = ("alloc", "map_fixed", "reserve", "ipc_open", "lib_map")  # events that make a range at their address


def phases_problem(saved: Sequence[Phase], region_size: int) -> str | None:
    """Why the saved phases are not a layout the recorder makes: names unique, events in order without overlap, each
    anchor at or after the previous phase's limit, every limit inside the region, setup phases before post-capture
    ones. None when they are."""
    names: set[str] = set()
    prev: Phase | None = None
    post = False
    for i, ph in enumerate(saved):
        where = f"extra.phases[{i}] ({ph.name[:60]!r})"
        if ph.name in names:
            return f"{where}: a second phase of that name"
        names.add(ph.name)
        if ph.limit > region_size:
            return f"{where}: its limit {ph.limit:#x} lies past the region's {region_size:#x} bytes"
        if prev is not None and (ph.start_event < prev.end_event or ph.start < prev.limit):
            return (f"{where}: events {ph.start_event}.. and anchor {ph.start:#x} before the end of the phase before "
                    f"(events ..{prev.end_event}, limit {prev.limit:#x})")  # fmt: skip
        if post and not ph.post_capture:
            return f"{where}: a setup phase after a post-capture phase"
        post = post or ph.post_capture
        prev = ph
    return None


def log_problem(saved: Sequence[Phase], evs: Sequence[Event], base: int, size: int) -> str | None:
    """Why the allocation log (with phases_problem's phases) is not one SAVE writes or LOAD can restore: an event
    outside the region, or one SAVE refuses (`outside`, `refused`); a reservation or IPC mapping after setup that no
    post-capture phase holds, or in a skip_on_load phase (restore_ranges, skip_problems); an event after the first
    post-capture phase began outside every phase (after_post_problems). None when it is sound."""
    end = base + size
    for i, e in enumerate(evs):
        if e.kind in ("outside", "refused"):
            return f"event {i}: {e.describe()}: SAVE refuses any such event"
        if not base <= e.addr < end or (e.kind in MAPPINGS and e.addr + e.size > end):
            return f"event {i}: {describe(e)} lies outside the region {base:#x}+{size:#x}"
    inside: set[int] = set()
    for p in saved:
        inside.update(range(p.start_event, p.end_event))
    setup_end = max((p.end_event for p in saved if not p.post_capture), default=0)
    for i in range(setup_end, len(evs)):
        if i not in inside and evs[i].kind not in ALLOC_FREE:
            return (f"event {i}: capture-time {describe(evs[i])} is not restorable: reservations and IPC mappings "
                    "after setup need a declared post-capture phase")  # fmt: skip
    skipped = skip_problems(saved, evs)
    if skipped:
        return f"{skipped[0]}: a skip_on_load phase may only allocate and free (LOAD maps its memory)"
    late = after_post_problems(saved, evs)
    if late:
        return f"{describe(late[0])} happened after a post-capture phase began, outside any phase"
    return None


def unbacked(pointers: Iterable[int], evs: Sequence[Event]) -> int | None:
    """The lowest graph address in no memory SAVE had live at its end (check_backed's "inconsistent" case); None when
    every one lies in some."""
    live = live_ranges(list(evs))
    return next((p for p in sorted(set(pointers)) if find_range(live, p) is None), None)


def find_range(ranges: list[tuple[int, int]], addr: int) -> tuple[int, int] | None:
    """The (start, size) in sorted, disjoint `ranges` holding `addr`, or None."""
    i = bisect.bisect_right(ranges, (addr, float("inf"))) - 1
    return ranges[i] if i >= 0 and addr < ranges[i][0] + ranges[i][1] else None


def param_values(words: set[int], addresses: set[int], live: list[tuple[int, int]]) -> set[int]:
    """The in-region kernel-parameter words that are numbers, not addresses: those no live region memory backs at
    SAVE. A graph can only dereference memory that is live when SAVE reads it, and LOAD writes every parameter byte
    back as saved, so such a word replays the same whether it is a number or a dangling pointer. FlashAttention-3's
    kernels, for one, pass two 32-bit numbers that read as an in-region address (0x501a00000001 at SGLang's decode
    batch 256, 2026-11-30). A memset or memcpy address (`addresses`) is always an address and never a number."""
    return {w for w in words - addresses if find_range(live, w) is None}


def pointer_phases(pointers: Iterable[int], saved: Sequence[Phase], evs: Sequence[Event],
                   live: list[tuple[int, int]]) -> tuple[dict[str, int], list[tuple[int, str]]]:  # fmt: skip
    """SAVE: how many graph addresses lie in memory each phase made ("(capture)": capture-time memory), and those
    in a variable phase LOAD runs again. LOAD can prove such memory only by its extent (check_backed), not by what
    it holds: a variable phase lays out its allocations anew, and torch may place other tensors inside them."""
    owner = owners(saved, evs)
    variable = {p.name for p in saved if not p.exact and not p.skip_on_load}
    counts: dict[str, int] = {}
    risky: list[tuple[int, str]] = []
    live = sorted(live)
    for ptr in sorted(set(pointers)):
        rng = find_range(live, ptr)
        name = owner.get(rng[0], "(capture)") if rng else "(unbacked)"
        counts[name] = counts.get(name, 0) + 1
        if name in variable:
            risky.append((ptr, name))
    return counts, risky


def check_backed(pointers: Iterable[int], saved: Sequence[Phase], saved_evs: Sequence[Event],
                 live: list[tuple[int, int]], *, defer: Callable[[str], bool] | None = None,
                 what: str = "graph address") -> list[int]:  # fmt: skip
    """Every address graphs read must lie, after LOAD, in memory at its saved address with its saved size; a
    refusal names the address, the phase that made its memory and both extents. Addresses whose memory a phase
    for which `defer(name)` holds made (a post-capture phase not run yet) are returned instead, to check later."""
    saved_live = live_ranges(list(saved_evs))
    owner = owners(saved, saved_evs)
    live = sorted(live)
    later = []
    for p in sorted(set(pointers)):
        want = find_range(saved_live, p)
        if want is None:
            raise PhaseError(f"{what} {p:#x} is not in memory SAVE had live: the archive is inconsistent")
        phase = owner.get(want[0], "(capture)")
        if defer is not None and defer(phase):
            later.append(p)
            continue
        got = find_range(live, p)
        if got != want:
            live_txt = f"{got[0]:#x}+{got[1]}" if got else "not mapped"
            raise PhaseError(
                f"{what} {p:#x} (memory of phase {phase!r}): saved extent {want[0]:#x}+{want[1]}, live {live_txt}. "
                "A variable phase may not hold memory graphs read; make that phase exact or move the buffer to an "
                "exact phase: LOAD refused"
            )
    return later


def held_blocks(pointers: Iterable[int], segments: list[tuple[int, int]],
                blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:  # fmt: skip
    """The torch blocks (addr, size; from sorted, disjoint `blocks` inside torch's `segments`) holding graph
    addresses. Setup memory is proven at LOAD by its driver-level allocations, which say nothing about torch's
    blocks inside them: a tensor a graph reads that LOAD's setup did not recreate leaves its block free there, and
    any later tensor (an eager kernel's scratch between two piecewise graphs) may take it."""
    held = set()
    for p in pointers:
        if find_range(segments, p) is not None and (blk := find_range(blocks, p)) is not None:
            held.add(blk)
    return sorted(held)


def block_problems(saved: Iterable[Sequence[int]], live_blocks: list[tuple[int, int]],
                   segments: list[tuple[int, int]]) -> list[str]:  # fmt: skip
    """LOAD: each block SAVE's graphs read that lies in a torch segment at LOAD must be live again there, starting
    where it started and at least as large (torch keeps a remainder too small to split inside the block, so the same
    tensor may get a larger one). A block in no torch segment at LOAD lies in memory the runtime maps itself (a
    phase LOAD skips, e.g. autotuning): torch cannot hand it out, and check_backed proves it is mapped."""
    problems = []
    for addr, size in saved:
        if find_range(segments, addr) is None:
            continue
        got = find_range(live_blocks, addr)
        if got is not None and got[0] == addr and got[1] >= size:
            continue
        now = (
            f"inside live block {got[0]:#x}+{got[1]}"
            if got is not None
            else "free in torch's segment (no live tensor there)"
        )
        problems.append(f"{addr:#x}+{size}: {now}")
    return problems


def implicit_name(after: str) -> str:
    return f"(after {after})"


def legacy(setup_events: int, setup_cursor: int) -> list[Phase]:
    """The phases of an archive written before phases existed: its whole setup as one exact phase."""
    return [Phase(IMPLICIT_FIRST, implicit=True, start_event=0, end_event=setup_events, start=0, end=setup_cursor,
                  limit=setup_cursor)]  # fmt: skip
