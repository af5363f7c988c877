"""Four and eight ranks without a 4- or 8-GPU host (issue 13): the rank bookkeeping, archive layout and validation
of TP=4 and TP=8, simulated on CPU.

Threads stand in for the ranks' processes (test_ranks.ThreadGather fakes all_gather_object); an 8-GPU host's
nvidia-smi stands in for the GPUs, and torch's version facts are supplied where torch is absent (CI). Everything
else is the runtime's real code, in the order save.Saver.save and load.load call it: parallel_layout and
collective, collect_live and world_facts, the Ranks agreement, ArchiveWriter (rank 0 stages, every rank writes
its part, rank 0 publishes), and per rank open_archive(keep_rank=r) and check_or_refuse. save.py and load.py
themselves need torch and a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from archive_fixtures import (
    CAPTURE_SIZES,
    GPU_UUIDS,
    PCI_BUS_IDS,
    REGION_BASE,
    REGION_SIZE,
    fake_nvidia_smi,
    smi_rows,
    world,
    write_rank,
)
from test_ranks import run_world

from graphpersist import ranks
from graphpersist.archive import codec, liveenv, open_archive
from graphpersist.archive.liveenv import PINNED_ENV, collect_live, world_facts
from graphpersist.archive.manifest import MANIFEST_NAME
from graphpersist.archive.validate import check_or_refuse, flatten
from graphpersist.archive.world import RankInfo, WorldError, parallel_facts
from graphpersist.collective import collective, parallel_layout
from graphpersist.errors import PersistError

REPO = Path(__file__).resolve().parents[2]
HOST_GPUS = 8
ALL_GPUS = ",".join(str(i) for i in range(HOST_GPUS))
ROTATED = ",".join(str((i + 1) % HOST_GPUS) for i in range(HOST_GPUS))  # device r is GPU r+1, device 7 is GPU 0
# What only the engine knows, as the fixture archive's world holds it.
_W = world()
ENGINE, MODEL, FLAGS = _W["engine"], _W["model"], _W["flags"]
CAPTURE = {"sizes": list(CAPTURE_SIZES), "modes": ["full"]}
REGION = {"base": REGION_BASE, "size": REGION_SIZE}
SOFTWARE = ("torch.version", "cuda.runtime", "cuda.driver_api", "nccl.version")
# The launch environment every rank sees: device numbers in PCI order, all eight GPUs, multicast off.
ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ALL_GPUS, "NCCL_NVLS_ENABLE": "0"}


def software() -> dict[str, Any]:
    """The software facts torch would give (torch, CUDA runtime and driver API, NCCL) where this host lacks them
    (no torch or libcuda in CI): the fixture's values, supplied as the engine supplies what only it knows."""
    host = flatten(collect_live(environ={}))
    return {name: value for name, value in flatten(_W).items() if name in SOFTWARE and name not in host}


def tp(world_size: int, tp_size: int | None = None, pp_size: int = 1) -> dict[str, int]:
    return {"world_size": world_size, "tp_size": world_size if tp_size is None else tp_size, "pp_size": pp_size}


@pytest.fixture(autouse=True)
def eight_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is on an 8-GPU host: nvidia-smi lists eight H200s; the pins are ENV, nothing else."""
    monkeypatch.setattr(liveenv, "_smi_gpus", lambda: smi_rows(HOST_GPUS))
    for name in PINNED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


def save_rank(
    root: Path, parallel: Mapping[str, int], rank: int, gather: ranks.Gather, fail: str | None = None
) -> Path:
    """One rank's collective SAVE, in save.Saver.save's order; its GPU is looked up by the writer (device = rank)."""
    par = parallel_layout(parallel)
    coll = collective(par, rank, gather)
    live = collect_live(
        device=rank, engine=ENGINE, model=MODEL, capture=CAPTURE, parallel=par, flags=FLAGS, **software()
    )
    facts = world_facts(live)
    coll.check(None, "SAVE")
    coll.same_world(facts, "SAVE")
    writer = coll.writer(root, facts, overwrite=False)
    write_rank(writer, rank, gpu=rank)
    coll.commit(writer, fail)
    return writer.root


def load_rank(
    root: Path, parallel: Mapping[str, int], rank: int, gather: ranks.Gather, *, device: int | None = None, **live: Any
) -> None:
    """One rank's LOAD preamble, in load.load's order: every rank validates its own facts, then all agree."""
    par = parallel_layout(parallel)
    coll = collective(par, rank, gather)
    try:
        archive = open_archive(root, keep_rank=rank)
        facts = collect_live(
            device=rank if device is None else device,
            engine=ENGINE,
            model=MODEL,
            capture=CAPTURE,
            parallel=par,
            flags=FLAGS,
            region=REGION,
            **software(),
            **live,
        )
        check_or_refuse(archive, facts, rank)
    except Exception as exc:
        coll.check(f"{type(exc).__name__}: {exc}", "LOAD")
        raise
    coll.check(None, "LOAD")


def save(root: Path, parallel: Mapping[str, int]) -> Path:
    results = run_world(parallel["world_size"], lambda r, g: save_rank(root, parallel, r, g))
    assert results == [root] * parallel["world_size"], results
    return root


def refusals(results: list[Any]) -> list[str]:
    """Every rank's message, asserting that every rank raised the agreed refusal."""
    assert all(isinstance(x, ranks.RanksRefused) for x in results), results
    return [str(x) for x in results]


