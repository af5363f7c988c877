"""The diagnosis wiring of a vLLM worker's persistence session: `install()` wraps the product's session steps.

Nothing in the product calls it: a diagnosis run puts `tools/gpdiag/site` on PYTHONPATH (the driver does, whenever a
`GP_DIAG_*` switch is set), whose `sitecustomize` calls `install()` in every Python process. It wraps, from outside
(the names are gpdiag's own contract, `tools/gpdiag/contract.toml`, checked by `make check`):

| product step | what runs |
|---|---|
| `PersistSession.begin` | cProfile starts (`GP_DIAG_CPROFILE`); the allocation history begins (`GP_DIAG_HISTORY`) |
| (a vLLM worker's begin) | `GP_DIAG_EXTRA_WARMUP=1`, `GP_DIAG_LOAD_PROFILE=full|small`: LOAD's work before graphs |
| (the same) | `GP_DIAG_PIECES=count|record|reuse`: the compiled model's load, piece by piece (`vllm_pieces`) |
| `memory.region.restore` | LOAD mapped memory afresh: listed, optionally filled (`restored_fill`) |
| `PersistSession._save` / `_restore` | the graphs as DOT (`GP_DIAG_DOT`) |
| `PersistSession.ready` | runner-state fingerprints, SAVE's bytes, KV blocks (`GP_DIAG_DUMP` ...) |
| `PersistSession.finish` | the cProfile and the compiled pieces' numbers (`GP_DIAG_PIECES`) are written |
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from gpdiag import restored_fill, startprofile, vllm_pieces

EXTRA_WARMUP_ENV = "GP_DIAG_EXTRA_WARMUP"
LOAD_PROFILE_ENV = "GP_DIAG_LOAD_PROFILE"
LOAD_PROFILES = ("lean", "full", "small")  # lean is the product's own LOAD forward


def _after(owner: Any, name: str, then: Callable[..., None]) -> None:
    """Wraps `owner.name` so that `then(self, result)` runs after it (once per process)."""
    original = getattr(owner, name)
    if getattr(original, "_gpdiag", False):
        return

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        then(self, result)
        return result

    wrapped._gpdiag = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def install() -> None:
    """Wraps the product's session steps (see the module's docstring); idempotent."""
    from graphpersist.engine import session as session_mod
    from graphpersist.memory import region

    cls = session_mod.PersistSession
    if getattr(cls.begin, "_gpdiag", False):
        return
    begin = cls.begin.__func__  # type: ignore[attr-defined]

    def begun(owner: Any, adapter: Any) -> Any:
        startprofile.start()
        sess = begin(owner, adapter)
        if sess is not None:
            from gpdiag import vllm_state

            vllm_state.start_history()
            if sess.adapter.name == "vllm":
                _wire_worker(type(sess.adapter.worker))
        return sess

    begun._gpdiag = True  # type: ignore[attr-defined]
    cls.begin = classmethod(begun)  # type: ignore[method-assign, assignment]
    restore = region.restore

    def restored(to_map: Any, *args: Any, **kwargs: Any) -> Any:
        result = restore(to_map, *args, **kwargs)
        restored_fill.fill(list(to_map))
        return result

    region.restore = restored
    _after(cls, "_save", lambda s, _: _dots({n: e.graph.raw_cuda_graph() for n, e in s.saver.entries.items()}, True))
    _after(cls, "_restore", lambda s, result: _dots({n: g.graph for n, g in result.graphs.items()}, False))
    _after(cls, "ready", _dump_state)
    finish = cls.finish

    def finished(self: Any) -> None:
        startprofile.stop(self.rank)
        vllm_pieces.report(self.rank, self.log)
        finish(self)

    cls.finish = finished  # type: ignore[method-assign]


def _dots(graphs: dict[str, Any], saving: bool) -> None:
    from gpdiag import vllm_state

    vllm_state.dump_dots(graphs, saving=saving)


def _dump_state(sess: Any, _: Any) -> None:
    if sess.adapter.name == "vllm":
        from gpdiag import vllm_state

        vllm_state.dump_runner_state(sess.adapter.worker.model_runner, sess.rank, saving=not sess.loading)


def _wire_worker(worker_cls: Any) -> None:
    """GP_DIAG_EXTRA_WARMUP=1: LOAD runs SAVE's kernel warm-up before the graphs too. GP_DIAG_LOAD_PROFILE: LOAD's
    profile phase runs upstream's whole profile run (`full`) or a one-token forward without the sampler (`small`)
    instead of the product's `lean` forward. GP_DIAG_PIECES: vLLM's compile calls are timed, and recorded or reused
    (`vllm_pieces`)."""
    pieces = vllm_pieces.mode()
    if pieces is not None:
        vllm_pieces.install(pieces)
    if os.environ.get(EXTRA_WARMUP_ENV) == "1":
        _after(worker_cls, "_warm_up_before_graphs", lambda w, _: w._kernel_warmup() if w.persist.loading else None)
    how = os.environ.get(LOAD_PROFILE_ENV, "lean")
    if how not in LOAD_PROFILES:
        raise ValueError(f"{LOAD_PROFILE_ENV}={how!r}: use one of {', '.join(LOAD_PROFILES)}")
    if how != "lean":
        from vllm import graphpersist_facts

        graphpersist_facts.compile_forward = functools.partial(profile_forward, how)


def profile_forward(how: str, runner: Any) -> dict[str, float]:
    """LOAD's profile phase as GP_DIAG_LOAD_PROFILE says: `full` (upstream's profile run) or `small` (one token, no
    sampler); the same parts as the product's forward (`compile` is what vLLM's compile monitor counted)."""
    import time

    import torch

    comp = runner.vllm_config.compilation_config
    compiled_before = float(comp.compilation_time)
    started = time.perf_counter()
    if how == "small":
        runner._dummy_run(1, skip_attn=True, is_profile=True)
    else:
        runner.profile_run()
    torch.cuda.synchronize()
    compile_s = float(comp.compilation_time) - compiled_before
    return {"compile": round(compile_s, 4), "sampler": 0.0,
            "forward": round(time.perf_counter() - started - compile_s, 4)}  # fmt: skip
