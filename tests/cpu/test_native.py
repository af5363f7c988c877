"""The interposer's pure bookkeeping (native/gp_core.c), built with gcc and driven through ctypes, no GPU."""

from __future__ import annotations

import ctypes
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from graphpersist.graph import format as graphformat
from graphpersist.memory import region

NATIVE = region.NATIVE_DIR
CUDA_H = Path("/usr/local/cuda-13.0/include/cuda.h")  # what gp_cuda.h's declarations were taken from
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


class Bump(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("base", "size", "cursor", "gran")]


class Log(ctypes.Structure):
    _fields_ = [
        ("ev", ctypes.c_void_p),
        ("n", ctypes.c_size_t),
        ("cap", ctypes.c_size_t),
        ("next_seq", ctypes.c_uint64),
    ]


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    out = tmp_path_factory.mktemp("gpcore") / "libgpcore_test.so"
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    str(NATIVE / "gp_core.c")], check=True)  # fmt: skip
    lib = ctypes.CDLL(str(out))
    lib.gp_round_up.restype = ctypes.c_uint64
    lib.gp_round_up.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    lib.gp_bump_place.argtypes = [ctypes.POINTER(Bump), ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64),
                                  ctypes.POINTER(ctypes.c_uint64)]  # fmt: skip
    lib.gp_bump_set_cursor.argtypes = [ctypes.POINTER(Bump), ctypes.c_uint64]
    lib.gp_log_append.restype = ctypes.c_uint64
    lib.gp_log_append.argtypes = [ctypes.POINTER(Log), ctypes.c_uint32] + [ctypes.c_uint64] * 3
    lib.gp_log_find_live.restype = ctypes.c_long
    lib.gp_log_find_live.argtypes = [ctypes.POINTER(Log), ctypes.c_uint64]
    lib.gp_log_find_reservation.restype = ctypes.c_long
    lib.gp_log_find_reservation.argtypes = [ctypes.POINTER(Log), ctypes.c_uint64]
    lib.gp_image_size.restype = ctypes.c_uint64
    lib.gp_image_size.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.gp_image_format.restype = ctypes.c_uint32
    lib.gp_image_format.argtypes = [ctypes.c_void_p]
    lib.gp_free_add.argtypes = [ctypes.POINTER(Free), ctypes.c_uint64, ctypes.c_uint64]
    lib.gp_free_take.argtypes = [ctypes.POINTER(Free), ctypes.c_uint64, ctypes.c_uint64,
                                 ctypes.POINTER(ctypes.c_uint64)]  # fmt: skip
    lib.gp_knode_size.restype = ctypes.c_size_t
    lib.gp_knode_layout_check.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                                          ctypes.c_char_p, ctypes.c_size_t]  # fmt: skip
    lib.gp_kattr_size.restype = ctypes.c_size_t
    return lib


def place(lib: ctypes.CDLL, b: Bump, req: int) -> tuple[int, int, int]:
    addr, mapped = ctypes.c_uint64(), ctypes.c_uint64()
    rc = lib.gp_bump_place(ctypes.byref(b), req, ctypes.byref(addr), ctypes.byref(mapped))
    return rc, addr.value, mapped.value


def test_round_up(core: ctypes.CDLL) -> None:
    mib2 = 2 << 20
    assert [core.gp_round_up(v, mib2) for v in (0, 1, mib2, mib2 + 1)] == [0, mib2, mib2, 2 * mib2]
    assert core.gp_round_up(2**64 - 1, mib2) == 0  # does not fit: 0, never a wrapped small size
    assert core.gp_round_up(2**64 - mib2, mib2) == 2**64 - mib2


def test_absurd_request_is_refused_not_wrapped(core: ctypes.CDLL) -> None:
    b = Bump(0x500000000000, 1 << 30, 0, 2 << 20)
    assert place(core, b, 2**64 - 1)[0] == -1
    assert b.cursor == 0
    assert core.gp_bump_set_cursor(ctypes.byref(b), 2**64 - 1) == -1


