"""Control of the native interposer (native/, gp_state.h lists its sources) from Python, through ctypes.

The interposer is loaded with LD_PRELOAD before any CUDA library starts, reserves one fixed virtual range at
the first device allocation and places every allocation at a deterministic bump cursor. This module reads its
bookkeeping (region, allocation events, recorded kernel images) and drives LOAD's fixed mappings.
"""

from __future__ import annotations

import ctypes
import hashlib
import heapq
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parents[1] / "native"
LIB_NAME = "libgpinterpose.so"
DEFAULT_BASE = 0x500000000000  # far below the mmap area (0x7f..), where ASLR placed libraries over 0x7f0000000000
DEFAULT_SIZE = None  # the interposer reserves 4x the device's memory (GP_SIZE_FACTOR) unless told otherwise
# GP_HOST_BASE for pinned host memory graphs read (native/gp_host.c; opt-in: unset leaves it to the driver), 16 TiB
# below the region's default
DEFAULT_HOST_BASE = 0x4F0000000000

# Allocation event kinds (native enum gp_event_kind), by number and by the name the archive's log uses.
# lib_map / lib_unmap: memory a library mapped itself into a reservation the region carved for it (torch's expandable
# segments, NCCL's buffers), `req` holding the offset inside the reservation.
EVENT_KINDS = {1: "alloc", 2: "free", 3: "reserve", 4: "map_fixed", 5: "refused", 6: "outside", 7: "unreserve",
               8: "ipc_open", 9: "ipc_close", 10: "lib_map", 11: "lib_unmap"}  # fmt: skip
(EV_ALLOC, EV_FREE, EV_RESERVE, EV_MAP_FIXED, EV_REFUSED, EV_OUTSIDE, EV_UNRESERVE, EV_IPC_OPEN,
 EV_IPC_CLOSE, EV_LIB_MAP, EV_LIB_UNMAP) = EVENT_KINDS  # fmt: skip
# Why device memory landed outside the region (native enum gp_outside_why); SAVE refuses any of them.
OUTSIDE_WHY = {
    1: "cuMemAlloc before the region was enabled",
    2: "cuMemAllocManaged (managed memory is not placed in the region)",
    3: "cuMemAddressReserve at a caller-chosen address",
    4: "cuMemMap into a range the region did not hand out",
}
# Pinned host memory (native gp_host.c): its own log, never mixed into the device allocation log phases compare.
HOST_KINDS = {12: "host_alloc", 13: "host_free", 14: "host_outside"}
# Why pinned host memory was left to the driver (native enum gp_host_outside_why); a graph reading it is refused.
HOST_OUTSIDE_WHY = {
    1: "allocated before the region was enabled",
    2: "write-combined (cuMemHostRegister cannot make it)",
    3: "host placement is off (GP_HOST_BASE unset or 0; set it to place pinned memory graphs read)",
    4: "the pinned host range could not be reserved at GP_HOST_BASE",
    5: "the pinned host range is full (raise GP_HOST_SIZE)",
    6: "cuMemHostRegister failed",
    7: "this device's pointer to it differs from the host address",
}
IMAGE_KINDS = {1: "module", 2: "module-ex", 3: "fatbinary", 4: "library"}
IMAGE_FORMATS = {0: "unknown", 1: "fatbin", 2: "elf", 3: "ptx"}


class RegionError(RuntimeError):
    """The deterministic address space is missing, broken, or does not match what an archive expects."""


class _Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("base", "size", "cursor", "gran")] + [
        (n, ctypes.c_int64) for n in ("enabled", "failed", "n_events", "n_images")
    ]


class _Event(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("seq", "addr", "size", "req")] + [
        ("kind", ctypes.c_uint32),
        ("detail", ctypes.c_uint32),
    ]


class _HostInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("base", "size", "cursor")] + [
        (n, ctypes.c_int64) for n in ("reserved", "n_events")
    ]


class _Image(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("seq", "handle", "ptr", "size")] + [
        (n, ctypes.c_uint32) for n in ("kind", "owned", "format", "n_jit")
    ]


@dataclass(frozen=True)
class RegionInfo:
    """Where the region lies and how far the bump cursor got (offset from base)."""

    base: int
    size: int
    cursor: int
    granularity: int
    enabled: bool
    failed: bool
    n_events: int
    n_images: int


