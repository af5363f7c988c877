"""Diagnosis only: a fingerprint of the model runner's device state just before the first request.

`GP_DIAG_DUMP=DIR` (never set in production) makes each persisting worker write `DIR/runner-state.rank<N>.json`
after vLLM's warm-up: every CUDA tensor the runner keeps outside the model and the KV cache (input buffers,
request states, block tables, graph-manager buffers), with a hash of its bytes and its first values; and
`DIR/region-sums.rank<N>.json`: every live allocation of the region with the sum of its 32-bit words. Comparing a
SAVE's files with a LOAD's names the buffers and allocations whose contents differ when serving starts.

More switches for the TP=1 diagnosis (`recipes/diagnosis/vllm-qwen3-8b-tp1-bisect/`), all acting at the same point:
`GP_DIAG_HISTORY=1` records torch's allocation history from init_device on and writes
`DIR/memory-owners.rank<N>.json.gz` (who allocated what, with Python stacks); `GP_DIAG_SAVE_BYTES=PREFIX` makes a SAVE
write the bytes of every live region allocation except weights and KV cache (`PREFIX.rank<N>.bin`, index `.json`);
`GP_DIAG_KV_BLOCKS=FILE:A-B` makes a SAVE write KV blocks A..B-1 of every layer and a LOAD put them back;
`GP_DIAG_EXTRA_WARMUP=1` gives a LOAD the kernel warm-up SAVE runs before its capture; `GP_DIAG_DOT=PREFIX` prints
the graphs whose names start with PREFIX (`cuGraphDebugDotPrint`, verbose: each kernel's name, launch dimensions,
shared memory and attributes, and the edges) into `DIR/dot-save/` or `DIR/dot-load/`, to compare a captured graph
with its rebuild. The functions a driver runs in the worker through `LLM.collective_rpc` are in
`gpdiag/vllm_rpc.py`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

DUMP_ENV = "GP_DIAG_DUMP"
HISTORY_ENV = "GP_DIAG_HISTORY"
SAVE_BYTES_ENV = "GP_DIAG_SAVE_BYTES"
KV_ENV = "GP_DIAG_KV_BLOCKS"  # FILE:FIRST-LAST (SAVE writes those KV blocks of every layer, LOAD puts them back)
_MAX_BYTES = 256 << 20
_SKIP = {"model", "kv_caches", "compilation_config", "vllm_config"}


def _summary(t: torch.Tensor) -> dict[str, Any]:
    entry: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if t.numel() * t.element_size() > _MAX_BYTES:
        entry["skipped"] = "too large"
        return entry
    host = t.detach().contiguous().cpu()
    entry["sha256"] = hashlib.sha256(host.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    entry["head"] = host.flatten()[:16].float().tolist()
    return entry


def _walk(obj: Any, prefix: str, depth: int, out: dict[str, Any], seen: set[int]) -> None:
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    items = vars(obj).items() if hasattr(obj, "__dict__") else []
    for name, value in items:
        if name in _SKIP:
            continue
        key = f"{prefix}{name}"
        if isinstance(value, torch.Tensor) and value.is_cuda:
            out[key] = _summary(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            for i, v in enumerate(value):
                if v.is_cuda:
                    out[f"{key}[{i}]"] = _summary(v)
        elif type(value).__module__.startswith("vllm.v1.worker"):
            _walk(value, f"{key}.", depth - 1, out, seen)


def region_sums() -> dict[str, list[int]]:
    """Per live region allocation (address -> [size, sum of its 32-bit words]): SAVE and LOAD ran the same warm-up
    replays before the first request, so an allocation whose sum differs holds something no replay rewrote."""
    from graphpersist.memory import region
    from graphpersist.memory.tensors import tensor_at

    sums = {}
    for addr, size in region.live_ranges(region.events()):
        words = tensor_at({"addr": addr, "dtype": "int32", "shape": [size // 4], "stride": [1]})
        sums[f"{addr:#x}"] = [size, int(torch.sum(words, dtype=torch.int64))]
    return sums


def dump_runner_state(runner: Any, rank: int, saving: bool) -> None:
    """Write the runner's device-state fingerprint and the region's per-allocation sums when GP_DIAG_DUMP is set;
    nothing otherwise."""
    where = os.environ.get(DUMP_ENV)
    if not where:
        return
    torch.cuda.synchronize()
    state: dict[str, Any] = {}
    _walk(runner, "", 3, state, set())
    path = Path(where) / f"runner-state.rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=1, sort_keys=True))
    sums = region_sums()
    (Path(where) / f"region-sums.rank{rank}.json").write_text(json.dumps(sums, indent=0, sort_keys=True))
    print(f"graphpersist: {DUMP_ENV}: {len(state)} runner tensors and {len(sums)} region allocations fingerprinted "
          f"into {path.parent}", flush=True)  # fmt: skip
    from graphpersist import run
    from graphpersist.memory import phases, setup

    read = run.current().graph_blocks  # the torch blocks graphs read, checked again now that serving starts
    segments, blocks = setup._torch_blocks()
    count, gone = len(read), phases.block_problems(read, blocks, segments)
    print(f"graphpersist: {DUMP_ENV}: {count} torch blocks graphs read, {len(gone)} not live now: {gone[:8]}",
          flush=True)  # fmt: skip
    if os.environ.get(HISTORY_ENV) == "1":
        _write_owners(Path(where) / f"memory-owners.rank{rank}.json.gz")
    if spec := os.environ.get(KV_ENV):
        _kv_blocks(runner, spec, saving)
    if saving and (prefix := os.environ.get(SAVE_BYTES_ENV)):
        _write_bytes(runner, Path(f"{prefix}.rank{rank}"))


def _kv_blocks(runner: Any, spec: str, saving: bool) -> None:
    """GP_DIAG_KV_BLOCKS=FILE:FIRST-LAST: SAVE writes KV blocks FIRST..LAST-1 of every layer as they are when serving
    starts; LOAD writes FIRST..LAST-1 of them back at the same point (blocks are the leading dimension)."""
    from graphpersist.memory.tensors import bytes_at

    path, _, span = spec.rpartition(":")
    first, _, last = span.partition("-")
    lo, hi = int(first), int(last)
    blocks = [(kv.data_ptr(), kv.stride(0) * kv.element_size()) for kv in runner.kv_caches]
    if saving:
        torch.save({"first": lo, "layers": [bytes_at(p + lo * b, (hi - lo) * b).cpu() for p, b in blocks]}, path)
        print(f"graphpersist: {KV_ENV}: KV blocks {lo}..{hi - 1} of {len(blocks)} layers -> {path}", flush=True)
        return
    saved = torch.load(path)
    for (p, b), host in zip(blocks, saved["layers"], strict=True):
        at, count = saved["first"], host.numel() // b
        if not at <= lo <= hi <= at + count:
            raise ValueError(f"{KV_ENV}: blocks {lo}..{hi - 1} are not all in {path} ({at}..{at + count - 1})")
        bytes_at(p + lo * b, (hi - lo) * b).copy_(host[(lo - at) * b : (hi - at) * b])
    torch.cuda.synchronize()
    print(f"graphpersist: {KV_ENV}: KV blocks {lo}..{hi - 1} of {len(blocks)} layers put back from {path}", flush=True)


def dump_dots(graphs: dict[str, Any], saving: bool) -> None:
    """GP_DIAG_DOT=PREFIX (with GP_DIAG_DUMP): the named CUgraph handles whose names start with PREFIX, printed by
    the driver into DIR/dot-save/ or DIR/dot-load/ (one file per graph, '/' in names as '_')."""
    prefix, where = os.environ.get("GP_DIAG_DOT"), os.environ.get(DUMP_ENV)
    if prefix is None or not where:
        return
    from cuda.bindings import driver as drv

    out = Path(where) / ("dot-save" if saving else "dot-load")
    out.mkdir(parents=True, exist_ok=True)
    flags = drv.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE
    chosen = sorted(n for n in graphs if n.startswith(prefix))
    for name in chosen:
        path = out / (name.replace("/", "_") + ".dot")
        try:
            (err,) = drv.cuGraphDebugDotPrint(drv.CUgraph(int(graphs[name])), str(path).encode(), int(flags))
        except (TypeError, ValueError) as exc:  # a diagnosis must not stop the run it observes
            err = exc
        if err != drv.CUresult.CUDA_SUCCESS:
            print(f"graphpersist: GP_DIAG_DOT: {name}: {err!r}", flush=True)
    print(f"graphpersist: GP_DIAG_DOT: {len(chosen)} graph(s) starting with {prefix!r} -> {out}", flush=True)


def start_history() -> None:
    """GP_DIAG_HISTORY=1 (with GP_DIAG_DUMP): record every allocation of torch's caching allocator with its Python
    stack from here on, so the owner of an address can be named later."""
    if os.environ.get(DUMP_ENV) and os.environ.get(HISTORY_ENV) == "1":
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")


def _frames(frames: list[dict[str, Any]], table: dict[str, int]) -> list[int]:
    out = []
    for f in frames[:10]:
        text = f"{f.get('filename', '?')}:{f.get('line', 0)}:{f.get('name', '?')}"
        out.append(table.setdefault(text, len(table)))
    return out


def _write_owners(path: Path) -> None:
    """Live blocks and every allocation event of torch's allocator, with deduplicated stack frames."""
    snap = torch.cuda.memory._snapshot()
    table: dict[str, int] = {}
    blocks = [
        [b["address"], b["size"], b["state"], seg.get("segment_pool_id"), _frames(b.get("frames", []), table)]
        for seg in snap["segments"]
        for b in seg["blocks"]
    ]
    traces = [
        [i, e["action"], e["addr"], e["size"], _frames(e.get("frames", []), table)]
        for dev in snap["device_traces"]
        for i, e in enumerate(dev)
        if e["action"] in ("alloc", "segment_alloc")
    ]
    frames = sorted(table, key=table.__getitem__)
    with gzip.open(path, "wt") as out:
        json.dump({"blocks": blocks, "traces": traces, "frames": frames}, out)
    print(f"graphpersist: {HISTORY_ENV}: {len(blocks)} blocks, {len(traces)} events -> {path}", flush=True)


