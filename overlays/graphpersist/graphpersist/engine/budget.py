"""The memory budget an engine sizes its KV cache (memory pool) by, under persistence: SAVE decides it, LOAD reuses it.

A cold SAVE (compiling) and a warm one profile a few tens of MiB apart; unrounded, the KV cache and every address
after it would differ between their archives. So SAVE takes the smallest rank's profile rounded down to 1 GiB (at
most 1 GiB of KV cache less than upstream would use) and records it (`flags.memory_budget_bytes`); LOAD never
profiles: it reuses the recorded budget, refused when the GPU's free memory cannot hold it now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from graphpersist.errors import PersistError

FLAG = "memory_budget_bytes"
GRANULE = 1 << 30


def rounded(profiled: Sequence[int], what: str, advice: str) -> int:
    """SAVE's budget from every rank's profile: the smallest, rounded down to GRANULE; refused below one granule."""
    smallest = int(min(profiled))
    if smallest < GRANULE:
        raise PersistError(
            f"graphpersist: the memory profile leaves {smallest // 2**20} MiB for the {what}, less than the "
            f"{GRANULE >> 30} GiB SAVE needs: {advice}"
        )
    return smallest - smallest % GRANULE


def saved(flags: Mapping[str, Any], archive_dir: Path | str) -> int:
    """LOAD: the budget SAVE recorded; refuses an archive without one."""
    value = flags.get(FLAG)
    if type(value) is not int or value <= 0:
        raise PersistError(f"graphpersist: {archive_dir} records no memory budget (flags.{FLAG} = {value!r}). "
                           "Re-run with mode=save.")  # fmt: skip
    return value


def check_free(needed: int, what: str) -> None:
    """LOAD reuses SAVE's budget instead of profiling: refused when this GPU cannot hold it now."""
    import torch

    free, total = torch.cuda.mem_get_info()
    if free < needed:
        raise PersistError(
            f"graphpersist: the archive's {what} needs {needed / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB "
            f"of {total / 2**30:.2f} GiB are free on this GPU: free the GPU (other processes?) or re-run with "
            "mode=save on this host"
        )