@dataclass(frozen=True)
class Event:
    """One allocation event; `seq` orders them, (kind, addr, size, req) is what SAVE and LOAD compare."""

    seq: int
    kind: str
    addr: int
    size: int
    req: int
    detail: int = 0

    def key(self) -> tuple[str, int, int, int]:
        return (self.kind, self.addr, self.size, self.req)

    def describe(self) -> str:
        what = f"{self.kind} of {self.req} bytes at {self.addr:#x}"
        if self.kind == "host_outside":
            return f"{what} ({HOST_OUTSIDE_WHY.get(self.detail, 'unknown reason')})"
        return f"{what} ({OUTSIDE_WHY.get(self.detail, 'unknown reason')})" if self.kind == "outside" else what


@dataclass(frozen=True)
class ImageLoad:
    """One module/library load the interposer saw; `ptr`/`size` stay readable for the process's lifetime."""

    seq: int
    kind: str
    handle: int
    ptr: int
    size: int
    format: str = "unknown"
    n_jit: int = 0

    def data(self) -> bytes:
        return ctypes.string_at(self.ptr, self.size)


PREBUILT_DIR = NATIVE_DIR / "prebuilt"  # the runtime wheel's build: the library and the digest of its sources
PREBUILT_STAMP = "SOURCES.sha256"


def native_sources() -> list[Path]:
    """Every file the interposer build reads (C sources, headers, build.sh), in a fixed order."""
    files = [p for p in NATIVE_DIR.iterdir() if p.is_file() and p.suffix in (".c", ".h", ".sh")]
    return sorted(files, key=lambda p: p.name)


def sources_digest() -> str:
    """sha256 over the interposer's sources: names a build, so a library is never used with other sources."""
    digest = hashlib.sha256()
    for path in native_sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def native_build_dir() -> Path:
    """Where a source build of the interposer lives: $GP_NATIVE_DIR, else beside the sources when that folder is
    writable (a source checkout, a user's venv), else the user's cache (a read-only site-packages). The folder name
    carries a hash of the sources, so a new release never picks up an old build."""
    if os.environ.get("GP_NATIVE_DIR"):
        return Path(os.environ["GP_NATIVE_DIR"])
    tag = sources_digest()[:16]
    if os.access(NATIVE_DIR, os.W_OK):
        return NATIVE_DIR / "build" / tag
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "graphpersist" / "native" / tag


def build_interposer(out_dir: Path | None = None) -> Path:
    """Compiles the interposer with gcc (no CUDA toolkit, no libcuda needed); returns the .so path.

    It builds into a private folder and renames the results into place, so ranks that start together and all
    build on first use never load a half-written library.
    """
    out = out_dir or native_build_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        try:
            proc = subprocess.run(["sh", str(NATIVE_DIR / "build.sh"), tmp], capture_output=True, text=True)
        except OSError as exc:
            raise RegionError(f"building the interposer failed: {exc}") from None
        if proc.returncode != 0:
            raise RegionError(
                "building the interposer from source failed (this install has no prebuilt library for these "
                f"sources, so gcc is needed; install the platform wheel to avoid the build):\n{proc.stdout}"
                f"{proc.stderr}"
            )
        for built in Path(tmp).glob("*.so"):
            os.replace(built, out / built.name)
    return out / LIB_NAME


def prebuilt_interposer() -> Path | None:
    """The library the runtime wheel ships, when it was built from exactly the sources beside it."""
    lib, stamp = PREBUILT_DIR / LIB_NAME, PREBUILT_DIR / PREBUILT_STAMP
    try:
        return lib if lib.is_file() and stamp.read_text().strip() == sources_digest() else None
    except OSError:
        return None


def interposer_path() -> Path:
    """The interposer to preload: $GP_NATIVE_DIR's build if set; else the wheel's prebuilt library; else a build
    from the shipped sources (a source checkout, or sources changed after the wheel was built), made on first use."""
    if not os.environ.get("GP_NATIVE_DIR") and (prebuilt := prebuilt_interposer()) is not None:
        return prebuilt
    path = native_build_dir() / LIB_NAME
    if not path.exists():
        build_interposer(path.parent)
    return path


def preload_env(base: int = DEFAULT_BASE, size: int | None = DEFAULT_SIZE, env: dict[str, str] | None = None) -> dict:
    """The environment a worker process needs so the interposer is active from its first CUDA call.

    `size` None keeps the interposer's default (4x the device's memory) unless GP_REGION_SIZE is already set.
    """
    env = dict(os.environ if env is None else env)
    lib = str(interposer_path())
    pre = [p for p in env.get("LD_PRELOAD", "").split(":") if p and LIB_NAME not in p]
    env["LD_PRELOAD"] = ":".join([lib, *pre])
    env["GP_REGION_BASE"] = hex(base)
    if size is not None:
        env["GP_REGION_SIZE"] = str(size)
    return env


REEXEC_GUARD = "GP_REEXECED"


