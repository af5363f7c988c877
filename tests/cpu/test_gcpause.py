"""graphpersist.gcpause at start-up: a persistence session (SAVE or LOAD) freezes the imports' heap, persistence off
(no session) leaves the collector as upstream has it, and the meter counts the collections a start runs.

Each case runs in a fresh interpreter: a freeze is process-wide and would change the test process's collector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

RUNTIME = Path(__file__).resolve().parents[2] / "overlays" / "graphpersist"


def run(code: str) -> Any:
    """Runs `code` in a fresh Python with the runtime importable; returns the JSON it prints last."""
    env = {**os.environ, "PYTHONPATH": str(RUNTIME)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


# A cycle made before the start (an import's leftover) and one made after (the engine's own garbage), each with a
# weak reference that says whether a collection freed it.
CYCLES = """
import gc, json, weakref
from graphpersist import gcpause

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

old = cycle()
tracked_before = len(gc.get_objects())
frozen = gcpause.freeze_at_start()
tracked_after = len(gc.get_objects())
new = cycle()
gc.collect()
result = {"frozen": frozen, "freeze_count": gc.get_freeze_count(), "old_alive": old() is not None,
          "new_alive": new() is not None, "tracked_before": tracked_before, "tracked_after": tracked_after}
gc.unfreeze()  # what the engines' shutdown does
gc.collect()
result["old_alive_after_unfreeze"] = old() is not None
print(json.dumps(result))
"""


def test_a_session_freezes_the_start_up_heap_and_still_collects_what_the_start_makes() -> None:
    got = run(CYCLES)
    assert got["frozen"] == got["freeze_count"] > 1000  # the interpreter's and the runtime's objects
    assert got["tracked_after"] < got["tracked_before"] - 1000  # full passes no longer walk them
    assert got["new_alive"] is False  # garbage made after the freeze is collected as before
    assert got["old_alive"] is True  # garbage that existed at the freeze waits for the unfreeze
    assert got["old_alive_after_unfreeze"] is False


def test_the_meter_counts_full_passes_and_younger_ones_apart() -> None:
    got = run(
        """
        import gc, json
        from graphpersist import gcpause
        meter = gcpause.CollectionMeter()
        gc.collect()  # before start(): not counted
        meter.start()
        meter.start()  # idempotent: one callback
        gc.collect()
        gc.collect()
        gc.collect(0)
        meter.stop()
        gc.collect()  # after stop(): not counted
        print(json.dumps(meter.summary()))
        """
    )
    assert got["full_passes"] == 2 and got["passes"][2] == 2
    assert got["passes"][0] >= 1  # gc.collect(0), and whatever the interpreter ran meanwhile
    assert got["full_s"] >= 0 and got["full_s"] == got["seconds"][2]


def test_a_session_freezes_whether_it_saves_or_loads_and_reports_its_collections() -> None:
    """PersistSession.begin() freezes before it touches the GPU; its stats carry the freeze and the meter. torch is
    stood in (CPU test host: no CUDA), the region start and LOAD's checks too: what is pinned is the order."""
    code = """
    import gc, json, os, sys, types
    calls = []
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(CUDAGraph=type("CUDAGraph", (), {"capture_begin": lambda self: None}),
                                       set_device=lambda i: calls.append(("set_device", gc.get_freeze_count() > 0)))
    sys.modules["torch"] = torch
    os.environ.update(GRAPHPERSIST_MODE="WHICH", GRAPHPERSIST_DIR="/")
    from graphpersist import api
    from graphpersist.engine import caches, session as session_mod

    api.start_region = lambda: types.SimpleNamespace(base=0x500000000000, size=1 << 40)
    api.use_layout = lambda directory, rank: calls.append(("use_layout", gc.get_freeze_count() > 0))
    class Adapter:
        name = "fake"
        note_sections = ()
        logger = types.SimpleNamespace(info=lambda *a: None)
        unused_param_bytes = None
        pins_kernel_choices = False
        def refuse(self): pass
        def rank(self): return 0
        def parallel(self): return {"world_size": 1}
        def output_types(self): return {}
        def device_index(self): return 0
        def model_facts(self): return {}
        def cache_resolvers(self): return {}
    session_mod.interposer_loaded = lambda: True
    session_mod.PersistSession._check_before_setup = lambda self: calls.append(("check", gc.get_freeze_count() > 0))
    caches.SessionCaches.restore = lambda self, sess: None
    sess = session_mod.PersistSession.begin(Adapter())
    gc.collect()
    stats = sess.stats()["gc"]
    sess.finish()
    gc.collect()
    print(json.dumps({"calls": calls, "gc": stats, "after_stop": sess.stats()["gc"]["full_passes"]}))
    """
    load = run(code.replace("WHICH", "load"))
    assert load["calls"] == [["set_device", True], ["check", True], ["use_layout", True]]
    assert load["gc"]["frozen_at_start"] > 1000
    assert load["gc"]["full_passes"] >= 1
    assert load["after_stop"] == load["gc"]["full_passes"]  # finish ends the start: the meter stops
    save = run(code.replace("WHICH", "save"))
    assert save["calls"] == [["set_device", True]]
    assert save["gc"]["frozen_at_start"] > 1000
