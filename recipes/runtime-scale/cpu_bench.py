"""CPU benchmark of LOAD's open + validate on an archive shaped like runtime-scale's, written without a GPU.

`python3 cpu_bench.py --out DIR` writes a synthetic archive with the runtime's own writer and pack code (51 FULL
graphs of 1000 kernel nodes, 1887 PIECEWISE graphs of 10, one rank, 2 kernel images) whose graph descriptions,
parameter blobs and kernel tables have the sizes SAVE writes for the GPU benchmark (graphwalk.serialize's layout:
two float32 elementwise kernels, every readable launch attribute of a kernel node), then times, phase by phase,
what LOAD does before it touches the GPU: open_archive (manifest, every file hashed, rank record) and the
validation steps of load._load_rank (drift rules, graph index, every graph's description against its record and
kernel table, pointer inventory, setup tensors). Live facts (collect_live) need a GPU and are not timed here.

`--heap N` keeps N small objects alive while timing, like a process that has imported torch and built an engine:
the cyclic garbage collector's passes grow with the heap, and LOAD's parsing allocates many small containers.
Numbers are this machine's; compare ratios between versions, not absolute times with the GPU host's REPORT.md.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "overlays" / "graphpersist"))

from graphpersist.archive import (  # noqa: E402
    ArchiveWriter,
    archive_path,
    codec,
    open_archive,
    safejson,
)
from graphpersist.archive.liveenv import PINNED_ENV  # noqa: E402
from graphpersist.archive.manifest import RankRecord  # noqa: E402
from graphpersist.archive.read import _read_manifest  # noqa: E402
from graphpersist.archive.validate import check_or_refuse, flatten  # noqa: E402
from graphpersist.gcpause import paused_gc  # noqa: E402
from graphpersist.graph import format as graphformat  # noqa: E402
from graphpersist.graph import pack as graphpack  # noqa: E402

SIZES = (1, 2, 4, *range(8, 8 * 49, 8))  # as model.py
FULL_LAYERS, PIECES, PIECE_LAYERS, HIDDEN = 500, 37, 5, 256
BASE, REGION_SIZE = 0x500000000000, 564 << 30
IMAGE_BYTES = (1_900_000, 900_000)  # the GPU run's 2 images, 2.8 MB
# Two torch elementwise kernels (h * w + b, then tanh), as the GPU benchmark captures them.
KERNELS = (
    (
        "_ZN2at6native29vectorized_elementwise_kernelILi4EZZZNS0_19addcmul_cuda_kernelERNS_18TensorIteratorBaseERKN3c106"
        "ScalarEENKUlvE_clEvENKUlvE2_clEvEUlfffE_St5arrayIPcLm4EEEEviT0_T1_",
        [[0, 4], [4, 4], [8, 32]],
    ),
    (
        "_ZN2at6native29vectorized_elementwise_kernelILi4EZZZNS0_16tanh_kernel_cudaERNS_18TensorIteratorBaseEENKUlvE_"
        "clEvENKUlvE0_clEvEUlfE_St5arrayIPcLm2EEEEviT0_T1_",
        [[0, 4], [4, 1], [8, 16]],
    ),
)
# Every launch attribute a kernel node reads back on an H200 with CUDA 13 (id -> value, trailing zeros cut as
# graphwalk stores it): 14 attributes, most of them zero. 72 bytes each in the kernel table.
ATTRS = {
    "1": "", "2": "", "3": "", "4": "010000000100000001", "5": "", "6": "", "8": "", "9": "0001", "10": "",
    "11": "", "13": "", "14": "", "16": "", "17": "",
}  # fmt: skip
FATTRS = {"8": 0, "9": -1, "11": 0, "12": 0, "13": 0, "14": 0, "15": 0}
WORLD = {
    "engine": {"name": "graphpersist-scale-proof", "version": "1", "commit": "none"},
    "distribution": {"version": "1"},
    "torch": {"version": "2.11.0+cu130"},
    "cuda": {"runtime": "13.0", "driver": "580.159.04", "driver_api": "13.0"},
    "nccl": {"version": "2.28.9"},
    "gpu": {"model": "NVIDIA H200", "compute_capability": "9.0"},
    "parallel": {"world_size": 1, "tp_size": 1, "pp_size": 1, "ep_size": 1},
    "model": {"dtype": "float32", "config_fingerprint": "0" * 32},
    "capture": {"sizes": list(SIZES), "modes": ["full", "piecewise"]},
    "env": {name: None for name in PINNED_ENV} | {"NCCL_NVLS_ENABLE": "0", "GP_REGION_BASE": hex(BASE)},
    "flags": {},
}
DEVICE = {"index": 0, "uuid": "GPU-11111111-2222-3333-4444-555555555555", "pci_bus_id": "0000:19:00.0"}


def _spec(addr: int, b: int) -> dict[str, Any]:
    return {"addr": addr, "dtype": "float32", "shape": [b, HIDDEN], "stride": [HIDDEN, 1]}


def _graph(n_layers: int, b: int, base: int, images: list[str]) -> tuple[dict[str, Any], bytes]:
    """A description and parameter blob as graphwalk.serialize writes them for n_layers x (addcmul, tanh)."""
    nodes, blob = [], bytearray()
    funcs = [[images[k % len(images)], name, dict(FATTRS)] for k, (name, _layout) in enumerate(KERNELS)]
    n = b * HIDDEN
    grid = [max(1, -(-n // 512)), 1, 1]
    for i in range(2 * n_layers):
        k = i % 2
        name, layout = KERNELS[k]
        size = layout[-1][0] + layout[-1][1]
        words = [base + 4096 * (i + j) for j in range(1 + (size - 8) // 8)]
        params = n.to_bytes(4, "little") + bytes(4) + b"".join(w.to_bytes(8, "little") for w in words)[: size - 8]
        nodes.append({"type": "kernel", "func": k, "image": funcs[k][0], "name": name, "grid": grid,
                      "block": [128, 1, 1], "smem": 0, "layout": layout, "params": [len(blob), size],
                      "attrs": dict(ATTRS)})  # fmt: skip
        blob += params
    edges = [[i, i + 1, 0, 0, 0] for i in range(len(nodes) - 1)]
    desc = {"format": 1, "nodes": nodes, "edges": edges, "funcs": funcs, "blob_size": len(blob)}
    desc["blob_sha256"] = hashlib.sha256(blob).hexdigest()
    return desc, bytes(blob)


def write(root: Path) -> dict[str, Any]:
    """The synthetic archive, through ArchiveWriter and graphpack.PackWriter as SAVE writes it."""
    t0 = time.perf_counter()
    if root.exists():
        shutil.rmtree(root)
    w = ArchiveWriter(root, WORLD)
    image_records, shas = [], []
    for i, size in enumerate(IMAGE_BYTES):
        data = hashlib.shake_256(f"image {i}".encode()).digest(size)
        sha = hashlib.sha256(data).hexdigest()
        rel = w.add_file(0, f"images/{sha}.bin", data)
        image_records.append({"sha256": sha, "file": rel, "size": size, "kind": "cubin", "entries": [KERNELS[i][0]]})
        shas.append(sha)
    pack = graphpack.PackWriter()
    index_rel = archive_path(0, graphpack.INDEX_NAME)
    records, fps, pointers = [], {}, set()
    addr = BASE + (1 << 30)
    for b in sorted(SIZES, reverse=True):
        shapes = [(f"FULL/bs{b}", FULL_LAYERS, "full")] + [
            (f"PIECEWISE/bs{b}/piece{p}", PIECE_LAYERS, "piecewise") for p in range(PIECES)
        ]
        x = BASE + 4096
        for name, layers, mode in shapes:
            desc, blob = _graph(layers, b, addr, shas)
            table = graphformat.pack_kernel_table(desc)
            desc["table_size"], desc["table_sha256"] = len(table), hashlib.sha256(table).hexdigest()
            out = addr + 4096 * 2 * layers
            outputs: dict[str, Any] = {"kind": "tensor", "spec": _spec(out, b)}
            if mode == "full":
                outputs = {"kind": "dataclass", "type": "runtime_scale.full_output", "fields": {
                    "hidden": outputs, "extras": {"kind": "dict", "keys": ["residual", "batch"], "items": [
                        {"kind": "tuple", "items": [{"kind": "tensor", "spec": _spec(out, 1)},
                                                    {"kind": "value", "value": None}]},
                        {"kind": "value", "value": b}]}, "step": {"kind": "value", "value": layers}}}  # fmt: skip
            pack.add(name, desc, blob, table, inputs=[_spec(x, b)], outputs=outputs)
            x = out
            pointers.update(range(addr, out, 4096 * 64))
            by_type = {"kernel": len(desc["nodes"])}
            topology = graphformat.topology_fingerprint(desc)
            records.append({"name": name, "file": index_rel, "topology_fingerprint": topology,
                            "node_count": len(desc["nodes"]), "nodes_by_type": by_type,
                            "kernel_count": len(desc["nodes"]), "images": sorted(shas), "capture_size": b,
                            "mode": mode})  # fmt: skip
            fps[name] = graphformat.address_fingerprint(desc, blob, BASE, BASE + REGION_SIZE)
            addr = out + 4096
    ptrs = sorted(pointers)[:1973]
    setup_tensors = [[f"w.{i}", BASE + 4096 * i, "float32", [HIDDEN], [1]] for i in range(33)]
    w.add_json(0, "alloc_log.json", [["alloc", BASE + (i << 21), 2 << 20, 2 << 20] for i in range(600)])
    w.add_json(0, "pointers.json", ptrs)
    w.add_json(0, "setup_tensors.json", setup_tensors)
    w.add_file(0, graphpack.PACK_NAME, pack.data())
    w.add_json(0, graphpack.INDEX_NAME, pack.index())
    w.set_rank_facts(0, {
        "rank": 0, "device": DEVICE, "region": {"base": BASE, "size": REGION_SIZE, "final_offset": addr - BASE},
        "pointers": {"fingerprint": hashlib.sha256(json.dumps(ptrs).encode()).hexdigest(), "count": len(ptrs)},
        "graphs": records, "images": image_records,
        "extra": {"setup_events": 40, "setup_cursor": 1 << 30, "address_fingerprints": fps, "granularity": 2 << 20,
                  "phases": [], "state": []},
    })  # fmt: skip
    w.commit()
    files = [p for p in root.rglob("*") if p.is_file()]
    return {"write_s": time.perf_counter() - t0, "files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "sizes": {p.relative_to(root).as_posix(): p.stat().st_size for p in files}}  # fmt: skip


def _live(arch: Any) -> dict[str, Any]:
    """What collect_live would report on the SAVE host: the archive's own world and rank facts."""
    rec = arch.rank_facts(0)
    live = flatten(codec.to_dict(arch.manifest.world))
    live |= {"parallel.rank": 0, "device.index": rec.device.index, "device.uuid": rec.device.uuid,
             "device.pci_bus_id": rec.device.pci_bus_id, "region.base": rec.region.base,
             "region.size": rec.region.size, "format_version": arch.manifest.format_version}  # fmt: skip
    return live


