"""SAVE / LOAD of captured CUDA graphs across processes (single rank): the runtime's public surface, the one module
recipes and tools import (`python -m gptools imports` holds them to it; diagnosis has a short reviewed list).

Process A (SAVE) runs under the interposer (reexec_with_interposer or LD_PRELOAD), builds its model, calls
mark_setup(), warms up and captures with PersistentCUDAGraph (or torch.cuda.CUDAGraph(keep_graph=True)), registers
the graphs on a Saver with their static input/output tensors, and saves. Process B (LOAD) runs the same setup code,
so every setup allocation lands at the same address, then load() validates the archive, recreates the memory the
graphs reference beyond the setup, loads the kernel images and rebuilds the graphs. No warm-up and no capture happen
in B.

Caveat (by design for now): memory allocated after mark_setup() is recreated empty at LOAD. Graphs may use it
as scratch or outputs, and inputs the caller refills, but must not read values computed during A's warm-up.

Setup may be divided into named phases (`phase("weights")`, `begin_phase(name, exact=False)`), each anchored at
its saved offset at LOAD (`use_layout(archive)` before setup); post-capture phases and declared state
(`declare_state`) are re-run / restored after load() and checked by `verify_state()` or the first replay.

Besides SAVE and LOAD: starting a process under the interposer (`reexec_with_interposer`, `preload_env`,
`build_interposer`), what the region did (`region_info`, `region_events`, `host_events`, `image_loads`,
`live_ranges`, `bytes_at`), and reading an archive (`open_archive`, `read_graphs`: a rank's graphs as
`graphpersist check` reads them).

Importing this module imports no torch: a script re-executes itself under the interposer before CUDA or torch
loads. The names whose modules need torch (save, load, memory.setup, memory.tensors) are bound on first use.

Modules: setup (region, mark_setup, ownership), layout (phases and declared state; logic in phases, state),
tensors (static tensors at recorded addresses), save (Saver, PersistentCUDAGraph), load (load, LoadedGraph,
LoadResult).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphpersist.archive import ArchiveError, open_archive
from graphpersist.collective import SINGLE
from graphpersist.errors import PersistError
from graphpersist.loadplan import read_graphs
from graphpersist.memory.layout import begin_phase, declare_state, end_phase, phase, use_layout, verify_state
from graphpersist.memory.region import (
    DEFAULT_HOST_BASE,
    build_interposer,
    host_events,
    image_loads,
    live_ranges,
    preload_env,
    reexec_with_interposer,
)
from graphpersist.memory.region import events as region_events
from graphpersist.memory.region import info as region_info
from graphpersist.records import Facts
from graphpersist.switch import SwitchError

if TYPE_CHECKING:  # bound on first use at run time (__getattr__): their modules import torch
    from graphpersist.load import LoadedGraph, LoadResult, check_before_setup, load
    from graphpersist.memory.setup import check_ownership, check_setup_tensors, mark_setup, start_region
    from graphpersist.memory.tensors import bytes_at, tensor_at, tensor_spec
    from graphpersist.save import PersistentCUDAGraph, Saver

__all__ = [
    "DEFAULT_HOST_BASE",
    "SINGLE",
    "ArchiveError",
    "Facts",
    "LoadResult",
    "LoadedGraph",
    "PersistError",
    "PersistentCUDAGraph",
    "Saver",
    "SwitchError",
    "begin_phase",
    "build_interposer",
    "bytes_at",
    "check_before_setup",
    "check_ownership",
    "check_setup_tensors",
    "declare_state",
    "end_phase",
    "host_events",
    "image_loads",
    "live_ranges",
    "load",
    "mark_setup",
    "open_archive",
    "phase",
    "preload_env",
    "read_graphs",
    "reexec_with_interposer",
    "region_events",
    "region_info",
    "start_region",
    "tensor_at",
    "tensor_spec",
    "use_layout",
    "verify_state",
]


def _with_torch() -> dict[str, Any]:
    """The facade's names whose modules import torch."""
    from graphpersist import load, save
    from graphpersist.memory import setup, tensors

    return {
        "LoadResult": load.LoadResult,
        "LoadedGraph": load.LoadedGraph,
        "check_before_setup": load.check_before_setup,
        "load": load.load,
        "PersistentCUDAGraph": save.PersistentCUDAGraph,
        "Saver": save.Saver,
        "check_ownership": setup.check_ownership,
        "check_setup_tensors": setup.check_setup_tensors,
        "mark_setup": setup.mark_setup,
        "start_region": setup.start_region,
        "bytes_at": tensors.bytes_at,
        "tensor_at": tensors.tensor_at,
        "tensor_spec": tensors.tensor_spec,
    }


def __getattr__(name: str) -> Any:
    """Binds the names whose modules import torch when the first of them is used (PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    bound = _with_torch()
    globals().update(bound)
    return bound[name]
