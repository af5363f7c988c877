"""SAVE / LOAD of captured CUDA graphs across processes (single rank): the runtime's public surface.

Process A (SAVE) runs under the interposer (region.reexec_with_interposer or LD_PRELOAD), builds its model,
calls mark_setup(), warms up and captures with PersistentCUDAGraph (or torch.cuda.CUDAGraph(keep_graph=True)),
registers the graphs on a Saver with their static input/output tensors, and saves. Process B (LOAD) runs the
same setup code, so every setup allocation lands at the same address, then load() validates the archive,
recreates the memory the graphs reference beyond the setup, loads the kernel images and rebuilds the graphs.
No warm-up and no capture happen in B.

Caveat (by design for now): memory allocated after mark_setup() is recreated empty at LOAD. Graphs may use it
as scratch or outputs, and inputs the caller refills, but must not read values computed during A's warm-up.

Setup may be divided into named phases (`phase("weights")`, `begin_phase(name, exact=False)`), each anchored at
its saved offset at LOAD (`use_layout(archive)` before setup); post-capture phases and declared state
(`declare_state`) are re-run / restored after load() and checked by `verify_state()` or the first replay.

Modules: setup (region, mark_setup, ownership), layout (phases and declared state; logic in phases, state),
tensors (static tensors at recorded addresses), save (Saver, PersistentCUDAGraph), load (load, LoadedGraph,
LoadResult). Engines and recipes import this facade.
"""

from __future__ import annotations

from graphpersist.collective import SINGLE
from graphpersist.errors import PersistError
from graphpersist.load import LoadedGraph, LoadResult, check_before_setup, load
from graphpersist.memory.layout import begin_phase, declare_state, end_phase, phase, use_layout, verify_state
from graphpersist.memory.setup import check_ownership, check_setup_tensors, mark_setup, start_region
from graphpersist.memory.tensors import tensor_at, tensor_spec
from graphpersist.save import PersistentCUDAGraph, Saver

__all__ = [
    "SINGLE",
    "LoadResult",
    "LoadedGraph",
    "PersistError",
    "PersistentCUDAGraph",
    "Saver",
    "begin_phase",
    "check_before_setup",
    "check_ownership",
    "check_setup_tensors",
    "declare_state",
    "end_phase",
    "load",
    "mark_setup",
    "phase",
    "start_region",
    "tensor_at",
    "tensor_spec",
    "use_layout",
    "verify_state",
]
