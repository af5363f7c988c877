"""Diagnosis: what a graph executable's first launch costs, with and without cuGraphUpload ahead of it.

A request right after LOAD launches restored executables that have never run; the baseline's first request
launches captured ones that have never run either. This script captures one torch graph of many small kernels,
instantiates fresh executables of it with the flags torch gave its own executable, and times launch +
synchronize of each executable's first and second launch, for executables launched as they are and for
executables uploaded (cuGraphUpload, then synchronize) first. It also prints the flags torch gave its own
executable. No interposer, no archive: torch, cuda-bindings and the runtime's result check. Measured on the GPU
host (torch 2.11.0+cu130, 300 kernels, 40 executables per variant): first launch 1.284 ms as instantiated,
0.568 ms after an upload (upload + synchronize 0.737 ms), second launch 0.568 ms.

    python3 recipes/runtime-single-gpu/upload_probe.py [--kernels 300] [--execs 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "overlays" / "graphpersist"))
from graphpersist.graph.images import check as _ck  # the runtime's cuda-bindings result check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=300, help="kernels in the captured graph (default 300)")
    ap.add_argument("--execs", type=int, default=40, help="fresh executables per variant (default 40)")
    a = ap.parse_args()
    import torch
    from cuda.bindings import driver as drv

    x = torch.zeros(4096, device="cuda")
    stream = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(stream):
        x.add_(1.0)  # warm the kernel outside the capture
        with torch.cuda.graph(g, stream=stream):
            for _ in range(a.kernels):
                x.mul_(1.0001).add_(1.0)
    g.instantiate()
    torch_flags = int(_ck(drv.cuGraphExecGetFlags(drv.CUgraphExec(g.raw_cuda_graph_exec())), "cuGraphExecGetFlags"))
    raw = drv.CUgraph(g.raw_cuda_graph())
    s = drv.CUstream(stream.cuda_stream)
    torch.cuda.synchronize()

    def launch_s(ex: Any) -> float:
        t = time.perf_counter()
        _ck(drv.cuGraphLaunch(ex, s), "cuGraphLaunch")
        _ck(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        return time.perf_counter() - t

    rows: dict[str, dict[str, float]] = {}
    for variant in ("launched as instantiated", "uploaded first"):
        first, second, upload = [], [], []
        for _ in range(a.execs):
            ex = _ck(drv.cuGraphInstantiate(raw, torch_flags), "cuGraphInstantiate")
            if variant == "uploaded first":
                t = time.perf_counter()
                _ck(drv.cuGraphUpload(ex, s), "cuGraphUpload")
                _ck(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
                upload.append(time.perf_counter() - t)
            first.append(launch_s(ex))
            second.append(launch_s(ex))
            _ck(drv.cuGraphExecDestroy(ex), "cuGraphExecDestroy")
        rows[variant] = {
            "upload_ms": 1e3 * statistics.median(upload) if upload else 0.0,
            "first_ms": 1e3 * statistics.median(first),
            "second_ms": 1e3 * statistics.median(second),
        }
    print(f"torch {torch.__version__}: its executable's flags {torch_flags:#x} (the probe's executables use the same)")
    print(f"{a.kernels} kernels per graph, {a.execs} fresh executables per variant, medians:")
    print("| variant | upload + sync ms | first launch + sync ms | second launch + sync ms | first / second |")
    print("|---|---|---|---|---|")
    for variant, r in rows.items():
        print(f"| {variant} | {r['upload_ms']:.3f} | {r['first_ms']:.3f} | {r['second_ms']:.3f} | "
              f"{r['first_ms'] / r['second_ms']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
