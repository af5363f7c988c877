"""The vLLM proof driver's options (recipes/vllm-qwen3-8b-tp2/driver.py): which reach the engine's processes, how.

The engine's processes inherit the driver's environment, so an option that a worker reads has to land there before
LLM() starts anything. Tested without vLLM: the driver imports it only once a run starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from module_file import load_module

DRIVER_PATH = Path(__file__).resolve().parents[2] / "recipes" / "vllm-qwen3-8b-tp2" / "driver.py"
driver = load_module(DRIVER_PATH, "vllm_recipe_driver")


# every diagnosis switch needs gpdiag's site folder on the processes' path (its sitecustomize wraps the session)
PLUGIN = {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "tools" / "gpdiag" / "site")}


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


FAKE_VLLM = """
__version__ = "0.26.0+gp.1"


class LLM:
    \"\"\"A LOAD refused in the engine core, raised as patched vLLM raises it in this process (patch 0006).\"\"\"

    def __init__(self, **kwargs):
        import os, sys
        from pathlib import Path
        from graphpersist.archive.validate import LoadRefused, Mismatch

        refused = LoadRefused(kwargs["graph_persist_dir"], [Mismatch("flags.max_model_len", 32768, 4096)], 0)
        log = Path(sys.argv[sys.argv.index("--result") + 1]).parent / "log.txt"  # the runner's log of the run
        log.write_text(f"(EngineCore pid=7) {refused}\\n")
        print("reexeced:", os.environ.get("GP_REEXECED"), flush=True)
        raise refused from RuntimeError("Engine core initialization failed. See root cause above.")
