"""Kernel parameter bytes vLLM's kernels never read, which SAVE writes as zeros so two SAVEs are byte-identical.

The runtime's pointer scan reads a kernel's parameters as 8-byte words; bytes its launcher leaves as the stack or
heap held them make two SAVEs differ and can look like an address in the region (a pointer LOAD then requires to be
backed). Each rule names the kernel, the bytes and why they are never read.
"""

from __future__ import annotations

import re

from vllm import graphpersist_customar as customar

# vllm-flash-attn's FA3 split-KV combine, `device_kernel<FlashAttnFwdCombine<...>>(Params)`: its Params open with
# `int batch_size`, a pointer, a shape of five int32 and a stride of int64 (vllm-project/flash-attention
# hopper/flash_fwd_combine_kernel.h), so bytes 4-7 and 36-39 are alignment padding the launcher never sets. Pairs of
# TP=1 SAVEs on the reference host (2026-12-01) held 0 and 0x5003 there: first in bytes 4-7, and once those were
# zeroed in bytes 36-39, each time forming the in-region word 0x500300000001 with the int32 of value 1 before it.
_FA3_COMBINE = re.compile(r"FlashAttnFwdCombine")
_FA3_COMBINE_PADDING = ((4, 8), (36, 40))


def unused_param_bytes(kernel: str, layout: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of `kernel`'s parameters it never reads (graphpersist.save.Saver's
    unused_param_bytes): the custom all-reduce's unused peer slots and the FA3 combine's padding."""
    if _FA3_COMBINE.search(kernel) and layout and layout[0][1] >= _FA3_COMBINE_PADDING[-1][1]:
        start = layout[0][0]
        return [(start + begin, start + end) for begin, end in _FA3_COMBINE_PADDING]
    return customar.unused_param_bytes(kernel, layout)
