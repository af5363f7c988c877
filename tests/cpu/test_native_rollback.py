"""Every failing path of the interposer rolls back completely, on CPU: the real interposer runs preloaded in a child
process over a fake driver (tests/cpu/native/fakecuda.c: reservations, memfd-backed physical memory and mappings
in host memory, with counters), and each named fault site (GP_FAULT / gp_fault_inject) is made to fail once.
Each scenario asserts that the call returns an error, that no handle or mapping leaked, that the cursor, free list
and event log are unchanged, and that the next allocation lands where it would have landed without the failure.
The same free-while-pending behaviour is tested on the real driver by tests/gpu/test_memsafety_gpu.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from native_fixtures import build_fake_driver, child_env, run_child

from graphpersist.memory import region

HERE = Path(__file__).resolve().parent / "native"
BASE = 0x500000000000
MIB = 1 << 20

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed: cannot build the fake")

PRELUDE = """
import json, ctypes
from fakegp import Gp, State, MIB, GRAN
gp = Gp()
out = {}
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_fake_driver(tmp_path_factory.mktemp("rollback"))


def run(libs: dict[str, str], code: str, **env: str) -> dict:
    """Runs `code` (after PRELUDE) in a process under the interposer over the fake driver; returns its `out`."""
    out, stderr = run_child(PRELUDE, code, child_env(libs, BASE, **env))
    return {**out, "stderr": stderr}


def test_fake_driver_and_interposer_basics(libs: dict[str, str]) -> None:
    """The harness itself: placement at the cursor, real memory behind it, free + reuse only after freeze."""
    out = run(
        libs,
        """
        base = gp.reserve_region()
        rc, a = gp.alloc(3 * MIB)
        assert (rc, a) == (0, base), (rc, hex(a))
        ctypes.memset(a, 0x5A, 3 * MIB)  # the fake maps real host memory: writable where the region mapped it
        rc, b = gp.alloc(1)
        assert (rc, b) == (0, base + 4 * MIB)
        assert gp.free(a) == 0
        rc, c = gp.alloc(1)
        assert c == base + 6 * MIB, hex(c)  # not reused before freeze
        gp.freeze()
        rc, d = gp.alloc(4 * MIB)
        assert d == base, hex(d)  # reused after it
        st = gp.state()
        out.update(handles=st.handles, mappings=st.mappings, trace=gp.trace())
    """,
    )
    assert out["handles"] == out["mappings"] == 3
    trace = out["trace"]
    assert trace.index("sync") < trace.index("unmap") < trace.index("release"), trace


@pytest.mark.parametrize("frozen", [False, True], ids=["cursor", "free-list"])
@pytest.mark.parametrize("site", ["create", "map", "access", "live_grow", "log_grow"])
def test_allocation_failure_rolls_back(libs: dict[str, str], site: str, frozen: bool) -> None:
    out = run(
        libs,
        f"""
        base = gp.reserve_region()
        if {frozen}:
            rc, a = gp.alloc(4 * MIB); assert rc == 0
            rc, keep = gp.alloc(2 * MIB); assert rc == 0
            assert gp.free(a) == 0
            gp.freeze()
            expect = base  # the freed range
        else:
            expect = base
        before = gp.state()
        gp.fault({site!r})
        rc, p = gp.alloc(3 * MIB)
        assert rc != 0 and gp.fault_pending() == 0, (rc, gp.fault_pending())
        assert gp.state() == before, (gp.state(), before)
        rc, p = gp.alloc(3 * MIB)
        assert (rc, p) == (0, expect), (rc, hex(p))
        out["error"] = gp.error()
    """,
    )
    assert out["error"]


def test_fault_from_the_environment(libs: dict[str, str]) -> None:
    """GP_FAULT=<site>:<nth> arms the same hook from the start: the second cuMemCreate fails, nothing leaks."""
    out = run(
        libs,
        """
        base = gp.reserve_region()
        assert gp.alloc(1) == (0, base)
        before = gp.state()
        assert gp.alloc(1)[0] != 0
        assert gp.state() == before
        assert gp.alloc(1) == (0, base + GRAN)
    """,
        GP_FAULT="create:2",
    )
    assert "fault injected at create" in out["stderr"]
    bad = run(libs, "gp.reserve_region()", GP_FAULT="nosuchsite:1")
    assert "GP_FAULT=nosuchsite:1 names no fault site" in bad["stderr"]