def test_bump_is_a_function_of_the_sequence(core: ctypes.CDLL) -> None:
    """Two processes making the same requests get the same addresses: the heart of SAVE/LOAD equality."""
    seq = [1024, 20 << 20, 1, 64 << 20, 3 << 20]
    runs = []
    for _ in range(2):
        b = Bump(0x500000000000, 1 << 30, 0, 2 << 20)
        runs.append([place(core, b, r) for r in seq])
    assert runs[0] == runs[1]
    addrs = [a for _, a, _ in runs[0]]
    assert addrs[0] == 0x500000000000 and addrs == sorted(addrs)
    assert [m for _, _, m in runs[0]] == [2 << 20, 20 << 20, 2 << 20, 64 << 20, 4 << 20]


def test_bump_exhaustion_and_unset_region(core: ctypes.CDLL) -> None:
    b = Bump(0x500000000000, 4 << 20, 0, 2 << 20)
    assert place(core, b, 3 << 20)[0] == 0
    assert place(core, b, 1)[0] == -1  # full: refused, cursor unchanged
    assert b.cursor == 4 << 20
    assert place(core, Bump(0, 0, 0, 0), 1)[0] == -1


def test_set_cursor_never_moves_back(core: ctypes.CDLL) -> None:
    b = Bump(0x500000000000, 1 << 30, 0, 2 << 20)
    place(core, b, 10 << 20)
    assert core.gp_bump_set_cursor(ctypes.byref(b), 4 << 20) == -1
    assert core.gp_bump_set_cursor(ctypes.byref(b), (30 << 20) + 1) == 0
    assert b.cursor == 32 << 20  # rounded to the granularity
    assert core.gp_bump_set_cursor(ctypes.byref(b), 2 << 30) == -1


def test_event_log_tracks_liveness(core: ctypes.CDLL) -> None:
    log = Log()
    for i in range(600):  # forces growth past the initial capacity
        assert core.gp_log_append(ctypes.byref(log), region.EV_ALLOC, 0x1000 * i, 4096, 100) == i
    core.gp_log_append(ctypes.byref(log), region.EV_FREE, 0x1000 * 5, 4096, 0)
    assert core.gp_log_find_live(ctypes.byref(log), 0x1000 * 5) == -1
    assert core.gp_log_find_live(ctypes.byref(log), 0x1000 * 6) == 6
    assert core.gp_log_find_live(ctypes.byref(log), 0xDEAD) == -1
    res = core.gp_log_append(ctypes.byref(log), region.EV_RESERVE, 0x900000, 8 << 20, 8 << 20)
    assert core.gp_log_find_live(ctypes.byref(log), 0x900000) == -1  # a reservation alone is not memory ...
    assert core.gp_log_find_reservation(ctypes.byref(log), 0x900000 + (3 << 20)) == res  # ... but address space
    mapped = core.gp_log_append(ctypes.byref(log), region.EV_LIB_MAP, 0x900000 + (2 << 20), 2 << 20, 2 << 20)
    assert core.gp_log_find_live(ctypes.byref(log), 0x900000 + (2 << 20)) == mapped  # what a library maps there is
    core.gp_log_append(ctypes.byref(log), region.EV_LIB_UNMAP, 0x900000 + (2 << 20), 2 << 20, 2 << 20)
    assert core.gp_log_find_live(ctypes.byref(log), 0x900000 + (2 << 20)) == -1
    core.gp_log_append(ctypes.byref(log), region.EV_UNRESERVE, 0x900000, 8 << 20, 8 << 20)
    assert core.gp_log_find_reservation(ctypes.byref(log), 0x900000 + (3 << 20)) == -1  # given back
    assert core.gp_log_find_reservation(ctypes.byref(log), 0x900000 + (8 << 20)) == -1  # past its end


class Free(ctypes.Structure):
    _fields_ = [("r", ctypes.c_void_p), ("n", ctypes.c_size_t), ("cap", ctypes.c_size_t)]


def free_ranges(f: Free) -> list[tuple[int, int]]:
    arr = (ctypes.c_uint64 * (2 * f.n)).from_address(f.r) if f.n else []
    return [(arr[2 * i], arr[2 * i + 1]) for i in range(f.n)]


def take(core: ctypes.CDLL, f: Free, size: int, align: int) -> int | None:
    addr = ctypes.c_uint64()
    return addr.value if core.gp_free_take(ctypes.byref(f), size, align, ctypes.byref(addr)) == 0 else None


