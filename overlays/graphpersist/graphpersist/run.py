"""The one process-wide slot: the SAVE or LOAD this process runs now, and everything it has gathered.

Like vLLM's forward context, one `Run` holds what a SAVE or LOAD accumulates between the runtime's calls: the
phase recorder, the declared state, LOAD's checks that wait for the post-capture phases, the setup mark, the torch
blocks the graphs read, Inductor's kernel choices, and the engine session running it (if any). The memory and graph
modules read it through `current()`; a persistence session makes a fresh one and activates it, so two sessions
share nothing. The runtime used alone (a recipe, a test) gets one at its first use.

It sits below the memory and graph packages that fill it, so it names their types in comments only. No torch at
import: the engines import the runtime while they parse arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Run:
    """One SAVE or LOAD of this process (see the module's docstring)."""

    recorder: Any = None  # graphpersist.memory.phases.Recorder, made by memory.layout at its first use
    declared: dict[str, Any] = field(default_factory=dict)  # name -> graphpersist.memory.state.Declared
    pending: Any = None  # graphpersist.memory.layout.Pending: LOAD's checks that wait for the post-capture phases
    mark: Any = None  # graphpersist.memory.setup.SetupMark, once mark_setup() ran
    graph_blocks: list[tuple[int, int]] = field(default_factory=list)  # torch blocks graphs read (SAVE, LOAD)
    kernel_choices: Any = None  # graphpersist.graph.kernelchoice.Choices, when Inductor's choices are pinned
    gc_passes: Any = None  # graphpersist.memory.alloctrace.GcPasses, while an allocation trace records
    session: Any = None  # graphpersist.engine.PersistSession running this, or None (the runtime used alone)


_current: Run | None = None


def current() -> Run:
    """The run of this process; the runtime used without a session gets one here, at its first use."""
    global _current
    if _current is None:
        _current = Run()
    return _current


def active() -> Run | None:
    """The run of this process if one began, else None (nothing is created)."""
    return _current


def fresh(session: Any = None) -> Run:
    """Starts a new run (a new SAVE or LOAD in this process) and makes it current."""
    global _current
    _current = Run(session=session)
    return _current


@contextlib.contextmanager
def activated(run: Run) -> Iterator[Run]:
    """`run` current for a block, the one before it afterwards (tests; an engine process keeps its one run)."""
    global _current
    before, _current = _current, run
    try:
        yield run
    finally:
        _current = before
