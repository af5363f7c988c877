"""Phase-anchored layout and declared state (graphpersist.memory.phases, graphpersist.memory.state) on synthetic event logs.

A small bump allocator stands in for the interposer: it places allocations at a cursor and logs `region.Event`
records exactly as the native log does, and the recorder moves its cursor where the runtime would move the
native one. SAVE and LOAD are two runs of the same "engine" code over two such allocators.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable

import pytest

from graphpersist.memory import phases, region, state
from graphpersist.memory.phases import Phase, PhaseError, Recorder
from graphpersist.memory.region import Event

BASE = 0x500000000000
GRAN = 2 << 20
MIB = 1 << 20


class Bump:
    """The interposer's placement and log, in Python: deterministic addresses from the allocation sequence."""

    def __init__(self) -> None:
        self.evs: list[Event] = []
        self.cursor = 0

    def log(self, kind: str, addr: int, size: int, req: int) -> int:
        self.evs.append(Event(len(self.evs), kind, addr, size, req))
        return addr

    def alloc(self, req: int, kind: str = "alloc") -> int:
        size = phases.round_up(req, GRAN)
        addr = BASE + self.cursor
        self.cursor += size
        return self.log(kind, addr, size, req)

    def free(self, addr: int) -> None:
        self.log("free", addr, 0, 0)

    def move(self, target: int) -> None:
        assert target >= self.cursor, "the native control refuses to move the cursor backwards"
        self.cursor = target

    def begin(self, rec: Recorder, name: str, **kw: object) -> None:
        self.move(rec.begin(name, self.evs, self.cursor, GRAN, **kw))  # type: ignore[arg-type]

    def end(self, rec: Recorder) -> None:
        self.move(rec.end(self.evs, self.cursor, GRAN))

    def finish_setup(self, rec: Recorder) -> None:
        self.move(rec.finish_setup(self.evs, self.cursor, GRAN))


Engine = Callable[[Bump, Recorder], dict[str, int]]


def saved_run(engine: Engine) -> tuple[Bump, Recorder, dict[str, int]]:
    mem, rec = Bump(), Recorder()
    out = engine(mem, rec)
    return mem, rec, out


def load_run(engine: Engine, saved: Recorder, saved_mem: Bump) -> tuple[Bump, Recorder, dict[str, int]]:
    """LOAD: a fresh allocator, the archive's phases (through JSON, as the archive stores them)."""
    back = [Phase.from_json(p.to_json()) for p in saved.phases]
    mem, rec = Bump(), Recorder(saved=back, saved_events=list(saved_mem.evs))
    out = engine(mem, rec)
    return mem, rec, out


def engine_with(profile_allocs: int, *, loading: bool = False, kv_req: int = 64 * MIB) -> Engine:
    """weights (exact) -> profile (variable, `profile_allocs` scratch buffers, freed) -> kv (exact) -> setup done
    -> capture allocations (SAVE only)."""

    def run(mem: Bump, rec: Recorder) -> dict[str, int]:
        mem.alloc(4 * MIB)  # the CUDA context's first allocation, before any phase
        mem.begin(rec, "weights")
        w = mem.alloc(100 * MIB)
        mem.end(rec)
        mem.begin(rec, "profile", exact=False, headroom=64 * MIB)
        scratch = [mem.alloc(8 * MIB) for _ in range(profile_allocs)]
        for a in scratch:
            mem.free(a)
        mem.end(rec)
        mem.begin(rec, "kv")
        kv = mem.alloc(kv_req)
        mem.end(rec)
        mem.finish_setup(rec)
        out = {"weights": w, "kv": kv}
        if not loading:
            out["pool"] = mem.alloc(32 * MIB)  # capture pool: mapped from the archive at LOAD
        return out

    return run