# ------------------------------------------------------------------------------------------------- SAVE


@pytest.mark.parametrize("world_size", [4, 8])
def test_a_collective_save_of_w_ranks_writes_one_archive_with_a_gpu_per_rank(tmp_path: Path, world_size: int):
    root = save(tmp_path / "archive", tp(world_size))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive"], "no staging or trash folder may remain"
    assert sorted(p.name for p in root.iterdir()) == sorted([MANIFEST_NAME] + [f"rank_{r}" for r in range(world_size)])
    archive = open_archive(root)
    assert archive.ranks == tuple(range(world_size))
    parallel = archive.manifest.world.parallel
    assert (parallel.world_size, parallel.tp_size, parallel.pp_size) == (world_size, world_size, 1)
    devices = [archive.rank_facts(r).device for r in range(world_size)]
    assert [d.index for d in devices] == list(range(world_size))
    assert [d.uuid for d in devices] == list(GPU_UUIDS[:world_size])  # looked up per rank, not copied
    assert [d.pci_bus_id for d in devices] == list(PCI_BUS_IDS[:world_size])
    assert {rel.split("/", 1)[0] for rel in archive.manifest.files} == {f"rank_{r}" for r in range(world_size)}
    for r in range(world_size):
        assert {rel.split("/", 1)[0] for rel in archive.names(r)} == {"graphs", "images", "allocations.log"}
    # and every rank LOADs it on the GPU it saved on
    assert run_world(world_size, lambda r, g: load_rank(root, tp(world_size), r, g)) == [None] * world_size


def test_one_rank_of_8_failing_its_save_refuses_all_and_leaves_nothing(tmp_path: Path):
    root = tmp_path / "archive"
    results = run_world(8, lambda r, g: save_rank(root, tp(8), r, g, fail="disk full" if r == 3 else None))
    for message in refusals(results):
        assert message == "SAVE refused on 1 of 8 rank(s):\n  rank 3: disk full"
    assert not list(tmp_path.iterdir()), "neither the archive nor rank 0's staging folder may remain"


def test_ranks_that_describe_different_worlds_are_refused_before_any_file(tmp_path: Path):
    """Rank 6 of 8 sees another NCCL protocol pin: SAVE names the field and both ranks' values, writes nothing."""
    root = tmp_path / "archive"

    def body(rank: int, gather: ranks.Gather) -> None:
        coll = collective(parallel_layout(tp(8)), rank, gather)
        env = {**ENV, "NCCL_PROTO": "Simple"} if rank == 6 else ENV
        live = collect_live(
            device=rank, environ=env, engine=ENGINE, model=MODEL, capture=CAPTURE, parallel=tp(8), **software()
        )
        coll.same_world(world_facts(live), "SAVE")
        coll.writer(root, world_facts(live), overwrite=False)

    for message in refusals(run_world(8, body)):
        assert message == (
            "SAVE refused: the ranks describe different worlds:\n  env.NCCL_PROTO: rank 0 <unset>, rank 6 'Simple'"
        )
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------- LOAD


@pytest.fixture
def tp8(tmp_path: Path) -> Path:
    return save(tmp_path / "tp8", tp(8))


def test_one_rank_of_8_refusing_makes_all_8_refuse_naming_it(tp8: Path):
    """Rank 5's region lands elsewhere: only rank 5's own check fails, and all eight ranks raise with its reason."""

    def body(rank: int, gather: ranks.Gather) -> None:
        moved = {"region.base": REGION_BASE + (1 << 40)} if rank == 5 else {}
        load_rank(tp8, tp(8), rank, gather, **moved)

    for message in refusals(run_world(8, body)):
        lines = message.splitlines()
        assert lines[:3] == [
            "LOAD refused on 1 of 8 rank(s):",
            f"  rank 5: LoadRefused: graphpersist: cannot LOAD {tp8} (rank 5): 1 mismatch",
            "  region.base: saved 0x7e0000000000, live 0x7f0000000000",
        ]
        assert not any(f"rank {r}:" in message for r in range(8) if r != 5)


