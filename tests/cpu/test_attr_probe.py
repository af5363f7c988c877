"""graphwalk._AttrProbe: whether an unreadable launch attribute is simply not a kernel-node attribute.

SAVE asks it for every launch attribute a captured kernel node cannot read: 559k times for an engine's 1938 graphs
(recipes/runtime-scale/README.md). Its answer depends only on the kernel and the attribute, so the driver is asked
once per pair and every later node reads the answer from the SAVE's cache; no CUDA here, a recording stand-in for
cuda.bindings.driver answers.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from graphpersist.graph import walk as graphwalk


class RecordingDriver:
    """The calls the probe makes, each answered as the driver would for an attribute a fresh node cannot read."""

    CUDA_KERNEL_NODE_PARAMS = SimpleNamespace

    def __init__(self) -> None:
        self.calls: list[str] = []

    def cuGraphCreate(self, flags: int) -> tuple[int, str]:
        self.calls.append("cuGraphCreate")
        return 0, "scratch-graph"

    def cuGraphAddKernelNode(self, graph: str, deps: Any, n: int, params: Any) -> tuple[int, str]:
        self.calls.append(f"cuGraphAddKernelNode func={params.func}")
        return 0, f"node-of-{params.func}"

    def cuGraphKernelNodeGetAttribute(self, node: str, attr: int) -> tuple[int, None]:
        self.calls.append(f"cuGraphKernelNodeGetAttribute {node} {attr}")
        return 1, None  # CUDA_ERROR_INVALID_VALUE: not an attribute of this kernel node

    def cuGraphDestroy(self, graph: str) -> None:
        self.calls.append(f"cuGraphDestroy {graph}")


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> RecordingDriver:
    fake = RecordingDriver()
    monkeypatch.setattr(graphwalk, "driver", lambda: fake)
    return fake


def kernel_node(func: int) -> SimpleNamespace:
    return SimpleNamespace(func=func, gridDimX=1, gridDimY=1, gridDimZ=1, blockDimX=32, blockDimY=1, blockDimZ=1,
                           sharedMemBytes=0)  # fmt: skip


def test_the_driver_is_asked_once_per_kernel_and_attribute(drv: RecordingDriver) -> None:
    answers: dict[tuple[int, int], int] = {}
    probe = graphwalk._AttrProbe(answers)
    layout, params = [(0, 8)], bytes(8)
    got = [probe.unreadable_on_fresh(kernel_node(func), layout, params, attr) for func, attr in
           [(0x10, 7), (0x10, 7), (0x10, 9), (0x20, 7), (0x10, 7), (0x20, 7)]]  # fmt: skip
    assert got == [1] * 6
    assert answers == {(0x10, 7): 1, (0x10, 9): 1, (0x20, 7): 1}
    assert drv.calls == [
        "cuGraphCreate",
        "cuGraphAddKernelNode func=16",
        "cuGraphKernelNodeGetAttribute node-of-16 7",
        "cuGraphAddKernelNode func=16",
        "cuGraphKernelNodeGetAttribute node-of-16 9",
        "cuGraphAddKernelNode func=32",
        "cuGraphKernelNodeGetAttribute node-of-32 7",
    ]
    probe.close()
    assert drv.calls[-1] == "cuGraphDestroy scratch-graph"


def test_answers_cached_by_an_earlier_graph_of_the_save_need_no_driver_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        raise AssertionError("the driver was looked up for an answer the SAVE already had")

    monkeypatch.setattr(graphwalk, "driver", no_driver)
    probe = graphwalk._AttrProbe({(0x10, 7): 1, (0x10, 9): 0})
    assert probe.unreadable_on_fresh(kernel_node(0x10), [], b"", 7) == 1
    assert probe.unreadable_on_fresh(kernel_node(0x10), [], b"", 9) == 0
    probe.close()  # no scratch graph was made, so nothing to destroy
