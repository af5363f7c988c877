"""The scheduler (TP worker) process's side of CUDA-graph persistence: the seams the patches call, in start-up order.

SGLang starts one scheduler process per TP rank with `spawn`; each inherits the runtime's interposer through
`LD_PRELOAD`, which the switch exports before SGLang launches them (`graphpersist_switch`). The seams:

* `ModelRunner.init_torch_distributed`, first (`before_distributed`): refusals, the session, the address region;
  LOAD also checks the facts known this early, puts the JIT caches back and anchors the phases at SAVE's offsets.
* (setup, exact): NCCL, the custom all-reduce workspace, the weights, at the same addresses in SAVE and LOAD.
* `KVCacheConfigurator.configure`, sizing (`memory_pool_config`): the exact phase `kv_cache` begins; SAVE rounds the
  profile down to 1 GiB and records the pool; LOAD reuses it, checked against free memory, never profiled.
* the graph runners' `__init__`, capture (`graphpersist_capture.defer`): deferred, in SAVE and LOAD.
* `capture_cuda_graphs`, after the runners (`graphs`): the variable phase `warmup` runs one eager decode forward
  (so state a layer creates on its first forward exists in setup); the exact phase `attn_shapes` prepares the attention
  backend's per-shape capture metadata; `mark_setup`; SAVE runs the deferred captures and custom all-reduce's
  registration (post-capture phase `custom_all_reduce`); LOAD runs `api.load`, installs the graphs in the runners,
  re-runs the registration and verifies the state.
* the end of `ModelRunner.init_cuda_graphs` (`after_graphs`), once SGLang holds its graph runners and a batch can
  run: SAVE writes the archive, running SGLang's first requests (`graphpersist_warmup`) after the archive's content
  is fixed and before rank 0 packs the JIT caches, so the kernels they compile travel with it; LOAD does nothing.

Everything up to `mark_setup` is exact: LOAD's allocations must land at SAVE's addresses, event by event. The
captures are deferred until every runner has allocated its buffers (upstream captures prefill graphs before the
decode runner allocates), so SAVE and LOAD run the same setup. Per-rank timings and counts go to
`GRAPHPERSIST_STATS_DIR` (`graphpersist_session.write_stats`).
"""

from __future__ import annotations

import time
from typing import Any

from sglang.srt import graphpersist_caches as caches
from sglang.srt import graphpersist_capture as capture
from sglang.srt import graphpersist_customar as customar
from sglang.srt import graphpersist_facts as facts
from sglang.srt import graphpersist_session as gps
from sglang.srt import graphpersist_warmup as warmup

from graphpersist import breakdown, rankstats, switch
from graphpersist.errors import PersistError


def before_distributed(model_runner: Any) -> None:
    """First thing of `ModelRunner.init_torch_distributed`: with persistence off, nothing."""
    resolved = switch.resolve()
    if not resolved.enabled:
        return
    import torch

    from graphpersist import api
    from graphpersist.memory import region

    started = time.perf_counter()
    sa = model_runner.server_args
    facts.refuse_unsupported(sa)
    if model_runner.is_draft_worker:
        raise facts.Refused("graphpersist: a draft model cannot be persisted: serve without speculative decoding")
    facts.refuse_unsupported_model(model_runner)
    if not region.loaded():
        raise PersistError(
            "graphpersist: this scheduler process runs without the runtime's interposer (LD_PRELOAD); start SGLang "
            "through an entry point that resolves --graph-persist (sglang.Engine, launch_server, sglang serve) so "
            "its processes inherit it, or under `python -m graphpersist exec`"
        )
    assert resolved.directory is not None
    ps = model_runner.ps
    sess = gps.open_session(resolved.mode, resolved.directory, ps.tp_rank, ps.tp_size)
    sess.timings["process_start"] = rankstats.seconds_since_process_start()
    sess.model = facts.model_facts(sa, model_runner.model_config)
    caches.resolve(sess)
    torch.cuda.set_device(model_runner.gpu_id)  # the region belongs to this rank's GPU
    info = api.start_region()
    if sess.loading:
        facts.early_check(sess, sa)
        caches.restore(sess)  # before anything compiles
        api.use_layout(sess.directory, rank=sess.rank)
    sess.log("%s, region %#x + %d GiB", resolved.describe(), info.base, info.size >> 30)
    sess.timed("start", started)
    sess.setup_started = time.perf_counter()


