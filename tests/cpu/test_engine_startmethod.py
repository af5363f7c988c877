"""The start method of a persisting engine's processes (graphpersist.engine.startmethod), written once for every
engine: the engine's own, except the runtime's spawn where a fork would lose the interposer. The interposer is stood
in (this test process has none); what the spawn then runs is tests/cpu/test_engine_spawn.py's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from graphpersist import switch
from graphpersist.engine import spawn, start_context, startmethod
from graphpersist.memory import region

TOLD = "graphpersist: this process runs without the runtime's interposer, so Tiny's engine process starts with spawn"


@pytest.fixture
def persisting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """A SAVE switch in the environment and a process that has not said anything about its start method yet."""
    monkeypatch.setenv(switch.MODE_ENV, "save")
    monkeypatch.setenv(switch.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(startmethod, "_told", False)
    return monkeypatch


def _method(context: object) -> str:
    mainless = isinstance(context, spawn.MainlessSpawnContext)
    return context.get_start_method() + (" without __main__" if mainless else "")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("interposer", "upstream", "expected"),
    [
        (True, "fork", "fork"),  # a forked child inherits the interposer
        (True, "spawn", "spawn"),
        (False, "spawn", "spawn"),  # the engine spawns anyway: its choice, its script's guard are the user's
        (False, "forkserver", "spawn without __main__"),  # the fork server would lack the interposer as well
        (False, "fork", "spawn without __main__"),
    ],
)
def test_the_engines_method_stands_unless_a_fork_would_lose_the_interposer(
    persisting: pytest.MonkeyPatch, interposer: bool, upstream: str, expected: str
) -> None:
    persisting.setattr(region, "loaded", lambda: interposer)
    assert _method(start_context(upstream, logging.getLogger("tiny"), "Tiny")) == expected


@pytest.mark.parametrize("upstream", ["fork", "spawn"])
def test_persistence_off_keeps_the_engines_method_and_reads_no_interposer(
    monkeypatch: pytest.MonkeyPatch, upstream: str
) -> None:
    monkeypatch.delenv(switch.MODE_ENV, raising=False)

    def asked() -> bool:
        raise AssertionError("persistence off asked whether the interposer is loaded")

    monkeypatch.setattr(region, "loaded", asked)
    assert _method(start_context(upstream, logging.getLogger("tiny"), "Tiny")) == upstream


def test_the_spawn_is_said_once_per_process_naming_the_engine_and_the_way_to_fork(
    persisting: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    persisting.setattr(region, "loaded", lambda: False)
    with caplog.at_level(logging.INFO, logger="tiny"):
        for _ in range(3):
            start_context("fork", logging.getLogger("tiny"), "Tiny")
    assert [r.getMessage() for r in caplog.records] == [
        f"{TOLD} (it imports Tiny again; this script does not run again); start the program under "
        "`python -m graphpersist exec` to let it fork"
    ]
