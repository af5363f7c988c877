"""One SGLang start of the proof: sglang.Engine(...) in the given persistence mode, the workloads, then result.json.

The proof runner (`python -m gptools prove`, see proof.toml) starts this once per run as its own process group:
`python driver.py --run NAME --mode off|save|load [--archive DIR] --result FILE [--tp N] [--disable-cuda-graph]
[--disable-custom-all-reduce] [--enable-torch-symm-mem] [--deepep]`. Without `--model DIR` it writes a Qwen3-8B
`config.json` next to the run folders (one path for every run: the model path is part of the configuration LOAD
compares), loads dummy weights and no tokenizer (prompts are token ids): what runs on the GPU host. `--model` takes a
real checkpoint. `--deepep` (recipes/sglang-qwen3-30b-a3b-ep2-deepep) serves a Qwen3-30B-A3B-shaped MoE instead,
with DeepEP expert parallelism over the TP ranks in normal mode (`DEEPEP_KWARGS`).

The model cases of issue 34 (recipes/sglang-qwen3-8b-tp1-fp8, -kvfp8, -sampling, -long, sglang-qwen3-30b-a3b-tp1)
use the vLLM driver's options, each off by default: `--model-shape qwen3-30b-a3b` (the MoE without DeepEP),
`--quantization fp8`, `--kv-cache-dtype fp8_e4m3`, `--context-length N` (4096), `--sampling seeded` and
`--long-prompts`. SGLang 0.5.17 honours a request's `sampling_seed` only with `enable_deterministic_inference`
(`SamplingBatchInfo.from_schedule_batch`; else it samples from the process's CUDA generator), so `--sampling
seeded` turns that on (its PyTorch sampler draws with a hash of seed and position, `multinomial_with_seed`).
`--expect-refusal REGEX` makes a run pass only when the engine refused to start and its log matches REGEX; the run
records what Engine() raised (the runtime's LoadRefused, which the patched SGLang raises in this process instead of
killing it: patch 0010) and its first mismatch line. SGLang spawns its processes, each of which imports this file
again as `__mp_main__` (upstream's process model: hence the main guard below); result.json's `script_runs` counts
them, and a persistence run must count as many as the baseline.

The model config, the prompts and the workloads are the vLLM recipe's (recipes/vllm-qwen3-8b-tp2/driver.py, loaded
from its file), so both engines answer the same requests: sequential prompts one at a time; a concurrent batch; an
"oversize" batch with more requests than SGLang's largest decode graph (its decode runs without graphs); then time to
first token on a long prompt and decode tokens/s at batch 1 and 32. Start-up is Engine()'s wall time; importing
sglang and its Engine module comes before the clock and is reported apart (`import_sglang_s`).

Phases use the vLLM driver's vocabulary and add up to the start-up time. They come from SGLang's own summary line
("Engine startup timings (s): load_weight=..., kv_cache_allocation=..., scheduler_e2e=..., cuda_graph={...}"),
split further by the runtime's per-rank stats when persistence is on: `start` is everything before the scheduler
processes begin their set-up (ServerArgs, spawning and importing), `rest_of_init` the schedulers' set-up besides
weights, KV cache and graphs (distributed init with NCCL and custom all-reduce, attention backends).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tools"))

from gptools import proofkit  # noqa: E402  (stdlib only; the runner's helper for drivers)

proofkit.note_script_run(__name__)  # the run's `script_runs`: SGLang's spawn imports this file in each of its processes


def _vllm_recipe() -> ModuleType:
    """The vLLM recipe's driver, for its model config, prompts and helpers (it imports no engine at module level)."""
    path = HERE.parent / "vllm-qwen3-8b-tp2" / "driver.py"
    spec = importlib.util.spec_from_file_location("vllm_qwen3_8b_tp2_driver", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the vLLM recipe's driver from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shared = _vllm_recipe()
QWEN3_8B: dict[str, Any] = shared.QWEN3_8B
QWEN3_30B_A3B: dict[str, Any] = shared.QWEN3_30B_A3B
MODEL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = shared.MODEL_SHAPES
GEN: int = shared.GEN
SAMPLING_MODES: tuple[str, ...] = shared.SAMPLING_MODES
SEEDED_SAMPLING: dict[str, Any] = shared.SEEDED_SAMPLING
prompt = shared.prompt
write_model = shared.write_model
timed = shared.timed
long_prompts = shared.long_prompts
request_seed = shared.request_seed

CONTEXT_LENGTH = shared.MAX_MODEL_LEN
OVERSIZE_REQUESTS = 300  # > 256, SGLang's largest decode graph on an H200 at TP < 4 (checked against the engine)
DECODE_TOKENS = 256
# The opt-in of patch 0007 (sglang/srt/graphpersist_symm_multicast.py): torch symmetric memory's two-shot all-reduce
# on a host without multicast. Set for every run of a recipe, persistence off included, so all runs reduce alike.
SYMM_MEM_NO_MULTICAST_ENV = "GRAPHPERSIST_SYMM_MEM_NO_MULTICAST"
ENGINE_FLAGS = ("disable_cuda_graph", "disable_custom_all_reduce", "enable_torch_symm_mem")  # Engine(flag=True)

# DeepEP's normal (high-throughput) mode over the TP ranks, the only DeepEP mode persistence takes (low-latency needs
# NVSHMEM). Its normal-mode experts run on DeepGEMM's BF16 grouped GEMM (SGLang refuses unquantized normal mode
# otherwise). Decode batch sizes are multiples of 8, as SGLang makes its breakable prefill sizes for DeepEP; with
# persistence on the decode graphs are breakable (DeepEP runs between segments), off upstream runs without graphs.
DEEPEP_KWARGS: dict[str, Any] = {
    "moe_a2a_backend": "deepep",
    "deepep_mode": "normal",
    "moe_runner_backend": "deep_gemm",
    "cuda_graph_bs_decode": [8, 16, 32, 64],
}

# SGLang's one summary line (main process), printed once every scheduler reported ready.
STARTUP_LINE = re.compile(
    r"Engine startup timings \(s\): load_weight=([\d.]+), kv_cache_allocation=([\d.]+), "
    r"scheduler_e2e=([\d.]+), cuda_graph=\{([^}]*)\}"
)
# Per-rank lines, for a log without the summary (a start that failed before it): weights and graph capture.
WEIGHTS_LINE = re.compile(r"Load weight end\. elapsed=([\d.]+) s")
CAPTURE_LINE = re.compile(r"Capture (?:target|draft) (\w+) (?:\w+ )?graph end\. elapsed=([\d.]+) s")


def engine_kwargs(a: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The keywords of sglang.Engine(...) for a run. Flags are passed only when set, so a run without them is
    SGLang's own default configuration (some of its fields resolve differently when given explicitly)."""
    kwargs: dict[str, Any] = {
        "model_path": str(model_dir),
        "tp_size": a.tp,
        "mem_fraction_static": a.mem_fraction_static,
        "context_length": a.context_length,
        "random_seed": 0,
        "log_level": "info",  # Engine's default ("error") hides the lines the phases are read from
        "graph_persist": a.mode,
        "graph_persist_dir": a.archive,
    }
    if not a.model:
        kwargs |= {"load_format": "dummy", "skip_tokenizer_init": True}
    if a.deepep:
        kwargs |= {**DEEPEP_KWARGS, "ep_size": a.tp}
    for flag in ENGINE_FLAGS:
        if getattr(a, flag):
            kwargs[flag] = True
    if a.quantization:
        kwargs["quantization"] = a.quantization
    if a.kv_cache_dtype:
        kwargs["kv_cache_dtype"] = a.kv_cache_dtype
    if a.sampling == "seeded":  # SGLang reads a request's sampling_seed only then (module docstring)
        kwargs["enable_deterministic_inference"] = True
    return kwargs


def model_dir(a: argparse.Namespace) -> Path:
    """The checkpoint (`--model`) or the dummy model's folder, shared by every run of the proof's --out."""
    if a.model:
        return Path(a.model)
    folder, config = MODEL_SHAPES["qwen3-30b-a3b" if a.deepep else a.model_shape]
    return write_model(Path(a.result).resolve().parent.parent / folder, config)


def sampling(max_tokens: int) -> dict[str, Any]:
    """Greedy, a fixed number of tokens whatever the model emits."""
    return {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}


def sampling_params(prompts: list[list[int]], max_tokens: int, how: str = "greedy") -> Any:
    """Engine.generate's sampling_params: one greedy dict for the batch, or (seeded) one dict per request with
    SEEDED_SAMPLING and the request's own seed (the vLLM driver's request_seed: the same seed for the same prompt)."""
    if how == "greedy":
        return sampling(max_tokens)
    if how != "seeded":
        raise ValueError(f"sampling {how!r}: use one of {', '.join(SAMPLING_MODES)}")
    fixed = {"max_new_tokens": max_tokens, "ignore_eos": True, **SEEDED_SAMPLING}
    return [{**fixed, "sampling_seed": request_seed(p)} for p in prompts]


def token_ids(outputs: Any, expected: int, max_tokens: int) -> list[list[int]]:
    """The generated token ids of a batch answer, in request order; refuses an answer of another shape, so a
    truncated or missing output fails the run instead of comparing as a shorter sequence."""
    if not isinstance(outputs, list) or len(outputs) != expected:
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise ValueError(f"expected {expected} outputs, got {got}")
    ids = []
    for i, out in enumerate(outputs):
        seq = out.get("output_ids") if isinstance(out, dict) else None
        if not isinstance(seq, list) or len(seq) != max_tokens:
            size = len(seq) if isinstance(seq, list) else "no output_ids"
            raise ValueError(f"output {i}: expected {max_tokens} token ids, got {size}")
        ids.append([int(t) for t in seq])
    return ids


def generate(engine: Any, prompts: list[list[int]], max_tokens: int = GEN, how: str = "greedy") -> list[list[int]]:
    outputs = engine.generate(input_ids=prompts, sampling_params=sampling_params(prompts, max_tokens, how))
    return token_ids(outputs, len(prompts), max_tokens)


# Sampling the greedy workloads never reach (FlashInfer's top-k/top-p and min-p kernels, penalties), run once after
# every measured workload: its outputs are not compared, what it compiles is counted (jit.new_cache_files_later).
SAMPLED = (
    {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
    {"temperature": 0.8, "min_p": 0.05, "repetition_penalty": 1.1},
)
SAMPLED_TOKENS = 4


def sample_once(engine: Any) -> None:
    for i, params in enumerate(SAMPLED):
        outputs = engine.generate(
            input_ids=[prompt(700 + i, 16)],
            sampling_params={**params, "max_new_tokens": SAMPLED_TOKENS, "ignore_eos": True},
        )
        token_ids(outputs, 1, SAMPLED_TOKENS)


def log_phases(text: str) -> dict[str, float]:
    """SGLang's own start-up timings found in a log: the summary line's (slowest scheduler) when it is there,
    else the slowest rank's weight and capture lines. Keys: weights, kv_cache, scheduler, graphs (seconds)."""
    found = STARTUP_LINE.findall(text)
    if found:
        weights, kv, scheduler, graphs = found[-1]
        per_phase = [float(v) for _, v in re.findall(r"(\w+)=([\d.]+)", graphs)]
        return {"weights": float(weights), "kv_cache": float(kv), "scheduler": float(scheduler),
                "graphs": sum(per_phase)}  # fmt: skip
    phases: dict[str, float] = {}
    if weights_found := WEIGHTS_LINE.findall(text):
        phases["weights"] = max(map(float, weights_found))
    captures: dict[str, float] = {}
    for kind, seconds in CAPTURE_LINE.findall(text):
        captures[kind] = max(captures.get(kind, 0.0), float(seconds))
    if captures:
        phases["graphs"] = sum(captures.values())
    return phases


KERNEL_WARMUP = "kernel_warmup_before_save"  # SAVE's first requests before it packs the JIT caches (per-rank stats)


def slowest(stats: list[dict[str, Any]], name: str) -> float:
    """A persistence phase's time on the slowest rank (0.0 where no rank reported it)."""
    return max((float(s.get("phases", {}).get(name, 0.0)) for s in stats), default=0.0)


# Lines whose appearance the driver stamps (proofkit.LogStamps, the wall clock): the end of weight loading, the
# graphs' end (capture, or the runtime's save or restore), the summary line (the main process logs it once every
# scheduler reported ready). STAMPED_FIRST: the first such line; STAMPED_LAST: the last.
STAMPED_FIRST = {
    "summary_line": STARTUP_LINE.pattern,
}
STAMPED_LAST = {  # the slowest rank's, as the summary line's numbers are
    "weights_line": WEIGHTS_LINE.pattern,
    "graphs_end_line": r"Capture (?:target|draft) \w+ (?:\w+ )?graph end\."
    r"|graphpersist: rank \d+: (?:saved|restored) \d+ graphs",
}
FRONT_FIRST_LINE = r"server_args=ServerArgs\("  # a server's first line, once imported (launch_server's stamps)
SCHEDULER_TITLE = r"sglang::scheduler"  # SGLang retitles its scheduler processes (setproctitle)


def stamp_marks(stamps: proofkit.LogStamps, births: list[tuple[float, int, str]], t0_wall: float) -> dict[str, float]:
    """The start-up's stamps in seconds since the clock started (`t0_wall`, the wall clock): the stamped lines and
    the first scheduler process's birth (`scheduler_born`). A stamp not found is left out."""
    return proofkit.stamp_marks(lambda p, last: stamps.last(p) if last else stamps.first(p),
                                lambda title: proofkit.born(births, title), STAMPED_FIRST,
                                {"scheduler_born": SCHEDULER_TITLE}, STAMPED_LAST, t0_wall)  # fmt: skip


def start_phases(
    ready: float, log: dict[str, float], stats: list[dict[str, Any]], marks: dict[str, float] | None = None
) -> dict[str, float]:
    """The vLLM driver's vocabulary, adding up to the start-up time: weights | profile | kv_warmup | graphs (capture
    or restore) | save | rest_of_init. With persistence on, graphs, save (with SAVE's kernel warm-up before it),
    profile and warm-up are the runtime's per-rank numbers (slowest rank); SGLang's graph time then holds them and
    is not counted twice. The parts SGLang does not time are measured between stamps on one clock (`marks`, seconds
    since the clock started: stamp_marks): front_boot (a server's imports, to its first line) | engine_launch (to the
    scheduler process's birth) | scheduler_boot (its imports, to Scheduler.__init__: the summary line's time less
    scheduler_e2e) | scheduler_setup (to the weights: model config, distributed init, model runner) | after_graphs
    (the graphs' end to the scheduler's) | handoff (the summary line to ready). `start` and `rest_of_init` are what
    remains once the measured parts are taken out: remainders (proof.toml `residual_phases`)."""
    scheduler = log.get("scheduler")
    if scheduler is None:  # the summary line is missing: only what the runtime measured
        return {k: v for s in stats[:1] for k, v in s.get("phases", {}).items()}
    marks = marks or {}
    weights = log.get("weights", 0.0)
    if stats:
        profile = slowest(stats, "profile")
        save = slowest(stats, "save") + slowest(stats, KERNEL_WARMUP)  # SAVE's first requests run inside its save
        graphs = slowest(stats, "capture") + slowest(stats, "restore")
        kv_warmup = max(log.get("kv_cache", 0.0), slowest(stats, "kv_cache")) + slowest(stats, "warmup")
    else:
        profile, save, graphs, kv_warmup = 0.0, 0.0, log.get("graphs", 0.0), log.get("kv_cache", 0.0)
    summary = marks.get("summary_line")
    begin = proofkit.before(summary, scheduler)
    front = shared.front_marks(marks)
    outside = {
        **proofkit.consecutive([*front, ("engine_launch", marks.get("scheduler_born")), ("scheduler_boot", begin)]),
        **proofkit.consecutive([("scheduler_end", summary), ("handoff", ready)]),
    }
    inside = {
        **proofkit.consecutive([("scheduler_begin", begin),
                                ("scheduler_setup", proofkit.before(marks.get("weights_line"), log.get("weights")))]),
        **proofkit.consecutive([("graphs_end", marks.get("graphs_end_line")), ("after_graphs", summary)]),
    }  # fmt: skip
    phases = {
        "start": ready - scheduler - sum(outside.values()),
        **outside,
        "weights": weights,
        "profile": profile,
        "kv_warmup": kv_warmup,
        "graphs": graphs,
        "save": save,
        **inside,
        "rest_of_init": scheduler - weights - profile - kv_warmup - graphs - save - sum(inside.values()),
    }
    return {k: round(v, 3) for k, v in phases.items()}


def graph_inventory(server_args: Any) -> dict[str, Any]:
    """The largest decode batch and prefill size SGLang captures graphs for (None where it cannot be read)."""
    config = getattr(server_args, "cuda_graph_config", None)
    decode, prefill = getattr(config, "decode", None), getattr(config, "prefill", None)
    return {"decode_max_bs": getattr(decode, "max_bs", None), "prefill_max_tokens": getattr(prefill, "max_bs", None)}


def check_oversize(requests: int, inventory: dict[str, Any]) -> None:
    """The oversize workload must be larger than the decode graphs, or it proves nothing about running past them."""
    largest = inventory.get("decode_max_bs")
    if isinstance(largest, int) and requests <= largest:
        raise ValueError(
            f"the oversize batch ({requests} requests) is not larger than the largest decode graph ({largest}): "
            "raise OVERSIZE_REQUESTS in driver.py"
        )


def restored_cache_files(stats: list[dict[str, Any]]) -> set[str]:
    """The cache files LOAD put back from the archive (not compiled here), named as proofkit's snapshots name them."""
    return proofkit.snapshot_names(p for s in stats for p in s.get("jitcache_restored", []))


def run(a: argparse.Namespace) -> dict[str, Any]:
    t_import = time.perf_counter()
    import sglang  # before the clock starts: start-up is Engine()'s wall time
    from sglang.srt.entrypoints import engine as _engine_module  # noqa: F401  (sglang.Engine imports it lazily)

    import_s = time.perf_counter() - t_import
    kwargs = engine_kwargs(a, model_dir(a))
    before = proofkit.cache_snapshot()
    started = proofkit.start_engine(
        lambda: sglang.Engine(**kwargs), Path(a.result).parent / "log.txt", a.expect_refusal
    )
    if started.result is not None:
        return {**started.result, "script_runs": proofkit.script_runs(a.result)}
    engine, ready = started.engine, started.ready_s
    marks = stamp_marks(started.stamps, proofkit.process_births(os.getpgid(0)), started.t0_wall)
    after_start = proofkit.cache_snapshot()
    inventory = graph_inventory(engine.server_args)
    check_oversize(OVERSIZE_REQUESTS, inventory)

    gen = functools.partial(generate, how=a.sampling)  # every workload samples as --sampling says
    sequential_prompts = [prompt(i, n) for i, n in enumerate((7, 64, 300, 1000))]
    first, first_s = timed(gen, engine, sequential_prompts[:1])
    after_first = proofkit.cache_snapshot()
    sequential = first + [gen(engine, [p])[0] for p in sequential_prompts[1:]]
    steady = [timed(gen, engine, sequential_prompts[:1])[1] for _ in range(3)]
    concurrent = gen(engine, [prompt(100 + i, 16 + 9 * i) for i in range(16)])
    oversize = gen(engine, [prompt(200 + i, 40) for i in range(OVERSIZE_REQUESTS)] + [prompt(300, 1500)])
    outputs = {"sequential": sequential, "concurrent": concurrent, "oversize": oversize}
    if a.long_prompts:
        longest, *others = long_prompts(a.context_length)
        outputs["long"] = gen(engine, [longest]) + gen(engine, others)

    # Time to first token: a prompt of the same length first (shapes warm), then three others; each prompt is new,
    # so SGLang's prefix cache cannot answer any of them.
    gen(engine, [prompt(399, 3000)], 1)
    ttft = statistics.median(timed(gen, engine, [prompt(400 + i, 3000)], 1)[1] for i in range(3))
    _, b1 = timed(gen, engine, [prompt(500, 16)], DECODE_TOKENS)
    _, b32 = timed(gen, engine, [prompt(600 + i, 16) for i in range(32)], DECODE_TOKENS)
    sample_once(engine)
    after_all = proofkit.cache_snapshot()

    stats = proofkit.rank_stats()
    log = Path(a.result).parent / "log.txt"
    phases = start_phases(ready, log_phases(log.read_text(errors="replace") if log.is_file() else ""), stats, marks)
    restored = restored_cache_files(stats)
    new_start = [f for f in proofkit.new_files(before, after_start) if f not in restored]
    new_first = proofkit.new_files(after_start, after_first)
    new_later = proofkit.new_files(after_first, after_all)  # every later workload, sampling included

    return {
        "ok": True,
        "error": None,
        "start_to_ready_s": round(ready, 3),
        "phases": phases,
        "outputs": outputs,
        "latency": {
            "first_request_s": round(first_s, 4),
            "steady_request_s": round(statistics.median(steady), 4),
            "ttft_long_s": round(ttft, 4),
            "decode_tps_b1": round(DECODE_TOKENS / b1, 1),
            "decode_tps_b32": round(32 * DECODE_TOKENS / b32, 1),
            "import_sglang_s": round(import_s, 2),
        },
        "jit": {
            "new_cache_files_start": len(new_start),
            "new_cache_files_first_request": len(new_first),
            "examples": (new_start + new_first)[:10],
            "new_cache_files_later": len(new_later),
            "examples_later": new_later[:10],
        },
        "engine": {"name": "sglang", "version": sglang.__version__},
        "graph_inventory": inventory,
        "graphpersist_stats": stats,
        "start_marks": marks,
        "script_runs": proofkit.script_runs(a.result),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="run name (for the logs)")
    ap.add_argument("--mode", choices=proofkit.MODES, required=True)
    ap.add_argument("--archive", help="archive directory (save/load)")
    ap.add_argument("--result", required=True, help="where to write result.json")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    ap.add_argument("--model", help="a real checkpoint directory (default: dummy Qwen3-8B weights)")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b",
                    help="the dummy model's config (default qwen3-8b; --deepep: qwen3-30b-a3b)")  # fmt: skip
    ap.add_argument("--mem-fraction-static", type=float, default=0.5, help="SGLang's mem_fraction_static (0.5)")
    ap.add_argument("--context-length", type=int, default=CONTEXT_LENGTH, help=f"(default {CONTEXT_LENGTH})")
    ap.add_argument("--quantization", help="SGLang's quantization, e.g. fp8 (online FP8 weights; default: none)")
    ap.add_argument("--kv-cache-dtype", help="SGLang's kv_cache_dtype, e.g. fp8_e4m3 (default: SGLang's, auto)")
    ap.add_argument("--sampling", choices=SAMPLING_MODES, default="greedy",
                    help="greedy (default), or seeded: temperature 0.8, top-p 0.9, a seed per request "
                    "(turns on enable_deterministic_inference, without which SGLang ignores the seeds)")  # fmt: skip
    ap.add_argument("--long-prompts", action="store_true",
                    help="a workload of prompts near the context length (outputs compared as `long`)")  # fmt: skip
    ap.add_argument("--expect-refusal", metavar="REGEX",
                    help="the engine must not start: ok when its log matches REGEX")  # fmt: skip
    ap.add_argument("--disable-cuda-graph", action="store_true", help="no CUDA graphs (the eager comparison start)")
    ap.add_argument(
        "--disable-custom-all-reduce", action="store_true", help="all-reduce through NCCL only (no custom all-reduce)"
    )
    ap.add_argument(
        "--enable-torch-symm-mem", action="store_true", help="SGLang's torch symmetric-memory all-reduce as well"
    )
    ap.add_argument(
        "--deepep",
        action="store_true",
        help="a Qwen3-30B-A3B-shaped MoE with DeepEP expert parallelism over the TP ranks, normal mode",
    )
    ap.add_argument(
        "--symm-mem-no-multicast",
        action="store_true",
        help=f"let symmetric memory run its two-shot all-reduce without multicast ({SYMM_MEM_NO_MULTICAST_ENV}=1)",
    )
    a = ap.parse_args(argv)
    if (a.archive is None) != (a.mode == "off"):
        ap.error(f"--archive is {'needed' if a.archive is None else 'not allowed'} with --mode {a.mode}")
    return a


def main() -> NoReturn:
    a = parse_args()
    if a.symm_mem_no_multicast:  # before anything starts: SGLang's schedulers inherit the environment
        os.environ[SYMM_MEM_NO_MULTICAST_ENV] = "1"
    if a.mode != "off":  # as for vLLM: the engine's processes start where the interposer is already loaded
        from graphpersist import api

        api.reexec_with_interposer()
    flags = ",".join(f for f in (*ENGINE_FLAGS, "symm_mem_no_multicast", "deepep", "long_prompts") if getattr(a, f))
    case = {k: v for k, v in (("shape", a.model_shape), ("quantization", a.quantization),
                              ("kv_cache_dtype", a.kv_cache_dtype), ("context_length", a.context_length),
                              ("sampling", a.sampling)) if v}  # fmt: skip
    flags = f"{flags or '-'} {case}"
    print(f"driver: run {a.run}: mode={a.mode} tp={a.tp} archive={a.archive} flags={flags}", flush=True)
    proofkit.run_and_exit(lambda: run(a), a.result)


if __name__ == "__main__":  # SGLang starts its schedulers with spawn: they import this file again
    main()
