"""Diagnosis: split-K matmuls saved in one process and loaded in another, link by link and buffer by buffer.

The probe that found why the 36-layer proof at Qwen3-8B's shape gave wrong LOAD outputs where cuBLAS picks split-K
kernels (SPLITK.md). `save DIR` captures a chain of `--chain N` bf16 matmuls (the first `o = x @ w`, [m, k] x
[k, n], deterministic inputs; `--between relu` puts a torch elementwise kernel between links) as
PersistentCUDAGraph, keeps every link's output, saves, replays and records, for every in-region pointer in every
kernel node's parameters, the bytes behind it after the replay (hash, and the first 4 MiB); `--roundtrip` also
rebuilds the serialized graph in the capturing process as LOAD does, without edge data, and as the driver's clone,
replays each three times and times them. `load DIR` runs the same setup in a fresh process, loads the archive,
replays and compares link by link and buffer by buffer. Options of `load`: `--python-rebuild` (the reference
rebuild instead of the interposer's native one), `--warm` (an eager forward before the replay), `--replays N`.
`kernels` only captures one matmul and prints the kernels cuBLAS picked (to try workspace settings).

    Run from the repository root on a GPU host:
    python3 recipes/diagnosis/runtime-probes/xproc_probe.py save /tmp/x --chain 2 --between relu --roundtrip
    python3 recipes/diagnosis/runtime-probes/xproc_probe.py load /tmp/x --chain 2 --between relu [--python-rebuild]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

from matmulgraph import fresh_images, kernel_nodes  # also puts the runtime on sys.path

ENGINE = {"name": "graphpersist-xproc-probe", "version": "1", "commit": "none"}
KEEP = 4 << 20  # bytes kept per buffer for an element-wise comparison


def _setup(m: int, k: int, n: int, chain: int = 1) -> tuple[Any, Any, dict[str, Any]]:
    """Region, then the weights, input and output from a fixed generator: the same in both processes. Links after
    the first multiply by [n, n] weights."""
    from graphpersist.memory import region

    region.reexec_with_interposer()
    import torch

    from graphpersist import api

    api.start_region()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
    more = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen) * n**-0.5 for _ in range(chain - 1)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    o = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
    tensors = {"w": w, "x": x, "o": o} | {f"w{i + 1}": t for i, t in enumerate(more)}
    api.mark_setup(tensors)
    torch.cuda.synchronize()
    return torch, api, tensors


def _facts(a: argparse.Namespace) -> dict[str, str]:
    return {"dtype": "bfloat16", "config_fingerprint": f"{a.m}x{a.k}x{a.n}x{a.chain}-{a.between}"}


def _kernel_pointers(graph: Any) -> list[dict[str, Any]]:
    """Per kernel node: its name, parameter bytes (hex) and the aligned in-region words with the live range
    behind each."""
    from graphpersist.graph.walk import _param_layout, _read_params
    from graphpersist.memory import region
    from graphpersist.memory.phases import find_range

    info = region.info()
    lo, hi = info.base, info.base + info.size
    live = sorted(region.live_ranges(region.events()))
    out = []
    for _nd, p, name in kernel_nodes(graph):
        params = _read_params(p, _param_layout(p.func, name), name)
        ptrs = []
        for off in range(0, len(params) - 7, 8):
            v = int.from_bytes(params[off : off + 8], "little")
            if lo <= v < hi:
                rng = find_range(live, v)
                ptrs.append({"off": off, "addr": v, "range": list(rng) if rng else None})
        grid = (p.gridDimX, p.gridDimY, p.gridDimZ)
        out.append({"name": name, "params": params.hex(), "grid": grid, "pointers": ptrs})
    return out


def _buffers(torch: Any, kernels: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The bytes behind each distinct pointer, to the end of its live range: hash and the first KEEP bytes."""
    from graphpersist.memory.tensors import bytes_at

    torch.cuda.synchronize()
    out = {}
    for k in kernels:
        for p in k["pointers"]:
            if p["range"] is None or p["addr"] in out:
                continue
            start, size = p["range"]
            n = min(start + size - p["addr"], 64 << 20)
            data = bytes_at(p["addr"], n).cpu()
            out[p["addr"]] = {
                "len": n,
                "sha": hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16],
                "head": data[:KEEP].clone(),
            }
    return out


def _torch_block(torch: Any, addr: int) -> str:
    """What torch's allocator says about an address: the block holding it and its state, or 'not torch'."""
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= addr < seg["address"] + seg["total_size"]:
            at = seg["address"]
            for b in seg["blocks"]:
                if at <= addr < at + b["size"]:
                    return (
                        f"torch {b['state']} block {at:#x}+{b['size']} (segment {seg['address']:#x}, {seg['stream']})"
                    )
                at += b["size"]
    return "not torch's"