def once(root: Path) -> dict[str, float]:
    """One open + validate, as load._load_rank does it, timed step by step (seconds)."""
    t: dict[str, float] = {}
    clock = time.perf_counter

    def step(name: str, fn: Callable[[], Any]) -> Any:
        a = clock()
        out = fn()
        t[name] = clock() - a
        return out

    arch = step("open_archive", lambda: open_archive(root, keep_rank=0))
    live = _live(arch)
    step("drift rules", lambda: check_or_refuse(arch, live, 0))
    rec = arch.rank_facts(0)
    packed = step("graph index", lambda: graphpack.read_graphs(arch, 0, [g.name for g in rec.graphs]))
    step("graph descriptions", lambda: graphpack.check_graphs(rec.graphs, packed, full=False))
    step("pointers", lambda: graphpack.read_pointers(arch, 0, rec.pointers.fingerprint))
    step("setup tensors", lambda: arch.read_json(0, "setup_tensors.json"))
    t["open + validate"] = sum(t.values())
    # Inside open_archive (informational, separate calls): manifest, hashing, the rank record.
    step("  manifest.json", lambda: _read_manifest(root))
    step("  read + sha256 of every file", lambda: [hashlib.sha256(p.read_bytes()) for p in root.rglob("*")
                                                   if p.is_file()])  # fmt: skip
    text = (root / "rank_0" / "rank.json").read_bytes()
    tree = step("  rank.json: safejson", lambda: safejson.loads(text))
    step("  rank.json: records", lambda: codec.from_dict(RankRecord, tree))
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/gp-cpu-bench"), help="where to write the archive")
    ap.add_argument("--runs", type=int, default=5, help="timed runs (the best is reported: the machine may be shared)")
    ap.add_argument("--heap", type=int, default=0, help="small objects kept alive while timing (a torch process)")
    ap.add_argument("--gc", action="store_true", help="leave the garbage collector on (LOAD pauses it)")
    ap.add_argument("--reuse", action="store_true", help="time an archive already written to --out")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()
    root = args.out / "archive"
    info = None if args.reuse else write(root)
    if info:
        print(f"wrote {root}: {info['files']} files, {info['bytes'] / 1e6:.1f} MB in {info['write_s']:.1f} s")
        for rel, size in sorted(info["sizes"].items(), key=lambda kv: -kv[1])[:4]:
            print(f"  {rel}: {size / 1e6:.1f} MB")
    heap = [(i,) for i in range(args.heap)]  # noqa: F841 (kept alive on purpose)
    gc.collect()
    runs = []
    for _ in range(args.runs + 1):  # the first run warms the page cache
        if args.gc:
            runs.append(once(root))
        else:
            with paused_gc():  # as load.load() runs _load_rank
                runs.append(once(root))
    runs = runs[1:]
    med = {k: min(r[k] for r in runs) for k in runs[0]}
    print(f"cpus {os.cpu_count()}, heap {args.heap}, gc {'on' if args.gc else 'paused'}, best of {args.runs} runs")
    print("| step | ms |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"info": info, "median_s": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
