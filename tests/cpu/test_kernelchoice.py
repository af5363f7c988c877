"""Inductor's timed kernel choices (graphpersist.graph.kernelchoice), against torch's real CachingAutotuner.

SAVE times the first autotuner object of each kernel source as upstream does and has every later object of that
source launch the same winner; LOAD launches the archive's choice without timing. What a CPU host cannot run (the
GPU timing) is stood in by given timings (tests/cpu/kernelchoice_prelude.py); recipes/vllm-qwen3-8b-tp1 checks it on
the GPU host ("archives a = b", "load timed no kernel choice"). CI's torch is a newer CPU build than the pinned 2.11;
the wrapped method has the same name and signature in both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from warm_python import WarmPython

pytestmark = [pytest.mark.network, pytest.mark.slow]

PRELUDE = Path(__file__).resolve().parent / "kernelchoice_prelude.py"
WIDE = "R0_BLOCK=2048,XBLOCK=1,num_warps=16,num_stages=1"
HALF = "R0_BLOCK=1024,XBLOCK=1,num_warps=16,num_stages=1"


@pytest.fixture(scope="module")
def torch_py(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmPython]:
    work = tmp_path_factory.mktemp("kernelchoice")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHPERSIST_", "PYTHONPATH"))}
    server = WarmPython(vllm_venv / "bin" / "python", PRELUDE, env, work)
    yield server
    server.close()


SAVE = """
choices = kernelchoice.install(loading=False, saved=None, log=LOGGED.append)
"""


def test_save_times_the_first_object_of_a_kernel_source_as_upstream_does(torch_py: WarmPython) -> None:
    """Upstream's own bookkeeping runs: its autotune cache hook records the winner later starts read."""
    got = torch_py.run(
        SAVE
        + """
t = tuner({2048: 0.0990, 1024: 0.0947})
recorded = []
t.save_cache_hook = lambda config, *a, **k: recorded.append(kernelchoice.config_text(config))
t.autotune_to_one_config()
result = {"kept": kept(t), "timed": t.timed, "recorded": recorded, "counts": dict(choices.counts),
          "used": choices.used, "logged": LOGGED}
"""
    ).ok()
    assert got["kept"] == 1024 and got["timed"] == 1 and got["recorded"] == [HALF]
    assert got["counts"] == {"timed": 1} and got["logged"] == []
    assert got["used"] == {
        "cabc123": {
            "kernel": "triton_red_fused_add_rms_norm_2",
            "candidates": [WIDE, HALF],
            "chosen": HALF,
            "how": "timed",
            "objects": 1,
        }
    }


SECOND_OBJECT = """
first = tuner({2048: 0.0990, 1024: 0.0947})
first.autotune_to_one_config()
second = tuner(%r)
recorded = []
second.save_cache_hook = lambda config, *a, **k: recorded.append(kernelchoice.config_text(config))
second.autotune_to_one_config()
result = {"kept": [kept(first), kept(second)], "timed": second.timed, "recorded": recorded,
          "counts": dict(choices.counts), "objects": choices.used["cabc123"]["objects"], "logged": LOGGED}
"""


def test_a_later_object_of_the_same_source_launches_the_first_ones_choice_and_counts_a_disagreement(
    torch_py: WarmPython,
) -> None:
    """What made the tenth session's cold SAVE capture another config in one piece than every later start: each
    object timed on its own; now its own timing is only measured, and upstream's cache gets the first winner."""
    got = torch_py.run(SAVE + SECOND_OBJECT % {2048: 0.0900, 1024: 0.0947}).ok()
    assert got["kept"] == [1024, 1024] and got["recorded"] == [HALF]
    assert got["timed"] == 1  # measured, as upstream would have timed it
    assert got["counts"] == {"timed": 1, "reused": 1, "overruled": 1} and got["objects"] == 2
    [line] = got["logged"]
    assert line == (f"kernel triton_red_fused_add_rms_norm_2 (cabc123): this object's timing preferred {WIDE}; it "
                    f"launches {HALF}, the choice of the first object of its source")  # fmt: skip


def test_a_later_object_that_agrees_is_reused_silently(torch_py: WarmPython) -> None:
    got = torch_py.run(SAVE + SECOND_OBJECT % {2048: 0.0990, 1024: 0.0947}).ok()
    assert got["kept"] == [1024, 1024] and got["counts"] == {"timed": 1, "reused": 1} and got["logged"] == []


