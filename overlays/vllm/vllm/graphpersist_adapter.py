"""vLLM as the runtime's persistence session sees it: the answers only vLLM's worker can give (`VllmAdapter`).

The session (graphpersist.engine.PersistSession) owns the SAVE/LOAD lifecycle; this adapter answers its questions
from one GPU worker: the facts an archive records (`graphpersist_facts`), where the graphs live and how LOAD puts
them back (`graphpersist_capture`), custom all-reduce (`graphpersist_customar`), the cache folders
(`graphpersist_caches`) and the kernel parameter bytes vLLM's kernels never read.
"""

from __future__ import annotations

import re
from typing import Any

from vllm import graphpersist_caches as caches
from vllm import graphpersist_capture as capture
from vllm import graphpersist_customar as customar
from vllm import graphpersist_facts as facts
from vllm.logger import init_logger

from graphpersist import engine

# vllm-flash-attn's FA3 split-KV combine, `device_kernel<FlashAttnFwdCombine<...>>(Params)`: its Params open with
# `int batch_size`, a pointer, a shape of five int32 and a stride of int64 (vllm-project/flash-attention
# hopper/flash_fwd_combine_kernel.h; the block sits at buffer byte 0), so bytes 4-7 and 36-39 are alignment padding
# the launcher never sets. Pairs of TP=1 SAVEs on the reference host (2026-12-01) held 0 and 0x5003 there: first in
# bytes 4-7, and once those were zeroed in bytes 36-39, each time forming the in-region word 0x500300000001 with the
# int32 of value 1 before it.
_FA3_COMBINE = r"FlashAttnFwdCombine"
_FA3_COMBINE_PADDING = ((4, 8), (36, 40))
# FA3's forward kernel, `device_kernel<enable_sm90_or_later<FlashAttnFwdSm90<...>>>(Params)`: its Params block is
# 128-aligned, so it sits at byte 112 of the parameter buffer (EIATTR_KPARAM_INFO of every sm_90a instance in the
# pinned wheel's _vllm_fa3_C.abi3.so); buffer bytes 176-179 hold an int32 and 180-183 the padding after it. Two TP=1
# SAVEs on the reference host (2026-12-03) held 0 and 0x5038 there, forming the in-region word 0x503800000001 in one
# archive's pointer inventory only. No sm_90a instance's constant loads touch buffer bytes 180-183 (nvdisasm,
# 2026-12-03). Offsets here are buffer offsets, as SAVE's diff names them (until 2026-12-03 they were shifted by the
# block's 112, which zeroed bytes 292-295 that 540 of the 1146 instances read).
_FA3_FWD = r"FlashAttnFwdSm90"
_FA3_FWD_PADDING = ((180, 184),)


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
