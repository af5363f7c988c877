"""The scheduler (TP worker) process's side of CUDA-graph persistence: the seams the patches call, in start-up order,
each one of the session's steps (patches/sglang/README.md, "The scheduler's start", has the phases)."""

from __future__ import annotations

import time
from typing import Any

from sglang.srt import graphpersist_facts as facts
from sglang.srt.graphpersist_adapter import SglangAdapter, SglangRun

from graphpersist import engine
from graphpersist.engine import PersistError


def _adapter(sess: engine.PersistSession) -> SglangAdapter:
    adapter = sess.adapter
    assert isinstance(adapter, SglangAdapter)
    return adapter


def before_distributed(model_runner: Any) -> None:
    """First thing of `ModelRunner.init_torch_distributed`: with persistence off, nothing."""
    sess = engine.PersistSession.begin(SglangAdapter(model_runner))
    if sess is not None:
        _adapter(sess).run.setup_started = time.perf_counter()


@engine.recording_refusals()  # its own refusals too, outside the session's steps
def memory_pool_config(configurator: Any, pre_model_load_memory: Any) -> Any:
    """Replaces `KVCacheConfigurator._resolve_memory_pool_config` in `configure`: upstream's with persistence off."""
    sess = engine.current()
    if sess is None:
        return configurator._resolve_memory_pool_config(pre_model_load_memory)
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    adapter = _adapter(sess)
    run = adapter.run
    if facts.uses_deepep(adapter.server_args):
        from sglang.srt import graphpersist_deepep as deepep

        run.deepep_buffer = deepep.setup_buffer(sess, configurator.model)  # before the pool is sized and placed
    sess.timed("setup", run.setup_started)
    run.kv_started = time.perf_counter()
    sess.begin_phase("kv_cache")
    if sess.loading:
        budget = sess.memory_budget(None)  # SAVE's, checked against this GPU's free memory
        config = MemoryPoolConfig(**run.pool)
        sess.log("memory pool from the archive: %d tokens (budget %.2f GiB, not profiled)",
                 config.max_total_num_tokens, budget / 2**30)  # fmt: skip
        return config
    # KVCacheConfigurator has __slots__: its profile is wrapped on the class, for this one call (one thread).
    cls = type(configurator)
    profiled = cls._profile_available_bytes
    calls: list[int] = []

    def budgeted(self: Any, pre: Any) -> int:
        calls.append(sess.memory_budget(lambda: int(profiled(self, pre))))
        return calls[-1]

    cls._profile_available_bytes = budgeted
    try:
        config = configurator._resolve_memory_pool_config(pre_model_load_memory)
    finally:
        cls._profile_available_bytes = profiled
    if len(calls) != 1:
        raise PersistError(f"graphpersist: SGLang profiled the memory pool {len(calls)} times (once expected): the "
                           "sizing changed upstream; SAVE refused")  # fmt: skip
    run.pool = facts.pool_record(config)
    sess.log("memory pool: %d tokens (budget %.2f GiB, rounded down to 1 GiB)", config.max_total_num_tokens,
             calls[0] / 2**30)  # fmt: skip
    return config


def _runners(run: SglangRun) -> dict[str, Any]:
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    found: dict[str, Any] = {}
    for runner in run.deferred:
        phase = "decode" if isinstance(runner, DecodeCudaGraphRunner) else None
        phase = "prefill" if isinstance(runner, PrefillCudaGraphRunner) else phase
        if phase is None or phase in found:
            raise PersistError(f"graphpersist: an unexpected graph runner {type(runner).__name__}: refused")
        found[phase] = runner
    prefill = found.get("prefill")
    if prefill is not None and prefill.attn_metadata_buffers is not None:
        raise engine.Refused("graphpersist: this attention backend keeps captured prefill metadata per shape, which "
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


def _capture(run: SglangRun, phase: str, runner: Any) -> None:
    """SAVE: the capture upstream's runner __init__ would have run, as it runs it."""
    run.capturing = phase
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
        run.capturing = None


@engine.recording_refusals()  # its own refusals too, outside the session's steps
def graphs(model_runner: Any) -> None:
    """In `capture_cuda_graphs`, after the graph runners exist: SAVE captures (and writes in `after_graphs`), LOAD
    restores."""
    sess = engine.current()
    if sess is None:
        return
    run = _adapter(sess).run
    runners = _runners(run)
    if "decode" not in runners:
        raise engine.Refused("graphpersist: this configuration captures no decode CUDA graphs: there is nothing to "
                             "persist; turn persistence off")  # fmt: skip
    sess.timed("kv_cache", run.kv_started)  # pool, attention backends, runners' buffers
    with sess.phase("warmup", exact=False, span=WARMUP_SPAN, timed="warmup"):
        _warm_forward(runners["decode"])
        engine.release_cached()
    with sess.phase("attn_shapes", timed="attn_shapes"):
        _prepare_attention_shapes(runners["decode"])
        engine.release_cached()  # so what the captures allocate never lands in a setup segment's free space
    prepared = _attention_state(runners["decode"])
    run.runners = runners
    sess.graphs(lambda: _capture_all(sess, run, prepared), check=lambda notes: _same_attention_state(prepared, notes))


def _capture_all(sess: engine.PersistSession, run: SglangRun, prepared: dict[str, list[Any]]) -> None:
    """SAVE: every deferred capture, in upstream's order; the attention state they read must not have moved."""
    for phase in ("prefill", "decode"):  # upstream's order
        if phase in run.runners:
            _capture(run, phase, run.runners[phase])
    after = _attention_state(run.runners["decode"])
    if changed := _differences(prepared, after):
        raise PersistError(
            f"graphpersist: the attention backend's per-shape state changed during the capture ({changed[0]}: "
            f"prepared {prepared.get(changed[0])}, captured {after.get(changed[0])}; {len(changed)} in all), so "
            "LOAD could not prepare it exactly: SAVE refused (use --attention-backend fa3)"
        )
    sess.notes["attn_shapes"] = prepared


def _same_attention_state(prepared: dict[str, list[Any]], notes: dict[str, Any]) -> None:
    """LOAD, before anything is installed: the attention state prepared here is SAVE's."""
    saved_state = notes.get("attn_shapes", {})
    if changed := _differences(prepared, saved_state):
        raise PersistError(
            f"graphpersist: the attention backend's per-shape state differs from SAVE's ({changed[0]}: saved "
            f"{saved_state.get(changed[0])}, live {prepared.get(changed[0])}; {len(changed)} in all): LOAD "
            "refused. Re-run with mode=save for this configuration."
        )


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The paths whose attention state differs between `a` and `b` (present in one only, or not equal)."""
    return sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))


@engine.recording_refusals()  # its own refusals too, outside the session's steps
def after_graphs(model_runner: Any) -> None:
    """End of `ModelRunner.init_cuda_graphs`, once SGLang holds its graph runners and a batch can run: SAVE writes the
    archive, running SGLang's first requests once its content is fixed (the adapter's `warm_kernels_before_save`);
    the start ends for the session."""
    sess = engine.current()
    if sess is None or sess.finished:  # graphs set up again after the start are upstream's own
        return
    try:
        if sess.saving and not _adapter(sess).run.runners:
            raise PersistError("graphpersist: SGLang set up its CUDA graphs without the persistence seam in "
                               "capture_cuda_graphs (patch 0004): SAVE refused")  # fmt: skip
        sess.ready()
    finally:
        sess.finish()