def reexec_with_interposer(base: int = DEFAULT_BASE, size: int | None = DEFAULT_SIZE) -> None:
    """Re-executes this Python process under the interposer unless it is already loaded (call it first thing).

    The command line is the interpreter's own (`sys.orig_argv`), so `python -m pkg`, `python -c ...` and option
    flags survive. A guard variable stops a loop when the preload does not take (e.g. a setuid interpreter).
    """
    if loaded():
        return
    if os.environ.get(REEXEC_GUARD):
        raise RegionError(
            f"re-executed with LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r} but the interposer is still not "
            "loaded: check that the library exists and that the loader honours LD_PRELOAD for this interpreter"
        )
    env = preload_env(base, size)
    env[REEXEC_GUARD] = "1"
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)


_lib: ctypes.CDLL | None = None


def loaded() -> bool:
    """Whether the interposer is in this process (LD_PRELOAD'ed)."""
    try:
        return hasattr(ctypes.CDLL(None), "gp_region_info")
    except OSError:
        return False


def lib() -> ctypes.CDLL:
    """The interposer's control surface; refuses when the process was not started under LD_PRELOAD."""
    global _lib
    if _lib is None:
        if not loaded():
            raise RegionError(
                "the graphpersist interposer is not loaded: start the process with "
                f"LD_PRELOAD={interposer_path()} GP_REGION_BASE=0x... (see graphpersist.memory.region.preload_env)"
            )
        cdll = ctypes.CDLL(None)
        cdll.gp_region_info.argtypes = [ctypes.POINTER(_Info)]
        cdll.gp_events.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        cdll.gp_events.restype = ctypes.c_size_t
        cdll.gp_images.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        cdll.gp_images.restype = ctypes.c_size_t
        cdll.gp_restore.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64,
                                    ctypes.c_uint64]  # fmt: skip
        cdll.gp_set_cursor.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        cdll.gp_enable.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        cdll.gp_last_error.restype = ctypes.c_char_p
        cdll.gp_host_info.argtypes = [ctypes.POINTER(_HostInfo)]
        cdll.gp_host_events.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        cdll.gp_host_events.restype = ctypes.c_size_t
        cdll.gp_kernel_node_attrs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                              ctypes.c_void_p]  # fmt: skip
        cdll.gp_func_param_layout.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        cdll.gp_func_param_layout.restype = ctypes.c_long
        cdll.gp_add_kernel_nodes.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_size_t),
        ]  # fmt: skip
        _lib = cdll
    return _lib


def info() -> RegionInfo:
    raw = _Info()
    lib().gp_region_info(ctypes.byref(raw))
    return RegionInfo(
        raw.base, raw.size, raw.cursor, raw.gran, bool(raw.enabled), bool(raw.failed), raw.n_events, raw.n_images
    )


def last_error() -> str:
    return (lib().gp_last_error() or b"").decode(errors="replace")


def start(base: int | None = None, size: int | None = None) -> RegionInfo:
    """Makes sure the region exists now (a CUDA context must be current, e.g. after torch.cuda.init())."""
    if base is not None and lib().gp_enable(base, size or 0) != 0 and info().base != base:
        raise RegionError(f"the region already lies at {info().base:#x}, not {base:#x}")
    if lib().gp_reserve_now() != 0:
        raise RegionError(f"the region could not be reserved: {last_error() or 'GP_REGION_BASE is not set'}")
    return info()


def events() -> list[Event]:
    n = lib().gp_events(None, 0)
    buf = (_Event * max(n, 1))()
    n = min(n, lib().gp_events(buf, n))
    return [Event(e.seq, EVENT_KINDS.get(e.kind, str(e.kind)), e.addr, e.size, e.req, e.detail) for e in buf[:n]]


@dataclass(frozen=True)
class HostInfo:
    """The pinned host range: where it lies (base 0: placement off), its cursor, whether it is reserved (1) or
    could not be (-1), and how many host events there are."""

    base: int
    size: int
    cursor: int
    reserved: int
    n_events: int


def host_info() -> HostInfo:
    raw = _HostInfo()
    lib().gp_host_info(ctypes.byref(raw))
    return HostInfo(raw.base, raw.size, raw.cursor, raw.reserved, raw.n_events)


def host_events() -> list[Event]:
    """The pinned host memory log: host_alloc (placed), host_outside (left to the driver), host_free."""
    n = lib().gp_host_events(None, 0)
    buf = (_Event * max(n, 1))()
    n = min(n, lib().gp_host_events(buf, n))
    return [Event(e.seq, HOST_KINDS.get(e.kind, str(e.kind)), e.addr, e.size, e.req, e.detail) for e in buf[:n]]


