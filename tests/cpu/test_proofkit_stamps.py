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
