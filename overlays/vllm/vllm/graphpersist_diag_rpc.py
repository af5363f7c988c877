"""Diagnosis only: what a driver runs in a worker through `LLM.collective_rpc` (recipes/vllm-qwen3-8b-tp1-bisect).

`bisect_setup` / `bisect_apply` / `bisect_peek`: put SAVE's bytes (`GP_DIAG_SAVE_BYTES`, vllm/graphpersist_diag.py)
back into chosen windows of the memory a LOAD mapped afresh, one trial request at a time, after putting every such
range back as it was when serving started. `probe_install` / `probe_collect`: record what each sampling step read.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm.graphpersist_diag import DUMP_ENV


class _Trials:
    """LOAD, in the worker: the restored ranges and SAVE's windows, each [address, size, offset] (in `ready`, in
    the SAVE's .bin), the ranges' contents when serving started, and SAVE's bytes."""

    ranges: ClassVar[list[list[int]]] = []
    ready: torch.Tensor | None = None
    save_index: ClassVar[list[list[int]]] = []
    save_bytes: Any = None


def _overlaps(index: list[list[int]], lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """(start, end, offset of start in the index's buffer) of every part of [lo, hi) an index entry covers."""
    for a, s, off in index:
        x, y = max(lo, a), min(hi, a + s)
        if x < y:
            yield x, y, off + x - a


def bisect_setup(worker: Any, prefix: str) -> dict[str, Any]:
    """Keep a pinned copy of every range this LOAD mapped afresh (as it is now) and open SAVE's bytes."""
    import numpy as np

    from graphpersist.memory.tensors import bytes_at

    listing = Path(os.environ[DUMP_ENV]) / f"restored-ranges.pid{os.getpid()}.json"
    ranges = [(a, s) for _, a, s in json.loads(listing.read_text())]
    offsets = itertools.accumulate((s for _, s in ranges), initial=0)
    _Trials.ranges[:] = [[a, s, at] for (a, s), at in zip(ranges, offsets, strict=False)]
    total = sum(s for _, s in ranges)
    torch.cuda.synchronize()
    ready = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    for a, s, at in _Trials.ranges:
        ready[at : at + s].copy_(bytes_at(a, s))
    _Trials.ready = ready
    name = f"{prefix}.rank{worker.rank}"
    _Trials.save_index[:] = json.loads(Path(f"{name}.json").read_text())
    _Trials.save_bytes = np.memmap(f"{name}.bin", dtype=np.uint8, mode="r")
    return {"ranges": ranges, "bytes": total, "save_windows": len(_Trials.save_index)}


def bisect_apply(worker: Any, windows: list[list[int]], fill: int | None = None) -> int:
    """Put every restored range back as it was when serving started, then SAVE's bytes (or `fill`) into
    `windows` ([start, end) addresses). Returns the bytes written into the windows."""
    from graphpersist.memory.tensors import bytes_at

    assert _Trials.ready is not None, "bisect_setup first"
    for a, s, at in _Trials.ranges:
        bytes_at(a, s).copy_(_Trials.ready[at : at + s])
    written = 0
    for lo, hi in windows:
        if fill is not None:
            bytes_at(lo, hi - lo).fill_(fill)
            written += hi - lo
            continue
        for x, y, off in _overlaps(_Trials.save_index, lo, hi):
            bytes_at(x, y - x).copy_(torch.from_numpy(_Trials.save_bytes[off : off + y - x].copy()))
            written += y - x
    torch.cuda.synchronize()
    return written


def bisect_peek(worker: Any, lo: int, hi: int) -> dict[str, str]:
    """The bytes of [lo, hi) as SAVE left them and as this LOAD had them when serving started (hex)."""
    assert _Trials.ready is not None, "bisect_setup first"
    ready = b"".join(_Trials.ready[o : o + y - x].numpy().tobytes() for x, y, o in _overlaps(_Trials.ranges, lo, hi))
    saved = b"".join(_Trials.save_bytes[o : o + y - x].tobytes() for x, y, o in _overlaps(_Trials.save_index, lo, hi))
    return {"save": saved.hex(), "load": ready.hex()}


_PROBED: list[dict[str, Any]] = []


def probe_install(worker: Any) -> bool:
    """Record, for every sampling step from now on, what the runner sampled from: the batch's slots, input ids,
    positions and logits rows, the hidden states of those rows, the logits' argmax before the sampler, and the
    sampled ids (to tell a model difference from a sampler or bookkeeping one)."""
    runner = worker.model_runner
    upstream = runner.sample

    def sample(hidden_states: torch.Tensor, input_batch: Any, grammar_output: Any) -> Any:
        out = upstream(hidden_states, input_batch, grammar_output)
        rows = hidden_states[input_batch.logits_indices]
        n = int(input_batch.num_tokens)
        _PROBED.append(
            {
                "slots": [int(x) for x in input_batch.idx_mapping_np],
                "num_tokens": n,
                "input_ids": input_batch.input_ids[: min(n, 64)].tolist(),
                "positions": input_batch.positions[: min(n, 64)].tolist(),
                "logits_indices": input_batch.logits_indices.tolist()[:64],
                "hidden_rows_head": rows.float()[:4, :16].tolist(),
                "hidden_rows_norm": rows.float()[:4].norm(dim=-1).tolist(),
                "argmax": runner.model.compute_logits(rows).argmax(dim=-1).tolist()[:64],
                "sampled": out[0].sampled_token_ids.flatten().tolist()[:64],
                **_guarded(_attention_inputs, runner, input_batch),
            }
        )
        return out

    runner.sample = sample
    return True


def _guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as exc:  # a probe must never stop the request it watches
        return {"probe_error": f"{type(exc).__name__}: {exc}"}


def _attention_inputs(runner: Any, input_batch: Any) -> dict[str, Any]:
    """What attention read for this step: the requests' block tables (as staged, as gathered), their block counts
    (host and the UVA view the kernels read), slot mapping, sequence lengths, and the KV cache at those slots
    (first and last layer: sum of |K| and |V| per token; every layer: at the first and the last slot written) to
    tell a wrong write from a wrong read, and at which layer two runs part."""
    bt = runner.block_tables
    slots = [int(x) for x in input_batch.idx_mapping_np][:8]
    n = int(input_batch.num_tokens)
    mapping = bt.slot_mappings[0][: min(n, 64)]
    seen: dict[str, Any] = {
        "staged_rows": [bt.block_tables[0].gpu[s, :4].tolist() for s in slots],
        "gathered_rows": bt.input_block_tables[0][: len(slots), :4].tolist(),
        "num_blocks_np": [int(bt.num_blocks.np[0, s]) for s in slots],
        "num_blocks_uva": bt.num_blocks.gpu[0, slots].tolist(),
        "slot_mapping": mapping.tolist(),
        "seq_lens": input_batch.seq_lens[: len(slots)].tolist(),
        "query_start_loc": input_batch.query_start_loc[: len(slots) + 1].tolist(),
    }
    ok = mapping[mapping >= 0]
    per_layer: list[list[float]] = []
    for layer, kv in enumerate(runner.kv_caches):  # logical (blocks, heads, block_size, 2 * head_size), K|V packed
        if kv.dim() != 4 or kv.stride(1) != kv.shape[3] or kv.stride(0) != kv.shape[2] * kv.stride(2):
            seen["kv_layout"] = f"layer {layer}: shape {list(kv.shape)} strides {list(kv.stride())} not read"
            break
        heads, width = kv.shape[1], kv.shape[3]
        rows = kv.as_strided((kv.shape[0] * kv.shape[2], heads, width), (kv.stride(2), width, 1))[ok].float()
        k = rows[:, :, : width // 2].abs().sum(dim=(1, 2))
        v = rows[:, :, width // 2 :].abs().sum(dim=(1, 2))
        if layer in (0, len(runner.kv_caches) - 1):
            seen["kv_first" if layer == 0 else "kv_last"] = {"k": k.tolist()[:16], "v": v.tolist()[:16]}
        per_layer.append([float(k[0]), float(v[0]), float(k[-1]), float(v[-1])] if len(k) else [])
    # every layer's sum of |K| and |V| at the first and the last slot written: where the divergence starts
    seen["kv_per_layer"] = per_layer
    return seen


def probe_collect(worker: Any) -> list[dict[str, Any]]:
    taken = list(_PROBED)
    _PROBED.clear()
    return taken
