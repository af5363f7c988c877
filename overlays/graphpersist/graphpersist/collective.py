"""The parallel layout and the rank collective SAVE and LOAD share (one rank needs no gather)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from graphpersist import ranks
from graphpersist.archive.world import layout_problems
from graphpersist.errors import PersistError

SINGLE = {"world_size": 1, "tp_size": 1, "pp_size": 1, "ep_size": 1}


def parallel_layout(parallel: Mapping[str, int] | None) -> dict[str, int]:
    """The parallel layout (world_size, tp/pp/ep sizes); a single rank when not given.

    Held to the rules of `world.parallel_facts` (tp_size x pp_size = world_size, ep_size divides it), so SAVE
    never records a layout that the engine-side helper would refuse, whatever the world size.
    """
    par = {**SINGLE, **(parallel or {})}
    problems = layout_problems(par["world_size"], par["tp_size"], par["pp_size"], par["ep_size"])
    if problems:
        raise PersistError(
            f"inconsistent parallel layout {par}: {'; '.join(problems)}. Pass the engine's layout, e.g. "
            "graphpersist.archive.world.parallel_facts(current_rank(), tp_size=..., pp_size=...)"
        )
    return par


def collective(par: Mapping[str, int], rank: int, gather: ranks.Gather | None) -> ranks.Ranks:
    """The ranks of `par` as seen from `rank`; a refusal of the layout becomes a PersistError."""
    try:
        return ranks.Ranks(par["world_size"], rank, gather)
    except ranks.RanksRefused as exc:
        raise PersistError(str(exc)) from None


def run_on_every_rank(coll: ranks.Ranks, work: Callable[[], None], what: str) -> None:
    """Runs `work` on this rank, then agrees with the others as after their preparation: a failure on any rank
    raises RanksRefused on every rank, naming it (one rank: the failure as it is, there is nobody to tell).

    Every rank must call this (collectively): a rank that skipped it would leave the others waiting."""
    error = None
    try:
        work()
    except Exception as exc:
        if coll.world_size == 1:
            raise
        error = f"{type(exc).__name__}: {exc}"
    coll.check(error, what)
