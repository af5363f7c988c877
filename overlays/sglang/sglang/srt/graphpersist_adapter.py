"""SGLang as the persistence session sees it: the answers only SGLang's model runner can give (`SglangAdapter`), and
SGLang's own bookkeeping of the run (`SglangRun`)."""

from __future__ import annotations

import dataclasses
import getpass
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang.srt import graphpersist_capture as capture
from sglang.srt import graphpersist_customar as customar
from sglang.srt import graphpersist_facts as facts
from sglang.srt import graphpersist_registry as registry
from sglang.srt import graphpersist_warmup as warmup

from graphpersist import engine

# sgl-kernel 0.4.5's FA3 forward kernels, V head 128, bf16, not appending KV (b5 = AppendKV below, false): the buffer
# bytes none of them reads, in their one Params block at buffer byte 112 (patches/sglang/README.md, "Parameter bytes
# never read"; recipes/diagnosis/fa3-unread-params derives the list). SAVE writes them as zeros so two SAVEs are
# byte-identical.
_FA3_FWD_UNREAD = (
    (124, 128), (132, 136), (144, 168), (172, 184), (232, 240), (276, 280), (304, 488), (496, 500), (512, 520),
    (580, 624), (752, 880), (1008, 1136), (1264, 1920), (1924, 2000), (2028, 2032), (2056, 2064), (2088, 2096),
    (2104, 2160), (2176, 2192), (2200, 2232), (2236, 2244), (2280, 2288), (2304, 2328), (2376, 2400), (2416, 2424),
    (2464, 2488), (2532, 2544),
)  # fmt: skip
_FA3_FWD_V128_BF16 = re.compile(
    r"FlashAttnFwdSm90.*Li128ENS_10bfloat16_tEfNS_4arch4Sm90E(?:Lb[01]E){5}Lb0E(?:Lb[01]E){7}"
)
FA3_FWD = engine.UnreadBytes("FA3 forward kernel", _FA3_FWD_V128_BF16, 112, _FA3_FWD_UNREAD)


def _cute_dsl() -> Path:
    value = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    return Path(value) if value else Path(tempfile.gettempdir()) / getpass.getuser() / "flash_attention_cute_dsl_cache"


@dataclass
class SglangRun:
    """SGLang's own bookkeeping of one SAVE or LOAD, between the seams the patches call."""

    pool: dict[str, Any] | None = None  # the MemoryPoolConfig fields SAVE sized; LOAD reuses them
    runners: dict[str, Any] = field(default_factory=dict)  # the graph runners by phase ("decode", "prefill")
    captures: dict[str, Callable[[], None]] = field(default_factory=dict)  # SAVE runs them: each as its __init__ would
    capturing: str | None = None  # "decode" or "prefill" while SAVE runs that runner's capture
    breaks: list[dict[str, Any]] = field(default_factory=list)  # SAVE: breaks of the graph being captured
    deepep_buffer: Any = None  # DeepEP's Buffer, made in setup (graphpersist_deepep.setup_buffer)


