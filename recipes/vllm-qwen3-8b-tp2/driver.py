"""One vLLM start of the proof: LLM(...) in the given persistence mode, the fixed workloads, then result.json.

The proof runner (`python -m gptools prove`, see proof.toml) starts this once per run as its own process group:
`python driver.py --run NAME --mode off|save|load [--archive DIR] --result FILE [--tp N] [--enforce-eager]`.
Without `--model DIR` it writes a Qwen3-8B `config.json` next to the run folders (one path for every run: the model
path is part of vLLM's config fingerprint, which LOAD compares), loads dummy weights and no tokenizer (prompts are
token ids): what runs on the GPU host. `--model` takes a real checkpoint directory instead; `--model-shape
qwen3-30b-a3b` writes a Qwen3-30B-A3B-shaped MoE config instead of Qwen3-8B's (dummy weights too).

The model cases of issue 34 (recipes/vllm-qwen3-8b-tp1-fp8, -kvfp8, -sampling, -long, vllm-qwen3-30b-a3b-tp1) set,
each off by default: `--quantization fp8` (online FP8 weights), `--kv-cache-dtype fp8`, `--max-model-len N` (4096),
`--sampling seeded` (every request samples at temperature 0.8, top-p 0.9 with a seed of its own, derived from its
prompt, so a baseline and a LOAD draw the same tokens), `--long-prompts` (a workload of prompts near
max_model_len) and `--model-runner v2` (VLLM_USE_V2_MODEL_RUNNER=1: vLLM 0.26.0 runs Qwen3-MoE on its V1 runner
otherwise, which persistence refuses).

With persistence on the driver re-executes itself under the runtime's interposer (as `graphpersist exec` does), so
vLLM forks its processes; `--no-reexec` starts it as a plain `python app.py` would, and vLLM spawns its engine core
without running this script again. Every process that runs this file as a script notes itself
(`proofkit.note_script_run`): result.json's `script_runs` (1 where only the driver did), which the runner compares
with the baseline's. A run that had to be refused records what LLM() raised (`refusal.raised_type`: the runtime's
LoadRefused when vLLM hands the refusal back) and its first mismatch line.

Workloads (greedy, `ignore_eos`, fixed token ids): sequential prompts one at a time; a concurrent batch; an
"oversize" batch whose prefill is larger than the largest capture size (it runs without graphs, then decode
replays); then the measurements: time to first token on a long prompt, decode tokens/s at batch 1 and 32
(median of three timings each); with `--long-prompts`, a prompt near max_model_len alone, then two at once
(compared like the others); with `--replay-timing`, last, graph replays timed in the worker. A batch of several
prompts is held until all of it is in the engine core (`held_batch`), so every run serves the same batches;
`--unheld-batches` sends it as one plain `LLM.generate()` call instead.
Phases (one vocabulary for every run, adding up to the start-up time): vLLM's own log lines (weights, engine init,
profile, capture) split further by the runtime's per-rank stats when persistence is on.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time
import zlib
from array import array
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tools"))

from gptools import proofkit  # noqa: E402  (stdlib only; the runner's helper for drivers)

proofkit.note_script_run(__name__)  # the run's `script_runs`: under persistence vLLM must not run this script again

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# --model-shape qwen3-30b-a3b: Qwen3-30B-A3B's layout (its Hugging Face config.json: 48 layers, hidden 2048, 128
# experts of which 8 route each token, expert MLP 768, 32 query and 4 KV heads of 128), dummy weights (about 61 GB).
QWEN3_30B_A3B: dict[str, Any] = {
    **QWEN3_8B,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "max_window_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
# --model-shape: the dummy model's folder (beside the run folders, shared by every run of an --out) and its config.
MODEL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-8b": ("qwen3-8b-dummy", QWEN3_8B),
    "qwen3-30b-a3b": ("qwen3-30b-a3b-dummy", QWEN3_30B_A3B),
}
VOCAB = 151936
GEN = 32
MAX_MODEL_LEN = 4096  # the recipes' default; --max-model-len changes it
# --sampling seeded: every request samples with these, and a seed of its own (request_seed)
SEEDED_SAMPLING: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9}
SAMPLING_MODES = ("greedy", "seeded")
LONG_MARGIN = 64  # --long-prompts: the longest prompt leaves this many positions below the limit besides GEN
TTFT_TOKENS = 3000
DECODE_REPEATS = 3  # decode tok/s is the median of this many timings: host-bound modes (PIECEWISE) vary

# vLLM's own log lines (persistence off): phase name -> pattern with the seconds in group 1.
LOG_PHASES = {
    "weights": r"Model loading took [\d.]+ GiB and ([\d.]+) seconds",
    "compile": r"torch\.compile took ([\d.]+) s in total",
    "profile": r"Memory profiling takes ([\d.]+) seconds",
    "capture": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
}


def prompt(seed: int, length: int) -> list[int]:
    """Deterministic token ids (a linear congruential sequence) in the vocabulary, avoiding special tokens."""
    x, out = seed * 7919 + 1, []
    for _ in range(length):
        x = (1103515245 * x + 12345) % (2**31)
        out.append(1000 + x % (VOCAB - 2000))
    return out


def ttft_prompts() -> tuple[list[int], list[list[int]]]:
    """Time to first token: a long prompt to warm its shapes, then three others to time, each new.

    vLLM's prefix cache is on by default: a prompt sent again (or one that starts like an earlier one) would be
    answered from cached KV blocks, and the timing would be of the last block's prefill, not the prompt's.
    """
    return prompt(399, TTFT_TOKENS), [prompt(400 + i, TTFT_TOKENS) for i in range(3)]


def long_prompts(max_len: int) -> list[list[int]]:
    """--long-prompts: the longest prompt the limit allows with GEN new tokens and a margin, then two a little shorter
    (sent together: two chunked prefills in one batch). Each is new to the prefix cache."""
    longest = max_len - GEN - LONG_MARGIN
    if longest < 1024:
        raise ValueError(f"--long-prompts needs a max_model_len above {1024 + GEN + LONG_MARGIN}, got {max_len}")
    return [prompt(800, longest), prompt(801, longest - 512), prompt(802, longest - 1024)]


def request_seed(ids: list[int]) -> int:
    """--sampling seeded: a request's seed, a function of its prompt alone: every run draws the same tokens for it."""
    return zlib.crc32(array("I", ids).tobytes())


