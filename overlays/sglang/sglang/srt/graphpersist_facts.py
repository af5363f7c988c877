"""What an SGLang archive must agree on (facts LOAD compares field by field), what persistence refuses at start-up,
and the small engine lookups the glue needs. Nothing here imports SGLang or torch at module level (CPU tests)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from graphpersist import engine
from graphpersist.engine import PersistError, Refused

SUPPORTED = (
    "supported with persistence: dense decoder models, tensor parallelism on one node (custom all-reduce "
    "v2, SGLang's default, or --disable-custom-all-reduce), decode CUDA graphs with the 'full' backend and prefill "
    "CUDA graphs with the 'breakable' backend (the defaults on CUDA) or disabled, attention backends fa3, flashinfer "
    "or triton; MoE models with DeepEP expert parallelism in normal mode on one node (--moe-a2a-backend deepep "
    "--deepep-mode normal: breakable decode graphs); no speculative decoding, pipeline or data parallelism, DP "
    "attention, other expert-parallel backends, LoRA, PD multiplexing, two-batch overlap or torch.compile"
)

ATTENTION_BACKENDS = ("fa3", "flashinfer", "triton")
DECODE_BACKENDS = ("full",)
DEEPEP_DECODE_BACKENDS = ("breakable",)  # --deepep-mode normal under persistence (graphpersist_deepep, patch 0009)
PREFILL_BACKENDS = ("breakable", "disabled")

# Environment switches that change what SGLang captures or how it allocates, with the value persistence needs.
ENV_REFUSED = {
    "SGLANG_ENABLE_CUDA_GRAPH_DEDUP": ("graph dedup shares one executable between shapes", "unset it"),
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": ("the memory saver's CUDA-graph mode", "unset it"),
    "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": (
        "post-capture KV sizing grows the KV pool after the capture",
        "unset it (LOAD reuses SAVE's pool size instead)",
    ),
}
ENV_TRUE = ("1", "true", "yes", "on")


def _refuse(what: str, instead: str) -> Refused:
    return Refused(f"graphpersist: {what} cannot be persisted: {instead}. ({SUPPORTED})")


def refuse_unsupported(sa: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuses, before anything is allocated, the configurations whose graphs this integration cannot restore."""
    env = os.environ if environ is None else environ
    if getattr(sa, "speculative_algorithm", None):
        raise _refuse(f"speculative decoding ({sa.speculative_algorithm})", "serve without --speculative-algorithm")
    if sa.pp_size != 1:
        raise _refuse(f"pipeline parallelism (--pp-size {sa.pp_size})", "use tensor parallelism only")
    if sa.dp_size != 1 or sa.enable_dp_attention:
        raise _refuse(
            "data parallelism / DP attention", "start one engine per data-parallel rank, without --enable-dp-attention"
        )
    if uses_deepep(sa):
        from sglang.srt import graphpersist_deepep as deepep

        deepep.refuse(sa)
    elif getattr(sa, "moe_a2a_backend", "none") not in (None, "none") or getattr(sa, "ep_size", 1) != 1:
        raise _refuse(
            f"expert parallelism (--moe-a2a-backend {sa.moe_a2a_backend}, --ep-size {getattr(sa, 'ep_size', 1)})",
            "serve without expert parallelism, or with DeepEP in normal mode (--moe-a2a-backend deepep "
            "--deepep-mode normal)",
        )
    if sa.nnodes != 1:
        raise _refuse(f"{sa.nnodes} nodes", "run on a single node")
    if getattr(sa, "dcp_size", 1) != 1 or getattr(sa, "attn_cp_size", 1) != 1:
        raise _refuse("context parallelism", "serve without --dcp-size / --attn-cp-size")
    if sa.enable_lora:
        raise _refuse("LoRA", "serve without --enable-lora")
    if sa.enable_pdmux:
        raise _refuse("PD multiplexing", "serve without --enable-pdmux")
    if sa.enable_two_batch_overlap:
        raise _refuse("two-batch overlap", "serve without --enable-two-batch-overlap")
    if sa.enable_torch_compile:
        raise _refuse("torch.compile (--enable-torch-compile)", "serve without it")
    if sa.enable_memory_saver:
        raise _refuse("the memory saver (--enable-memory-saver)", "serve without it")
    if getattr(sa, "forward_hooks", None):
        raise _refuse("forward hooks (--forward-hooks)", "serve without them")
    if sa.enable_symm_mem or sa.enable_mscclpp or sa.enable_nccl_nvls:
        raise _refuse(
            "NCCL symmetric-memory (--enable-symm-mem), MSCCL++ or NVLS all-reduce",
            "use SGLang's default custom all-reduce, --enable-torch-symm-mem or --disable-custom-all-reduce",
        )
    if sa.enable_profile_cuda_graph or sa.debug_cuda_graph:
        raise _refuse(
            "CUDA-graph profiling or debugging", "serve without --enable-profile-cuda-graph/--debug-cuda-graph"
        )
    cfg = sa.cuda_graph_config
    decode_backends = DECODE_BACKENDS + (DEEPEP_DECODE_BACKENDS if uses_deepep(sa) else ())
    if cfg.decode.backend not in decode_backends:
        raise _refuse(
            f"decode CUDA graphs with the {cfg.decode.backend!r} backend",
            "use the default decode backend 'full' (persistence needs CUDA graphs to persist; with DeepEP in "
            "normal mode persistence chooses 'breakable' itself)",
        )
    if cfg.prefill.backend not in PREFILL_BACKENDS:
        raise _refuse(
            f"prefill CUDA graphs with the {cfg.prefill.backend!r} backend",
            "use the default 'breakable' prefill backend or --cuda-graph-backend-prefill disabled",
        )
    backends = {sa.attention_backend, sa.prefill_attention_backend, sa.decode_attention_backend} - {None}
    other = sorted(b for b in backends if b not in ATTENTION_BACKENDS)
    if other:
        raise _refuse(
            f"attention backend {', '.join(other)}", f"use --attention-backend {' or '.join(ATTENTION_BACKENDS)}"
        )
    for name, (what, instead) in ENV_REFUSED.items():
        if env.get(name, "").strip().lower() in ENV_TRUE:
            raise _refuse(f"{name}={env[name]} ({what})", instead)
    if not sa.disable_custom_all_reduce and env.get("SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2", "1").strip().lower() not in (
        *ENV_TRUE,
        "",
    ):
        raise _refuse(
            "the legacy custom all-reduce (SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0)",
            "unset SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2 (the default custom all-reduce v2 is persisted) or pass "
            "--disable-custom-all-reduce",
        )


