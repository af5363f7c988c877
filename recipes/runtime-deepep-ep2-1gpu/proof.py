"""GPU proof of DeepEP NVL IPC persistence with EP=2 on ONE GPU: two processes on GPU 0, a gloo group, our deep_ep.

`python3 proof.py prove --out DIR --report REPORT.md` installs our deep_ep wheel (dist/, the running Python's tag)
into a folder outside the repository (`pip install --no-deps --no-index --target`), checks that `import deep_ep`
takes it, then runs process groups of 2 ranks, both on GPU 0: baseline (no interposer, persistence off), SAVE,
LOAD, and a refusal group (LOAD with another num_nvl_bytes). Each rank builds a `deep_ep.Buffer` (normal mode,
NVL only), captures one CUDA graph around get_dispatch_layout + dispatch (`num_worst_tokens`, no CPU sync) + an
"expert" scaling + combine, and replays it on fixed inputs. `python3 proof.py rank ...` is one rank of one group.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "overlays" / "graphpersist"))
sys.path.insert(0, str(REPO / "tools"))

from gptools import hostkit  # noqa: E402  (the runtime recipes' shared host plumbing)
from gptools.hostkit import group_errors, group_ok  # noqa: E402

ENGINE = {"name": "graphpersist-deepep-ep2-1gpu-proof", "version": "1", "commit": "none"}
WORLD = 2
TOKENS, HIDDEN, EXPERTS, TOPK = 8, 1024, 8, 2
WORST = TOKENS * WORLD  # every token of every rank: the most one rank can receive
NVL_BYTES = 256 << 20
OTHER_NVL_BYTES = 128 << 20  # the refusal group's
REGION_SIZE = 16 << 30  # per process; both processes share GPU 0
INPUT_SEEDS = (1, 2)
GROUP_TIMEOUT = 180
GP_IPC_MAGIC = 0x47504950  # the first word of a graphpersist VMM-IPC handle (native/gp_ipc.h)
DEEP_EP_DIR_ENV = "GP_DEEP_EP_DIR"


# ------------------------------------------------------------------------------------------- one rank


MODEL = {"dtype": "bfloat16", "config_fingerprint": f"deepep-ep2-1gpu t{TOKENS} h{HIDDEN} e{EXPERTS} k{TOPK}"}


def deepep_flags(nvl_bytes: int) -> dict[str, str]:
    """What LOAD must match about the DeepEP set-up (recorded as world flags, compared field by field)."""
    return {"deepep_num_nvl_bytes": str(nvl_bytes), "deepep_num_rdma_bytes": "0", "deepep_low_latency_mode": "False",
            "deepep_use_fabric": "False", "deepep_allow_mnnvl": "False", "num_worst_tokens": str(WORST)}  # fmt: skip


def fill_inputs(x: Any, topk_idx: Any, topk_weights: Any, rank: int, seed: int) -> None:
    """Deterministic inputs per (rank, seed), made on the CPU and copied into the static tensors."""
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    x.copy_(torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16))
    scores = torch.rand(TOKENS, EXPERTS, generator=g)
    topk_idx.copy_(scores.topk(TOPK, dim=-1).indices.to(topk_idx.dtype))
    topk_weights.copy_(torch.rand(TOKENS, TOPK, generator=g))


def digest(t: Any) -> str:
    """sha256 of a tensor's bytes (bit-identity, not closeness)."""
    import torch

    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _rank_main(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    persist = a.mode != "baseline"
    torch.cuda.set_device(0)  # both ranks on GPU 0
    if persist:
        from graphpersist import api

        api.start_region()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=a.rank, world_size=WORLD)
    import deep_ep

    captures = {"n": 0}
    real_begin = torch.cuda.CUDAGraph.capture_begin

    def counting_begin(self: Any, *args: Any, **kw: Any) -> Any:
        captures["n"] += 1
        return real_begin(self, *args, **kw)

    torch.cuda.CUDAGraph.capture_begin = counting_begin  # LOAD must not capture: counted, not assumed
    res: dict[str, Any] = {"rank": a.rank, "deep_ep_file": deep_ep.__file__}
    b0 = time.perf_counter()
    buf = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=a.nvl_bytes, num_rdma_bytes=0, low_latency_mode=False)
    res["buffer_s"] = time.perf_counter() - b0
    handle = bytes(buf.runtime.get_local_ipc_handle())
    res["ipc_handle_magic"] = hex(struct.unpack_from("<I", handle)[0])
    res["nvl_buffer_ptr"] = buf.get_local_buffer_tensor(torch.uint8).data_ptr()
    dev = torch.device("cuda", 0)
    x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=dev)
    topk_idx = torch.empty(TOKENS, TOPK, dtype=deep_ep.topk_idx_t, device=dev)
    topk_weights = torch.empty(TOKENS, TOPK, dtype=torch.float32, device=dev)
    scale = torch.arange(1, HIDDEN + 1, dtype=torch.float32, device=dev) / HIDDEN  # the "expert": a fixed scaling
    named = {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "scale": scale}
    res["setup_s"] = time.perf_counter() - t0

    def step() -> tuple[Any, ...]:
        n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
        recv_x, recv_idx, recv_w, _, hnd, _ = buf.dispatch(
            x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=WORST)  # fmt: skip
        y = (recv_x.float() * scale).to(torch.bfloat16)
        combined, _, _ = buf.combine(y, hnd, topk_weights=recv_w)
        return recv_x, recv_idx, recv_w, combined

    if persist:
        ipc_opens = [(e.addr, e.size) for e in api.region_events() if e.kind == "ipc_open"]
        res["ipc_opens"] = [[hex(ad), sz] for ad, sz in ipc_opens]
        info = api.region_info()
        res["region"] = [hex(info.base), info.size]
        res["nvl_in_region"] = info.base <= res["nvl_buffer_ptr"] < info.base + info.size
        res["host_allocs"] = [[hex(e.addr), e.size, e.req] for e in api.host_events() if e.kind == "host_alloc"]
        res["host_outside"] = [e.describe() for e in api.host_events() if e.kind == "host_outside"]
        res["setup_tensors"] = {k: hex(t.data_ptr()) for k, t in named.items()}
    fill_inputs(x, topk_idx, topk_weights, a.rank, INPUT_SEEDS[0])
    if a.mode in ("baseline", "save"):
        if persist:
            api.mark_setup(named)
        for _ in range(2):  # eager warm-up: the same no-CPU-sync path
            step()
        torch.cuda.synchronize()
        dist.barrier()
        g = api.PersistentCUDAGraph() if persist else torch.cuda.CUDAGraph()
        c0 = time.perf_counter()
        with torch.cuda.graph(g):
            outs = step()
        torch.cuda.synchronize()
        res["capture_ms"] = 1e3 * (time.perf_counter() - c0)
        if persist:
            g.instantiate()
            saver = api.Saver()
            saver.add("ep2", g, [x, topk_idx, topk_weights], list(outs), capture_size=TOKENS, mode="full")
            s0 = time.perf_counter()
            parallel = {"world_size": WORLD, "tp_size": WORLD, "ep_size": WORLD}
            res["save"] = saver.save(
                a.archive, api.Facts(ENGINE, MODEL, parallel=parallel, flags=deepep_flags(a.nvl_bytes)), rank=a.rank
            )
            res["save_s"] = time.perf_counter() - s0
        replay = g.replay
    else:  # load, and the refusal group
        l0 = time.perf_counter()
        try:
            loaded = api.load(
                a.archive,
                api.Facts(
                    ENGINE,
                    MODEL,
                    parallel={"world_size": WORLD, "tp_size": WORLD, "ep_size": WORLD},
                    flags=deepep_flags(a.nvl_bytes),
                ),
                sizes=[TOKENS],
                modes=["full"],
                rank=a.rank,
                setup_tensors=named,
            )
        except Exception as exc:
            res["refused"] = {"type": type(exc).__name__, "message": str(exc)}
            res["captures"] = captures["n"]
            return res
        res["load_s"] = time.perf_counter() - l0
        lg = loaded.graphs["ep2"]
        res["restored"] = {"nodes": lg.node_count, "rebuild_ms": 1e3 * lg.rebuild_s,
                           "instantiate_ms": 1e3 * lg.instantiate_s}  # fmt: skip
        static = [x, topk_idx, topk_weights]
        res["inputs_at_setup_tensors"] = [t.data_ptr() for t in lg.inputs] == [t.data_ptr() for t in static]
        outs = tuple(lg.outputs)
        replay = lg.replay
    if persist:
        host = api.open_archive(a.archive).rank_facts(a.rank).extra.host_memory
        res["archive_host_memory"] = None if host is None else {"ranges": host.ranges, "words": host.words}
    recv_x, recv_idx, recv_w, combined = outs
    results = {}
    for seed in INPUT_SEEDS:
        fill_inputs(x, topk_idx, topk_weights, a.rank, seed)
        torch.cuda.synchronize()
        dist.barrier()
        replay()
        torch.cuda.synchronize()
        valid = (recv_idx >= 0).any(dim=-1)
        results[f"seed{seed}"] = {
            "received": int(valid.sum()),
            "recv_x": digest(recv_x[valid]),
            "recv_topk_idx": digest(recv_idx),
            "recv_topk_weights": digest(recv_w[valid]),
            "combined": digest(combined),
            "combined_finite": bool(torch.isfinite(combined.float()).all()),
            "combined_sum": float(combined.float().sum()),
        }
    res["outputs"] = results
    res["captures"] = captures["n"]
    dist.barrier()
    return res


