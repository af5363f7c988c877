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

import ctypes
import struct
import sys
from pathlib import Path

from matmulgraph import arguments, capture


def host_mappings() -> list[tuple[int, int, str]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        out.append((lo, hi, f"{parts[1]} {parts[5] if len(parts) > 5 else '[anon]'}"))
    return out


def main() -> int:
    a = arguments(__doc__)
    c = capture(a.m, a.k, a.n)
    drv = c.drv
    from graphpersist.graph.walk import _param_layout, _read_params

    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS
    print("pageable memory access:", drv.cuDeviceGetAttribute(attr, 0)[1])
    maps = host_mappings()
    for _nd, p, name in c.kernel_nodes():
        layout = _param_layout(p.func, name)
        params = _read_params(p, layout, name)
        print(f"kernel {name[:80]}: {len(layout)} parameters, {len(params)} bytes")
        for j in range(len(params) // 8):
            (v,) = struct.unpack_from("<Q", params, 8 * j)
            if c.info.base <= v < c.info.base + c.info.size or not (1 << 32) <= v < (1 << 57):
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
