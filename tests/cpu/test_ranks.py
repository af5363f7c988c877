"""The ranks' agreement protocol (graphpersist.ranks), with threads standing in for the ranks' processes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from archive_fixtures import world, write_rank

from graphpersist import ranks
from graphpersist.archive import open_archive


class ThreadGather:
    """all_gather_object for `n` threads: everyone deposits, waits, reads the list, waits again."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slots: list[Any] = [None] * n
        self.barrier = threading.Barrier(n, timeout=20)

    def for_rank(self, rank: int) -> ranks.Gather:
        def gather(obj: Any) -> list[Any]:
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


def run_world(n: int, body: Callable[[int, ranks.Gather], Any]) -> list[Any]:
    """Runs body(rank, gather) on n threads, one per rank; each rank's result or the exception it raised."""
    g = ThreadGather(n)
    results: list[Any] = [None] * n

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, g.for_rank(rank))
        except Exception as exc:  # collected for the assertions
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is still blocked: the protocol deadlocked"
    return results


def run_ranks(n: int, body: Callable[[ranks.Ranks], Any]) -> list[Any]:
    """Runs body(Ranks) on n threads; returns each rank's result or the exception it raised."""
    return run_world(n, lambda rank, gather: body(ranks.Ranks(n, rank, gather)))


def test_one_rank_refusing_refuses_all_and_names_it() -> None:
    res = run_ranks(3, lambda r: r.check("tensor drift" if r.rank == 1 else None, "LOAD"))
    assert all(isinstance(x, ranks.RanksRefused) for x in res), res
    assert all("LOAD refused on 1 of 3 rank(s)" in str(x) and "rank 1: tensor drift" in str(x) for x in res)
    assert run_ranks(2, lambda r: r.check(None, "LOAD")) == [None, None]


def test_ranks_must_describe_one_world() -> None:
    def body(r: ranks.Ranks) -> None:
        r.same_world(world(**{"env.NCCL_PROTO": "Simple" if r.rank == 1 else None}), "SAVE")

    res = run_ranks(2, body)
    assert all(isinstance(x, ranks.RanksRefused) for x in res), res
    assert "env.NCCL_PROTO: rank 0 <unset>, rank 1 'Simple'" in str(res[0])
    assert run_ranks(2, lambda r: r.same_world(world(), "SAVE")) == [None, None]


def test_two_ranks_write_one_archive(tmp_path: Path) -> None:
    root = tmp_path / "archive"

    def body(r: ranks.Ranks) -> str:
        w = r.writer(root, world(), overwrite=False)
        write_rank(w, r.rank)
        r.commit(w, None)
        return str(w.staging)

    res = run_ranks(2, body)
    assert res[0] == res[1], res  # both wrote into rank 0's staging folder
    archive = open_archive(root)
    assert archive.ranks == (0, 1)
    assert not Path(res[0]).exists()


def test_a_failing_rank_leaves_no_archive(tmp_path: Path) -> None:
    root = tmp_path / "archive"

    def body(r: ranks.Ranks) -> None:
        w = r.writer(root, world(), overwrite=False)
        if r.rank == 0:
            write_rank(w, 0)
        r.commit(w, "disk full" if r.rank == 1 else None)

    res = run_ranks(2, body)
    assert all(isinstance(x, ranks.RanksRefused) and "rank 1: disk full" in str(x) for x in res), res
    assert not root.exists()
    assert not list(tmp_path.iterdir()), "the staging folder must be removed"


def test_rank_zero_cannot_stage_everyone_hears(tmp_path: Path) -> None:
    root = tmp_path / "archive"
    root.mkdir()  # exists and overwrite=False: rank 0 cannot stage

    res = run_ranks(2, lambda r: r.writer(root, world(), overwrite=False))
    assert all(isinstance(x, ranks.RanksRefused) and "rank 0: cannot stage the archive" in str(x) for x in res)


def test_rank_outside_world_and_wrong_answer_count() -> None:
    with pytest.raises(ranks.RanksRefused, match="rank 2 is outside world_size 2"):
        ranks.Ranks(2, 2, lambda o: [o, o])
    with pytest.raises(ranks.RanksRefused, match="1 ranks answered, world_size is 2"):
        ranks.Ranks(2, 0, lambda o: [o]).check(None, "LOAD")
    assert ranks.Ranks(1, 0).gather("x") == ["x"]  # single rank: no transport needed