def test_a_world_of_8_loaded_as_4_is_refused_on_every_rank(tp8: Path):
    messages = refusals(run_world(4, lambda r, g: load_rank(tp8, tp(4), r, g)))
    for message in messages:
        assert message.startswith("LOAD refused on 4 of 4 rank(s):\n")
        for r in range(4):
            assert f"  rank {r}: LoadRefused: graphpersist: cannot LOAD {tp8} (rank {r}): 2 mismatches\n" in message
        assert message.count("  parallel.world_size: saved 8, live 4\n") == 4
        assert message.count("  parallel.tp_size: saved 8, live 4\n") == 4
    assert len(set(messages)) == 1, "every rank must report the same agreed refusal"


@pytest.mark.parametrize("how", ["visible_devices", "launcher"])
def test_ranks_on_a_rotated_list_of_gpus_are_refused_on_every_rank(tp8: Path, monkeypatch, how: str):
    """Rank r comes back on GPU r+1 (rank 7 on GPU 0). `visible_devices`: CUDA_VISIBLE_DEVICES rotated, device r
    is now GPU r+1 and the pin says so too; `launcher`: same device list, rank r put on device r+1, so only the
    rank records catch it. Either way every rank refuses, naming its own GPU's saved and live identity."""
    if how == "visible_devices":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ROTATED)

    def body(rank: int, gather: ranks.Gather) -> None:
        load_rank(tp8, tp(8), rank, gather, device=(rank + 1) % 8 if how == "launcher" else None)

    for message in refusals(run_world(8, body)):
        assert message.startswith("LOAD refused on 8 of 8 rank(s):\n")
        for r in range(8):
            o = (r + 1) % 8
            expected = [
                *(
                    [f"env.CUDA_VISIBLE_DEVICES: saved '{ALL_GPUS}', live '{ROTATED}'"]
                    if how == "visible_devices"
                    else []
                ),
                *([f"device.index: saved {r}, live {o}"] if how == "launcher" else []),
                f"device.pci_bus_id: saved '{PCI_BUS_IDS[r]}', live '{PCI_BUS_IDS[o]}'",
            ]
            head = f"  rank {r}: LoadRefused: graphpersist: cannot LOAD {tp8} (rank {r}): 2 mismatches"
            assert "\n".join([head, *(f"  {line}" for line in expected)]) in message


# ------------------------------------------------------------------------------------------------- TP x PP


def test_tp4_x_pp2_is_one_world_of_8(tmp_path: Path):
    root = save(tmp_path / "tp4pp2", tp(8, tp_size=4, pp_size=2))
    archive = open_archive(root)
    parallel = archive.manifest.world.parallel
    assert (parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.ep_size) == (8, 4, 2, 1)
    assert archive.ranks == tuple(range(8))
    assert run_world(8, lambda r, g: load_rank(root, tp(8, tp_size=4, pp_size=2), r, g)) == [None] * 8
    # the same eight ranks as TP=8 are another layout: what each rank holds and talks to differs
    for message in refusals(run_world(8, lambda r, g: load_rank(root, tp(8), r, g))):
        assert message.count("  parallel.tp_size: saved 4, live 8\n") == 8
        assert message.count("  parallel.pp_size: saved 2, live 1\n") == 8
    assert parallel_facts(RankInfo(7, 8, 7, 7, "test"), tp_size=4, pp_size=2) == {
        "world_size": 8,
        "tp_size": 4,
        "pp_size": 2,
        "ep_size": 1,
        "rank": 7,
    }


