"""The parallel layout and the rank collective SAVE and LOAD share (one rank needs no gather)."""

from __future__ import annotations

from collections.abc import Mapping

from graphpersist import ranks
from graphpersist.errors import PersistError

SINGLE = {"world_size": 1, "tp_size": 1, "pp_size": 1, "ep_size": 1}


def parallel_layout(parallel: Mapping[str, int] | None) -> dict[str, int]:
    """The parallel layout (world_size, tp/pp/ep sizes); a single rank when not given."""
    par = {**SINGLE, **(parallel or {})}
    if par["world_size"] < 1 or par["tp_size"] * par["pp_size"] > par["world_size"]:
        raise PersistError(f"inconsistent parallel layout {par}")
    return par


def collective(par: Mapping[str, int], rank: int, gather: ranks.Gather | None) -> ranks.Ranks:
    """The ranks of `par` as seen from `rank`; a refusal of the layout becomes a PersistError."""
    try:
        return ranks.Ranks(par["world_size"], rank, gather)
    except ranks.RanksRefused as exc:
        raise PersistError(str(exc)) from None