def _excluded(runner: Any) -> list[tuple[int, int]]:
    """Weights and KV cache: memory both runs set up identically and too large to copy."""
    spans = []
    for t in [*runner.model.parameters(), *runner.model.buffers(), *runner.kv_caches]:
        if t.is_cuda and t.numel():
            start = t.untyped_storage().data_ptr()
            spans.append((start, start + t.untyped_storage().nbytes()))
    return sorted(spans)


def _minus(lo: int, hi: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    pieces, at = [], lo
    for a, b in spans:
        if b <= at or a >= hi:
            continue
        if a > at:
            pieces.append((at, a))
        at = max(at, b)
    if at < hi:
        pieces.append((at, hi))
    return pieces


def _write_bytes(runner: Any, prefix: Path) -> None:
    """SAVE: the bytes of every live region allocation except weights and KV cache, as they are when serving
    starts (PREFIX.bin, index PREFIX.json: [address, size, offset in the .bin])."""
    from graphpersist.memory import region
    from graphpersist.memory.tensors import bytes_at

    spans = _excluded(runner)
    windows = [p for a, s in region.live_ranges(region.events()) for p in _minus(a, a + s, spans)]
    total = sum(b - a for a, b in windows)
    if total > 48 << 30:
        print(f"graphpersist: {SAVE_BYTES_ENV}: {total >> 30} GiB is too much to copy; nothing written", flush=True)
        return
    prefix.parent.mkdir(parents=True, exist_ok=True)
    index, offset = [], 0
    with open(f"{prefix}.bin", "wb") as out:
        for a, b in windows:
            host = bytes_at(a, b - a).cpu()
            out.write(memoryview(host.numpy()))
            index.append([a, b - a, offset])
            offset += b - a
    Path(f"{prefix}.json").write_text(json.dumps(index))
    print(f"graphpersist: {SAVE_BYTES_ENV}: {len(index)} windows, {offset >> 20} MiB -> {prefix}.bin", flush=True)
