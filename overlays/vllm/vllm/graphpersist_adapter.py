"""vLLM as the persistence session sees it: the answers only vLLM's worker can give (`VllmAdapter`), among them what
an archive must agree on (facts LOAD compares field by field; patches/vllm/README.md, "Facts and refusals")."""

from __future__ import annotations

import logging
import re
from typing import Any

from vllm import graphpersist_caches as caches
from vllm import graphpersist_capture as capture
from vllm import graphpersist_customar as customar
from vllm import graphpersist_facts as facts

from graphpersist import engine

# Parameter bytes FA3's launchers leave unset and its kernels never read, as buffer offsets (the evidence:
# patches/vllm/README.md, "Parameter bytes never read"): the split-KV combine's Params padding, and the forward
# kernel's padding after the int32 at byte 176 (its Params block sits at byte 112).
_FA3_COMBINE, _FA3_COMBINE_PADDING = r"FlashAttnFwdCombine", ((4, 8), (36, 40))
_FA3_FWD, _FA3_FWD_PADDING = r"FlashAttnFwdSm90", ((180, 184),)


class VllmAdapter(engine.EngineAdapter):
    """One vLLM GPU worker (`vllm.v1.worker.gpu_worker.Worker`), as the persistence session asks about it."""

    name = "vllm"
    note_sections = ("full", "pieces")
    logger = logging.getLogger("vllm.graphpersist")  # under vLLM's own logger, whose lines vLLM prints (serve too)
    entry_points = "LLM(...) or `vllm serve`"
    budget_what = "KV cache"
    budget_advice = "raise gpu_memory_utilization or lower max_model_len/max_num_seqs"
    pins_kernel_choices = True  # vLLM compiles the model with Inductor

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    @property
    def config(self) -> Any:
        return self.worker.vllm_config

    def refuse(self) -> None:
        facts.refuse_unsupported(self.config)

    def engine_facts(self) -> dict[str, str]:
        import vllm
        from vllm import _version

        return {"name": "vllm", "version": vllm.__version__, "commit": str(_version.__commit_id__ or "")}

    def model_facts(self) -> dict[str, str]:
        model = self.config.model_config
        return {"dtype": str(model.dtype), "config_fingerprint": model.compute_hash()}

    def parallel(self) -> dict[str, int]:
        par = self.config.parallel_config
        return {"world_size": par.world_size, "tp_size": par.tensor_parallel_size, "pp_size": 1, "ep_size": 1}

    def config_flags(self) -> dict[str, Any]:
        """Flags known from the configuration alone (compared before setup and again at LOAD): the settings users
        change, named one by one; `vllm_config_hash` (`flags`) covers the rest of vLLM's configuration."""
        cfg = self.config
        cache, sched = cfg.cache_config, cfg.scheduler_config
        return {
            "max_model_len": cfg.model_config.max_model_len,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "block_size": cache.block_size,
            "kv_cache_dtype": str(cache.cache_dtype),
            "quantization": cfg.model_config.quantization,
            "gpu_memory_utilization": float(cache.gpu_memory_utilization),
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
            "disable_custom_all_reduce": bool(cfg.parallel_config.disable_custom_all_reduce),
            "fuse_allreduce_rms": bool(cfg.compilation_config.pass_config.fuse_allreduce_rms),
            "seed": cfg.model_config.seed,
        }

    def flags(self, session: engine.SessionView) -> dict[str, Any]:
        """Every flag SAVE records and LOAD compares, after the KV cache and attention backends exist. The capture
        sizes are the session's own fact (`capture.sizes`, from `inventory`)."""
        cfg = self.config
        groups = self.worker.model_runner.attn_groups
        return {
            **self.config_flags(),
            "cudagraph_mode": cfg.compilation_config.cudagraph_mode.name,
            "attention_backends": sorted({g.backend.get_name() for group in groups for g in group}),
            "custom_all_reduce": customar.active() is not None,
            "vllm_config_hash": cfg.compute_hash(),
        }

    def rank(self) -> int:
        return int(self.worker.rank)

    def device_index(self) -> int:
        """The CUDA device this worker uses, as Worker.init_device computes it (single node, no data parallelism)."""
        from vllm.platforms import current_platform

        return int(current_platform.logical_device_id_to_visible_device_id(self.worker.local_rank))

    def cpu_gather(self) -> Any:
        """Rank agreement over the TP group's CPU (gloo) group, which in what persistence accepts is the whole world
        (`refuse_unsupported` refuses a world larger than tensor parallelism): nothing touches the GPU or NCCL."""
        from vllm.distributed.parallel_state import get_tp_group

        return engine.torch_gather(get_tp_group().cpu_group)

    def setup_tensors(self) -> dict[str, Any]:
        """The setup tensors the graphs read, by name: parameters, buffers and KV caches (LOAD proves their place)."""
        runner = self.worker.model_runner
        return {**engine.model_tensors(runner.model), **{f"kv_cache.{i}": t for i, t in enumerate(runner.kv_caches)}}

    def unused_param_bytes(self, kernel: str, layout: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Byte ranges [start, end) of `kernel`'s parameters it never reads, which SAVE writes as zeros so two SAVEs
        are byte-identical: the FA3 kernels' padding and the custom all-reduce's unused peer slots (offsets into the
        parameter buffer, as SAVE's diff names them)."""
        for pattern, padding in ((_FA3_COMBINE, _FA3_COMBINE_PADDING), (_FA3_FWD, _FA3_FWD_PADDING)):
            if re.search(pattern, kernel):
                return engine.bytes_in_param(layout, 0, padding)
        return customar.unused_param_bytes(kernel, layout)

    def inventory(self) -> engine.Inventory:
        return capture.expected_inventory(self.worker.model_runner.cudagraph_manager)

    def install(self, session: engine.SessionView, result: Any) -> int:
        return capture.install(self.worker.model_runner.cudagraph_manager, result, result.notes)

    def communicators(self) -> list[engine.Communicator]:
        return [customar.CustomAllReduce()]

    def cache_resolvers(self) -> dict[str, engine.Resolver]:
        return caches.resolvers()
