"""The start method of a persisting engine's processes: the engine's own, except where a fork would lose the interposer.

A forked child inherits this process's libraries, so it runs under the runtime's interposer exactly when this process
does; a spawned one executes anew, with the LD_PRELOAD the switch exported (graphpersist.engine.start). So where the
engine would fork from a process without the interposer (a plain `python app.py` that starts the engine), its
processes spawn instead, through the runtime's spawn, which never runs the program's `__main__` again
(graphpersist.engine.spawn): the script runs once, as upstream's fork runs it. Everywhere else the engine's choice
stands: persistence off (which reads nothing but the switch), an engine that spawns anyway, a process that has the
interposer (the engine's own processes, or anything under `graphpersist exec`).
"""

from __future__ import annotations

import logging
import multiprocessing
from multiprocessing.context import BaseContext

from graphpersist import switch
from graphpersist.engine.session import interposer_loaded

_told = False  # this process said once why its engine's processes spawn


def start_context(upstream: str, logger: logging.Logger, engine: str) -> BaseContext:
    """The multiprocessing context of the processes an engine starts with its own start method `upstream`: that one,
    unless persistence is on, the engine would fork and this process lacks the interposer; then the runtime's spawn,
    said once per process in `logger` (`engine` names what the spawned process imports again)."""
    global _told
    if upstream == "spawn" or not switch.resolve().enabled or interposer_loaded():
        return multiprocessing.get_context(upstream)
    if not _told:
        _told = True
        logger.info(
            "graphpersist: this process runs without the runtime's interposer, so %s's engine process starts with "
            "spawn (it imports %s again; this script does not run again); start the program under "
            "`python -m graphpersist exec` to let it fork",
            engine,
            engine,
        )
    from graphpersist.engine.spawn import spawn_context

    return spawn_context()
