"""The scheduler (TP worker) process's side of CUDA-graph persistence: the seams the patches call, in start-up order,
each one of the session's steps (patches/sglang/README.md, "The scheduler's start", has the phases)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt import graphpersist_facts as facts
from sglang.srt.graphpersist_adapter import SglangAdapter, SglangRun

from graphpersist import engine
from graphpersist.engine import PersistError


def before_distributed(model_runner: Any) -> None:
    """First thing of `ModelRunner.init_torch_distributed`: with persistence off, nothing."""
    engine.PersistSession.begin(SglangAdapter(model_runner))


@engine.recording_refusals()  # its own refusals too, outside the session's steps
def memory_pool_config(configurator: Any, pre_model_load_memory: Any) -> Any:
    """Replaces `KVCacheConfigurator._resolve_memory_pool_config` in `configure`: upstream's with persistence off, and
    at SAVE (which sizes it by the session's budget: `pool_budget`); LOAD reuses SAVE's pool, never profiled."""
    sess = engine.current()
    if sess is None:
        return configurator._resolve_memory_pool_config(pre_model_load_memory)
    run = sess.adapter.run
    if facts.uses_deepep(sess.adapter.server_args):
        from sglang.srt import graphpersist_deepep as deepep

        run.deepep_buffer = deepep.setup_buffer(sess, configurator.model)  # before the pool is sized and placed
    sess.lap("setup")  # distributed init, the weights
    sess.begin_phase("kv_cache")
    if sess.loading:
        from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

        budget = sess.memory_budget(None)  # SAVE's, checked against this GPU's free memory
        config = MemoryPoolConfig(**run.pool)
        sess.log("memory pool from the archive: %d tokens (budget %.2f GiB, not profiled)",
                 config.max_total_num_tokens, budget / 2**30)  # fmt: skip
        return config
    config = configurator._resolve_memory_pool_config(pre_model_load_memory)
    if sess.budget_bytes is None:
        raise PersistError("graphpersist: SGLang sized the memory pool without the persistence seam in "
                           "_resolve_memory_pool_config (patch 0003): SAVE refused")  # fmt: skip
    run.pool = facts.pool_record(config)
    sess.log("memory pool: %d tokens (budget %.2f GiB, rounded down to 1 GiB)", config.max_total_num_tokens,
             sess.budget_bytes / 2**30)  # fmt: skip
    return config


def pool_budget(profile: Callable[[], int]) -> int:
    """`_resolve_memory_pool_config`'s profile: upstream's with persistence off; at SAVE the session's budget, the
    smallest rank's profile rounded down to 1 GiB (a cold and a warm SAVE then size the same pool)."""
    sess = engine.current()
    return profile() if sess is None else sess.memory_budget(lambda: int(profile()))


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


def _capture_all(run: SglangRun) -> None:
    """SAVE: every deferred capture, in upstream's order, as upstream's runner __init__ would have run it."""
    for phase in ("prefill", "decode"):  # upstream's order
        if phase in run.runners:
            run.capturing = phase
            try:
                run.captures[phase]()
            finally:
                run.capturing = None


@engine.recording_refusals()  # its own refusals too, outside the session's steps
def graphs(model_runner: Any) -> None:
    """In `capture_cuda_graphs`, after the graph runners exist: SAVE captures (and writes in `after_graphs`), LOAD
    restores. The attention backend's per-shape state (what the decode graphs read and the replay preparation
    writes) is prepared in setup; the session proves SAVE's captures left it so and LOAD's is SAVE's."""
    sess = engine.current()
    if sess is None:
        return
    run = sess.adapter.run
    if "decode" not in run.runners:
        raise engine.Refused("graphpersist: this configuration captures no decode CUDA graphs: there is nothing to "
                             "persist; turn persistence off")  # fmt: skip
    decode = run.runners["decode"]
    sess.lap("kv_cache")  # pool, attention backends, runners' buffers
    with sess.phase("warmup", exact=False, span=WARMUP_SPAN, timed="warmup"):
        _warm_forward(decode)
        engine.release_cached()
    with sess.phase("attn_shapes", timed="attn_shapes"):
        _prepare_attention_shapes(decode)
        engine.release_cached()  # so what the captures allocate never lands in a setup segment's free space
    prepared = engine.PreparedState(
        "attn_shapes", "the attention backend's per-shape state",
        lambda: engine.per_shape_tensors(decode.attn_backend, "attn_backend", decode.capture_bs),
        advice="use --attention-backend fa3",
    )  # fmt: skip
    sess.graphs(lambda: _capture_all(run), prepared=prepared)


@engine.recording_refusals()  # its own refusals too, outside the session's steps
def after_graphs(model_runner: Any) -> None:
    """End of `ModelRunner.init_cuda_graphs`, once SGLang holds its graph runners and a batch can run: SAVE writes the
    archive, running SGLang's first requests once its content is fixed (the adapter's `warm_kernels_before_save`);
    the start ends for the session."""
    sess = engine.current()
    if sess is None or sess.finished:  # graphs set up again after the start are upstream's own
        return
    try:
        if sess.saving and sess.step != "graphs":  # the session's graphs step never ran
            raise PersistError("graphpersist: SGLang set up its CUDA graphs without the persistence seam in "
                               "capture_cuda_graphs (patch 0004): SAVE refused")  # fmt: skip
        sess.ready()
    finally:
        sess.finish()
