"""What persistence refuses in vLLM at start-up (patches/vllm/README.md, "Facts and refusals"), and LOAD's compile
forward."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from graphpersist import engine

SUPPORTED = (
    "supported with persistence: the V2 model runner (dense decoder models), cudagraph_mode FULL_AND_PIECEWISE "
    "(default), FULL_DECODE_ONLY or PIECEWISE, tensor parallelism on one node (custom all-reduce on or "
    "off), no pipeline/data/expert/context parallelism, no LoRA, no speculative decoding"
)
_refuse = engine.refuser(SUPPORTED)


def refuse_unsupported(cfg: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuses, before anything is allocated, the configurations whose graphs this integration cannot restore."""
    par, comp = cfg.parallel_config, cfg.compilation_config
    env = os.environ if environ is None else environ
    if cfg.model_config.enforce_eager:
        raise _refuse("enforce_eager (no CUDA graphs)", "turn persistence off, or drop enforce_eager")
    refuse_deepep(par)  # first: with DeepEP, data parallelism is the consequence, not the cause
    if par.pipeline_parallel_size != 1:
        raise _refuse(f"pipeline_parallel_size={par.pipeline_parallel_size}", "use tensor parallelism only")
    if par.data_parallel_size != 1:
        raise _refuse(f"data_parallel_size={par.data_parallel_size}", "start one engine per data-parallel rank")
    if par.world_size != par.tensor_parallel_size:  # vLLM's world: pipeline x tensor x prefill-context ranks
        raise _refuse(f"prefill context parallelism (a world of {par.world_size} ranks for tensor_parallel_size "
                      f"{par.tensor_parallel_size})", "serve without prefill_context_parallel_size")  # fmt: skip
    if par.decode_context_parallel_size != 1:  # its own group's collectives run in the graphs, unpersisted
        raise _refuse(f"decode_context_parallel_size={par.decode_context_parallel_size}",
                      "serve without decode context parallelism")  # fmt: skip
    if getattr(par, "enable_expert_parallel", False):
        raise _refuse("expert parallelism", "turn expert parallelism off")
    if par.nnodes_within_dp != 1:
        raise _refuse(f"{par.nnodes_within_dp} nodes", "run on a single node")
    if cfg.lora_config is not None:
        raise _refuse("LoRA", "serve without LoRA adapters")
    if cfg.speculative_config is not None:
        raise _refuse("speculative decoding", "serve without a speculative config")
    mode = comp.cudagraph_mode
    if mode is not None and mode.name == "NONE":
        raise _refuse("cudagraph_mode NONE (no CUDA graphs)", "turn persistence off")
    if env.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") == "1":  # read as vllm.envs reads it
        raise _refuse(
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1 (breakable CUDA graphs: the model runner captures them outside the "
            "capture sites persistence sees; vLLM sets it itself for DeepSeek-V4, Inkling and MiniMax-M3 models)",
            "unset it, or set VLLM_USE_BREAKABLE_CUDAGRAPH=0",
        )
    if par.tensor_parallel_size > 1 and comp.pass_config.fuse_allreduce_rms:
        raise _refuse(
            "the fused all-reduce + RMSNorm pass (flashinfer) at tensor parallelism > 1",
            'turn it off with compilation_config={"pass_config": {"fuse_allreduce_rms": false}} (vllm serve: '
            "-cc.pass_config.fuse_allreduce_rms=false). Its automatic backend needs NVLink multicast, which hosts "
            "like ours do not have, and its IPC workspace is not persisted yet",
        )


def refuse_deepep(par: Any) -> None:
    """DeepEP in vLLM 0.26.0, refused with its own reason (patches/vllm/README.md, "Facts and refusals")."""
    backend = str(getattr(par, "all2all_backend", ""))
    if not getattr(par, "enable_expert_parallel", False) or not backend.startswith("deepep"):
        return
    if backend == "deepep_low_latency":
        raise _refuse(
            "DeepEP's low-latency all2all (--all2all-backend deepep_low_latency)",
            "it is captured in the decode graphs and needs NVSHMEM with an InfiniBand NIC (IBGDA), even within one "
            "node, while persistence keeps only DeepEP's NVLink buffers. Instead serve with tensor parallelism "
            "(expert parallelism off), or use SGLang's DeepEP normal mode (--moe-a2a-backend deepep --deepep-mode "
            "normal), which persistence supports",
        )
    raise _refuse(
        f"DeepEP expert parallelism (--all2all-backend {backend})",
        "vLLM uses DeepEP only with data parallelism > 1, which persistence does not take, and turns CUDA graphs off "
        "for its high-throughput kernels (nothing to persist). Instead serve with tensor parallelism (expert "
        "parallelism off), or use SGLang's DeepEP normal mode (--moe-a2a-backend deepep --deepep-mode normal)",
    )


def refuse_unsupported_runner(worker: Any) -> None:
    """After the runner exists: only the V2 model runner's capture sites are hooked (vLLM 0.26.0 runs MoE models
    outside `DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES` on V1 unless VLLM_USE_V2_MODEL_RUNNER=1)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    if not isinstance(worker.model_runner, GPUModelRunner):
        raise _refuse(
            "this model (it runs on vLLM's V1 model runner)",
            "serve a dense decoder model on the V2 runner, or set VLLM_USE_V2_MODEL_RUNNER=1 (vLLM 0.26.0 runs MoE "
            "models outside its V2 list, Qwen3-MoE among them, on V1 unless told)",
        )


def compile_forward(runner: Any) -> dict[str, float]:
    """LOAD: a forward through the compiled model without the profiling around it (it loads the compiled model as
    SAVE's profile run compiled it), then the sampler on its output (it compiles the kernels the first greedy request
    needs), at one token per request of the largest batch; patches/vllm/README.md, "The worker's start", has the
    measurements. Returns the parts in seconds: `forward` (the compiled model's load included) and `sampler`."""
    started = time.perf_counter()
    _, sample = runner._dummy_run(runner.max_num_reqs, skip_attn=True, is_profile=True)
    torch.cuda.synchronize()
    forward_s = time.perf_counter() - started
    runner._dummy_sampler_run(sample)
    torch.cuda.synchronize()
    return {"sampler": round(time.perf_counter() - started - forward_s, 4), "forward": round(forward_s, 4)}
