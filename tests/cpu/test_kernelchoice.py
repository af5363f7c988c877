"""Inductor's timed kernel choices, made once (graphpersist.kernelchoice), against torch's real CachingAutotuner.

SAVE times a kernel as upstream does the first time a host sees it and keeps the winner for every later SAVE and
every rank; LOAD launches the archive's winner without timing. What a CPU host cannot run (the GPU timing) is stood
in by given timings (tests/cpu/kernelchoice_prelude.py); recipes/vllm-qwen3-8b-tp1 proves it on the GPU host
("archives a = b", "load timed no kernel choice").
"""

from __future__ import annotations

import json
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


def save(store: Path) -> str:
    return f"""
os.environ["GRAPHPERSIST_KERNEL_CHOICES_DIR"] = {str(store)!r}
choices = kernelchoice.install(loading=False, saved=None, log=LOGGED.append)
"""


def test_a_first_save_times_as_upstream_keeps_the_faster_and_records_it_for_the_host(
    torch_py: WarmPython, tmp_path: Path
) -> None:
    got = torch_py.run(
        "import os\n"
        + save(tmp_path)
        + """
t = tuner({2048: 0.0990, 1024: 0.0947})
t.autotune_to_one_config()
result = {"kept": kept(t), "timed": t.timed, "used": choices.used, "counts": dict(choices.counts)}
"""
    ).ok()
    assert got["kept"] == 1024 and got["timed"] == 1
    assert got["used"] == {
        "cabc123": {
            "kernel": "triton_red_fused_add_rms_norm_2",
            "candidates": [WIDE, HALF],
            "chosen": HALF,
            "how": "timed",
        }
    }
    assert got["counts"] == {"timed": 1}
    [record] = tmp_path.glob("cabc123-*.json")
    assert json.loads(record.read_text()) == {
        "kernel": "triton_red_fused_add_rms_norm_2",
        "candidates": [WIDE, HALF],
        "chosen": HALF,
    }
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_a_later_save_on_the_host_launches_the_recorded_winner_without_timing(
    torch_py: WarmPython, tmp_path: Path
) -> None:
    first = "import os\n" + save(tmp_path) + "t = tuner({2048: 0.0990, 1024: 0.0947})\nt.autotune_to_one_config()"
    torch_py.run(first).ok()
    got = torch_py.run(  # a new process, whose timing now favours the other config (a near tie)
        "import os\n"
        + save(tmp_path)
        + """
t = tuner({2048: 0.0940, 1024: 0.0947})
t.autotune_to_one_config()
result = {"kept": kept(t), "timed": t.timed, "how": choices.used["cabc123"]["how"], "counts": dict(choices.counts)}
"""
    ).ok()
    assert got == {"kept": 1024, "timed": 0, "how": "host", "counts": {"host": 1}}


def test_a_save_that_another_rank_beat_to_the_record_launches_the_others_winner(
    torch_py: WarmPython, tmp_path: Path
) -> None:
    got = torch_py.run(
        "import os, json\n"
        + save(tmp_path)
        + f"""
t = tuner({{2048: 0.0990, 1024: 0.0947}})
timing = t.benchmark_all_configs
def raced(*a, **k):  # the other rank publishes while this one times
    path = kernelchoice.store_dir() / ("cabc123-" + kernelchoice._digest([{WIDE!r}, {HALF!r}]) + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({{"kernel": "k", "candidates": [{WIDE!r}, {HALF!r}], "chosen": {WIDE!r}}}))
    return timing(*a, **k)
t.benchmark_all_configs = raced
t.autotune_to_one_config()
result = {{"kept": kept(t), "used": choices.used["cabc123"]["chosen"]}}
"""
    ).ok()
    assert got == {"kept": 2048, "used": WIDE}


def test_a_host_record_for_other_candidates_is_not_used(torch_py: WarmPython, tmp_path: Path) -> None:
    other = "t = tuner({2048: 0.1, 512: 0.2}, blocks=(2048, 512))\nt.autotune_to_one_config()"
    torch_py.run("import os\n" + save(tmp_path) + other).ok()
    got = torch_py.run(
        "import os\n"
        + save(tmp_path)
        + "t = tuner({2048: 0.0990, 1024: 0.0947})\nt.autotune_to_one_config()\nresult = [kept(t), t.timed]"
    ).ok()
    assert got == [1024, 1]
    assert len(list(tmp_path.glob("cabc123-*.json"))) == 2  # one record per candidate set


LOAD = """
saved = {"cabc123": {"kernel": "triton_red_fused_add_rms_norm_2", "candidates": [%r, %r], "chosen": %r}}
choices = kernelchoice.install(loading=True, saved=saved, log=LOGGED.append)
"""


def test_load_launches_the_archives_choice_without_timing_or_writing(torch_py: WarmPython, tmp_path: Path) -> None:
    got = torch_py.run(
        f"import os\nos.environ['GRAPHPERSIST_KERNEL_CHOICES_DIR'] = {str(tmp_path)!r}\n"
        + LOAD % (WIDE, HALF, WIDE)
        + """
t = tuner({2048: 0.0990, 1024: 0.0947})  # this process would have chosen the other
t.autotune_to_one_config()
result = {"kept": kept(t), "timed": t.timed, "counts": dict(choices.counts), "logged": LOGGED}
"""
    ).ok()
    assert got == {"kept": 2048, "timed": 0, "counts": {"pinned": 1}, "logged": []}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kernel_hash, blocks, why",
    [
        ("cdef456", (2048, 1024), "SAVE never timed it"),
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


def test_off_leaves_upstreams_method_and_uninstall_puts_it_back(torch_py: WarmPython) -> None:
    got = torch_py.run(
        """
before = CachingAutotuner.autotune_to_one_config is UPSTREAM
kernelchoice.install(loading=True, saved={}, log=LOGGED.append)
wrapped = CachingAutotuner.autotune_to_one_config is not UPSTREAM
kernelchoice.install(loading=False, saved=None, log=LOGGED.append)  # a second install wraps nothing twice
kernelchoice.uninstall()
result = [before, wrapped, CachingAutotuner.autotune_to_one_config is UPSTREAM]
"""
    ).ok()
    assert got == [True, True, True]