@pytest.mark.parametrize("site", ["sync", "unmap", "release", "log_grow"])
def test_free_failure_keeps_the_allocation(libs: dict[str, str], site: str) -> None:
    """A free that fails leaves the allocation live and intact (a failed release maps it again) and freeable."""
    run(
        libs,
        f"""
        base = gp.reserve_region()
        rc, a = gp.alloc(2 * MIB); assert rc == 0
        ctypes.memset(a, 0x33, 2 * MIB)
        before = gp.state()
        gp.fault({site!r})
        assert gp.free(a) != 0 and gp.fault_pending() == 0
        assert gp.state() == before, (gp.state(), before)
        assert ctypes.string_at(a + MIB, 4) == b"\\x33" * 4  # still mapped, same memory
        assert gp.free(a) == 0
        st = gp.state()
        assert (st.handles, st.mappings) == (0, 0), st
    """,
    )


def test_free_returns_the_synchronize_error(libs: dict[str, str]) -> None:
    """cuMemFree's contract: it waits for pending work; when that fails (e.g. during stream capture) it fails too."""
    out = run(
        libs,
        """
        base = gp.reserve_region()
        rc, a = gp.alloc(1); assert rc == 0
        gp.fake.fake_set_sync_result(900)  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        out["rc"] = gp.free(a)
        st = gp.state(); assert (st.handles, st.mappings) == (1, 1)
        gp.fake.fake_set_sync_result(0)
        assert gp.free(a) == 0
        out["trace"] = gp.trace()
    """,
    )
    assert out["rc"] == 900
    assert out["trace"][-3:] == ["sync", "unmap", "release"], out["trace"]


def test_reservation_failures_leave_the_cursor(libs: dict[str, str]) -> None:
    """A refused or failed reservation (log room, exhaustion after an alignment step) does not move the cursor."""
    run(
        libs,
        """
        base = gp.reserve_region()
        assert gp.alloc(1) == (0, base)
        before = gp.state()
        gp.fault("log_grow")
        assert gp.reserve(8 * MIB)[0] != 0
        assert gp.state() == before
        rc, _ = gp.reserve(200 * MIB, 128 * MIB)  # aligned to 128 MiB it no longer fits in 256 MiB
        assert rc != 0 and gp.info().cursor == before.cursor
        assert gp.reserve(8 * MIB) == (0, base + GRAN)
        gp.fault("log_grow")
        assert gp.address_free(base + GRAN, 8 * MIB) != 0
        assert gp.address_free(base + GRAN, 8 * MIB) == 0
    """,
    )


def test_library_mappings_are_logged_and_block_the_address_free(libs: dict[str, str]) -> None:
    """cuMemMap into a carved reservation is a lib_map event (offset in req); anywhere else it is `outside`."""
    out = run(
        libs,
        """
        base = gp.reserve_region()
        rc, r = gp.reserve(8 * MIB); assert rc == 0
        h = gp.create(2 * MIB)
        assert gp.map(r + 4 * MIB, 2 * MIB, h) == 0
        assert gp.address_free(r, 8 * MIB) != 0  # still mapped inside: never handed out again
        assert gp.unmap(r + 4 * MIB, 2 * MIB) == 0
        assert gp.address_free(r, 8 * MIB) == 0
        rc, a = gp.alloc(1); assert rc == 0
        rc, hint = gp.reserve(2 * MIB, 0, 0x600000000000)  # a caller's address: outside
        assert rc == 0 and hint == 0x600000000000
        h2 = gp.create(2 * MIB)
        assert gp.map(hint, 2 * MIB, h2) == 0
        assert gp.unmap(hint, 2 * MIB) == 0
        gp.fault("log_grow")
        before = gp.state()
        assert gp.map(hint, 2 * MIB, h2) != 0 and gp.state() == before  # no room to log it: not mapped at all
        assert gp.fake.cuMemRelease(h) == 0 and gp.fake.cuMemRelease(h2) == 0
        out["events"] = gp.events()
        out["r"] = r
    """,
    )
    kinds = {v: k for k, v in region.EVENT_KINDS.items()}
    r = out["r"]
    evs = [(region.EVENT_KINDS[k], a, s, q, d) for k, a, s, q, d in out["events"]]
    assert evs[0] == ("reserve", r, 8 * MIB, 8 * MIB, 0)
    assert evs[1] == ("lib_map", r + 4 * MIB, 2 * MIB, 4 * MIB, 0)
    assert evs[2] == ("lib_unmap", r + 4 * MIB, 2 * MIB, 4 * MIB, 0)
    assert evs[3][0] == "unreserve"
    assert [e[0] for e in evs[4:]] == ["alloc", "outside", "outside"]
    assert evs[5][4] == 3 and evs[6][4] == 4  # GP_OUT_HINT, then GP_OUT_MAP
    assert kinds["lib_map"] == region.EV_LIB_MAP


