"""Kernels whose graphs LOAD cannot replay exactly: SAVE refuses any graph that launches one.

Each rule names a kernel family by its (mangled) name, what it is, and where the measurement that put it here is
recorded. A rule goes when a GPU run proves LOAD replays that family bit for bit. `GP_DIAG_ALLOW_UNRESTORABLE=1`
(diagnosis of such a family only, never for serving) lets SAVE write the archive anyway, with a warning per kernel.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class KernelRule:
    pattern: re.Pattern[str]
    what: str
    evidence: str


RULES = (
    KernelRule(
        re.compile(r"splitKreduce_kernel|^nvjet_\w*_splitK_"),
        "a cuBLASLt split-K GEMM (partial sums written by one kernel, reduced by another), which cuBLAS picks for "
        "small batches of some shapes, e.g. bf16 [8, 4096] x [4096, 4096]",
        "on the reference host a graph of such GEMMs replayed with other results after LOAD than in the process "
        "that captured it (2026-12-01, recipes/runtime-single-gpu/SPLITK.md)",
    ),
)


DIAG_ALLOW = "GP_DIAG_ALLOW_UNRESTORABLE"


def unrestorable(name: str) -> str | None:
    """Why a graph launching kernel `name` cannot be persisted, or None when no rule names it (or the diagnosis
    switch lifts the rules)."""
    why = _rule_says(name)
    if why is not None and os.environ.get(DIAG_ALLOW) == "1":
        _warn_once(name)
        return None
    return why


@lru_cache(maxsize=4096)
def _warn_once(name: str) -> None:
    print(f"graphpersist: WARNING: {DIAG_ALLOW}=1: kernel {name[:100]!r} is saved although LOAD is known not to "
          "replay it exactly (diagnosis only)", file=sys.stderr, flush=True)  # fmt: skip


@lru_cache(maxsize=4096)
def _rule_says(name: str) -> str | None:
    for rule in RULES:
        if rule.pattern.search(name):
            return (
                f"this kernel is {rule.what}; {rule.evidence}. SAVE refused: run this configuration with persistence "
                "off (or one whose GEMMs cuBLAS runs without split-K)"
            )
    return None
