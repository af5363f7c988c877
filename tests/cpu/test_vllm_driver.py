"""The vLLM proof driver's options (recipes/vllm-qwen3-8b-tp2/driver.py): which reach the engine's processes, how.

The engine's processes inherit the driver's environment, so an option that a worker reads has to land there before
LLM() starts anything. Tested without vLLM: the driver imports it only once a run starts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

DRIVER_PATH = Path(__file__).resolve().parents[2] / "recipes" / "vllm-qwen3-8b-tp2" / "driver.py"
spec = importlib.util.spec_from_file_location("vllm_recipe_driver", DRIVER_PATH)
assert spec is not None and spec.loader is not None
driver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(driver)


PLUGIN = {"GRAPHPERSIST_PLUGINS": "gpdiag.vllm"}  # every diagnosis switch needs the observer that reads it


def exported(tmp_path: Path, *flags: str) -> dict[str, str]:
    result = tmp_path / "run" / "result.json"
    a = driver.build_parser().parse_args(["--run", "r", "--mode", "load", "--result", str(result), *flags])
    environ: dict[str, str] = {}
    driver.export_options(a, environ)
    return environ


def test_no_diagnosis_option_exports_nothing(tmp_path: Path) -> None:
    assert exported(tmp_path) == {}


def test_cprofile_profiles_into_the_runs_folder(tmp_path: Path) -> None:
    assert exported(tmp_path, "--diag-cprofile") == {"GP_DIAG_CPROFILE": str((tmp_path / "run").resolve()), **PLUGIN}


def test_the_runner_state_dump_goes_into_the_runs_folder_too(tmp_path: Path) -> None:
    folder = str((tmp_path / "run").resolve())
    assert exported(tmp_path, "--diag", "--diag-cprofile") == {
        "GP_DIAG_DUMP": folder,
        "GP_DIAG_CPROFILE": folder,
        **PLUGIN,
    }


@pytest.mark.parametrize("how", ["full", "small", "lean"])
def test_the_load_profile_variant_is_passed_as_given(tmp_path: Path, how: str) -> None:
    assert exported(tmp_path, "--diag-load-profile", how) == {"GP_DIAG_LOAD_PROFILE": how, **PLUGIN}


def test_an_unknown_load_profile_variant_is_misuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        exported(tmp_path, "--diag-load-profile", "tiny")
    assert exited.value.code == 2
    assert "invalid choice: 'tiny'" in capsys.readouterr().err


def test_switches_export_one_and_values_themselves(tmp_path: Path) -> None:
    got = exported(tmp_path, "--diag-launch-blocking", "--flashinfer-allreduce-backend", "trtllm", "--replay-timing")
    assert got == {
        "CUDA_LAUNCH_BLOCKING": "1",
        "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # replay timing sends a function to the worker
    }


def test_time_to_first_token_is_timed_on_prompts_the_prefix_cache_has_not_seen() -> None:
    """vLLM caches KV by 16-token block: prompts that share a first block would be timed as a cached prefill."""
    warm, timed = driver.ttft_prompts()
    prompts = [warm, *timed]
    assert len(timed) == 3 and all(len(p) == driver.TTFT_TOKENS for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == len(prompts)


def test_a_run_whose_engine_fails_still_writes_its_result_and_exits_0(tmp_path: Path) -> None:
    """The whole driver (`main`): a vLLM that cannot be imported becomes a failed result.json, not a crash."""
    import os
    import subprocess
    import sys

    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("raise RuntimeError('no engine on this machine')\n")
    result = tmp_path / "baseline" / "result.json"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    proc = subprocess.run(
        [sys.executable, str(DRIVER_PATH), "--run", "baseline", "--mode", "off", "--result", str(result)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result.read_text()) == {"ok": False, "error": "RuntimeError: no engine on this machine"}
    assert f"driver: wrote {result}" in proc.stdout