def test_variable_phase_allocating_less_keeps_the_next_anchor() -> None:
    smem, srec, sout = saved_run(engine_with(5))
    prof = next(p for p in srec.phases if p.name == "profile")
    assert prof.limit - prof.end == 64 * MIB  # SAVE left the requested headroom after the variable phase
    kv = next(p for p in srec.phases if p.name == "kv")
    assert kv.start == prof.limit
    lmem, lrec, lout = load_run(engine_with(2, loading=True), srec, smem)
    assert lout["kv"] == sout["kv"] and lout["weights"] == sout["weights"]
    assert [p.name for p in lrec.phases] == [p.name for p in srec.phases]
    assert phases.compare_setup(srec.phases, smem.evs, lrec.phases, lmem.evs) == []
    # LOAD maps only the capture pool, at its saved address
    assert phases.restore_ranges(srec.phases, smem.evs, lmem.evs, []) == [(sout["pool"], 32 * MIB)]


def test_variable_phase_allocating_more_than_the_headroom_is_refused() -> None:
    smem, srec, _ = saved_run(engine_with(2))
    with pytest.raises(PhaseError, match=r"phase 'profile' overran at LOAD.*more headroom") as exc:
        load_run(engine_with(2 + 9, loading=True), srec, smem)  # 9 x 8 MiB more than SAVE > 64 MiB headroom
    assert "limit" in str(exc.value)


def test_variable_phase_within_the_headroom_passes() -> None:
    smem, srec, sout = saved_run(engine_with(2))
    _, _, lout = load_run(engine_with(2 + 8, loading=True), srec, smem)  # exactly 64 MiB more
    assert lout["kv"] == sout["kv"]


def test_default_headroom_is_at_least_the_phase_and_one_gib() -> None:
    assert phases.headroom_for(10 * MIB, None, GRAN) == 1 << 30
    assert phases.headroom_for(3 << 30, None, GRAN) == 3 << 30
    assert phases.headroom_for(3 * MIB, 3 * MIB, GRAN) == 4 * MIB  # rounded up to the granularity
    with pytest.raises(PhaseError, match="headroom must be >= 0"):
        phases.headroom_for(0, -1, GRAN)


def test_exact_phase_that_differs_is_refused_naming_the_event() -> None:
    smem, srec, _ = saved_run(engine_with(3))
    with pytest.raises(PhaseError, match=r"phase 'kv' \(exact\): event 0 differs: saved alloc of 67108864 bytes "
                                         r".* live alloc of 67110912 bytes"):  # fmt: skip
        load_run(engine_with(3, loading=True, kv_req=64 * MIB + 2048), srec, smem)


def test_exact_phase_with_an_extra_event_is_refused() -> None:
    smem, srec, _ = saved_run(engine_with(3))

    def extra(mem: Bump, rec: Recorder) -> dict[str, int]:
        mem.alloc(4 * MIB)
        mem.begin(rec, "weights")
        mem.alloc(100 * MIB)
        mem.alloc(MIB)
        mem.end(rec)
        return {}

    with pytest.raises(PhaseError, match=r"phase 'weights' \(exact\): SAVE recorded 1 events, LOAD made 2; first "
                                         r"unmatched: LOAD made alloc of 1048576 bytes"):  # fmt: skip
        load_run(extra, srec, smem)


def capture_only_engine(loading: bool) -> Engine:
    """weights -> warmup (skip_on_load: compile/autotune scratch that graphs keep reading) -> kv."""

    def run(mem: Bump, rec: Recorder) -> dict[str, int]:
        mem.begin(rec, "weights")
        w = mem.alloc(10 * MIB)
        mem.end(rec)
        out = {"weights": w}
        if not loading:
            mem.begin(rec, "warmup", exact=False, skip_on_load=True, headroom=0)
            out["workspace"] = mem.alloc(6 * MIB)
            tmp = mem.alloc(2 * MIB)
            mem.free(tmp)
            mem.end(rec)
        mem.begin(rec, "kv")
        out["kv"] = mem.alloc(20 * MIB)
        mem.end(rec)
        mem.finish_setup(rec)
        return out

    return run


def test_skipped_capture_only_phase_is_mapped_from_the_archive() -> None:
    smem, srec, sout = saved_run(capture_only_engine(False))
    lmem, lrec, lout = load_run(capture_only_engine(True), srec, smem)
    assert lrec.skipped == ["warmup"]
    assert lout["kv"] == sout["kv"]  # kv anchored past the phase LOAD did not run
    assert phases.compare_setup(srec.phases, smem.evs, lrec.phases, lmem.evs) == ["warmup"]
    ranges = phases.restore_ranges(srec.phases, smem.evs, lmem.evs, lrec.skipped)
    assert ranges == [(sout["workspace"], 6 * MIB)]  # the freed temporary is not mapped
    # graphs read the workspace: backed at its saved extent once LOAD mapped it
    live = phases.live_ranges(lmem.evs) + ranges
    assert phases.check_backed([sout["workspace"] + 64, sout["kv"]], srec.phases, smem.evs, live) == []


