"""The capture sites: SAVE keeps every graph SGLang captures; LOAD installs restored graphs where SGLang keeps them.

SGLang 0.5.17 captures two inventories per TP worker (defaults on CUDA):
- decode graphs, one per batch size, by `FullCudaGraphBackend.capture_one` (`DecodeCudaGraphRunner`), kept in
  `backend._graphs[ShapeKey(bs)]` with the forward's output (a `LogitsProcessorOutput`) in `backend._outputs`;
- prefill graphs, one per token count, by `BreakableCudaGraphBackend.capture_one` (`PrefillCudaGraphRunner`): a
  `BreakableCUDAGraph` of several segment graphs with an eager "break" between two segments (attention, run in
  Python at replay against the live batch), kept the same way with the output rows of the shared output buffer.
With DeepEP in normal mode the decode graphs are breakable too (graphpersist_deepep): each MoE layer's dispatch,
experts and combine are a break.
Names are stable across processes: `decode/<bs>`, `decode/<bs>/<segment>` (breakable) and
`prefill/<tokens>/<segment>` (segments numbered from 0).
A break is persisted as a call record (graphpersist.graph.structure): the function it calls by its id in SGLang's
registry (graphpersist_registry: an archive is data, never code) and its arguments (tensors at their addresses,
modules of the model by their name in it, plain values), so LOAD rebuilds the same replay function from the live
registry alone; a break whose function is not registered or whose arguments cannot be recorded that way refuses the
SAVE, and LOAD refuses an id the live registry lacks. With persistence off every hook returns at once and the code
path is upstream's.
"""

from __future__ import annotations

import sys
from typing import Any

from sglang.srt import graphpersist_registry as registry

from graphpersist import engine
from graphpersist.engine import PersistError, structure

new_graph = engine.new_graph  # the graph object a capture site records into (patch 0005)


def defer(runner: Any) -> bool:
    """Called where a graph runner's __init__ would capture. With persistence on the capture waits until every
    runner has allocated its buffers (`graphpersist_engine.graphs`), so SAVE and LOAD run the same setup before
    `mark_setup`; returns False (capture now, as upstream) when persistence is off."""
    sess = engine.current()
    if sess is None:
        return False
    sess.adapter.run.deferred.append(runner)
    return True


def _tensor_leaf(x: Any) -> dict[str, Any] | None:
    """A tensor's spec (address, dtype, shape, strides), None for anything else (without torch, nothing is one)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    return engine.tensor_spec(x)


MODULE_KEY = "module"  # a leaf that is a module of the model: {"module": "<its name in model.named_modules()>"}


def _break_leaf(model: Any) -> Any:
    """The leaf function of a break's arguments: tensors by spec, and a module of `model` (a MoE layer whose method
    is the break: DeepEP's `a2a_forward_with_output`) by its name in the model, which LOAD's model has too."""
    names: dict[int, str] | None = None

    def leaf(x: Any) -> dict[str, Any] | None:
        nonlocal names
        spec = _tensor_leaf(x)
        if spec is not None or model is None:
            return spec
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.nn.Module):
            return None
        if names is None:
            names = {id(m): name for name, m in model.named_modules()}
        name = names.get(id(x))
        if name is None:
            raise structure.StructureError(f"the module {type(x).__name__} is not part of the model")
        return {MODULE_KEY: name}

    return leaf


def _model(sess: Any) -> Any:
    return getattr(getattr(sess.adapter, "model_runner", None), "model", None)


def _key_name(phase: str, key: Any) -> str:
    if key.stream_idx is not None or key.variant_label is not None:
        raise PersistError(
            f"graphpersist: {phase} graph {key} has a stream or variant (PD multiplexing, LoRA, chunked prefix): "
            "not persisted (refused)"
        )
    return f"{phase}/{key.size}"


def captured_full(backend: Any, key: Any, graph: Any, out: Any) -> None:
    """SAVE: one decode graph was captured for `key`; its output is the structure the forward returned."""
    sess = engine.current()
    if sess is None or not sess.saving:
        return
    phase = sess.adapter.run.capturing
    if phase != "decode":
        raise PersistError(f"graphpersist: a full CUDA graph was captured outside the decode runner ({phase}): refused")
    name = _key_name(phase, key)
    try:
        sess.add_graph(name, graph, [], out, size=key.size, mode="decode")
    except PersistError as exc:
        raise PersistError(f"graphpersist: {exc}") from None
    sess.notes["decode"][name] = {"size": key.size}


def captured_break(inner: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    """SAVE: the breakable capture ran `inner(*args, **kwargs)` eagerly between two segments (replayed so)."""
    sess = engine.current()
    if sess is None or not sess.saving:
        return
    instead = "serve without --moe-a2a-backend deepep" if sess.adapter.run.capturing == "decode" else (
        "use --cuda-graph-backend-prefill disabled")  # fmt: skip
    functions = registry.breaks()
    fn_id = structure.registered_id(inner, functions)
    if fn_id is None:
        name = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', type(inner).__qualname__)}"
        raise PersistError(
            f"graphpersist: the breakable CUDA graph breaks at {name}, which is not in SGLang's registry of break "
            f"functions ({', '.join(functions)}), so LOAD could not call it again: SAVE refused ({instead}, or add "
            "it to sglang/srt/graphpersist_registry.py and declare it in patches/sglang/hooks.toml)"
        )
    leaf = _break_leaf(_model(sess))
    try:
        record = structure.encode_call(
            inner, args, kwargs, output, leaf, f"break {fn_id}", functions, registry.output_types()
        )
    except structure.StructureError as exc:
        raise PersistError(f"graphpersist: {exc}: SAVE refused ({instead})") from None
    sess.adapter.run.breaks.append(record)


def captured_breakable(backend: Any, key: Any, graph: Any, stored: Any) -> None:
    """SAVE: one breakable graph (segments and breaks) was captured for `key`; `stored` is what replay returns.
    Prefill graphs are breakable; decode graphs only with DeepEP in normal mode (graphpersist_facts refuses others)."""
    sess = engine.current()
    if sess is None or not sess.saving:
        return
    run = sess.adapter.run
    phase = run.capturing
    if phase not in ("prefill", "decode"):
        raise PersistError(f"graphpersist: a breakable CUDA graph was captured outside the graph runners ({phase}): "
                           "refused")  # fmt: skip
    base = _key_name(phase, key)
    segments = list(graph._segments)
    breaks, run.breaks = run.breaks, []
    if len(breaks) != len(graph._break_fns) or len(segments) != len(breaks) + 1:
        raise PersistError(
            f"graphpersist: {base}: {len(segments)} segments, {len(graph._break_fns)} breaks, {len(breaks)} recorded: "
            "the breakable graph's structure is not what persistence expects: SAVE refused"
        )
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        try:
            sess.add_graph(f"{base}/{i:03d}", seg, [], stored if last else None, size=key.size, mode=phase)
        except PersistError as exc:
            raise PersistError(f"graphpersist: {exc}") from None
    sess.notes[phase][base] = {"size": key.size, "segments": len(segments), "breaks": breaks}


def expected_inventory(runners: dict[str, Any]) -> engine.Inventory:
    """The capture sizes this live configuration would capture, per phase (what LOAD must find saved)."""
    out: dict[str, list[int]] = {}
    if runners.get("decode") is not None:
        out["decode"] = sorted(runners["decode"].capture_bs)
    if runners.get("prefill") is not None:
        out["prefill"] = sorted(runners["prefill"].capture_num_tokens)
    return engine.Inventory(sorted({n for values in out.values() for n in values}), sorted(out), out)


def _viewer(model: Any) -> Any:
    """LOAD: a leaf spec back to its live object: a tensor at its address, or the model's module of that name (looked
    up among `model.named_modules()`: data of the live model, never an attribute walk by the archive's string)."""
    modules: dict[str, Any] | None = None

    def view(spec: dict[str, Any]) -> Any:
        nonlocal modules
        if MODULE_KEY not in spec:
            return engine.tensor_at(spec)
        if modules is None:
            modules = dict(model.named_modules()) if model is not None else {}
        found = modules.get(spec[MODULE_KEY])
        if found is None:
            raise structure.StructureError(f"the model has no module {structure.shown(repr(spec[MODULE_KEY]), 80)}")
        return found

    return view