@pytest.mark.parametrize("site", ["create", "map", "access", "live_grow", "log_grow"])
def test_restore_failing_midway_unmaps_what_it_mapped(libs: dict[str, str], site: str) -> None:
    """A failed LOAD restore leaves the process as before: the next allocation takes the cursor as usual."""
    run(
        libs,
        f"""
        base = gp.reserve_region()
        rc, a = gp.alloc(1); assert rc == 0
        before = gp.state()
        ranges = [(base + 4 * MIB, 2 * MIB), (base + 6 * MIB, 4 * MIB), (base + 12 * MIB, 2 * MIB)]
        n = len(before.events)
        gp.fault({site!r}, 3 if {site!r} != "log_grow" else 2)  # the third (second) range fails
        assert gp.restore(ranges, n, 14 * MIB) != 0 and gp.fault_pending() == 0
        assert gp.state() == before, (gp.state(), before)
        assert gp.restore(ranges, n, 1 * MIB) != 0  # all mapped, then the cursor cannot move back: undone too
        assert gp.state() == before, (gp.state(), before)
        assert "cursor" in gp.error()
        assert gp.alloc(1) == (0, base + GRAN)  # capture goes on normally after a failed LOAD
        assert gp.free(base + GRAN) == 0
        assert gp.restore(ranges, len(gp.events()), 14 * MIB) == 0, gp.error()  # a later LOAD still works
        assert gp.state().handles == 4 and gp.info().cursor == 14 * MIB
    """,
    )


def test_restore_succeeds_after_a_failed_one(libs: dict[str, str]) -> None:
    run(
        libs,
        """
        base = gp.reserve_region()
        ranges = [(base + 4 * MIB, 2 * MIB), (base + 6 * MIB, 2 * MIB)]
        gp.fault("map", 2)
        assert gp.restore(ranges, 0, 8 * MIB) != 0
        assert gp.restore(ranges, 0, 8 * MIB) == 0, gp.error()
        st = gp.state()
        assert (st.handles, st.mappings, st.cursor) == (2, 2, 8 * MIB)
        assert [e[0] for e in st.events] == [4, 4]  # map_fixed, map_fixed: the failed attempt left none
        assert gp.alloc(1) == (0, base + 8 * MIB)
    """,
    )


EXPORTER = """
import sys
base = gp.reserve_region()
rc, a = gp.alloc(4 * MIB); assert rc == 0
ctypes.memset(a, 0x77, 4 * MIB)
gp.fault("export")
assert gp.ipc_handle(a)[0] != 0  # a failed export leaves no fd behind and can be retried
rc, raw = gp.ipc_handle(a); assert rc == 0, gp.error()
print("HANDLE " + raw.hex(), flush=True)
sys.stdin.readline()  # the importer is done
"""


@pytest.fixture()
def exporter(libs: dict[str, str]):
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + EXPORTER], env=child_env(libs, BASE), text=True, **pipes)
    line = proc.stdout.readline()
    if not line.startswith("HANDLE "):
        proc.kill()
        pytest.fail(f"exporter failed: {line}{proc.stderr.read()}")
    yield line.split()[1]
    proc.stdin.write("done\n")
    proc.stdin.close()
    proc.wait(timeout=30)


IMPORT_PRELUDE = """
raw = bytes.fromhex({handle!r})
base = gp.reserve_region()
rc, probe = gp.ipc_open(raw)
if rc != 0 and "pidfd_getfd" in gp.error() and "Operation not permitted" in gp.error():
    out["skip"] = gp.error()
else:
    assert rc == 0, (rc, gp.error())
    assert probe == base, (hex(probe), hex(base))
    assert ctypes.string_at(probe, 4) == b"\\x77" * 4, ctypes.string_at(probe, 4)
    assert gp.ipc_close(probe) == 0
"""