def test_a_phase_that_may_not_be_skipped_is_refused_when_missing() -> None:
    smem, srec, _ = saved_run(engine_with(1))

    def no_profile(mem: Bump, rec: Recorder) -> dict[str, int]:
        mem.alloc(4 * MIB)
        mem.begin(rec, "weights")
        mem.alloc(100 * MIB)
        mem.end(rec)
        mem.begin(rec, "kv")
        return {}

    with pytest.raises(PhaseError, match=r"phase 'kv' begins at LOAD where SAVE ran phase 'profile' \(variable\)"):
        load_run(no_profile, srec, smem)


def test_skip_on_load_phase_with_an_ipc_open_is_a_save_problem() -> None:
    mem, rec = Bump(), Recorder()
    mem.begin(rec, "comm", skip_on_load=True)
    mem.alloc(2 * MIB, kind="ipc_open")
    mem.finish_setup(rec)
    assert phases.skip_problems(rec.phases, mem.evs) == [f"phase 'comm': ipc_open of {2 * MIB} bytes "
                                                         f"({2 * MIB} mapped) at {BASE:#x}"]  # fmt: skip


def test_graph_pointer_not_backed_after_load_is_refused() -> None:
    """A graph reading memory of a variable phase: LOAD's phase allocated differently, so the extent differs."""

    def engine(n: int) -> Engine:
        def run(mem: Bump, rec: Recorder) -> dict[str, int]:
            mem.begin(rec, "profile", exact=False, headroom=32 * MIB)
            bufs = [mem.alloc((i + 1) * 4 * MIB) for i in range(n)]
            mem.end(rec)
            mem.finish_setup(rec)
            return {"last": bufs[-1]}

        return run

    smem, srec, sout = saved_run(engine(3))  # 4, 8, 12 MiB
    lmem, _, _ = load_run(engine(2), srec, smem)  # 4, 8 MiB: the 12 MiB buffer does not exist
    live = phases.live_ranges(lmem.evs)
    ptr = sout["last"] + 128
    with pytest.raises(PhaseError, match=rf"graph address {ptr:#x} \(memory of phase 'profile'\): saved extent "
                                         rf"{sout['last']:#x}\+{12 * MIB}, live not mapped"):  # fmt: skip
        phases.check_backed([ptr], srec.phases, smem.evs, live)
    with pytest.raises(PhaseError, match=rf"graph address {BASE + 50 * MIB:#x} is not in memory SAVE had live"):
        phases.check_backed([BASE + 50 * MIB], srec.phases, smem.evs, live)


def test_graph_pointer_with_a_different_extent_is_refused() -> None:
    evs_s = [Event(0, "alloc", BASE, 8 * MIB, 8 * MIB)]
    saved = [Phase("(setup)", implicit=True, start_event=0, end_event=1, start=0, end=8 * MIB, limit=8 * MIB)]
    with pytest.raises(PhaseError, match=rf"graph address {BASE + 16:#x} \(memory of phase '\(setup\)'\): saved "
                                         rf"extent {BASE:#x}\+{8 * MIB}, live {BASE:#x}\+{4 * MIB}"):  # fmt: skip
        phases.check_backed([BASE + 16], saved, evs_s, [(BASE, 4 * MIB)])


