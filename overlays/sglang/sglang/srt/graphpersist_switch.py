"""SGLang glue for the graph-persistence switch, called by the patched `ServerArgs` (patch 0001): the flags, and the
environment SGLang's spawned scheduler processes inherit (patches/sglang/README.md, "The switch")."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from graphpersist import engine
from graphpersist.engine import switch

logger = logging.getLogger(__name__)

# Pins every persisted multi-rank start needs, set where the user left them unset (a value the user set is kept, and
# a multi-rank SAVE refuses a multicast one, naming it): NVLink multicast objects are not placed in the region, and
# NCCL must connect (and allocate) every channel at init, in setup, not at its first collective inside a capture.
PINS = {**engine.MULTICAST_OFF, "NCCL_RUNTIME_CONNECT": "0"}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add `--graph-persist`/`--graph-persist-dir` to SGLang's server parser as one titled group."""
    engine.add_switch_group(parser, "graph persistence")


def resolve_server_args(server_args: Any) -> switch.Switch:
    """Resolve and validate the switch of a `ServerArgs` (logged once per process and switch); on, it exports what
    the scheduler processes need: the switch, the interposer and the pins."""
    resolved, _ = engine.resolve_switch(server_args.graph_persist, server_args.graph_persist_dir, logger, PINS)
    return resolved
