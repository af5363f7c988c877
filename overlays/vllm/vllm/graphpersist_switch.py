"""vLLM glue for the graph-persistence switch, called by the patched `EngineArgs` (patch 0001) and the start-method
seams (0004, 0005); the engine core's failed start (0006) calls the runtime's `graphpersist.engine.refusal_or`
itself. The flag spellings, precedence and validation are the runtime's (graphpersist.switch,
graphpersist.engine.start); patches/vllm/README.md says why each seam is where it is."""

from __future__ import annotations

import functools
import logging
import multiprocessing.context
import os
from typing import Any

from graphpersist import engine
from graphpersist.engine import switch

logger = logging.getLogger(__name__)  # vllm.graphpersist_switch: under vLLM's logger, which vLLM prints

WORKER_CLS = "vllm.graphpersist_worker.PersistWorker"


# `--graph-persist`/`--graph-persist-dir` as their own group (`vllm serve --help=GraphPersist`).
add_cli_args = functools.partial(engine.add_switch_group, title="GraphPersist")


def resolve_engine_args(engine_args: Any) -> switch.Switch:
    """Resolve and validate the switch of an `EngineArgs` (vLLM builds several per start: only the first logs). On,
    it selects the persisting worker and exports what every engine and worker process inherits; a LOAD also puts
    back the caches vLLM reads before it starts a worker."""

    def own_worker(resolved: switch.Switch) -> None:
        if engine_args.worker_cls not in ("auto", WORKER_CLS):
            raise switch.SwitchError(
                f"graphpersist: --graph-persist {resolved.mode.value} needs vLLM's own GPU worker, but worker_cls is "
                f"{engine_args.worker_cls!r}: drop --worker-cls or turn persistence off"
            )

    resolved, first = engine.resolve_switch(
        engine_args.graph_persist, engine_args.graph_persist_dir, logger, refuse=own_worker
    )
    if not resolved.enabled:
        return resolved
    engine_args.worker_cls = WORKER_CLS
    if first and resolved.mode is switch.Mode.LOAD:
        from vllm import graphpersist_caches as caches

        assert resolved.directory is not None
        if written := caches.restore_before_engine(resolved.directory):
            logger.info("graphpersist: %d cache file(s) restored before the engine starts (%s)", len(written),
                        ", ".join(caches.BEFORE_ENGINE))  # fmt: skip
    return resolved


START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"

_cli_default_spawn = False  # `vllm serve` set START_METHOD_ENV=spawn as its default (patch 0005), not the user


def note_cli_default_spawn() -> None:
    """vLLM's CLI has just set ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` because the user left it unset (called by the
    patched ``cli_env_setup``). Only recorded: with persistence off nothing reads it."""
    global _cli_default_spawn
    _cli_default_spawn = True


def mp_context(upstream: str) -> multiprocessing.context.BaseContext:
    """The multiprocessing context of the processes this process starts (vLLM's get_mp_context, patch 0004): the
    runtime's choice (graphpersist.engine.start_context: vLLM's own, except a spawn that runs only the target where
    this process lacks the interposer and vLLM would fork), with `vllm serve`'s default spawn decided again where this
    process has the interposer (patches/vllm/README.md, "The start method")."""
    if upstream == "spawn" and _cli_default_spawn and switch.resolve().enabled and engine.interposer_loaded():
        upstream = _fork_unless_vllm_must_spawn()
    return engine.start_context(upstream, logger, "vLLM")


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
