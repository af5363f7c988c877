"""proofkit's start-up stamps (issue 32): log lines and process births on the wall clock, and the phases between.

The engine drivers turn these into measured phases, so the stamps themselves must be right: a line is stamped when
its first byte appeared (a progress bar's `\\r` ends a line too), a process's birth is read from /proc on the same
clock, and a phase with a missing end is left out rather than named wrongly.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptools import proofkit


def test_lines_are_stamped_when_they_first_appear(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    log.write_text("before the start\n")
    stamps = proofkit.LogStamps(log)
    stamps.start()  # from the log's end: the earlier line is not this start's
    with log.open("a") as f:
        f.write("engine: first\n")
        f.flush()
        time.sleep(0.2)
        f.write("Capturing CUDA graphs (FULL):   0%|\rCapturing CUDA graphs (FULL): 100%|\n")
        f.flush()
        time.sleep(0.1)
        f.write("engine: the last without its end")
    stamps.stop()
    texts = [line for _, line in stamps.lines]
    assert texts == ["engine: first", "Capturing CUDA graphs (FULL):   0%|", "Capturing CUDA graphs (FULL): 100%|"]
    first, bar = stamps.first("engine: first"), stamps.first("Capturing CUDA graphs")
    assert first is not None and bar is not None and 0.15 < bar - first < 1.0
    assert stamps.last("Capturing") == stamps.lines[-1][0]
    assert stamps.first("no such line") is None and abs(time.time() - bar) < 5


def test_a_childs_birth_is_on_the_wall_clock(tmp_path: Path) -> None:
    if not Path("/proc/self/stat").exists():
        pytest.skip("no /proc here")
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)", "VLLM::EngineCore"],
                             start_new_session=True)  # fmt: skip
    try:
        time.sleep(0.3)
        births = proofkit.process_births(child.pid)
        born = proofkit.born(births, "EngineCore")
        assert born is not None and before - 0.05 <= born <= before + 0.3
        assert proofkit.born(births, "sglang::scheduler") is None
    finally:
        child.kill()
        child.wait()


def test_consecutive_stamps_become_phases_and_a_missing_end_drops_both_sides() -> None:
    marks = [("clock", 0.0), ("launch", 1.0), ("boot", 3.5), ("setup", 4.0)]
    assert proofkit.consecutive(marks) == {"launch": 1.0, "boot": 2.5, "setup": 0.5}
    assert proofkit.consecutive([("clock", 0.0), ("launch", None), ("boot", 3.5), ("setup", 4.0)]) == {"setup": 0.5}


def test_an_end_a_hair_before_its_begin_is_no_time_and_one_far_before_is_not_a_phase() -> None:
    """vLLM logs its init time to 0.01 s and a line is stamped when read: an end up to STAMP_SLACK_S early is 0."""
    assert proofkit.consecutive([("clock", 0.0), ("weights_end", 2.0), ("after_weights", 1.996)]) == {
        "weights_end": 2.0,
        "after_weights": 0.0,
    }
    assert proofkit.consecutive([("clock", 0.0), ("weights_end", 2.0), ("after_weights", 1.5)]) == {"weights_end": 2.0}


def test_an_engine_start_is_timed_stamped_and_ends_the_run_only_as_the_recipe_expects(tmp_path: Path) -> None:
    """proofkit.start_engine, the drivers' `LLM(...)` / `sglang.Engine(...)`: ready time and the log's lines stamped
    while it starts; a raise ends the run only when a refusal was expected and the log names it."""
    log = tmp_path / "log.txt"
    log.write_text("")

    def starts() -> str:
        with log.open("a") as f:
            f.write("engine: loading weights\n")
        time.sleep(0.3)
        return "engine"

    def refused() -> str:
        with log.open("a") as f:
            f.write("graphpersist: LOAD refused: flags.max_model_len: saved 4096, live 2048\n")
        raise RuntimeError("Engine core initialization failed")

    began = time.time()
    up = proofkit.start_engine(starts, log, None)
    assert (up.engine, up.result) == ("engine", None) and 0.3 <= up.ready_s < 5
    assert began <= up.t0_wall <= up.stamps.first("loading weights") <= began + 5

    wrongly_up = proofkit.start_engine(starts, log, r"LOAD refused")
    assert wrongly_up.result == {"ok": False, "error": "the engine started: it had to be refused ('LOAD refused')"}

    with pytest.raises(RuntimeError, match="initialization failed"):
        proofkit.start_engine(refused, log, None)
    down = proofkit.start_engine(refused, log, r"LOAD refused: flags\.max_model_len")
    assert down.engine is None and down.result is not None and down.result["ok"] is True
    assert down.result["refusal"]["raised"] == "Engine core initialization failed"
    assert not proofkit.start_engine(refused, log, r"refused at SAVE").result["ok"]  # the log does not say it
