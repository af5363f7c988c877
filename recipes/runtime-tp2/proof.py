"""GPU proof of tensor-parallel persistence on 2 GPUs: NCCL, symmetric-memory and IPC all-reduce graphs.

`python3 proof.py prove --out DIR --report REPORT.md` runs, for each variant (nccl, symm, ipc), four process
groups of 2 ranks each: baseline (no interposer, plain capture), SAVE, SAVE2 and LOAD, then three drift groups
against the nccl archive (world size 1, ranks on swapped GPUs, a different NCCL setting). It compares what the
groups wrote and renders REPORT.md. `python3 proof.py rank ...` is one rank of one group (what `prove` starts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "overlays" / "graphpersist"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(HERE))

from gptools import hostkit  # noqa: E402  (the runtime recipes' shared host plumbing)
from gptools.hostkit import group_errors, group_ok  # noqa: E402

VARIANTS = ("nccl", "symm", "ipc")
ENGINE = {"name": "graphpersist-tp2-proof", "version": "1", "commit": "none"}
PINNED_ENV = {
    **hostkit.PINNED_ENV,
    "NCCL_RUNTIME_CONNECT": "0",  # connect every channel at init: no NCCL buffer appears after setup
}
INPUT_SEED = 7
GROUP_TIMEOUT = 240
VERSIONS = ("torch", "nccl", "triton", "cuda-bindings")  # the report's versions block, after host, GPUs and python


# ------------------------------------------------------------------------------------------- one rank


def _rank_main(a: argparse.Namespace) -> dict[str, Any]:
    """One rank: setup, then baseline capture, SAVE, or LOAD; replays fixed inputs and returns the outputs."""
    import torch

    t0 = time.perf_counter()
    persist = a.mode != "baseline"
    device = (a.world - 1 - a.rank) if a.swap else a.rank
    torch.cuda.set_device(device)
    if persist:
        from graphpersist import api

        api.start_region()  # before NCCL allocates anything
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=a.rank, world_size=a.world, device_id=torch.device("cuda", device))
    from model import SIZES, TPModel, inputs_for

    captures = {"n": 0}
    real_begin = torch.cuda.CUDAGraph.capture_begin

    def counting_begin(self: Any, *args: Any, **kw: Any) -> Any:
        captures["n"] += 1
        return real_begin(self, *args, **kw)

    torch.cuda.CUDAGraph.capture_begin = counting_begin  # LOAD must not capture: counted, not assumed
    model = TPModel(a.variant, a.rank, a.world)
    t_setup = time.perf_counter()
    res: dict[str, Any] = {"rank": a.rank, "device": device, "setup_s": t_setup - t0}
    parallel = {"world_size": a.world, "tp_size": a.world}
    graphs: dict[int, Any] = {}
    if a.mode in ("baseline", "save"):
        if persist:
            api.mark_setup(model.named_tensors())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in SIZES:
                for _ in range(2):
                    model.forward(b)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        saver = api.Saver() if persist else None
        per = {}
        for b in sorted(SIZES, reverse=True):
            g = api.PersistentCUDAGraph() if persist else torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            c0 = time.perf_counter()
            with torch.cuda.graph(g, pool=pool):
                out = model.forward(b)
            torch.cuda.synchronize()
            c1 = time.perf_counter()
            if persist:
                g.instantiate()  # keep_graph=True graphs instantiate on demand
            torch.cuda.synchronize()
            per[f"b{b}"] = {"capture_ms": 1e3 * (c1 - c0), "instantiate_ms": 1e3 * (time.perf_counter() - c1)}
            graphs[b] = (g.replay, out)
            if saver:
                saver.add(f"b{b}", g, [model.x[:b]], [out], capture_size=b, mode="full")
        res["capture"] = per
        if saver:
            s0 = time.perf_counter()
            res["save"] = saver.save(a.archive, api.Facts(ENGINE, model.facts(), parallel=parallel), rank=a.rank)
            res["save_s"] = time.perf_counter() - s0
    else:  # load (and the drift modes, which must be refused)
        l0 = time.perf_counter()
        try:
            loaded = api.load(
                a.archive,
                api.Facts(ENGINE, model.facts(), parallel=parallel),
                sizes=SIZES,
                modes=["full"],
                rank=a.rank,
                setup_tensors=model.named_tensors(),
            )
        except Exception as exc:
            res["refused"] = {"type": type(exc).__name__, "message": str(exc)}
            res["captures"] = captures["n"]
            return res
        res["load_s"] = time.perf_counter() - l0
        res["load_timings"] = loaded.timings
        res["restored"] = {n: {"nodes": g.node_count, "rebuild_ms": 1e3 * g.rebuild_s,
                               "instantiate_ms": 1e3 * g.instantiate_s} for n, g in loaded.graphs.items()}  # fmt: skip
        for b in SIZES:
            lg = loaded.graphs[f"b{b}"]
            graphs[b] = (lg.replay, lg.outputs[0])
            res.setdefault("input_at_model_buffer", []).append(lg.inputs[0].data_ptr() == model.x.data_ptr())
    outs = {}
    for b in SIZES:
        replay, out = graphs[b]
        model.x[:b].copy_(inputs_for(b, model.dtype, INPUT_SEED))
        torch.cuda.synchronize()
        dist.barrier()
        replay()
        torch.cuda.synchronize()
        outs[f"b{b}"] = out.detach().float().cpu().tolist()
    res["outputs"] = outs
    res["captures"] = captures["n"]
    if a.mode == "load":  # no warm-up/JIT: the only module loads are the archive's own module images
        from graphpersist import api

        res["module_loads"] = sum(1 for m in api.image_loads() if m.kind != "library")
        rec = api.open_archive(a.archive).rank_facts(a.rank)
        res["archived_module_images"] = sum(1 for im in rec.images if im.kind != "library")
    dist.barrier()
    return res


def rank_entry(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="proof.py rank", description="one rank of one proof group")
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("mode", choices=["baseline", "save", "load"])
    ap.add_argument("archive")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--swap", action="store_true", help="put rank r on GPU world-1-r")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    if a.mode != "baseline":
        from graphpersist import api

        api.reexec_with_interposer()
    hostkit.finish_rank(a.rank, Path(a.result), lambda: _rank_main(a))


# ------------------------------------------------------------------------------------------- groups


def run_group(name: str, out: Path, variant: str, mode: str, archive: Path, world: int = 2, swap: bool = False,
              env_extra: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Starts `world` rank processes, waits for all (killing them at the timeout), returns their results."""
    from graphpersist import api

    env = {**(api.preload_env() if mode != "baseline" else os.environ), **PINNED_ENV, **(env_extra or {})}

    def argv(r: int, result: Path) -> list[str]:
        return [sys.executable, __file__, "rank", variant, mode, str(archive), "--rank", str(r), "--world",
                str(world), "--result", str(result)] + (["--swap"] if swap else [])  # fmt: skip

    return hostkit.run_ranks(name, out, world, argv, env, GROUP_TIMEOUT, "tp2")