def host_live(evs: list[Event], placed: bool = True) -> list[tuple[int, int]]:
    """(addr, size) of pinned host memory live after `evs`, sorted: the placed allocations (`placed`), or those
    left to the driver."""
    live: dict[int, int] = {}
    want = "host_alloc" if placed else "host_outside"
    for e in evs:
        if e.kind == want:
            live[e.addr] = e.size
        elif e.kind == "host_free":
            live.pop(e.addr, None)
    return sorted(live.items())


def image_loads() -> list[ImageLoad]:
    n = lib().gp_images(None, 0)
    buf = (_Image * max(n, 1))()
    n = min(n, lib().gp_images(buf, n))
    return [
        ImageLoad(m.seq, IMAGE_KINDS.get(m.kind, str(m.kind)), m.handle, m.ptr, m.size,
                  IMAGE_FORMATS.get(m.format, "unknown"), m.n_jit)
        for m in buf[:n]
    ]  # fmt: skip


def restore(ranges: list[tuple[int, int]], expect_events: int, final_offset: int) -> None:
    """Maps fresh device memory at exactly each (addr, size) and moves the cursor to SAVE's final offset, as
    one locked native step that refuses if any allocation happened after the caller read `expect_events`."""
    addrs = (ctypes.c_uint64 * max(len(ranges), 1))(*[a for a, _ in ranges])
    sizes = (ctypes.c_uint64 * max(len(ranges), 1))(*[s for _, s in ranges])
    if lib().gp_restore(addrs, sizes, len(ranges), expect_events, final_offset) != 0:
        raise RegionError(f"restoring SAVE's memory layout failed: {last_error()}")


def set_cursor(offset: int, expect_events: int) -> None:
    """Moves the bump cursor forward to region offset `offset` (a phase's anchor), as one locked native step that
    refuses moving backwards, onto live memory, or after an allocation the caller has not seen."""
    if lib().gp_set_cursor(offset, expect_events) != 0:
        raise RegionError(last_error())


def freeze() -> None:
    """The layout is saved or restored: freed ranges may now be reused (long-lived engines churn memory)."""
    lib().gp_freeze()


def live_ranges(evs: list[Event]) -> list[tuple[int, int]]:
    """(addr, size) of region memory still live after `evs`: allocated, fixed-mapped, a peer's allocation mapped by
    IPC (opened in setup, same place every time) or mapped by a library into a reservation the region carved
    (`lib_map`), and not freed, closed or unmapped since. A reservation alone is address space, not memory: a graph
    pointer into it is backed only where something is mapped there."""
    made: dict[int, tuple[int, int]] = {}  # address -> (when, size) of the last mapping made there
    gone: dict[int, int] = {}  # address -> when it was last freed or closed
    unmaps: list[tuple[int, int, int]] = []  # (start, end, when) of each unmap, which may span several mappings
    for i, e in enumerate(evs):
        if e.kind in ("alloc", "map_fixed", "ipc_open", "lib_map"):
            made[e.addr] = (i, e.size)
        elif e.kind in ("free", "ipc_close"):
            gone[e.addr] = i
        elif e.kind in ("lib_unmap", "unreserve"):
            unmaps.append((e.addr, e.addr + e.size, i))
    # A mapping is live when nothing removed it after it was made: its own free, or an unmap over its address. The
    # latest unmap over each address comes from one sweep in address order (a heap of the unmaps begun so far), so a
    # log of many mappings and unmaps costs n log n, not n squared.
    unmaps.sort()
    latest: list[tuple[int, int]] = []  # (-when, end) of the unmaps begun at or before the address
    k, out = 0, []
    for addr in sorted(made):
        when, size = made[addr]
        while k < len(unmaps) and unmaps[k][0] <= addr:
            heapq.heappush(latest, (-unmaps[k][2], unmaps[k][1]))
            k += 1
        while latest and latest[0][1] <= addr:  # ended below this address: it covers no later one either
            heapq.heappop(latest)
        if gone.get(addr, -1) < when and (not latest or -latest[0][0] < when):
            out.append((addr, size))
    return out


# NVLink multicast objects (NVLS, torch symmetric-memory multicast, NVSHMEM NVLS) are not placed in the region:
# a multi-rank SAVE requires them off.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_problems(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """`NAME=value (need X)` for each multicast switch that is not pinned off."""
    return [f"{k}={environ.get(k)!r} (need {v!r})" for k, v in MULTICAST_OFF.items() if environ.get(k) != v]


def outside(evs: list[Event]) -> list[Event]:
    """Device memory that bypassed the region (or was refused): a graph may point into it, so SAVE refuses."""
    return [e for e in evs if e.kind in ("outside", "refused")]
