"""Pinned host memory at fixed host addresses (native/gp_host.c), on CPU: the real interposer preloaded in a child
process over the fake driver (tests/cpu/native/fakecuda.c, which now also allocates, registers and frees pinned host
memory). What DeepEP's receive counters need: the same allocation sequence gives the same host addresses in two
processes, the memory is real, pinned (registered with PORTABLE | DEVICEMAP) and its device pointer is its host
address; whatever cannot be placed exactly goes to the driver and is logged with the reason, and a failed placement
leaves nothing behind."""

from __future__ import annotations

import shutil

import pytest
from native_fixtures import build_fake_driver, child_env, run_child

BASE = 0x500000000000
HOST_BASE = 0x4F0000000000
HOST_ALLOC, HOST_FREE, HOST_OUTSIDE = 12, 13, 14
PAGE = 4096

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed: cannot build the fake")

PRELUDE = """
import json, ctypes
from fakegp import Gp, MIB
gp = Gp()
out = {}
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_fake_driver(tmp_path_factory.mktemp("host"))


def run(libs: dict[str, str], code: str, **env: str) -> dict:
    """Runs `code` (after PRELUDE) under the interposer over the fake driver, region enabled unless env says not."""
    out, stderr = run_child(PRELUDE, code, child_env(libs, BASE, **{"GP_HOST_BASE": hex(HOST_BASE), **env}))
    return {**out, "stderr": stderr}


SEQUENCE = """
rc1, a = gp.host_alloc(8, 2)          # DeepEP: cudaHostAlloc(&moe_recv_counter, sizeof(int64_t), Mapped)
rc2, b = gp.host_alloc(4 * 1024, 2)   # moe_recv_expert_counter
rc3, c = gp.alloc_host(3 * PAGE + 1)  # cudaMallocHost
ctypes.memset(a, 0x5A, 8)             # real memory at the address handed out
ctypes.memset(c, 0x11, 3 * PAGE + 1)
out.update(rcs=[rc1, rc2, rc3], addrs=[a, b, c], events=gp.host_events(), registered=gp.fake.fake_live_registered(),
           driver_host=gp.fake.fake_live_host(), info=gp.host_info())
