"""Runs once in the vLLM CPU venv before the snippets of test_engine_vllm_persist_cpu.py (see warm_python.py).

It imports what the snippets use, so no snippet pays for importing vLLM, and holds what several snippets share:
real vLLM configs for a tiny model, vLLM's own graph manager and wrappers, the few CPU stand-ins they need, and
objects that record or refuse how the persistence hooks treat them. Not a test module: it needs the venv's vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
from vllm import graphpersist_capture as capture
from vllm import graphpersist_customar as customar
from vllm import graphpersist_facts as facts
from vllm import graphpersist_switch as gswitch
from vllm.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import BatchDescriptor
from vllm.graphpersist_adapter import VllmAdapter
from vllm.platforms import current_platform
from vllm.v1.worker.gpu import cudagraph_utils
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, ModelCudaGraphManager

from graphpersist import engine, run, switch
from graphpersist.archive import ArchiveWriter
from graphpersist.archive.liveenv import collect_live, merge, world_facts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from archive_fixtures import world, write_rank

# Imported for the snippets only (this module does not use them itself).
__all__ = [
    "BatchDescriptor",
    "BatchExecutionDescriptor",
    "CUDAGraphEntry",
    "capture",
    "customar",
    "facts",
    "gswitch",
    "json",
]

MODEL = os.environ["GP_TEST_MODEL"]  # a folder with the tiny Llama's config.json (no weights)
CAPTURE_SIZES = [1, 2, 4, 8]


def engine_config(graphs: bool = True, **engine_args: Any) -> VllmConfig:
    """The tiny model's VllmConfig, resolved by vLLM itself on this CPU host.

    vLLM's CPU platform turns CUDA graphs off (cudagraph_mode NONE, no capture sizes); `graphs` puts back what
    the CUDA platform keeps by default: FULL_AND_PIECEWISE over CAPTURE_SIZES.
    """
    cfg = EngineArgs(model=MODEL, max_num_seqs=8, **engine_args).create_engine_config()
    if graphs:
        comp = cfg.compilation_config
        comp.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        comp.cudagraph_capture_sizes = list(CAPTURE_SIZES)
        comp.max_cudagraph_capture_size = max(CAPTURE_SIZES)
    return cfg


def _cpu_graph_pool() -> None:
    """CPU stand-in: vLLM's graph managers and wrappers take the platform's CUDA graph pool, which CPU has none of
    (the CPU platform's handle factory is None); they only store it."""
    type(current_platform)._global_graph_pool = ("cpu stand-in for a CUDA graph pool",)


def graph_manager(cfg: VllmConfig) -> ModelCudaGraphManager:
    """vLLM's own FULL-graph manager for `cfg`: its `_capture_descs` are the graphs vLLM would capture.

    CPU stand-ins: the graph pool, and the pipeline group (none exists without torch.distributed; one stage is
    first and last)."""
    _cpu_graph_pool()
    cudagraph_utils.get_pp_group = lambda: types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    return ModelCudaGraphManager(cfg, torch.device("cpu"), cfg.compilation_config.cudagraph_mode, decode_query_len=1)


def piece_wrappers(cfg: VllmConfig, count: int) -> list[CUDAGraphWrapper]:
    """vLLM's PIECEWISE wrappers for `count` pieces of the split model. The runnable stands in for torch.compile's
    PiecewiseBackend, of which persistence reads only `piecewise_compile_index`."""
    _cpu_graph_pool()
    runnables = [types.SimpleNamespace(piecewise_compile_index=i) for i in range(count)]
    return [CUDAGraphWrapper(r, cfg, CUDAGraphMode.PIECEWISE) for r in runnables]


def adapter(cfg: VllmConfig | None = None) -> VllmAdapter:
    """vLLM's adapter over a stand-in worker that holds `cfg` (default: the tiny model's): what the configuration alone
    answers (facts, refusals, flags known before setup)."""
    return VllmAdapter(types.SimpleNamespace(vllm_config=cfg if cfg is not None else engine_config()))


def open_session(
    mode: str,
    directory: str | Path = "/nonexistent-archive",
    saver: Any = None,
    cfg: VllmConfig | None = None,
    world_size: int = 1,
) -> engine.PersistSession:
    """The worker's session (rank 0), opened as PersistWorker opens it, over a stand-in worker that holds `cfg`
    (default: the tiny model's); `saver` replaces the real Saver."""
    resolved = switch.Switch(switch.Mode(mode), Path(directory), "test", "test")
    sess = engine.PersistSession.open(adapter(cfg), resolved, rank=0, world_size=world_size)
    if saver is not None:
        sess.saver = saver
    return sess


class Untouchable:
    """An argument a hook must not look at: any attribute access raises, naming the argument."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattribute__(self, attr: str) -> Any:
        raise AssertionError(f"the hook touched {object.__getattribute__(self, '_name')}.{attr}")


class Recorder:
    """Records every attribute access and call, in order; each attribute is a method that returns None."""

    def __init__(self) -> None:
        object.__setattr__(self, "calls", [])

    def __getattribute__(self, attr: str) -> Any:
        calls = object.__getattribute__(self, "calls")
        if attr == "calls":
            return calls
        calls.append(f"get {attr}")
        return lambda *args, **kwargs: calls.append(f"call {attr} {list(args)} {kwargs}")


class FakeGraph:
    """A captured graph as the capture sites hand it over; SAVE instantiates it before keeping it."""

    def __init__(self) -> None:
        self.instantiated = 0

    def instantiate(self) -> None:
        self.instantiated += 1


class RecordingSaver:
    """Stands in for graphpersist.api.Saver: records what the capture sites add."""

    def __init__(self) -> None:
        self.added: list[dict[str, Any]] = []

    def add(self, name: str, graph: Any, inputs: list[Any], outputs: Any, **kwargs: Any) -> None:
        self.added.append({"name": name, "graph": graph, "inputs": inputs, "outputs": outputs, **kwargs})


def record_save(manager: ModelCudaGraphManager, wrappers: list[CUDAGraphWrapper]) -> tuple[dict, RecordingSaver]:
    """What SAVE's capture sites record for `manager`'s inventory: the patched CudaGraphManager.capture reports
    each FULL descriptor (captured_full), the patched CUDAGraphWrapper.__call__ each piece at each PIECEWISE size
    (captured_piece). Returns the session's notes as the archive stores them (JSON) and the saver."""
    saver = RecordingSaver()
    sess = open_session("save", saver=saver)
    manager.hidden_states = torch.zeros(max(CAPTURE_SIZES), 4)
    for desc in manager._capture_descs.get(CUDAGraphMode.FULL, []):
        capture.captured_full(manager, desc, FakeGraph())
    for desc in manager._capture_descs.get(CUDAGraphMode.PIECEWISE, []):
        for wrapper in wrappers:
            entry = CUDAGraphEntry(batch_descriptor=BatchDescriptor(num_tokens=desc.num_tokens), cudagraph=FakeGraph())
            capture.captured_piece(wrapper, entry, (torch.zeros(desc.num_tokens), 7), torch.ones(desc.num_tokens))
    notes = json.loads(json.dumps(sess.notes))
    run.fresh()  # SAVE's process ends here; LOAD is another process with its own session
    return notes, saver


def write_vllm_archive(
    root: Path,
    cfg: VllmConfig,
    flags: dict[str, Any],
    shared: dict[str, bytes] | None = None,
    notes: dict[str, Any] | None = None,
) -> None:
    """An archive whose world is what SAVE of `cfg` records on this host: collect_live with vLLM's facts
    as the worker passes them, over the fixture's world for what a CPU host cannot know (CUDA runtime, NCCL).
    The ranks' payload is the fixture's stand-in (tests/cpu/archive_fixtures.py); rank 0 saved on the fake
    nvidia-smi's GPU 0; `notes`: every rank's engine notes, as SAVE stores them."""
    vllm = adapter(cfg)
    live = collect_live(device=0, engine=vllm.engine_facts(), model=vllm.model_facts(), parallel=vllm.parallel(),
                        flags=flags)  # fmt: skip
    saved = merge(world(), world_facts(live))
    saved["flags"] = flags
    with ArchiveWriter(root, saved) as writer:
        writer.add_shared(shared or {})  # what SAVE shares between ranks (the JIT caches)
        for rank in range(cfg.parallel_config.world_size):
            write_rank(writer, rank, extra=None if notes is None else {"engine_notes": notes})
        writer.commit()
