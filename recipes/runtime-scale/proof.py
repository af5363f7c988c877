"""Benchmark of the graphpersist runtime at engine scale: an archive shaped like one vLLM worker's graphs.

`python3 proof.py prove --out DIR` runs SAVE (capture 1938 graphs into one pool, save, then replay every graph
as the baseline) and LOAD (a fresh process: load, replay every graph on the same inputs) as separate processes
under the interposer, compares every output bit for bit and renders REPORT.md with the time of each LOAD phase.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import sys
import time
import weakref
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "overlays" / "graphpersist"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(HERE))

from gptools import hostkit  # noqa: E402  (the runtime recipes' shared host plumbing)

ENGINE = {"name": "graphpersist-scale-proof", "version": "1", "commit": "none"}
BASE = 0x500000000000
TARGET_LOAD_S, TARGET_OPEN_VALIDATE_S = 1.5, 0.100


def _names(sizes: Any, pieces: int) -> list[str]:
    """Graph names in capture order (largest batch size first, the full graph, then its pieces)."""
    out = []
    for b in sorted(sizes, reverse=True):
        out.append(f"FULL/bs{b}")
        out += [f"PIECEWISE/bs{b}/piece{p}" for p in range(pieces)]
    return out


def _setup() -> tuple[Any, Any, Any]:
    import torch
    from model import Model

    from graphpersist import api

    api.start_region()
    return torch, Model(), api


def _digest(torch: Any, t: Any) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _leaves(out: Any) -> list[Any]:
    """The tensors of a graph output in a fixed order (FullOutput: hidden, residual; a piece: itself)."""
    if hasattr(out, "hidden"):
        return [out.hidden, out.extras["residual"][0]]
    return [out]


def _replay_all(torch: Any, model: Any, graphs: dict[str, tuple[Any, Any]]) -> dict[str, list[str]]:
    """Replays every graph on fixed inputs in the engine's order; digest of each output tensor per graph."""
    from model import PIECES, SIZES, inputs_for

    digests = {}
    for b in SIZES:
        model.x[:b].copy_(inputs_for(b))
        for name in [f"FULL/bs{b}", *(f"PIECEWISE/bs{b}/piece{p}" for p in range(PIECES))]:
            replay, out = graphs[name]
            replay()
            digests[name] = [_digest(torch, t) for t in _leaves(out)]
    torch.cuda.synchronize()
    return digests