def rank_entry(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="proof.py rank", description="one rank of one proof group")
    ap.add_argument("mode", choices=["baseline", "save", "load"])
    ap.add_argument("archive")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--nvl-bytes", type=int, default=NVL_BYTES)
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    if os.environ.get(DEEP_EP_DIR_ENV):
        sys.path.insert(0, os.environ[DEEP_EP_DIR_ENV])
    if a.mode != "baseline":
        from graphpersist import api

        api.reexec_with_interposer(size=REGION_SIZE)
    hostkit.finish_rank(a.rank, Path(a.result), lambda: _rank_main(a))


# ------------------------------------------------------------------------------------------- deep_ep install


def find_wheel(dist_dir: Path, tag: str | None = None) -> Path:
    """Our deep_ep wheel for this Python (cp3XY) in `dist_dir`; refuses naming what to run when there is none."""
    tag = tag or f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = sorted(dist_dir.glob(f"deep_ep-*+gp.*-{tag}-{tag}-*.whl"))
    if not found:
        raise SystemExit(f"no deep_ep wheel for {tag} in {dist_dir}: run `make build OFFLINE=1` (or `make build "
                         f"ENGINE=deep_ep`) first, or pass --wheel")  # fmt: skip
    if len(found) > 1:
        raise SystemExit(f"{len(found)} deep_ep wheels for {tag} in {dist_dir} ({', '.join(p.name for p in found)}): "
                         "keep one, or pass --wheel")  # fmt: skip
    return found[0]


