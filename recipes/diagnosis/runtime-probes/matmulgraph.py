"""What the split-K probes share: one bf16 matmul captured under the interposer, and the kernel nodes of its graph.

Setup (the weight, input and output tensors, named in mark_setup()), a warm-up on a side stream, then the capture,
in the order the runtime proof uses. Each probe re-executes itself under the interposer first (`capture` does).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "overlays" / "graphpersist"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))  # gpdiag: the reference rebuild


def arguments(doc: str, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """--m/--k/--n (default Qwen3-8B's o_proj at batch 8, where cuBLAS picks split-K) and the probe's own options."""
    ap = parser or argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--m", type=int, default=8, help="rows of the input (the batch)")
    ap.add_argument("--k", type=int, default=4096, help="the reduced dimension")
    ap.add_argument("--n", type=int, default=4096, help="columns of the weight")
    return ap.parse_args()


@dataclass
class Captured:
    torch: Any
    drv: Any
    info: Any  # the region (graphpersist.memory.region.RegionInfo)
    x: Any
    w: Any
    o: Any
    g: Any  # torch.cuda.CUDAGraph, kept
    graph: Any  # its CUgraph

    def kernel_nodes(self) -> Iterator[tuple[Any, Any, str]]:
        return kernel_nodes(self.graph)


def kernel_nodes(graph: Any) -> Iterator[tuple[Any, Any, str]]:
    """(node, kernel node parameters, kernel name) of every kernel node of a CUgraph (or its handle as an int)."""
    from cuda.bindings import driver as drv

    graph = drv.CUgraph(int(graph))
    for nd in drv.cuGraphGetNodes(graph, drv.cuGraphGetNodes(graph, 0)[2])[1]:
        if drv.cuGraphNodeGetType(nd)[1] != drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        p = drv.cuGraphKernelNodeGetParams(nd)[1]
        name = drv.cuFuncGetName(p.func)[1]
        yield nd, p, name.decode() if isinstance(name, bytes) else str(name)


def fresh_images(table: Any, desc: dict[str, Any]) -> Any:
    """Freshly loaded copies (graphpersist.graph.images.LoadedImages) of every image a serialized graph's kernels come
    from, as LOAD loads them; `table` is the capturing process's ImageTable."""
    from graphpersist.graph import images

    fresh = images.LoadedImages()
    for sha in {f[0] for f in desc["funcs"]}:
        fresh.load(sha, table.by_sha[sha].kind, table.by_sha[sha].data())
    return fresh


def capture(m: int, k: int, n: int) -> Captured:
    """Re-executes under the interposer, then sets up, warms up and captures `o = x @ w` ([m, k] x [k, n], bf16)."""
    from graphpersist.memory import region

    region.reexec_with_interposer()
    import torch
    from cuda.bindings import driver as drv

    from graphpersist import api

    info = api.start_region()
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k**-0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    api.mark_setup({"w": w, "x": x, "o": o})
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.matmul(x, w, out=o)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        torch.matmul(x, w, out=o)
    return Captured(torch, drv, info, x, w, o, g, drv.CUgraph(g.raw_cuda_graph()))