@dataclass
class SglangAdapter(engine.EngineAdapter):
    """One SGLang scheduler process's `ModelRunner`, as the persistence session asks about it."""

    model_runner: Any
    run: SglangRun = field(default_factory=SglangRun)

    name = "sglang"
    note_sections = ("decode", "prefill")
    logger = logging.getLogger("sglang.srt.graphpersist")  # SGLang configures where its loggers' lines go
    entry_points = "sglang.Engine, launch_server or `sglang serve`"
    budget_what = "memory pool"
    budget_advice = "raise --mem-fraction-static or lower --context-length"
    writes_when_ready = True  # the kernel warm-up runs SGLang's first requests, through the installed graphs

    def refuse(self) -> None:
        facts.refuse_unsupported(self.server_args)  # speculative decoding too: no draft model runner reaches here
        facts.refuse_unsupported_model(self.model_runner)

    @property
    def server_args(self) -> Any:
        return self.model_runner.server_args

    def unused_param_bytes(self, kernel: str, layout: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return FA3_FWD(kernel, layout, self.logger)  # other kernels: none

    def cache_resolvers(self) -> dict[str, engine.Resolver]:
        """The JIT and compile cache folders an SGLang 0.5.17 scheduler reads, its own and those every engine shares
        (patches/sglang/README.md, "The caches an archive carries"; the session resolves them at start)."""
        shared = engine.cache_folders()
        return {
            "tvm_ffi": engine.env_folder("TVM_FFI_CACHE_DIR", lambda: Path.home() / ".cache" / "tvm-ffi"),
            "sglang": engine.env_folder("SGLANG_CACHE_DIR", lambda: Path.home() / ".cache" / "sglang"),
            **{name: shared[name] for name in ("flashinfer", "flashinfer_cubins", "triton", "inductor")},
            "cute_dsl": _cute_dsl,
        }

    def engine_facts(self) -> dict[str, str]:
        import sglang

        return {"name": "sglang", "version": str(getattr(sglang, "__version__", "")), "commit": ""}

    def model_facts(self) -> dict[str, str]:
        """dtype and a fingerprint of the model's configuration (architecture, sizes), known before the weights. The
        model's path is a recorded flag (`graphpersist_facts.server_args_record`), named plainly when it differs."""
        config = self.model_runner.model_config
        hf = getattr(config, "hf_config", None)
        described = hf.to_json_string(use_diff=False) if hf is not None and hasattr(hf, "to_json_string") else repr(hf)
        fingerprint = hashlib.sha256(json.dumps({"hf": described, "context_len": config.context_len}).encode())
        return {"dtype": str(config.dtype), "config_fingerprint": fingerprint.hexdigest()}

    def cpu_gather(self) -> Any:
        """Rank agreement over the TP group's CPU (gloo) group, which in what persistence accepts is the whole world
        (no pipeline or data parallelism: `parallel` says world_size = tp_size): nothing touches the GPU or NCCL."""
        from sglang.srt.distributed import get_tp_group

        return engine.torch_gather(get_tp_group().cpu_group)

    def parallel(self) -> dict[str, int]:
        sa = self.server_args
        ep = int(getattr(sa, "ep_size", 1)) if facts.uses_deepep(sa) else 1
        return {"world_size": sa.tp_size, "tp_size": sa.tp_size, "pp_size": 1, "ep_size": ep}

    def config_flags(self) -> dict[str, Any]:
        return facts.config_flags(self.server_args)

    def flags(self, session: engine.SessionView) -> dict[str, Any]:
        return facts.flags(self.run.pool, self.model_runner, self.inventory().by_mode)

    def rank(self) -> int:
        return int(self.model_runner.ps.tp_rank)

    def device_index(self) -> int:
        return int(self.model_runner.gpu_id)

    def setup_tensors(self) -> dict[str, Any]:
        """The setup tensors the graphs read, by name: parameters, buffers and the KV pool (LOAD proves their place)."""
        named = engine.model_tensors(self.model_runner.model)
        pool = self.model_runner.token_to_kv_pool
        for kind in ("k_buffer", "v_buffer"):
            named.update({f"kv_pool.{kind}.{i}": t for i, t in enumerate(getattr(pool, kind, None) or [])})
        return named

    def read_saved(self, session: engine.SessionView) -> None:
        """The memory pool SAVE sized (every MemoryPoolConfig field, flags.memory_pool), which LOAD reuses; an archive
        without one is refused."""
        from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

        value = session.saved_flags.get("memory_pool")
        if not isinstance(value, dict) or set(value) != {f.name for f in dataclasses.fields(MemoryPoolConfig)}:
            raise engine.PersistError(
                f"graphpersist: {session.directory} records no memory-pool size (flags.memory_pool = {value!r}). "
                "Re-run with mode=save."
            )
        self.run.pool = value

    def inventory(self) -> engine.Inventory:
        return capture.expected_inventory(self.run.runners)

    def output_types(self) -> engine.breakable.Registry:
        return registry.output_types

    def install(self, session: engine.SessionView, result: Any) -> int:
        return capture.install(self.run.runners, result, result.notes, self.model_runner.model)

    def communicators(self) -> list[engine.Communicator]:
        found: list[engine.Communicator] = [customar.CustomAllReduceV2()]
        if facts.uses_deepep(self.server_args):
            from sglang.srt import graphpersist_deepep as deepep

            found.append(deepep.noted(self.run.deepep_buffer))
        return found

    def warm_kernels_before_save(self, session: engine.SessionView) -> None:
        """SAVE, every rank, once the archive's content is fixed and before rank 0 packs the JIT caches: SGLang's
        first requests (`graphpersist_warmup`), so the kernels SGLang compiles only when it serves travel in the
        archive and a LOAD on a fresh host compiles none of them (the session names the cache files they added)."""
        session.kernel_warmup(lambda: warmup.run(self.model_runner, self.run.runners, session.log).summary())