def refuse_unsupported_model(model_runner: Any) -> None:
    """Models whose memory pools or attention this integration does not persist (hybrid, MLA, multimodal)."""
    if model_runner.is_hybrid_swa or model_runner.use_mla_backend or model_runner.is_multimodal:
        raise _refuse("this model (hybrid sliding-window, MLA or multimodal attention)", "serve a dense decoder model")
    if not model_runner.is_generation:
        raise _refuse("an embedding or reward model", "serve a generative decoder model")
    from sglang.srt.configs.hybrid_arch import mambaish_config

    if mambaish_config(model_runner.model_config) is not None:
        raise _refuse("a hybrid (mamba or linear-attention) model", "serve a dense decoder model")


def engine_facts() -> dict[str, str]:
    import sglang

    version = getattr(sglang, "__version__", "")
    return {"name": "sglang", "version": str(version), "commit": ""}


def model_facts(sa: Any, model_config: Any) -> dict[str, str]:
    """dtype and a fingerprint of the model's configuration (architecture, sizes), known before the weights."""
    import hashlib
    import json

    hf = getattr(model_config, "hf_config", None)
    described = hf.to_json_string(use_diff=False) if hf is not None and hasattr(hf, "to_json_string") else repr(hf)
    fingerprint = hashlib.sha256(
        json.dumps({"hf": described, "context_len": model_config.context_len, "model_path": sa.model_path}).encode()
    ).hexdigest()
    return {"dtype": str(model_config.dtype), "config_fingerprint": fingerprint}


def uses_deepep(sa: Any) -> bool:
    """Whether this start runs DeepEP expert parallelism (`--moe-a2a-backend deepep`)."""
    return getattr(sa, "moe_a2a_backend", "none") == "deepep"


def parallel(sa: Any) -> dict[str, int]:
    ep = int(getattr(sa, "ep_size", 1)) if uses_deepep(sa) else 1
    return {"world_size": sa.tp_size, "tp_size": sa.tp_size, "pp_size": 1, "ep_size": ep}