"""


def test_the_same_sequence_lands_at_the_same_host_addresses_in_two_processes(libs: dict[str, str]) -> None:
    first, second = (run(libs, f"PAGE = {PAGE}\n" + SEQUENCE) for _ in range(2))
    assert first["rcs"] == [0, 0, 0]
    assert first["addrs"] == [HOST_BASE, HOST_BASE + PAGE, HOST_BASE + 2 * PAGE]
    assert second["addrs"] == first["addrs"] and second["events"] == first["events"]
    assert first["events"] == [[HOST_ALLOC, HOST_BASE, PAGE, 8, 2], [HOST_ALLOC, HOST_BASE + PAGE, PAGE, 4096, 2],
                               [HOST_ALLOC, HOST_BASE + 2 * PAGE, 4 * PAGE, 3 * PAGE + 1, 1]]  # fmt: skip
    assert first["registered"] == 3 and first["driver_host"] == 0  # pinned by us, none from the driver
    base, size, cursor, reserved, n = first["info"]
    assert (base, size, cursor, reserved, n) == (HOST_BASE, 64 << 30, 6 * PAGE, 1, 3)


def test_free_unpins_drops_the_pages_and_never_reuses_the_range(libs: dict[str, str]) -> None:
    out = run(libs, """
        rc, a = gp.host_alloc(100, 2)
        gp.fake.fake_clear_trace()
        out["free"] = gp.free_host(a)
        out["trace"] = gp.trace()
        out["registered"] = gp.fake.fake_live_registered()
        rc, b = gp.host_alloc(100, 2)
        out["b"] = b
        out["events"] = gp.host_events()
        maps = open("/proc/self/maps").read().splitlines()
        out["prot_at_a"] = next(ln.split()[1] for ln in maps if int(ln.split("-")[0], 16) <= a
                                < int(ln.split()[0].split("-")[1], 16))
        """)  # fmt: skip
    assert out["free"] == 0
    assert out["trace"] == ["sync", "unregister"]  # pending work waited for, then unpinned
    assert out["registered"] == 0  # unpinned before b was made
    assert out["b"] == HOST_BASE + PAGE  # the freed page is not handed out again
    assert out["prot_at_a"].startswith("---")  # back to reserved address space, no pages
    assert [e[0] for e in out["events"]] == [HOST_ALLOC, HOST_FREE, HOST_ALLOC]


@pytest.mark.parametrize(
    ("setup", "env", "flags", "why"),
    [
        ("", {"GP_REGION_BASE": ""}, 2, 1),  # region not enabled
        ("", {}, 4, 2),  # write-combined
        ("", {"GP_HOST_BASE": "0"}, 2, 3),  # placement off
        ("", {"GP_HOST_BASE": ""}, 2, 3),  # placement is opt-in: empty, as unset, is off
        ("", {"GP_HOST_SIZE": str(PAGE)}, 2, 5),  # the second allocation does not fit
        ("gp.fake.fake_set_register_result(2)", {}, 2, 6),  # cuMemHostRegister fails
        ("gp.fake.fake_set_devptr_skew(1 << 20)", {}, 2, 7),  # the device cannot use the host pointer
    ],
)
def test_what_cannot_be_placed_exactly_goes_to_the_driver_with_the_reason(
    libs: dict[str, str], setup: str, env: dict[str, str], flags: int, why: int
) -> None:
    out = run(libs, f"""
        {setup}
        if {why} == 5:
            gp.host_alloc({PAGE}, 2)
        rc, a = gp.host_alloc(64, {flags})
        ctypes.memset(a, 1, 64)
        out.update(rc=rc, a=a, events=gp.host_events(), registered=gp.fake.fake_live_registered(),
                   driver_host=gp.fake.fake_live_host(), info=gp.host_info())
        out["free"] = gp.free_host(a)
        out["driver_host_after"] = gp.fake.fake_live_host()
        out["last"] = gp.host_events()[-1]
        """, **env)  # fmt: skip
    assert out["rc"] == 0 and out["a"] != 0
    assert not HOST_BASE <= out["a"] < HOST_BASE + (64 << 30)
    assert out["events"][-1] == [HOST_OUTSIDE, out["a"], 64, 64, why]
    assert out["driver_host"] == 1 and out["driver_host_after"] == 0  # the driver's allocation, freed by the driver
    assert out["registered"] == (1 if why == 5 else 0)  # a failed placement left no registration behind
    expected_cursor = PAGE if why == 5 else 0
    assert out["info"][2] == expected_cursor  # and did not move the cursor
    assert out["last"] == [HOST_FREE, out["a"], 64, 0, 0]


def test_the_host_range_is_taken_only_where_it_is_free(libs: dict[str, str]) -> None:
    """An address someone already maps is never clobbered: placement is refused with the reason, the error says
    what to do."""
    out = run(libs, """
        import mmap as _m
        libc = ctypes.CDLL(None)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        busy = libc.mmap(0x4F0000000000 + 4096, 4096, 3, 0x22 | 0x100000, -1, 0)  # MAP_FIXED_NOREPLACE
        rc, a = gp.host_alloc(64, 2)
        out.update(rc=rc, a=a, busy=busy, last=gp.host_events()[-1], error=gp.error(), info=gp.host_info())
        """)  # fmt: skip
    assert out["busy"] == HOST_BASE + PAGE
    assert out["rc"] == 0 and out["a"] != HOST_BASE
    assert out["last"][0] == HOST_OUTSIDE and out["last"][4] == 4
    assert "GP_HOST_BASE" in out["error"] and out["info"][3] == -1


def test_lookups_hand_out_the_host_hooks(libs: dict[str, str]) -> None:
    """cudart finds the driver through cuGetProcAddress and dlsym: both must give our wrappers, and the 32-bit v1
    cuMemAllocHost stays the driver's."""
    out = run(libs, """
        c = gp.c
        c.cuGetProcAddress_v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                          ctypes.c_uint64, ctypes.c_void_p]
        def proc(name, ver=12000):
            p = ctypes.c_void_p()
            c.cuGetProcAddress_v2(name.encode(), ctypes.byref(p), ver, 0, None)
            return p.value
        ours = {n: ctypes.cast(getattr(c, s), ctypes.c_void_p).value for n, s in
                [("cuMemHostAlloc", "cuMemHostAlloc"), ("cuMemAllocHost", "cuMemAllocHost_v2"),
                 ("cuMemFreeHost", "cuMemFreeHost")]}
        out["proc"] = {n: proc(n) == a for n, a in ours.items()}
        out["v1"] = proc("cuMemAllocHost", 2000) == ours["cuMemAllocHost"]
        c.dlsym.restype = ctypes.c_void_p
        c.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        out["dlsym"] = {n: c.dlsym(None, n.encode()) == ours[n] for n in ("cuMemHostAlloc", "cuMemFreeHost")}
        """)  # fmt: skip
    assert out["proc"] == {"cuMemHostAlloc": True, "cuMemAllocHost": True, "cuMemFreeHost": True}
    assert out["v1"] is False
    assert out["dlsym"] == {"cuMemHostAlloc": True, "cuMemFreeHost": True}
