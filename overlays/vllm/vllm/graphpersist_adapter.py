"""vLLM as the persistence session sees it: the answers only vLLM's worker can give (`VllmAdapter`)."""

from __future__ import annotations

import re
from typing import Any

from vllm import graphpersist_caches as caches
from vllm import graphpersist_capture as capture
from vllm import graphpersist_customar as customar
from vllm import graphpersist_facts as facts
from vllm.logger import init_logger

from graphpersist import engine

# Parameter bytes FA3's launchers leave unset and its kernels never read, as buffer offsets (the evidence:
# patches/vllm/README.md, "Parameter bytes never read"): the split-KV combine's Params padding, and the forward
# kernel's padding after the int32 at byte 176 (its Params block sits at byte 112).
_FA3_COMBINE, _FA3_COMBINE_PADDING = r"FlashAttnFwdCombine", ((4, 8), (36, 40))
_FA3_FWD, _FA3_FWD_PADDING = r"FlashAttnFwdSm90", ((180, 184),)


def unused_param_bytes(kernel: str, layout: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of `kernel`'s parameters it never reads, which SAVE writes as zeros so two SAVEs are
    byte-identical: the custom all-reduce's unused peer slots and the FA3 kernels' padding (offsets into the
    parameter buffer, as SAVE's diff names them)."""
    for pattern, padding in ((_FA3_COMBINE, _FA3_COMBINE_PADDING), (_FA3_FWD, _FA3_FWD_PADDING)):
        if re.search(pattern, kernel):
            return engine.bytes_in_param(layout, 0, padding)
    return customar.unused_param_bytes(kernel, layout)


class VllmAdapter(engine.EngineAdapter):
    """One vLLM GPU worker (`vllm.v1.worker.gpu_worker.Worker`), as the persistence session asks about it."""

    name = "vllm"
    note_sections = ("full", "pieces")
    logger = init_logger("vllm.graphpersist")  # vLLM prints its own loggers' lines (vllm serve too)
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
        return facts.engine_facts()

    def model_facts(self) -> dict[str, str]:
        return facts.model_facts(self.config)

    def parallel(self) -> dict[str, int]:
        return facts.parallel(self.config)

    def config_flags(self) -> dict[str, Any]:
        return facts.config_flags(self.config)

    def flags(self, session: engine.SessionView) -> dict[str, Any]:
        return facts.flags(self.worker)

    def rank(self) -> int:
        return int(self.worker.rank)

    def device_index(self) -> int:
        return facts.device_index(self.worker)

    def cpu_gather(self) -> Any:
        return facts.cpu_gather()

    def setup_tensors(self) -> dict[str, Any]:
        return facts.setup_tensors(self.worker.model_runner)

    def unused_param_bytes(self, kernel: str, layout: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return unused_param_bytes(kernel, layout)

    def inventory(self) -> engine.Inventory:
        return capture.expected_inventory(self.worker.model_runner.cudagraph_manager)

    def install(self, session: engine.SessionView, result: Any) -> int:
        return capture.install(self.worker.model_runner.cudagraph_manager, result, result.notes)

    def communicators(self) -> list[engine.Communicator]:
        return [customar.CustomAllReduce()]

    def cache_resolvers(self) -> dict[str, engine.Resolver]:
        return caches.resolvers()
