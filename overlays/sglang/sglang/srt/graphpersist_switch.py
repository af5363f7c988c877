"""SGLang glue for the graph-persistence switch, called by the patched `ServerArgs` (patch 0001): the flags, and the
environment SGLang's spawned scheduler processes inherit (patches/sglang/README.md, "The switch"); and by the
launcher when a scheduler failed to start (patch 0010): a refusal is raised in the launching process."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from graphpersist import engine
from graphpersist.engine import switch

logger = logging.getLogger(__name__)

# Pins every persisted multi-rank start needs, set where the user left them unset (a value the user set is kept, and
# a multi-rank SAVE refuses a multicast one, naming it): NVLink multicast objects are not placed in the region, and
# NCCL must connect (and allocate) every channel at init, in setup, not at its first collective inside a capture.
PINS = {**engine.MULTICAST_OFF, "NCCL_RUNTIME_CONNECT": "0"}


# `--graph-persist`/`--graph-persist-dir`, added to SGLang's server parser as one titled group.
add_cli_args = functools.partial(engine.add_switch_group, title="graph persistence")


def resolve_server_args(server_args: Any) -> switch.Switch:
    """Resolve and validate the switch of a `ServerArgs` (logged once per process and switch); on, it exports what
    the scheduler processes need: the switch, the interposer and the pins."""
    resolved, _ = engine.resolve_switch(server_args.graph_persist, server_args.graph_persist_dir, logger, PINS)
    return resolved


# Whether a scheduler of this start recorded a refusal: the launch-phase SIGQUIT handler (patch 0010) then ends every
# child but keeps this process, whose wait for the schedulers raises the refusal.
refused = engine.refusal_recorded


def refusal_or(error: RuntimeError) -> BaseException:
    """What `_scheduler_died_error` returns for a scheduler that died starting (patch 0010): the refusal a scheduler
    of this start recorded (a refused LOAD as `LoadRefused`, every mismatch named), chained to SGLang's error, once
    every child of this process is ended (as SGLang's SIGQUIT handler ends them); else SGLang's error. Persistence
    off: SGLang's error, nothing read."""
    refusal = engine.refusal_or(error)
    if refusal is not error:
        from sglang.srt.utils.common import kill_process_tree

        kill_process_tree(os.getpid(), include_parent=False)
    return refusal
