"""One rank's record written by SAVE's own code (save.Saver._write), without a GPU: what proves that rank.json's
format survives a change to how the runtime types it.

`prepared(save)` is a save._Prepared as `_prepare` makes it after capture (two graphs, two kernel images, four
allocation events, three phases, a "bytes" and a "recreated" state, torch's blocks, graph addresses in a variable
phase); `write_one_rank(save, root)` runs `Saver._write` on it into a one-rank archive and commits it. Only names
every runtime release since the rank records' digests has are used, so this module also runs against an older
runtime: `PYTHONPATH=<that runtime's overlays/graphpersist> python tests/cpu/save_record_fixture.py OUT.json` writes
its rank.json to OUT.json. tests/cpu/data/rank-record-before-rank-extra.json was made so, by the runtime of commit
5e6d9ef (`git archive 5e6d9ef overlays/graphpersist`), whose rank records kept `extra` as a plain dict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from archive_fixtures import REGION_BASE, REGION_SIZE, loadable_graph, smi_rows, world

GOLDEN = Path(__file__).resolve().parent / "data" / "rank-record-before-rank-extra.json"
MIB = 1 << 20
GRAPHS = {"full-bs1": 1, "full-bs8": 8}
NOTES = {"dispatch": {"full-bs8": [8, 8, True]}, "kernel_choices": {"triton_mm": [64, 64, 32]}}
ONE_RANK = {"parallel.world_size": 1, "parallel.tp_size": 1}


class StandInTensor:
    """A static input as save.tensor_spec reads it: its address, dtype, shape and stride."""

    def __init__(self, addr: int, shape: tuple[int, ...]) -> None:
        self.addr, self.shape, self.dtype = addr, shape, "torch.bfloat16"

    def data_ptr(self) -> int:
        return self.addr

    def stride(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))


def prepared(save: ModuleType) -> tuple[Any, Any]:
    """(a Saver with the graphs registered, the save._Prepared its `_prepare` would return for them)."""
    from graphpersist.graph import walk as graphwalk
    from graphpersist.memory import phases, region, state

    images = [hashlib.sha256(b"kernel image %d" % i).digest() * 64 for i in range(2)]
    shas = [hashlib.sha256(data).hexdigest() for data in images]
    funcs = [[shas[0], "k_own", {}], [shas[1], "k_shared", {"8": 65536}]]
    buffers = [REGION_BASE + 4096, REGION_BASE + 64 * MIB + 512, REGION_BASE + 96 * MIB]
    saver = save.Saver()
    saved, pointers = {}, set()
    for name, size in GRAPHS.items():
        desc, blob, table = loadable_graph(size, 0, funcs, buffers)
        in_region = {w for w in (int.from_bytes(blob[i : i + 8], "little") for i in range(0, len(blob), 8))}
        memset = {buffers[2]} if size == 8 else set()  # graphwalk records every memset and memcpy address
        used = {w for w in in_region if REGION_BASE <= w < REGION_BASE + REGION_SIZE} | set(buffers[:2]) | memset
        saved[name] = graphwalk.SavedGraph(desc, blob, used, table)
        pointers |= used
        inputs = [StandInTensor(buffers[1], (8, 64))]
        tree = {"kind": "value", "value": None}
        saver.entries.add(name, save._Entry(None, inputs, tree, [], size, "full", None))
    loads = {
        sha: (SimpleNamespace(data=lambda data=data: data, size=len(data), kind="cubin"), {funcs[i][1]})
        for i, (sha, data) in enumerate(zip(shas, images, strict=True))
    }
    evs = [
        region.Event(0, "alloc", REGION_BASE, 64 * MIB, 64 * MIB),
        region.Event(1, "alloc", REGION_BASE + 64 * MIB, 32 * MIB, 30 * MIB),
        region.Event(2, "alloc", REGION_BASE + 96 * MIB, 8 * MIB, 8 * MIB),
        region.Event(3, "alloc", REGION_BASE + 104 * MIB, 2 * MIB, 4096),
    ]
    rec_phases = [
        phases.Phase("(setup)", implicit=True, start_event=0, end_event=1, start=0, end=64 * MIB, limit=64 * MIB),
        phases.Phase("kv_cache", exact=False, start_event=1, end_event=2, start=64 * MIB, end=96 * MIB,
                     limit=96 * MIB, headroom=0),
        phases.Phase("custom_all_reduce", post_capture=True, start_event=3, end_event=4, start=104 * MIB,
                     end=106 * MIB, limit=106 * MIB),
    ]  # fmt: skip
    rank_data = hashlib.sha256(b"rank data").digest() * 8
    states = [
        (state.StateRecord("rank_data", REGION_BASE + 104 * MIB, len(rank_data), "bytes",
                           hashlib.sha256(rank_data).hexdigest(), "custom_all_reduce", "state/0.bin"), rank_data),
        (state.StateRecord("peer_ptrs", REGION_BASE + 104 * MIB + 4096, 64, "recreated", "cd" * 32,
                           "custom_all_reduce", None), b""),
    ]  # fmt: skip
    inventory = sorted(pointers)
    prep = save._Prepared(
        t0=0.0, serialize_s=0.0,
        info=SimpleNamespace(base=REGION_BASE, size=REGION_SIZE, cursor=106 * MIB, granularity=2 * MIB),
        evs=evs, saved=saved, used=loads, exec_flags=dict.fromkeys(GRAPHS, 1), pointers=inventory,
        inv_fp=hashlib.sha256(json.dumps(inventory).encode()).hexdigest(), world=world(**ONE_RANK),
        mark=SimpleNamespace(events=1, cursor=64 * MIB,
                             tensors=[["model.weight", REGION_BASE + 4096, "bfloat16", [1024, 64], [64, 1]]]),
        phases=rec_phases, states=states, numbers=set(),
        pointer_phases={"(setup)": len(inventory) - 1, "kv_cache": 1},
        variable_pointers=[[buffers[1], "kv_cache"]], torch_blocks=[(REGION_BASE + 4096, MIB)],
        **later_fields(save),
    )  # fmt: skip
    return saver, prep


def later_fields(save: ModuleType) -> dict[str, Any]:
    """_Prepared's fields added after the committed record was made, with what a SAVE without them writes: no pinned
    host memory read, no parameter bytes zeroed (so the fixture runs on the runtime before and after them)."""
    later = {"host_memory": {"ranges": [], "words": 0}, "zeroed": {}}
    have = {f.name for f in dataclasses.fields(save._Prepared)}
    return {k: v for k, v in later.items() if k in have}


def write_one_rank(save: ModuleType, root: Path) -> Path:
    """A committed one-rank archive at `root` whose rank 0 files and record Saver._write wrote."""
    from graphpersist.archive import ArchiveWriter

    saver, prep = prepared(save)
    with ArchiveWriter(root, world(**ONE_RANK)) as writer:
        saver._write(writer, 0, prep, dict(NOTES))
        return writer.commit()


def standin_save() -> ModuleType:
    """graphpersist.save against a stand-in torch that knows its current device (0), and nvidia-smi's two GPUs."""
    from graphpersist.archive import liveenv

    torch = ModuleType("torch")
    torch.cuda = SimpleNamespace(CUDAGraph=type("CUDAGraph", (), {}), current_device=lambda: 0)  # type: ignore[attr-defined]
    sys.modules["torch"] = torch
    liveenv._smi_gpus = lambda: smi_rows(2)  # type: ignore[assignment]
    for name in liveenv.PINNED_ENV:
        os.environ.pop(name, None)
    os.environ |= {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_NVLS_ENABLE": "0"}
    import graphpersist.save as save

    return save


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: save_record_fixture.py OUT.json  (the runtime that writes it first on PYTHONPATH)")
    with tempfile.TemporaryDirectory() as scratch:
        archive = write_one_rank(standin_save(), Path(scratch) / "archive")
        Path(sys.argv[1]).write_bytes((archive / "rank_0" / "rank.json").read_bytes())
    print(f"wrote {sys.argv[1]}")
