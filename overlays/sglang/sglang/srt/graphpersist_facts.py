"""The flags an SGLang archive records (LOAD compares them field by field; the other facts are the adapter's own
answers), what persistence refuses at start-up, and the small engine lookups the glue needs. Nothing here imports
SGLang or torch at module level (CPU tests)."""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Mapping
from typing import Any

from graphpersist import engine

SUPPORTED = (
    "supported with persistence: dense decoder models, tensor parallelism on one node (custom all-reduce "
    "v2, SGLang's default, or --disable-custom-all-reduce), decode CUDA graphs with the 'full' backend and prefill "
    "CUDA graphs with the 'breakable' backend (the defaults on CUDA) or disabled, attention backends fa3, flashinfer "
    "or triton; MoE models with DeepEP expert parallelism in normal mode on one node (--moe-a2a-backend deepep "
    "--deepep-mode normal: breakable decode graphs); no speculative decoding, pipeline or data parallelism, DP "
    "attention, other expert-parallel backends, LoRA, PD multiplexing, two-batch overlap or torch.compile"
)
_refuse = engine.refuser(SUPPORTED)

ATTENTION_BACKENDS = ("fa3", "flashinfer", "triton")
DECODE_BACKENDS = ("full",)
DEEPEP_DECODE_BACKENDS = ("breakable",)  # --deepep-mode normal under persistence (graphpersist_deepep, patch 0009)
PREFILL_BACKENDS = ("breakable", "disabled")
GRAPH_BACKEND_INSTEAD = {
    "decode": "use the default decode backend 'full' (persistence needs CUDA graphs to persist; with DeepEP in normal "
    "mode persistence chooses 'breakable' itself)",
    "prefill": "use the default 'breakable' prefill backend or --cuda-graph-backend-prefill disabled",
}

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

ALL_REDUCE_INSTEAD = "use SGLang's default custom all-reduce, --enable-torch-symm-mem or --disable-custom-all-reduce"
ATTENTION_INSTEAD = f"use --attention-backend {' or '.join(ATTENTION_BACKENDS)}"
# The ServerArgs fields persistence refuses, checked in this order: field -> (what it takes: None for unset or off, a
# tuple of the values it takes, else the one value; what the setting is; what to do instead).
REFUSED = {
    "speculative_algorithm": (None, "speculative decoding", "serve without it"),
    "pp_size": (1, "pipeline parallelism", "use tensor parallelism only"),
    "dp_size": (1, "data parallelism", "start one engine per data-parallel rank"),
    "enable_dp_attention": (None, "DP attention", "start one engine per data-parallel rank, without it"),
    "nnodes": (1, "a start over several nodes", "run on a single node"),
    "dcp_size": (1, "context parallelism", "serve without it"),
    "attn_cp_size": (1, "context parallelism", "serve without it"),
    "enable_lora": (None, "LoRA", "serve without it"),
    "enable_pdmux": (None, "PD multiplexing", "serve without it"),
    "enable_two_batch_overlap": (None, "two-batch overlap", "serve without it"),
    "enable_torch_compile": (None, "torch.compile", "serve without it"),
    "enable_memory_saver": (None, "the memory saver", "serve without it"),
    "forward_hooks": (None, "forward hooks", "serve without them"),
    "enable_symm_mem": (None, "NCCL symmetric-memory all-reduce", ALL_REDUCE_INSTEAD),
    "enable_mscclpp": (None, "MSCCL++ all-reduce", ALL_REDUCE_INSTEAD),
    "enable_nccl_nvls": (None, "NVLS all-reduce", ALL_REDUCE_INSTEAD),
    "enable_profile_cuda_graph": (None, "CUDA-graph profiling", "serve without it"),
    "debug_cuda_graph": (None, "CUDA-graph debugging", "serve without it"),
    "attention_backend": ((*ATTENTION_BACKENDS, None), "this attention backend", ATTENTION_INSTEAD),
    "prefill_attention_backend": ((*ATTENTION_BACKENDS, None), "this attention backend", ATTENTION_INSTEAD),
    "decode_attention_backend": ((*ATTENTION_BACKENDS, None), "this attention backend", ATTENTION_INSTEAD),
}


