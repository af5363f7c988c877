"""What every engine's glue does with the switch where the engine validates its arguments, before any process starts.

The engines resolve their switch where their arguments are validated (vLLM's `EngineArgs.__post_init__`, SGLang's
`ServerArgs.__post_init__`), which may run several times in one process (copies, defaults to compare with): the
first resolution of a switch logs it, later ones are silent. With persistence on, every process the engine starts
inherits the resolved mode and directory, the runtime's interposer and the start's refusal file
(graphpersist.engine.refusal) through the environment; off, an environment that said otherwise is set to off, so
that every process of the start (DeepEP's Buffer included) agrees.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from graphpersist import switch
from graphpersist.engine import refusal

_logged: set[tuple[switch.Mode, str]] = set()  # the switches this process has logged (its one log line each)


def add_switch_group(parser: argparse.ArgumentParser, title: str) -> None:
    """`--graph-persist` and `--graph-persist-dir` as one titled group of the engine's parser."""
    group = parser.add_argument_group(
        title=title,
        description="Save captured CUDA graphs to an archive once and load them on later starts (graphpersist).",
    )
    switch.add_arguments(group)


def export_environment(
    resolved: switch.Switch, environ: MutableMapping[str, str], pins: Mapping[str, str] | None = None
) -> list[str]:
    """What every engine process a persisting start launches needs: the resolved switch, the interposer, and `pins`
    where the user left them unset (a value the user set is kept). Returns the pins it set, as `NAME=value`."""
    from graphpersist.memory import region

    pins = pins or {}
    set_here = [f"{k}={v}" for k, v in pins.items() if k not in environ]
    for name, value in pins.items():
        environ.setdefault(name, value)
    environ[switch.MODE_ENV] = resolved.mode.value
    environ[switch.DIR_ENV] = str(resolved.directory)
    preload = region.preload_env(env=dict(environ))
    for name in ("LD_PRELOAD", "GP_REGION_BASE", "GP_REGION_SIZE"):
        if name in preload:
            environ[name] = preload[name]
    return set_here


def resolve_switch(
    mode: Any,
    archive_dir: Any,
    logger: logging.Logger,
    pins: Mapping[str, str] | None = None,
    refuse: Callable[[switch.Switch], None] | None = None,
) -> tuple[switch.Switch, bool]:
    """The engine's switch from its flag or keyword values and the environment (graphpersist.switch decides); on,
    `refuse(switch)` may refuse it (nothing is exported then), else the environment is exported for the engine's
    processes (with `pins`). Returns the switch and whether this is its first resolution in this process (logged
    then, with the pins it set)."""
    resolved = switch.resolve(mode, archive_dir)
    if not resolved.enabled:
        if os.environ.get(switch.MODE_ENV, "off") not in ("", "off"):  # the flag said off: so must every process
            os.environ[switch.MODE_ENV] = "off"
        return resolved, False
    if refuse is not None:
        refuse(resolved)
    pinned = export_environment(resolved, os.environ, pins)
    refusal.export(os.environ)  # where an engine process's refusal reaches the process that launched it
    key = (resolved.mode, str(resolved.directory))
    if key in _logged:
        return resolved, False
    _logged.add(key)
    logger.info("%s", resolved.describe())
    if pinned:
        logger.info("graphpersist: pinned for persistence: %s", " ".join(pinned))
    return resolved, True
