"""The TP=1 diagnosis's search (recipes/vllm-qwen3-8b-tp2/diagbisect.py): it must find the windows a fake LOAD
needs, down to the byte grain, with no GPU (the GPU run calls the same search)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "vllm-qwen3-8b-tp2"))

import diagbisect  # noqa: E402


def _needs(*spots: int):
    """An outcome that is right only when every spot lies in a chosen window."""

    def outcome(windows: list[list[int]]) -> list[list[int]]:
        return [[int(all(any(a <= s < b for a, b in windows) for s in spots))]]

    return outcome


def _search(outcome, limit: int = 400) -> diagbisect.Search:
    return diagbisect.Search(outcome, lambda out: out == [[1]], limit_s=60, max_trials=limit)


RANGES = [[0x1000 * i, 0x1000 * i + 0x800] for i in range(1, 200)]


def test_one_spot_is_found_to_the_grain() -> None:
    search = _search(_needs(0x5123))
    found = search.minimize(RANGES, [])
    assert search.complete
    assert len(found) == 1
    lo, hi = found[0]
    assert lo <= 0x5123 < hi and hi - lo <= diagbisect.GRAIN


def test_two_spots_in_different_ranges_are_both_found() -> None:
    search = _search(_needs(0x2004, 0x9F010))
    found = search.minimize(RANGES, [])
    assert search.complete
    assert len(found) == 2
    assert any(a <= 0x2004 < b for a, b in found) and any(a <= 0x9F010 < b for a, b in found)


def test_the_trial_budget_stops_the_search_and_says_so() -> None:
    search = _search(_needs(0x5123), limit=3)
    found = search.minimize(RANGES, [])
    assert not search.complete
    assert any(a <= 0x5123 < b for a, b in found)


def test_owners_name_the_allocation_covering_a_window(tmp_path: Path) -> None:
    history = tmp_path / "memory-owners.rank0.json.gz"
    data = {
        "blocks": [[0x5000, 0x1000, "active_allocated", [0, 1], [0, 1]], [0x9000, 0x100, "inactive", None, []]],
        "traces": [[7, "alloc", 0x5000, 0x1000, [1]], [9, "alloc", 0x9000, 0x100, [0]]],
        "frames": ["a.py:1:f", "b.py:2:g"],
    }
    with gzip.open(history, "wt") as out:
        json.dump(data, out)
    named = diagbisect.owners(history, [[0x5123, 0x5133]])
    assert named[0]["live_blocks"][0]["stack"] == ["a.py:1:f", "b.py:2:g"]
    assert [e["event"] for e in named[0]["events"]] == [7]
    assert diagbisect.owners(tmp_path / "missing.json.gz", [[1, 2]]) == []
