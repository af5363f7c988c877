"""graphpersist.memory.layout (begin_phase / phase / use_layout / declare_state / verify_state), end to end on CPU.

The interposer is hardware-facing, so a Python bump allocator stands in for its control surface (events, region
info, the locked cursor move, freeze) and for device memory reads and writes; the archive is a real one
(ArchiveWriter + open_archive), so use_layout reads the phases exactly as SAVE wrote them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from archive_fixtures import device, world

from graphpersist import run
from graphpersist.archive import ArchiveWriter, open_archive
from graphpersist.errors import PersistError
from graphpersist.memory import layout, phases, region

BASE = 0x500000000000
GRAN = 2 << 20
MIB = 1 << 20


class FakeInterposer:
    """The interposer's bookkeeping as region.py sees it: events, info, gp_set_cursor's refusals, freeze."""

    def __init__(self) -> None:
        self.evs: list[region.Event] = []
        self.cursor = 0
        self.frozen = False
        self.memory: dict[int, bytes] = {}

    def alloc(self, req: int, kind: str = "alloc") -> int:
        size = phases.round_up(req, GRAN)
        addr = BASE + self.cursor
        self.cursor += size
        self.evs.append(region.Event(len(self.evs), kind, addr, size, req))
        return addr

    def free(self, addr: int) -> None:
        self.evs.append(region.Event(len(self.evs), "free", addr, 0, 0))

    def events(self) -> list[region.Event]:
        return list(self.evs)

    def info(self) -> region.RegionInfo:
        return region.RegionInfo(BASE, 1 << 40, self.cursor, GRAN, True, False, len(self.evs), 0)

    def set_cursor(self, offset: int, expect_events: int) -> None:
        if expect_events != len(self.evs):
            raise region.RegionError("an allocation happened while the cursor was being moved")
        if offset < self.cursor:
            raise region.RegionError(f"cannot move the cursor back from offset {self.cursor:#x} to {offset:#x}")
        self.cursor = offset

    def freeze(self) -> None:
        self.frozen = True

    def read(self, addr: int, n: int) -> bytes:
        return self.memory.get(addr, bytes(n))[:n]

    def write(self, addr: int, data: bytes) -> None:
        self.memory[addr] = bytes(data)


class Processes:
    """Each call to `start()` is a new process: a fresh interposer and no phases yet."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def start(self) -> FakeInterposer:
        fake = FakeInterposer()
        for name in ("events", "info", "set_cursor", "freeze"):
            self.monkeypatch.setattr(region, name, getattr(fake, name))
        self.monkeypatch.setattr(layout, "read_bytes", fake.read)
        self.monkeypatch.setattr(layout, "write_bytes", fake.write)
        run.fresh()
        return fake


@pytest.fixture
def procs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Processes]:
    yield Processes(monkeypatch)
    run.fresh()


def engine(gpu: FakeInterposer, n_profile: int, *, loading: bool) -> dict[str, int]:
    """weights -> profile (variable) -> kv, then mark_setup; SAVE captures (a pool allocation)."""
    out = {}
    with layout.phase("weights"):
        out["weights"] = gpu.alloc(100 * MIB)
    with layout.phase("profile", exact=False, headroom=32 * MIB):
        scratch = [gpu.alloc(8 * MIB) for _ in range(n_profile)]
        for a in scratch:
            gpu.free(a)
    with layout.phase("kv"):
        out["kv"] = gpu.alloc(64 * MIB)
    layout.finish_setup()
    if not loading:
        out["pool"] = gpu.alloc(16 * MIB)
    return out


def post_capture(gpu: FakeInterposer, *, extra: bool = False) -> int:
    with layout.phase("post_capture"):
        if extra:
            gpu.alloc(2 * MIB)
        return gpu.alloc(4 * MIB, kind="ipc_open")


def write_archive(root: Path, gpu: FakeInterposer, states: list[dict]) -> None:
    single = {"parallel.world_size": 1, "parallel.tp_size": 1}
    with ArchiveWriter(root, world(**single)) as w:
        w.add_json(0, "alloc_log.json", [[e.kind, e.addr, e.size, e.req] for e in gpu.evs])
        w.set_rank_facts(0, {
            "device": device(0),
            "region": {"base": BASE, "size": 1 << 40, "final_offset": gpu.cursor},
            "pointers": {"fingerprint": "0" * 64, "count": 0}, "graphs": [], "images": [],
            "extra": {"setup_events": 0, "setup_cursor": 0, "granularity": GRAN,
                      "phases": [p.to_json() for p in layout.recorder().phases], "state": states},
        })  # fmt: skip
        w.commit()