def sampling_kwargs(ids: list[int], max_tokens: int, sampling: str = "greedy") -> dict[str, Any]:
    """SamplingParams' keywords for one request: greedy, or SEEDED_SAMPLING with the request's own seed."""
    base = {"max_tokens": max_tokens, "ignore_eos": True, "detokenize": False}
    if sampling == "greedy":
        return {"temperature": 0.0, **base}
    if sampling != "seeded":
        raise ValueError(f"sampling {sampling!r}: use one of {', '.join(SAMPLING_MODES)}")
    return {**SEEDED_SAMPLING, "seed": request_seed(ids), **base}


def write_model(where: Path, config: dict[str, Any] | None = None) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(QWEN3_8B if config is None else config, indent=1))
    return where


def dummy_model(a: argparse.Namespace) -> Path:
    """The dummy model's folder for --model-shape, beside the run folders (one path for every run of the --out)."""
    folder, config = MODEL_SHAPES[a.model_shape]
    return write_model(Path(a.result).resolve().parent.parent / folder, config)


def llm_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """LLM(...)'s keywords for a run. The model-case options are passed only when set, so a run without them is the
    dense recipes' start as before."""
    kwargs: dict[str, Any] = {
        "model": str(a.model or dummy_model(a)),
        "tensor_parallel_size": a.tp,
        "gpu_memory_utilization": a.gpu_memory_utilization,
        "max_model_len": a.max_model_len,
        "seed": 0,
        "enforce_eager": a.enforce_eager,
        "graph_persist": a.mode,
        "graph_persist_dir": a.archive,
    }
    if not a.model:
        kwargs |= {"load_format": "dummy", "skip_tokenizer_init": True}
    compilation: dict[str, Any] = {}
    if a.tp > 1:  # see README.md: the flashinfer fusion's automatic backend needs multicast (not on this host)
        compilation["pass_config"] = {"fuse_allreduce_rms": a.fuse_allreduce_rms == "on"}
    if a.cudagraph_mode:
        compilation["cudagraph_mode"] = a.cudagraph_mode
    if a.async_scheduling != "default":
        kwargs["async_scheduling"] = a.async_scheduling == "on"
    if a.executor != "default":
        kwargs["distributed_executor_backend"] = a.executor
    if compilation:
        kwargs["compilation_config"] = compilation
    if a.quantization:
        kwargs["quantization"] = a.quantization
    if a.kv_cache_dtype:
        kwargs["kv_cache_dtype"] = a.kv_cache_dtype
    return kwargs


