"""Issue 43.3: the dense TP=1 recipes' real-weight runs (`*_real`), without a GPU.

Each resolves, through its driver's own parser, into an engine started on GP_REAL_MODEL's checkpoint (no dummy
weights), in the output group "real", with the Targets rows that state its start-up; the recipe's other runs keep
the dummy weights. How fast the engines LOAD from a real checkpoint is what the GPU runs measure (not yet run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from module_file import load_module

from gptools import prove
from gptools.proofrecipe import MAIN_OUTPUTS, RunSpec

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
VLLM = load_module(RECIPES / "vllm-qwen3-8b-tp2" / "driver.py", "real_weights_vllm_driver")
SGLANG = load_module(RECIPES / "sglang-qwen3-8b-tp2" / "driver.py", "real_weights_sglang_driver")
RECIPE_NAMES = ["vllm-qwen3-8b-tp1", "sglang-qwen3-8b-tp1"]
REAL = {"save_real": ("save", "r"), "load_real": ("load", "r"), "baseline_real": ("off", None)}


def engine_kwargs(recipe: str, spec: RunSpec, out: Path) -> dict[str, Any]:
    """The engine keywords a run's driver command starts with (the driver's own parser and keyword builder)."""
    command = prove.driver_command(prove.parse_recipe(RECIPES / recipe), out, spec, "python3")
    argv = command[command.index(next(p for p in command if p.endswith("driver.py"))) + 1 :]
    if recipe.startswith("vllm"):
        return VLLM.llm_kwargs(VLLM.build_parser().parse_args(argv))
    a = SGLANG.parse_args(argv)
    return SGLANG.engine_kwargs(a, SGLANG.model_dir(a))


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_the_real_runs_start_the_engine_on_the_checkpoint_and_the_others_on_dummy_weights(
    recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tmp_path / "qwen3-8b-random"
    monkeypatch.setenv(prove.REAL_MODEL_ENV, str(checkpoint))
    runs = prove.parse_recipe(RECIPES / recipe).runs
    assert [r.name for r in runs[-3:]] == list(REAL)  # last: the dummy runs' warm caches come first
    for spec in runs:
        if spec.expect_refusal:
            continue
        kwargs = engine_kwargs(recipe, spec, tmp_path / "out")
        model = kwargs.get("model", kwargs.get("model_path"))
        if spec.name in REAL:
            assert (spec.mode, spec.archive, spec.outputs) == (*REAL[spec.name], "real")
            assert model == str(checkpoint) and "load_format" not in kwargs, spec.name
        else:
            assert spec.outputs == MAIN_OUTPUTS
            assert model == str(tmp_path / "out" / "qwen3-8b-dummy") and kwargs["load_format"] == "dummy", spec.name


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_the_real_weight_targets_state_loads_start_up(recipe: str) -> None:
    targets = {t.name: t for t in prove.parse_recipe(RECIPES / recipe).targets}
    absolute = targets["LOAD start-up, real weights (s)"]
    ratio = targets["LOAD start-up / warm baseline, real weights"]
    assert (absolute.num, absolute.den, absolute.max) == ("load_real.start_to_ready_s", None, 8)
    assert (ratio.num, ratio.den, ratio.max) == ("load_real.start_to_ready_s", "baseline_real.start_to_ready_s", 0.35)
