"""Diagnosis: region addresses hidden in a captured split-K GEMM's parameters, and where they point.

SAVE's pointer scan reads a kernel's parameters as aligned 8-byte words. An address stored another way (at a 4-byte
offset, or shifted inside a tensor map's packed fields) is not seen: LOAD would neither check nor restore the memory
behind it, and if that memory lies in torch's free space at the end of setup, LOAD may hand it to another tensor.
This script captures one bf16 matmul of Qwen3-8B's o_proj shape under the interposer (setup tensors, mark_setup,
a warm-up on a side stream, then the capture, as the runtime proof does) and reports, per kernel node, every value
at any 4-byte offset that lies in the region read plainly or shifted left by 4 bits, with the live range holding it,
whether that range was made before or after mark_setup, whether torch had a live block there at mark_setup, and its
first 16 bytes after the capture (a split-K kernel's counters must be zero when it starts).

    python3 recipes/runtime-single-gpu/paramscan_probe.py [--m 8] [--k 4096] [--n 4096]
"""

from __future__ import annotations

import struct
import sys

from matmulgraph import arguments, capture


def hidden_addresses(params: bytes, lo: int, hi: int) -> list[tuple[int, str, int]]:
    """(byte offset, how, address) of every in-region value at a 4-byte offset: 'plain' (an aligned 8-byte word,
    what SAVE's scan sees), 'unaligned' (at offset 4 mod 8) or 'shifted' (an 8-byte value whose <<4 is in range)."""
    found = []
    for off in range(0, len(params) - 7, 4):
        (v,) = struct.unpack_from("<Q", params, off)
        if lo <= v < hi:
            found.append((off, "plain" if off % 8 == 0 else "unaligned", v))
        elif lo <= (v << 4) < hi and v:
            found.append((off, "shifted", v << 4))
    return found


def main() -> int:
    a = arguments(__doc__)
    c = capture(a.m, a.k, a.n)
    from graphpersist.graph.walk import _param_layout, _read_params
    from graphpersist.memory import region, setup
    from graphpersist.memory.phases import find_range
    from graphpersist.memory.tensors import bytes_at

    lo, hi = c.info.base, c.info.base + c.info.size
    mark = setup.current()
    assert mark is not None
    setup_end = lo + mark.cursor
    print(f"region {lo:#x}..{hi:#x}, end of setup {setup_end:#x}; x {c.x.data_ptr():#x} w {c.w.data_ptr():#x} "
          f"o {c.o.data_ptr():#x}")  # fmt: skip
    live = sorted(region.live_ranges(region.events()))
    for _nd, p, name in c.kernel_nodes():
        params = _read_params(p, _param_layout(p.func, name), name)
        print(f"kernel {name[:80]}: {len(params)} parameter bytes")
        for off, how, v in hidden_addresses(params, lo, hi):
            rng = find_range(live, v)
            where = "not live" if rng is None else f"in {rng[0]:#x}+{rng[1]}"
            made = "" if rng is None else (" (made in setup" if rng[0] < setup_end else " (made after setup")
            blk = find_range(mark.blocks, v)
            torch_state = (
                (", torch block live at mark_setup)" if blk else ", no live torch block at mark_setup)") if made else ""
            )
            head = bytes_at(v, 16).cpu().numpy().tobytes().hex() if rng is not None else "-"
            print(f"  bytes {off}..{off + 7} {how}: {v:#x} {where}{made}{torch_state}, holds {head}...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
