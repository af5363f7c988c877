"""Issue 34's model-case recipes (FP8 weights, FP8 KV cache, seeded sampling, long context, MoE; TP=1, both engines).

What needs no GPU: each recipe's proof.toml parses and every run's driver command resolves, through the driver's own
parser, into the engine keywords and environment that run must start with (the case's setting in every run, the
other value in the refused LOAD); with none of the new options the drivers start the dense recipes' engine as before;
run and archive names do not clash with the recipes that share their output folder; each refused run's pattern
matches the line persistence writes for that mismatch; each README's commands run every run of its recipe; and a whole
SGLang proof, its refused LOAD included, passes against a stand-in SGLang. Whether the engines restore these models
exactly is what the recipes' GPU runs prove (not yet run).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import fake_sglang_site
import pytest
from module_file import load_module

from gptools import jsonfile, prove
from gptools.__main__ import main as gptools_main
from graphpersist.archive.validate import LoadRefused, Mismatch

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


VLLM = load_module(RECIPES / "vllm-qwen3-8b-tp2" / "driver.py", "model_cases_vllm_driver")
SGLANG = load_module(RECIPES / "sglang-qwen3-8b-tp2" / "driver.py", "model_cases_sglang_driver")

# recipe -> (engine, what every started run's engine keywords hold, the refused run's (keywords, the mismatch line))
CASES: dict[str, tuple[str, dict[str, Any], tuple[dict[str, Any], Mismatch] | None]] = {
    "vllm-qwen3-8b-tp1-fp8": (
        "vllm",
        {"quantization": "fp8"},
        ({"quantization": None}, Mismatch("flags.quantization", "fp8", None)),
    ),
    "vllm-qwen3-8b-tp1-kvfp8": (
        "vllm",
        {"kv_cache_dtype": "fp8"},
        ({"kv_cache_dtype": "auto"}, Mismatch("flags.kv_cache_dtype", "fp8", "auto")),
    ),
    "vllm-qwen3-8b-tp1-sampling": ("vllm", {}, None),
    "vllm-qwen3-8b-tp1-long": (
        "vllm",
        {"max_model_len": 32768},
        ({"max_model_len": 4096}, Mismatch("flags.max_model_len", 32768, 4096)),
    ),
    "vllm-qwen3-30b-a3b-tp1": ("vllm", {"gpu_memory_utilization": 0.8}, ({}, None)),
    "sglang-qwen3-8b-tp1-fp8": (
        "sglang",
        {"quantization": "fp8"},
        ({"quantization": None}, Mismatch("flags.quantization", "fp8", None)),
    ),
    "sglang-qwen3-8b-tp1-kvfp8": (
        "sglang",
        {"kv_cache_dtype": "fp8_e4m3"},
        ({"kv_cache_dtype": "auto"}, Mismatch("flags.kv_cache_dtype", "fp8_e4m3", "auto")),
    ),
    "sglang-qwen3-8b-tp1-sampling": ("sglang", {"enable_deterministic_inference": True}, None),
    "sglang-qwen3-8b-tp1-long": (
        "sglang",
        {"context_length": 32768},
        ({"context_length": 4096}, Mismatch("flags.context_length", 32768, 4096)),
    ),
    "sglang-qwen3-30b-a3b-tp1": ("sglang", {"mem_fraction_static": 0.8}, None),
}
MOE = {"vllm-qwen3-30b-a3b-tp1", "sglang-qwen3-30b-a3b-tp1"}
# The recipes that share one output folder (engine-proof.sh PROOF_OUT) with the dense TP=1 recipe of their engine.
SHARED_OUT = {
    "vllm": ["vllm-qwen3-8b-tp1", "vllm-qwen3-8b-tp1-serve", "vllm-qwen3-8b-tp1-piecewise",
             "vllm-qwen3-8b-tp1-full-decode-only", *(r for r, c in CASES.items() if c[0] == "vllm")],
    "sglang": ["sglang-qwen3-8b-tp1", "sglang-qwen3-8b-tp1-serve", *(r for r, c in CASES.items() if c[0] == "sglang")],
}  # fmt: skip


def resolve(recipe: str, spec: prove.RunSpec, out: Path) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """A run's driver command from proof.toml, parsed by its driver: (its arguments, the engine's keywords, the
    environment the driver exports to the engine's processes). Writes the dummy model's folder under `out`."""
    parsed = prove.parse_recipe(RECIPES / recipe)
    command = prove.driver_command(parsed, out, spec, sys.executable)
    argv = command[command.index(next(p for p in command if p.endswith("driver.py"))) + 1 :]
    if CASES[recipe][0] == "vllm":
        a = VLLM.build_parser().parse_args(argv)
        environ: dict[str, str] = {}
        VLLM.export_options(a, environ)
        return a, VLLM.llm_kwargs(a), environ
    a = SGLANG.parse_args(argv)
    return a, SGLANG.engine_kwargs(a, SGLANG.model_dir(a)), {}


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_every_run_starts_the_engine_with_its_case(recipe: str, tmp_path: Path) -> None:
    _, case, refused = CASES[recipe]
    parsed = prove.parse_recipe(RECIPES / recipe)
    started = [r for r in parsed.runs if not r.expect_refusal]
    assert [r.mode for r in started[:3]] == ["save", "load", "off"] and all(r.compare_outputs for r in started)
    for spec in started:
        a, kwargs, environ = resolve(recipe, spec, tmp_path / "out")
        assert (kwargs.get("tensor_parallel_size", kwargs.get("tp_size"))) == 1
        assert {k: kwargs.get(k) for k in case} == case, spec.name
        model = Path(kwargs.get("model", kwargs.get("model_path")))
        assert model == tmp_path / "out" / ("qwen3-30b-a3b-dummy" if recipe in MOE else "qwen3-8b-dummy")
        assert (model / "config.json").is_file()
        if recipe.startswith("vllm-qwen3-30b"):  # Qwen3-MoE runs on vLLM's V2 runner only when told
            assert environ == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
        else:
            assert environ == {}
        assert a.sampling == ("seeded" if recipe.endswith("-sampling") else "greedy")
        assert a.long_prompts == recipe.endswith("-long")
    assert (refused is None) == (not any(r.expect_refusal for r in parsed.runs))
    if refused is not None:
        [spec] = [r for r in parsed.runs if r.expect_refusal]
        a, kwargs, environ = resolve(recipe, spec, tmp_path / "out")
        assert {k: kwargs.get(k) for k in refused[0]} == refused[0]
        assert a.expect_refusal and environ == {}  # the MoE SAVE on vLLM's own choice of runner
        assert "custom_sigquit_handler" not in kwargs  # patched SGLang raises the refusal in the driver (0010)


@pytest.mark.parametrize("recipe", sorted(r for r, c in CASES.items() if c[2] and c[2][1]))
def test_a_refused_runs_pattern_matches_the_line_persistence_writes(recipe: str) -> None:
    """The refused LOAD passes when the engine's log holds this pattern: the runtime's own refusal, as a log has it."""
    [spec] = [r for r in prove.parse_recipe(RECIPES / recipe).runs if r.expect_refusal]
    pattern = spec.args[spec.args.index("--expect-refusal") + 1]
    mismatch = CASES[recipe][2][1]  # type: ignore[index]
    message = str(LoadRefused(Path("/root/proof/archives") / spec.archive, [mismatch], 0))
    log = f"INFO starting\nERROR Scheduler hit an exception: Traceback ...\ngraphpersist.LoadRefused: {message}\n"
    assert re.search(pattern, log, re.DOTALL)
    other = str(LoadRefused(Path("/a"), [Mismatch(mismatch.field, mismatch.saved, mismatch.saved)], 0))
    assert not re.search(pattern, other, re.DOTALL)


def test_without_the_case_options_the_drivers_start_the_dense_recipes_engine(tmp_path: Path) -> None:
    """Off by default: the dense recipes' engine keywords and environment are what they were before these options."""
    result = str(tmp_path / "out" / "baseline" / "result.json")
    a = VLLM.build_parser().parse_args(["--run", "r", "--mode", "off", "--result", result, "--tp", "1"])
    environ: dict[str, str] = {}
    VLLM.export_options(a, environ)
    assert environ == {}
    assert VLLM.llm_kwargs(a) == {
        "model": str(tmp_path / "out" / "qwen3-8b-dummy"), "tensor_parallel_size": 1, "gpu_memory_utilization": 0.5,
        "max_model_len": 4096, "seed": 0, "enforce_eager": False, "graph_persist": "off", "graph_persist_dir": None,
        "load_format": "dummy", "skip_tokenizer_init": True,
    }  # fmt: skip
    assert VLLM.sampling_kwargs([1, 2], 8) == {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
                                               "detokenize": False}  # fmt: skip
    s = SGLANG.parse_args(["--run", "r", "--mode", "off", "--result", result, "--tp", "1"])
    kwargs = SGLANG.engine_kwargs(s, SGLANG.model_dir(s))
    assert not {"quantization", "kv_cache_dtype", "enable_deterministic_inference", "custom_sigquit_handler"} & set(
        kwargs
    )
    assert kwargs["context_length"] == 4096
    assert SGLANG.sampling_params([[1, 2]], 8) == {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def test_seeded_sampling_gives_each_prompt_its_own_seed_in_both_drivers() -> None:
    first, second = VLLM.prompt(1, 64), VLLM.prompt(2, 64)
    v1, v2 = (VLLM.sampling_kwargs(p, 32, "seeded") for p in (first, second))
    assert (v1["temperature"], v1["top_p"], v1["max_tokens"]) == (0.8, 0.9, 32)
    assert v1["seed"] != v2["seed"] and v1["seed"] == VLLM.sampling_kwargs(list(first), 32, "seeded")["seed"]
    s1, s2 = SGLANG.sampling_params([first, second], 32, "seeded")
    assert (s1["temperature"], s1["top_p"], s1["max_new_tokens"], s1["ignore_eos"]) == (0.8, 0.9, 32, True)
    assert (s1["sampling_seed"], s2["sampling_seed"]) == (v1["seed"], v2["seed"])  # the same seeds in both engines
    with pytest.raises(ValueError, match="sampling 'hot'"):
        VLLM.sampling_kwargs(first, 32, "hot")


def test_long_prompts_come_near_the_limit_and_leave_room_for_the_answer() -> None:
    longest, *others = VLLM.long_prompts(32768)
    assert len(longest) == 32768 - VLLM.GEN - VLLM.LONG_MARGIN and len(others) == 2
    assert all(len(p) + VLLM.GEN < 32768 and len(p) > 31000 for p in others)
    assert len({tuple(p[:16]) for p in (longest, *others)}) == 3  # each new to the prefix cache
    with pytest.raises(ValueError, match="needs a max_model_len above"):
        VLLM.long_prompts(1024)


def test_the_moe_shape_is_qwen3_30b_a3b() -> None:
    """Qwen3-30B-A3B's public config.json: 48 layers, hidden 2048, 128 experts, 8 per token, expert MLP 768, 32 query
    and 4 KV heads of 128; both drivers write the same config (the SGLang driver takes the vLLM driver's)."""
    config = VLLM.MODEL_SHAPES["qwen3-30b-a3b"][1]
    assert config == SGLANG.QWEN3_30B_A3B == SGLANG.MODEL_SHAPES["qwen3-30b-a3b"][1]
    assert {k: config[k] for k in ("architectures", "num_hidden_layers", "hidden_size", "num_experts",
                                   "num_experts_per_tok", "moe_intermediate_size", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "vocab_size")} == {
        "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 151936,
    }  # fmt: skip


@pytest.mark.parametrize("engine", sorted(SHARED_OUT))
def test_the_recipes_sharing_an_output_folder_name_runs_and_archives_apart(engine: str) -> None:
    runs: list[str] = []
    archives: list[str] = []
    for recipe in SHARED_OUT[engine]:
        parsed = prove.parse_recipe(RECIPES / recipe)
        runs += [r.name for r in parsed.runs]
        archives += sorted({r.archive for r in parsed.runs if r.archive})
    assert len(runs) == len(set(runs)), sorted(r for r in runs if runs.count(r) > 1)
    assert len(archives) == len(set(archives)), sorted(a for a in archives if archives.count(a) > 1)


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_the_readme_runs_every_run_in_calls_of_at_most_nine_minutes(recipe: str) -> None:
    engine = CASES[recipe][0]
    text = (RECIPES / recipe / "README.md").read_text()
    assert "Not yet run on the GPU host" in text
    calls = re.findall(rf"RECIPE={recipe} PROOF_OUT=(\S+) RUNS=(\S+) LIMIT=(\d+)", text)
    assert calls, f"{recipe}/README.md names no engine-proof.sh call"
    assert {out for out, _, _ in calls} == {f"/root/proof-{SHARED_OUT[engine][0]}"}
    assert all(int(limit) <= 580 for _, _, limit in calls)
    named = [run for _, runs, _ in calls for run in runs.split(",")]
    assert sorted(named) == sorted(r.name for r in prove.parse_recipe(RECIPES / recipe).runs)


# ------------------------------------------------------------- a whole SGLang proof, its refused LOAD included

FAKE_ENGINE = '''
"""A stand-in for sglang.srt.entrypoints.engine: SAVE records the quantization; a LOAD started with another one
is refused as a scheduler refuses it: the runtime's lines in the log, then Engine() raises the refusal, chained to
SGLang's own error (patch 0010; the launching process survives)."""
import json, os, sys
from pathlib import Path
from types import SimpleNamespace


class Engine:
    def __init__(self, **kwargs):
        mode, archive = kwargs["graph_persist"], kwargs.get("graph_persist_dir")
        if mode == "save":
            from archive_fixtures import write_archive

            write_archive(Path(archive))
            Path(archive + ".case.json").write_text(json.dumps({"quantization": kwargs.get("quantization")}))
        if mode == "load":
            saved = json.loads(Path(archive + ".case.json").read_text())["quantization"]
            if saved != kwargs.get("quantization"):
                from graphpersist.archive.validate import LoadRefused, Mismatch

                refusal = LoadRefused(archive, [Mismatch("flags.quantization", saved, kwargs.get("quantization"))], 0)
                print(f"Scheduler hit an exception: {refusal}", file=sys.stderr, flush=True)
                raise refusal from RuntimeError("Rank 0 scheduler died during initialization (exit code: -9).")
        stats = Path(os.environ["GRAPHPERSIST_STATS_DIR"])
        if mode != "off":
            (stats / "rank_0.json").write_text(json.dumps({
                "rank": 0, "mode": mode, "captured": 4 if mode == "save" else 0,
                "restored": 4 if mode == "load" else 0, "capture_calls": 4 if mode == "save" else 0,
                "phases": {"capture": 0.5} if mode == "save" else {"restore": 0.1}}))
        print("Engine startup timings (s): load_weight=0.01, kv_cache_allocation=0.01, scheduler_e2e=0.60, "
              "cuda_graph={prefill=0.40, decode=0.10}, tokenizer_e2e=0.70", flush=True)
        self.server_args = SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(max_bs=256)))
        self.quantized = kwargs.get("quantization") == "fp8"

    def generate(self, input_ids, sampling_params):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        return [{"output_ids": [(sum(p) + k + self.quantized) % 151936 for k in range(s["max_new_tokens"])]}
                for p, s in zip(input_ids, params)]
'''


@pytest.fixture
def fake_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return fake_sglang_site.install(tmp_path, monkeypatch, FAKE_ENGINE)


def test_the_sglang_fp8_proof_passes_with_its_refused_load_against_a_fake_sglang(
    fake_sglang: Path, tmp_path: Path
) -> None:
    """The committed proof.toml end to end: SAVE, LOAD, baseline, SAVE2, the fresh LOAD, and the LOAD without
    quantization, which the stand-in refuses as the patched SGLang does: Engine() raises the runtime's LoadRefused in
    the driver, which records it, finds the runtime's line in its log and passes the run."""
    out = tmp_path / "out"
    recipe = RECIPES / "sglang-qwen3-8b-tp1-fp8"
    assert gptools_main(["prove", str(recipe), "--out", str(out)]) == 0, (out / "REPORT.md").read_text()
    assert (out / "REPORT.md").read_text().splitlines()[0] == "all checks passed"
    refused = json.loads((out / "fp8_refused" / "result.json").read_text())["refusal"]
    assert refused["raised_type"] == "graphpersist.archive.validate.LoadRefused"
    assert refused["first_mismatch"] == "flags.quantization: saved 'fp8', live <unset>"
    checks = {c["name"]: c for c in jsonfile.load(out / "report.json")["checks"]}
    assert checks["fp8_refused refused"]["detail"] == (
        "LoadRefused in the driver: flags.quantization: saved 'fp8', live <unset>"
    )
