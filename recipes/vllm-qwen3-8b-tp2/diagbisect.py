"""Diagnosis only (driver `--diag-bisect`): the smallest set of byte windows of the memory a LOAD mapped afresh
that must hold SAVE's contents for the LOAD's outputs to equal SAVE's, found by trial requests in one process.

Each trial puts every restored range back as it was when serving started, writes SAVE's bytes into the chosen
windows (`tools/gpdiag/vllm_rpc.py`, through `LLM.collective_rpc`), and runs the probe requests. When SAVE's bytes
everywhere do not give SAVE's outputs, it looks instead for the windows whose 0xff fill changes LOAD's outputs (memory
the probes read before writing). The windows found are named by the SAVE's allocation history when it was recorded.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Windows = list[list[int]]
GRAIN = 16  # bytes: the smallest window tried


class Budget(Exception):
    pass


class Search:
    def __init__(self, outcome: Callable[[Windows], Any], good: Callable[[Any], bool], limit_s: float, max_trials: int):
        self.outcome, self.good = outcome, good
        self.deadline, self.left = time.monotonic() + limit_s, max_trials
        self.trials: list[dict[str, Any]] = []
        self.complete = True

    def test(self, windows: Windows) -> bool:
        if self.left <= 0 or time.monotonic() > self.deadline:
            raise Budget
        self.left -= 1
        out = self.outcome(windows)
        ok = self.good(out)
        size = sum(b - a for a, b in windows)
        self.trials.append({"windows": len(windows), "bytes": size, "good": ok, "out": out})
        print(f"diagbisect: trial {len(self.trials)}: {len(windows)} windows, {size} bytes -> {ok} {out}", flush=True)
        return ok

    def minimize(self, cands: Windows, fixed: Windows) -> Windows:
        """A small sublist M of `cands` (windows split down to GRAIN bytes) with test(fixed + M) true, given that
        test(fixed + cands) is true (delta debugging by halves)."""
        if len(cands) == 1:
            lo, hi = cands[0]
            if hi - lo <= GRAIN:
                return cands
            mid = lo + max(GRAIN, (hi - lo) // 2 // GRAIN * GRAIN)
            a, b = [[lo, mid]], [[mid, hi]]
        else:
            half = len(cands) // 2
            a, b = cands[:half], cands[half:]
        try:
            if self.test(fixed + a):
                return self.minimize(a, fixed)
            if self.test(fixed + b):
                return self.minimize(b, fixed)
            found_a = self.minimize(a, fixed + b)
            return found_a + self.minimize(b, fixed + found_a)
        except Budget:
            self.complete = False
            return cands


def owners(history: Path, windows: Windows) -> list[dict[str, Any]]:
    """For each window, the SAVE allocations (live blocks and allocation events) that covered its start."""
    if not history.is_file():
        return []
    with gzip.open(history, "rt") as f:
        data = json.load(f)
    frames = data["frames"]
    named = []
    for lo, hi in windows[:8]:
        live = [
            {"address": hex(a), "size": s, "state": st, "pool": pool, "stack": [frames[i] for i in fr]}
            for a, s, st, pool, fr in data["blocks"]
            if a <= lo < a + s
        ]
        events = [
            {"event": i, "action": act, "address": hex(a), "size": s, "stack": [frames[j] for j in fr]}
            for i, act, a, s, fr in data["traces"]
            if a <= lo < a + s
        ][-6:]
        named.append({"window": [hex(lo), hex(hi)], "live_blocks": live, "events": events})
    return named


def run(llm: Any, generate: Callable[..., list[list[int]]], probes: list[list[list[int]]], expected: list[list[int]],
        prefix: str, history: Path, limit_s: float = 240, max_trials: int = 90) -> dict[str, Any]:  # fmt: skip
    from gpdiag import vllm_rpc as diag

    started = time.monotonic()
    info = llm.collective_rpc(diag.bisect_setup, args=(prefix,))[0]
    ranges = [[a, a + s] for a, s in info["ranges"]]
    print(f"diagbisect: {len(ranges)} restored ranges, {info['bytes'] >> 20} MiB; SAVE's bytes: "
          f"{info['save_windows']} windows; setup {time.monotonic() - started:.1f} s", flush=True)  # fmt: skip

    def outcome(windows: Windows, fill: int | None = None) -> list[list[int]]:
        llm.reset_prefix_cache()  # every trial computes its whole prompts, as the first time
        llm.collective_rpc(diag.bisect_apply, args=(windows, fill))
        return [generate(llm, p, len(expected[0]))[0] for p in probes]

    report: dict[str, Any] = {"ranges": len(ranges), "bytes": info["bytes"], "expected": expected}
    report["as_loaded"] = outcome([])
    if report["as_loaded"] == expected:
        report["question"] = "none: these trials give SAVE's outputs without SAVE's bytes"
        return report
    report["save_bytes_everywhere"] = outcome(ranges)
    if report["save_bytes_everywhere"] == expected:
        report["question"] = "which windows need SAVE's bytes for SAVE's outputs"
        search = Search(outcome, lambda out: out == expected, limit_s, max_trials)
    else:
        report["question"] = "which windows, filled with 0xff, change LOAD's outputs"
        base = report["as_loaded"]
        search = Search(lambda w: outcome(w, 0xFF), lambda out: out != base, limit_s, max_trials)
        if not search.test(ranges):
            report["found"], report["trials"] = [], search.trials
            return report
    found = search.minimize(ranges, [])
    report["complete"] = search.complete
    report["found"] = [[hex(a), hex(b), b - a] for a, b in found]
    report["trials"] = search.trials
    peek = [llm.collective_rpc(diag.bisect_peek, args=(a, min(b, a + 256)))[0] for a, b in found[:8]]
    report["bytes_of_found"] = peek
    report["owners"] = owners(history, found)
    report["took_s"] = round(time.monotonic() - started, 1)
    return report
