"""A third engine is an adapter alone: tests/cpu/tiny_engine.py goes through the session's SAVE and LOAD.

The engine (under 250 lines, adapter included) calls one session step at each seam and answers the adapter's
questions; nothing of the lifecycle is its own. On CPU, what needs a GPU is stood in at the hardware boundary only:
the region and setup mark (`graphpersist.api`), the graph capture (a "graph" re-runs its forward into the output it
captured), the archive's serialization (a Saver that keeps the graphs) and LOAD's rebuild (graphs that run against
the live engine's tensors, as restored graphs do at SAVE's addresses). tests/gpu/test_tiny_engine_gpu.py runs the
same engine for real. Runs in the vLLM CPU venv (its torch), against the built runtime wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.network, pytest.mark.slow]

HERE = Path(__file__).resolve().parent

SCRIPT = r"""
import gc, json, sys, types
sys.path.insert(0, HERE)
import torch
import tiny_engine as te
from graphpersist import api, engine, run
from graphpersist.engine import budget, caches, session as session_mod

session_mod.interposer_loaded = lambda: True
torch.cuda.set_device = lambda index: None
torch.cuda.mem_get_info = lambda: (40 << 30, 80 << 30)  # what a GPU would have free
api.start_region = lambda: types.SimpleNamespace(base=0x500000000000, size=1 << 40)
api.use_layout = lambda directory, rank: None
marks, captured_at, handed, ahead_at_caches, gc_on = [], [], [], [], {"build": [], "marked": []}
api.mark_setup = lambda tensors: marks.append(sorted(tensors)) or gc_on["marked"].append(gc.isenabled()) or 0
built = te.TinyModel.__init__
te.TinyModel.__init__ = lambda self, cfg: gc_on["build"].append(gc.isenabled()) or built(self, cfg)
api.verify_state = lambda: []


class CpuGraph:
    # a graph stand-in: replay re-runs the forward it captured into the output it captured
    def __init__(self, fn, out):
        self.fn, self.out, self.outputs = fn, out, out

    def instantiate(self):
        pass

    def replay(self):
        self.out.copy_(self.fn())


def capture_one(self, bs):
    sess = engine.current()
    captured_at.append((sess.mode.value if sess else "off", bs))
    fn = lambda: self.model(self.inputs[bs], self.cache)
    out = fn()
    return CpuGraph(fn, out), out


te.TinyEngine._capture_one = capture_one
archive = {}


class KeepingSaver:
    # the archive's serialization stand-in: keeps the graphs, the facts and what SAVE passes for rank 0
    def __init__(self, **kwargs):
        self.graphs = {}

    def add(self, name, graph, inputs, outputs, *, capture_size, mode):
        self.graphs[name] = (capture_size, mode)

    def save(self, directory, facts, **kwargs):
        import os
        os.makedirs(directory, exist_ok=True)
        kwargs["before_write"]()
        archive.update(graphs=self.graphs, flags=facts.flags, notes=json.loads(json.dumps(kwargs["notes"])),
                       engine=facts.engine, model=facts.model)
        split = {"prepare": 0.0, "write": 0.0, "shared": 0.0, "commit": 0.0}
        return {"serialize_s": 0.0, "images": 0, "split_s": split}


def check_before_setup(self):
    # the early check's stand-in: what the archive recorded, read back as the real one reads it
    self.saved_flags, self.saved_notes = dict(archive["flags"]), archive["notes"]
    self.saved_budget = budget.saved(self.saved_flags, self.directory)
    self.adapter.read_saved(self)


class Result(dict):
    # what api.load returns, by graph name, with the rank's notes
    notes = property(lambda self: archive["notes"])
    timings = {"validate_s": 0.0, "memory_s": 0.0, "images_s": 0.0, "graphs_s": 0.0, "rebuild_s": 0.0,
               "instantiate_s": 0.0, "upload_s": 0.0}


def load(directory, facts, **kwargs):
    # LOAD's rebuild stand-in: every saved graph, running against the live engine's tensors (SAVE's addresses)
    eng = engine.current().adapter.eng
    handed.append(kwargs["ahead"] is engine.current().read_ahead is not None)  # the session's reading ahead
    graphs = Result()
    for name, (bs, mode) in archive["graphs"].items():
        graphs[name] = CpuGraph(lambda bs=bs: eng.model(eng.inputs[bs], eng.cache), torch.zeros(bs, eng.cfg.hidden))
    return graphs