def test_free_list_coalesces_and_refuses_overlap(core: ctypes.CDLL) -> None:
    f = Free()
    m = 2 << 20
    for a in (10 * m, 14 * m, 12 * m):  # out of order; 12 sits between 10 and 14 with gaps on both sides
        assert core.gp_free_add(ctypes.byref(f), a, m) == 0
    assert free_ranges(f) == [(10 * m, m), (12 * m, m), (14 * m, m)]
    assert core.gp_free_add(ctypes.byref(f), 11 * m, m) == 0  # joins 10 and 12
    assert core.gp_free_add(ctypes.byref(f), 13 * m, m) == 0  # joins everything
    assert free_ranges(f) == [(10 * m, 5 * m)]
    assert core.gp_free_add(ctypes.byref(f), 12 * m, m) == -1  # already free: a double free is refused
    assert core.gp_free_add(ctypes.byref(f), 9 * m, 2 * m) == -1  # overlaps the head
    assert core.gp_free_add(ctypes.byref(f), 0, 0) == -1
    assert free_ranges(f) == [(10 * m, 5 * m)]


def test_free_list_first_fit_with_alignment_splits(core: ctypes.CDLL) -> None:
    f = Free()
    m = 2 << 20
    core.gp_free_add(ctypes.byref(f), 3 * m, 6 * m)  # [3m, 9m)
    assert take(core, f, m, 4 * m) == 4 * m  # aligned inside: head [3m,4m) and tail [5m,9m) stay
    assert free_ranges(f) == [(3 * m, m), (5 * m, 4 * m)]
    assert take(core, f, m, m) == 3 * m  # exact fit removes the range
    assert take(core, f, 4 * m, m) == 5 * m
    assert free_ranges(f) == []
    assert take(core, f, m, m) is None
    assert take(core, f, m, 3 * m) is None  # alignment must be a power of two


def image_size(core: ctypes.CDLL, data: bytes) -> tuple[int, int, int]:
    buf = ctypes.create_string_buffer(data, len(data))
    start = ctypes.c_void_p()
    n = core.gp_image_size(buf, ctypes.byref(start))
    return n, start.value or 0, ctypes.addressof(buf)


def test_image_size_fatbin_and_wrapper(core: ctypes.CDLL) -> None:
    fat = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 1000) + bytes(1000)
    n, start, addr = image_size(core, fat)
    assert (n, start) == (1016, addr)
    fat_buf = ctypes.create_string_buffer(fat, len(fat))
    wrapper = struct.pack("<iiQQ", 0x466243B1, 1, ctypes.addressof(fat_buf), 0)
    n, start, _ = image_size(core, wrapper)
    assert (n, start) == (1016, ctypes.addressof(fat_buf))


def test_image_size_elf_and_ptx(core: ctypes.CDLL) -> None:
    # ELF64 header (64 bytes) + one 100-byte section at 64 + section header table (2 x 64) at 200.
    ehdr = bytearray(64)
    ehdr[0:4] = b"\x7fELF"
    ehdr[4] = 2
    struct.pack_into("<Q", ehdr, 0x28, 200)  # e_shoff
    struct.pack_into("<HH", ehdr, 0x3A, 64, 2)  # e_shentsize, e_shnum
    body = bytearray(200 - 64)
    sh0, sh1 = bytearray(64), bytearray(64)
    struct.pack_into("<I", sh1, 4, 1)  # SHT_PROGBITS
    struct.pack_into("<QQ", sh1, 0x18, 64, 100)
    elf = bytes(ehdr + body + sh0 + sh1)
    assert image_size(core, elf)[0] == 328
    assert image_size(core, b".version 8.0\n.target sm_90\n\0garbage")[0] == len(".version 8.0\n.target sm_90\n") + 1
    fmt = {v: k for k, v in region.IMAGE_FORMATS.items()}
    buf = ctypes.create_string_buffer(elf, len(elf))
    assert core.gp_image_format(buf) == fmt["elf"]
    assert core.gp_image_format(b".version 8.0\n\0") == fmt["ptx"]
    assert core.gp_image_format(struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 0)) == fmt["fatbin"]