def build_llm(a: argparse.Namespace) -> Any:
    from vllm import LLM

    return LLM(**llm_kwargs(a))


def generate(
    llm: Any, prompts: list[list[int]], max_tokens: int = GEN, sampling: str = "greedy", held: bool = True
) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if sampling == "greedy":  # one SamplingParams for the batch, as before --sampling existed
        params: Any = SamplingParams(**sampling_kwargs([], max_tokens))
    else:
        params = [SamplingParams(**sampling_kwargs(p, max_tokens, sampling)) for p in prompts]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    if held and len(requests) > 1:
        outs = held_batch(llm, requests, params)
    else:
        outs = llm.generate(requests, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def held_batch(llm: Any, requests: list[Any], params: Any) -> list[Any]:
    """One batch whose first step holds every request. vLLM's engine core starts a step as soon as a request arrives
    (`EngineCore._process_input_queue`), so which of one `generate()` call's requests share its first steps depends on
    timing, and another batch's rounding changes a token where the top logits are close (seen with random real
    weights: SAVE, LOAD and the baseline each served the concurrent batch differently, 2026-12-07). So scheduling is
    paused (vLLM's level-0 sleep, requests kept), the requests enqueued, scheduling resumed: runs compare the same
    batches. The utility calls travel the engine core's input queue in order, behind nothing."""
    llm.sleep(level=0, mode="keep")
    try:
        llm.enqueue(requests, params, use_tqdm=False)
    finally:
        llm.wake_up(tags=["scheduling"])
    return llm.wait_for_completion(use_tqdm=False)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def log_phases(text: str) -> dict[str, float]:
    """vLLM's own timings found in a log's text (also used by the `vllm serve` recipe's driver)."""
    phases = {}
    for name, pattern in LOG_PHASES.items():
        found = re.findall(pattern, text)
        if found:
            phases[name] = max(float(x) for x in found)  # the slowest rank
    return phases


# Lines whose first appearance the driver stamps (proofkit.LogStamps, the wall clock), for the phases the engine's own
# timings leave out: the engine core's first line (vLLM prefixes its output with the process name), the end of
# weight loading, the end of the memory profile, the first CUDA-graph progress bar, the capture's and the init's end.
STAMPED_LINES = {
    "core_first_line": r"\(EngineCore\w* pid=\d+\)",
    "weights_line": LOG_PHASES["weights"],
    "kv_line": r"Available KV cache memory",
    "capture_begin": r"Capturing CUDA graphs",
    "capture_end": LOG_PHASES["capture"],
    "init_line": LOG_PHASES["init_engine"],
}
ENGINE_CORE_TITLE = r"EngineCore"  # vLLM retitles its engine core process `VLLM::EngineCore` (setproctitle)


def stamp_marks(stamps: proofkit.LogStamps, births: list[tuple[float, int, str]], t0_wall: float) -> dict[str, float]:
    """The start-up's stamps in seconds since the clock started (`t0_wall`, the wall clock): each stamped line's
    first appearance and the engine core process's birth (`core_born`). A stamp not found is left out."""
    return proofkit.stamp_marks(lambda p, _last: stamps.first(p), lambda title: proofkit.born(births, title),
                                STAMPED_LINES, {"core_born": ENGINE_CORE_TITLE}, t0=t0_wall)  # fmt: skip


def start_phases(
    ready: float, log: dict[str, float], stats: list[dict[str, Any]], marks: dict[str, float] | None = None
) -> dict[str, float]:
    """One vocabulary for every run, adding up to the start-up time, so baseline, eager, SAVE and LOAD compare:
    weights | profile (+ compile) | KV cache + warm-ups | graphs (capture or restore) | save | after_graphs (vLLM's
    kernel warm-up after the graphs), and the parts of the start the engine does not time, measured between stamps
    on one clock (`marks`, seconds since the clock started: stamp_marks): front_boot (a server's imports, to its
    first line) | engine_config (the configuration in the launching process, to the engine core's birth) |
    core_boot (the engine core's birth to its first line: its imports when spawned) | core_setup (to the weights:
    executor, worker, CUDA, distributed init) | after_weights (to vLLM's init) | handoff (the init's end to ready).
    `start` and `rest_of_init` are what remains of the start-up and of vLLM's init once the measured parts are
    taken out: remainders (proof.toml `residual_phases`)."""
    init, weights = log.get("init_engine"), log.get("weights", 0.0)
    if init is None:  # the engine did not log its init time: only what the runtime measured
        return {k: v for s in stats[:1] for k, v in s.get("phases", {}).items()}
    marks = marks or {}
    names = stats[0].get("phases", {}) if stats else {}
    slowest = {n: max(float(s.get("phases", {}).get(n, 0.0)) for s in stats) for n in names}
    init_start = proofkit.before(marks.get("init_line"), init)
    if slowest:
        profile = slowest.get("profile", 0.0)
        kv_warmup = slowest.get("kv_cache", 0.0) + slowest.get("warmup", 0.0)
        graphs = slowest.get("capture", 0.0) + slowest.get("restore", 0.0)
        save = slowest.get("save", 0.0)
        inside = {"after_graphs": slowest["after_graphs"]} if "after_graphs" in slowest else {}
    else:
        profile, kv_warmup, save = log.get("profile", log.get("compile", 0.0)), 0.0, 0.0
        graphs = log.get("capture", 0.0)
        # persistence off: vLLM's init split at its own lines (capture's logged time is whole seconds)
        stamped = consecutive_init(init_start, marks)
        profile, kv_warmup, graphs = (stamped.pop(k, v) for k, v in
                                      (("profile", profile), ("kv_warmup", kv_warmup), ("graphs", graphs)))  # fmt: skip
        inside = stamped
    outside = {
        **proofkit.consecutive([*front_marks(marks), ("engine_config", marks.get("core_born")),
                                ("core_boot", marks.get("core_first_line")),
                                ("core_setup", proofkit.before(marks.get("weights_line"), log.get("weights")))]),
        **proofkit.consecutive([("weights_end", marks.get("weights_line")), ("after_weights", init_start)]),
        **proofkit.consecutive([("init_end", marks.get("init_line")), ("handoff", ready)]),
    }  # fmt: skip
    measured_init = profile + kv_warmup + graphs + save + sum(inside.values())
    phases = {
        "start": ready - init - weights - sum(outside.values()),
        **outside,
        "weights": weights,
        "profile": profile,
        "kv_warmup": kv_warmup,
        "graphs": graphs,
        "save": save,
        **inside,
        "rest_of_init": init - measured_init,
    }
    return {k: round(v, 3) for k, v in phases.items()}


def front_marks(marks: dict[str, float]) -> list[tuple[str, float | None]]:
    """Where the clock starts, then, for a server (`front_first_line` stamped), its boot: imports to its first line."""
    front: list[tuple[str, float | None]] = [("clock", 0.0)]
    return [*front, ("front_boot", marks["front_first_line"])] if "front_first_line" in marks else front


def consecutive_init(init_start: float | None, marks: dict[str, float]) -> dict[str, float]:
    """Persistence off (no rank stats): vLLM's init between its own lines: profile (the profile run, compile
    included, to "Available KV cache memory") | kv_warmup (KV cache and warm-up, to the first CUDA-graph progress
    bar) | graphs (to "Graph capturing finished") | after_graphs (to the init's end line). {} when a line is
    missing (an eager start captures nothing): the durations vLLM logs stand, the rest stays in rest_of_init."""
    chain = [("init_start", init_start), ("profile", marks.get("kv_line")), ("kv_warmup", marks.get("capture_begin")),
             ("graphs", marks.get("capture_end")), ("after_graphs", marks.get("init_line"))]  # fmt: skip
    return proofkit.consecutive(chain) if all(t is not None for _, t in chain) else {}


def record_early_restores() -> list[str]:
    """The list that will hold the cache files vLLM's switch puts back in this process before the engine starts
    (LOAD; not compiled here): the driver wraps the glue's restore, which returns them."""
    from vllm import graphpersist_caches

    restored: list[str] = []
    restore = graphpersist_caches.restore_before_engine

    def recording(directory: Path) -> list[str]:
        written = restore(directory)
        restored.extend(written)
        return written

    graphpersist_caches.restore_before_engine = recording
    return restored


def restored_cache_files(stats: list[dict[str, Any]], early: list[str]) -> set[str]:
    """The cache files LOAD put back from the archive (not compiled here), named as proofkit's snapshots name them:
    the workers' (in their stats) and what the switch restored in this process before the engine started."""
    return proofkit.snapshot_names([*(p for s in stats for p in s.get("jitcache_restored", [])), *early])


def run(a: argparse.Namespace) -> dict[str, Any]:
    t_import = time.perf_counter()
    import vllm  # before the clock starts: start-up is LLM()'s wall time, as REFERENCE-GPU.md measures it
    from vllm import LLM  # noqa: F401  (vLLM imports LLM's module lazily, on first use)

    import_s = time.perf_counter() - t_import
    early = record_early_restores() if a.mode == "load" else []
    before = proofkit.cache_snapshot()
    started = proofkit.start_engine(lambda: build_llm(a), Path(a.result).parent / "log.txt", a.expect_refusal)
    if started.result is not None:
        return {**started.result, "script_runs": proofkit.script_runs(a.result)}
    llm, ready = started.engine, started.ready_s
    marks = stamp_marks(started.stamps, proofkit.process_births(os.getpgid(0)), started.t0_wall)
    after_start = proofkit.cache_snapshot()

    # every workload samples as --sampling says; a batch is held until all of it is in, unless --unheld-batches
    gen = functools.partial(generate, sampling=a.sampling, held=not a.unheld_batches)
    sequential_prompts = [prompt(i, n) for i, n in enumerate((7, 64, 300, 1000))]
    first, first_s = timed(gen, llm, sequential_prompts[:1])
    after_first = proofkit.cache_snapshot()
    sequential = first + [gen(llm, [p])[0] for p in sequential_prompts[1:]]
    repeats = [timed(gen, llm, sequential_prompts[:1]) for _ in range(3)]  # the first request, again
    steady = [s for _, s in repeats]
    concurrent_prompts = [prompt(100 + i, 16 + 9 * i) for i in range(16)]
    concurrent = gen(llm, concurrent_prompts)
    oversize = gen(llm, [prompt(200 + i, 40) for i in range(48)] + [prompt(300, 1500)])
    outputs = {
        "sequential": sequential,
        "first_repeated": [out[0] for out, _ in repeats],
        "concurrent": concurrent,
        "oversize": oversize,
    }
    if a.long_prompts:
        longest, *others = long_prompts(a.max_model_len)
        outputs["long"] = gen(llm, [longest]) + gen(llm, others)

    warm_long, timed_long = ttft_prompts()
    gen(llm, [warm_long], 1)
    ttft = statistics.median(timed(gen, llm, [p], 1)[1] for p in timed_long)
    b1s = [timed(gen, llm, [prompt(500 + r, 16)], 256)[1] for r in range(DECODE_REPEATS)]
    batches = [[prompt(600 + 32 * r + i, 16) for i in range(32)] for r in range(DECODE_REPEATS)]
    b32s = [timed(gen, llm, batch, 256)[1] for batch in batches]
    b1, b32 = statistics.median(b1s), statistics.median(b32s)

    stats = proofkit.rank_stats()
    log = Path(a.result).parent / "log.txt"
    phases = start_phases(ready, log_phases(log.read_text(errors="replace") if log.is_file() else ""), stats, marks)
    restored = restored_cache_files(stats, early)
    new_start = [f for f in proofkit.new_files(before, after_start) if f not in restored]
    new_first = proofkit.new_files(after_start, after_first)

    result = {
        "ok": True,
        "error": None,
        "start_to_ready_s": round(ready, 3),
        "phases": phases,
        "outputs": outputs,
        "latency": {
            "first_request_s": round(first_s, 4),
            "steady_request_s": round(statistics.median(steady), 4),
            "ttft_long_s": round(ttft, 4),
            "decode_tps_b1": round(256 / b1, 1),
            "decode_tps_b32": round(32 * 256 / b32, 1),
            "import_vllm_s": round(import_s, 2),
        },
        "jit": {
            "new_cache_files_start": len(new_start),
            "new_cache_files_first_request": len(new_first),
            "examples": (new_start + new_first)[:10],
        },
        "decode_s": {"b1": [round(x, 4) for x in b1s], "b32": [round(x, 4) for x in b32s]},
        "engine": {"name": "vllm", "version": vllm.__version__},
        "graphpersist_stats": stats,
        "start_marks": marks,
        "script_runs": proofkit.script_runs(a.result),
    }
    if a.replay_timing:  # last: replays overwrite the graphs' static buffers
        from gpdiag import vllm_replaytime

        timing = llm.collective_rpc(vllm_replaytime.replay_timing)[0]
        result["replay_timing"] = timing
        for kind in ("full", "pieces"):
            if timing.get(kind):
                result["latency"][f"{kind}_submit_us"] = timing[kind]["submit_us"]
                result["latency"][f"{kind}_round_ms"] = timing[kind]["round_ms"]
        result["latency"]["eager_op_us"] = timing["eager_op_us"]
    if a.diag_probe:  # diagnosis: what the first prompt and the concurrent batch were sampled from
        from gpdiag import vllm_rpc as diag

        llm.collective_rpc(diag.probe_install)
        gen(llm, sequential_prompts[:1], 2)
        gen(llm, concurrent_prompts, 1)
        result["diag_probe"] = llm.collective_rpc(diag.probe_collect)[0]
    if a.diag_bisect:
        import diagbisect

        runs = Path(a.result).resolve().parent.parent
        saved = json.loads((runs / "save" / "result.json").read_text())["outputs"]
        expected = [saved["sequential"][0][:4], saved["concurrent"][0][:4]]
        probes = [sequential_prompts[:1], concurrent_prompts]
        history = runs / "save" / "memory-owners.rank0.json.gz"
        result["diag_bisect"] = diagbisect.run(llm, gen, probes, expected, a.diag_bisect, history)
    return result


# Options that reach the engine as an environment variable: a switch sets it to 1, a value is passed as given.
# CUDA_LAUNCH_BLOCKING is not an environment pin, so a LOAD may differ from its SAVE there.
OPTION_ENV = {
    "diag_fill_restored": "GP_DIAG_FILL_RESTORED",
    "diag_history": "GP_DIAG_HISTORY",
    "diag_dot": "GP_DIAG_DOT",
    "diag_kv_blocks": "GP_DIAG_KV_BLOCKS",
    "diag_extra_warmup": "GP_DIAG_EXTRA_WARMUP",
    "flashinfer_allreduce_backend": "VLLM_FLASHINFER_ALLREDUCE_BACKEND",
    "diag_launch_blocking": "CUDA_LAUNCH_BLOCKING",
    "diag_save_bytes": "GP_DIAG_SAVE_BYTES",
    "diag_load_profile": "GP_DIAG_LOAD_PROFILE",
}
MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # --model-runner v2 sets it to 1; default leaves vLLM's choice
# A diagnosis run puts gpdiag's site folder first on every process's path: its sitecustomize wraps the session.
DIAG_SITE = str(Path(__file__).resolve().parents[2] / "tools" / "gpdiag" / "site")
# Switches that point a variable at the run's folder, where the workers write their files.
RUN_FOLDER_ENV = {
    "diag": "GP_DIAG_DUMP",  # tools/gpdiag/vllm_state.py
    "diag_cprofile": "GP_DIAG_CPROFILE",  # tools/gpdiag/startprofile.py
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="run name (for the logs)")
    ap.add_argument("--mode", choices=["off", "save", "load"], required=True)
    ap.add_argument("--archive", help="archive directory (save/load)")
    ap.add_argument("--result", required=True, help="where to write result.json")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    ap.add_argument("--model", help="a real checkpoint directory (default: dummy Qwen3-8B weights)")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-8b",
                    help="the dummy model's config without --model (default qwen3-8b)")  # fmt: skip
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the eager comparison start)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help=f"(default {MAX_MODEL_LEN})")
    ap.add_argument("--quantization", help="vLLM's quantization, e.g. fp8 (online FP8 weights; default: none)")
    ap.add_argument("--kv-cache-dtype", help="vLLM's kv_cache_dtype, e.g. fp8 (default: vLLM's, auto)")
    ap.add_argument("--sampling", choices=SAMPLING_MODES, default="greedy",
                    help="greedy (default), or seeded: temperature 0.8, top-p 0.9, a seed per request")  # fmt: skip
    ap.add_argument("--long-prompts", action="store_true",
                    help="a workload of prompts near max_model_len (outputs compared as `long`)")  # fmt: skip
    ap.add_argument("--model-runner", choices=["default", "v2"], default="default",
                    help="v2: VLLM_USE_V2_MODEL_RUNNER=1 (vLLM runs Qwen3-MoE on its V1 runner otherwise)")  # fmt: skip
    ap.add_argument("--cudagraph-mode", help="vLLM cudagraph_mode (default: vLLM's choice, FULL_AND_PIECEWISE here)")
    ap.add_argument("--async-scheduling", choices=["default", "on", "off"], default="default",
                    help="vLLM's async scheduling (default: vLLM's choice)")  # fmt: skip
    ap.add_argument("--fuse-allreduce-rms", choices=["on", "off"], default="off",
                    help="TP>1: flashinfer's fused all-reduce + RMSNorm pass (default off: README.md)")  # fmt: skip
    ap.add_argument("--flashinfer-allreduce-backend", choices=["auto", "trtllm", "mnnvl"],
                    help="VLLM_FLASHINFER_ALLREDUCE_BACKEND for that pass (default: vLLM's, auto)")  # fmt: skip
    ap.add_argument("--expect-refusal", metavar="REGEX",
                    help="the engine must not start: ok when its log matches REGEX")  # fmt: skip
    ap.add_argument("--unheld-batches", action="store_true",
                    help="send each batch with one LLM.generate() call (the engine core may start on part of it; "
                    "default: hold the batch until every request is in, so runs compare the same batches)")  # fmt: skip
    ap.add_argument("--no-reexec", action="store_true",
                    help="stay out of the runtime's interposer, as `python app.py` without `graphpersist exec`: vLLM "
                    "then spawns its engine core (persistence's spawn: it does not run this script again)")  # fmt: skip
    ap.add_argument("--executor", choices=["default", "mp", "uni"], default="default",
                    help="vLLM's distributed_executor_backend (default: vLLM's choice, 'uni' at TP=1)")  # fmt: skip
    ap.add_argument("--replay-timing", action="store_true",
                    help="last, time graph replays in the worker (tools/gpdiag/vllm_replaytime.py)")  # fmt: skip
    ap.add_argument(
        "--diag",
        action="store_true",
        help="diagnosis only: fingerprint the runner's buffers (GP_DIAG_DUMP)",
    )
    ap.add_argument("--diag-fill-restored", metavar="BYTE", help="diagnosis: fill LOAD's restored memory with BYTE")
    ap.add_argument("--diag-history", action="store_true", help="diagnosis: record torch's allocation history")
    ap.add_argument("--diag-save-bytes", metavar="PREFIX", help="diagnosis, SAVE: write the region's bytes to PREFIX")
    ap.add_argument("--diag-probe", action="store_true", help="diagnosis: record what sampling steps read")
    ap.add_argument("--diag-kv-blocks", metavar="FILE:FIRST-LAST", help="diagnosis: SAVE writes, LOAD puts back KV")
    ap.add_argument("--diag-extra-warmup", action="store_true", help="diagnosis, LOAD: SAVE's warm-up before graphs")
    ap.add_argument("--diag-dot", metavar="PREFIX", help="diagnosis: print graphs named PREFIX... (GP_DIAG_DOT)")
    ap.add_argument("--diag-launch-blocking", action="store_true", help="diagnosis: CUDA_LAUNCH_BLOCKING=1")
    ap.add_argument("--diag-cprofile", action="store_true",
                    help="diagnosis: cProfile each worker's start into the run folder (GP_DIAG_CPROFILE)")  # fmt: skip
    ap.add_argument("--diag-load-profile", choices=["lean", "full", "small"],
                    help="diagnosis, LOAD: the compile forward at one token per request of the largest batch with the "
                    "sampler (lean, the default), at max tokens with the sampler (full: upstream's profile run), or "
                    "at one token without it (small)")  # fmt: skip
    ap.add_argument(
        "--diag-bisect",
        metavar="PREFIX",
        help="diagnosis, LOAD: find the windows that need SAVE's bytes (PREFIX: SAVE's --diag-save-bytes)",
    )
    return ap