def post_capture_engine(peer_offset: int, loading: bool) -> Engine:
    """setup (comm buffers) -> capture -> post_capture: open two peers' graph buffers (custom all-reduce's
    registration); at LOAD the capture-time pool is mapped by the runtime before the post-capture phase."""

    def run(mem: Bump, rec: Recorder) -> dict[str, int]:
        mem.begin(rec, "comm")
        rank_data = mem.alloc(2 * MIB)
        mem.end(rec)
        mem.finish_setup(rec)
        if loading:  # api.load(): capture ranges mapped, cursor moved to the first post-capture anchor
            mem.move(rec.remaining_saved()[0].start)
        else:
            mem.alloc(16 * MIB)  # capture pool
        mem.begin(rec, "post_capture")
        mem.alloc(peer_offset)  # an allocation that differs between runs shifts the IPC opens after it
        opened = [mem.alloc(4 * MIB, kind="ipc_open"), mem.alloc(4 * MIB, kind="ipc_open")]
        mem.end(rec)
        return {"rank_data": rank_data, "peer0": opened[0], "peer1": opened[1]}

    return run


def test_post_capture_ipc_open_at_the_saved_address_passes() -> None:
    smem, srec, sout = saved_run(post_capture_engine(2 * MIB, False))
    post = srec.phases[-1]
    assert post.name == "post_capture" and post.post_capture
    assert phases.late_mappings(smem.evs, post.start_event, srec.phases) == []
    _, _, lout = load_run(post_capture_engine(2 * MIB, True), srec, smem)
    assert lout == sout


def test_post_capture_ipc_open_at_a_different_address_is_refused() -> None:
    smem, srec, _ = saved_run(post_capture_engine(2 * MIB, False))
    with pytest.raises(PhaseError, match=r"phase 'post_capture' \(exact, post_capture\): event 0 differs"):
        load_run(post_capture_engine(4 * MIB, True), srec, smem)


def test_allocation_after_the_post_capture_phase_outside_a_phase_is_refused() -> None:
    mem, rec = Bump(), Recorder()
    mem.finish_setup(rec)
    mem.alloc(MIB)  # capture: fine, mapped from the archive before the post-capture phase re-runs
    mem.begin(rec, "post_capture")
    mem.alloc(MIB, kind="ipc_open")
    mem.end(rec)
    late = mem.alloc(MIB)  # would be mapped where LOAD's post-capture phase allocates again
    assert [e.addr for e in phases.after_post_problems(rec.phases, mem.evs)] == [late]
    with pytest.raises(PhaseError, match=rf"alloc of {MIB} bytes .* at {late:#x} happened at SAVE after a "
                                         "post-capture phase began"):  # fmt: skip
        phases.restore_ranges(rec.phases, mem.evs, mem.evs[:0], [])


def test_variable_post_capture_phase_still_pins_its_ipc_opens() -> None:
    def engine(extra: int, loading: bool) -> Engine:
        def run(mem: Bump, rec: Recorder) -> dict[str, int]:
            mem.finish_setup(rec)
            if loading:
                mem.move(rec.remaining_saved()[0].start)
            mem.begin(rec, "post_capture", exact=False, headroom=8 * MIB)
            mem.alloc(extra)
            mem.alloc(4 * MIB, kind="ipc_open")
            mem.end(rec)
            return {}

        return run

    smem, srec, _ = saved_run(engine(2 * MIB, False))
    want = rf"mapping event \(IPC open / reservation\) 0 differs: saved ipc_open .* at {BASE + 2 * MIB:#x}, live "
    with pytest.raises(PhaseError, match=want + rf"ipc_open .* at {BASE + 4 * MIB:#x}"):
        load_run(engine(4 * MIB, True), srec, smem)


def test_mappings_after_setup_outside_a_declared_phase_are_late() -> None:
    mem, rec = Bump(), Recorder()
    mem.alloc(MIB)
    mem.finish_setup(rec)
    setup_n = len(mem.evs)
    mem.alloc(MIB)
    opened = mem.alloc(MIB, kind="ipc_open")
    mem.begin(rec, "post_capture")
    mem.alloc(MIB, kind="ipc_open")
    mem.end(rec)
    late = phases.late_mappings(mem.evs, setup_n, rec.phases)
    assert [e.addr for e in late] == [opened]


def test_mark_setup_alone_is_one_exact_phase() -> None:
    def run(mem: Bump, rec: Recorder) -> dict[str, int]:
        mem.alloc(MIB)
        mem.alloc(3 * MIB)
        mem.finish_setup(rec)
        return {}

    smem, srec, _ = saved_run(run)
    assert [(p.name, p.exact, p.start_event, p.end_event) for p in srec.phases] == [("(setup)", True, 0, 2)]
    lmem, lrec, _ = load_run(run, srec, smem)
    assert phases.compare_setup(srec.phases, smem.evs, lrec.phases, lmem.evs) == []


