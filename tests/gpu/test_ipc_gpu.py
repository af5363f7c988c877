"""GPU test: VMM-IPC through the interposer between two processes, and who owns what.

An exporter process allocates a plain buffer (cuMemAlloc) and a pitched one (cuMemAllocPitch) inside its region,
fills them and exports both with cuIpcGetMemHandle. An importer process opens them (on the second GPU when there
is one): the same handle opened twice gives the same mapping, the pitched export covers pitch x height, the data
is the exporter's. The handles use the default transport (SCM_RIGHTS from the exporter's server thread), and the
importer has pidfd_getfd blocked by a seccomp filter (as in container default profiles), so it cannot fall back to
it. Then the exporter exits while the importer still holds a mapping: the mapping keeps working until the
importer's last close, after which it is gone; a third close and a new open from the dead exporter are refused
with errors, and a handle that is not ours goes to the driver's legacy path.

Run: `python3 -m pytest -m gpu tests/gpu/test_ipc_gpu.py` on a GPU host (torch, cuda-bindings, gcc).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "overlays" / "graphpersist"
F_SCM = 2  # gp_ipc.h: the handle's transport flag (bytes 6..7)
N = 3 << 20  # plain buffer: 3 MiB (two granules when mapped)
WIDTH, HEIGHT = 1000, 37  # pitched buffer: bytes per row, rows


def _ck(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


def _wait_for(path: Path, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


def exporter(work: Path) -> dict[str, Any]:
    import torch
    from cuda.bindings import driver as drv

    from graphpersist import api

    torch.cuda.set_device(0)
    api.start_region()
    plain = int(_ck(drv.cuMemAlloc(N), "cuMemAlloc"))
    _ck(drv.cuMemsetD32(plain, 0xA5A5A5A5, N // 4), "cuMemsetD32")
    pitched, pitch = _ck(drv.cuMemAllocPitch(WIDTH, HEIGHT, 4), "cuMemAllocPitch")
    pitched = int(pitched)
    _ck(drv.cuMemsetD8(pitched, 0x3C, int(pitch) * HEIGHT), "cuMemsetD8")
    h1 = bytes(_ck(drv.cuIpcGetMemHandle(plain), "cuIpcGetMemHandle").reserved)
    h1_again = bytes(_ck(drv.cuIpcGetMemHandle(plain + 4096), "cuIpcGetMemHandle").reserved)
    h2 = bytes(_ck(drv.cuIpcGetMemHandle(pitched), "cuIpcGetMemHandle").reserved)
    info = {"pid": os.getpid(), "plain": h1.hex(), "plain_inner": h1_again.hex(), "pitched": h2.hex(),
            "pitch": int(pitch)}  # fmt: skip
    (work / "handles.json").write_text(json.dumps(info))
    _wait_for(work / "exporter-may-exit")
    return {"exported": True}


def importer(work: Path) -> dict[str, Any]:
    import torch
    from cuda.bindings import driver as drv

    from graphpersist import api
    from graphpersist.memory import region

    sys.path.insert(0, str(REPO / "tests"))
    import seccomp_block

    dev = 1 if torch.cuda.device_count() > 1 else 0
    torch.cuda.set_device(dev)
    api.start_region()
    out: dict[str, Any] = {"device": dev, "pidfd_getfd_blocked": False}
    if seccomp_block.supported():
        seccomp_block.block_pidfd_getfd()
        libc = ctypes.CDLL(None, use_errno=True)
        pidfd = libc.syscall(434, os.getpid(), 0)  # pidfd_open (allowed), then pidfd_getfd on ourselves
        got = libc.syscall(438, pidfd, 0, 0) if pidfd >= 0 else 0
        out["pidfd_getfd_blocked"] = got < 0 and ctypes.get_errno() == errno.EPERM
        for fd in (pidfd, got):
            if fd >= 0:
                os.close(fd)
    _wait_for(work / "handles.json")
    info = json.loads((work / "handles.json").read_text())
    lazy = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

    def handle(hexed: str) -> Any:
        h = drv.CUipcMemHandle()
        h.reserved = bytes.fromhex(hexed)
        return h

    def read(ptr: int, n: int) -> bytes | str:
        buf = bytearray(n)
        err = drv.cuMemcpyDtoH(buf, ptr, n)[0]
        return bytes(buf) if int(err) == 0 else err.name

    out["inner_handle_same"] = info["plain"] == info["plain_inner"]
    out["transports"] = [struct.unpack_from("<H", bytes.fromhex(info[k]), 6)[0] for k in ("plain", "pitched")]
    a = int(_ck(drv.cuIpcOpenMemHandle(handle(info["plain"]), lazy), "open plain"))
    a2 = int(_ck(drv.cuIpcOpenMemHandle(handle(info["plain"]), lazy), "open plain again"))
    p = int(_ck(drv.cuIpcOpenMemHandle(handle(info["pitched"]), lazy), "open pitched"))
    base, size = region.info().base, region.info().size
    out["same_mapping_twice"] = a == a2
    out["mapped_in_region"] = all(base <= x < base + size for x in (a, p))
    out["plain_data"] = read(a, N) == bytes([0xA5]) * N
    rows = info["pitch"] * HEIGHT
    out["pitch"] = info["pitch"]
    out["pitched_data"] = read(p, rows) == bytes([0x3C]) * rows
    _ck(drv.cuIpcCloseMemHandle(a), "close plain (1 of 2)")
    out["readable_after_first_close"] = read(a, 64) == bytes([0xA5]) * 64
    (work / "importer-phase1").write_text("done")
    _wait_for(work / "exporter-gone")
    out["readable_after_exporter_exit"] = read(a, N) == bytes([0xA5]) * N
    _ck(drv.cuIpcCloseMemHandle(a), "close plain (2 of 2)")
    gone = read(a, 64)
    out["after_last_close"] = gone if isinstance(gone, str) else "READABLE"
    out["third_close"] = drv.cuIpcCloseMemHandle(a)[0].name
    err, _ = drv.cuIpcOpenMemHandle(handle(info["plain"]), lazy)
    out["open_from_dead_exporter"] = err.name
    out["open_error_message"] = region.last_error()
    err, _ = drv.cuIpcOpenMemHandle(handle(os.urandom(64).hex()), lazy)
    out["legacy_garbage_handle"] = err.name
    _ck(drv.cuIpcCloseMemHandle(p), "close pitched")
    out["events"] = [(e.kind, e.size) for e in region.events() if e.kind.startswith("ipc_")]
    return out


def main() -> int:
    sys.path.insert(0, str(OVERLAY))
    from graphpersist.memory import region

    region.reexec_with_interposer()
    role, work, result = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    data = exporter(work) if role == "exporter" else importer(work)
    result.write_text(json.dumps(data, default=str))
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_ipc_ownership_and_lifetimes(tmp_path: Path) -> None:
    from graphpersist.memory import region

    env = region.preload_env()
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(OVERLAY), env.get("PYTHONPATH", "")])

    def start(role: str) -> subprocess.Popen:
        log = open(tmp_path / f"{role}.log", "w")  # noqa: SIM115 - the child owns it
        return subprocess.Popen([sys.executable, __file__, role, str(tmp_path), str(tmp_path / f"{role}.json")],
                                env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    exp, imp = start("exporter"), start("importer")
    try:
        _wait_for(tmp_path / "importer-phase1", timeout=180)
        (tmp_path / "exporter-may-exit").write_text("go")
        assert exp.wait(timeout=60) == 0, (tmp_path / "exporter.log").read_text()[-3000:]
        (tmp_path / "exporter-gone").write_text("gone")
        assert imp.wait(timeout=60) == 0, (tmp_path / "importer.log").read_text()[-3000:]
    finally:
        for p in (exp, imp):
            if p.poll() is None:
                p.kill()
    r = json.loads((tmp_path / "importer.json").read_text())
    print(json.dumps(r, indent=1))
    assert r["inner_handle_same"], "a handle names the whole allocation, as legacy IPC does"
    assert r["transports"] == [F_SCM, F_SCM], "the default transport is SCM_RIGHTS"
    assert r["pidfd_getfd_blocked"], "the importer must run with pidfd_getfd blocked (seccomp) to prove SCM needs none"
    assert r["same_mapping_twice"] and r["mapped_in_region"], r
    assert r["plain_data"] and r["pitched_data"] and r["pitch"] >= 1000 and r["pitch"] % 512 == 0, r
    assert r["readable_after_first_close"] and r["readable_after_exporter_exit"], r
    assert r["after_last_close"] != "READABLE", r  # unmapped at the last close: the driver refuses the read
    assert r["third_close"] != "CUDA_SUCCESS" and r["open_from_dead_exporter"] == "CUDA_ERROR_INVALID_HANDLE", r
    assert "exporter must be alive" in r["open_error_message"], r["open_error_message"]
    assert r["legacy_garbage_handle"] != "CUDA_SUCCESS", r
    opens = [s for k, s in r["events"] if k == "ipc_open"]
    closes = [s for k, s in r["events"] if k == "ipc_close"]
    assert len(opens) == 2 and len(closes) == 2 and opens[0] == 4 << 20, r["events"]


if __name__ == "__main__":
    sys.exit(main())