def export_options(a: argparse.Namespace, environ: Any = os.environ) -> None:
    """The options the engine's processes read from their environment (they inherit this process's)."""
    for option, name in RUN_FOLDER_ENV.items():
        if getattr(a, option):
            environ[name] = str(Path(a.result).resolve().parent)
    for option, name in OPTION_ENV.items():
        value = getattr(a, option)
        if value is True:
            environ[name] = "1"
        elif value:
            environ[name] = value
    if a.model_runner == "v2":
        environ[MODEL_RUNNER_ENV] = "1"
    if any(name.startswith("GP_DIAG_") for name in environ):  # gpdiag reads them (tools/gpdiag/vllm.py)
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [DIAG_SITE, environ.get("PYTHONPATH")]))
    if a.diag_bisect or a.diag_probe or a.replay_timing:  # functions sent to the worker (LLM.collective_rpc)
        environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def main() -> NoReturn:
    a = build_parser().parse_args()
    export_options(a)
    if a.mode != "off" and not a.no_reexec:  # as the README advises: under the interposer vLLM forks its processes
        from graphpersist import api

        api.reexec_with_interposer()
    case = {k: v for k, v in (("shape", a.model_shape), ("quantization", a.quantization),
                              ("kv_cache_dtype", a.kv_cache_dtype), ("max_model_len", a.max_model_len),
                              ("sampling", a.sampling), ("long_prompts", a.long_prompts),
                              ("model_runner", a.model_runner)) if v and v != "default"}  # fmt: skip
    what = f"mode={a.mode} tp={a.tp} archive={a.archive} eager={a.enforce_eager}"
    print(f"driver: run {a.run}: {what} {case}", flush=True)
    proofkit.run_and_exit(lambda: run(a), a.result)


if __name__ == "__main__":
    main()