def install_deep_ep(wheel: Path, target: Path) -> dict[str, Any]:
    """pip install --no-deps --no-index --target `target` (a fresh folder outside the repository), then a plain
    `import deep_ep` smoke check in a new interpreter with only that folder added."""
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"[deepep] installing {wheel.name} into {target}", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    out: dict[str, Any] = {"wheel": wheel.name, "target": str(target), "pip_rc": p.returncode,
                           "pip_tail": (p.stdout + p.stderr)[-1500:]}  # fmt: skip
    if p.returncode != 0 and "No module named pip" in p.stderr:  # an interpreter without pip: unpack it as pip would
        print("[deepep] this Python has no pip: unpacking the wheel instead (no scripts, no data files)", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
        out.update(pip_rc=0, pip_tail="unpacked with zipfile (no pip)")
    if p.returncode != 0:
        return out
    code = ("import inspect, torch, deep_ep, deep_ep_cpp; from importlib.metadata import version; "
            "print(version('deep_ep'), deep_ep.__file__, deep_ep_cpp.__file__, "
            "'use_fabric' in inspect.signature(deep_ep.Buffer.__init__).parameters, "
            "deep_ep.Buffer.is_sm90_compiled())")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(REPO / "overlays" / "graphpersist")])}
    s = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    out["smoke_rc"] = s.returncode
    out["smoke"] = (s.stdout.strip().splitlines() or [""])[-1] if s.returncode == 0 else (s.stdout + s.stderr)[-1500:]
    return out


# ------------------------------------------------------------------------------------------- groups


def run_group(name: str, out: Path, mode: str, archive: Path, deep_ep_dir: Path,
              nvl_bytes: int = NVL_BYTES) -> dict[str, Any]:  # fmt: skip
    """Starts the 2 rank processes (both on GPU 0), waits for both (killing them at the timeout)."""
    from graphpersist import api

    env = api.preload_env(size=REGION_SIZE) if mode != "baseline" else dict(os.environ)
    if mode != "baseline":  # DeepEP's counters are read by the captured dispatch: place pinned memory (opt-in)
        env["GP_HOST_BASE"] = hex(api.DEFAULT_HOST_BASE)
    env.update(hostkit.PINNED_ENV)
    env.update({DEEP_EP_DIR_ENV: str(deep_ep_dir), "GRAPHPERSIST_MODE": "off" if mode == "baseline" else mode,
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]})  # fmt: skip

    def argv(r: int, result: Path) -> list[str]:
        return [sys.executable, __file__, "rank", mode, str(archive), "--rank", str(r), "--nvl-bytes", str(nvl_bytes),
                "--result", str(result)]  # fmt: skip

    return hostkit.run_ranks(name, out, WORLD, argv, env, GROUP_TIMEOUT, "deepep")