def test_load_without_anchoring_is_compared_after_the_fact() -> None:
    """A LOAD process that did not call use_layout records its phases SAVE-style; compare_setup still refuses."""
    smem, srec, _ = saved_run(engine_with(4))
    lmem, lrec, _ = saved_run(engine_with(1, loading=True))
    kv_s = next(p for p in srec.phases if p.name == "kv").start
    kv_l = next(p for p in lrec.phases if p.name == "kv").start
    assert kv_l < kv_s  # the shorter unanchored profile phase shifted everything after it
    with pytest.raises(PhaseError, match=rf"phase 'kv' started at offset {kv_l:#x} at LOAD, {kv_s:#x} at SAVE.*"
                                         "use_layout"):  # fmt: skip
        phases.compare_setup(srec.phases, smem.evs, lrec.phases, lmem.evs)


def test_allocating_between_phases_where_save_did_not_is_refused() -> None:
    def run(gap: bool) -> Engine:
        def go(mem: Bump, rec: Recorder) -> dict[str, int]:
            mem.begin(rec, "a")
            mem.alloc(MIB)
            mem.end(rec)
            if gap:
                mem.alloc(MIB)
            mem.begin(rec, "b")
            mem.alloc(MIB)
            mem.finish_setup(rec)
            return {}

        return go

    smem, srec, _ = saved_run(run(False))
    assert [p.name for p in srec.phases] == ["a", "b"]  # the empty "(after a)" is dropped
    with pytest.raises(PhaseError, match=r"LOAD allocated between phases where SAVE did not \(\(after a\)\)"):
        load_run(run(True), srec, smem)


def test_phase_misuse_is_refused() -> None:
    mem, rec = Bump(), Recorder()
    mem.begin(rec, "a")
    with pytest.raises(PhaseError, match="used twice"):
        mem.begin(rec, "a")
    with pytest.raises(PhaseError, match="headroom and span are for variable phases"):
        mem.begin(rec, "b", headroom=MIB)
    with pytest.raises(PhaseError, match="names must be non-empty"):
        mem.begin(rec, "(x)")
    mem.finish_setup(rec)
    with pytest.raises(PhaseError, match="post-capture phase cannot be skipped"):
        mem.begin(rec, "c", skip_on_load=True)
    with pytest.raises(PhaseError, match="no named phase is open"):
        mem.end(rec)


# ------------------------------------------------------------------------------------------- state


def device(size: int = 64) -> tuple[dict[int, bytearray], Callable[[int, int], bytes], Callable[[int, bytes], None]]:
    mem = {BASE: bytearray(size)}

    def read(addr: int, n: int) -> bytes:
        return bytes(mem[BASE][addr - BASE : addr - BASE + n])

    def write(addr: int, data: bytes) -> None:
        mem[BASE][addr - BASE : addr - BASE + len(data)] = data

    return mem, read, write


def test_state_bytes_are_written_back_and_recreated_state_verified() -> None:
    _, read, write = device()
    write(BASE, b"\x01" * 16)
    write(BASE + 16, b"\x02" * 16)
    table: dict[str, state.Declared] = {}
    state.declare(table, state.Declared("rank_data", BASE, 16, "bytes"))
    state.declare(table, state.Declared("peer_ptrs", BASE + 16, 16, "recreated", phase="post_capture"))
    recs = [state.record(d, read(d.addr, d.nbytes), file="state/x.bin") for d in table.values()]
    assert recs[1].file is None and recs[0].file == "state/x.bin"
    recs = [state.StateRecord.from_json(r.to_json()) for r in recs]

    _, read2, write2 = device()  # LOAD: fresh memory, the engine re-created peer_ptrs
    write2(BASE + 16, b"\x02" * 16)
    state.check_declarations(recs, table)
    assert state.restore(recs, lambda r: b"\x01" * 16, write2, read2) == ["rank_data", "peer_ptrs"]
    assert read2(BASE, 16) == b"\x01" * 16


