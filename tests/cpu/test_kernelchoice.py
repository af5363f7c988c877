"""Inductor's timed kernel choices (graphpersist.kernelchoice), against torch's real CachingAutotuner.

SAVE launches what every later start launches (a kernel's compiled config where upstream keeps no record of a timed
choice; upstream's timing where its autotune cache keeps the winner); LOAD launches the archive's choice without
timing. What a CPU host cannot run (the GPU timing) is stood in by given timings (tests/cpu/kernelchoice_prelude.py);
recipes/vllm-qwen3-8b-tp1 checks it on the GPU host ("archives a = b", "load timed no kernel choice"). CI's torch is
a newer CPU build than the pinned 2.11; the wrapped method has the same name and signature in both.
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


def test_save_launches_the_compiled_config_of_a_kernel_upstream_keeps_no_record_for_without_timing(
    torch_py: WarmPython,
) -> None:
    """One compiled config plus the halved copy Inductor added: every later start (which loads the compiled
    artifact) launches the compiled one, so SAVE does too, even where the copy would time faster."""
    got = torch_py.run(
        SAVE
        + """
t = tuner({2048: 0.0990, 1024: 0.0947})
t.autotune_to_one_config()
result = {"kept": kept(t), "timed": t.timed, "used": choices.used, "counts": dict(choices.counts)}
"""
    ).ok()
    assert got["kept"] == 2048 and got["timed"] == 0
    assert got["used"] == {
        "cabc123": {
            "kernel": "triton_red_fused_add_rms_norm_2",
            "candidates": [WIDE, HALF],
            "chosen": WIDE,
            "how": "compiled",
        }
    }
    assert got["counts"] == {"compiled": 1}


def test_save_times_a_kernel_compiled_with_several_configs_as_upstream_does(torch_py: WarmPython) -> None:
    """Upstream's autotune cache records this winner (save_cache_hook) and hands it to later starts."""
    got = torch_py.run(
        SAVE
        + """
t = tuner({2048: 0.0990, 1024: 0.0947})
recorded = []
t.save_cache_hook = lambda config, *a, **k: recorded.append(kernelchoice.config_text(config))
t.autotune_to_one_config()
result = {"kept": kept(t), "timed": t.timed, "recorded": recorded, "counts": dict(choices.counts),
          "how": choices.used["cabc123"]["how"], "chosen": choices.used["cabc123"]["chosen"]}
"""
    ).ok()
    assert got == {"kept": 1024, "timed": 1, "recorded": [HALF], "counts": {"timed": 1}, "how": "timed",
                   "chosen": HALF}  # fmt: skip


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
