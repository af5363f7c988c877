"""Putting back what an engine's own code changed while the glue ran it (graphpersist.engine.putback): the objects'
attributes and torch's random generators, with torch stood in for (a CPU tensor stand-in that clones and copies)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from graphpersist import engine
from graphpersist.engine.putback import Snapshot


class T:
    """A tensor stand-in: values and a device type."""

    def __init__(self, values: list[int], device: str = "cuda") -> None:
        self.values, self.device = list(values), SimpleNamespace(type=device)

    def clone(self) -> T:
        return T(self.values, self.device.type)

    def copy_(self, other: T) -> None:
        self.values[:] = other.values


def test_snapshot_copies_lists_clones_cpu_tensors_back_in_place_and_drops_new_attributes() -> None:
    obj = SimpleNamespace(slots=[1, 2, 3], gen=T([0, 0], device="cpu"), free=T([5, 6]), flag=True)
    gen, free = obj.gen, obj.free
    snap = Snapshot.of(obj)
    obj.slots.pop()
    obj.gen.values[1] = 9
    obj.free, obj.flag, obj.extra = T([6]), False, "made by the batches"
    snap.restore()
    assert obj.slots == [1, 2, 3] and obj.gen is gen and gen.values == [0, 0] and obj.free is free
    assert obj.flag is True and not hasattr(obj, "extra")


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A torch whose random generator states are strings, recording what is set and synchronised."""
    events: list[Any] = []
    module = ModuleType("torch")
    module.get_rng_state = lambda: "cpu state"  # type: ignore[attr-defined]
    module.set_rng_state = lambda s: events.append(("cpu", s))  # type: ignore[attr-defined]
    module.cuda = SimpleNamespace(  # type: ignore[attr-defined]
        get_rng_state=lambda: "cuda state",
        set_rng_state=lambda s: events.append(("cuda", s)),
        synchronize=lambda: events.append("synchronize"),
    )
    monkeypatch.setitem(sys.modules, "torch", module)
    return events


def test_put_back_restores_the_objects_and_both_generators_after_the_gpu_finished(torch: list[Any]) -> None:
    pool, allocator = SimpleNamespace(free=[1, 2]), SimpleNamespace(count=0)
    with engine.put_back(pool, allocator):
        pool.free.pop()
        allocator.count = 7
    assert pool.free == [1, 2] and allocator.count == 0
    assert torch == ["synchronize", ("cpu", "cpu state"), ("cuda", "cuda state")]


def test_put_back_restores_also_when_the_block_raises(torch: list[Any]) -> None:
    pool = SimpleNamespace(free=[1, 2])
    with pytest.raises(RuntimeError, match="illegal memory access"), engine.put_back(pool):
        pool.free.clear()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    assert pool.free == [1, 2] and len(torch) == 3