def test_state_mismatch_is_refused_naming_buffer_address_and_hashes() -> None:
    _, read, write = device()
    write(BASE + 16, b"\x02" * 16)
    d = state.Declared("peer_ptrs", BASE + 16, 16, "recreated")
    rec = state.record(d, read(d.addr, 16))
    _, read2, write2 = device()
    write2(BASE + 16, b"\x03" * 16)
    live = state.sha256(b"\x03" * 16)
    want = rf"state 'peer_ptrs' \(recreated\) at {BASE + 16:#x}\+16: content re-created at LOAD hashes {live}, "
    with pytest.raises(state.StateError, match=want + rf"SAVE's hashed {rec.sha256}"):
        state.restore([rec], lambda r: b"", write2, read2)


def test_state_bytes_payload_that_does_not_match_is_refused() -> None:
    _, read, write = device()
    write(BASE, b"\x05" * 8)
    rec = state.record(state.Declared("planner", BASE, 8, "bytes"), read(BASE, 8), file="f")
    _, read2, write2 = device()
    with pytest.raises(state.StateError, match=r"state 'planner' .* payload hashes .* the archive is damaged"):
        state.restore([rec], lambda r: b"\x06" * 8, write2, read2)
    assert read2(BASE, 8) == b"\x00" * 8  # nothing written


def test_state_declarations_must_match() -> None:
    rec = state.StateRecord("rank_data", BASE, 16, "bytes", "0" * 64)
    with pytest.raises(state.StateError, match=r"'rank_data': saved bytes .*\+16, live recreated .*\+16"):
        state.check_declarations([rec], {"rank_data": state.Declared("rank_data", BASE, 16, "recreated")})
    with pytest.raises(state.StateError, match=r"declared at SAVE, not at LOAD"):
        state.check_declarations([rec], {})
    with pytest.raises(state.StateError, match=r"'x' .* is declared at LOAD but not at SAVE"):
        state.check_declarations([], {"x": state.Declared("x", BASE, 1, "bytes")})
    table: dict[str, state.Declared] = {}
    state.declare(table, state.Declared("a", BASE, 16, "bytes"))
    with pytest.raises(state.StateError, match="overlaps state 'a'"):
        state.declare(table, state.Declared("b", BASE + 8, 16, "bytes"))
    with pytest.raises(state.StateError, match="how='copy'"):
        state.Declared("c", BASE, 1, "copy")


# ------------------------------------------------------------------------------------------- archives without phases


def _evs(*items: tuple[str, int, int]) -> list[Event]:
    return [Event(i, k, a, s, s) for i, (k, a, s) in enumerate(items)]


def test_legacy_setup_compares_requested_sizes() -> None:
    """Two setups can map the same rounded size from different requests: that is drift too."""
    saved = [Event(0, "alloc", 0x1000, 0x200000, 1000)]
    live_rec = Recorder()
    live_rec.finish_setup([Event(0, "alloc", 0x1000, 0x200000, 2000)], 0x200000, GRAN)
    with pytest.raises(PhaseError, match=r"saved alloc of 1000 bytes .* live alloc of 2000 bytes"):
        phases.compare_setup(phases.legacy(1, 0x200000), saved, live_rec.phases,
                             [Event(0, "alloc", 0x1000, 0x200000, 2000)])  # fmt: skip


def test_legacy_archive_maps_capture_time_allocations_and_refuses_late_reservations() -> None:
    saved = _evs(("alloc", 0x1000, 0x100), ("alloc", 0x1100, 0x100), ("alloc", 0x1200, 0x100),
                 ("free", 0x1100, 0x100), ("alloc", 0x1300, 0x200))  # fmt: skip
    old = phases.legacy(2, 0x200)
    rec = Recorder()
    rec.finish_setup(saved[:2], 0x200, 0x100)
    assert phases.compare_setup(old, saved, rec.phases, saved[:2]) == []
    assert phases.restore_ranges(old, saved, saved[:2], []) == [(0x1200, 0x100), (0x1300, 0x200)]
    with pytest.raises(PhaseError, match=r"phase '\(setup\)' \(exact\): SAVE recorded 2 events, LOAD made 1"):
        short = Recorder()
        short.finish_setup(saved[:1], 0x100, 0x100)
        phases.compare_setup(old, saved, short.phases, saved[:1])
    reserved = [*saved[:2], Event(2, "reserve", 0x1200, 0x100, 0x100)]
    with pytest.raises(PhaseError, match=r"capture-time reserve of 256 bytes .* is not restorable"):
        phases.restore_ranges(old, reserved, saved[:2], [])
    evs = [Event(0, "alloc", 0x1000, 0x100, 1), Event(1, "reserve", 0x2000, 0x100, 1),
           Event(2, "alloc", 0x3000, 0x100, 1), Event(3, "free", 0x1000, 0x100, 0),
           Event(4, "ipc_open", 0x4000, 0x200, 0x200), Event(5, "reserve", 0x5000, 0x100, 1)]  # fmt: skip
    assert phases.late_mappings(evs, 2, []) == [evs[4], evs[5]]  # the setup reservation (seq 1) is fine
    assert phases.late_mappings(evs, 6, []) == []


