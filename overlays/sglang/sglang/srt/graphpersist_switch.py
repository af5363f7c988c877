"""SGLang glue for the graph-persistence switch (called from the patched ``sglang/srt/server_args.py``).

The patch only declares the two ``ServerArgs`` fields and calls the two functions below; the flag spellings,
help, precedence and validation live in ``graphpersist.switch`` so SGLang and vLLM behave the same.
``ServerArgs.__post_init__`` is where every entry (``sglang serve``/``launch_server``, ``sglang.Engine(...)``)
validates its arguments; the call sits before the dummy-model early return because the switch does not depend
on the model, and before anything touches the device.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from graphpersist import switch

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--graph-persist``/``--graph-persist-dir`` to SGLang's server parser as one titled group."""
    group = parser.add_argument_group(
        title="graph persistence",
        description="Save captured CUDA graphs to an archive once and load them on later starts (graphpersist).",
    )
    switch.add_arguments(group)


def resolve_server_args(server_args: Any) -> switch.Switch:
    """Resolve and validate the switch of a ``ServerArgs``; log one line when persistence is on, nothing when off."""
    resolved = switch.resolve(server_args.graph_persist, server_args.graph_persist_dir)
    if resolved.enabled:
        logger.info("%s", resolved.describe())
    return resolved
