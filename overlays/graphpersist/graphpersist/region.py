"""Control of the native interposer (native/interposer.c) from Python, through ctypes.

The interposer is loaded with LD_PRELOAD before any CUDA library starts, reserves one fixed virtual range at
the first device allocation and places every allocation at a deterministic bump cursor. This module reads its
bookkeeping (region, allocation events, recorded kernel images) and drives LOAD's fixed mappings.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent / "native"
LIB_NAME = "libgpinterpose.so"
DEFAULT_BASE = 0x500000000000  # far below the mmap area (0x7f..), where ASLR placed libraries over 0x7f0000000000
DEFAULT_SIZE = 128 << 30

EV_ALLOC, EV_FREE, EV_RESERVE, EV_MAP_FIXED, EV_REFUSED, EV_OUTSIDE = 1, 2, 3, 4, 5, 6
EVENT_KINDS = {1: "alloc", 2: "free", 3: "reserve", 4: "map_fixed", 5: "refused", 6: "outside"}
IMAGE_KINDS = {1: "module", 2: "module-ex", 3: "fatbinary", 4: "library"}


class RegionError(RuntimeError):
    """The deterministic address space is missing, broken, or does not match what an archive expects."""


class _Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("base", "size", "cursor", "gran")] + [
        (n, ctypes.c_int64) for n in ("enabled", "failed", "n_events", "n_images")
    ]


class _Event(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("seq", "addr", "size", "req")] + [
        ("kind", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class _Image(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("seq", "handle", "ptr", "size")] + [
        ("kind", ctypes.c_uint32),
        ("owned", ctypes.c_uint32),
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
    """One allocation event; `seq` orders them, (kind, addr, size) is what SAVE and LOAD compare."""

    seq: int
    kind: str
    addr: int
    size: int
    req: int

    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.addr, self.size)


@dataclass(frozen=True)
class ImageLoad:
    """One module/library load the interposer saw; `ptr`/`size` stay readable for the process's lifetime."""

    seq: int
    kind: str
    handle: int
    ptr: int
    size: int

    def data(self) -> bytes:
        return ctypes.string_at(self.ptr, self.size)


def native_build_dir() -> Path:
    """Where the compiled interposer lives: $GP_NATIVE_DIR, else beside the sources when that folder is writable
    (a source checkout, a user's venv), else the user's cache (a read-only site-packages). The folder name carries
    a hash of the sources, so a new release never picks up an old build."""
    if os.environ.get("GP_NATIVE_DIR"):
        return Path(os.environ["GP_NATIVE_DIR"])
    digest = hashlib.sha256()
    for name in ("interposer.c", "gp_core.c", "gp_core.h", "build.sh"):
        digest.update((NATIVE_DIR / name).read_bytes())
    tag = digest.hexdigest()[:16]
    if os.access(NATIVE_DIR, os.W_OK):
        return NATIVE_DIR / "build" / tag
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "graphpersist" / "native" / tag


