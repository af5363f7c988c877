"""Diagnosis only: what LOAD mapped afresh, listed and optionally filled with one byte value.

`GP_DIAG_FILL_RESTORED=BYTE[:FIRST-LAST]` fills the memory LOAD mapped afresh (or the ranges FIRST..LAST of it, by
index in address order, to bisect) with one byte value, to test whether a graph reads restored memory before writing
it (its output then changes with the value). `GP_DIAG_DUMP=DIR` also lists the ranges in
`DIR/restored-ranges.pid<N>.json`. Runs right after LOAD maps them (gpdiag.vllm wraps `memory.region.restore`),
before anything writes that memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILL_ENV = "GP_DIAG_FILL_RESTORED"
DUMP_ENV = "GP_DIAG_DUMP"


def fill(ranges: list[tuple[int, int]]) -> None:
    if where := os.environ.get(DUMP_ENV):
        listing = Path(where) / f"restored-ranges.pid{os.getpid()}.json"
        listing.write_text(json.dumps([[i, a, s] for i, (a, s) in enumerate(sorted(ranges))]))
    value = os.environ.get(FILL_ENV)
    if not value:
        return
    import torch

    from graphpersist.memory.tensors import bytes_at

    byte_text, _, span = value.partition(":")
    byte = int(byte_text, 0) & 0xFF
    chosen = sorted(ranges)
    if span:
        first, _, last = span.partition("-")
        chosen = chosen[int(first) : int(last or first) + 1]
    for addr, size in chosen:
        bytes_at(addr, size).fill_(byte)
    torch.cuda.synchronize()
    print(f"graphpersist: {FILL_ENV}={value}: filled {len(chosen)} of {len(ranges)} restored ranges "
          f"({sum(s for _, s in chosen) >> 20} MiB) with {byte:#04x}", flush=True)  # fmt: skip
