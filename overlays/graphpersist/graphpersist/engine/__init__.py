"""The engine interface: everything an engine's glue may use of the runtime, in one import.

An engine integrates by implementing an `EngineAdapter` (its facts, graphs, communicators, caches) and calling a
`PersistSession` at its seams (graphpersist.engine.session says which, in start-up order). Glue code imports
`graphpersist.engine` and nothing else of the runtime (`make check` holds it to that), so the runtime's modules
can move without touching any engine.

Cheap at import (no torch, no CUDA): the engines import their glue while they parse arguments, persistence off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphpersist import switch
from graphpersist.archive.notedsections import COMPILED_MODEL
from graphpersist.archive.notedsections import read_models as read_noted_models
from graphpersist.engine import breakable, warmup
from graphpersist.engine.adapter import (
    Communicator,
    EngineAdapter,
    Inventory,
    Resolver,
    SessionView,
    UnreadBytes,
    bytes_in_param,
    graphs_differ,
)
from graphpersist.engine.caches import env_folder
from graphpersist.engine.checks import NotedFacts, check_noted, opted_in
from graphpersist.engine.prepared import PreparedState, per_shape_tensors
from graphpersist.engine.putback import put_back
from graphpersist.engine.refusal import RefusedInEngine, refusal_or
from graphpersist.engine.refusal import recorded as refusal_recorded
from graphpersist.engine.refusal import recording as recording_refusals
from graphpersist.engine.session import (
    KERNEL_WARMUP,
    PersistSession,
    current,
    interposer_loaded,
    release_cached,
    while_saving,
)
from graphpersist.engine.start import add_switch_group, resolve_switch
from graphpersist.engine.startmethod import start_context  # the start method of an engine's processes
from graphpersist.errors import PersistError
from graphpersist.graph import structure
from graphpersist.memory.region import MULTICAST_OFF

if TYPE_CHECKING:
    from multiprocessing.context import SpawnContext

__all__ = [
    "COMPILED_MODEL",
    "KERNEL_WARMUP",
    "MULTICAST_OFF",
    "Communicator",
    "EngineAdapter",
    "Inventory",
    "NotedFacts",
    "PersistError",
    "PersistSession",
    "PreparedState",
    "Refused",
    "RefusedInEngine",
    "Resolver",
    "SessionView",
    "UnreadBytes",
    "add_switch_group",
    "breakable",
    "bytes_in_param",
    "cache_folders",
    "check_noted",
    "current",
    "env_folder",
    "graphs_differ",
    "interposer_loaded",
    "model_tensors",
    "new_graph",
    "open_peers",
    "opted_in",
    "per_shape_tensors",
    "put_back",
    "read_noted_models",
    "recording_refusals",
    "refusal_or",
    "refusal_recorded",
    "refuser",
    "release_cached",
    "resolve_switch",
    "restore_caches_early",
    "spawn_context",
    "start_context",
    "structure",
    "switch",
    "tensor_at",
    "tensor_spec",
    "torch_gather",
    "warmup",
    "while_saving",
]


class Refused(PersistError):
    """A configuration persistence cannot restore exactly: refused at start-up, saying what to use instead."""


def refuser(supported: str) -> Callable[[str, str], Refused]:
    """An engine's start-up refusal, one form for every engine: `what` cannot be persisted, what to use `instead`, then
    what the engine's integration supports (`supported`)."""
    return lambda what, instead: Refused(f"graphpersist: {what} cannot be persisted: {instead}. ({supported})")


def new_graph() -> Any:
    """The graph object a capture site records into: one SAVE can serialize while saving, else torch's own."""
    sess = current()
    if sess is not None:
        return sess.new_graph()
    import torch

    return torch.cuda.CUDAGraph()


def spawn_context() -> SpawnContext:
    """A multiprocessing spawn context whose processes run only their target, never the program's `__main__` again:
    for an engine that must spawn where upstream forks (graphpersist.engine.spawn)."""
    from graphpersist.engine.spawn import spawn_context as context

    return context()


def cache_folders() -> dict[str, Resolver]:
    """The cache folders every engine shares (Inductor, Triton, FlashInfer), by name: add the engine's own."""
    from graphpersist import cachefolders

    return {
        "inductor": cachefolders.inductor,
        "triton": cachefolders.triton,
        "flashinfer": cachefolders.flashinfer,
        "flashinfer_cubins": cachefolders.flashinfer_cubins,
    }


def restore_caches_early(archive_dir: Path, resolvers: Mapping[str, Resolver], names: tuple[str, ...]) -> list[str]:
    """LOAD, in a process that starts no model (the one that builds the engine's configuration): puts back the named
    cache folders the archive carries; returns the files written. Nothing when the archive carries none or cannot
    be read: the model processes check the archive first and refuse naming why, so this only saves time."""
    from graphpersist import cachefolders
    from graphpersist.archive import ArchiveError, jitcache, read_shared

    try:
        blob = read_shared(archive_dir, jitcache.SHARED_NAME)
    except ArchiveError:
        return []
    if blob is None:
        return []
    found, _left_out = cachefolders.resolve_all({name: resolvers[name] for name in names if name in resolvers})
    return jitcache.restore(blob, found).written


def torch_gather(group: Any = None) -> Callable[[Any], list[Any]]:
    """Rank agreement over a torch.distributed CPU (gloo) group."""
    from graphpersist import ranks

    return ranks.torch_gather(group)


def model_tensors(model: Any) -> dict[str, Any]:
    """A model's parameters (`param.<name>`) and its CUDA buffers (`buffer.<name>`): the setup tensors every engine's
    graphs read, named as LOAD compares them (the engine adds its KV cache)."""
    named = {f"param.{name}": t.data for name, t in model.named_parameters()}
    named.update({f"buffer.{name}": t for name, t in model.named_buffers() if t.is_cuda})
    return named


def open_peers(own: list[int], gather: Callable[[Any], list[Any]], rank: int) -> dict[bytes, int]:
    """LOAD: the peers' buffers a post-capture registration opened by legacy CUDA IPC handle, opened again at the
    addresses the archive expects: this rank's buffers `own` exported, the handles exchanged over `gather`, each
    peer's opened once in SAVE's order (graphpersist.memory.legacyipc.open_peers). Returns them by handle (keep them
    alive)."""
    from graphpersist.memory import legacyipc

    return legacyipc.open_peers(own, gather, rank)


def tensor_spec(t: Any) -> dict[str, Any]:
    """A tensor's address, dtype, shape and strides, as archives record it."""
    from graphpersist.memory.tensors import tensor_spec as spec

    return spec(t)


def tensor_at(spec: Mapping[str, Any]) -> Any:
    """The tensor a spec names, at its recorded address (LOAD: the memory exists again there)."""
    from graphpersist.memory.tensors import tensor_at as at

    return at(spec)