api.load = load
import graphpersist.save
graphpersist.save.Saver = KeepingSaver
session_mod.PersistSession._check_before_setup = check_before_setup
# the stand-in archive carries no JIT caches; the reading ahead begins only after their restore (the GIL)
caches.SessionCaches.restore = lambda self, sess: ahead_at_caches.append(sess.read_ahead)

cfg = te.TinyConfig(hidden=64, layers=3, sizes=(1, 2, 4), cache_bytes=(1 << 30) + (5 << 20))
x = {bs: torch.randn(bs, cfg.hidden, generator=torch.Generator().manual_seed(bs)) for bs in cfg.sizes}
out = {}
eng = te.TinyEngine(cfg, device="cpu")
assert eng.persist is None
out["off"] = {bs: eng.generate(x[bs]).tolist() for bs in cfg.sizes}
with te.persisting("save", ARCHIVE):
    run.fresh()  # each engine start is a process of its own
    eng = te.TinyEngine(cfg, device="cpu")
    save = eng.persist
    out["save"] = {bs: eng.generate(x[bs]).tolist() for bs in cfg.sizes}
with te.persisting("load", ARCHIVE):
    run.fresh()
    eng = te.TinyEngine(cfg, device="cpu")
    load_sess = eng.persist
    out["load"] = {bs: eng.generate(x[bs]).tolist() for bs in cfg.sizes}
refused = None
with te.persisting("load", ARCHIVE):
    run.fresh()
    try:
        te.TinyEngine(te.TinyConfig(hidden=64, layers=3, sizes=(1, 2), cache_bytes=cfg.cache_bytes), device="cpu")
    except Exception as exc:
        refused = f"{type(exc).__name__}: {exc}"
print(json.dumps({
    "same": [out["save"] == out["off"], out["load"] == out["save"]],
    "captured_at": captured_at,
    "marks": len(marks),
    "saved_graphs": archive["graphs"],
    "flags": archive["flags"],
    "notes": archive["notes"],
    "steps": [save.step, load_sess.step],
    "counts": [save.captured, load_sess.restored, load_sess.capture_calls],
    "budget": [save.budget_bytes, load_sess.budget_bytes],
    "refused": refused,
    "handed": handed,
    "ahead_at_caches": [repr(a) for a in ahead_at_caches],
    "gc_on": gc_on,
    "gc_on_after": gc.isenabled(),
}))
"""


def test_a_third_engine_saves_and_loads_through_its_adapter_alone(vllm_venv: Path, tmp_path: Path) -> None:
    engine_src = (HERE / "tiny_engine.py").read_text()
    assert len(engine_src.splitlines()) < 250, "the third engine, adapter included, stays under 250 lines"
    code = SCRIPT.replace("HERE", repr(str(HERE))).replace("ARCHIVE", repr(str(tmp_path / "archive")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHPERSIST_", "PYTHONPATH", "LD_PRELOAD"))}
    proc = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["same"] == [True, True]  # off, SAVE and LOAD serve the same tokens
    assert got["captured_at"] == [["off", 1], ["off", 2], ["off", 4], ["save", 1], ["save", 2], ["save", 4]]  # not LOAD
    assert got["saved_graphs"] == {"tiny/1": [1, "decode"], "tiny/2": [2, "decode"], "tiny/4": [4, "decode"]}
    assert got["notes"] == {"decode": {"tiny/1": {"size": 1}, "tiny/2": {"size": 2}, "tiny/4": {"size": 4}}}
    assert got["flags"]["memory_budget_bytes"] == 1 << 30 and got["flags"]["cache_rows"] == (1 << 30) >> 16
    assert got["budget"] == [1 << 30, 1 << 30]  # LOAD reuses SAVE's budget; the cache is laid out the same
    assert got["steps"] == ["finish", "finish"] and got["marks"] == 3  # the refused LOAD marked its setup too
    assert got["counts"] == [3, 3, 0]
    assert got["handed"] == [True, True]  # each LOAD's restore was handed the archive its start began reading
    assert got["ahead_at_caches"] == ["None", "None"]  # and began it after the JIT caches' restore
    # the collector's automatic passes: as upstream's when off; paused while SAVE and LOAD build the model (the refused
    # LOAD's too), on again from the memory budget (the graphs) and after the last start
    assert got["gc_on"] == {"build": [True, False, False, False], "marked": [True, True, True]}, got["gc_on"]
    assert got["gc_on_after"] is True
    assert got["refused"] == (
        "PersistError: graphpersist: decode graphs differ: not in the archive none, saved but not replayed by this "
        "configuration ['tiny/4']. Re-run with mode=save for this configuration."
    )