def _forward(torch: Any, t: dict[str, Any], a: argparse.Namespace) -> list[Any]:
    """o = x @ w, then `chain - 1` more links (an optional elementwise op, then a matmul into graph-pool memory);
    every link's output is kept, so each can be compared after a replay."""
    h = torch.matmul(t["x"], t["w"], out=t["o"])
    outs = [h]
    for i in range(1, a.chain):
        if a.between == "relu":
            h = torch.relu(h)
        h = h @ t[f"w{i}"]
        outs.append(h)
    return outs


def _compare(torch: Any, label: str, got: list[Any], want: list[Any]) -> None:
    """One line per link: identical, or the max abs difference."""
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not torch.equal(g, w)]
    print(f"{label}: {len(got) - len(bad)}/{len(got)} links identical; first differing link {bad[0] if bad else None}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not torch.equal(g, w):
            print(f"  link {i}: max abs diff {float((g.float() - w.float()).abs().max())}")


def _roundtrip(torch: Any, graph: Any, t: dict[str, Any], outs: list[Any], want: list[Any]) -> None:
    """The captured graph serialized as SAVE does, rebuilt in this process with fresh image copies (as LOAD does),
    replayed three times and compared with the captured graph's replay; also rebuilt with variations of the edges
    and launch attributes, and cloned by the driver, to find what the rebuild changes."""
    import copy

    from cuda.bindings import driver as drv
    from gpdiag import rebuild as reference

    from graphpersist.graph import build as graphbuild
    from graphpersist.graph import images
    from graphpersist.graph import walk as graphwalk
    from graphpersist.memory import region

    info = region.info()
    table = images.ImageTable.current()
    saved = graphwalk.serialize(graph, table, info.base, info.base + info.size)
    print("edges [from, to, from_port, to_port, type]:", saved.desc["edges"])
    for i, nd in enumerate(saved.desc["nodes"]):
        attrs = {k: v for k, v in nd.get("attrs", {}).items() if v}
        print(f"node {i} {nd['type']} {nd.get('name', '')[:50]} grid {nd.get('grid')} block {nd.get('block')} "
              f"smem {nd.get('smem')} attrs {attrs}")  # fmt: skip
    fresh = fresh_images(table, saved.desc)

    def plain_edges(d: dict[str, Any]) -> None:
        d["edges"] = [[e[0], e[1], 0, 0, 0] for e in d["edges"]]

    variants: dict[str, Any] = {
        "as LOAD rebuilds it": lambda d: None,
        "edges without data": plain_edges,
    }
    stream = torch.cuda.current_stream().cuda_stream
    execs = {}
    for label, change in variants.items():
        desc = copy.deepcopy(saved.desc)
        change(desc)
        execs[label] = graphbuild.instantiate(
            "probe", reference.rebuild("probe", desc, saved.blob, fresh.function, hashed=True), 0
        )
    execs["driver clone of the captured graph"] = images.check(
        drv.cuGraphInstantiate(images.check(drv.cuGraphClone(graph), "cuGraphClone"), 0), "cuGraphInstantiate"
    )
    execs["the captured graph"] = images.check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    for label, ex in execs.items():
        for trial in range(3):
            for o in outs:
                o.fill_(7)
            images.check(drv.cuGraphLaunch(ex, stream), "cuGraphLaunch")
            torch.cuda.synchronize()
            _compare(torch, f"rebuilt in SAVE's process, {label}, replay {trial + 1}", [o.cpu() for o in outs], want)
        t0 = time.perf_counter()
        for _ in range(200):
            images.check(drv.cuGraphLaunch(ex, stream), "cuGraphLaunch")
        torch.cuda.synchronize()
        print(f"  {label}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us per replay")


def step_save(a: argparse.Namespace) -> int:
    torch, api, t = _setup(a.m, a.k, a.n, a.chain)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _forward(torch, t, a)
    torch.cuda.synchronize()
    g = api.PersistentCUDAGraph()
    with torch.cuda.graph(g):
        outs = _forward(torch, t, a)
    g.instantiate()
    saver = api.Saver()
    saver.add("g", g, [t["x"]], outs, capture_size=a.m, mode="full")
    saver.save(a.dir / "archive", api.Facts(ENGINE, _facts(a)))
    from cuda.bindings import driver as drv

    graph = drv.CUgraph(g.raw_cuda_graph())
    kernels = _kernel_pointers(graph)
    for o in outs:
        o.fill_(7)
    g.replay()
    bufs = _buffers(torch, kernels)
    want = [o.cpu() for o in outs]
    eager = _forward(torch, {**t, "o": torch.empty_like(t["o"])}, a)
    _compare(torch, "SAVE replay vs eager", want, [e.cpu() for e in eager])
    g.replay()
    torch.cuda.synchronize()
    _compare(torch, "SAVE second replay", [o.cpu() for o in outs], want)
    for k in kernels[: 2 * 3]:
        print(f"kernel {k['name'][:90]} grid {k['grid']}")
        for p in k["pointers"]:
            b = bufs.get(p["addr"])
            print(f"  param bytes {p['off']}: {p['addr']:#x} range {p['range']} {_torch_block(torch, p['addr'])}"
                  f" sha {b and b['sha']}")  # fmt: skip
    print("kernels:", sorted({k["name"][:70] for k in kernels}))
    torch.save({"kernels": kernels, "buffers": bufs, "outs": want}, a.dir / "save.pt")
    if a.roundtrip:
        _roundtrip(torch, graph, t, outs, want)
    return 0


def step_load(a: argparse.Namespace) -> int:
    torch, api, t = _setup(a.m, a.k, a.n, a.chain)
    import contextlib

    from gpdiag import rebuild as reference

    with reference.in_load() if a.python_rebuild else contextlib.nullcontext():
        res = api.load(a.dir / "archive", api.Facts(ENGINE, _facts(a)), sizes=[a.m], modes=["full"], setup_tensors=t)
    saved = torch.load(a.dir / "save.pt")
    if a.warm:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            _forward(torch, {**t, "o": torch.empty_like(t["o"])}, a)
        torch.cuda.synchronize()
    lg = res.graphs["g"]
    kernels = _kernel_pointers(lg.graph)
    same = sum(mine["params"] == theirs["params"] for mine, theirs in zip(kernels, saved["kernels"], strict=True))
    print(f"LOAD: {same} of {len(kernels)} kernel nodes have SAVE's parameter bytes")
    for r in range(a.replays):
        for o in lg.outputs:
            o.fill_(7)
        lg.replay()
        bufs = _buffers(torch, saved["kernels"])
        _compare(torch, f"LOAD replay {r + 1}", [o.cpu() for o in lg.outputs], saved["outs"])
        for addr, b in bufs.items():
            want = saved["buffers"][addr]
            if b["sha"] == want["sha"]:
                continue
            diff = (b["head"] != want["head"]).nonzero()
            first = int(diff[0]) if len(diff) else -1
            f32 = b["head"][: len(b["head"]) // 4 * 4].view(torch.float32)
            w32 = want["head"][: len(want["head"]) // 4 * 4].view(torch.float32)
            d32 = (f32 - w32).abs()
            print(f"  buffer {addr:#x} ({b['len']} bytes): DIFFERS, {len(diff)} of the first {len(b['head'])} bytes, "
                  f"first at +{first}; as fp32 max abs diff {float(d32.nan_to_num().max())}, "
                  f"first words {f32[first // 4 : first // 4 + 4].tolist()} "
                  f"vs {w32[first // 4 : first // 4 + 4].tolist()}; "
                  f"{_torch_block(torch, addr)}")  # fmt: skip
    return 0


def step_kernels(a: argparse.Namespace) -> int:
    torch, _api, t = _setup(a.m, a.k, a.n)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.matmul(t["x"], t["w"], out=t["o"])  # cuBLAS initialised outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        torch.matmul(t["x"], t["w"], out=t["o"])
    print(f"[{a.m}, {a.k}] x [{a.k}, {a.n}]:", [name[:80] for _nd, _p, name in kernel_nodes(g.raw_cuda_graph())])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["save", "load", "kernels"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--python-rebuild", action="store_true", help="LOAD through the reference rebuild")
    ap.add_argument("--warm", action="store_true", help="LOAD: an eager matmul on a side stream before replaying")
    ap.add_argument("--replays", type=int, default=2)
    ap.add_argument("--chain", type=int, default=1, help="matmuls in a row, each link's output kept")
    ap.add_argument("--between", choices=["none", "relu"], default="none", help="an op between the links")
    ap.add_argument("--roundtrip", action="store_true", help="SAVE: also rebuild the graph in this process")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    return {"save": step_save, "load": step_load, "kernels": step_kernels}[a.step](a)


if __name__ == "__main__":
    sys.exit(main())
