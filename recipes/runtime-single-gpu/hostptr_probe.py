"""Diagnosis: which kernel-parameter words of a captured cuBLAS split-K matmul are host addresses?

A TP=1 vLLM LOAD and this recipe at Qwen3-8B's o_proj shape give wrong outputs exactly where cuBLAS picks split-K
kernels, and every `splitKreduce_kernel` node's parameters differ between two SAVE processes in words that are
not region addresses. On a GPU that reads pageable host memory (HMM/ATS: the device attribute
PAGEABLE_MEMORY_ACCESS), a kernel can dereference a plain host pointer, which names other bytes (or nothing) in
another process. This script captures one bf16 matmul under the interposer and prints, for each kernel node, every
8-byte parameter word outside the region that lies in a mapping of this process (/proc/self/maps), with the
mapping and the 4-byte floats there.

    python3 recipes/runtime-single-gpu/hostptr_probe.py [--m 8] [--k 4096] [--n 4096]
"""

from __future__ import annotations

import argparse
import ctypes
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "overlays" / "graphpersist"))


def host_mappings() -> list[tuple[int, int, str]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        out.append((lo, hi, f"{parts[1]} {parts[5] if len(parts) > 5 else '[anon]'}"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    a = ap.parse_args()
    from graphpersist import region

    region.reexec_with_interposer()
    import torch
    from cuda.bindings import driver as drv

    from graphpersist import api
    from graphpersist.graphwalk import _param_layout, _read_params

    info = api.start_region()
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS
    print("pageable memory access:", drv.cuDeviceGetAttribute(attr, 0)[1])
    x = torch.randn(a.m, a.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(a.k, a.n, device="cuda", dtype=torch.bfloat16) * a.k**-0.5
    o = torch.empty(a.m, a.n, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.matmul(x, w, out=o)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        torch.matmul(x, w, out=o)
    maps = host_mappings()
    graph = drv.CUgraph(g.raw_cuda_graph())
    nodes = drv.cuGraphGetNodes(graph, drv.cuGraphGetNodes(graph, 0)[2])[1]
    for nd in nodes:
        if drv.cuGraphNodeGetType(nd)[1] != drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        p = drv.cuGraphKernelNodeGetParams(nd)[1]
        name = drv.cuFuncGetName(p.func)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        layout = _param_layout(p.func, name)
        params = _read_params(p, layout, name)
        print(f"kernel {name[:80]}: {len(layout)} parameters, {len(params)} bytes")
        for j in range(len(params) // 8):
            (v,) = struct.unpack_from("<Q", params, 8 * j)
            if info.base <= v < info.base + info.size or not (1 << 32) <= v < (1 << 57):
                continue
            where = next((m for m in maps if m[0] <= v < m[1]), None)
            kind = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, v)[0]
            floats = struct.unpack("<4f", ctypes.string_at(v, 16)) if where else None
            param = next((i for i, (off, size) in enumerate(layout) if off <= 8 * j < off + size), None)
            print(f"  bytes {8 * j}..{8 * j + 7} (parameter {param}): {v:#x} mapping {where and where[2]} "
                  f"cuPointerGetAttribute {kind!r} floats there {floats}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