def compare_archives(a: Path, b: Path, world: int) -> dict[str, bool]:
    same: dict[str, bool] = {}
    for r in range(world):
        ra = json.loads((a / f"rank_{r}" / "rank.json").read_text())
        rb = json.loads((b / f"rank_{r}" / "rank.json").read_text())
        same[f"rank {r}: region offsets"] = ra["region"] == rb["region"]
        same[f"rank {r}: allocation log"] = (a / f"rank_{r}/alloc_log.json").read_bytes() == (
            b / f"rank_{r}/alloc_log.json"
        ).read_bytes()
        same[f"rank {r}: pointer inventory"] = (
            ra["pointers"] == rb["pointers"]
            and (a / f"rank_{r}/pointers.json").read_bytes() == (b / f"rank_{r}/pointers.json").read_bytes()
        )
        same[f"rank {r}: topology fingerprints"] = [g["topology_fingerprint"] for g in ra["graphs"]] == [
            g["topology_fingerprint"] for g in rb["graphs"]
        ]
        same[f"rank {r}: address fingerprints"] = (
            ra["extra"]["address_fingerprints"] == rb["extra"]["address_fingerprints"]
        )
    return same


def prove(out: Path, report: Path, variants: tuple[str, ...] = VARIANTS, drift: bool = True) -> int:
    from graphpersist import api

    out.mkdir(parents=True, exist_ok=True)
    api.build_interposer()
    started = datetime.now(UTC)
    res: dict[str, Any] = {"versions": hostkit.versions(VERSIONS, every_gpu=True), "variants": {}}
    for v in variants:
        a1, a2 = out / f"{v}-archive1", out / f"{v}-archive2"
        for p in (a1, a2):
            shutil.rmtree(p, ignore_errors=True)
        vr: dict[str, Any] = {}
        vr["baseline"] = run_group(f"{v}-baseline", out, v, "baseline", a1)
        vr["save"] = run_group(f"{v}-save", out, v, "save", a1)
        vr["save2"] = run_group(f"{v}-save2", out, v, "save", a2)
        vr["load"] = run_group(f"{v}-load", out, v, "load", a1)
        vr["compare"] = compare_archives(a1, a2, 2) if a1.exists() and a2.exists() else {}
        res["variants"][v] = vr
    nccl = out / "nccl-archive1"
    res["drift"] = (
        {}
        if not drift
        else {
            "world_size": run_group("drift-world", out, "nccl", "load", nccl, world=1),
            "swapped_gpus": run_group("drift-swap", out, "nccl", "load", nccl, swap=True),
            "nccl_setting": run_group("drift-nccl", out, "nccl", "load", nccl, env_extra={"NCCL_PROTO": "Simple"}),
        }
    )
    return hostkit.publish(out, report, res, lambda r: render(r, started))


# ------------------------------------------------------------------------------------------- report


