"""The capture sites: SAVE keeps every graph vLLM captures; LOAD installs restored graphs where vLLM keeps them
(patches/vllm/README.md, "The capture sites", has the names and where each graph lives)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphpersist import engine
from graphpersist.engine import PersistError

new_graph = engine.new_graph  # the graph object a capture site records into (patch 0002)


def full_name(desc: Any) -> str:
    return f"full/{desc.num_tokens}/{desc.num_reqs}/{desc.uniform_token_count}"


def piece_name(batch_descriptor: Any, piece: int) -> str:
    return f"piecewise/{batch_descriptor.num_tokens}/{piece:03d}"


def piece_index(wrapper: Any) -> int:
    index = getattr(wrapper.runnable, "piecewise_compile_index", None)
    if not isinstance(index, int):
        raise PersistError(
            f"graphpersist: a piecewise CUDA graph wraps {type(wrapper.runnable).__name__}, which has no "
            "piecewise_compile_index: only torch.compile's piecewise backend can be persisted (refused)"
        )
    return index


@engine.while_saving
def captured_full(sess: engine.PersistSession, manager: Any, desc: Any, graph: Any) -> None:
    """SAVE: a FULL graph was captured; its output is the manager's hidden_states buffer (pipeline parallelism and
    speculative decoding, which capture other outputs, are refused at start-up)."""
    name = full_name(desc)
    fields = dataclasses.asdict(desc)
    fields["cg_mode"] = desc.cg_mode.name
    sess.notes["full"][name] = fields
    sess.add_graph(name, graph, [], manager.hidden_states, size=desc.num_tokens, mode="full")


@engine.while_saving
def captured_piece(sess: engine.PersistSession, wrapper: Any, entry: Any, args: tuple[Any, ...], output: Any) -> None:
    """SAVE: one piece of a PIECEWISE forward was captured for `entry.batch_descriptor`."""
    name = piece_name(entry.batch_descriptor, piece_index(wrapper))
    sess.notes["pieces"][name] = dataclasses.asdict(entry.batch_descriptor)
    inputs = [x for x in args if isinstance(x, torch.Tensor)]
    sess.add_graph(name, entry.cudagraph, inputs, output, size=entry.batch_descriptor.num_tokens, mode="piecewise")


def expected_inventory(manager: Any) -> engine.Inventory:
    """The capture sizes and modes this live configuration would capture (what LOAD must find saved)."""
    sizes = sorted({d.num_tokens for descs in manager._capture_descs.values() for d in descs})
    modes = sorted({m.name.lower() for m in manager._capture_descs})
    return engine.Inventory(sizes, modes)


def install(manager: Any, result: Any, notes: dict[str, Any]) -> int:
    """LOAD: puts every restored graph where vLLM's dispatch looks for it; returns how many were installed.

    Refuses (before any replay) when the saved inventory is not exactly what this configuration dispatches to:
    a FULL descriptor vLLM would capture but the archive lacks, or the reverse, or a piece without a wrapper.
    """
    from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    installed = 0
    live_full = {full_name(d): d for d in manager._capture_descs.get(CUDAGraphMode.FULL, [])}
    saved_full = notes.get("full", {})
    if set(live_full) != set(saved_full):
        raise engine.graphs_differ("FULL", saved_full, live_full)
    for name, fields in saved_full.items():
        desc = BatchExecutionDescriptor(**{**fields, "cg_mode": CUDAGraphMode[fields["cg_mode"]]})
        if desc != live_full[name]:
            raise PersistError(f"graphpersist: FULL graph {name}: saved descriptor {desc}, live "
                                   f"{live_full[name]}. Re-run with mode=save for this configuration.")  # fmt: skip
        graph = result[name]
        manager.graphs[desc] = graph
        manager.hidden_states = graph.outputs
        installed += 1

    wrappers = {piece_index(w): w for w in CUDAGraphWrapper._all_instances}  # every one is a piece (V2 runner)
    live_piece_sizes = {d.num_tokens for d in manager._capture_descs.get(CUDAGraphMode.PIECEWISE, [])}
    saved_pieces = notes.get("pieces", {})
    expected = {piece_name(BatchDescriptor(num_tokens=n), i) for n in live_piece_sizes for i in wrappers}
    if set(saved_pieces) != expected:
        raise engine.graphs_differ(f"piecewise ({len(wrappers)} live pieces x {len(live_piece_sizes)} sizes)",
                                   saved_pieces, expected)  # fmt: skip
    for name, fields in saved_pieces.items():
        bd = BatchDescriptor(**fields)
        graph = result[name]
        wrapper = wrappers[int(name.rsplit("/", 1)[1])]
        wrapper.concrete_cudagraph_entries[bd] = CUDAGraphEntry(batch_descriptor=bd, cudagraph=graph,
                                                                output=graph.outputs)  # fmt: skip
        installed += 1
    manager._graphs_captured = True
    return installed