def _capture(torch: Any, model: Any, api: Any) -> tuple[Any, dict[str, tuple[Any, Any]], float]:
    """Setup mark, warm-up, and the capture of every graph into one pool, registered on a Saver (SAVE's part before
    saving); returns the saver, the captured graphs with their outputs, and when the warm-up ended."""
    from model import OUTPUT_TYPES, PIECES, SIZES

    api.mark_setup(model.named_tensors())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: loads the kernels' modules before capture
        model.piece(model.full(1).hidden, 0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    t_warm = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    saver = api.Saver(output_types=OUTPUT_TYPES)
    captured: dict[str, tuple[Any, Any]] = {}
    for b in sorted(SIZES, reverse=True):
        g = api.PersistentCUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = model.full(b)
        saver.add(f"FULL/bs{b}", g, [model.x[:b]], out, capture_size=b, mode="full")
        captured[f"FULL/bs{b}"] = (g, out)
        h = model.x[:b]
        for p in range(PIECES):
            g = api.PersistentCUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                o = model.piece(h, p)
            saver.add(f"PIECEWISE/bs{b}/piece{p}", g, [h], o, capture_size=b, mode="piecewise")
            captured[f"PIECEWISE/bs{b}/piece{p}"] = (g, o)
            h = o
    torch.cuda.synchronize()
    return saver, captured, t_warm


def step_save(archive: Path, ref: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch, model, api = _setup()
    from cuda.bindings import driver as drv

    saver, captured, t_warm = _capture(torch, model, api)
    t_capture = time.perf_counter()
    try:
        saver.add("FULL/bs8", captured["FULL/bs8"][0], [model.x[:8]], captured["FULL/bs8"][1])
        duplicate = {"refused": False, "message": "accepted"}
    except api.PersistError as exc:
        duplicate = {"refused": True, "message": str(exc)}
    summary = saver.save(archive, api.Facts(ENGINE, model.facts()))
    t_saved = time.perf_counter()
    torch_flags = sorted({int(drv.cuGraphExecGetFlags(drv.CUgraphExec(g.raw_cuda_graph_exec()))[1])
                          for g, _ in captured.values()})  # fmt: skip
    for g, _ in captured.values():
        g.instantiate()  # again (SAVE instantiated each graph to read its flags): what torch's instantiation costs
    torch.cuda.synchronize()
    t_inst = time.perf_counter()
    digests = _replay_all(torch, model, {n: (g.replay, o) for n, (g, o) in captured.items()})
    ref.write_text(json.dumps(digests))
    files = sorted(p.relative_to(archive).as_posix() for p in archive.rglob("*") if p.is_file())
    return {
        "setup_warmup_s": t_warm - t0,
        "capture_s": t_capture - t_warm,
        "save_s": t_saved - t_capture,
        "torch_instantiate_all_s": t_inst - t_saved,
        "torch_exec_flags": torch_flags,
        "summary": {k: v for k, v in summary.items() if k != "nodes"},
        "nodes": summary["nodes"],
        "order": list(captured),
        "duplicate": duplicate,
        "files": files,
        "archive_bytes": sum((archive / f).stat().st_size for f in files),
    }


def _load(api: Any, model: Any, archive: Path) -> Any:
    """LOAD of the archive with the scale model's facts, inventory, setup tensors and output types."""
    from model import OUTPUT_TYPES, SIZES

    return api.load(
        archive,
        api.Facts(ENGINE, model.facts()),
        sizes=SIZES,
        modes=["full", "piecewise"],
        setup_tensors=model.named_tensors(),
        output_types=OUTPUT_TYPES,
    )


def step_load(archive: Path, ref: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch, model, api = _setup()
    from model import PIECES, SIZES, FullOutput

    t_setup = time.perf_counter()
    res = _load(api, model, archive)
    t_load = time.perf_counter()
    digests = _replay_all(torch, model, {n: (lg.replay, lg.outputs) for n, lg in res.graphs.items()})
    want = json.loads(ref.read_text())
    differ = sorted(n for n in want if digests.get(n) != want[n])
    structure = []
    shared = []
    for b in SIZES:
        out = res[f"FULL/bs{b}"].outputs
        structure.append(
            type(out) is FullOutput
            and isinstance(out.extras["residual"], tuple)
            and out.extras["residual"][1] is None
            and out.extras["batch"] == b
            and out.step > 0
            and out.extras["residual"][0].data_ptr() == out.hidden.data_ptr()
        )
        prev = res[f"FULL/bs{b}"].inputs[0]
        ok = prev.data_ptr() == model.x.data_ptr()
        for p in range(PIECES):
            lg = res[f"PIECEWISE/bs{b}/piece{p}"]
            ok = ok and lg.inputs[0] is prev
            prev = lg.outputs
        shared.append(ok)
    try:
        res["FULL/bs7"]
        lookup = "no error"
    except KeyError as exc:
        lookup = str(exc)
    # Each loaded executable was instantiated with the flags its record holds (torch's, read at SAVE).
    from cuda.bindings import driver as drv

    records = api.open_archive(archive, verify_checksums=False).rank_facts(0).graphs
    wrong_flags = [g.name for g in records if int(drv.cuGraphExecGetFlags(res[g.name].exec)[1]) != g.instantiate_flags]
    # What `graphpersist check` adds to LOAD's reading: parse every kernel node, recompute every topology fingerprint.
    a = time.perf_counter()
    try:  # as `graphpersist check` reads the graphs: refused when a graph's fingerprint differs from its record's
        api.read_graphs(api.open_archive(archive, verify_checksums=False), 0, full=True)
        fps_ok = True
    except api.ArchiveError:
        fps_ok = False
    topology_s = time.perf_counter() - a
    # Release: a dropped graph is destroyed by its finalizer; close() is idempotent; a closed graph refuses.
    dropped = res.graphs.pop(f"PIECEWISE/bs{SIZES[0]}/piece{PIECES - 1}")
    fin, ref_ = dropped._release, weakref.ref(dropped)
    del dropped
    gc.collect()
    finalized = ref_() is None and not fin.alive
    res.close()
    res.close()
    try:
        res[f"FULL/bs{SIZES[0]}"].replay()
        after_close = "replayed"
    except api.PersistError as exc:
        after_close = str(exc)
    return {
        "setup_s": t_setup - t0,
        "load_s": t_load - t_setup,
        "timings": res.timings,
        "graphs": len(digests),
        "order": [*res.graphs, f"PIECEWISE/bs{SIZES[0]}/piece{PIECES - 1}"],
        "compared": len(want),
        "outputs_compared": sum(len(v) for v in want.values()),
        "differ": differ[:10],
        "n_differ": len(differ),
        "structure_ok": all(structure),
        "shared_ok": all(shared),
        "lookup": lookup,
        "topology_s": topology_s,
        "topology_ok": fps_ok,
        "saved_flags": sorted({g.instantiate_flags for g in records}),
        "wrong_flags": wrong_flags[:10],
        "finalized": finalized,
        "after_close": after_close,
    }


def step_profile(archive: Path) -> dict[str, Any]:
    """LOAD once more under cProfile (its own process): where LOAD's time goes, by function (informational)."""
    import cProfile
    import io
    import pstats

    _torch, model, api = _setup()

    prof = cProfile.Profile()
    prof.enable()
    res = _load(api, model, archive)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    return {"timings": res.timings, "top_tottime": text.getvalue()[-6000:]}


def step_profile_save(archive: Path) -> dict[str, Any]:
    """SAVE once more under cProfile (its own process, its own archive): where SAVE's time goes (informational)."""
    import cProfile
    import io
    import pstats

    torch, model, api = _setup()
    saver, _captured, _t_warm = _capture(torch, model, api)
    prof = cProfile.Profile()
    prof.enable()
    summary = saver.save(archive, api.Facts(ENGINE, model.facts()))
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return {
        "split_s": summary["split_s"],
        "serialize_s": summary["serialize_s"],
        "top_tottime": text.getvalue()[-8000:],
    }


def _child(args: list[str], out: Path, name: str, timeout: int = 240) -> dict[str, Any]:
    from graphpersist import api

    env = {**api.preload_env(base=BASE), **hostkit.PINNED_ENV}
    return hostkit.run_step([sys.executable, __file__, *args], out, name, env, timeout)


def prove(out: Path, report: Path) -> int:
    from graphpersist import api

    out.mkdir(parents=True, exist_ok=True)
    api.build_interposer()
    archive, ref = out / "archive", out / "ref.json"
    shutil.rmtree(archive, ignore_errors=True)
    started = datetime.now(UTC)
    res: dict[str, Any] = {"versions": hostkit.versions(["torch", "cuda-bindings"])}
    res["save"] = _child(["save", str(archive), str(ref)], out, "save")
    res["load"] = _child(["load", str(archive), str(ref)], out, "load") if res["save"]["_rc"] == 0 else {}
    res["profile"] = _child(["profile", str(archive)], out, "profile") if res["save"]["_rc"] == 0 else {}
    res["profile_save"] = _child(["profile-save", str(out / "archive-profiled")], out, "profile-save")
    shutil.rmtree(out / "archive-profiled", ignore_errors=True)
    return hostkit.publish(out, report, res, lambda r: render(r, started))


def render(res: dict[str, Any], started: datetime) -> tuple[str, list[str]]:
    from model import FULL_LAYERS, PIECE_LAYERS, PIECES, SIZES

    sv, ld = res["save"], res.get("load", {})
    nodes = sv.get("nodes", {})
    full = [n for k, n in nodes.items() if k.startswith("FULL/")]
    pieces = [n for k, n in nodes.items() if k.startswith("PIECEWISE/")]
    want_names = _names(SIZES, PIECES)
    files = sv.get("files", [])
    images = [f for f in files if "/images/" in f]
    checks: list[hostkit.Check] = [
        ("SAVE process ran", sv.get("_rc") == 0, f"rc {sv.get('_rc')}, {sv.get('_wall_s', 0):.1f} s"),
        ("LOAD process ran", ld.get("_rc") == 0, f"rc {ld.get('_rc')}, {ld.get('_wall_s', 0):.1f} s"),
        (
            f"archive holds {len(SIZES)} full graphs of ~{2 * FULL_LAYERS} nodes and {len(SIZES) * PIECES} pieces of "
            f"~{2 * PIECE_LAYERS} nodes",
            len(full) == len(SIZES) and min(full, default=0) >= 2 * FULL_LAYERS
            and len(pieces) == len(SIZES) * PIECES and max(pieces, default=99) <= 2 * PIECE_LAYERS + 2,
            f"{len(nodes)} graphs; full {min(full, default=0)}-{max(full, default=0)} nodes, pieces "
            f"{min(pieces, default=0)}-{max(pieces, default=0)} nodes",
        ),
        (
            "graph records packed: rank_0 holds graphs/index.json + graphs/pack.bin, no file per graph",
            "rank_0/graphs/index.json" in files and "rank_0/graphs/pack.bin" in files
            and len([f for f in files if f.startswith("rank_0/graphs/")]) == 2,
            f"{len(files)} files in the archive ({len(images)} kernel images), "
            f"{sv.get('archive_bytes', 0) / 1e6:.1f} MB",
        ),
        ("SAVE refuses a duplicate graph name", sv.get("duplicate", {}).get("refused") is True,
         sv.get("duplicate", {}).get("message", "")[:200]),
        ("LOAD restores every graph, in capture order", ld.get("order") == want_names == sv.get("order"),
         f"{ld.get('graphs')} graphs replayed"),
        ("LOAD outputs bit-identical to SAVE's replay of the same inputs, every graph",
         ld.get("compared") == len(want_names) and ld.get("n_differ") == 0,
         f"{ld.get('outputs_compared')} output tensors of {ld.get('compared')} graphs compared (sha256 of the bytes); "
         f"differ: {ld.get('n_differ')} {ld.get('differ')}"),
        ("nested outputs rebuilt (dataclass with dict, tuple, None, int; shared storage)",
         ld.get("structure_ok") is True,
         "FullOutput(hidden, extras={'residual': (hidden[:1], None), 'batch': b}, step)"),
        ("pieces share buffers at LOAD: piece p's input is piece p-1's output tensor, piece 0's the model's buffer",
         ld.get("shared_ok") is True, ""),
        ("unknown graph name: KeyError listing the closest names", "closest" in str(ld.get("lookup")),
         str(ld.get("lookup"))[:200]),
        ("topology fingerprints of all graphs match their records (graphpersist check's reading, run separately)",
         ld.get("topology_ok") is True, f"{ld.get('topology_s', 0):.2f} s for all graphs"),
        ("LOAD instantiates every graph with the flags torch gave SAVE's executable",
         bool(ld.get("saved_flags")) and ld.get("saved_flags") == sv.get("torch_exec_flags")
         and ld.get("wrong_flags") == [],
         f"torch {sv.get('torch_exec_flags')}, archive {ld.get('saved_flags')}, loaded executables that differ: "
         f"{ld.get('wrong_flags')}"),
        ("a dropped LoadedGraph is released by its finalizer; close() twice is fine; replay after close refused",
         ld.get("finalized") is True and "closed" in str(ld.get("after_close")), str(ld.get("after_close"))[:120]),
    ]  # fmt: skip
    t = ld.get("timings", {})
    open_validate = t.get("validate_s", 0)
    total = t.get("total_s", 0)
    shape = (f"- graphs: {len(SIZES)} batch sizes x (1 full graph of {2 * FULL_LAYERS} kernel nodes + {PIECES} "
             f"pieces of {2 * PIECE_LAYERS}), float32 elementwise kernels, one graph pool")  # fmt: skip
    lines, failed = hostkit.report_head("runtime-scale: LOAD of an engine-sized archive (one rank)", started,
                                        res["versions"], [shape], checks)  # fmt: skip
    lines += ["", "## Targets (reported, not asserted)", "", "| target | measured | met |", "|---|---|---|"]
    met = "yes" if 0 < total <= TARGET_LOAD_S else "NO"
    lines += [f"| whole LOAD <= {TARGET_LOAD_S} s per rank | {total:.3f} s | {met} |"]
    lines += [f"| open + validate <= {TARGET_OPEN_VALIDATE_S * 1e3:.0f} ms | {open_validate * 1e3:.1f} ms | "
              f"{'yes' if 0 < open_validate <= TARGET_OPEN_VALIDATE_S else 'NO'} |"]  # fmt: skip
    phases = [
        ("open (open_archive: manifest, every file hashed once, records)", t.get("open_archive_s")),
        ("live facts (collect_live: what it took beyond the open it overlaps)", t.get("collect_live_s")),
        ("validate (drift rules, graph index and records, pointers, setup tensors)",
         None if not t else t["validate_s"] - t["open_archive_s"] - t["collect_live_s"]),
        ("memory (restore the capture-time allocations)", t.get("memory_s")),
        ("images (load kernel images, resolve functions)", t.get("images_s")),
        ("rebuild (events + native node rebuild, all graphs)", t.get("rebuild_s")),
        ("instantiate (cuGraphInstantiate, all graphs)", t.get("instantiate_s")),
        ("upload (cuGraphUpload, all graphs)", t.get("upload_s")),
        ("other per-graph work (output structures, tensors, records)",
         None if not t else t["graphs_s"] - t["rebuild_s"] - t["instantiate_s"] - t.get("upload_s", 0.0)),
        ("total (api.load)", t.get("total_s")),
    ]  # fmt: skip
    lines += ["", "## LOAD phases (same run)", "", "| phase | ms |", "|---|---|"]
    lines += [f"| {n} | {v * 1e3:.1f} |" if v is not None else f"| {n} | - |" for n, v in phases]
    lines += ["", f"LOAD process: setup {ld.get('setup_s', 0):.2f} s, api.load {ld.get('load_s', 0):.2f} s. "
              f"Reading the graphs as `graphpersist check` does takes about {ld.get('topology_s', 0):.2f} s more "
              f"(parse every kernel node, recompute every topology fingerprint; measured above)."]  # fmt: skip
    summ = sv.get("summary", {})
    lines += [f"SAVE process: setup + warm-up {sv.get('setup_warmup_s', 0):.2f} s, capture of {len(nodes)} graphs "
              f"{sv.get('capture_s', 0):.2f} s, SAVE {sv.get('save_s', 0):.2f} s (serialize "
              f"{summ.get('serialize_s', 0):.2f} s; by step {_seconds(summ.get('split_s', {}))}), torch "
              "instantiate of all graphs again "
              f"{sv.get('torch_instantiate_all_s', 0):.2f} s. Archive: {summ.get('images')} kernel images "
              f"({summ.get('image_bytes', 0) / 1e6:.1f} MB), {summ.get('pointers')} distinct in-region "
              "addresses."]  # fmt: skip
    prof = res.get("profile", {})
    if prof.get("top_tottime"):
        pt = prof["timings"]
        lines += ["", f"LOAD under cProfile (separate process, informational; total {pt.get('total_s', 0):.2f} s "
                  "with profiling overhead), top functions by own time:", ""]  # fmt: skip
        lines += ["```", prof["top_tottime"].strip(), "```"]
    psave = res.get("profile_save", {})
    if psave.get("top_tottime"):
        lines += ["", f"SAVE under cProfile (separate process, informational; by step {_seconds(psave['split_s'])} "
                  "with profiling overhead), top functions by own time:", ""]  # fmt: skip
        lines += ["```", psave["top_tottime"].strip(), "```"]
    if failed:
        for key in ("save", "load"):
            if res.get(key, {}).get("_log_tail"):
                lines += ["", f"{key} log tail:", "", "```", res[key]["_log_tail"], "```"]
    lines += ["", "Full per-step JSON: results.json of the run (not committed)."]
    return "\n".join(lines) + "\n", failed


def _seconds(split: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f} s" for k, v in split.items()) or "-"


def main() -> int:
    steps = {"save": step_save, "load": step_load, "profile": step_profile, "profile-save": step_profile_save}
    return hostkit.step_main(HERE, prove, steps)


if __name__ == "__main__":
    sys.exit(main())
