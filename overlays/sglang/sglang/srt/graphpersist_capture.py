"""The capture sites: SAVE keeps every graph SGLang captures; LOAD installs restored graphs where SGLang keeps them.

Decode graphs (`decode/<bs>`) come from `FullCudaGraphBackend`; prefill graphs, and decode graphs with DeepEP in
normal mode, are breakable (`<phase>/<size>/<segment>`): their segments and eager breaks are the runtime's
(graphpersist.engine.breakable), each break's function found by its id in SGLang's registry
(graphpersist_registry: an archive is data, never code). With persistence off every hook returns at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt import graphpersist_registry as registry

from graphpersist import engine
from graphpersist.engine import PersistError

new_graph = engine.new_graph  # the graph object a capture site records into (patch 0005)


@engine.recording_refusals()  # its own refusals too, outside the session's steps
def defer(phase: str, runner: Any, capture: Callable[[], None]) -> bool:
    """Called where a graph runner's __init__ would capture ("decode" or "prefill"; `capture` runs the capture as the
    __init__ does). With persistence on the capture waits until every runner has allocated its buffers
    (`graphpersist_engine.graphs`), so SAVE and LOAD run the same setup before `mark_setup`; returns False (capture
    now, as upstream) when persistence is off."""
    sess = engine.current()
    if sess is None:
        return False
    run = sess.adapter.run
    if phase in run.runners:
        raise PersistError(f"graphpersist: an unexpected graph runner {type(runner).__name__}: refused")
    if phase == "prefill" and runner.attn_metadata_buffers is not None:
        raise engine.Refused("graphpersist: this attention backend keeps captured prefill metadata per shape, which "
                             "cannot be restored: use --cuda-graph-backend-prefill disabled")  # fmt: skip
    run.runners[phase], run.captures[phase] = runner, capture
    return True


def _model(sess: Any) -> Any:
    return getattr(getattr(sess.adapter, "model_runner", None), "model", None)


@engine.while_saving
def captured_full(sess: engine.PersistSession, backend: Any, key: Any, graph: Any, out: Any) -> None:
    """SAVE: one decode graph was captured for `key`; its output is the structure the forward returned."""
    phase = sess.adapter.run.capturing
    if phase != "decode":
        raise PersistError(f"graphpersist: a full CUDA graph was captured outside the decode runner ({phase}): refused")
    name = f"decode/{key.size}"  # one graph a size: a second (a stream or variant) is refused as a duplicate name
    sess.add_graph(name, graph, [], out, size=key.size, mode="decode")
    sess.notes["decode"][name] = {"size": key.size}


@engine.while_saving
def captured_break(
    sess: engine.PersistSession, inner: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    """SAVE: the breakable capture ran `inner(*args, **kwargs)` eagerly between two segments (replayed so)."""
    instead = "serve without --moe-a2a-backend deepep" if sess.adapter.run.capturing == "decode" else (
        "use --cuda-graph-backend-prefill disabled")  # fmt: skip
    record = engine.breakable.record_break(
        inner, args, kwargs, output, model=_model(sess), functions=registry.breaks, types=registry.output_types,
        tensor_spec=engine.tensor_spec, instead=instead, owner="SGLang", where="sglang/srt/graphpersist_registry.py"
    )  # fmt: skip
    sess.adapter.run.breaks.append(record)


@engine.while_saving
def captured_breakable(sess: engine.PersistSession, backend: Any, key: Any, graph: Any, stored: Any) -> None:
    """SAVE: one breakable graph (segments and breaks) was captured for `key`; `stored` is what replay returns.
    Prefill graphs are breakable; decode graphs only with DeepEP in normal mode (graphpersist_facts refuses others)."""
    run = sess.adapter.run
    if run.capturing not in ("prefill", "decode"):
        raise PersistError(f"graphpersist: a breakable CUDA graph was captured outside the graph runners "
                           f"({run.capturing}): refused")  # fmt: skip
    breaks, run.breaks = run.breaks, []
    engine.breakable.add_breakable(sess, f"{run.capturing}/{key.size}", list(graph._segments), len(graph._break_fns),
                                   breaks, stored, size=key.size, mode=run.capturing)  # fmt: skip


def expected_inventory(runners: dict[str, Any]) -> engine.Inventory:
    """The capture sizes this live configuration would capture, per phase (what LOAD must find saved)."""
    out: dict[str, list[int]] = {}
    if runners.get("decode") is not None:
        out["decode"] = sorted(runners["decode"].capture_bs)
    if runners.get("prefill") is not None:
        out["prefill"] = sorted(runners["prefill"].capture_num_tokens)
    return engine.Inventory(sorted({n for values in out.values() for n in values}), sorted(out), out)


def install(runners: dict[str, Any], result: Any, notes: dict[str, Any], model: Any = None) -> int:
    """LOAD: puts every restored graph where SGLang's runners replay it; returns how many graphs were installed.

    Refuses (before any replay) when the saved inventory is not exactly what this configuration dispatches to.
    """
    from sglang.srt.model_executor.runner.shape_key import ShapeKey
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
        BreakableCUDAGraph,
        _copy_output,
    )

    live = expected_inventory(runners).by_mode
    for phase in ("decode", "prefill"):
        saved, want = set(notes.get(phase, {})), {f"{phase}/{n}" for n in live.get(phase, [])}
        if saved != want:
            raise engine.graphs_differ(phase, saved, want)
    found = {"model": model, "functions": registry.breaks, "types": registry.output_types,
             "tensor_at": engine.tensor_at}  # fmt: skip
    graphs: list[tuple[Any, Any, Any, list[Any]]] = []  # (backend, key, graph, its graphs in the archive)
    for phase in ("prefill", "decode"):  # every break function is rebuilt before anything is installed
        for base, rec in notes.get(phase, {}).items():
            if "segments" not in rec:
                graphs.append((runners[phase].backend, ShapeKey(size=int(rec["size"])), result[base], [result[base]]))
                continue
            bg = BreakableCUDAGraph(None)
            bg._segments, bg._break_fns = engine.breakable.rebuild(base, rec, result, copy_output=_copy_output, **found)
            graphs.append((runners[phase].backend, ShapeKey(size=int(rec["size"])), bg, bg._segments))
    for backend, key, graph, restored in graphs:
        backend._graphs[key] = graph
        backend._outputs[key] = restored[-1].outputs
    return sum(len(restored) for *_, restored in graphs)