def prove(out: Path, report: Path, wheel: Path | None, deep_ep_dir: Path, baseline: bool = True) -> int:
    from graphpersist import api

    out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    print("[deepep] building the interposer", flush=True)
    api.build_interposer()
    res: dict[str, Any] = {"versions": hostkit.versions(["torch"], every_gpu=True), "groups": {}}
    res["install"] = install_deep_ep(wheel or find_wheel(REPO / "dist"), deep_ep_dir)
    if res["install"].get("smoke_rc") == 0:
        archive = out / "archive"
        shutil.rmtree(archive, ignore_errors=True)
        groups = res["groups"]
        if baseline:
            groups["baseline"] = run_group("baseline", out, "baseline", archive, deep_ep_dir)
        groups["save"] = run_group("save", out, "save", archive, deep_ep_dir)
        groups["load"] = run_group("load", out, "load", archive, deep_ep_dir)
        groups["refuse_nvl"] = run_group("refuse-nvl", out, "load", archive, deep_ep_dir, nvl_bytes=OTHER_NVL_BYTES)
    return hostkit.publish(out, report, res, lambda r: render(r, started))


# ------------------------------------------------------------------------------------------- report


def render(res: dict[str, Any], started: datetime) -> tuple[str, list[str]]:
    """REPORT.md's text and the names of the failed checks (a check whose group did not run fails)."""
    checks: list[hostkit.Check] = []
    inst = res.get("install", {})
    checks.append(("our deep_ep wheel installs (pip --no-deps --no-index --target)", inst.get("pip_rc") == 0,
                   f"{inst.get('wheel', '?')} -> {inst.get('target', '?')}"))  # fmt: skip
    smoke = str(inst.get("smoke", ""))
    checks.append(("`import deep_ep` takes our build (version, files, Buffer has use_fabric, sm90 compiled)",
                   inst.get("smoke_rc") == 0 and "+gp." in smoke and str(inst.get("target", "//")) in smoke
                   and smoke.endswith("True True"), smoke.replace("\n", " / ")[:600]))  # fmt: skip
    g = res.get("groups", {})
    for name in ("baseline", "save", "load"):
        if name == "baseline" and name not in g:
            continue
        grp = g.get(name)
        checks.append((f"{name} group ran on 2 ranks (both on GPU 0)", group_ok(grp),
                       f"{grp['wall_s']:.1f} s {group_errors(grp, width=500)}" if grp else "NOT RUN"))  # fmt: skip
    save, load = g.get("save"), g.get("load")
    if group_ok(save):
        sr = save["ranks"]
        checks.append(("SAVE: NVL buffer inside the region on every rank", all(r["nvl_in_region"] for r in sr),
                       ", ".join(f"{r['nvl_buffer_ptr']:#x} in {r['region']}" for r in sr)))  # fmt: skip
        checks.append(("SAVE: IPC handles are graphpersist VMM-IPC handles (our cuIpcGetMemHandle)",
                       all(r["ipc_handle_magic"] == hex(GP_IPC_MAGIC) for r in sr),
                       str([r["ipc_handle_magic"] for r in sr])))  # fmt: skip
        checks.append(("SAVE: each rank mapped its peer's NVL buffer in the region (ipc_open)",
                       all(len(r["ipc_opens"]) == 1 for r in sr), str([r["ipc_opens"] for r in sr])))  # fmt: skip
        checks.append(("SAVE: DeepEP's pinned host counters placed in the host range, none left to the driver",
                       all(r["host_allocs"] and not r["host_outside"] for r in sr),
                       str([(r["host_allocs"], r["host_outside"]) for r in sr])[:600]))  # fmt: skip
        checks.append(("SAVE: the graph reads pinned host memory (extra.host_memory), recorded for LOAD",
                       all((r.get("archive_host_memory") or {}).get("ranges") for r in sr),
                       str([r.get("archive_host_memory") for r in sr])))  # fmt: skip
        recv = [[o["received"] for o in r["outputs"].values()] for r in sr]
        finite = all(o["combined_finite"] for r in sr for o in r["outputs"].values())
        checks.append(("SAVE: dispatch/combine ran (tokens received per rank and seed, combine finite)",
                       all(all(n > 0 for n in x) for x in recv) and finite, str(recv)))  # fmt: skip
    if group_ok(save) and group_ok(load):
        sr, lr = save["ranks"], load["ranks"]
        for key, label in (("nvl_buffer_ptr", "NVL buffer address"), ("ipc_opens", "peer IPC mapping addresses"),
                           ("host_allocs", "pinned host counter addresses"), ("setup_tensors", "setup tensors"),
                           ("region", "region")):  # fmt: skip
            same = [s[key] == ld[key] for s, ld in zip(sr, lr, strict=True)]
            checks.append((f"LOAD: {label} identical to SAVE's on every rank", all(same), str(same)))
        same = [s["outputs"] == ld["outputs"] for s, ld in zip(sr, lr, strict=True)]
        n = sum(len(s["outputs"]) for s in sr)
        checks.append(("LOAD: replay outputs bit-identical to SAVE's replay (recv_x, recv_topk_idx, "
                       "recv_topk_weights, combined; sha256)", all(same),
                       f"{n} input sets compared, ranks: {same}"))  # fmt: skip
        checks.append(("LOAD: zero captures", all(r["captures"] == 0 for r in lr), str([r["captures"] for r in lr])))
        checks.append(("LOAD: the graph's inputs are the setup tensors", all(r["inputs_at_setup_tensors"] for r in lr),
                       ""))  # fmt: skip
    base = g.get("baseline")
    if group_ok(base) and group_ok(save):
        same = [b["outputs"] == s["outputs"] for b, s in zip(base["ranks"], save["ranks"], strict=True)]
        checks.append(("SAVE's replay bit-identical to the baseline's (no interposer, persistence off)", all(same),
                       str(same)))  # fmt: skip
    ref = g.get("refuse_nvl")
    ranks = (ref or {}).get("ranks", [])
    msgs = [r.get("refused", {}).get("message", "") for r in ranks]
    ok = bool(ranks) and all("refused" in r and r.get("captures") == 0 and "outputs" not in r for r in ranks) and all(
        "deepep_num_nvl_bytes" in m and str(NVL_BYTES) in m and str(OTHER_NVL_BYTES) in m for m in msgs)  # fmt: skip
    detail = (msgs[0] if msgs and msgs[0] else group_errors(ref, width=500) or "NOT RUN").replace("\n", " / ")[:600]
    checks.append((f"LOAD with num_nvl_bytes={OTHER_NVL_BYTES} refused before any replay on every rank, naming it",
                   ok, detail))  # fmt: skip
    shape = (f"- shape: {WORLD} ranks on GPU 0, {TOKENS} tokens x hidden {HIDDEN} bf16 per rank, {EXPERTS} experts, "
             f"top-{TOPK}, num_worst_tokens {WORST}, num_nvl_bytes {NVL_BYTES}")  # fmt: skip
    lines, failed = hostkit.report_head("runtime-deepep-ep2-1gpu: GPU proof report", started, res.get("versions", {}),
                                        [shape], checks)  # fmt: skip
    timing = []
    if group_ok(save) and group_ok(load):
        for r, (s, ld) in enumerate(zip(save["ranks"], load["ranks"], strict=True)):
            timing.append(f"| {r} | {ld['restored']['nodes']} | {s['capture_ms']:.1f} | "
                          f"{ld['restored']['rebuild_ms'] + ld['restored']['instantiate_ms']:.1f} | "
                          f"{1e3 * ld['load_s']:.1f} | {s['buffer_s']:.3f} / {ld['buffer_s']:.3f} |")  # fmt: skip
    lines += ["", "## Timing (same run)", "", "| rank | nodes | capture ms (SAVE) | rebuild + instantiate ms (LOAD) | "
              "api.load ms | Buffer() s SAVE / LOAD |", "|---|---|---|---|---|---|", *timing, "",
              "Full per-rank JSON: results.json of the run (not committed)."]  # fmt: skip
    return "\n".join(lines) + "\n", failed


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        return rank_entry(sys.argv[2:])
    ap, p = hostkit.rank_cli(__doc__, HERE, "install our deep_ep, run every group and write the report")
    p.add_argument("--wheel", type=Path, help="the deep_ep wheel (default: the one in dist/ for this Python)")
    p.add_argument("--deep-ep-dir", type=Path, default=Path("/tmp/gp-deep-ep"),
                   help="where to install it, outside the repository (replaced)")  # fmt: skip
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline group")
    a = ap.parse_args()
    if REPO in a.deep_ep_dir.resolve().parents:
        ap.error(f"--deep-ep-dir {a.deep_ep_dir} lies inside the repository: choose a folder outside it")
    return prove(a.out, a.report, a.wheel, a.deep_ep_dir, baseline=not a.no_baseline)


if __name__ == "__main__":
    sys.exit(main())