def memory_pool_config(configurator: Any, pre_model_load_memory: Any) -> Any:
    """Replaces `KVCacheConfigurator._resolve_memory_pool_config` in `configure`: upstream's with persistence off."""
    sess = gps.current()
    if sess is None:
        return configurator._resolve_memory_pool_config(pre_model_load_memory)
    import torch
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    from graphpersist import api

    sess.timed("setup", sess.setup_started)
    sess.kv_started = time.perf_counter()
    api.begin_phase("kv_cache")
    if sess.loading:
        assert sess.pool is not None  # early_check read it
        free, total = torch.cuda.mem_get_info()
        facts.check_free_memory(int(sess.pool["budget_bytes"]), free, total)
        config = MemoryPoolConfig(**sess.pool["config"])
        sess.log("memory pool from the archive: %d tokens (budget %.2f GiB, not profiled)",
                 config.max_total_num_tokens, sess.pool["budget_bytes"] / 2**30)  # fmt: skip
        return config
    # KVCacheConfigurator has __slots__: its profile is wrapped on the class, for this one call (one thread).
    cls = type(configurator)
    profiled = cls._profile_available_bytes
    budget: list[int] = []

    def rounded(self: Any, pre: Any) -> int:
        budget.append(facts.pool_budget(int(profiled(self, pre))))
        return budget[-1]

    cls._profile_available_bytes = rounded
    try:
        config = configurator._resolve_memory_pool_config(pre_model_load_memory)
    finally:
        cls._profile_available_bytes = profiled
    if len(budget) != 1:
        raise PersistError(f"graphpersist: SGLang profiled the memory pool {len(budget)} times (once expected): the "
                           "sizing changed upstream; SAVE refused")  # fmt: skip
    sess.pool = facts.pool_record(config, budget[0])
    sess.log("memory pool: %d tokens (budget %.2f GiB, rounded down to 1 GiB)", config.max_total_num_tokens,
             budget[0] / 2**30)  # fmt: skip
    return config


def _runners(sess: gps.Session) -> dict[str, Any]:
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    found: dict[str, Any] = {}
    for runner in sess.deferred:
        phase = "decode" if isinstance(runner, DecodeCudaGraphRunner) else None
        phase = "prefill" if isinstance(runner, PrefillCudaGraphRunner) else phase
        if phase is None or phase in found:
            raise PersistError(f"graphpersist: an unexpected graph runner {type(runner).__name__}: refused")
        found[phase] = runner
    prefill = found.get("prefill")
    if prefill is not None and prefill.attn_metadata_buffers is not None:
        raise facts.Refused("graphpersist: this attention backend keeps captured prefill metadata per shape, which "
                            "cannot be restored: use --cuda-graph-backend-prefill disabled")  # fmt: skip
    return found


def _attention_state(runner: Any) -> dict[str, list[Any]]:
    """The CUDA tensors of the attention backend's per-shape state (entries keyed by a captured batch size), by
    path: what the decode graphs read and the replay preparation writes, so SAVE and LOAD must hold the same."""
    import torch

    sizes = set(runner.capture_bs)
    found: dict[str, list[Any]] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, depth: int, per_shape: bool) -> None:
        if isinstance(obj, torch.Tensor):
            if per_shape and obj.is_cuda:
                found[path] = [obj.data_ptr(), str(obj.dtype), list(obj.shape), list(obj.stride())]
            return
        if depth > 4 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                if isinstance(k, (str, int)):
                    walk(v, f"{path}[{k!r}]", depth + 1, per_shape or (isinstance(k, int) and k in sizes))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]", depth + 1, per_shape)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            for k, v in vars(obj).items():
                walk(v, f"{path}.{k}", depth + 1, per_shape)

    walk(runner.attn_backend, "attn_backend", 0, False)
    return found


