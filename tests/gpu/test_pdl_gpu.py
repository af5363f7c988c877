"""GPU test: graphs with programmatic (PDL) edges replay exactly after LOAD.

cuBLASLt launches its split-K reduction with programmatic stream serialization, so stream capture records a
programmatic edge from the GEMM to it. Rebuilt with that edge data, a graph of split-K GEMMs with a torch
elementwise kernel between them gave other results than the captured graph, even in the capturing process
(recipes/diagnosis/runtime-probes/SPLITK.md); the rebuild now adds every edge as a full dependency (graphbuild).

- `probe`: the first shape of SHAPES at which cuBLAS launches with programmatic edges on this GPU and library (the
  test was written on an H200 where cuBLAS picked split-K at [8, 4096] x [4096, 4096]; on an H100 with torch
  2.11.0+cu130 it picked an nvjet kernel with no edge there); the steps below use it.
- `save`: four bf16 [M, D] x [D, D] matmuls with a relu between each, captured and saved; the captured graph
  replayed three times, and rebuilt in the same process from its serialized form (both rebuild paths) and replayed
  three times each.
- `load`: the same setup in a fresh process, load(), five replays compared with SAVE's.
- `forged-offset`, `forged-end`: that archive with its kernel table forged and every hash recomputed (one row's
  parameter offset moved; one row's parameters moved so that its last parameter starts inside the blob and ends past
  it): LOAD refuses, naming the graph, node, kernel and both layouts, before the driver reads a byte past the blob.
  `save` also checks that the interposer's gp_func_param_layout (LOAD) reads every kernel's layout as SAVE's
  cuda-bindings walk does.

Run: `python3 -m pytest -m gpu tests/gpu/test_pdl_gpu.py` on a GPU host (torch, cuda-bindings, gcc).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from interposed import run_step, step_main

ENGINE = {"name": "graphpersist-pdl-test", "version": "1", "commit": "none"}
MODEL = {"dtype": "bfloat16", "config_fingerprint": "pdl-v1"}
LINKS = 4
SHAPES = [(8, 4096), (8, 8192), (16, 8192), (8, 16384), (32, 16384), (1, 16384), (64, 16384), (16, 28672)]  # (M, D)


def _tensors(torch: Any, m: int, d: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = {f"w{i}": torch.randn(d, d, device="cuda", dtype=torch.bfloat16, generator=gen) / 64 for i in range(LINKS)}
    t["x"] = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return t


def _setup(shape: str) -> tuple[Any, Any, dict[str, Any]]:
    import torch

    from graphpersist import api

    api.start_region()
    m, d = (int(v) for v in shape.split("x"))
    t = _tensors(torch, m, d)
    api.mark_setup(t)
    return torch, api, t


def step_probe(_tmp: Path) -> dict[str, Any]:
    """Programmatic edges in a captured chain of each shape, up to the first shape that has them."""
    import torch
    from cuda.bindings import driver as drv

    seen: dict[str, int] = {}
    for m, d in SHAPES:
        t = _tensors(torch, m, d)
        _forward(torch, t)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=True)  # raw_cuda_graph() needs the captured graph kept
        with torch.cuda.graph(g):
            _forward(torch, t)
        graph = drv.CUgraph(g.raw_cuda_graph())
        count = drv.cuGraphGetEdges(graph, 0)[-1]
        data = drv.cuGraphGetEdges(graph, count)[3] if count else []
        seen[f"{m}x{d}"] = sum(1 for e in data if int(e.type) != 0)
        del g, t
        torch.cuda.empty_cache()
        if seen[f"{m}x{d}"] >= LINKS:
            break
    return {"edges_by_shape": seen, "shape": next((k for k, v in seen.items() if v >= LINKS), None)}


def _forward(torch: Any, t: dict[str, Any]) -> list[Any]:
    h = t["x"] @ t["w0"]
    outs = [h]
    for i in range(1, LINKS):
        h = torch.relu(h) @ t[f"w{i}"]
        outs.append(h)
    return outs


def _same(torch: Any, got: list[Any], want: list[Any]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _replays(torch: Any, launch: Any, outs: list[Any], n: int) -> list[list[Any]]:
    got = []
    for _ in range(n):
        for o in outs:
            o.fill_(7)
        launch()
        torch.cuda.synchronize()
        got.append([o.cpu() for o in outs])
    return got


def step_save(tmp: Path, shape: str) -> dict[str, Any]:
    torch, api, t = _setup(shape)
    from cuda.bindings import driver as drv
    from gpdiag import rebuild as reference

    from graphpersist.graph import build as graphbuild
    from graphpersist.graph import format as graphformat
    from graphpersist.graph import images
    from graphpersist.graph import walk as graphwalk
    from graphpersist.memory import region

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _forward(torch, t)
    torch.cuda.synchronize()
    g = api.PersistentCUDAGraph()
    with torch.cuda.graph(g):
        outs = _forward(torch, t)
    g.instantiate()
    saver = api.Saver()
    saver.add("chain", g, [t["x"]], outs)
    saver.save(tmp / "archive", api.Facts(ENGINE, MODEL))
    captured = _replays(torch, g.replay, outs, 3)
    torch.save(captured[0], tmp / "reference.pt")

    info = region.info()
    table = images.ImageTable.current()
    saved = graphwalk.serialize(drv.CUgraph(g.raw_cuda_graph()), table, info.base, info.base + info.size)
    fresh = images.LoadedImages()
    for sha in {f[0] for f in saved.desc["funcs"]}:
        fresh.load(sha, table.by_sha[sha].kind, table.by_sha[sha].data())
    stream = torch.cuda.current_stream().cuda_stream
    rebuilt = {}
    for path in ("python", "native"):
        if path == "python":
            graph = reference.rebuild(
                "chain", saved.desc, saved.blob, fresh.function, hashed=True, layouts=fresh.layout
            )
        else:
            funcs = graphbuild.LiveFuncs.of(fresh, saved.desc["funcs"])
            graph = graphbuild.rebuild_native("chain", saved.desc, saved.blob, saved.table, funcs, hashed=True)
        ex = graphbuild.instantiate("chain", graph, graphformat.INSTANTIATE_FLAGS)
        got = _replays(torch, lambda ex=ex: images.check(drv.cuGraphLaunch(ex, stream), "cuGraphLaunch"), outs, 3)
        rebuilt[path] = [_same(torch, r, captured[0]) for r in got]
    # (offset, size) pairs as lists on both sides: the native reader gives tuples, the cuda-bindings walk lists
    layouts = {f[1]: [[list(p) for p in fresh.layout(*f)],
                      [list(p) for p in graphwalk._param_layout(fresh.function(*f), f[1])]]
               for f in saved.desc["funcs"]}  # fmt: skip
    return {
        "layouts_disagree": {k: v for k, v in layouts.items() if v[0] != v[1]},
        "layouts_read": len(layouts),
        "programmatic_edges": sum(1 for e in saved.desc["edges"] if e[4]),
        "kernels": sorted({f[1][:60] for f in saved.desc["funcs"]}),
        "captured_replays_equal": [
            all(torch.equal(a, b) for a, b in zip(r, captured[0], strict=True)) for r in captured
        ],
        "rebuilt_replays_equal": rebuilt,
    }


def step_load(tmp: Path, shape: str) -> dict[str, Any]:
    torch, api, t = _setup(shape)
    res = api.load(tmp / "archive", api.Facts(ENGINE, MODEL), sizes=[], setup_tensors=t)
    lg = res.graphs["chain"]
    want = torch.load(tmp / "reference.pt")
    got = _replays(torch, lg.replay, list(lg.outputs), 5)
    return {
        "replays_equal": [_same(torch, r, want) for r in got],
        "max_abs_diff": max(
            float((a.float() - b.float()).abs().max()) for r in got for a, b in zip(r, want, strict=True)
        ),
    }


def step_forged(tmp: Path, shape: str, case: str) -> dict[str, Any]:
    """LOAD of the saved archive with its kernel table forged as a crafted archive would be (hashes recomputed)."""
    import json
    import shutil
    import struct

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
    from archive_fixtures import forge

    from graphpersist.graph.format import KNODE, TABLE_HEADER

    _torch, api, t = _setup(shape)
    root = tmp / f"forged-{case}"
    shutil.copytree(tmp / "archive", root)
    entry = next(g for g in json.loads((root / "rank_0/graphs/index.json").read_bytes())["graphs"]
                 if g["name"] == "chain")  # fmt: skip
    pack = bytearray((root / "rank_0/graphs/pack.bin").read_bytes())
    t0, blob_size = entry["table"][0], entry["own"]["blob_size"]
    n_k = TABLE_HEADER.unpack_from(pack, t0)[0]
    rows = [KNODE.unpack_from(pack, t0 + TABLE_HEADER.size + r * KNODE.size) for r in range(n_k)]
    offsets_at = t0 + TABLE_HEADER.size + n_k * KNODE.size
    if case == "offset":  # the first parameter of a row with several moves 4 bytes: still inside the blob
        at = offsets_at + 4 * next(r for r in rows if r[9] >= 2)[11]
        struct.pack_into("<I", pack, at, struct.unpack_from("<I", pack, at)[0] + 4)
    else:  # a row's parameters move so that its last one starts at the blob's last byte
        i, r = max(((i, r) for i, r in enumerate(rows) if r[9]), key=lambda ir: ir[1][10])
        last = max(struct.unpack_from(f"<{r[9]}I", pack, offsets_at + 4 * r[11]))
        struct.pack_into("<Q", pack, t0 + TABLE_HEADER.size + i * KNODE.size + 40, blob_size - 1 - last)
    forge(root, "rank_0/graphs/pack.bin", bytes(pack))
    try:
        api.load(root, api.Facts(ENGINE, MODEL), sizes=[], setup_tensors=t)
    except Exception as exc:  # what LOAD raised is the result
        return {"refused": True, "error": f"{type(exc).__name__}: {exc}"}
    return {"refused": False}


STEPS = {"save": step_save, "load": step_load}


@pytest.mark.gpu
def test_programmatic_edges_replay_exactly(tmp_path: Path) -> None:
    probed, _ = run_step(__file__, ["probe", str(tmp_path)], tmp_path / "probe.json")
    shape = probed["shape"]
    assert shape, f"precondition: cuBLAS launched no GEMM chain of {SHAPES} with programmatic edges: {probed}"
    print(f"shape {shape}: programmatic edges by shape {probed['edges_by_shape']}")
    saved, _ = run_step(__file__, ["save", str(tmp_path), shape], tmp_path / "save.json")
    assert saved["programmatic_edges"] >= LINKS, f"precondition: no programmatic edges captured: {saved}"
    assert saved["captured_replays_equal"] == [True] * 3, saved
    assert saved["rebuilt_replays_equal"] == {"python": [True] * 3, "native": [True] * 3}, saved
    assert saved["layouts_read"] >= 2 and saved["layouts_disagree"] == {}, saved
    loaded, _ = run_step(__file__, ["load", str(tmp_path), shape], tmp_path / "load.json")
    assert loaded["replays_equal"] == [True] * 5 and loaded["max_abs_diff"] == 0.0, loaded
    for case, why in (("offset", "the function's at"), ("end", "ends past the")):
        got, _ = run_step(__file__, [f"forged-{case}", str(tmp_path), shape], tmp_path / f"forged-{case}.json")
        assert got["refused"], got
        assert "graph 'chain' node " in got["error"] and "its saved parameter layout does not fit" in got["error"], got
        assert why in got["error"] and "live (offset, size)" in got["error"], got


def _step(args: list[str]) -> dict[str, Any]:
    if args[0] == "probe":
        return step_probe(Path(args[1]))
    if args[0].startswith("forged-"):
        return step_forged(Path(args[1]), args[2], args[0].removeprefix("forged-"))
    return STEPS[args[0]](Path(args[1]), args[2])


if __name__ == "__main__":
    sys.exit(step_main(_step))
