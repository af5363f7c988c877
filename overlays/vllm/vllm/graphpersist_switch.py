"""vLLM glue for the graph-persistence switch (called from the patched ``vllm/engine/arg_utils.py``).

The patch only declares the two ``EngineArgs`` fields and calls the two functions below; the flag spellings,
help, precedence and validation live in ``graphpersist.switch`` so vLLM and SGLang behave the same.
``EngineArgs.__post_init__`` is the earliest point every entry (``vllm serve``, ``LLM(...)``, ``AsyncEngineArgs``)
passes through without touching CUDA, so a bad value is refused there before any engine process starts.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm.logger import init_logger

from graphpersist import switch

logger = init_logger(__name__)

GROUP_TITLE = "GraphPersist"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--graph-persist``/``--graph-persist-dir`` as their own group (``vllm serve --help=GraphPersist``)."""
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="Save captured CUDA graphs to an archive once and load them on later starts (graphpersist).",
    )
    switch.add_arguments(group)


def resolve_engine_args(engine_args: Any) -> switch.Switch:
    """Resolve and validate the switch of an ``EngineArgs``; log one line when persistence is on, nothing when off."""
    resolved = switch.resolve(engine_args.graph_persist, engine_args.graph_persist_dir)
    if resolved.enabled:
        logger.info("%s", resolved.describe())
    return resolved
