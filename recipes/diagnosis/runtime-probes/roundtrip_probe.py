"""Diagnosis: a graph rebuilt in the process that captured it, with its kernels from the library's own module or
from a freshly loaded copy of the same image.

A LOAD at Qwen3-8B's o_proj shape ([8, 4096] x [4096, 4096] bf16, where cuBLAS picks split-K kernels) gives wrong
outputs, while the same graph in the SAVE process gives the same outputs whatever capture-time memory holds
(RUNTIME_PROOF_SAVE_FILL). This script captures that matmul under the interposer, serializes it as SAVE does,
rebuilds it in the same process once per variant (every kernel from the original module; every kernel from a fresh
copy of its image, as LOAD does; only the split-K GEMM or only the reduction kernel from a fresh copy), replays
each on the same input and compares with the captured graph's output.

    python3 recipes/diagnosis/runtime-probes/roundtrip_probe.py [--m 8] [--k 4096] [--n 4096]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from matmulgraph import arguments, capture, fresh_images


def main() -> int:
    a = arguments(__doc__)
    c = capture(a.m, a.k, a.n)
    torch, drv, x, w, o, g = c.torch, c.drv, c.x, c.w, c.o, c.g
    from gpdiag import rebuild as reference

    from graphpersist.graph import build as graphbuild
    from graphpersist.graph import images
    from graphpersist.graph import walk as graphwalk

    o.zero_()
    g.replay()
    torch.cuda.synchronize()
    ref = o.clone()
    eager = x @ w
    print(f"captured graph vs eager matmul: max abs diff {float((ref.float() - eager.float()).abs().max())}")
    table = images.ImageTable.current()
    saved = graphwalk.serialize(c.graph, table, c.info.base, c.info.base + c.info.size)
    original: dict[tuple[str, str], Any] = {}
    for _nd, p, _name in c.kernel_nodes():
        sha, name, _load = table.resolve(p.func)
        original[(sha, name)] = drv.CUfunction(int(p.func))  # a handle of its own, not a view into the params
    fresh = fresh_images(table, saved.desc)
    print("kernels:", [n[:60] for _s, n in original])

    def pick(rule: Callable[[str], bool]) -> Callable[[str, str, dict[str, int]], Any]:
        return lambda sha, name, attrs: fresh.function(sha, name, attrs) if rule(name) else original[(sha, name)]

    variants = {
        "original modules": pick(lambda n: False),
        "fresh copies (as LOAD)": pick(lambda n: True),
        "fresh split-K GEMM only": pick(lambda n: "splitK" in n and "reduce" not in n),
        "fresh reduction only": pick(lambda n: "splitKreduce" in n),
    }
    stream = torch.cuda.current_stream().cuda_stream
    for label, funcs in variants.items():
        rebuilt = reference.rebuild("probe", saved.desc, saved.blob, funcs, hashed=True)  # size check only
        ex = graphbuild.instantiate("probe", rebuilt, 0)
        for trial in range(2):
            o.fill_(7)
            images.check(drv.cuGraphLaunch(ex, stream), "cuGraphLaunch")
            torch.cuda.synchronize()
            diff = float((o.float() - ref.float()).abs().max())
            same = "identical" if torch.equal(o, ref) else "DIFFERS"
            print(f"{label} (replay {trial + 1}): {same}, max abs diff {diff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