# ------------------------------------------------------------------------------------------- native bookkeeping


class _Log(ctypes.Structure):
    _fields_ = [("ev", ctypes.c_void_p), ("n", ctypes.c_size_t), ("cap", ctypes.c_size_t),
                ("next_seq", ctypes.c_uint64)]  # fmt: skip


class _Free(ctypes.Structure):
    _fields_ = [("r", ctypes.c_void_p), ("n", ctypes.c_size_t), ("cap", ctypes.c_size_t)]


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    out = tmp_path_factory.mktemp("gpcore") / "libgpcore_phases.so"
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    str(region.NATIVE_DIR / "gp_core.c")], check=True)  # fmt: skip
    lib = ctypes.CDLL(str(out))
    lib.gp_log_append.restype = ctypes.c_uint64
    lib.gp_log_append.argtypes = [ctypes.POINTER(_Log), ctypes.c_uint32] + [ctypes.c_uint64] * 3
    lib.gp_log_live_overlapping.restype = ctypes.c_long
    lib.gp_log_live_overlapping.argtypes = [ctypes.POINTER(_Log), ctypes.c_uint64, ctypes.c_uint64]
    lib.gp_free_add.argtypes = [ctypes.POINTER(_Free), ctypes.c_uint64, ctypes.c_uint64]
    lib.gp_free_overlaps.argtypes = [ctypes.POINTER(_Free), ctypes.c_uint64, ctypes.c_uint64]
    return lib


def test_native_live_overlap_finds_what_a_cursor_move_would_run_into(core: ctypes.CDLL) -> None:
    """gp_set_cursor refuses an anchor with live memory at or above it; gp_restore a range on live memory."""
    log = _Log()
    kinds = {v: k for k, v in region.EVENT_KINDS.items()}
    core.gp_log_append(ctypes.byref(log), kinds["alloc"], 0x1000, 0x100, 0x100)  # 0
    core.gp_log_append(ctypes.byref(log), kinds["map_fixed"], 0x3000, 0x100, 0x100)  # 1: restored above
    core.gp_log_append(ctypes.byref(log), kinds["ipc_open"], 0x5000, 0x200, 0x200)  # 2
    core.gp_log_append(ctypes.byref(log), kinds["free"], 0x1000, 0, 0)  # 3: frees 0
    core.gp_log_append(ctypes.byref(log), kinds["ipc_close"], 0x5000, 0, 0)  # 4: closes 2
    assert core.gp_log_live_overlapping(ctypes.byref(log), 0x1000, 0x2000) == -1  # freed
    assert core.gp_log_live_overlapping(ctypes.byref(log), 0x2000, 0x10000) == 1
    assert core.gp_log_live_overlapping(ctypes.byref(log), 0x30FF, 0x3100) == 1  # last byte overlaps
    assert core.gp_log_live_overlapping(ctypes.byref(log), 0x3100, 0x10000) == -1  # closed IPC mapping
    core.gp_log_append(ctypes.byref(log), kinds["reserve"], 0x8000, 0x1000, 0x1000)
    assert core.gp_log_live_overlapping(ctypes.byref(log), 0x3100, 0x10000) == 5
    free = _Free()
    assert core.gp_free_add(ctypes.byref(free), 0x1000, 0x100) == 0
    assert core.gp_free_overlaps(ctypes.byref(free), 0x10FF, 0x10) == 1
    assert core.gp_free_overlaps(ctypes.byref(free), 0x1100, 0x10) == 0