def _import_run(libs: dict[str, str], handle: str, body: str) -> dict:
    out = run(libs, IMPORT_PRELUDE.format(handle=handle) + "if 'skip' not in out:\n" + textwrap.indent(
        textwrap.dedent(body), "    "))  # fmt: skip
    if "skip" in out:
        pytest.skip(f"pidfd_getfd is not permitted here, so no fd can be fetched from the exporter: {out['skip']}")
    return out


@pytest.mark.parametrize("site", ["fd", "import", "map", "access", "log_grow"])
def test_partial_ipc_import_rolls_back(libs: dict[str, str], exporter: str, site: str) -> None:
    _import_run(
        libs,
        exporter,
        f"""
        gp.freeze()  # the probe's range is on the free list now: the import must take it again after the failure
        before = gp.state()
        gp.fault({site!r})
        rc, p = gp.ipc_open(raw)
        assert rc != 0 and gp.fault_pending() == 0
        assert gp.state() == before, (gp.state(), before)
        rc, p = gp.ipc_open(raw)
        assert (rc, p) == (0, base), (rc, hex(p), gp.error())
        assert ctypes.string_at(p + 3 * MIB, 4) == b"\\x77" * 4
        assert gp.ipc_close(p) == 0
        st = gp.state(); assert (st.handles, st.mappings) == (0, 0), st
    """,
    )


@pytest.mark.parametrize("site", ["sync", "unmap", "release", "log_grow"])
def test_failed_ipc_close_keeps_the_mapping(libs: dict[str, str], exporter: str, site: str) -> None:
    _import_run(
        libs,
        exporter,
        f"""
        rc, p = gp.ipc_open(raw); assert rc == 0
        rc, p2 = gp.ipc_open(raw); assert (rc, p2) == (0, p)  # two references
        assert gp.ipc_close(p) == 0  # not the last: nothing unmapped, no sync needed
        syncs = gp.fake.fake_sync_calls()
        before = gp.state()
        gp.fault({site!r})
        assert gp.ipc_close(p) != 0 and gp.fault_pending() == 0
        assert gp.state() == before, (gp.state(), before)
        assert ctypes.string_at(p, 4) == b"\\x77" * 4
        assert gp.ipc_close(p) == 0, gp.error()
        assert gp.fake.fake_sync_calls() > syncs
        st = gp.state(); assert (st.handles, st.mappings) == (0, 0), st
        assert gp.ipc_close(p) != 0  # closed: the fake driver's legacy path refuses it
    """,
    )


def test_missing_driver_is_named(libs: dict[str, str], tmp_path: Path) -> None:
    out = run(libs, """
        rc = gp.c.gp_reserve_now()
        out["rc"] = rc
        out["error"] = gp.error()
    """, GP_LIBCUDA=str(tmp_path / "nope.so"))  # fmt: skip
    assert out["rc"] != 0
    assert "cannot load the CUDA driver" in out["stderr"] and "nope.so" in out["stderr"]


def test_saves_attribute_reader_reads_every_attribute_of_a_node_in_one_native_call(libs: dict[str, str]) -> None:
    """graphwalk._AttrReader under the interposer: gp_kernel_node_attrs answers per attribute, in order, with the
    driver's error for unreadable ones and zeros as their value (the fake driver refuses ids divisible by 3)."""
    out = run(
        libs,
        """
        from graphpersist.graph import walk as graphwalk
        class Attr(int):
            name = ""
        attrs = [Attr(i) for i in (1, 2, 3, 4, 6, 7)]
        reader = graphwalk._AttrReader(attrs)
        out["native"] = reader.native is not None
        got = reader.read(0x1010)
        out["read"] = [[int(a), err, raw.hex()] for a, err, raw in got]
        """,
        PYTHONPATH=f"{HERE}{os.pathsep}{Path(region.__file__).resolve().parents[2]}",
    )
    assert out["native"] is True
    assert [(a, err) for a, err, _ in out["read"]] == [(1, 0), (2, 0), (3, 801), (4, 0), (6, 801), (7, 0)]
    for a, err, value in out["read"]:
        expected = bytes([(a + 0x10) & 0xFF]) * 64 if err == 0 else bytes(64)
        assert bytes.fromhex(value) == expected, a
