"""SGLang glue for the graph-persistence switch (called from the patched ``sglang/srt/server_args.py``).

The patch only declares the two ``ServerArgs`` fields and calls the two functions below; the flag spellings,
help, precedence and validation live in ``graphpersist.switch`` so SGLang and vLLM behave the same.
``ServerArgs.__post_init__`` is where every entry (``sglang serve``/``launch_server``, ``sglang.Engine(...)``)
validates its arguments; the call sits before the dummy-model early return because the switch does not depend
on the model, and before anything touches the device.

With persistence on it also prepares the environment SGLang's scheduler processes inherit: the resolved mode and
directory, and the runtime's interposer (``LD_PRELOAD`` and the region's base), which must be in every process that
holds a model before any CUDA library allocates. SGLang starts its scheduler processes with ``spawn``
(``_set_envs_and_config``), so each executes anew with this environment; the engine glue refuses a scheduler
process that lacks the interposer (``graphpersist_engine.before_distributed``).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from graphpersist import engine
from graphpersist.engine import switch

logger = logging.getLogger(__name__)

# The switches this process has logged: SGLang may build more ServerArgs after the user's (copies for draft
# models, tests), which resolve the switch again from the environment exported below.
_logged: set[tuple[switch.Mode, str]] = set()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--graph-persist``/``--graph-persist-dir`` to SGLang's server parser as one titled group."""
    group = parser.add_argument_group(
        title="graph persistence",
        description="Save captured CUDA graphs to an archive once and load them on later starts (graphpersist).",
    )
    switch.add_arguments(group)


def resolve_server_args(server_args: Any) -> switch.Switch:
    """Resolve and validate the switch of a ``ServerArgs``; log one line when persistence is on, nothing when off.

    On, it exports what the scheduler processes need (``export_environment``)."""
    resolved = switch.resolve(server_args.graph_persist, server_args.graph_persist_dir)
    if not resolved.enabled:
        if os.environ.get(switch.MODE_ENV, "off") not in ("", "off"):  # the flag said off: so must deep_ep's Buffer
            os.environ[switch.MODE_ENV] = "off"
        return resolved
    pinned = export_environment(resolved, os.environ)
    if (resolved.mode, str(resolved.directory)) not in _logged:
        _logged.add((resolved.mode, str(resolved.directory)))
        logger.info("%s", resolved.describe())
        if pinned:
            logger.info("graphpersist: pinned for persistence: %s", " ".join(pinned))
    return resolved


# Pins every persisted multi-rank start needs, set where the user left them unset (a value the user set is kept, and
# a multi-rank SAVE refuses a multicast one, naming it): NVLink multicast objects are not placed in the region, and
# NCCL must connect (and allocate) every channel at init, in setup, not at its first collective inside a capture.
PINS = {**engine.MULTICAST_OFF, "NCCL_RUNTIME_CONNECT": "0"}


def export_environment(resolved: switch.Switch, environ: MutableMapping[str, str]) -> list[str]:
    """What SGLang's scheduler processes need to find the switch and run under the runtime; returns the pins it set."""
    set_here = [f"{k}={v}" for k, v in PINS.items() if k not in environ]
    for name, value in PINS.items():
        environ.setdefault(name, value)
    engine.export_environment(resolved, environ)
    return set_here
