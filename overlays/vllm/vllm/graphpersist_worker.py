"""The GPU worker that persists (SAVE) or restores (LOAD) its CUDA graphs: vLLM's Worker plus the runtime's phases.

`vllm/graphpersist_switch.py` selects this class (`worker_cls`) only when persistence is on; with it off vLLM
uses its own Worker untouched. Every worker process (in-process at TP=1, a child of the engine core at TP>1) runs
under the runtime's interposer (LD_PRELOAD, exported by the switch before vLLM starts any process; a child is
spawned where its parent lacks it: `graphpersist_switch.start_method`) and starts its address region before
distributed init. Setup is divided into phases anchored at SAVE's offsets, so work whose allocations
vary between runs (torch.compile, the memory profile, warm-ups) cannot move the memory the graphs use:

| phase | what | kind |
|---|---|---|
| (setup) | NCCL and custom all-reduce buffers, model runner buffers, weights | exact |
| profile | SAVE: upstream's memory profile (compiles the model); LOAD: its profile run alone | variable, 96 GiB |
| kv_cache | attention backends, KV cache, block tables | exact |
| warmup | compile of other size ranges, kernel warm-up | variable, 48 GiB |
| capture / restore | SAVE captures then writes the archive; LOAD restores every graph, captures nothing | - |
| custom_all_reduce | graph buffers registered with the peers (TP>1) | post-capture |

The archive also carries the host's JIT and compile caches (`vllm/graphpersist_caches.py`): rank 0 packs them at
SAVE; every rank of a LOAD puts back what its host lacks in init_device, before anything compiles (timed as
`jitcache`, inside init_device).

Inductor's timed launch configs (`graphpersist.graph.kernelchoice`): SAVE makes one choice per kernel source and records
it in the rank's notes; LOAD launches the archive's choices instead of timing again.

SAVE sizes the KV cache by the smallest rank's profile rounded down to 1 GiB (so cold and warm SAVEs lay out the
same archive); LOAD never profiles: it reuses that budget, checked against the GPU's free memory.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from vllm import graphpersist_facts as facts
from vllm.graphpersist_adapter import VllmAdapter
from vllm.v1.worker.gpu_worker import Worker

from graphpersist import engine
from graphpersist.engine import PersistError

# Address space (not memory) each variable phase owns, so a cold SAVE (compiling) and a warm one (loading compiled
# code) lay out everything after them identically. A run that needs more is refused at SAVE, naming the phase.
PROFILE_SPAN = 96 << 30
WARMUP_SPAN = 48 << 30
WARM_AT_LOAD = "warm_kernels_at_load"  # session option (diagnosis): LOAD runs the kernel warm-up SAVE runs


def _release_cached() -> None:
    """Drop torch's cached free blocks so the next phase allocates fresh, at its anchor, as in the other run."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


class PersistWorker(Worker):
    """vLLM's GPU worker with CUDA-graph persistence (mode save or load)."""

    _graphs_done: float | None = None
    _persist: engine.PersistSession | None = None

    @property
    def persist(self) -> engine.PersistSession:
        assert self._persist is not None, "PersistWorker without a persistence session"
        return self._persist

    @property
    def adapter(self) -> VllmAdapter:
        adapter = self.persist.adapter
        assert isinstance(adapter, VllmAdapter)
        return adapter

    def init_device(self) -> None:
        started = time.perf_counter()
        resolved = engine.switch.resolve()
        facts.refuse_unsupported(self.vllm_config)
        if not engine.interposer_loaded():
            raise PersistError(
                "graphpersist: this worker runs without the runtime's interposer (LD_PRELOAD); start vLLM through "
                "an entry point that resolves --graph-persist (LLM, vllm serve) so worker processes inherit it"
            )
        adapter = VllmAdapter(self)
        sess = self._persist = engine.PersistSession.open(adapter, resolved, self.rank,
                                                          self.parallel_config.world_size)  # fmt: skip
        sess.start()  # before vLLM's compile redirects Inductor's and Triton's caches, and before distributed init
        sess.pin_kernel_choices()
        super().init_device()
        facts.refuse_unsupported_runner(self)
        sess.timed("init_device", started)

    def determine_available_memory(self) -> int:
        sess, adapter = self.persist, self.adapter
        started = time.perf_counter()
        with sess.phase("profile", exact=False, span=PROFILE_SPAN):
            if sess.loading:
                assert adapter.kv_bytes is not None  # read_saved read it
                available = adapter.kv_bytes
                facts.check_free_memory(available)
                how = sess.options.get(facts.LOAD_PROFILE_OPTION, facts.LOAD_PROFILES[0])
                parts = facts.compile_forward(self.model_runner, how)
                sess.timings.update({f"profile_{name}": seconds for name, seconds in parts.items()})
            else:
                available = super().determine_available_memory()
            _release_cached()
        if not sess.loading:
            available = adapter.kv_bytes = facts.agree_kv_bytes(sess.world_size, available)
        sess.timed("profile", started)
        return available

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        sess = self.persist
        with sess.phase("kv_cache", timed="kv_cache"):
            super().initialize_from_config(kv_cache_config)
        sess.begin_phase("warmup", exact=False, span=WARMUP_SPAN)  # ends where the capture starts (below)
        self._warmup_started = time.perf_counter()
        upstream_capture = self.model_runner.capture_model
        self.model_runner.capture_model = lambda: self._capture_or_restore(upstream_capture)

    def compile_or_warm_up_model(self) -> Any:
        sess = self.persist
        try:
            compiled = super().compile_or_warm_up_model()
            sess.report_late()  # SAVE: what the warm-up after the capture compiled is not in the archive
            sess.emit("ready", worker=self)
            return compiled
        finally:
            if self._graphs_done is not None:  # vLLM's own warm-up after the graphs (kernel warm-up, sampler)
                sess.timed("after_graphs", self._graphs_done)
            sess.write_stats()
            sess.emit("stopped", worker=self)

    def _capture_or_restore(self, upstream_capture: Any) -> int:
        sess = self.persist
        if not sess.loading or sess.options.get(WARM_AT_LOAD):
            self._warm_kernels_before_save()
        _release_cached()  # inside the variable phase: what the warm-ups cached differs between SAVE and LOAD
        sess.end_phase()
        sess.timed("warmup", self._warmup_started)
        manager = self.model_runner.cudagraph_manager
        if manager is None or not manager.needs_capture():
            raise PersistError(
                "graphpersist: this configuration captures no CUDA graphs (enforce_eager or cudagraph_mode NONE): "
                "there is nothing to persist; turn persistence off"
            )
        sess.mark_setup()
        started = time.perf_counter()
        if not sess.loading:
            graph_bytes = upstream_capture()
            sess.timed("capture", started)
            sess.save()  # VllmAdapter warms no kernels here: its kernel warm-up ran before the capture (above)
        else:
            graph_bytes = 0
            sess.restore()
        self._graphs_done = time.perf_counter()
        return graph_bytes

    def _warm_kernels_before_save(self) -> None:
        """SAVE: vLLM's V2 runner compiles its sampler and input-preparation kernels (Triton, FlashInfer) in a
        warm-up after the capture, when the archive is already written. Running that warm-up once more here, in the
        variable phase before the capture, puts those kernels into the caches the archive carries, so a LOAD on a
        fresh host does not compile them. Upstream's own warm-up still runs after the capture (then from cache)."""
        from vllm.v1.worker.gpu.warmup import warmup_kernels

        started = time.perf_counter()
        warmup_kernels(self.model_runner, self.execute_model, self.sample_tokens)
        torch.cuda.synchronize()
        self.persist.timed(engine.KERNEL_WARMUP, started)
