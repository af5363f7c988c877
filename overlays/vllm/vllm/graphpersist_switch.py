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
        restored_before_engine.extend(written)
        logger.info("graphpersist: %d cache file(s) restored before the engine starts (%s)", len(written),
                    ", ".join(caches.BEFORE_ENGINE))  # fmt: skip


restored_before_engine: list[str] = []  # what this process restored (not compiled here: the proof tells them apart)


def export_environment(resolved: switch.Switch, environ: MutableMapping[str, str]) -> None:
    """What the engine core and worker processes need to find the switch and run under the runtime."""
    engine.export_environment(resolved, environ)


_spawn_logged = False


def start_method(upstream: str) -> str:
    """The multiprocessing start method for the processes this process starts (called by vLLM's get_mp_context).

    A forked child inherits this process's libraries, so it runs under the interposer exactly when this process
    does; a spawned one executes anew with the exported ``LD_PRELOAD``. With persistence on in a process without
    the interposer (a program that called ``LLM(...)`` without being started under it), only ``spawn`` gives the
    child the runtime; a process that has it (vLLM's engine core after that spawn, or any process started under
    ``graphpersist exec``) keeps vLLM's own choice, usually ``fork``, which saves each child a fresh import of vLLM
    (about 20 s at TP=2 on the reference host). With persistence off this returns vLLM's choice unchanged.
    """
    global _spawn_logged
    if upstream == "spawn" or not switch.resolve().enabled or engine.interposer_loaded():
        return upstream
    if not _spawn_logged:
        _spawn_logged = True
        logger.info(
            "graphpersist: this process runs without the runtime's interposer, so vLLM's engine process starts "
            "with spawn (it imports vLLM again); start the program under `python -m graphpersist exec` to let "
            "it fork"
        )
    return "spawn"
