"""vLLM's GPU worker with CUDA-graph persistence: each overridden method is one of the session's seams, in start-up
order (patches/vllm/README.md, "The worker's start", has the phases and why each is exact or variable)."""

from __future__ import annotations

import time
from typing import Any

from vllm import graphpersist_compiled as compiled
from vllm import graphpersist_facts as facts
from vllm.graphpersist_adapter import VllmAdapter
from vllm.v1.worker.gpu_worker import Worker

from graphpersist import engine
from graphpersist.engine import PersistError

# Address space (not memory) each variable phase owns, so a cold SAVE (compiling) and a warm one (loading compiled
# code) lay out everything after them identically. A run that needs more is refused at SAVE, naming the phase.
PROFILE_SPAN = 96 << 30
WARMUP_SPAN = 48 << 30


class PersistWorker(Worker):
    """vLLM's GPU worker with CUDA-graph persistence (mode save or load)."""

    _persist: engine.PersistSession | None = None

    @property
    def persist(self) -> engine.PersistSession:
        if self._persist is None:
            raise PersistError("graphpersist: PersistWorker runs without a persistence session (GRAPHPERSIST_MODE "
                               "is off in this process): start vLLM with --graph-persist save|load")  # fmt: skip
        return self._persist

    @engine.recording_refusals()  # its own refusals too, outside the session's steps
    def init_device(self) -> None:
        started = time.perf_counter()
        # before vLLM's compile redirects Inductor's and Triton's caches, and before distributed init
        self._persist = engine.PersistSession.begin(VllmAdapter(self))
        compiled.install(self.persist)  # LOAD builds the compiled model from SAVE's notes (refuses damaged ones)
        super().init_device()
        facts.refuse_unsupported_runner(self)
        self.persist.timed("init_device", started)

    def determine_available_memory(self) -> int:
        sess = self.persist
        started = time.perf_counter()
        with sess.phase("profile", exact=False, span=PROFILE_SPAN):
            available = sess.memory_budget(super().determine_available_memory)
            if sess.loading:  # loads the compiled model as SAVE's profile run compiled it
                parts = facts.compile_forward(self.model_runner)
                sess.timings.update({f"profile_{name}": seconds for name, seconds in parts.items()})
            engine.release_cached()
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
            sess.ready()
            return compiled
        finally:
            sess.finish()

    @engine.recording_refusals()  # its own refusals too, outside the session's steps
    def _capture_or_restore(self, upstream_capture: Any) -> int:
        sess = self.persist
        self._warm_up_before_graphs()
        engine.release_cached()  # inside the variable phase: what the warm-ups cached differs between SAVE and LOAD
        sess.end_phase()
        sess.timed("warmup", self._warmup_started)
        if not sess.adapter.inventory().modes:  # what vLLM's capture_model would capture (it skips an empty one)
            raise PersistError(
                "graphpersist: this configuration captures no CUDA graphs (enforce_eager or cudagraph_mode NONE): "
                "there is nothing to persist; turn persistence off"
            )
        return sess.graphs(upstream_capture) or 0  # LOAD captures nothing: no graph memory

    def _warm_up_before_graphs(self) -> None:
        """SAVE: vLLM's V2 runner compiles its sampler and input-preparation kernels (Triton, FlashInfer) in a
        warm-up after the capture, when the archive is already written. Running that warm-up once more here, in the
        variable phase before the capture, puts those kernels into the caches the archive carries, so a LOAD on a
        fresh host does not compile them. Upstream's own warm-up still runs after the capture (then from cache)."""
        if not self.persist.loading:
            self._kernel_warmup()

    def _kernel_warmup(self) -> None:
        """The V2 runner's own kernel warm-up, run by the session's `kernel_warmup` as SGLang's first requests are:
        synchronized, timed as KERNEL_WARMUP, the JIT cache files it added named in rank 0's stats."""
        from vllm.v1.worker.gpu.warmup import warmup_kernels

        def run() -> tuple[dict[str, Any], str]:
            warmup_kernels(self.model_runner, self.execute_model, self.sample_tokens)
            return {}, "vLLM's warmup_kernels"

        self.persist.kernel_warmup(run)