def _takes(needs: Any, value: Any) -> bool:
    """Whether a field's value is one persistence takes (`REFUSED`'s first column says which)."""
    if needs is None:
        return not value
    return value in needs if isinstance(needs, tuple) else value == needs


def refuse_unsupported(sa: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuses, before anything is allocated, the configurations whose graphs this integration cannot restore."""
    env = os.environ if environ is None else environ
    if uses_deepep(sa):
        from sglang.srt import graphpersist_deepep as deepep

        deepep.refuse(sa)
    elif sa.moe_a2a_backend not in (None, "none") or sa.ep_size != 1:
        raise _refuse(
            f"expert parallelism (--moe-a2a-backend {sa.moe_a2a_backend}, --ep-size {sa.ep_size})",
            "serve without expert parallelism, or with DeepEP in normal mode (--moe-a2a-backend deepep "
            "--deepep-mode normal)",
        )
    for name, (needs, what, instead) in REFUSED.items():
        if not _takes(needs, value := getattr(sa, name)):
            raise _refuse(f"{what} (--{name.replace('_', '-')}{'' if value is True else f' {value}'})", instead)
    cfg = sa.cuda_graph_config
    decode_backends = DECODE_BACKENDS + (DEEPEP_DECODE_BACKENDS if uses_deepep(sa) else ())
    for phase, backend, takes in (("decode", cfg.decode.backend, decode_backends),
                                  ("prefill", cfg.prefill.backend, PREFILL_BACKENDS)):  # fmt: skip
        if backend not in takes:
            raise _refuse(f"{phase} CUDA graphs with the {backend!r} backend", GRAPH_BACKEND_INSTEAD[phase])
    for name, (what, instead) in ENV_REFUSED.items():
        if env.get(name, "").strip().lower() in ENV_TRUE:
            raise _refuse(f"{name}={env[name]} ({what})", instead)
    v2 = env.get("SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2", "").strip().lower()
    if v2 not in (*ENV_TRUE, "") and not sa.disable_custom_all_reduce:
        raise _refuse(
            "the legacy custom all-reduce (SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0)",
            "unset SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2 (the default custom all-reduce v2 is persisted) or pass "
            "--disable-custom-all-reduce",
        )
    server_args_record(sa)  # a value an archive cannot record is refused now, before anything is allocated


def refuse_unsupported_model(model_runner: Any) -> None:
    """Models whose memory pools or attention this integration does not persist (hybrid, MLA, multimodal)."""
    if model_runner.is_hybrid_swa or model_runner.use_mla_backend or model_runner.is_multimodal:
        raise _refuse("this model (hybrid sliding-window, MLA or multimodal attention)", "serve a dense decoder model")
    if not model_runner.is_generation:
        raise _refuse("an embedding or reward model", "serve a generative decoder model")
    from sglang.srt.configs.hybrid_arch import mambaish_config

    if mambaish_config(model_runner.model_config) is not None:
        raise _refuse("a hybrid (mamba or linear-attention) model", "serve a dense decoder model")


def uses_deepep(sa: Any) -> bool:
    """Whether this start runs DeepEP expert parallelism (`--moe-a2a-backend deepep`)."""
    return getattr(sa, "moe_a2a_backend", "none") == "deepep"


# ServerArgs fields that may differ between SAVE and LOAD without changing any graph (reviewed against SGLang 0.5.17;
# a CPU test holds each to a field of the pinned ServerArgs): persistence's own switch, the seed SGLang draws on each
# start that names none, rendezvous ports, the HTTP front-end, logging, metrics and tracing, process supervision.
# Every other field is recorded as it is and compared, so a field a new release adds is compared until reviewed here.
MAY_DIFFER = frozenset((
    "graph_persist", "graph_persist_dir", "random_seed", "host", "port", "nccl_port", "dist_init_addr", "grpc_port",
    "smg_http_sidecar_port", "fastapi_root_path", "enable_http2", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
    "enable_ssl_refresh", "served_model_name", "chat_template", "hf_chat_template_name", "completion_template",
    "default_chat_template_kwargs", "reasoning_parser", "tool_call_parser", "tool_server", "file_storage_path",
    "enable_cache_report", "stream_interval", "stream_response_default_include_usage",
    "incremental_streaming_output", "uvicorn_access_log_exclude_prefixes", "log_level", "log_level_http",
    "log_requests", "log_requests_level", "log_requests_format", "log_requests_target", "show_time_cost",
    "decode_log_interval", "enable_request_time_stats_logging", "crash_dump_folder", "gc_warning_threshold_secs",
    "enable_metrics", "enable_metrics_for_all_schedulers", "bucket_time_to_first_token",
    "bucket_inter_token_latency", "bucket_e2e_request_latency", "prompt_tokens_buckets",
    "generation_tokens_buckets", "tokenizer_metrics_custom_labels_header",
    "tokenizer_metrics_allowed_custom_labels", "extra_metric_labels", "stat_loggers", "export_metrics_to_file",
    "export_metrics_to_file_dir", "enable_trace", "trace_modules", "otlp_traces_endpoint", "kv_events_config",
    "load_snapshot_publish_interval", "watchdog_timeout", "soft_watchdog_timeout", "dist_timeout",
    "custom_sigquit_handler"
))  # fmt: skip
# Secrets are never written into an archive, whatever a release names them (a CPU test pins what this matches).
SECRET = re.compile(r"(api_key|password|secret|credentials?|(auth|access|hf|api)_token)$")


def _recordable(name: str, value: Any) -> Any:
    """A field's value as JSON the archive records and LOAD compares (sets sorted, dataclasses by their fields); a
    value of another kind is refused, naming the field, rather than compared by a text that may differ per start."""
    if isinstance(value, enum.Enum):
        value = value.value
    for kind in (bool, int, float, str):  # a subclass (IntEnum, a str enum) as JSON reads it back
        if isinstance(value, kind):
            return kind(value)
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _recordable(f"{name}.{k}", v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        value = sorted(value, key=repr)
    if isinstance(value, list | tuple):
        return [_recordable(name, v) for v in value]
    raise _refuse(f"--{name.replace('_', '-')} (a {type(value).__name__})", "start without it: an archive records "
                  "every server argument that may change a graph, and cannot record this one")  # fmt: skip


def server_args_record(sa: Any) -> dict[str, Any]:
    """Every ServerArgs field (`dataclasses.fields`) but `MAY_DIFFER` and secrets, as recorded: compared before setup
    and again at LOAD, each differing field named with its saved and live value."""
    return {f.name: _recordable(f.name, getattr(sa, f.name)) for f in dataclasses.fields(sa)
            if f.name not in MAY_DIFFER and not SECRET.search(f.name)}  # fmt: skip


def config_flags(sa: Any, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Flags known from the server arguments alone (compared before setup and again at LOAD)."""
    env = os.environ if environ is None else environ
    return {**server_args_record(sa), "custom_all_reduce_v2": env.get("SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2")}


def flags(pool: dict[str, Any] | None, model_runner: Any, inventory: Mapping[str, list[int]]) -> dict[str, Any]:
    """Every flag SAVE records and LOAD compares, once the memory pool and graph runners exist. The attention backends
    SGLang runs are the recorded flags' (ServerArgs.get_attention_backends; a draft worker is refused), and its
    token count is the memory pool's."""
    from sglang.srt import graphpersist_customar as customar

    return {
        **config_flags(model_runner.server_args),
        "decode_batch_sizes": list(inventory.get("decode", [])),
        "prefill_token_sizes": list(inventory.get("prefill", [])),
        "memory_pool": dict(pool or {}),
        "custom_all_reduce": customar.describe_live(),
        "torch_symm_mem": customar.torch_symm_mem_live(),
    }


def pool_record(config: Any) -> dict[str, Any]:
    """The MemoryPoolConfig SAVE used, every field by name (a dataclass of sizes), as the archive records it (LOAD
    rebuilds it)."""
    return dataclasses.asdict(config)
