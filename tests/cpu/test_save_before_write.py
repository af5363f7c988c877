"""`Saver.save(before_write=...)`: work every rank runs once what the archive holds is fixed and before anything is
written (an engine's first-request kernel warm-up, whose compiles the JIT caches carry), checked on CPU.

save.py needs torch only for what this does not run (its graph serialization in `_prepare` and its rank files in
`_write` are replaced by stand-ins that record when they ran); torch itself is a stand-in module. Everything else is
the runtime's real code: the rank agreement (`collective.run_on_every_rank`, threads for ranks), `ArchiveWriter`
staging and publishing, the shared files.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from archive_fixtures import smi_rows, world, write_rank
from test_ranks import run_ranks, run_world

from graphpersist import ranks
from graphpersist.archive import liveenv, open_archive, read_shared
from graphpersist.archive.liveenv import PINNED_ENV
from graphpersist.collective import run_on_every_rank
from graphpersist.errors import PersistError
from graphpersist.records import Facts

TP2 = {"world_size": 2, "tp_size": 2, "pp_size": 1, "ep_size": 1}
SHARED_IMAGE = b"a kernel image both ranks load" * 100


# ----------------------------------------------------------------------------------- the rank agreement itself


def test_every_rank_runs_the_work_and_all_go_on_when_all_succeed() -> None:
    ran: list[int] = []
    results = run_ranks(2, lambda coll: run_on_every_rank(coll, lambda: ran.append(coll.rank), "SAVE"))
    assert results == [None, None] and sorted(ran) == [0, 1]


def test_a_failure_on_one_rank_refuses_on_every_rank_naming_it() -> None:
    def work(coll: ranks.Ranks) -> None:
        if coll.rank == 1:
            raise RuntimeError("the warm-up's forward failed")

    results = run_ranks(2, lambda coll: run_on_every_rank(coll, lambda: work(coll), "SAVE"))
    assert all(isinstance(r, ranks.RanksRefused) for r in results), results
    assert all("SAVE refused on 1 of 2 rank(s)" in str(r) for r in results)
    assert all("rank 1: RuntimeError: the warm-up's forward failed" in str(r) for r in results)


def test_one_rank_raises_the_failure_as_it_is() -> None:
    def fail() -> None:
        raise ValueError("as it is")

    with pytest.raises(ValueError, match="as it is"):
        run_on_every_rank(ranks.Ranks(1, 0), fail, "SAVE")


# ------------------------------------------------------------------------------------------ in Saver.save's order


@pytest.fixture
def two_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi lists two GPUs in PCI order, as the fixture archive's ranks were on (the writer looks them up)."""
    monkeypatch.setattr(liveenv, "_smi_gpus", lambda: smi_rows(2))
    for name in PINNED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")


@pytest.fixture
def save_module(monkeypatch: pytest.MonkeyPatch, two_gpu_host: None) -> Iterator[ModuleType]:
    """graphpersist.save imported against a stand-in torch (the class it subclasses, nothing it would run here)."""
    torch = ModuleType("torch")
    torch.cuda = SimpleNamespace(CUDAGraph=type("CUDAGraph", (), {}))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.delitem(sys.modules, "graphpersist.save", raising=False)
    import graphpersist.save as save

    monkeypatch.setattr(save.region, "freeze", lambda: None)
    yield save
    sys.modules.pop("graphpersist.save", None)


def recorded_saver(save: ModuleType, events: list[str], rank: int) -> Any:
    """A Saver whose preparation and rank files are stand-ins that record when they ran."""
    saver = save.Saver()

    def prepare(*args: Any) -> Any:
        events.append(f"prepare {rank}")
        return SimpleNamespace(world=world(), t0=0.0)  # the two fields of save._Prepared that save() reads

    def write(w: Any, r: int, prep: Any, notes: dict[str, Any]) -> dict[str, Any]:
        events.append(f"write {r}")
        write_rank(w, r, gpu=r, shared_image=SHARED_IMAGE)  # as SAVE adds kernel images (save.Saver._write)
        return {}

    saver._prepare = prepare
    saver._write = write
    return saver


def save_world(save: ModuleType, root: Path, before_write: Callable[[int], None], events: list[str]) -> list[Any]:
    def carry() -> dict[str, bytes]:
        events.append("shared")
        return {"jitcache.tar": b"what the warm-up compiled"}

    def body(rank: int, gather: ranks.Gather) -> Any:
        shared = carry if rank == 0 else None
        return recorded_saver(save, events, rank).save(
            root, Facts({}, {}, parallel=TP2), rank=rank, gather=gather, shared=shared,
            before_write=lambda: before_write(rank),
        )  # fmt: skip

    return run_world(2, body)