"""


def test_a_refused_load_records_what_llm_raised_and_how_often_the_script_ran(tmp_path: Path) -> None:
    """The whole driver (`main`), `--no-reexec` (a plain `python driver.py`, as a user's script), against a vLLM
    whose LLM() raises the runtime's LoadRefused: the run passes on the log's line and records the exception's type,
    its first mismatch line and one process that ran the script."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(FAKE_VLLM)
    (site / "graphpersist_caches.py").write_text("def restore_before_engine(directory):\n    return []\n")
    result, archive = tmp_path / "refused" / "result.json", tmp_path / "archive"
    archive.mkdir()
    overlays = str(Path(__file__).resolve().parents[2] / "overlays" / "graphpersist")
    env = {k: v for k, v in os.environ.items() if k != "GP_REEXECED"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), overlays])
    pattern = r"cannot LOAD .*flags\.max_model_len: saved 32768"
    argv = ["--run", "refused", "--mode", "load", "--archive", str(archive), "--result", str(result), "--no-reexec",
            "--max-model-len", "4096", "--expect-refusal", pattern]  # fmt: skip
    proc = subprocess.run([sys.executable, str(DRIVER_PATH), *argv], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "reexeced: None" in proc.stdout  # --no-reexec: the driver stayed as it was started
    got = json.loads(result.read_text())
    assert got["ok"] is True and got["script_runs"] == 1
    assert got["refusal"]["raised_type"] == "graphpersist.archive.validate.LoadRefused"
    assert got["refusal"]["first_mismatch"] == "flags.max_model_len: saved 32768, live 4096"


# ---------------------------------------------------------------------------------------------------- held batches


class Engine:
    """vLLM's LLM as the driver sees it, with its engine core's arrival race: a plain generate() call's first step
    holds only the first request; while scheduling is paused (level-0 sleep) requests wait and the first step after
    the wake-up holds all of them. A request's tokens name the size of the step that prefilled it."""

    def __init__(self, fail_enqueue: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.paused = False
        self.waiting: list[list[int]] = []
        self.fail_enqueue = fail_enqueue

    @staticmethod
    def _served(steps: list[list[list[int]]]) -> list[Any]:
        from types import SimpleNamespace

        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[len(step), *ids[:1]])]) for step in steps
                for ids in step]  # fmt: skip

    def generate(self, requests: list[dict[str, Any]], params: Any, use_tqdm: bool) -> list[Any]:
        self.calls.append(("generate", len(requests)))
        ids = [r["prompt_token_ids"] for r in requests]
        return self._served([ids[:1], ids[1:]] if len(ids) > 1 else [ids])

    def sleep(self, level: int, mode: str) -> None:
        self.calls.append(("sleep", level, mode))
        self.paused = True

    def enqueue(self, requests: list[dict[str, Any]], params: Any, use_tqdm: bool) -> list[str]:
        self.calls.append(("enqueue", len(requests)))
        if self.fail_enqueue:
            raise ValueError("a prompt longer than max_model_len")
        self.waiting += [r["prompt_token_ids"] for r in requests]
        return [str(i) for i in range(len(requests))]

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tags))
        self.paused = False

    def wait_for_completion(self, use_tqdm: bool) -> list[Any]:
        self.calls.append(("wait_for_completion",))
        assert not self.paused, "a paused engine never completes"
        served, self.waiting = self._served([self.waiting]), []
        return served


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two names `generate` imports: SamplingParams and TokensPrompt (a dict, as vLLM's TypedDict is)."""
    import sys
    from types import ModuleType

    vllm, inputs = ModuleType("vllm"), ModuleType("vllm.inputs")
    vllm.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def test_a_batch_is_held_until_every_request_is_in_so_its_first_step_holds_all(fake_vllm: None) -> None:
    llm = Engine()
    got = driver.generate(llm, [[11], [12], [13]], 4)
    assert llm.calls == [("sleep", 0, "keep"), ("enqueue", 3), ("wake_up", ["scheduling"]), ("wait_for_completion",)]
    assert got == [[3, 11], [3, 12], [3, 13]]  # one step of three


def test_unheld_a_batch_is_one_generate_call_and_its_steps_follow_arrival(fake_vllm: None) -> None:
    llm = Engine()
    got = driver.generate(llm, [[11], [12], [13]], 4, held=False)
    assert llm.calls == [("generate", 3)]
    assert got == [[1, 11], [2, 12], [2, 13]]  # the race the held batch removes


def test_a_single_prompt_needs_no_holding(fake_vllm: None) -> None:
    llm = Engine()
    assert driver.generate(llm, [[11]], 4) == [[1, 11]]
    assert llm.calls == [("generate", 1)]


def test_a_failed_enqueue_still_resumes_scheduling(fake_vllm: None) -> None:
    llm = Engine(fail_enqueue=True)
    with pytest.raises(ValueError, match="max_model_len"):
        driver.generate(llm, [[11], [12]], 4)
    assert llm.calls[-1] == ("wake_up", ["scheduling"]) and not llm.paused


def test_the_driver_holds_batches_unless_told_not_to(tmp_path: Path) -> None:
    base = ["--run", "r", "--mode", "off", "--result", str(tmp_path / "r.json")]
    assert driver.build_parser().parse_args(base).unheld_batches is False
    assert driver.build_parser().parse_args([*base, "--unheld-batches"]).unheld_batches is True


# ------------------------------------------------------------------------------------------- measured start (issue 32)

LOG = {"weights": 1.0, "compile": 5.0, "capture": 4.0, "init_engine": 12.0}
# seconds since LLM() began: engine core born, its first line, weights done, KV line, capture, the init's end line
MARKS = {"core_born": 0.5, "core_first_line": 0.6, "weights_line": 3.0, "kv_line": 8.5, "capture_begin": 9.5,
         "capture_end": 13.6, "init_line": 15.2}  # fmt: skip


def test_an_upstream_start_is_measured_from_its_stamps_with_nothing_left() -> None:
    phases = driver.start_phases(16.0, LOG, [], MARKS)
    assert {k: phases[k] for k in ("engine_config", "core_boot", "core_setup", "after_weights", "handoff")} == {
        "engine_config": 0.5, "core_boot": 0.1, "core_setup": 1.4, "after_weights": 0.2, "handoff": 0.8}  # fmt: skip
    # vLLM's init (3.2 .. 15.2) at its own lines: capture's whole-second log time (4) gives way to the stamps (4.1)
    assert {k: phases[k] for k in ("profile", "kv_warmup", "graphs", "after_graphs")} == {
        "profile": 5.3, "kv_warmup": 1.0, "graphs": 4.1, "after_graphs": 1.6}  # fmt: skip
    assert (phases["start"], phases["rest_of_init"]) == (0.0, 0.0)
    assert sum(phases.values()) == pytest.approx(16.0)


def test_with_persistence_the_rank_stats_time_the_init_and_after_graphs_is_measured() -> None:
    stats = [{"rank": 0, "phases": {"profile": 5.6, "kv_cache": 0.1, "warmup": 0.3, "restore": 1.5,
                                    "after_graphs": 0.7}}]  # fmt: skip
    phases = driver.start_phases(16.0, LOG, stats, {k: v for k, v in MARKS.items() if k != "core_born"})
    assert (phases["after_graphs"], phases["graphs"]) == (0.7, 1.5)
    assert phases["rest_of_init"] == pytest.approx(12.0 - 5.6 - 0.4 - 1.5 - 0.7)
    assert "engine_config" not in phases and "core_boot" not in phases  # the engine core's birth was not seen
    assert phases["start"] == pytest.approx(0.6)  # so LLM()'s configuration and the core's boot stay a remainder
    assert sum(phases.values()) == pytest.approx(16.0)


def test_without_stamps_the_remainders_are_as_before() -> None:
    phases = driver.start_phases(16.0, LOG, [])
    assert phases == {"start": 3.0, "weights": 1.0, "profile": 5.0, "kv_warmup": 0.0, "graphs": 4.0, "save": 0.0,
                      "rest_of_init": 3.0}  # fmt: skip


def test_a_server_adds_its_own_boot_before_the_engine_core() -> None:
    phases = driver.start_phases(16.0, LOG, [], {**MARKS, "front_first_line": 0.3})
    assert (phases["front_boot"], phases["engine_config"], phases["start"]) == (0.3, 0.2, 0.0)
