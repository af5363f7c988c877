"""vLLM glue for the graph-persistence switch (called from the patched ``vllm/engine/arg_utils.py``).

The patch only declares the two ``EngineArgs`` fields and calls the two functions below; the flag spellings,
help, precedence and validation live in ``graphpersist.switch`` so vLLM and SGLang behave the same.
``EngineArgs.__post_init__`` is the earliest point every entry (``vllm serve``, ``LLM(...)``, ``AsyncEngineArgs``)
passes through without touching CUDA, so a bad value is refused there before any engine process starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import MutableMapping
from typing import Any

from vllm.logger import init_logger

from graphpersist import engine
from graphpersist.engine import switch

logger = init_logger(__name__)

GROUP_TITLE = "GraphPersist"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--graph-persist``/``--graph-persist-dir`` as their own group (``vllm serve --help=GraphPersist``)."""
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="Save captured CUDA graphs to an archive once and load them on later starts (graphpersist).",
    )
    switch.add_arguments(group)


WORKER_CLS = "vllm.graphpersist_worker.PersistWorker"

# The switches this process has logged. vLLM builds more EngineArgs after the user's (LLM's log_non_default_args
# builds a default instance to compare with), and those resolve the switch again from the environment exported
# below: without this, one start would log a second line that names GRAPHPERSIST_MODE the user never set.
_logged: set[tuple[switch.Mode, str]] = set()


def resolve_engine_args(engine_args: Any) -> switch.Switch:
    """Resolve and validate the switch of an ``EngineArgs``; log one line when persistence is on (once per process
    and switch), nothing when off.

    On, it selects the persisting worker and prepares the environment every engine and worker process inherits:
    the resolved mode and directory and the runtime's interposer (``LD_PRELOAD``: the address region must exist
    before any CUDA library allocates). Which start method each process uses is ``start_method``'s choice.
    """
    resolved = switch.resolve(engine_args.graph_persist, engine_args.graph_persist_dir)
    if not resolved.enabled:
        if os.environ.get(switch.MODE_ENV, "off") not in ("", "off"):  # the flag said off: so must deep_ep's Buffer
            os.environ[switch.MODE_ENV] = "off"
        return resolved
    if engine_args.worker_cls not in ("auto", WORKER_CLS):
        raise switch.SwitchError(
            f"graphpersist: --graph-persist {resolved.mode.value} needs vLLM's own GPU worker, but worker_cls is "
            f"{engine_args.worker_cls!r}: drop --worker-cls or turn persistence off"
        )
    engine_args.worker_cls = WORKER_CLS
    export_environment(resolved, os.environ)
    if (resolved.mode, str(resolved.directory)) not in _logged:
        _logged.add((resolved.mode, str(resolved.directory)))
        logger.info("%s", resolved.describe())
        if resolved.mode is switch.Mode.LOAD:
            _restore_caches_before_engine(resolved)
    return resolved


def _restore_caches_before_engine(resolved: switch.Switch) -> None:
    """LOAD: what vLLM reads before it starts a worker (graphpersist_caches.BEFORE_ENGINE) comes from the archive
    here, in the process that builds the configuration; the workers restore the other caches."""
    from vllm import graphpersist_caches as caches

    assert resolved.directory is not None
    written = caches.restore_before_engine(resolved.directory)
    if written:
        logger.info("graphpersist: %d cache file(s) restored before the engine starts (%s)", len(written),
                    ", ".join(caches.BEFORE_ENGINE))  # fmt: skip


def export_environment(resolved: switch.Switch, environ: MutableMapping[str, str]) -> None:
    """What the engine core and worker processes need to find the switch and run under the runtime."""
    engine.export_environment(resolved, environ)


_spawn_logged = False

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"

# Set by the patched cli_env_setup (`vllm serve`): the spawn in START_METHOD_ENV is the CLI's default for a user who
# chose none, not the user's choice. A forked child inherits it; start_method clears it once it has decided.
_cli_default_spawn = False


def note_cli_default_spawn() -> None:
    """vLLM's CLI has just set ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` because the user left it unset (called by the
    patched ``cli_env_setup``). Only recorded: with persistence off nothing reads it."""
    global _cli_default_spawn
    _cli_default_spawn = True


def start_method(upstream: str) -> str:
    """The multiprocessing start method for the processes this process starts (called by vLLM's get_mp_context).

    A forked child inherits this process's libraries, so it runs under the interposer exactly when this process
    does; a spawned one executes anew with the exported ``LD_PRELOAD``. With persistence off this returns vLLM's
    choice unchanged. With persistence on:

    - in a process without the interposer (a program that called ``LLM(...)`` without being started under it), only
      ``spawn`` gives the child the runtime;
    - in a process that has it (vLLM's engine core after that spawn, or any process started under
      ``graphpersist exec``), vLLM's own choice, usually ``fork``, which saves each child a fresh import of vLLM
      (about 20 s at TP=2 on the reference host);
    - except that the ``spawn`` `vllm serve` sets for a user who chose none (``note_cli_default_spawn``) is
      revisited: vLLM's library default, ``fork``, is put back and vLLM's own ``_maybe_force_spawn`` decides, so
      the engine core forks unless vLLM would spawn anyway (CUDA initialised here, a Ray actor, NUMA binding,
      WSL). A spawned engine core imports vLLM again: 40.3 s against 30.8 s to healthy for a TP=1 LOAD.
    """
    global _spawn_logged
    if not switch.resolve().enabled:
        return upstream
    interposer = engine.interposer_loaded()
    if upstream == "spawn":
        if _cli_default_spawn and interposer:
            return _fork_unless_vllm_must_spawn()
        return upstream
    if interposer:
        return upstream
    if not _spawn_logged:
        _spawn_logged = True
        logger.info(
            "graphpersist: this process runs without the runtime's interposer, so vLLM's engine process starts "
            "with spawn (it imports vLLM again); start the program under `python -m graphpersist exec` to let "
            "it fork"
        )
    return "spawn"


def _fork_unless_vllm_must_spawn() -> str:
    """The CLI's default spawn, decided again once per process: with upstream's library default (fork) in the
    environment, vLLM's ``_maybe_force_spawn`` sets spawn again, and warns with its reasons, wherever fork is unsafe.
    Whatever it leaves is what every later call (and every forked child) reads, as if the user had chosen it."""
    global _cli_default_spawn
    from vllm.utils import system_utils

    _cli_default_spawn = False
    os.environ[START_METHOD_ENV] = "fork"
    system_utils._maybe_force_spawn()
    method = os.environ[START_METHOD_ENV]
    if method == "fork":
        logger.info(
            "graphpersist: persistence is on and %s is unset, so vLLM's processes fork instead of the CLI's "
            "default spawn (no CUDA context in this process; they do not import vLLM again); set %s=spawn to "
            "spawn them",
            START_METHOD_ENV,
            START_METHOD_ENV,
        )
    return method
