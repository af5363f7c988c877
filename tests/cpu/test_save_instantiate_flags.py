"""SAVE reads how torch instantiated each graph (`cuGraphExecGetFlags` on torch's executable) for LOAD to repeat.

The driver and torch's CUDAGraph are stand-ins here (the real ones are exercised on the GPU host by
tests/gpu/test_events_gpu.py, which compares torch's, the archive's and the loaded executable's flags); the code
under test is save.py's own.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_save_before_write import save_module, two_gpu_host  # noqa: F401  (fixtures)

from graphpersist.errors import PersistError


class _Graph:
    """torch.cuda.CUDAGraph(keep_graph=True) as far as SAVE asks it: no executable until instantiate()."""

    def __init__(self) -> None:
        self.instantiated = 0

    def instantiate(self) -> None:
        self.instantiated += 1

    def raw_cuda_graph_exec(self) -> int:
        if not self.instantiated:
            raise RuntimeError("You cannot access the raw cudaGraphExec_t instance until instantiate() has been called")
        return 0x7F00


def _driver(flags: int) -> Any:
    return SimpleNamespace(CUgraphExec=lambda raw: ("exec", raw), cuGraphExecGetFlags=lambda ex: (0, flags))


def test_flags_are_read_from_torchs_executable_made_first_if_missing(save_module: ModuleType) -> None:  # noqa: F811
    graph = _Graph()
    assert save_module._instantiate_flags(_driver(0x1), "full/8", graph) == 0x1
    assert graph.instantiated == 1  # as its first replay would have
    assert save_module._instantiate_flags(_driver(0x9), "full/8", graph) == 0x9
    assert graph.instantiated == 1  # an executable that exists is read, not made again


@pytest.mark.parametrize("flags", [0x2, 0x4, 0x10])
def test_flags_load_cannot_repeat_refuse_the_save(save_module: ModuleType, flags: int) -> None:  # noqa: F811
    with pytest.raises(PersistError, match=rf"graph 'full/8': instantiated with flags {flags:#x}; .*SAVE refused"):
        save_module._instantiate_flags(_driver(flags), "full/8", _Graph())


def test_a_torch_without_the_executable_accessor_refuses_the_save(save_module: ModuleType) -> None:  # noqa: F811
    with pytest.raises(PersistError, match=r"no raw_cuda_graph_exec\(\).*use the pinned torch\. SAVE refused"):
        save_module._instantiate_flags(_driver(0x1), "full/8", object())
