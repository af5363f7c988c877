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
import os
import time
from typing import Any

import torch
from vllm import graphpersist_caches as caches
from vllm import graphpersist_capture as capture
from vllm import graphpersist_customar as customar
from vllm import graphpersist_diag as diag
from vllm import graphpersist_facts as facts
from vllm import graphpersist_session as gps
from vllm import graphpersist_startprofile as startprofile
from vllm.v1.worker.gpu_worker import Worker

from graphpersist import api, breakdown, rankstats, switch
from graphpersist.graph import kernelchoice
from graphpersist.memory import region

# Address space (not memory) each variable phase owns, so a cold SAVE (compiling) and a warm one (loading compiled
# code) lay out everything after them identically. A run that needs more is refused at SAVE, naming the phase.
PROFILE_SPAN = 96 << 30
WARMUP_SPAN = 48 << 30


def _pin_kernel_choices(sess: gps.Session) -> None:
    """Inductor's timed launch configs (graphpersist.graph.kernelchoice): SAVE records them in the rank's notes, LOAD
    launches the archive's."""
    saved = sess.saved_notes.get(kernelchoice.NOTES_KEY) if sess.loading else None
    sess.kernel_choices = kernelchoice.install(loading=sess.loading, saved=saved, log=lambda m: sess.log("%s", m))
    if not sess.loading:
        sess.notes[kernelchoice.NOTES_KEY] = sess.kernel_choices.used  # filled as kernels first launch


