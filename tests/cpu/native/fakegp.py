"""The child side of the rollback tests: a process started with the interposer preloaded over the fake driver
(GP_LIBCUDA=libfakecuda.so) drives the interposer's hooks and control surface through ctypes and reads the fake
driver's counters. Used by tests/cpu/test_native_rollback.py, which runs scenarios in such processes."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

MIB = 1 << 20
GRAN = 2 * MIB  # the fake driver's granularity
U64 = ctypes.c_uint64


class Range(ctypes.Structure):
    _fields_ = [("addr", U64), ("size", U64)]


class Info(ctypes.Structure):
    _fields_ = [(n, U64) for n in ("base", "size", "cursor", "gran")] + [
        (n, ctypes.c_int64) for n in ("enabled", "failed", "n_events", "n_images")
    ]


class Event(ctypes.Structure):
    _fields_ = [(n, U64) for n in ("seq", "addr", "size", "req")] + [
        ("kind", ctypes.c_uint32),
        ("detail", ctypes.c_uint32),
    ]


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


@dataclass(frozen=True)
class State:
    """Everything a failed call must leave as it was."""

    cursor: int
    events: tuple[tuple[int, int, int, int, int], ...]
    free: tuple[tuple[int, int], ...]
    handles: int
    mappings: int
    reservations: int


class Gp:
    def __init__(self) -> None:
        self.c = ctypes.CDLL(None)  # the preloaded interposer: its hooks and gp_* functions
        path = os.environ["GP_LIBCUDA"]
        self.fake = ctypes.CDLL(path) if os.path.exists(path) else None
        c, f = self.c, self.fake
        c.cuMemAlloc_v2.argtypes = [ctypes.POINTER(U64), ctypes.c_size_t]
        c.cuMemFree_v2.argtypes = [U64]
        c.cuMemAddressReserve.argtypes = [ctypes.POINTER(U64), ctypes.c_size_t, ctypes.c_size_t, U64, U64]
        c.cuMemAddressFree.argtypes = [U64, ctypes.c_size_t]
        c.cuMemMap.argtypes = [U64, ctypes.c_size_t, ctypes.c_size_t, U64, U64]
        c.cuMemUnmap.argtypes = [U64, ctypes.c_size_t]
        c.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, U64]
        c.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(U64), IpcHandle, ctypes.c_uint]
        c.cuIpcCloseMemHandle.argtypes = [U64]
        c.gp_fault_inject.argtypes = [ctypes.c_char_p, ctypes.c_long]
        c.gp_fault_pending.restype = ctypes.c_long
        c.gp_events.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        c.gp_events.restype = ctypes.c_size_t
        c.gp_free_ranges.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        c.gp_free_ranges.restype = ctypes.c_size_t
        c.gp_restore.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, U64, U64]
        c.gp_last_error.restype = ctypes.c_char_p
        c.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        c.cuMemAllocHost_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        c.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        c.gp_host_events.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        c.gp_host_events.restype = ctypes.c_size_t
        if f is not None:
            f.cuMemCreate.argtypes = [ctypes.POINTER(U64), ctypes.c_size_t, ctypes.c_void_p, U64]
            f.cuMemRelease.argtypes = [U64]
            f.fake_trace.restype = ctypes.c_char_p

    # ---- the hooks ----
    def alloc(self, size: int) -> tuple[int, int]:
        p = U64()
        return self.c.cuMemAlloc_v2(ctypes.byref(p), size), p.value

    def free(self, addr: int) -> int:
        return self.c.cuMemFree_v2(addr)

    def reserve(self, size: int, align: int = 0, hint: int = 0) -> tuple[int, int]:
        p = U64()
        return self.c.cuMemAddressReserve(ctypes.byref(p), size, align, hint, 0), p.value

    def address_free(self, addr: int, size: int) -> int:
        return self.c.cuMemAddressFree(addr, size)

    def create(self, size: int) -> int:
        """A physical allocation made by a library itself (not hooked: straight from the fake driver)."""
        h = U64()
        assert self.fake.cuMemCreate(ctypes.byref(h), size, None, 0) == 0
        return h.value

    def map(self, addr: int, size: int, handle: int) -> int:
        return self.c.cuMemMap(addr, size, 0, handle, 0)

    def unmap(self, addr: int, size: int) -> int:
        return self.c.cuMemUnmap(addr, size)

    def ipc_handle(self, addr: int) -> tuple[int, bytes]:
        buf = ctypes.create_string_buffer(64)
        return self.c.cuIpcGetMemHandle(buf, addr), buf.raw

    def ipc_open(self, raw: bytes) -> tuple[int, int]:
        p = U64()
        return self.c.cuIpcOpenMemHandle_v2(ctypes.byref(p), IpcHandle.from_buffer_copy(raw), 1), p.value

    def ipc_close(self, addr: int) -> int:
        return self.c.cuIpcCloseMemHandle(addr)

    def host_alloc(self, size: int, flags: int = 0) -> tuple[int, int]:
        p = ctypes.c_void_p()
        return self.c.cuMemHostAlloc(ctypes.byref(p), size, flags), p.value or 0

    def alloc_host(self, size: int) -> tuple[int, int]:
        p = ctypes.c_void_p()
        return self.c.cuMemAllocHost_v2(ctypes.byref(p), size), p.value or 0

    def free_host(self, addr: int) -> int:
        return self.c.cuMemFreeHost(addr)

    # ---- control surface ----
    def reserve_region(self) -> int:
        assert self.c.gp_reserve_now() == 0, self.error()
        return self.info().base

    def info(self) -> Info:
        raw = Info()
        self.c.gp_region_info(ctypes.byref(raw))
        return raw

    def fault(self, site: str, nth: int = 1) -> None:
        assert self.c.gp_fault_inject(site.encode(), nth) == 0, site

    def fault_pending(self) -> int:
        return self.c.gp_fault_pending()

    def events(self) -> list[tuple[int, int, int, int, int]]:
        n = self.c.gp_events(None, 0)
        buf = (Event * max(n, 1))()
        self.c.gp_events(buf, n)
        return [(e.kind, e.addr, e.size, e.req, e.detail) for e in buf[:n]]

    def host_events(self) -> list[tuple[int, int, int, int, int]]:
        n = self.c.gp_host_events(None, 0)
        buf = (Event * max(n, 1))()
        self.c.gp_host_events(buf, n)
        return [(e.kind, e.addr, e.size, e.req, e.detail) for e in buf[:n]]

    def host_info(self) -> tuple[int, int, int, int, int]:
        """(base, size, cursor, reserved, n_events) of the pinned host range."""
        raw = (U64 * 5)()  # gp_host_info_t: three uint64 then two int64, all 8 bytes
        self.c.gp_host_info(raw)
        return tuple(ctypes.c_int64(v).value if i >= 3 else v for i, v in enumerate(raw))

    def free_list(self) -> list[tuple[int, int]]:
        n = self.c.gp_free_ranges(None, 0)
        buf = (Range * max(n, 1))()
        self.c.gp_free_ranges(buf, n)
        return [(r.addr, r.size) for r in buf[:n]]

    def restore(self, ranges: list[tuple[int, int]], expect_events: int, final_offset: int) -> int:
        addrs = (U64 * max(len(ranges), 1))(*[a for a, _ in ranges])
        sizes = (U64 * max(len(ranges), 1))(*[s for _, s in ranges])
        return self.c.gp_restore(addrs, sizes, len(ranges), expect_events, final_offset)

    def freeze(self) -> None:
        self.c.gp_freeze()

    def error(self) -> str:
        return (self.c.gp_last_error() or b"").decode()

    # ---- the fake driver's view ----
    def state(self) -> State:
        f = self.fake
        return State(self.info().cursor, tuple(self.events()), tuple(self.free_list()), f.fake_live_handles(),
                     f.fake_live_mappings(), f.fake_live_reservations())  # fmt: skip

    def trace(self) -> list[str]:
        return [t.split(":")[0] for t in self.fake.fake_trace().decode().split()]