def test_a_later_object_with_other_candidates_is_timed_and_named(torch_py: WarmPython) -> None:
    got = torch_py.run(
        SAVE
        + """
first = tuner({2048: 0.0990, 1024: 0.0947})
first.autotune_to_one_config()
other = tuner({2048: 0.0990, 512: 0.0900}, blocks=(2048, 512))
other.autotune_to_one_config()
result = {"kept": kept(other), "counts": dict(choices.counts), "chosen": choices.used["cabc123"]["chosen"],
          "logged": LOGGED}
"""
    ).ok()
    assert got["kept"] == 512 and got["counts"] == {"timed": 2} and got["chosen"] == HALF
    [line] = got["logged"]
    assert line.startswith("kernel triton_red_fused_add_rms_norm_2 (cabc123) timed again at SAVE with other candidates")
    assert line.endswith("a LOAD will time it")


LOAD = """
saved = {"cabc123": {"kernel": "triton_red_fused_add_rms_norm_2", "candidates": [%r, %r], "chosen": %r}}
choices = kernelchoice.install(loading=True, saved=saved, log=LOGGED.append)
"""


def test_load_launches_the_archives_choice_without_timing(torch_py: WarmPython) -> None:
    got = torch_py.run(
        LOAD % (WIDE, HALF, WIDE)
        + """
t = tuner({2048: 0.0990, 1024: 0.0947})  # this process would have chosen the other
t.autotune_to_one_config()
result = {"kept": kept(t), "timed": t.timed, "counts": dict(choices.counts), "logged": LOGGED}
"""
    ).ok()
    assert got == {"kept": 2048, "timed": 0, "counts": {"pinned": 1}, "logged": []}


@pytest.mark.parametrize(
    "kernel_hash, blocks, why",
    [
        ("cdef456", (2048, 1024), "SAVE made no choice for it"),
        ("cabc123", (2048, 512), f"its candidates differ: saved [{WIDE!r}, {HALF!r}], live"),
    ],
)
def test_load_times_what_the_archive_has_no_choice_for_and_says_so(
    torch_py: WarmPython, kernel_hash: str, blocks: tuple[int, ...], why: str
) -> None:
    got = torch_py.run(
        LOAD % (WIDE, HALF, WIDE)
        + f"""
t = tuner({{2048: 0.0990, 1024: 0.0947, 512: 0.0900}}, kernel_hash={kernel_hash!r}, blocks={blocks!r})
t.autotune_to_one_config()
result = {{"kept": kept(t), "timed": t.timed, "counts": dict(choices.counts), "logged": LOGGED}}
"""
    ).ok()
    assert got["timed"] == 1 and got["kept"] == blocks[1]
    assert got["counts"] == {"timed": 1}
    [line] = got["logged"]
    assert line.startswith(f"kernel triton_red_fused_add_rms_norm_2 ({kernel_hash}) timed at LOAD: {why}")
    assert line.endswith(f"chose R0_BLOCK={blocks[1]},XBLOCK=1,num_warps=16,num_stages=1")


def test_a_kernel_without_a_source_file_is_left_to_upstream(torch_py: WarmPython) -> None:
    got = torch_py.run(
        LOAD % (WIDE, HALF, WIDE)
        + "t = tuner({2048: 0.0990, 1024: 0.0947}, kernel_hash='')\nt.autotune_to_one_config()\n"
        + "result = [kept(t), t.timed, dict(choices.counts)]"
    ).ok()
    assert got == [1024, 1, {"unkeyed": 1}]


def test_the_wrapper_is_installed_once_and_a_run_that_pins_nothing_times_as_upstream(torch_py: WarmPython) -> None:
    """The choices belong to the process's run (graphpersist.run): a fresh run (a new session) has none, so the
    process-wide wrapper hands every kernel to upstream's own timing."""
    got = torch_py.run(
        """
from graphpersist import run

before = CachingAutotuner.autotune_to_one_config is UPSTREAM
kernelchoice.install(loading=True, saved={}, log=LOGGED.append)
wrapper = CachingAutotuner.autotune_to_one_config
kernelchoice.install(loading=False, saved=None, log=LOGGED.append)  # a second install wraps nothing twice
same = CachingAutotuner.autotune_to_one_config is wrapper
run.fresh()
t = tuner({2048: 0.0990, 1024: 0.0947})
t.autotune_to_one_config()
result = [before, wrapper is not UPSTREAM, same, kept(t), t.timed, run.current().kernel_choices, LOGGED]
"""
    ).ok()
    assert got == [True, True, True, 1024, 1, None, []]