def test_native_tables_match_python_packing(core: ctypes.CDLL) -> None:
    """graphformat.pack_kernel_table writes what gp_add_kernel_nodes reads."""
    assert core.gp_knode_size() == graphformat.KNODE.size
    assert core.gp_kattr_size() == graphformat.KATTR.size


def layout_check(core: ctypes.CDLL, params_off: int, offsets: list[int], live: list[tuple[int, int]],
                 blob_size: int) -> str | None:  # fmt: skip
    """gp_knode_layout_check of one kernel row (its offsets at the start of the offset rows) against `live`."""
    row = graphformat.KNODE.pack(0, 0, 1, 1, 1, 1, 1, 1, 0, len(offsets), params_off, 0, 0, 0, 0)
    offs = (ctypes.c_uint32 * max(len(offsets), 1))(*offsets)
    words = (ctypes.c_uint32 * (1 + 2 * len(live)))(len(live), *[v for p in live for v in p])
    why = ctypes.create_string_buffer(160)
    return None if core.gp_knode_layout_check(row, offs, words, blob_size, why, 160) == 0 else why.value.decode()


def test_a_kernel_row_must_have_its_functions_layout_and_end_inside_the_blob(core: ctypes.CDLL) -> None:
    """What gp_add_kernel_nodes checks of every row before adding a node: the driver reads each parameter for as
    long as the live function says, so the row's count and offsets must be the function's and every end inside."""
    live = [(0, 8), (8, 4), (16, 8)]
    assert layout_check(core, 40, [0, 8, 16], live, 64) is None  # ends exactly at the blob's end
    assert layout_check(core, 41, [0, 8, 16], live, 64) == "parameter 2 (8 bytes at offset 16) ends past the " \
        "64-byte blob"  # fmt: skip
    assert layout_check(core, 0, [0, 8], live, 64) == "2 parameters, the function 3"
    assert layout_check(core, 0, [0, 12, 16], live, 64) == "parameter 1 at offset 12, the function's at 8"
    # an offset near 2**64 must not wrap around into the blob
    assert layout_check(core, 2**64 - 8, [0, 8, 16], live, 64) == "parameter 0 (8 bytes at offset 0) ends past " \
        "the 64-byte blob"  # fmt: skip
    assert layout_check(core, 60, [], [], 64) is None  # no parameters: nothing is read


def test_pack_kernel_table_layout() -> None:
    desc = {"nodes": [
        {"type": "empty"},
        {"type": "kernel", "func": 3, "grid": [4, 2, 1], "block": [128, 1, 1], "smem": 99, "params": [16, 24],
         "layout": [[0, 8], [8, 4], [16, 8]], "attrs": {"4": "04" + "00" * 63}},
    ]}  # fmt: skip
    table = graphformat.pack_kernel_table(desc)
    n_k, n_off, n_attr, _ = graphformat.TABLE_HEADER.unpack_from(table)
    assert (n_k, n_off, n_attr) == (1, 3, 1)
    node = graphformat.KNODE.unpack_from(table, graphformat.TABLE_HEADER.size)
    assert node[:2] == (1, 3) and node[2:8] == (4, 2, 1, 128, 1, 1) and node[8:11] == (99, 3, 16)
    offs = struct.unpack_from("<3I", table, graphformat.TABLE_HEADER.size + graphformat.KNODE.size)
    assert offs == (0, 8, 16)


def test_blob_checks_refuse_truncation() -> None:
    blob = bytes(range(64))
    desc = {"blob_size": 64, "blob_sha256": __import__("hashlib").sha256(blob).hexdigest()}
    graphformat.verify_blob("g", desc, blob)
    with pytest.raises(graphformat.GraphFormatError, match="truncated"):
        graphformat.verify_blob("g", desc, blob[:32])
    with pytest.raises(graphformat.GraphFormatError, match="sha256"):
        graphformat.verify_blob("g", desc, bytes(64))


