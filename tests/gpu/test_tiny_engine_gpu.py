"""GPU test: the third engine (tests/cpu/tiny_engine.py) through the real session, SAVE and LOAD in fresh processes.

Each step is a process of its own under the interposer (interposed.run_step), the engine's switch in its environment:
- `off`: persistence off: the engine captures with torch and serves; its outputs are the baseline;
- `save`: SAVE captures, writes the archive, serves;
- `load`: a fresh process restores instead of capturing (no capture begins) and serves the same outputs, bit for bit;
- `refused`: LOAD with other batch sizes is refused before the first replay, raising in the engine's own process and
  naming the flag with its saved and live values.

Run: `python3 -m pytest -m gpu tests/gpu/test_tiny_engine_gpu.py` on a GPU host (torch, cuda-bindings, gcc).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from interposed import run_step, step_main

CPU_TESTS = Path(__file__).resolve().parents[1] / "cpu"
CONFIG = {"hidden": 1024, "layers": 6, "sizes": [1, 2, 4, 8, 16]}


def _outputs(eng: Any, cfg: Any) -> dict[str, Any]:
    import torch

    x = {bs: torch.randn(bs, cfg.hidden, generator=torch.Generator().manual_seed(bs)).cuda() for bs in cfg.sizes}
    out = {bs: eng.generate(x[bs]) for bs in cfg.sizes}
    torch.save({bs: o.cpu() for bs, o in out.items()}, eng.out_file)
    return {str(bs): float(o.double().abs().sum()) for bs, o in out.items()}


def step(mode: str, tmp: Path, config: str) -> dict[str, Any]:
    sys.path.insert(0, str(CPU_TESTS))
    import tiny_engine as te

    stats = tmp / f"stats-{mode}"
    os.environ["GRAPHPERSIST_STATS_DIR"] = str(stats)
    cfg = te.config_of(config)
    try:
        if mode == "off":
            eng = te.TinyEngine(cfg)
        else:
            with te.persisting(mode.removeprefix("refused-"), str(tmp / "archive")):
                eng = te.TinyEngine(cfg)
    except Exception as exc:  # a refused LOAD raises here, in the engine's own process
        return {"raised": f"{type(exc).__name__}: {exc}"}
    eng.out_file = tmp / f"out-{mode}.pt"  # type: ignore[attr-defined]
    sums = _outputs(eng, cfg)
    rank = json.loads((stats / "rank_0.json").read_text()) if (stats / "rank_0.json").exists() else {}
    return {"sums": sums, "stats": {k: rank.get(k) for k in ("captured", "restored", "capture_calls", "mode")}}


def _same(tmp: Path, a: str, b: str) -> bool:
    import torch

    x, y = torch.load(tmp / f"out-{a}.pt"), torch.load(tmp / f"out-{b}.pt")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.gpu
def test_the_third_engine_saves_and_loads_bit_identically(tmp_path: Path) -> None:
    config = json.dumps(CONFIG)
    got = {m: run_step(__file__, [m, str(tmp_path), config], tmp_path / f"{m}.json")[0] for m in ("off", "save")}
    got["load"], _ = run_step(__file__, ["load", str(tmp_path), config], tmp_path / "load.json")
    sizes = len(CONFIG["sizes"])
    assert got["save"]["stats"] == {"captured": sizes, "restored": 0, "capture_calls": sizes, "mode": "save"}, got
    assert got["load"]["stats"] == {"captured": 0, "restored": sizes, "capture_calls": 0, "mode": "load"}, got
    assert _same(tmp_path, "off", "save") and _same(tmp_path, "save", "load"), got
    other = json.dumps({**CONFIG, "sizes": [1, 2, 4]})
    refused, _ = run_step(__file__, ["refused-load", str(tmp_path), other], tmp_path / "refused.json")
    assert refused["raised"].startswith("LoadRefused: graphpersist: cannot LOAD"), refused
    assert "flags.sizes: saved [1, 2, 4, 8, 16], live [1, 2, 4]" in refused["raised"], refused


if __name__ == "__main__":
    sys.exit(step_main(lambda args: step(args[0], Path(args[1]), args[2])))