def test_range_mapped_from_the_archive_over_live_memory_is_refused() -> None:
    saved = _evs(("alloc", BASE, 2 * MIB), ("alloc", BASE + 2 * MIB, 4 * MIB))
    old = phases.legacy(1, 2 * MIB)
    live = _evs(("alloc", BASE, 2 * MIB), ("alloc", BASE + 2 * MIB, 2 * MIB))  # LOAD allocated there already
    want = rf"range {BASE + 2 * MIB:#x}\+{4 * MIB} that LOAD maps from the archive \(made by \(capture\) at SAVE\) "
    with pytest.raises(PhaseError, match=want + "overlaps memory LOAD already has"):
        phases.restore_ranges(old, saved, live, [])


def test_span_fixes_the_next_anchor_whatever_the_phase_used() -> None:
    """A cold and a warm SAVE of a variable phase with a span put the next phase at the same anchor."""
    gib = 1 << 30
    anchors = []
    for used in (3 * gib, 7 * gib):
        rec = phases.Recorder()
        rec.begin("compile", [], 0, 2 << 20, exact=False, span=16 * gib)
        anchors.append(rec.begin("kv", [], used, 2 << 20))
    assert anchors == [16 * gib, 16 * gib]


def test_span_overrun_refuses_save_naming_the_phase() -> None:
    rec = phases.Recorder()
    rec.begin("compile", [], 0, 2 << 20, exact=False, span=1 << 30)
    with pytest.raises(phases.PhaseError, match=r"phase 'compile' used 3221225472 bytes .* more than its span"):
        rec.begin("kv", [], 3 << 30, 2 << 20)


def test_span_is_for_variable_phases_only() -> None:
    rec = phases.Recorder()
    with pytest.raises(phases.PhaseError, match="headroom and span are for variable phases"):
        rec.begin("weights", [], 0, 2 << 20, span=1 << 30)


def test_param_values_are_unbacked_kernel_words_never_memset_or_memcpy_addresses() -> None:
    """SGLang's FA3 decode kernels pass two 32-bit numbers that read as an in-region address (0x501a00000001):
    a kernel-parameter word no live memory backs is a number; an unbacked memset/memcpy address stays an address
    (check_ownership then refuses it)."""
    live = [(0x5000_0000_0000, 1 << 20), (0x5000_1000_0000, 4096)]
    backed, number, dangling_copy = 0x5000_0000_0100, 0x501A_0000_0001, 0x5000_2000_0000
    words = {backed, number, dangling_copy, 0x5000_1000_0FFF}
    assert phases.param_values(words, {dangling_copy}, live) == {number}
    assert phases.param_values(words, set(), live) == {number, dangling_copy}
    assert phases.param_values(set(), set(), live) == set()


def test_pointer_phases_counts_graph_addresses_by_the_phase_that_made_their_memory() -> None:
    """A graph address in a variable phase LOAD runs again is named (LOAD can prove only that memory's extent);
    addresses in exact phases and in capture-time memory are counted, not named."""

    def engine(mem: Bump, rec: Recorder) -> dict[str, int]:
        mem.begin(rec, "weights")
        w = mem.alloc(100 * MIB)
        mem.end(rec)
        mem.begin(rec, "profile", exact=False, headroom=64 * MIB)
        kept = mem.alloc(8 * MIB)  # e.g. a buffer the profile run leaves alive
        mem.end(rec)
        mem.finish_setup(rec)
        return {"weights": w, "kept": kept, "pool": mem.alloc(32 * MIB)}

    smem, srec, out = saved_run(engine)
    live = region.live_ranges(smem.evs)
    ptrs = [out["weights"] + 16, out["weights"] + 4096, out["kept"] + 8, out["pool"], BASE - 4096]
    counts, risky = phases.pointer_phases(ptrs, srec.phases, smem.evs, live)
    assert counts == {"weights": 2, "profile": 1, "(capture)": 1, "(unbacked)": 1}
    assert risky == [(out["kept"] + 8, "profile")]