@pytest.mark.parametrize(
    ("layout", "problem"),
    [
        (tp(8, tp_size=4), "tp_size 4 x pp_size 1 = 4, world size 8"),
        (tp(8, tp_size=4, pp_size=4), "tp_size 4 x pp_size 4 = 16, world size 8"),
        (tp(4, tp_size=2), "tp_size 2 x pp_size 1 = 2, world size 4"),
        ({**tp(8), "ep_size": 3}, "ep_size 3 does not divide world size 8"),
        (tp(0), "world_size must be a positive integer, got 0"),
    ],
)
def test_a_layout_whose_tp_x_pp_is_not_the_world_is_refused(tmp_path: Path, layout: dict[str, int], problem: str):
    with pytest.raises(PersistError, match="inconsistent parallel layout") as refused:
        parallel_layout(layout)
    assert problem in str(refused.value)
    if layout["world_size"] >= 1:  # the engine-side helper says the same
        with pytest.raises(WorldError, match=problem):
            parallel_facts(RankInfo(0, layout["world_size"], 0, 0, "test"), **{k: v for k, v in layout.items()
                                                                               if k != "world_size"})  # fmt: skip
        # and a SAVE with it refuses on every rank before anything is staged
        root = tmp_path / "archive"
        results = run_world(layout["world_size"], lambda r, g: save_rank(root, layout, r, g))
        assert all(isinstance(x, PersistError) and problem in str(x) for x in results), results
        assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def cli_tp8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """An 8-rank archive saved on this (simulated) host, and the environment the CLI runs in: the fake 8-GPU
    nvidia-smi first on PATH and the launch environment's pins."""
    folder = tmp_path_factory.mktemp("tp8cli")
    (folder / "bin").mkdir()
    fake_nvidia_smi(folder / "bin", gpus=HOST_GPUS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(liveenv, "_smi_gpus", lambda: smi_rows(HOST_GPUS))
        for name in PINNED_ENV:
            patch.delenv(name, raising=False)
        for name, value in ENV.items():
            patch.setenv(name, value)
        root = save(folder / "archive", tp(8))
    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV} | ENV
    env |= {
        "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO / "overlays" / "graphpersist"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    yield root, env


def graphpersist(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graphpersist", *args], env=dict(env), capture_output=True, text=True, cwd=REPO
    )


def test_inspect_shows_all_8_ranks_each_on_its_gpu(cli_tp8: tuple[Path, dict[str, str]]):
    root, env = cli_tp8
    result = graphpersist(env, "inspect", str(root))
    assert result.returncode == 0, result.stderr
    assert "parallel    world 8: tp 8, pp 1, ep 1" in result.stdout
    for r in range(8):
        assert f"\nrank {r}\n  gpu       device {r}, PCI {PCI_BUS_IDS[r]}, {GPU_UUIDS[r]}\n" in result.stdout
    assert "\nrank 8\n" not in result.stdout
    as_json = graphpersist(env, "inspect", "--json", "--no-verify", str(root))
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert list(data["ranks"]) == [str(r) for r in range(8)]
    assert data["manifest"]["ranks"] == list(range(8))
    assert [data["ranks"][str(r)]["device"]["uuid"] for r in range(8)] == list(GPU_UUIDS)


def test_check_every_rank_of_8_on_its_gpu_and_refuse_a_rotation(cli_tp8: tuple[Path, dict[str, str]]):
    root, env = cli_tp8
    saved = flatten(codec.to_dict(open_archive(root).manifest.world))
    # What a host without torch or libcuda cannot report (`check` would exit 3): given, as such a host's user would.
    unmeasurable = ("torch.version", "cuda.runtime", "cuda.driver_api", "nccl.version")
    sets = ["--set", "parallel.world_size=8", "--set", "parallel.tp_size=8"]
    sets += [f"--set={k}={saved[k]}" for k in unmeasurable]
    for r in range(8):
        result = graphpersist(env, "check", "--json", "--no-verify", "--rank", str(r), *sets, str(root))
        assert result.returncode == 0, result.stdout + result.stderr
        data = json.loads(result.stdout)
        assert data["ok"] and data["rank"] == r
        assert {"device.pci_bus_id", "parallel.world_size", "parallel.rank"} <= set(data["checked"])
    for r in (0, 7):
        result = graphpersist({**env, "CUDA_VISIBLE_DEVICES": ROTATED}, "check", "--no-verify", "--rank", str(r),
                              *sets, str(root))  # fmt: skip
        o = (r + 1) % 8
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stdout.splitlines()[:3] == [
            f"graphpersist: cannot LOAD {root} (rank {r}): 2 mismatches",
            f"  env.CUDA_VISIBLE_DEVICES: saved '{ALL_GPUS}', live '{ROTATED}'",
            f"  device.pci_bus_id: saved '{PCI_BUS_IDS[r]}', live '{PCI_BUS_IDS[o]}'",
        ]
    four = graphpersist(env, "check", "--no-verify", "--rank", "3", "--set", "parallel.world_size=4",
                        "--set", "parallel.tp_size=4", str(root))  # fmt: skip
    assert four.returncode == 1
    assert four.stdout.splitlines()[1:3] == [
        "  parallel.world_size: saved 8, live 4",
        "  parallel.tp_size: saved 8, live 4",
    ]
    outside = graphpersist(env, "check", "--no-verify", "--rank", "8", str(root))
    assert outside.returncode == 1
    assert "  parallel.rank: saved [0, 1, 2, 3, 4, 5, 6, 7], live 8" in outside.stdout