def _break_fn(record: Any, where: str, view: Any, functions: registry.Registry, types: registry.Registry) -> Any:
    """LOAD: the replay function of one break, as the breakable capture built it (same function, same arguments),
    its function from SGLang's live registry (`functions`) by the saved id alone."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
        _copy_output,
    )

    try:
        inner, args, kwargs, output = structure.decode_call(record, view, where, functions, types)
    except structure.StructureError as exc:
        raise PersistError(f"graphpersist: {exc}") from None

    def replay_fn() -> Any:
        return _copy_output(output, inner(*args, **kwargs))

    return replay_fn


def install(runners: dict[str, Any], result: Any, notes: dict[str, Any], model: Any = None) -> int:
    """LOAD: puts every restored graph where SGLang's runners replay it; returns how many graphs were installed.

    Refuses (before any replay) when the saved inventory is not exactly what this configuration dispatches to.
    """
    from sglang.srt.model_executor.runner.shape_key import ShapeKey
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
        BreakableCUDAGraph,
    )

    decode, prefill = runners.get("decode"), runners.get("prefill")
    saved_decode, saved_prefill = notes.get("decode", {}), notes.get("prefill", {})
    live = {f"decode/{bs}" for bs in decode.capture_bs} if decode is not None else set()
    if set(saved_decode) != live:
        raise engine.graphs_differ("decode", set(saved_decode), live)
    live = {f"prefill/{n}" for n in prefill.capture_num_tokens} if prefill is not None else set()
    if set(saved_prefill) != live:
        raise engine.graphs_differ("prefill", set(saved_prefill), live)
    breakables = []
    found = (_viewer(model), registry.breaks(), registry.output_types())  # one of each for every break
    for runner, saved in ((prefill, saved_prefill), (decode, saved_decode)):
        for base, rec in saved.items():  # every break function is rebuilt before anything is installed
            if "segments" not in rec:
                continue
            bg = BreakableCUDAGraph(None)
            bg._segments = [result[f"{base}/{i:03d}"] for i in range(int(rec["segments"]))]
            bg._break_fns = [_break_fn(b, f"{base} break {i}", *found) for i, b in enumerate(rec["breaks"])]
            breakables.append((runner, ShapeKey(size=int(rec["size"])), bg))

    installed = 0
    for name, rec in saved_decode.items():
        if "segments" in rec:
            continue
        graph = result[name]
        key = ShapeKey(size=int(rec["size"]))
        decode.backend._graphs[key] = graph
        decode.backend._outputs[key] = graph.outputs
        installed += 1
    for runner, key, bg in breakables:
        runner.backend._graphs[key] = bg
        runner.backend._outputs[key] = bg._segments[-1].outputs
        runner.backend._capture_inputs[key] = None
        installed += len(bg._segments)
    return installed
