"""Torch symmetric-memory all-reduce on a host without NVLink multicast (patch 0007): the two-shot communicator stays
on when `GRAPHPERSIST_SYMM_MEM_NO_MULTICAST=1` says so (patches/sglang/README.md, "Torch symmetric memory")."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from graphpersist import engine

logger = logging.getLogger(__name__)

ENV = "GRAPHPERSIST_SYMM_MEM_NO_MULTICAST"
OPTS_IN_TO = "let torch symmetric memory run its two-shot all-reduce without multicast"
PREFIX = "graphpersist: torch symmetric memory without multicast: "


def keep_without_multicast(
    world_size: int,
    capability: int,
    multimem_world_sizes: Mapping[int, Iterable[int]],
    *,
    inkling_custom_ar: bool,
) -> bool:
    """The patch's one call, made only when rendezvous() returned no multicast address: True keeps the communicator
    on. Not opted in (`ENV` unset or "0"; any value but "1" or "0" is refused): False and silent, so upstream's
    warning and shutdown follow unchanged. Opted in, the line that says why is logged: the kernel is multimem exactly
    where `multimem_world_sizes` (the communicator's own table) lists this world size for this capability."""
    if not engine.opted_in(ENV, OPTS_IN_TO):
        return False
    if world_size in tuple(multimem_world_sizes.get(capability, ())):
        reason = f"world size {world_size} on SM{capability}0 runs the multimem all-reduce, which needs it"
    elif inkling_custom_ar:
        reason = "SGLANG_OPT_USE_INKLING_CUSTOM_AR is on, and its all-reduce reads the multicast address"
    else:
        logger.info("%sthe two-shot all-reduce at world size %d needs none: communicator on", PREFIX, world_size)
        return True
    logger.warning("%s%s: communicator off (as upstream)", PREFIX, reason)
    return False