def test_address_fingerprint_ignores_padding_not_addresses() -> None:
    lo, hi = 0x500000000000, 0x500000000000 + (1 << 30)
    desc = {"nodes": [{"type": "kernel", "params": [0, 16], "name": "k", "attrs": {}}], "edges": []}
    a = struct.pack("<QQ", lo + 4096, 0x1111)
    b = struct.pack("<QQ", lo + 4096, 0x2222)  # padding differs
    c = struct.pack("<QQ", lo + 8192, 0x1111)  # an address differs
    fa, fb, fc = (graphformat.address_fingerprint(desc, x, lo, hi) for x in (a, b, c))
    assert fa == fb != fc
    # SAVE passes the topology fingerprint it computed already: the same hash, and the topology is in it
    assert graphformat.address_fingerprint(desc, a, lo, hi, graphformat.topology_fingerprint(desc)) == fa
    assert graphformat.address_fingerprint(desc, a, lo, hi, "00" * 32) != fa


def test_live_ranges() -> None:
    ev = region.Event
    evs = [ev(0, "alloc", 0x1000, 0x100, 1), ev(1, "alloc", 0x2000, 0x100, 1), ev(2, "free", 0x1000, 0x100, 0),
           ev(3, "map_fixed", 0x3000, 0x200, 0x200), ev(4, "reserve", 0x4000, 0x100, 0x80),
           ev(5, "reserve", 0x5000, 0x100, 0x80), ev(6, "unreserve", 0x5000, 0x100, 0x80),
           ev(7, "lib_map", 0x4000, 0x40, 0), ev(8, "lib_map", 0x4040, 0x40, 0x40),
           ev(9, "lib_map", 0x4080, 0x40, 0x80), ev(10, "lib_unmap", 0x4040, 0x80, 0x40)]  # fmt: skip
    # reservations are address space, not memory: only what a library mapped into one (and did not unmap) is live
    assert region.live_ranges(evs) == [(0x2000, 0x100), (0x3000, 0x200), (0x4000, 0x40)]
    assert region.live_ranges([*evs, ev(11, "unreserve", 0x4000, 0x100, 0x80)]) == [(0x2000, 0x100), (0x3000, 0x200)]


def test_outside_events_are_named_for_the_refusal() -> None:
    ev = region.Event
    evs = [ev(0, "alloc", 0x1000, 0x100, 1), ev(1, "outside", 0x7F0000000000, 4096, 4096, 2),
           ev(2, "refused", 0, 0, 64)]  # fmt: skip
    assert [e.seq for e in region.outside(evs)] == [1, 2]
    assert "cuMemAllocManaged" in evs[1].describe() and "0x7f0000000000" in evs[1].describe()
    assert region.outside(evs[:1]) == []


@needs_gcc
def test_interposer_builds_without_libcuda(tmp_path: Path) -> None:
    """gcc only (no CUDA headers); nothing links against libcuda, and the hooked entry points are exported."""
    so = region.build_interposer(tmp_path)
    needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
    assert "libcuda" not in needed
    syms = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
    for name in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemAllocPitch_v2", "cuMemAddressReserve", "cuMemAllocAsync",
                 "cuGetProcAddress", "cuGetProcAddress_v2", "cuModuleLoadData", "cuModuleLoadDataEx",
                 "cuModuleLoadFatBinary", "cuLibraryLoadData", "dlsym", "gp_region_info", "gp_events", "gp_images",
                 "gp_restore", "gp_freeze", "gp_add_kernel_nodes", "gp_add_edges", "cuMemMap",
                 "cuMemAllocManaged", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz",
                 "cuMemAllocAsync_ptsz", "cuMemUnmap", "gp_fault_inject", "gp_fault_pending",
                 "gp_free_ranges", "gp_kernel_node_attrs"):  # fmt: skip
        assert f" {name}\n" in syms, name