def test_before_write_runs_on_every_rank_after_all_prepared_and_before_any_file_or_the_shared_caches(
    save_module: ModuleType, tmp_path: Path
) -> None:
    events: list[str] = []

    def warm_up(rank: int) -> None:
        assert not list(tmp_path.iterdir()), "nothing is staged yet (no archive, no a.partial-* folder)"
        events.append(f"warm-up {rank}")

    results = save_world(save_module, tmp_path / "a", warm_up, events)
    assert all(isinstance(r, dict) for r in results), results
    for r in results:  # where each rank's SAVE went, in its summary (the engines log it with breakdown.of_save)
        assert set(r["split_s"]) == {"prepare", "write", "shared", "commit"} and min(r["split_s"].values()) >= 0
        assert r["total_s"] >= sum(r["split_s"].values()) - 1e-6
    last_prepare = max(events.index("prepare 0"), events.index("prepare 1"))
    first_warm_up = min(events.index("warm-up 0"), events.index("warm-up 1"))
    last_warm_up = max(events.index("warm-up 0"), events.index("warm-up 1"))
    first_write = min(events.index("write 0"), events.index("write 1"))
    # Rank 0 adds the shared files before it writes its record, which commits to them (archive_digests).
    assert last_prepare < first_warm_up and last_warm_up < events.index("shared") < events.index("write 0")
    assert last_warm_up < first_write
    assert read_shared(tmp_path / "a", "jitcache.tar") == b"what the warm-up compiled"
    archive = open_archive(tmp_path / "a")
    assert sorted(archive.ranks) == [0, 1]
    images = sorted(rel for rel in archive.manifest.files if rel.startswith("images/"))
    assert len(images) == 1 and all(images[0] in {i.file for i in archive.rank_facts(r).images} for r in (0, 1))


def test_a_warm_up_that_fails_on_one_rank_refuses_the_save_on_every_rank_and_writes_nothing(
    save_module: ModuleType, tmp_path: Path
) -> None:
    events: list[str] = []

    def warm_up(rank: int) -> None:
        if rank == 0:
            raise RuntimeError("Capture cuda graph failed")

    results = save_world(save_module, tmp_path / "a", warm_up, events)
    assert all(isinstance(r, PersistError) for r in results), results
    assert all("rank 0: RuntimeError: Capture cuda graph failed" in str(r) for r in results)
    assert not [e for e in events if e.startswith("write") or e == "shared"]
    assert not list(tmp_path.iterdir()), "no archive and no staging folder"


TP1 = {"world_size": 1, "tp_size": 1, "pp_size": 1, "ep_size": 1}


def test_the_collector_is_paused_while_save_serializes_and_writes_and_only_then(
    save_module: ModuleType, tmp_path: Path
) -> None:
    """As LOAD (graphpersist.gcpause): SAVE's own steps make many small objects and no cycles, so the collector is
    off in them; the engine's work in between (before_write, the shared caches) runs with it as it was."""
    import gc

    seen: dict[str, bool] = {}
    saver = save_module.Saver()

    def prepare(*args: Any) -> Any:
        seen["prepare"] = gc.isenabled()
        return SimpleNamespace(world=world(**{"parallel.world_size": 1, "parallel.tp_size": 1}), t0=0.0)

    def write(w: Any, r: int, prep: Any, notes: dict[str, Any]) -> dict[str, Any]:
        seen["write"] = gc.isenabled()
        write_rank(w, r, gpu=r, shared_image=SHARED_IMAGE)
        return {}

    def shared() -> dict[str, bytes]:
        seen["shared"] = gc.isenabled()
        return {"jitcache.tar": b"compiled"}

    saver._prepare, saver._write = prepare, write
    assert gc.isenabled()
    saver.save(tmp_path / "a", Facts({}, {}, parallel=TP1), shared=shared,
               before_write=lambda: seen.update(before_write=gc.isenabled()))  # fmt: skip
    assert seen == {"prepare": False, "before_write": True, "shared": True, "write": False}
    assert gc.isenabled()


def test_a_refused_preparation_gives_the_collector_back(save_module: ModuleType, tmp_path: Path) -> None:
    import gc

    saver = save_module.Saver()

    def refuse(*args: Any) -> Any:
        raise PersistError("graph 'x': an unsupported node")

    saver._prepare = refuse
    with pytest.raises(PersistError, match="unsupported node"):
        saver.save(tmp_path / "a", Facts({}, {}, parallel=TP1))
    assert gc.isenabled()