def render(res: dict[str, Any], started: datetime) -> tuple[str, list[str]]:
    checks: list[hostkit.Check] = []
    timing: list[str] = []
    for v, vr in res["variants"].items():
        for g in ("baseline", "save", "save2", "load"):
            checks.append(
                (f"{v}: {g} group ran on 2 ranks", group_ok(vr[g]), f"{vr[g]['wall_s']:.1f} s {group_errors(vr[g])}")
            )
        base, load = vr["baseline"]["ranks"], vr["load"]["ranks"]
        if group_ok(vr["baseline"]) and group_ok(vr["load"]):
            same = [b["outputs"] == ld["outputs"] for b, ld in zip(base, load, strict=True)]
            n = sum(len(b["outputs"]) for b in base)
            checks.append((f"{v}: LOAD outputs bit-identical to baseline on every rank and batch size",
                           all(same), f"{n} outputs compared, ranks equal: {same}"))  # fmt: skip
            save = vr["save"]["ranks"]
            if group_ok(vr["save"]):
                same_save = all(s["outputs"] == b["outputs"] for s, b in zip(save, base, strict=True))
                checks.append((f"{v}: SAVE's own replay bit-identical to baseline", same_save, ""))
            restored = [sorted(r["restored"]) for r in load]
            checks.append((f"{v}: every graph restored on every rank", all(len(x) == 4 for x in restored),
                           f"{restored}"))  # fmt: skip
            checks.append((f"{v}: zero captures during LOAD", all(r["captures"] == 0 for r in load),
                           f"captures per rank {[r['captures'] for r in load]}"))  # fmt: skip
            checks.append((f"{v}: LOAD's static input is the model's own buffer",
                           all(all(r["input_at_model_buffer"]) for r in load), ""))  # fmt: skip
            checks.append((f"{v}: LOAD ran no warm-up/JIT (module loads = the archive's module images)",
                           all(r["module_loads"] == r["archived_module_images"] for r in load),
                           f"{[(r['module_loads'], r['archived_module_images']) for r in load]}"))  # fmt: skip
        for k, same in vr.get("compare", {}).items():
            checks.append((f"{v}: SAVE vs SAVE2 {k} identical", bool(same), ""))
        if not vr.get("compare"):
            checks.append((f"{v}: SAVE vs SAVE2 compared", False, "an archive is missing"))
        if group_ok(vr["save"]) and group_ok(vr["load"]):
            for r, (s, ld) in enumerate(zip(vr["save"]["ranks"], vr["load"]["ranks"], strict=True)):
                cap = sum(c["capture_ms"] + c["instantiate_ms"] for c in s["capture"].values())
                rest = sum(g["rebuild_ms"] + g["instantiate_ms"] for g in ld["restored"].values())
                nodes = sum(g["nodes"] for g in ld["restored"].values())
                ratio = cap / rest if rest else float("nan")
                timing.append(f"| {v} | {r} | {nodes} | {cap:.1f} | {rest:.1f} | {1e3 * ld['load_s']:.1f} | "
                              f"{ratio:.1f}x | {s['setup_s']:.1f} / {ld['setup_s']:.1f} |")  # fmt: skip
    drift_want = {
        "world_size": ("LOAD with world size 1", "parallel.world_size: saved 2, live 1"),
        "swapped_gpus": ("LOAD with ranks on swapped GPUs", "device"),
        "nccl_setting": ("LOAD with NCCL_PROTO=Simple", "env.NCCL_PROTO: saved <unset>, live 'Simple'"),
    }
    for key, (label, needle) in drift_want.items():
        if not res["drift"]:
            checks.append((f"drift refused before replay on every rank: {label}", False, "NOT RUN (--no-drift)"))
            continue
        g = res["drift"][key]
        ranks_ = g.get("ranks", [])
        msgs = [r.get("refused", {}).get("message", "") for r in ranks_]
        ok = bool(ranks_) and all("refused" in r and r.get("captures") == 0 for r in ranks_) and all(
            needle in m for m in msgs)  # fmt: skip
        detail = (msgs[0] if msgs else group_errors(g)).replace("\n", " / ")[:600]
        checks.append((f"drift refused before replay on every rank: {label}", ok, detail))
    pinned = f"- pinned: {' '.join(f'{k}={v}' for k, v in PINNED_ENV.items())}"
    lines, failed = hostkit.report_head("runtime-tp2: GPU proof report", started, res["versions"], [pinned], checks)
    lines += ["", "## Timing (same run)", "",
              "Capture = torch capture + instantiate of all 4 graphs in SAVE; restore = rebuild + instantiate of the "
              "same graphs in LOAD; LOAD total = api.load() (validate, memory, images, graphs).", "",
              "| variant | rank | nodes (4 graphs) | capture ms | restore ms | LOAD total ms | capture / restore | "
              "setup s SAVE / LOAD |", "|---|---|---|---|---|---|---|---|", *timing, "",
              "Full per-rank JSON: results.json of the run (not committed)."]  # fmt: skip
    return "\n".join(lines) + "\n", failed


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        return rank_entry(sys.argv[2:])
    ap, p = hostkit.rank_cli(__doc__, HERE, "run every group and write the report")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (for debugging)")
    p.add_argument("--no-drift", action="store_true", help="skip the drift groups (for debugging)")
    a = ap.parse_args()
    variants = tuple(v for v in a.variants.split(",") if v)
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return prove(a.out, a.report, variants, drift=not a.no_drift)


if __name__ == "__main__":
    sys.exit(main())
