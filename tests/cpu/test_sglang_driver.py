"""The SGLang proof driver (recipes/sglang-qwen3-8b-tp2, shared by its -nccl and -symm variants) on CPU.

What needs no GPU: the driver's arguments, the Engine keywords each recipe's flags give, the model folder it writes,
the answer shapes it accepts, the phases it reads from SGLang's log lines and the runtime's stats, and the whole
committed proof.toml through `python -m gptools prove` with a fake `sglang` package standing in for SGLang (its
Engine prints SGLang's summary line, writes per-rank stats and, in SAVE, an archive of the real format).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import fake_sglang_site
import pytest
from module_file import load_module

from gptools import jsonfile
from gptools.__main__ import main as gptools_main

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
DRIVER_PATH = RECIPES / "sglang-qwen3-8b-tp2" / "driver.py"
VARIANTS = ("sglang-qwen3-8b-tp2", "sglang-qwen3-8b-tp2-nccl", "sglang-qwen3-8b-tp2-symm")
DEEPEP = "sglang-qwen3-30b-a3b-ep2-deepep"  # the same driver with --deepep


def load_driver() -> ModuleType:
    """The driver under a name of its own (the vLLM recipes' tests import another `driver`)."""
    return load_module(DRIVER_PATH, "sglang_qwen3_8b_tp2_driver")


driver = load_driver()

SUMMARY = (
    "[2026-11-30 12:00:10] Engine startup timings (s): load_weight=1.50, kv_cache_allocation=0.40, "
    "scheduler_e2e=25.00, cuda_graph={prefill=13.60, decode=6.10, target_verify=0.00}, tokenizer_e2e=30.00"
)


def args(*extra: str, mode: str = "off", result: str = "/tmp/out/baseline/result.json") -> Any:
    return driver.parse_args(["--run", "r", "--mode", mode, "--result", result, *extra])


# ------------------------------------------------------------------------------------------- arguments


def test_defaults_are_the_recipes_tp2_dummy_start() -> None:
    a = args()
    assert (a.tp, a.mem_fraction_static, a.model, a.archive) == (2, 0.5, None, None)
    assert not (a.disable_cuda_graph or a.disable_custom_all_reduce or a.enable_torch_symm_mem)
    assert not a.symm_mem_no_multicast


@pytest.mark.parametrize(
    ("mode", "archive", "message"),
    [("save", None, "--archive is needed with --mode save"), ("off", "/a", "--archive is not allowed with --mode off")],
)
def test_an_archive_goes_with_save_and_load_only(
    mode: str, archive: str | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        args(*(["--archive", archive] if archive else []), mode=mode)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_names_every_launch_flag() -> None:
    proc = subprocess.run([sys.executable, str(DRIVER_PATH), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--disable-cuda-graph", "--disable-custom-all-reduce", "--enable-torch-symm-mem", "--model"):
        assert flag in proc.stdout


# ------------------------------------------------------------------------------------------- Engine keywords


def test_engine_keywords_of_a_dummy_start_leave_unset_flags_to_sglang(tmp_path: Path) -> None:
    kwargs = driver.engine_kwargs(args("--archive", "/arch", mode="load"), tmp_path)
    assert kwargs == {
        "model_path": str(tmp_path),
        "tp_size": 2,
        "mem_fraction_static": 0.5,
        "context_length": 4096,
        "random_seed": 0,
        "log_level": "info",
        "graph_persist": "load",
        "graph_persist_dir": "/arch",
        "load_format": "dummy",
        "skip_tokenizer_init": True,
    }


def test_each_launch_flag_becomes_its_engine_keyword(tmp_path: Path) -> None:
    for flag in driver.ENGINE_FLAGS:
        kwargs = driver.engine_kwargs(args("--" + flag.replace("_", "-")), tmp_path)
        assert kwargs[flag] is True
        assert not {f for f in driver.ENGINE_FLAGS if f != flag} & set(kwargs)


def test_a_real_checkpoint_loads_its_weights_and_tokenizer(tmp_path: Path) -> None:
    kwargs = driver.engine_kwargs(args("--model", str(tmp_path), "--tp", "4"), tmp_path)
    assert "load_format" not in kwargs and "skip_tokenizer_init" not in kwargs
    assert (kwargs["model_path"], kwargs["tp_size"]) == (str(tmp_path), 4)


def test_the_dummy_model_folder_is_one_qwen3_8b_config_beside_the_runs(tmp_path: Path) -> None:
    first = driver.model_dir(args(result=str(tmp_path / "out" / "save" / "result.json")))
    second = driver.model_dir(args(result=str(tmp_path / "out" / "load" / "result.json")))
    assert first == second == tmp_path / "out" / "qwen3-8b-dummy"
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["vocab_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (151936, 36, 8)


def test_a_checkpoint_folder_is_used_as_given_and_not_written(tmp_path: Path) -> None:
    assert driver.model_dir(args("--model", str(tmp_path / "ckpt"))) == tmp_path / "ckpt"
    assert not (tmp_path / "ckpt").exists()


def test_prompts_and_model_are_the_vllm_recipes() -> None:
    vllm_driver = load_module(RECIPES / "vllm-qwen3-8b-tp2" / "driver.py", "vllm_recipe_for_test")
    assert driver.QWEN3_8B == vllm_driver.QWEN3_8B
    assert driver.prompt(3, 50) == vllm_driver.prompt(3, 50)


def test_greedy_sampling_with_a_fixed_length() -> None:
    assert driver.sampling(7) == {"temperature": 0.0, "max_new_tokens": 7, "ignore_eos": True}


# ------------------------------------------------------------------------------------------- answers


def test_token_ids_keep_request_order() -> None:
    outs = [{"output_ids": [1, 2], "text": ""}, {"output_ids": [3, 4]}]
    assert driver.token_ids(outs, 2, 2) == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ([{"output_ids": [1, 2]}], "expected 2 outputs, got 1"),
        ({"output_ids": [1, 2]}, "expected 2 outputs, got dict"),
        ([{"output_ids": [1, 2]}, {"output_ids": [3]}], "output 1: expected 2 token ids, got 1"),
        ([{"output_ids": [1, 2]}, {"text": "x"}], "output 1: expected 2 token ids, got no output_ids"),
    ],
)
def test_an_answer_of_another_shape_fails_the_run(outputs: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        driver.token_ids(outputs, 2, 2)


def test_the_oversize_batch_must_exceed_the_largest_decode_graph() -> None:
    server_args = SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(max_bs=256),
                                                                    prefill=SimpleNamespace(max_bs=8192)))  # fmt: skip
    inventory = driver.graph_inventory(server_args)
    assert inventory == {"decode_max_bs": 256, "prefill_max_tokens": 8192}
    driver.check_oversize(driver.OVERSIZE_REQUESTS, inventory)
    with pytest.raises(ValueError, match=r"300 requests\) is not larger than the largest decode graph \(512\)"):
        driver.check_oversize(300, {"decode_max_bs": 512})
    assert driver.graph_inventory(object()) == {"decode_max_bs": None, "prefill_max_tokens": None}
    driver.check_oversize(1, {"decode_max_bs": None})  # unknown: the run goes on, the inventory says so


# ------------------------------------------------------------------------------------------- phases


def test_the_summary_line_gives_weights_kv_scheduler_and_every_graph_phase() -> None:
    text = f"Load weight end. elapsed=9.99 s, type=Qwen3\n{SUMMARY}\n"
    assert driver.log_phases(text) == {"weights": 1.5, "kv_cache": 0.4, "scheduler": 25.0, "graphs": 19.7}


def test_without_the_summary_the_slowest_ranks_lines_are_read() -> None:
    text = "\n".join([
        "[TP0] Load weight end. elapsed=1.20 s, type=Qwen3ForCausalLM, avail mem=60.00 GB, mem usage=8.00 GB.",
        "[TP1] Load weight end. elapsed=1.40 s, type=Qwen3ForCausalLM, avail mem=60.00 GB, mem usage=8.00 GB.",
        "[TP0] Capture target prefill CUDA graph end. elapsed=13.00 s, mem usage=1.00 GB, avail mem=10.00 GB.",
        "[TP1] Capture target prefill CUDA graph end. elapsed=13.50 s, mem usage=1.00 GB, avail mem=10.00 GB.",
        "[TP0] Capture target decode CUDA graph end. elapsed=6.00 s, mem usage=1.00 GB, avail mem=9.00 GB.",
    ])  # fmt: skip
    assert driver.log_phases(text) == {"weights": 1.4, "graphs": 19.5}
    assert driver.log_phases("nothing here") == {}


def test_phases_of_an_upstream_start_add_up_to_its_start_up_time() -> None:
    phases = driver.start_phases(30.0, driver.log_phases(SUMMARY), [])
    assert phases == {"start": 5.0, "weights": 1.5, "profile": 0.0, "kv_warmup": 0.4, "graphs": 19.7, "save": 0.0,
                      "rest_of_init": 3.4}  # fmt: skip
    assert sum(phases.values()) == pytest.approx(30.0)


def test_with_persistence_the_runtimes_slowest_rank_splits_graphs_and_save() -> None:
    stats = [
        {"rank": 0, "phases": {"capture": 5.0, "save": 7.0, "warmup": 0.2}},
        {"rank": 1, "phases": {"capture": 5.5, "save": 6.0, "kv_cache": 0.1}},
    ]
    phases = driver.start_phases(30.0, driver.log_phases(SUMMARY), stats)
    assert (phases["graphs"], phases["save"], phases["kv_warmup"]) == (5.5, 7.0, 0.6)
    assert phases["rest_of_init"] == pytest.approx(25.0 - 1.5 - 0.6 - 5.5 - 7.0)
    assert sum(phases.values()) == pytest.approx(30.0)


def test_saves_kernel_warm_up_counts_as_save_and_the_phases_still_add_up() -> None:
    stats = [
        {"rank": 0, "phases": {"capture": 5.0, "kernel_warmup_before_save": 1.5, "save": 2.0}},
        {"rank": 1, "phases": {"capture": 5.0, "kernel_warmup_before_save": 1.75, "save": 1.0}},
    ]
    phases = driver.start_phases(30.0, driver.log_phases(SUMMARY), stats)
    assert phases["save"] == 3.75
    assert sum(phases.values()) == pytest.approx(30.0)


def test_without_the_summary_only_the_runtimes_phases_are_reported() -> None:
    stats = [{"rank": 0, "phases": {"restore": 1.2}}, {"rank": 1, "phases": {"restore": 1.4}}]
    assert driver.start_phases(12.0, {"weights": 1.0}, stats) == {"restore": 1.2}
    assert driver.start_phases(12.0, {}, []) == {}


def test_restored_cache_files_are_named_as_snapshots_name_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "TVM_FFI_CACHE_DIR"
    monkeypatch.setenv("GP_PROOF_CACHE_DIRS", str(root))
    stats = [{"rank": 0, "jitcache_restored": [str(root / "m" / "k.so"), "/elsewhere/x.so"]}]
    assert driver.restored_cache_files(stats) == {"TVM_FFI_CACHE_DIR/m/k.so"}


# ------------------------------------------------------------------------------------------- recipes

FAKE_ENGINE = '''
"""A stand-in for sglang.srt.entrypoints.engine: what the proof driver asks of SGLang, without a GPU.

Its start keeps SGLang's order and clock: a scheduler process (titled as SGLang titles it) is born, "imports", then
loads weights, allocates the KV cache and captures (or restores) graphs, each taking the time its lines say, and the
main process prints the summary line with scheduler_e2e from Scheduler.__init__'s begin. FAKE_SGLANG_GAP=S spends
S seconds between weights and KV cache that no line or stat times (a gap the phase check must see).
"""
import json, os, subprocess, sys, time
from pathlib import Path
from types import SimpleNamespace

SCHEDULER = "import os, sys, time\\nwhile os.getppid() == int(sys.argv[1]): time.sleep(0.05)"


def step(seconds, line=None):
    """Sleeps `seconds`; prints `line` with {s} as the time it really took (a loaded machine oversleeps)."""
    started = time.perf_counter()
    time.sleep(seconds)
    took = time.perf_counter() - started
    if line:
        print(line.format(s=took), flush=True)
    return took


class Engine:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        record = os.environ.get("FAKE_SGLANG_RECORD")
        if record:
            seen = dict(kwargs, symm_env=os.environ.get("GRAPHPERSIST_SYMM_MEM_NO_MULTICAST"))
            Path(record).write_text(json.dumps(seen))
        step(0.05)  # ServerArgs, ports
        self.scheduler = subprocess.Popen([sys.executable, "-c", SCHEDULER, str(os.getpid()), "sglang::scheduler_TP0"])
        step(0.3)  # the scheduler's imports
        begin = time.perf_counter()
        step(0.05, "[TP0] Init torch distributed begin.")
        weights = step(0.1, "[TP0] Load weight end. elapsed={s:.2f} s, type=Qwen3ForCausalLM, avail mem=60.00 GB")
        step(float(os.environ.get("FAKE_SGLANG_GAP", "0")))
        mode = kwargs["graph_persist"]
        kv = step(0.05)  # KV cache
        eager = kwargs.get("disable_cuda_graph")
        graphs_s = 0.0
        if mode == "save":
            from archive_fixtures import write_archive

            graphs_s = step(0.2, "[TP0] Capture target decode CUDA graph end. elapsed={s:.2f} s")
            started = time.perf_counter()
            write_archive(Path(kwargs["graph_persist_dir"]))
            save_s = time.perf_counter() - started
            print("[TP0] graphpersist: rank 0: saved 4 graphs", flush=True)
        elif mode == "load":
            graphs_s = step(0.04, "[TP0] graphpersist: rank 0: restored 4 graphs")
        elif not eager:
            graphs_s = step(0.2, "[TP0] Capture target decode CUDA graph end. elapsed={s:.2f} s")
        stats = Path(os.environ["GRAPHPERSIST_STATS_DIR"])
        if mode != "off":
            for rank in range(kwargs["tp_size"]):
                (stats / f"rank_{rank}.json").write_text(json.dumps({
                    "rank": rank, "mode": mode, "captured": 4 if mode == "save" else 0,
                    "restored": 4 if mode == "load" else 0, "capture_calls": 4 if mode == "save" else 0,
                    "phases": {"capture": round(graphs_s, 4), "save": round(save_s, 4)} if mode == "save"
                              else {"restore": round(graphs_s, 4)}}))
        step(0.05)  # the scheduler's set-up after its graphs
        graphs = f"prefill=0.00, decode={0.0 if eager or mode == 'load' else graphs_s:.2f}"
        e2e = time.perf_counter() - begin
        print(f"Engine startup timings (s): load_weight={weights:.2f}, kv_cache_allocation={kv:.2f}, "
              f"scheduler_e2e={e2e:.3f}, cuda_graph={{{graphs}}}, tokenizer_e2e=0.70", flush=True)
        step(0.02)  # the engine's return
        decode = SimpleNamespace(max_bs=256)
        self.server_args = SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=decode, prefill=None))

    def generate(self, input_ids, sampling_params):
        n = sampling_params["max_new_tokens"]
        greedy = sampling_params["temperature"] == 0.0
        assert sampling_params["ignore_eos"] and (greedy or (len(input_ids), n) == (1, 4)), sampling_params
        return [{"output_ids": [(sum(p) + k) % 151936 for k in range(n)], "text": ""} for p in input_ids]
'''


@pytest.fixture
def fake_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `sglang` package on PYTHONPATH (with the runtime and the archive fixtures the fake Engine uses)."""
    return fake_sglang_site.install(tmp_path, monkeypatch, FAKE_ENGINE)


def test_the_committed_proof_passes_against_a_fake_sglang(fake_sglang: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert gptools_main(["prove", str(RECIPES / "sglang-qwen3-8b-tp2"), "--out", str(out)]) == 0
    assert (out / "REPORT.md").read_text().splitlines()[0] == "all checks passed"
    save = json.loads((out / "save" / "result.json").read_text())
    assert set(save["outputs"]) == {"sequential", "concurrent", "oversize"}
    assert [len(save["outputs"][w]) for w in ("sequential", "concurrent", "oversize")] == [4, 16, 301]
    assert all(len(seq) == driver.GEN for w in save["outputs"].values() for seq in w)
    assert set(save["latency"]) == {"first_request_s", "steady_request_s", "ttft_long_s", "decode_tps_b1",
                                    "decode_tps_b32", "import_sglang_s"}  # fmt: skip
    assert list(save["phases"]) == [
        "start",
        "engine_launch",
        "scheduler_boot",
        "handoff",
        "weights",
        "profile",
        "kv_warmup",
        "graphs",
        "save",
        "scheduler_setup",
        "after_graphs",
        "rest_of_init",
    ]
    captured = json.loads((out / "save" / "stats" / "rank_0.json").read_text())["phases"]["capture"]
    assert captured >= 0.2 and save["phases"]["graphs"] == pytest.approx(captured, abs=1e-3)  # the rank's capture time
    assert save["engine"] == {"name": "sglang", "version": "0.5.17+gp.1"}
    assert save["graph_inventory"]["decode_max_bs"] == 256
    assert (save["jit"]["new_cache_files_later"], save["jit"]["examples_later"]) == (0, [])
    eager = json.loads((out / "eager" / "result.json").read_text())
    assert eager["phases"]["graphs"] == 0.0


def start_off(recipe: str, tmp_path: Path) -> tuple[dict, dict]:
    """Runs the recipe's driver command from its proof.toml once with persistence off, against the stand-in SGLang:
    (its result.json, the arguments Engine() received)."""
    toml = tomllib.loads((RECIPES / recipe / "proof.toml").read_text())
    command = [part.replace("{python}", sys.executable) for part in toml["driver"]]
    result, record = tmp_path / "out" / "baseline" / "result.json", tmp_path / "engine.json"
    (result.parent / "stats").mkdir(parents=True)
    env = dict(os.environ, FAKE_SGLANG_RECORD=str(record), GRAPHPERSIST_STATS_DIR=str(result.parent / "stats"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tools"), env["PYTHONPATH"]])
    proc = subprocess.run([*command, "--run", "baseline", "--mode", "off", "--result", str(result)],
                          cwd=RECIPES / recipe, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(result.read_text()), json.loads(record.read_text())


@pytest.mark.parametrize("recipe", VARIANTS)
def test_each_recipe_starts_the_engine_with_its_launch(recipe: str, fake_sglang: Path, tmp_path: Path) -> None:
    """The variant's driver command from its proof.toml, run once with persistence off: what Engine() received."""
    result, seen = start_off(recipe, tmp_path)
    assert result["ok"], result
    flags = {f for f in driver.ENGINE_FLAGS if seen.get(f)}
    expected = {
        "sglang-qwen3-8b-tp2": (set(), None),
        "sglang-qwen3-8b-tp2-nccl": ({"disable_custom_all_reduce"}, None),
        "sglang-qwen3-8b-tp2-symm": ({"enable_torch_symm_mem"}, "1"),
    }[recipe]
    assert (flags, seen["symm_env"]) == expected
    assert (seen["tp_size"], seen["graph_persist"], seen["load_format"]) == (2, "off", "dummy")


@pytest.mark.parametrize("recipe", VARIANTS)
def test_every_recipe_moves_every_sglang_jit_cache(recipe: str) -> None:
    """A fresh run must start with empty caches: each variable that moves one of SGLang's caches is listed."""
    cache_env = set(tomllib.loads((RECIPES / recipe / "proof.toml").read_text())["cache_env"])
    assert {"TVM_FFI_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "SGLANG_CACHE_DIR", "TRITON_CACHE_DIR",
            "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME", "HOME"} <= cache_env  # fmt: skip


def test_the_sglang_recipes_can_share_one_out() -> None:
    """engine-proof.sh runs the recipes into one --out (one warm cache): no run or archive name may repeat."""
    runs, archives = [], []
    for recipe in (*VARIANTS, DEEPEP):
        toml = tomllib.loads((RECIPES / recipe / "proof.toml").read_text())
        runs += [r["name"] for r in toml["run"]]
        archives += sorted({r["archive"] for r in toml["run"] if "archive" in r})
    assert len(runs) == len(set(runs)) == 23
    assert len(archives) == len(set(archives)) == 8


# ------------------------------------------------------------------------ the DeepEP recipe (EP=2, not run on GPUs)


def test_deepep_engine_keywords_are_normal_mode_expert_parallelism_over_the_tp_ranks(tmp_path: Path) -> None:
    a = driver.parse_args(["--run", "r", "--mode", "off", "--result", str(tmp_path / "r" / "result.json"), "--deepep"])
    kwargs = driver.engine_kwargs(a, driver.model_dir(a))
    assert {k: kwargs[k] for k in ("moe_a2a_backend", "deepep_mode", "ep_size", "tp_size", "moe_runner_backend")} == {
        "moe_a2a_backend": "deepep", "deepep_mode": "normal", "ep_size": 2, "tp_size": 2,
        "moe_runner_backend": "deep_gemm",
    }  # fmt: skip
    assert all(bs % 8 == 0 for bs in kwargs["cuda_graph_bs_decode"])
    assert max(kwargs["cuda_graph_bs_decode"]) < driver.OVERSIZE_REQUESTS
    config = json.loads((tmp_path / "qwen3-30b-a3b-dummy" / "config.json").read_text())
    assert (config["architectures"], config["num_experts"], config["num_experts_per_tok"]) == (
        ["Qwen3MoeForCausalLM"], 128, 8)  # fmt: skip
    plain = driver.parse_args(["--run", "r", "--mode", "off", "--result", str(tmp_path / "r" / "result.json")])
    assert "moe_a2a_backend" not in driver.engine_kwargs(plain, driver.model_dir(plain))


def test_the_deepep_proof_passes_against_a_fake_sglang(fake_sglang: Path, tmp_path: Path) -> None:
    """baseline / save / save2 / load / fresh load, every check of the runner, the baseline's outputs not compared."""
    out = tmp_path / "out"
    assert gptools_main(["prove", str(RECIPES / DEEPEP), "--out", str(out)]) == 0
    assert (out / "REPORT.md").read_text().splitlines()[0] == "all checks passed"
    toml = tomllib.loads((RECIPES / DEEPEP / "proof.toml").read_text())
    assert [(r["name"], r["mode"]) for r in toml["run"]] == [
        ("deepep_save", "save"), ("deepep_load", "load"), ("deepep_baseline", "off"), ("deepep_save2", "save"),
        ("deepep_load_fresh", "load"),
    ]  # fmt: skip
    assert [r["name"] for r in toml["run"] if r.get("compare_outputs", True) is False] == ["deepep_baseline"]
    caches = {"TVM_FFI_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "SGLANG_CACHE_DIR", "TRITON_CACHE_DIR",
              "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "XDG_CACHE_HOME", "HOME"}  # fmt: skip
    assert caches <= set(toml["cache_env"])
    save = json.loads((out / "deepep_save" / "result.json").read_text())
    assert save["ok"] and len(save["outputs"]["oversize"]) == driver.OVERSIZE_REQUESTS + 1


def test_the_deepep_recipe_starts_the_engine_with_deepep(fake_sglang: Path, tmp_path: Path) -> None:
    _, seen = start_off(DEEPEP, tmp_path)
    assert (seen["moe_a2a_backend"], seen["deepep_mode"], seen["ep_size"], seen["tp_size"]) == (
        "deepep",
        "normal",
        2,
        2,
    )
    assert seen["model_path"].endswith("qwen3-30b-a3b-dummy")


# ------------------------------------------------------------------------------------------- measured start (issue 32)


def test_stamps_turn_the_start_and_the_schedulers_set_up_into_measured_phases() -> None:
    marks = {"scheduler_born": 1.0, "weights_line": 12.5, "graphs_end_line": 24.0, "summary_line": 26.0}
    phases = driver.start_phases(27.0, driver.log_phases(SUMMARY), [], marks)
    # Scheduler.__init__ began at the summary line less scheduler_e2e (26 - 25 = 1.0): right at the birth here
    assert (phases["engine_launch"], phases["scheduler_boot"], phases["handoff"]) == (1.0, 0.0, 1.0)
    assert (phases["scheduler_setup"], phases["after_graphs"]) == (10.0, 2.0)  # 12.5 - 1.5 - 1.0; 26 - 24
    assert phases["start"] == 0.0  # every part of the start measured: nothing remains
    assert phases["rest_of_init"] == pytest.approx(25.0 - 1.5 - 0.4 - 19.7 - 10.0 - 2.0)
    assert sum(phases.values()) == pytest.approx(27.0)


def test_a_missing_stamp_leaves_its_parts_in_the_remainder() -> None:
    marks = {"weights_line": 12.5, "summary_line": 26.0}  # no scheduler process seen
    phases = driver.start_phases(27.0, driver.log_phases(SUMMARY), [], marks)
    assert "engine_launch" not in phases and "scheduler_boot" not in phases
    assert phases["start"] == 1.0  # 27 - 25 - handoff 1.0: the launch and the imports, unmeasured
    assert sum(phases.values()) == pytest.approx(27.0)


def tp1_proof(tmp_path: Path) -> Path:
    """The TP=1 recipe's runs that the phase check names, with the check as a check (not stated), in a folder of
    its own that runs the recipe's driver."""
    toml = (RECIPES / "sglang-qwen3-8b-tp1" / "proof.toml").read_text()
    assert 'phase_check = ["baseline", "load"]' in toml
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "proof.toml").write_text(
        textwrap.dedent(f"""\
        title = "sglang tp1 phases"
        driver = ["{{python}}", "{DRIVER_PATH}", "--tp", "1"]
        timeout_s = 60
        archive_dir = "archives"
        cache_env = ["XDG_CACHE_HOME"]
        run = [
          {{ name = "save", mode = "save", archive = "a" }},
          {{ name = "load", mode = "load", archive = "a" }},
          {{ name = "baseline", mode = "off" }},
        ]
        residual_phases = ["start", "rest_of_init"]
        phase_check = ["baseline", "load"]
        """)
    )
    return recipe


def test_with_every_part_measured_the_phase_check_passes_and_a_gap_fails(
    fake_sglang: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = tp1_proof(tmp_path)
    assert gptools_main(["prove", str(recipe), "--out", str(tmp_path / "out")]) == 0
    checks = {c["name"]: c for c in jsonfile.load(tmp_path / "out" / "report.json")["checks"]}
    assert checks["load unaccounted <= 5 %"]["status"] == "pass", checks["load unaccounted <= 5 %"]
    assert checks["baseline unaccounted <= 5 %"]["status"] == "pass", checks["baseline unaccounted <= 5 %"]
    text = (tmp_path / "out" / "REPORT.md").read_text()
    assert "| scheduler_boot |" in text and "| rest_of_init (remainder) |" in text

    monkeypatch.setenv("FAKE_SGLANG_GAP", "0.3")  # 0.3 s between weights and KV cache that nothing times
    assert gptools_main(["prove", str(recipe), "--out", str(tmp_path / "gap")]) == 1
    checks = {c["name"]: c for c in jsonfile.load(tmp_path / "gap" / "report.json")["checks"]}
    assert checks["baseline unaccounted <= 5 %"]["status"] == "FAIL"
    assert "remainders counted as unaccounted: start, rest_of_init" in checks["baseline unaccounted <= 5 %"]["detail"]


FAKE_REFUSING_SGLANG = """
__version__ = "0.5.17+gp.1"


class Engine:
    \"\"\"A LOAD refused in a scheduler, raised in this process as patched SGLang raises it (patch 0010).\"\"\"

    def __init__(self, **kwargs):
        import sys
        from pathlib import Path
        from graphpersist.archive.validate import LoadRefused, Mismatch

        live = kwargs["mem_fraction_static"]
        refused = LoadRefused(kwargs["graph_persist_dir"], [Mismatch("flags.mem_fraction_static", 0.5, live)], 0)
        log = Path(sys.argv[sys.argv.index("--result") + 1]).parent / "log.txt"  # the runner's log of the run
        log.write_text(f"[2026-12-07 06:40:00] {refused}\\n")
        raise refused from RuntimeError("Rank 0 scheduler died during initialization")
"""


def test_a_refused_load_records_the_load_refused_engine_raised_in_the_driver(tmp_path: Path) -> None:
    """The whole driver (`main`, mode load: re-executed under the interposer) against an SGLang whose Engine() raises
    the runtime's LoadRefused: the run passes on the log's line, as recipes/sglang-qwen3-8b-tp1's `load_refused` wants,
    and records the exception's type and its first mismatch line."""
    site = tmp_path / "site" / "sglang"
    (site / "srt" / "entrypoints").mkdir(parents=True)
    (site / "__init__.py").write_text(FAKE_REFUSING_SGLANG)
    for package in (site / "srt", site / "srt" / "entrypoints"):
        (package / "__init__.py").write_text("")
    (site / "srt" / "entrypoints" / "engine.py").write_text("")
    result, archive = tmp_path / "load_refused" / "result.json", tmp_path / "archive"
    archive.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("GP_REEXECED", "LD_PRELOAD")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(REPO / "overlays" / "graphpersist"),
                                         str(REPO / "tools")])  # fmt: skip
    toml = tomllib.loads((RECIPES / "sglang-qwen3-8b-tp1" / "proof.toml").read_text())
    spec = next(run for run in toml["run"] if run["name"] == "load_refused")
    argv = ["--run", "load_refused", "--mode", "load", "--archive", str(archive), "--result", str(result), "--tp", "1",
            *spec["args"]]  # fmt: skip
    proc = subprocess.run([sys.executable, str(DRIVER_PATH), *argv], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = json.loads(result.read_text())
    assert got["ok"] is True, got
    assert got["refusal"]["raised_type"] == "graphpersist.archive.validate.LoadRefused"
    assert got["refusal"]["first_mismatch"] == "flags.mem_fraction_static: saved 0.5, live 0.45"