def _release_cached() -> None:
    """Drop torch's cached free blocks so the next phase allocates fresh, at its anchor, as in the other run."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


class PersistWorker(Worker):
    """vLLM's GPU worker with CUDA-graph persistence (mode save or load)."""

    _graphs_done: float | None = None

    def init_device(self) -> None:
        startprofile.start()  # diagnosis only (GP_DIAG_CPROFILE)
        resolved = switch.resolve()
        facts.refuse_unsupported(self.vllm_config)
        if not region.loaded():
            raise api.PersistError(
                "graphpersist: this worker runs without the runtime's interposer (LD_PRELOAD); start vLLM through "
                "an entry point that resolves --graph-persist (LLM, vllm serve) so worker processes inherit it"
            )
        assert resolved.directory is not None
        started = time.perf_counter()
        sess = gps.open_session(resolved.mode, resolved.directory, self.rank, self.parallel_config.world_size)
        sess.timings["process_start"] = rankstats.seconds_since_process_start()
        sess.model = facts.model_facts(self.vllm_config)
        caches.resolve(sess)  # before vLLM's compile redirects Inductor's and Triton's caches
        torch.cuda.set_device(facts.device_index(self))  # the region belongs to this rank's GPU
        info = api.start_region()
        diag.start_history()
        if sess.loading:
            facts.early_check(sess, self.vllm_config)
            caches.restore(sess)  # before anything compiles
            api.use_layout(sess.directory, rank=self.rank)
        _pin_kernel_choices(sess)
        sess.log("%s, region %#x + %d GiB", resolved.describe(), info.base, info.size >> 30)
        super().init_device()
        facts.refuse_unsupported_runner(self)
        sess.timed("init_device", started)

    def determine_available_memory(self) -> int:
        sess = _session()
        started = time.perf_counter()
        with api.phase("profile", exact=False, span=PROFILE_SPAN):
            if sess.loading:
                assert sess.kv_bytes is not None  # early_check read it
                available = sess.kv_bytes
                facts.check_free_memory(available)
                how = os.environ.get(facts.LOAD_PROFILE_ENV, facts.LOAD_PROFILES[0])
                parts = facts.compile_forward(self.model_runner, how)
                sess.timings.update({f"profile_{name}": seconds for name, seconds in parts.items()})
            else:
                available = super().determine_available_memory()
            _release_cached()
        if not sess.loading:
            available = facts.agree_kv_bytes(sess, available)
        sess.timed("profile", started)
        return available

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        started = time.perf_counter()
        with api.phase("kv_cache"):
            super().initialize_from_config(kv_cache_config)
        _session().timed("kv_cache", started)
        api.begin_phase("warmup", exact=False, span=WARMUP_SPAN)  # ends where the capture starts (capture_model below)
        self._warmup_started = time.perf_counter()
        upstream_capture = self.model_runner.capture_model
        self.model_runner.capture_model = lambda: self._capture_or_restore(upstream_capture)

    def compile_or_warm_up_model(self) -> Any:
        sess = _session()
        try:
            compiled = super().compile_or_warm_up_model()
            caches.report_late(sess)  # SAVE: what the warm-up after the capture compiled is not in the archive
            diag.dump_runner_state(self.model_runner, self.rank, saving=not sess.loading)
            return compiled
        finally:
            if self._graphs_done is not None:  # vLLM's own warm-up after the graphs (kernel warm-up, sampler)
                sess.timed("after_graphs", self._graphs_done)
            sess.write_stats()
            startprofile.stop(self.rank)

    def _capture_or_restore(self, upstream_capture: Any) -> int:
        sess = _session()
        if not sess.loading or diag.extra_warmup():
            self._warm_kernels_before_save()
        _release_cached()  # inside the variable phase: what the warm-ups cached differs between SAVE and LOAD
        api.end_phase()
        sess.timed("warmup", self._warmup_started)
        runner = self.model_runner
        manager = runner.cudagraph_manager
        if manager is None or not manager.needs_capture():
            raise api.PersistError(
                "graphpersist: this configuration captures no CUDA graphs (enforce_eager or cudagraph_mode NONE): "
                "there is nothing to persist; turn persistence off"
            )
        api.mark_setup(facts.setup_tensors(runner))
        started = time.perf_counter()
        if not sess.loading:
            graph_bytes = upstream_capture()
            sess.timed("capture", started)
            self._save()
        else:
            graph_bytes = 0
            self._restore(manager)
            sess.timed("restore", started)
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
        _session().timed("kernel_warmup_before_save", started)

    def _save(self) -> None:
        sess = _session()
        assert sess.saver is not None
        started = time.perf_counter()
        summary = sess.saver.save(
            sess.directory,
            engine=facts.engine_facts(),
            model=sess.model,
            rank=self.rank,
            parallel=facts.parallel(self.vllm_config),
            flags=facts.flags(self),
            overwrite=True,
            gather=facts.cpu_gather(),
            notes=sess.notes,
            shared=(lambda: caches.carry(sess)) if self.rank == 0 else None,  # the ranks share the host's caches
        )
        sess.done = True
        took = sess.timed("save", started)
        diag.dump_dots({n: e.graph.raw_cuda_graph() for n, e in sess.saver.entries.items()}, saving=True)
        sess.log(
            "saved %d graphs to %s in %.2f s (%s)", sess.captured, sess.directory, took, breakdown.of_save(summary)
        )

    def _restore(self, manager: Any) -> None:
        sess = _session()
        sizes, modes = capture.expected_inventory(manager)
        result = api.load(
            sess.directory,
            engine=facts.engine_facts(),
            model=sess.model,
            sizes=sizes,
            modes=modes,
            rank=self.rank,
            parallel=facts.parallel(self.vllm_config),
            flags=facts.flags(self),
            setup_tensors=facts.setup_tensors(self.model_runner),
            gather=facts.cpu_gather(),
        )
        sess.kept.append(result)
        diag.dump_dots({n: g.graph for n, g in result.graphs.items()}, saving=False)
        sess.restored = capture.install(manager, result, result.notes)
        customar.restore_registration(sess, result.notes)
        api.verify_state()
        sess.done = True
        sess.log("restored %d graphs from %s in %.2f s (%s)", sess.restored, sess.directory,
                 result.timings["total_s"], breakdown.of_load(result.timings))  # fmt: skip


def _session() -> gps.Session:
    sess = gps.current()
    assert sess is not None, "PersistWorker without a persistence session"
    return sess