@needs_gcc
def test_reexec_keeps_the_interpreter_command_line_and_stops_a_loop(tmp_path: Path) -> None:
    """`python -c` (and -m) must survive the re-exec; a preload that does not take must not loop forever."""
    import os
    import sys

    code = (
        "import os, sys\nfrom graphpersist.memory import region\nregion.reexec_with_interposer()\n"
        "print('loaded', region.loaded(), os.environ.get('GP_REEXECED'), sys.argv)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(NATIVE.parents[1]), "GP_NATIVE_DIR": str(tmp_path)}
    env.pop("GP_REEXECED", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded True 1 ['-c']"
    looped = subprocess.run([sys.executable, "-c", code], env={**env, "GP_REEXECED": "1"}, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert looped.returncode != 0 and "still not loaded" in looped.stderr


def test_multicast_must_be_pinned_off() -> None:
    assert region.multicast_problems(dict(region.MULTICAST_OFF)) == []
    wrong = region.multicast_problems({"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    assert wrong == ["NCCL_NVLS_ENABLE='1' (need '0')", "NVSHMEM_DISABLE_NVLS=None (need '1')"]


def _build(out: Path, env: dict[str, str] | None = None) -> tuple[Path, str]:
    proc = subprocess.run(["sh", str(NATIVE / "build.sh"), str(out)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return out / region.LIB_NAME, proc.stderr


@needs_gcc
def test_build_is_clean_reproducible_and_needs_no_newer_glibc_than_2_28(tmp_path: Path) -> None:
    """What the platform wheel ships: no warnings, no CUDA toolkit, the same bytes from another folder, and only
    symbol versions a manylinux_2_28 host has (dlopen & co. bound to their old versions, libdl kept as needed)."""
    import os

    env = {**os.environ, "CUDA_HOME": str(tmp_path / "no-cuda"), "CPATH": ""}
    first, warnings = _build(tmp_path / "a", env)
    assert warnings == ""
    second, _ = _build(tmp_path / "b" / "deeper", env)
    assert first.read_bytes() == second.read_bytes()
    dyn = subprocess.run(["objdump", "-T", str(first)], capture_output=True, text=True, check=True).stdout
    versions = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"GLIBC_([0-9.]+)", dyn)}
    assert versions and max(versions) <= (2, 28), sorted(versions)
    needed = subprocess.run(["readelf", "-d", str(first)], capture_output=True, text=True, check=True).stdout
    assert "[libdl.so.2]" in needed and "[libpthread.so.0]" in needed and "libcuda" not in needed


FACTS = r"""
#include <stdio.h>
#include "gp_cuda.h"
#define V(e) printf("_Static_assert((long long)(%s) == %lldLL, \"%s\");\n", #e, (long long)(e), #e);
#define S(t) V(sizeof(t)) V(_Alignof(t))
#define O(t, f) V(offsetof(t, f)) V(sizeof(((t *)0)->f))
int main(void) {
    V(CUDA_SUCCESS) V(CUDA_ERROR_INVALID_VALUE) V(CUDA_ERROR_OUT_OF_MEMORY) V(CUDA_ERROR_NOT_INITIALIZED)
    V(CUDA_ERROR_INVALID_DEVICE) V(CUDA_ERROR_INVALID_CONTEXT) V(CUDA_ERROR_INVALID_HANDLE)
    V(CUDA_ERROR_NOT_SUPPORTED) V(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) V(CUDA_ERROR_UNKNOWN)
    V(CU_MEM_HANDLE_TYPE_NONE) V(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) V(CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    V(CU_MEM_LOCATION_TYPE_DEVICE) V(CU_MEM_ALLOCATION_TYPE_PINNED) V(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    V(CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) V(CU_GET_PROC_ADDRESS_SUCCESS) V(CU_JIT_MAX_REGISTERS)
    V(CU_LIBRARY_HOST_UNIVERSAL_FUNCTION_AND_DATA_TABLE) V(CU_LAUNCH_ATTRIBUTE_IGNORE)
    S(CUresult) S(cuuint64_t) S(CUdeviceptr) S(CUdevice) S(CUmemGenericAllocationHandle) S(CUipcMemHandle)
    S(CUmemAllocationHandleType) S(CUmemAccess_flags) S(CUmemLocationType) S(CUmemAllocationType)
    S(CUmemAllocationGranularity_flags) S(CUdriverProcAddressQueryResult) S(CUjit_option) S(CUlibraryOption)
    S(CUkernelNodeAttrID) S(CUkernelNodeAttrValue) S(CUmemLocation) S(CUmemAllocationProp) S(CUmemAccessDesc)
    S(CUDA_KERNEL_NODE_PARAMS)
    O(CUmemLocation, type) O(CUmemLocation, id) O(CUmemAccessDesc, location) O(CUmemAccessDesc, flags)
    O(CUmemAllocationProp, type) O(CUmemAllocationProp, requestedHandleTypes) O(CUmemAllocationProp, location)
    O(CUmemAllocationProp, win32HandleMetaData) O(CUmemAllocationProp, allocFlags)
    O(CUmemAllocationProp, allocFlags.compressionType) O(CUmemAllocationProp, allocFlags.usage)
    O(CUDA_KERNEL_NODE_PARAMS, func) O(CUDA_KERNEL_NODE_PARAMS, gridDimX) O(CUDA_KERNEL_NODE_PARAMS, gridDimZ)
    O(CUDA_KERNEL_NODE_PARAMS, blockDimX) O(CUDA_KERNEL_NODE_PARAMS, blockDimZ)
    O(CUDA_KERNEL_NODE_PARAMS, sharedMemBytes) O(CUDA_KERNEL_NODE_PARAMS, kernelParams)
    O(CUDA_KERNEL_NODE_PARAMS, extra) O(CUDA_KERNEL_NODE_PARAMS, kern) O(CUDA_KERNEL_NODE_PARAMS, ctx)
    return 0;
}
"""


@needs_gcc
@pytest.mark.skipif(not CUDA_H.exists(), reason=f"{CUDA_H} not present: gp_cuda.h cannot be compared with it here")
def test_own_cuda_declarations_match_the_cuda_13_header(tmp_path: Path) -> None:
    """gp_cuda.h stands in for cuda.h: every value, size, alignment and field offset it declares is printed as a
    static assertion and compiled against cuda.h, next to gp_cuda_api.h's prototypes redeclared after cuda.h's own
    (a prototype that differs does not compile)."""
    (tmp_path / "facts.c").write_text(FACTS)
    subprocess.run(["gcc", "-Wall", "-Werror", "-I", str(NATIVE), "-o", str(tmp_path / "facts"),
                    str(tmp_path / "facts.c")], check=True)  # fmt: skip
    asserts = subprocess.run([str(tmp_path / "facts")], capture_output=True, text=True, check=True).stdout
    assert asserts.count("_Static_assert") > 80
    (tmp_path / "check.c").write_text(
        '#include <stddef.h>\n#include <cuda.h>\n#include "gp_cuda_api.h"\n' + asserts + "int gp_check;\n"
    )
    proc = subprocess.run(["gcc", "-fsyntax-only", "-Wall", "-Werror", "-I", str(CUDA_H.parent), "-I", str(NATIVE),
                           str(tmp_path / "check.c")], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    broken = asserts.replace("== 900LL", "== 901LL")  # the check can fail: a wrong value does not compile
    (tmp_path / "check.c").write_text("#include <stddef.h>\n#include <cuda.h>\n" + broken + "int gp_check;\n")
    bad = subprocess.run(["gcc", "-fsyntax-only", "-I", str(CUDA_H.parent), str(tmp_path / "check.c")],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode != 0 and "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" in bad.stderr


def test_prebuilt_interposer_is_used_only_for_its_own_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wheel's library is loaded when its stamp names the sources beside it; otherwise the source build."""
    monkeypatch.setattr(region, "PREBUILT_DIR", tmp_path)
    monkeypatch.delenv("GP_NATIVE_DIR", raising=False)
    assert region.prebuilt_interposer() is None  # nothing shipped: a source checkout
    (tmp_path / region.LIB_NAME).write_bytes(b"\x7fELF")
    (tmp_path / region.PREBUILT_STAMP).write_text("0" * 64 + "\n")
    assert region.prebuilt_interposer() is None  # stale: built from other sources
    (tmp_path / region.PREBUILT_STAMP).write_text(region.sources_digest() + "\n")
    assert region.prebuilt_interposer() == tmp_path / region.LIB_NAME
    assert region.interposer_path() == tmp_path / region.LIB_NAME
    monkeypatch.setenv("GP_NATIVE_DIR", str(tmp_path / "own"))  # an explicit build folder wins
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / region.LIB_NAME).write_bytes(b"\x7fELF")
    assert region.interposer_path() == tmp_path / "own" / region.LIB_NAME
