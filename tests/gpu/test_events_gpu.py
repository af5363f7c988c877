"""GPU test: event record/wait nodes survive SAVE -> LOAD in a fresh process; unsupported nodes are refused.

Process A (`save`) captures a graph whose side branch waits on an external event and records another one, so
the captured graph holds real CU_GRAPH_NODE_TYPE_WAIT_EVENT / EVENT_RECORD nodes (counted, not assumed), saves
it, and replays it under an engine-style protocol: a 1-second spin kernel on another stream gates the wait
event, a third stream waits on the recorded event and copies the side branch's output. Processes B (`load`,
native and Python rebuild) load the archive with no capture and run the same protocol with the loaded graph's
live events (`LoadedGraph.events`): the graph must be held by the wait, the copy must see the finished side
branch, and every output must be bit-identical to A's. A also checks that topology fingerprints do not depend
on event handle values, and that SAVE refuses a graph with a host node, naming the node.

Run: `python3 -m pytest -m gpu tests/gpu/test_events_gpu.py` on a GPU host (torch, cuda-bindings, gcc).
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from interposed import run_step, step_main

N = 1 << 16
SPIN_CYCLES = 1_000_000_000  # about 0.5 s at 2 GHz: long enough to see the wait node hold the graph
ENGINE = {"name": "graphpersist-events-test", "version": "1", "commit": "none"}
MODEL = {"dtype": "float32", "config_fingerprint": "events-test-v1"}
_keep: list[Any] = []  # host callbacks referenced by captured graphs


# ------------------------------------------------------------------------------------------- workers


def _setup() -> tuple[Any, Any, dict[str, Any]]:
    """Context, region and the static buffers: identical in SAVE and LOAD processes."""
    import torch

    from graphpersist import api

    api.start_region()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {"x": torch.zeros(N, device="cuda"), "w": torch.randn(N, generator=gen, device="cuda")}
    torch.cuda.synchronize()
    return torch, api, tensors


def _inputs(torch: Any) -> Any:
    return torch.randn(N, generator=torch.Generator().manual_seed(7))


def _ck(result: Any, what: str) -> Any:
    from graphpersist.graph.images import check

    return check(result, what)


class _TorchEvents:
    """torch.cuda.Event(external=True): record/wait become event nodes when captured (torch >= 2.7)."""

    label = "torch.cuda.Event(external=True)"

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def new(self) -> Any:
        ev = self.torch.cuda.Event(external=True)
        ev.record()  # created now: torch's wait on a never-recorded event is a no-op
        return ev

    def handle(self, ev: Any) -> int:
        return int(ev.cuda_event)

    def record(self, ev: Any, stream: Any) -> None:
        ev.record(stream)

    def wait(self, ev: Any, stream: Any) -> None:
        stream.wait_event(ev)


class _DriverEvents:
    """Fallback: cuEventRecordWithFlags(RECORD_EXTERNAL) / cuStreamWaitEvent(WAIT_EXTERNAL) during capture."""

    label = "cuda-bindings cuEventRecordWithFlags/cuStreamWaitEvent EXTERNAL"

    def __init__(self, drv: Any) -> None:
        self.drv = drv

    def new(self) -> Any:
        return _ck(self.drv.cuEventCreate(0x2), "cuEventCreate")

    def handle(self, ev: Any) -> int:
        return int(ev)

    def record(self, ev: Any, stream: Any) -> None:
        flag = int(self.drv.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
        _ck(self.drv.cuEventRecordWithFlags(ev, stream.cuda_stream, flag), "cuEventRecordWithFlags")

    def wait(self, ev: Any, stream: Any) -> None:
        flag = int(self.drv.CUevent_wait_flags.CU_EVENT_WAIT_EXTERNAL)
        _ck(self.drv.cuStreamWaitEvent(stream.cuda_stream, ev, flag), "cuStreamWaitEvent")


def _forward(torch: Any, t: dict[str, Any], side: Any, evapi: Any = None, evs: Any = None) -> list[Any]:
    """Fork onto `side`, which waits on evs[0] (wait node) and records evs[1] (record node); join back."""
    cap = torch.cuda.current_stream()
    a = t["x"] * 2.0 + 1.0
    side.wait_stream(cap)  # fork: an edge
    with torch.cuda.stream(side):
        if evs:
            evapi.wait(evs[0], side)
        b = torch.sin(a) * t["w"]
        if evs:
            evapi.record(evs[1], side)
    c = torch.cos(a) + t["w"]
    cap.wait_stream(side)  # join: an edge
    return [b * c + a, b]


def _node_types(drv: Any, graph: Any) -> dict[str, int]:
    """Node count per CUgraphNodeType name, read from the driver (what the graph really holds)."""
    from graphpersist.graph import node_type_name

    n = _ck(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1]
    nodes = _ck(drv.cuGraphGetNodes(graph, n), "cuGraphGetNodes")[0] if n else []
    out: dict[str, int] = {}
    for nd in nodes:
        name = node_type_name(_ck(drv.cuGraphNodeGetType(nd), "cuGraphNodeGetType"))
        out[name] = out.get(name, 0) + 1
    return out


def _protocol(torch: Any, drv: Any, replay: Any, ev_in: Any, ev_out: Any, x: Any, outs: list[Any]) -> dict:
    """Engine-style use of the graph's external events; returns whether each one took effect, and the outputs.

    A spin kernel on `blocker` precedes the record of `ev_in`, so a working wait node holds the graph's side
    branch; `after` waits on `ev_out` and copies the side branch's output, which it sees finished only if the
    record node records `ev_out`.
    """
    main, blocker, after = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    seen = torch.empty_like(outs[1])
    x.copy_(_inputs(torch))
    outs[1].fill_(float("nan"))
    torch.cuda.synchronize()
    with torch.cuda.stream(blocker):
        torch.cuda._sleep(SPIN_CYCLES)
    _ck(drv.cuEventRecord(ev_in, blocker.cuda_stream), "cuEventRecord(ev_in)")
    replay()
    _ck(drv.cuStreamWaitEvent(after.cuda_stream, ev_out, 0), "cuStreamWaitEvent(ev_out)")
    with torch.cuda.stream(after):
        seen.copy_(outs[1])
    time.sleep(0.1)
    held = not main.query() and not blocker.query()
    torch.cuda.synchronize()
    got = [o.detach().cpu().clone() for o in outs]
    return {
        "held_by_wait_node": held,
        "record_node_ordered_copy": bool(torch.equal(seen.cpu(), got[1])),
        "outs": got,
    }


def step_save(archive: Path, out: Path) -> dict[str, Any]:
    torch, api, t = _setup()
    from cuda.bindings import driver as drv

    from graphpersist import graph as graphs
    from graphpersist.graph import images
    from graphpersist.memory import region

    api.mark_setup(t)
    side = torch.cuda.Stream()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(2):
            _forward(torch, t, side)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()

    def capture(evapi: Any) -> tuple[Any, list[Any], list[Any]]:
        evs = [evapi.new(), evapi.new()]
        torch.cuda.synchronize()
        g = api.PersistentCUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outs = _forward(torch, t, side, evapi, evs)
        return g, outs, evs

    tried: list[dict[str, Any]] = []
    chosen = None
    for evapi in (_TorchEvents(torch), _DriverEvents(drv)):
        try:
            g, outs, evs = capture(evapi)
        except Exception as exc:  # record why this way failed; the fallback follows
            tried.append({"api": evapi.label, "error": f"{type(exc).__name__}: {exc}"})
            continue
        counts = _node_types(drv, drv.CUgraph(g.raw_cuda_graph()))
        tried.append({"api": evapi.label, "node_types": counts})
        if counts.get("CU_GRAPH_NODE_TYPE_EVENT_RECORD") and counts.get("CU_GRAPH_NODE_TYPE_WAIT_EVENT"):
            chosen = (evapi, g, outs, evs, counts)
            break
    if chosen is None:
        return {"tried": tried, "event_nodes_captured": False}
    evapi, g, outs, evs, counts = chosen
    g.instantiate()

    saver = api.Saver()
    saver.add("ev", g, [t["x"]], outs, capture_size=1, mode="full")
    summary = saver.save(archive, api.Facts(ENGINE, MODEL))
    rec = json.loads((archive / "rank_0" / "rank.json").read_text())
    desc_text = json.dumps(_saved_desc(archive, "ev"))
    handles = [evapi.handle(e) for e in evs]

    h_in, h_out = (drv.CUevent(h) for h in handles)
    proto = _protocol(torch, drv, g.replay, h_in, h_out, t["x"], outs)
    torch.save(proto.pop("outs"), out / "ref.pt")

    # Same code, other events (other handle values): the descriptions and fingerprints must not change.
    info = region.info()
    lo, hi = info.base, info.base + info.size
    table = images.ImageTable.current()
    g2, _outs2, evs2 = capture(evapi)
    sg1 = graphs.serialize(drv.CUgraph(g.raw_cuda_graph()), table, lo, hi)
    sg2 = graphs.serialize(drv.CUgraph(g2.raw_cuda_graph()), table, lo, hi)
    fps = {
        "saved": rec["graphs"][0]["topology_fingerprint"],
        "serialize_again": graphs.topology_fingerprint(sg1.desc),
        "second_capture_other_events": graphs.topology_fingerprint(sg2.desc),
    }

    # A host node (cuLaunchHostFunc during capture) must make SAVE fail naming the node.
    libcuda = ctypes.CDLL("libcuda.so.1")
    host_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _p: None)
    _keep.append(host_fn)
    libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, type(host_fn), ctypes.c_void_p]
    g3 = api.PersistentCUDAGraph()
    with torch.cuda.graph(g3, pool=pool):
        y = t["x"] + 1.0
        host_rc = libcuda.cuLaunchHostFunc(torch.cuda.current_stream().cuda_stream, host_fn, None)
        z = y * 2.0
    host_counts = _node_types(drv, drv.CUgraph(g3.raw_cuda_graph()))
    bad = api.Saver()
    bad.add("with_host", g3, [t["x"]], [z], capture_size=1, mode="full")
    try:
        bad.save(out / "host_archive", api.Facts(ENGINE, MODEL))
        refusal = {"refused": False, "message": "SAVE went through"}
    except api.PersistError as exc:
        refusal = {"refused": True, "message": str(exc)}
    refusal["archive_written"] = (out / "host_archive").exists()

    return {
        "tried": tried,
        "event_nodes_captured": True,
        "api": evapi.label,
        "node_types": counts,
        "nodes_by_type_saved": rec["graphs"][0]["nodes_by_type"],
        "desc_events": json.loads(desc_text).get("events"),
        "handles": handles,
        "second_handles": [evapi.handle(e) for e in evs2],
        "handles_in_description": [h for h in handles if str(h) in desc_text or hex(h) in desc_text],
        "fingerprints": fps,
        "protocol": proto,
        "host_rc": host_rc,
        "host_node_types": host_counts,
        "host_refusal": refusal,
        "summary_nodes": summary["nodes"],
        "torch_exec_flags": int(_ck(drv.cuGraphExecGetFlags(drv.CUgraphExec(g.raw_cuda_graph_exec())), "flags")),
        "saved_instantiate_flags": rec["graphs"][0]["instantiate_flags"],
    }


def _saved_desc(archive: Path, name: str) -> dict[str, Any]:
    """A graph's whole description as the archive's graph pack holds it."""
    from graphpersist.graph import pack as graphpack

    pack = (archive / "rank_0" / graphpack.PACK_NAME).read_bytes()
    index = json.loads((archive / "rank_0" / graphpack.INDEX_NAME).read_text())
    entry = next(g for g in graphpack.parse_index(index, len(pack)) if g.name == name)
    return entry.full_desc_of(pack)


def step_load(archive: Path, out: Path, native: bool) -> dict[str, Any]:
    torch, api, t = _setup()
    import contextlib

    from cuda.bindings import driver as drv
    from gpdiag import rebuild as reference

    with contextlib.nullcontext() if native else reference.in_load():  # Python: the reference rebuild (gpdiag)
        res = api.load(archive, api.Facts(ENGINE, MODEL), sizes=[1], modes=["full"], setup_tensors=t)
    lg = res.graphs["ev"]
    desc = _saved_desc(archive, "ev")
    wait_idx = [nd["event"] for nd in desc["nodes"] if nd["type"] == "event_wait"]
    rec_idx = [nd["event"] for nd in desc["nodes"] if nd["type"] == "event_record"]
    counts = _node_types(drv, lg.graph)
    proto = _protocol(torch, drv, lg.replay, lg.events[wait_idx[0]], lg.events[rec_idx[0]], lg.inputs[0], lg.outputs)
    got = proto.pop("outs")
    ref = torch.load(out / "ref.pt")
    return {
        "native": native,
        "node_types": counts,
        "events": len(lg.events),
        "wait_idx": wait_idx,
        "rec_idx": rec_idx,
        "input_at_setup_buffer": lg.inputs[0].data_ptr() == t["x"].data_ptr(),
        "exec_flags": int(_ck(drv.cuGraphExecGetFlags(lg.exec), "cuGraphExecGetFlags")),
        "protocol": proto,
        "bit_identical": [_same(torch, a, b) for a, b in zip(got, ref, strict=True)],
    }


def _same(torch: Any, a: Any, b: Any) -> bool:
    return bool(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))


# ------------------------------------------------------------------------------------------- the test


def _run(step: str, archive: Path, out: Path) -> dict[str, Any]:
    return run_step(__file__, [step, str(archive), str(out)], out / f"{step}.json")[0]


@pytest.mark.gpu
def test_event_nodes_save_load_replay(tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    a = _run("save", archive, tmp_path)
    print(json.dumps({k: v for k, v in a.items() if k != "protocol"}, indent=1))
    assert a["event_nodes_captured"], f"no capture produced event nodes: {a['tried']}"
    assert a["nodes_by_type_saved"]["event_record"] == a["node_types"]["CU_GRAPH_NODE_TYPE_EVENT_RECORD"]
    assert a["nodes_by_type_saved"]["event_wait"] == a["node_types"]["CU_GRAPH_NODE_TYPE_WAIT_EVENT"]
    assert a["desc_events"] == [{"flags": 2}, {"flags": 2}]
    assert a["handles_in_description"] == [] and set(a["handles"]).isdisjoint(a["second_handles"])
    assert len(set(a["fingerprints"].values())) == 1, a["fingerprints"]
    # SAVE records how torch instantiated the graph (torch 2.11.0+cu130: 0x1, auto-free-on-launch); LOAD repeats it
    assert a["saved_instantiate_flags"] == a["torch_exec_flags"], (a["saved_instantiate_flags"], a["torch_exec_flags"])
    assert a["protocol"] == {"held_by_wait_node": True, "record_node_ordered_copy": True}, a["protocol"]
    ref = a["host_refusal"]
    assert a["host_rc"] == 0 and a["host_node_types"].get("CU_GRAPH_NODE_TYPE_HOST") == 1, a["host_node_types"]
    assert ref["refused"] and not ref["archive_written"], ref
    assert "graph 'with_host': node" in ref["message"] and "(CU_GRAPH_NODE_TYPE_HOST)" in ref["message"], ref

    for step in ("load-native", "load-python"):
        b = _run(step, archive, tmp_path)
        print(step, json.dumps(b))
        assert b["node_types"] == a["node_types"], (step, b["node_types"], a["node_types"])
        assert b["events"] == 2 and b["input_at_setup_buffer"], b
        assert b["protocol"] == a["protocol"], (step, b["protocol"])
        assert b["bit_identical"] == [True, True], (step, b["bit_identical"])
        assert b["exec_flags"] == a["torch_exec_flags"], (step, b["exec_flags"], a["torch_exec_flags"])


def _step(args: list[str]) -> dict[str, Any]:
    step, archive, out = args[0], Path(args[1]), Path(args[2])
    return step_save(archive, out) if step == "save" else step_load(archive, out, native=step == "load-native")


if __name__ == "__main__":
    sys.exit(step_main(_step))