def _prepare_attention_shapes(runner: Any) -> None:
    """The capture-time attention metadata of every decode shape (what `capture_one_shape` prepares before each
    capture), made in setup so SAVE and LOAD own it at the same addresses."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    runner.buffers.seq_lens.fill_(runner.seq_len_fill_value)  # as DecodeCudaGraphRunner.capture() before capturing
    runner.buffers.seq_lens_cpu.fill_(runner.seq_len_fill_value)
    runner.buffers.reset_index_buffers()
    for bs in reversed(runner.capture_bs):
        num_tokens = bs * runner.captured_req_width
        forward_batch, attn_backend, _ = runner.capture_prepare(bs, stream_idx=None, num_tokens=num_tokens)
        with forward_context(ForwardContext(attn_backend=attn_backend)):
            attn_backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)


# Address space (not memory) the variable warm-up phase owns, so the exact phases after it start at the same offset
# whatever the warm-up allocated (a cold SAVE compiles, a warm LOAD does not).
WARMUP_SPAN = 32 << 30


def _warm_forward(runner: Any) -> None:
    """One eager decode forward at the largest decode batch, before `mark_setup`, in SAVE and LOAD alike: whatever a
    layer or kernel creates on its first forward (lazily allocated state, JIT modules) then exists in setup, where
    LOAD makes it again, instead of in SAVE's capture warm-ups, after which LOAD would find it only as empty memory.
    Upstream runs the same dummy forward (with the decode runner's buffers) for its FlashInfer autotune."""
    import torch

    runner._dummy_run(batch_size=runner.max_bs, buffers=runner.buffers)
    torch.cuda.synchronize()


def _release_cached(torch: Any) -> None:
    """Drop torch's cached free blocks, inside the exact phase (SAVE and LOAD alike)."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _capture(sess: gps.Session, phase: str, runner: Any) -> None:
    """SAVE: the capture upstream's runner __init__ would have run, as it runs it."""
    sess.capturing = phase
    try:
        if phase == "decode":
            from sglang.srt.model_executor.runner_backend_utils import CUDA_GRAPH_CAPTURE_FAILED_MSG
            from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

            try:
                with model_capture_mode():
                    runner.capture()
            except RuntimeError as e:
                raise Exception(f"Capture cuda graph failed: {e}\n{CUDA_GRAPH_CAPTURE_FAILED_MSG}") from e
        else:
            runner.capture()
    finally:
        sess.capturing = None


def graphs(model_runner: Any) -> None:
    """In `capture_cuda_graphs`, after the graph runners exist: SAVE captures (and writes in `after_graphs`), LOAD
    restores."""
    sess = gps.current()
    if sess is None:
        return
    import torch

    from graphpersist import api

    runners = _runners(sess)
    if "decode" not in runners:
        raise facts.Refused("graphpersist: this configuration captures no decode CUDA graphs: there is nothing to "
                            "persist; turn persistence off")  # fmt: skip
    sess.timed("kv_cache", sess.kv_started)  # pool, attention backends, runners' buffers
    started = time.perf_counter()
    with api.phase("warmup", exact=False, span=WARMUP_SPAN):
        _warm_forward(runners["decode"])
        _release_cached(torch)
    sess.timed("warmup", started)
    started = time.perf_counter()
    with api.phase("attn_shapes"):
        _prepare_attention_shapes(runners["decode"])
        _release_cached(torch)  # so what the captures allocate never lands in a setup segment's free space
    prepared = _attention_state(runners["decode"])
    api.mark_setup(facts.setup_tensors(model_runner))
    sess.timed("attn_shapes", started)
    sess.runners = runners
    if sess.loading:
        _restore(sess, model_runner, runners, capture.expected_inventory(runners), prepared)
        sess.write_stats()
    else:
        _capture_all(sess, runners, prepared)  # the archive is written by after_graphs, once a batch can run


def _capture_all(sess: gps.Session, runners: dict[str, Any], prepared: dict[str, list[Any]]) -> None:
    """SAVE: every deferred capture, in upstream's order, then custom all-reduce's registration."""
    assert sess.saver is not None
    started = time.perf_counter()
    for phase in ("prefill", "decode"):  # upstream's order
        if phase in runners:
            _capture(sess, phase, runners[phase])
    customar.register_after_capture(sess)
    after = _attention_state(runners["decode"])
    changed = sorted(p for p in set(prepared) | set(after) if prepared.get(p) != after.get(p))
    if changed:
        raise PersistError(
            f"graphpersist: the attention backend's per-shape state changed during the capture ({changed[0]}: "
            f"prepared {prepared.get(changed[0])}, captured {after.get(changed[0])}; {len(changed)} in all), so "
            "LOAD could not prepare it exactly: SAVE refused (use --attention-backend fa3)"
        )
    sess.notes["attn_shapes"] = prepared
    sess.timed("capture", started)


def after_graphs(model_runner: Any) -> None:
    """End of `ModelRunner.init_cuda_graphs`: SAVE writes the archive (LOAD restored in `graphs`, nothing to do)."""
    sess = gps.current()
    if sess is None or not sess.saving:
        return
    if not sess.runners:
        raise PersistError("graphpersist: SGLang set up its CUDA graphs without the persistence seam in "
                           "capture_cuda_graphs (patch 0004): SAVE refused")  # fmt: skip
    _save(sess, model_runner)
    sess.write_stats()


KERNEL_WARMUP = "kernel_warmup_before_save"  # the per-rank stats phase, as vLLM's worker names it
FILES_LISTED = 500  # at most this many of the JIT cache files the warm-up added are named in rank 0's stats


def _save(sess: gps.Session, mr: Any) -> None:
    assert sess.saver is not None
    started = time.perf_counter()
    summary = sess.saver.save(
        sess.directory,
        engine=facts.engine_facts(),
        model=sess.model,
        rank=sess.rank,
        parallel=facts.parallel(mr.server_args),
        flags=facts.flags(sess, mr, capture.expected_inventory(sess.runners)),
        overwrite=True,
        gather=facts.cpu_gather(),
        notes=sess.notes,
        shared=(lambda: caches.carry(sess)) if sess.rank == 0 else None,  # the ranks share the host's caches
        before_write=lambda: _warm_kernels_before_save(sess, mr),
    )
    sess.done = True
    took = time.perf_counter() - started
    sess.timings["save"] = round(took - sess.timings.get(KERNEL_WARMUP, 0.0), 4)
    sess.log("saved %d graphs to %s in %.2f s (kernel warm-up %.2f s; %s)", sess.captured, sess.directory, took,
             sess.timings.get(KERNEL_WARMUP, 0.0), breakdown.of_save(summary))  # fmt: skip


def _warm_kernels_before_save(sess: gps.Session, mr: Any) -> None:
    """SAVE, every rank, once the archive's content is fixed and before rank 0 packs the JIT caches: SGLang's first
    requests (`graphpersist_warmup`), so the kernels SGLang compiles only when it serves travel in the archive and a
    LOAD on a fresh host compiles none of them. Rank 0 names the cache files they added (none on a warm host)."""
    import torch

    from graphpersist.archive import jitcache

    started = time.perf_counter()
    before = jitcache.listing(sess.caches) if sess.rank == 0 else set()
    outcome = warmup.run(mr, sess.runners, sess.log)
    torch.cuda.synchronize()
    added = sorted(jitcache.listing(sess.caches) - before) if sess.rank == 0 else []
    took = sess.timed(KERNEL_WARMUP, started)
    sess.kernel_warmup = {
        "batches": outcome.batches,
        "left_out": outcome.left_out,
        "graph_forwards": outcome.graph_forwards,
        "eager_forwards": outcome.eager_forwards,
        "new_cache_files": len(added) if sess.rank == 0 else None,
        "files": added[:FILES_LISTED],
    }
    sess.log("kernel warm-up before save: %d batches (%d graph replays, %d eager forwards) in %.2f s%s",
             len(outcome.batches), outcome.graph_forwards, outcome.eager_forwards, took,
             f"; {len(added)} new JIT cache file(s), e.g. {', '.join(added[:3])}" if added else "")  # fmt: skip


def _restore(sess: gps.Session, mr: Any, runners: dict[str, Any], inventory: dict[str, list[int]],
             prepared: dict[str, list[Any]]) -> None:  # fmt: skip
    from graphpersist import api

    started = time.perf_counter()
    sizes = sorted({n for values in inventory.values() for n in values})
    result = api.load(
        sess.directory,
        engine=facts.engine_facts(),
        model=sess.model,
        sizes=sizes,
        modes=sorted(inventory),
        rank=sess.rank,
        parallel=facts.parallel(mr.server_args),
        flags=facts.flags(sess, mr, inventory),
        setup_tensors=facts.setup_tensors(mr),
        gather=facts.cpu_gather(),
    )
    sess.kept.append(result)
    saved_state = result.notes.get("attn_shapes", {})
    changed = sorted(p for p in set(prepared) | set(saved_state) if prepared.get(p) != saved_state.get(p))
    if changed:
        raise PersistError(
            f"graphpersist: the attention backend's per-shape state differs from SAVE's ({changed[0]}: saved "
            f"{saved_state.get(changed[0])}, live {prepared.get(changed[0])}; {len(changed)} in all): LOAD refused. "
            "Re-run with mode=save for this configuration."
        )
    sess.restored = capture.install(runners, result, result.notes)
    customar.restore_registration(sess, result.notes)
    api.verify_state()
    sess.done = True
    took = sess.timed("restore", started)
    sess.log(
        "restored %d graphs from %s in %.2f s (%s)",
        sess.restored,
        sess.directory,
        took,
        breakdown.of_load(result.timings),
    )
