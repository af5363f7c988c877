"""Torch symmetric-memory all-reduce on a host without NVLink multicast (patch 0007): the two-shot communicator stays
on when `GRAPHPERSIST_SYMM_MEM_NO_MULTICAST=1` says so (patches/sglang/README.md, "Torch symmetric memory")."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV = "GRAPHPERSIST_SYMM_MEM_NO_MULTICAST"
PREFIX = "graphpersist: torch symmetric memory without multicast: "


@dataclass(frozen=True)
class Decision:
    """Whether the communicator stays on although rendezvous() returned no multicast address, and why."""

    keep: bool
    reason: str

    def describe(self) -> str:
        return f"{PREFIX}{self.reason}: communicator {'on' if self.keep else 'off (as upstream)'}"


def opted_in(environ: Mapping[str, str] | None = None) -> bool:
    """The variable's value: "1" on, unset or "0" off; anything else is refused, naming the values it takes."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(
        f"graphpersist: {ENV}={value!r} is not 1 or 0. Set {ENV}=1 to let torch symmetric memory run its "
        "two-shot all-reduce without multicast, or unset it for upstream behaviour."
    )


def decide(
    world_size: int,
    capability: int,
    multimem_world_sizes: Mapping[int, Iterable[int]],
    *,
    inkling_custom_ar: bool,
) -> Decision:
    """The decision for an opted-in start, from what the communicator would do: its kernel is multimem exactly
    where `multimem_world_sizes` (the communicator's own table) lists this world size for this capability."""
    if world_size in tuple(multimem_world_sizes.get(capability, ())):
        reason = f"world size {world_size} on SM{capability}0 runs the multimem all-reduce, which needs it"
        return Decision(False, reason)
    if inkling_custom_ar:
        return Decision(False, "SGLANG_OPT_USE_INKLING_CUSTOM_AR is on, and its all-reduce reads the multicast address")
    return Decision(True, f"the two-shot all-reduce at world size {world_size} needs none")


def keep_without_multicast(
    world_size: int,
    capability: int,
    multimem_world_sizes: Mapping[int, Iterable[int]],
    *,
    inkling_custom_ar: bool,
) -> bool:
    """The patch's one call, made only when rendezvous() returned no multicast address: True keeps the communicator
    on. Not opted in: False and silent, so upstream's warning and shutdown follow unchanged."""
    if not opted_in():
        return False
    decision = decide(world_size, capability, multimem_world_sizes, inkling_custom_ar=inkling_custom_ar)
    (logger.info if decision.keep else logger.warning)("%s", decision.describe())
    return decision.keep