def test_save_then_load_anchors_each_phase(procs: Processes, tmp_path: Path) -> None:
    gpu = procs.start()
    saved = engine(gpu, 4, loading=False)
    peer = post_capture(gpu)
    layout.close_open()
    recorded = list(layout.recorder().phases)
    assert [p.name for p in recorded] == ["weights", "profile", "kv", "post_capture"]
    prof = recorded[1]
    assert prof.limit == prof.end + 32 * MIB and recorded[2].start == prof.limit  # headroom left after profile
    write_archive(tmp_path / "a", gpu, [])
    save_evs = gpu.evs

    fresh = procs.start()  # LOAD: a new process
    assert layout.use_layout(tmp_path / "a") == ["weights", "profile", "kv", "post_capture"]
    loaded = engine(fresh, 1, loading=True)
    assert loaded["kv"] == saved["kv"] and loaded["weights"] == saved["weights"]
    saved_phases = [phases.Phase.from_json(p.to_json()) for p in recorded]
    assert phases.compare_setup(saved_phases, save_evs, layout.recorder().phases, fresh.evs) == []
    ranges = phases.restore_ranges(saved_phases, save_evs, fresh.evs, [])
    assert ranges == [(saved["pool"], 16 * MIB)]
    fresh.cursor = recorded[3].start  # what gp_restore does: the cursor at the first post-capture anchor
    assert post_capture(fresh) == peer


def test_load_refuses_a_variable_phase_past_its_headroom(procs: Processes, tmp_path: Path) -> None:
    gpu = procs.start()
    engine(gpu, 2, loading=False)
    write_archive(tmp_path / "a", gpu, [])
    fresh = procs.start()
    layout.use_layout(open_archive(tmp_path / "a"))  # already open, as an engine's early check leaves it
    with pytest.raises(PersistError, match=r"phase 'profile' overran at LOAD.*more headroom.*: refused"):
        engine(fresh, 2 + 5, loading=True)  # 40 MiB more than SAVE, 32 MiB headroom


def test_use_layout_after_the_first_phase_is_refused(procs: Processes, tmp_path: Path) -> None:
    gpu = procs.start()
    engine(gpu, 1, loading=False)
    write_archive(tmp_path / "a", gpu, [])
    with pytest.raises(PersistError, match="use_layout\\(\\) must come before the first phase"):
        layout.use_layout(tmp_path / "a")


def test_verify_state_refuses_until_post_capture_ran_then_checks_state(procs: Processes, tmp_path: Path) -> None:
    gpu = procs.start()
    engine(gpu, 1, loading=False)
    post_capture(gpu)
    layout.close_open()
    table = gpu.alloc(2 * MIB)  # setup memory in a real engine; here any address the fake can read
    gpu.write(table, b"\x07" * 64)
    layout.declare_state("table", (table, 64), how="bytes")
    layout.declare_state("rank_data", (table + 4096, 8), how="recreated")
    gpu.write(table + 4096, b"\x01" * 8)
    records = [r for r, _ in layout.records_for_save()]
    saved_phases = list(layout.recorder().phases)
    save_evs = list(gpu.evs)

    class Payload:
        def read(self, rank: int, name: str) -> bytes:
            assert name == records[0].file
            return b"\x07" * 64

    fresh = procs.start()
    engine(fresh, 1, loading=True)
    layout.recorder().adopt(saved_phases, save_evs)
    layout.set_pending(layout.Pending(Payload(), 0, saved_phases, save_evs, [], records))
    with pytest.raises(PersistError, match=r"post-capture phase\(s\) 'post_capture' of SAVE have not run"):
        layout.verify_state()
    fresh.cursor = saved_phases[-1].start
    post_capture(fresh)
    layout.declare_state("table", (table, 64), how="bytes")
    layout.declare_state("rank_data", (table + 4096, 8), how="recreated")
    fresh.write(table + 4096, b"\x02" * 8)  # the engine re-created different content
    with pytest.raises(PersistError, match=rf"state 'rank_data' \(recreated\) at {table + 4096:#x}\+8: content "):
        layout.verify_state()
    assert fresh.read(table, 64) == b"\x07" * 64 and not fresh.frozen  # "bytes" went back first; not frozen
    fresh.write(table + 4096, b"\x01" * 8)
    assert layout.verify_state() == ["table", "rank_data"] and fresh.frozen and not layout.needs_verify()


def test_post_capture_open_at_another_address_is_refused(procs: Processes) -> None:
    gpu = procs.start()
    engine(gpu, 1, loading=False)
    post_capture(gpu)
    layout.close_open()
    saved_phases, save_evs = list(layout.recorder().phases), list(gpu.evs)
    fresh = procs.start()
    engine(fresh, 1, loading=True)
    layout.recorder().adopt(saved_phases, save_evs)  # what load() does when use_layout was not called
    fresh.cursor = saved_phases[-1].start
    with pytest.raises(PersistError, match=r"phase 'post_capture' \(exact, post_capture\): event 0 differs: saved "
                                           r"ipc_open .* live alloc"):  # fmt: skip
        post_capture(fresh, extra=True)
