"""Diagnosis only: a fingerprint of the model runner's device state just before the first request.

`GP_DIAG_DUMP=DIR` (never set in production) makes each persisting worker write `DIR/runner-state.rank<N>.json`
after vLLM's warm-up: every CUDA tensor the runner keeps outside the model and the KV cache (input buffers,
request states, block tables, graph-manager buffers), with a hash of its bytes and its first values; and
`DIR/region-sums.rank<N>.json`: every live allocation of the region with the sum of its 32-bit words. Comparing a
SAVE's files with a LOAD's names the buffers and allocations whose contents differ when serving starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

DUMP_ENV = "GP_DIAG_DUMP"
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
    from graphpersist import region
    from graphpersist.tensors import tensor_at

    sums = {}
    for addr, size in region.live_ranges(region.events()):
        words = tensor_at({"addr": addr, "dtype": "int32", "shape": [size // 4], "stride": [1]})
        sums[f"{addr:#x}"] = [size, int(torch.sum(words, dtype=torch.int64))]
    return sums


def dump_runner_state(runner: Any, rank: int) -> None:
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