def build_interposer(out_dir: Path | None = None) -> Path:
    """Compiles the interposer with gcc against the CUDA headers (no libcuda needed); returns the .so path.

    It builds into a private folder and renames the results into place, so ranks that start together and all
    build on first use never load a half-written library.
    """
    out = out_dir or native_build_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
        proc = subprocess.run(["sh", str(NATIVE_DIR / "build.sh"), tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RegionError(
                f"building the interposer failed (gcc and the CUDA headers in $CUDA_HOME or /usr/local/cuda are "
                f"needed):\n{proc.stdout}{proc.stderr}"
            )
        for built in Path(tmp).glob("*.so"):
            os.replace(built, out / built.name)
    return out / LIB_NAME


def interposer_path() -> Path:
    """The built interposer, building it on first use."""
    path = native_build_dir() / LIB_NAME
    if not path.exists():
        build_interposer(path.parent)
    return path


def preload_env(base: int = DEFAULT_BASE, size: int = DEFAULT_SIZE, env: dict[str, str] | None = None) -> dict:
    """The environment a worker process needs so the interposer is active from its first CUDA call."""
    env = dict(os.environ if env is None else env)
    lib = str(interposer_path())
    pre = [p for p in env.get("LD_PRELOAD", "").split(":") if p and LIB_NAME not in p]
    env["LD_PRELOAD"] = ":".join([lib, *pre])
    env["GP_REGION_BASE"] = hex(base)
    env["GP_REGION_SIZE"] = str(size)
    return env


def reexec_with_interposer(base: int = DEFAULT_BASE, size: int = DEFAULT_SIZE) -> None:
    """Re-executes this Python process under the interposer unless it is already loaded (call it first thing)."""
    if loaded():
        return
    env = preload_env(base, size)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


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
                f"LD_PRELOAD={interposer_path()} GP_REGION_BASE=0x... (see graphpersist.region.preload_env)"
            )
        cdll = ctypes.CDLL(None)
        cdll.gp_region_info.argtypes = [ctypes.POINTER(_Info)]
        cdll.gp_events.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        cdll.gp_events.restype = ctypes.c_size_t
        cdll.gp_images.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        cdll.gp_images.restype = ctypes.c_size_t
        cdll.gp_set_cursor.argtypes = [ctypes.c_uint64]
        cdll.gp_map_fixed.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        cdll.gp_enable.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        cdll.gp_last_error.restype = ctypes.c_char_p
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
    return [Event(e.seq, EVENT_KINDS.get(e.kind, str(e.kind)), e.addr, e.size, e.req) for e in buf[:n]]


def image_loads() -> list[ImageLoad]:
    n = lib().gp_images(None, 0)
    buf = (_Image * max(n, 1))()
    n = min(n, lib().gp_images(buf, n))
    return [ImageLoad(m.seq, IMAGE_KINDS.get(m.kind, str(m.kind)), m.handle, m.ptr, m.size) for m in buf[:n]]


def set_cursor(offset: int) -> None:
    if lib().gp_set_cursor(offset) != 0:
        raise RegionError(f"cannot move the region cursor to offset {offset:#x} (now {info().cursor:#x})")


def map_fixed(addr: int, size: int) -> None:
    """Maps fresh device memory at exactly `addr` (LOAD recreating memory the graphs reference)."""
    if lib().gp_map_fixed(addr, size) != 0:
        raise RegionError(f"cannot map {size} bytes at {addr:#x}: {last_error()}")


def live_ranges(evs: list[Event]) -> list[tuple[int, int]]:
    """(addr, size) of allocations still live after `evs` (allocated or fixed-mapped, not freed)."""
    live: dict[int, int] = {}
    for e in evs:
        if e.kind in ("alloc", "map_fixed"):
            live[e.addr] = e.size
        elif e.kind == "free":
            live.pop(e.addr, None)
    return sorted(live.items())


def plan_restore(saved: list[Event], setup_n: int, live: list[Event]) -> list[tuple[int, int]]:
    """What LOAD must map: SAVE's capture-time allocations still live at SAVE, after proving the setup matches.

    `live` (this process's events so far) must equal SAVE's first `setup_n` events exactly; the first event
    that differs aborts with both addresses. Returns the (addr, size) ranges to map at their recorded addresses.
    """
    for i, ev in enumerate(live):
        if i >= setup_n:
            raise RegionError(
                f"allocation event {i} ({ev.kind} {ev.size} bytes at {ev.addr:#x}) happened after the setup that "
                f"SAVE recorded ({setup_n} events): LOAD must run before any further allocation"
            )
        want = saved[i]
        if ev.key() != want.key():
            raise RegionError(
                f"address drift at allocation event {i}: saved {want.kind} {want.size} bytes at {want.addr:#x}, "
                f"live {ev.kind} {ev.size} bytes at {ev.addr:#x} (setup code or its inputs differ)"
            )
    if len(live) != setup_n:
        raise RegionError(f"setup made {len(live)} allocation events, SAVE recorded {setup_n}")
    for kind in sorted({e.kind for e in saved[setup_n:]} - {"alloc", "free"}):
        raise RegionError(f"capture-time allocation kind {kind!r} is not restorable yet")
    before = {a for a, _ in live_ranges(saved[:setup_n])}
    return [(a, s) for a, s in live_ranges(saved) if a not in before]
