"""GPU test: freeing region memory waits for the work still pending on it, as cuMemFree does.

The interposer frees region memory with unmap + release, which (unlike cuMemFree) do not wait for the device: a
kernel still queued on the range then faults ("an illegal memory access"), or, once freed ranges are reused after
freeze(), writes into the next allocation. Each step runs in its own process under the interposer, after freeze():
- `torch`: a tensor whose last write is queued behind a long `torch.cuda._sleep` is deleted and the cache emptied
  (torch's cudaFree relies on the free synchronizing); a new tensor reuses the range, is zeroed, and must stay zero.
- `driver`: the same with cuda-bindings: cuMemAlloc, sleep + cuMemsetD32Async queued, cuMemFree right away (it
  must take about as long as the sleep), a new cuMemAlloc at the same address, zeroed, checked.
- `capture`: what a region free does while a stream is being captured (relaxed and global mode): either it
  succeeds or it fails with the driver's capture error and the allocation stays live, freeable after capture
  (measured on an H200, CUDA 13.0: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED in both modes, capture invalidated).

Run: `python3 -m pytest -m gpu tests/gpu/test_memsafety_gpu.py` on a GPU host (torch, cuda-bindings, gcc).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from interposed import run_step, step_main

SLEEP_CYCLES = 2_000_000_000  # about a second at H200 clocks
N = 16 << 20  # int32 elements: 64 MiB


def _ck(result: Any, what: str) -> Any:
    from graphpersist.graph.images import check

    return check(result, what)


def step_torch() -> dict[str, Any]:
    import torch

    from graphpersist import api
    from graphpersist.memory import region

    api.start_region()
    region.freeze()  # freed ranges are reused from here on: a late write would land in the next tensor
    x = torch.empty(N, dtype=torch.int32, device="cuda")
    # Load both kernels first: with lazy module loading, a kernel's first launch loads its module and waits for the
    # work already queued, so the fill would find the sleep done and nothing would be pending at the free (seen on
    # an H200: empty_cache then took 0.2 ms).
    torch.cuda._sleep(1)
    x.fill_(0)
    torch.cuda.synchronize()
    x_ptr = x.data_ptr()
    t0 = time.perf_counter()
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(7)  # queued behind the sleep
    launch_s = time.perf_counter() - t0
    del x
    t0 = time.perf_counter()
    torch.cuda.empty_cache()  # cudaFree of the segment while the fill is pending
    free_s = time.perf_counter() - t0
    y = torch.zeros(N, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    return {
        "reused": y.data_ptr() == x_ptr,
        "launch_s": launch_s,
        "free_s": free_s,
        "nonzero": int(torch.count_nonzero(y).item()),
        "events": [e.kind for e in region.events()],
    }


def step_driver() -> dict[str, Any]:
    import torch
    from cuda.bindings import driver as drv

    from graphpersist import api
    from graphpersist.memory import region

    api.start_region()
    region.freeze()
    size = N * 4
    p = int(_ck(drv.cuMemAlloc(size), "cuMemAlloc"))
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    _ck(drv.cuCtxSynchronize(), "cuCtxSynchronize")
    t0 = time.perf_counter()
    torch.cuda._sleep(SLEEP_CYCLES)
    _ck(drv.cuMemsetD32Async(p, 0xABCD, N, stream), "cuMemsetD32Async")  # queued behind the sleep
    launch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    (err,) = drv.cuMemFree(p)
    free_s = time.perf_counter() - t0
    q = int(_ck(drv.cuMemAlloc(size), "cuMemAlloc"))
    _ck(drv.cuMemsetD32(q, 0, N), "cuMemsetD32")
    (sync,) = drv.cuCtxSynchronize()
    host = torch.empty(N, dtype=torch.int32)
    _ck(drv.cuMemcpyDtoH(host.data_ptr(), q, size), "cuMemcpyDtoH")
    return {
        "free": err.name,
        "sync": sync.name,
        "reused": p == q,
        "launch_s": launch_s,
        "free_s": free_s,
        "nonzero": int(torch.count_nonzero(host).item()),
    }


def step_capture() -> dict[str, Any]:
    import torch
    from cuda.bindings import driver as drv

    from graphpersist import api

    api.start_region()
    out: dict[str, Any] = {}
    side = torch.cuda.Stream()
    for mode in ("CU_STREAM_CAPTURE_MODE_RELAXED", "CU_STREAM_CAPTURE_MODE_GLOBAL"):
        p = int(_ck(drv.cuMemAlloc(2 << 20), "cuMemAlloc"))
        stream = drv.CUstream(side.cuda_stream)
        _ck(drv.cuStreamBeginCapture(stream, getattr(drv.CUstreamCaptureMode, mode)), "cuStreamBeginCapture")
        (during,) = drv.cuMemFree(p)
        end, graph = drv.cuStreamEndCapture(stream)
        if end == drv.CUresult.CUDA_SUCCESS and graph:
            drv.cuGraphDestroy(graph)
        (after,) = drv.cuMemFree(p) if during != drv.CUresult.CUDA_SUCCESS else (drv.CUresult.CUDA_SUCCESS,)
        (sync,) = drv.cuCtxSynchronize()
        out[mode] = {"during": during.name, "end_capture": end.name, "free_after": after.name, "sync": sync.name}
    return out


STEPS = {"torch": step_torch, "driver": step_driver, "capture": step_capture}


def _run(step: str, tmp: Path) -> dict[str, Any]:
    data, log = run_step(__file__, [step], tmp / f"{step}.json")
    assert "illegal memory access" not in log, log
    print(step, json.dumps(data, indent=1))
    return data


@pytest.mark.gpu
def test_torch_free_waits_for_the_pending_write(tmp_path: Path) -> None:
    r = _run("torch", tmp_path)
    assert r["reused"], "precondition: the new tensor did not reuse the freed range; the check was not exercised"
    assert r["nonzero"] == 0, r  # the late fill_(7) did not land in the new tensor
    assert r["launch_s"] < 0.2, r  # precondition: the launches were asynchronous, so the fill was pending
    assert r["free_s"] > 0.2, r  # empty_cache waited for the sleeping stream


@pytest.mark.gpu
def test_driver_free_waits_for_the_pending_write(tmp_path: Path) -> None:
    r = _run("driver", tmp_path)
    assert r["free"] == "CUDA_SUCCESS" and r["sync"] == "CUDA_SUCCESS", r
    assert r["reused"], "precondition: cuMemAlloc did not reuse the freed range; the check was not exercised"
    assert r["nonzero"] == 0, r
    assert r["free_s"] > 0.2 and r["free_s"] > r["launch_s"], r  # cuMemFree returned only after the memset ran


@pytest.mark.gpu
def test_free_during_capture_keeps_or_frees_cleanly(tmp_path: Path) -> None:
    r = _run("capture", tmp_path)
    for mode, res in r.items():
        assert res["sync"] == "CUDA_SUCCESS", (mode, res)  # the context survives whatever the capture did
        assert res["free_after"] == "CUDA_SUCCESS", (mode, res)  # a free refused during capture works after it
        if res["during"] != "CUDA_SUCCESS":
            assert "CAPTURE" in res["during"], (mode, res)


if __name__ == "__main__":
    sys.exit(step_main(lambda args: STEPS[args[0]]()))