def config_flags(sa: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Flags known from the server arguments alone (compared before setup and again at LOAD)."""
    env = os.environ if environ is None else environ
    cfg = sa.cuda_graph_config
    return {
        "context_length": sa.context_length,
        "max_running_requests": sa.max_running_requests,
        "max_total_tokens": sa.max_total_tokens,
        "chunked_prefill_size": sa.chunked_prefill_size,
        "page_size": sa.page_size,
        "kv_cache_dtype": str(sa.kv_cache_dtype),
        "mem_fraction_static": sa.mem_fraction_static,
        "attention_backend": sa.attention_backend,
        "prefill_attention_backend": sa.prefill_attention_backend,
        "decode_attention_backend": sa.decode_attention_backend,
        "cuda_graph_decode_backend": cfg.decode.backend,
        "cuda_graph_decode_bs": sorted(cfg.decode.bs or []),
        "cuda_graph_prefill_backend": cfg.prefill.backend,
        "cuda_graph_prefill_bs": sorted(cfg.prefill.bs or []),
        "disable_cuda_graph_padding": bool(sa.disable_cuda_graph_padding),
        "disable_custom_all_reduce": bool(sa.disable_custom_all_reduce),
        "enable_torch_symm_mem": bool(sa.enable_torch_symm_mem),
        "custom_all_reduce_v2": env.get("SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2"),
        "disable_overlap_schedule": bool(sa.disable_overlap_schedule),
        # batch-invariant kernels in the graphs, and the only mode in which SGLang honours per-request seeds
        "enable_deterministic_inference": bool(sa.enable_deterministic_inference),
        "quantization": sa.quantization,
        "load_format": str(sa.load_format),
        **deepep_flags(sa),
    }


def deepep_flags(sa: Any) -> dict[str, Any]:
    """With DeepEP, what changes its Buffer and what runs in the breaks (none without it: archives stay as before)."""
    if not uses_deepep(sa):
        return {}
    return {
        "moe_a2a_backend": sa.moe_a2a_backend,
        "deepep_mode": str(sa.deepep_mode),
        "deepep_config": sa.deepep_config,
        "moe_runner_backend": str(sa.moe_runner_backend),
        "ep_size": int(sa.ep_size),
    }


def flags(pool: dict[str, Any] | None, model_runner: Any, inventory: Mapping[str, list[int]]) -> dict[str, Any]:
    """Every flag SAVE records and LOAD compares, once the memory pool, backends and graph runners exist."""
    from sglang.srt import graphpersist_customar as customar

    return {
        **config_flags(model_runner.server_args),
        "attention_backend_prefill_live": str(model_runner.prefill_attention_backend_str),
        "attention_backend_decode_live": str(model_runner.decode_attention_backend_str),
        "decode_batch_sizes": list(inventory.get("decode", [])),
        "prefill_token_sizes": list(inventory.get("prefill", [])),
        "memory_pool": dict(pool or {}),
        "max_total_num_tokens": int(model_runner.max_total_num_tokens),
        "custom_all_reduce": customar.describe_live(),
        "torch_symm_mem": torch_symm_mem_live(),
    }


def torch_symm_mem_live() -> list[str]:
    """Each process group's torch symmetric-memory communicator as `group:on|off:<buffer bytes>`: whether it came
    on depends on more than the flag (world size, GPU, multicast, patch 0007's GRAPHPERSIST_SYMM_MEM_NO_MULTICAST), and
    which all-reduces it takes (those below its buffer size) is in the captured graphs."""
    from sglang.srt import graphpersist_customar as customar

    return [
        f"{name}:off:0" if comm.disabled else f"{name}:on:{int(comm.max_size)}"
        for name, comm in customar.group_communicators("torch_symm_mem_comm")
    ]


POOL_FIELDS = (
    "max_total_num_tokens",
    "max_running_requests",
    "full_max_total_num_tokens",
    "swa_max_total_num_tokens",
    "c4_max_total_num_tokens",
    "c128_max_total_num_tokens",
    "c4_state_pool_size",
    "c128_state_pool_size",
    "mem_fraction_static",
)


def saved_pool(value: Any, archive_dir: Any) -> dict[str, Any]:
    """The memory pool SAVE sized (every MemoryPoolConfig field), as recorded in flags.memory_pool; refuses an archive
    without one."""
    if not isinstance(value, dict) or set(value) != set(POOL_FIELDS):
        raise PersistError(
            f"graphpersist: {archive_dir} records no memory-pool size (flags.memory_pool = {value!r}). "
            "Re-run with mode=save."
        )
    return value


def pool_record(config: Any) -> dict[str, Any]:
    """The MemoryPoolConfig SAVE used, every field by name, as the archive records it (LOAD rebuilds it)."""
    return {name: getattr(config, name) for name in POOL_FIELDS}


def cpu_gather() -> Any:
    """Rank agreement over SGLang's CPU (gloo) world group: nothing touches the GPU or NCCL."""
    from sglang.srt.distributed import get_world_group

    return engine.torch_gather(get_world_group().cpu_group)


def setup_tensors(model_runner: Any) -> dict[str, Any]:
    """The setup tensors the graphs read, by name: parameters, buffers and the KV pool (LOAD proves their place)."""
    named = engine.model_tensors(model_runner.model)
    pool = model_runner.token_to_kv_pool
    for kind in ("k_buffer", "v_buffer"):
        named.update({f"kv_pool.{kind}.{i}": t for i, t in enumerate(getattr(pool, kind, None) or [])})
    return named
