# ruff: noqa: F811  (srt and upstream_standins are fixtures imported from the persistence tests)
"""SGLang's DeepEP glue (overlays/sglang/sglang/srt/graphpersist_deepep.py and what it changes elsewhere), on CPU.

Stand-ins replace what needs a GPU (the Buffer, the model, the session's region); the decisions that read upstream
objects run against the pristine pinned SGLang where they can (its CUDA-graph config module, its server_args with
patch 0009, deep_ep's buffer.py with our series). What this does NOT prove: that a DeepEP Buffer comes up at the
same address at LOAD, or that breakable decode graphs with DeepEP breaks replay bit-exact (the EP=2 recipe on a
two-GPU host does; never run).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from module_file import load_module
from test_engine_sglang_persist_cpu import (  # noqa: F401
    Key,
    StandInBackend,
    StandInGraph,
    StandInSaver,
    StandInServerArgs,
    loaded,
    open_session,
    srt,
    upstream_standins,
)

from graphpersist import engine, switch
from graphpersist.engine import PersistError, Refused

NVL_AT = 0x7F3A00000000


def deepep_args(**change: Any) -> StandInServerArgs:
    """A `--moe-a2a-backend deepep --deepep-mode normal` EP=2 start, as ServerArgs resolves it (ep_size = tp_size)."""
    args = StandInServerArgs(moe_a2a_backend="deepep", deepep_mode="normal", ep_size=2,
                             moe_runner_backend="deep_gemm", model_path="Qwen/Qwen3-30B-A3B")  # fmt: skip
    for name, value in change.items():
        setattr(args, name, value)
    return args


# ----------------------------------------------------------------------------------------------- what is refused
def test_normal_mode_within_one_node_is_supported(srt: SimpleNamespace) -> None:
    srt.facts.refuse_unsupported(deepep_args(), {})


@pytest.mark.parametrize("mode", ["auto", "low_latency"])
def test_low_latency_mode_is_refused_at_start_up_saying_what_to_use(srt: SimpleNamespace, mode: str) -> None:
    with pytest.raises(Refused) as err:
        srt.facts.refuse_unsupported(deepep_args(deepep_mode=mode), {})
    message = str(err.value)
    assert message.startswith(f"graphpersist: DeepEP's low-latency mode (--deepep-mode {mode}")
    assert "cannot be persisted" in message and "NVSHMEM" in message and "captured in the decode graphs" in message
    assert "Instead, use --deepep-mode normal" in message


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"enable_single_batch_overlap": True}, "--enable-single-batch-overlap"),
        ({"nnodes": 2}, "several nodes (--nnodes 2)"),
        ({"moe_a2a_backend": "mooncake"}, "--moe-a2a-backend mooncake"),
    ],
)
def test_what_deepep_persistence_cannot_take_is_refused(
    srt: SimpleNamespace, change: dict[str, Any], names: str
) -> None:
    with pytest.raises(Refused, match="cannot be persisted") as err:
        srt.facts.refuse_unsupported(deepep_args(**change), {})
    assert names in str(err.value)


def test_breakable_decode_graphs_are_taken_only_with_deepep(srt: SimpleNamespace) -> None:
    from test_engine_sglang_persist_cpu import GraphConfig, Phase

    breakable = GraphConfig(decode=Phase("breakable", [8, 16]))
    srt.facts.refuse_unsupported(deepep_args(cuda_graph_config=breakable), {})
    with pytest.raises(Refused, match="decode CUDA graphs with the 'breakable' backend"):
        srt.facts.refuse_unsupported(StandInServerArgs(cuda_graph_config=breakable), {})


# --------------------------------------------------------------------------------------------- facts and flags
def parallel(srt: SimpleNamespace, server_args: Any) -> dict[str, int]:
    """The parallel layout the archive records, as the adapter answers it."""
    return srt.adapter.SglangAdapter(SimpleNamespace(server_args=server_args)).parallel()


def test_the_archive_records_the_expert_parallel_size_and_deepeps_settings(srt: SimpleNamespace) -> None:
    assert parallel(srt, deepep_args()) == {"world_size": 2, "tp_size": 2, "pp_size": 1, "ep_size": 2}
    flags = srt.facts.config_flags(deepep_args(), {})
    assert {k: flags[k] for k in ("moe_a2a_backend", "deepep_mode", "deepep_config", "moe_runner_backend", "ep_size")} \
        == {"moe_a2a_backend": "deepep", "deepep_mode": "normal", "deepep_config": None,
            "moe_runner_backend": "deep_gemm", "ep_size": 2}  # fmt: skip


def test_without_deepep_the_expert_parallel_size_is_one(srt: SimpleNamespace) -> None:
    assert parallel(srt, StandInServerArgs(ep_size=2))["ep_size"] == 1


# -------------------------------------------------------------- patch 0009: the graphs stay on, as breakable ones
@pytest.fixture
def cuda_graph_config(upstream_tree: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The pinned SGLang's own cuda_graph_config module (standard library only): real Backend and PhaseConfig."""
    name = "sglang.srt.model_executor.cuda_graph_config"
    path = upstream_tree("sglang") / "sglang/srt/model_executor/cuda_graph_config.py"
    return load_module(path, name, functools.partial(monkeypatch.setitem, sys.modules))


def _graphs(cgc: ModuleType, decode: str, prefill: str) -> Any:
    return cgc.CudaGraphConfig(decode=cgc.PhaseConfig(backend=decode), prefill=cgc.PhaseConfig(backend=prefill))


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_the_graph_backends_the_glue_names_are_upstreams_values(
    srt: SimpleNamespace, cuda_graph_config: ModuleType
) -> None:
    """The glue names backends by value ("breakable", "disabled"), as graphpersist_facts checks them."""
    backend = cuda_graph_config.Backend
    assert (backend.FULL, backend.BREAKABLE, backend.DISABLED) == ("full", "breakable", "disabled")
    named = {*srt.facts.DECODE_BACKENDS, *srt.facts.DEEPEP_DECODE_BACKENDS, *srt.facts.PREFILL_BACKENDS}
    assert named <= set(backend.ALL)


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_persistence_off_leaves_upstream_to_turn_the_graphs_off(
    srt: SimpleNamespace, cuda_graph_config: ModuleType
) -> None:
    args = deepep_args(cuda_graph_config=_graphs(cuda_graph_config, "full", "breakable"))
    args.graph_persist, args.graph_persist_dir = None, None
    assert srt.deepep.keep_graphs_in_normal_mode(args) is False
    assert (args.cuda_graph_config.decode.backend, args.cuda_graph_config.prefill.backend) == ("full", "breakable")


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
@pytest.mark.parametrize(
    ("decode", "prefill", "kept"),
    [
        ("full", "breakable", ("breakable", "breakable")),
        ("full", "full", ("breakable", "disabled")),
        ("full", "tc_piecewise", ("breakable", "disabled")),
        ("disabled", "disabled", ("disabled", "disabled")),
    ],
)
def test_persistence_keeps_breakable_graphs_where_deepep_runs_as_a_break(
    srt: SimpleNamespace, cuda_graph_config: ModuleType, tmp_path: Path, decode: str, prefill: str, kept: tuple
) -> None:
    args = deepep_args(cuda_graph_config=_graphs(cuda_graph_config, decode, prefill))
    args.graph_persist, args.graph_persist_dir = "save", str(tmp_path)
    assert srt.deepep.keep_graphs_in_normal_mode(args) is True
    assert (args.cuda_graph_config.decode.backend, args.cuda_graph_config.prefill.backend) == kept


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_patch_0009_asks_before_upstream_turns_the_graphs_off(upstream_tree: Callable[[str], Path],
                                                            repo_root: Path, tmp_path: Path) -> None:  # fmt: skip
    """Applied to the pinned server_args.py, the normal-mode branch that disables both graph backends now runs only
    when keep_graphs_in_normal_mode says no (persistence off), and still disables both then."""
    from gptools import apply as gpapply
    from gptools import series as gpseries

    patches = repo_root / "patches" / "sglang"
    rel = "sglang/srt/server_args.py"
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_bytes((upstream_tree("sglang") / rel).read_bytes())
    for name in gpseries.read_series(patches).names:
        patch = gpseries.read_patch(patches / name)
        if rel in gpapply.touched_paths([patch]):
            gpapply.apply_patch(tmp_path, patch)
    tree = ast.parse((tmp_path / rel).read_text())
    [method] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_handle_a2a_moe"]
    ifs = [n for n in ast.walk(method) if isinstance(n, ast.If) and "keep_graphs_in_normal_mode" in ast.unparse(n.test)]
    assert [ast.unparse(n.test) for n in ifs] == [
        "self.deepep_mode == 'normal' and (not keep_graphs_in_normal_mode(self))"
    ]
    body = "\n".join(ast.unparse(s) for s in ifs[0].body)
    assert "self.cuda_graph_config.decode.backend = Backend.DISABLED" in body
    assert "self.cuda_graph_config.prefill.backend = Backend.DISABLED" in body


# ---------------------------------------------------------------------------------------------- the Buffer's facts
@dataclass
class StandInTensor:
    address: int

    def data_ptr(self) -> int:
        return self.address


@dataclass
class StandInBuffer:
    """A deep_ep.Buffer's Python attributes (ours: patch 0003 adds use_fabric and allow_mnnvl)."""

    num_nvl_bytes: int = 1 << 30
    num_rdma_bytes: int = 0
    low_latency_mode: bool = False
    use_fabric: bool = False
    allow_mnnvl: bool = False
    rank: int = 0
    group_size: int = 2
    asked: list[Any] = field(default_factory=list)

    def get_local_buffer_tensor(self, dtype: Any) -> StandInTensor:
        self.asked.append(dtype)
        return StandInTensor(NVL_AT)


VERSION = "1.2.1.post20251110+gp.1"
OUR_DEEP_EP = Path(__file__).resolve().parents[2] / "overlays" / "deep_ep" / "deep_ep" / "graphpersist_buffer.py"


def our_deep_ep(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Our deep_ep as SGLang's glue imports it (`deep_ep.graphpersist_buffer`, the overlay's file: deep_ep's own
    __init__ needs torch and the extension), recording with the stand-ins' dtype and our deep_ep's version."""
    module = load_module(
        OUR_DEEP_EP, "deep_ep.graphpersist_buffer", functools.partial(monkeypatch.setitem, sys.modules)
    )
    monkeypatch.setattr(module, "recorded", functools.partial(module.recorded, version=VERSION, byte="uint8"))
    package = ModuleType("deep_ep")
    package.graphpersist_buffer = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_ep", package)
    return module


@pytest.fixture
def ours(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return our_deep_ep(monkeypatch)


def facts_of(srt: SimpleNamespace, buffer: Any) -> dict[str, Any]:
    return srt.deepep.buffer_facts(buffer)


def test_the_buffer_facts_are_its_sizes_mode_fabric_settings_place_and_build(
    srt: SimpleNamespace, ours: ModuleType
) -> None:
    buffer = StandInBuffer()
    assert facts_of(srt, buffer) == {
        "num_nvl_bytes": 1 << 30, "num_rdma_bytes": 0, "low_latency_mode": False, "use_fabric": False,
        "allow_mnnvl": False, "rank": 0, "group_size": 2, "nvl_buffer": "0x7f3a00000000", "deep_ep_version": VERSION,
    }  # fmt: skip
    assert buffer.asked == ["uint8"]


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"low_latency_mode": True}, "low_latency_mode=True"),
        ({"num_rdma_bytes": 1 << 29}, "num_rdma_bytes=536870912"),
        ({"use_fabric": True}, "use_fabric=True"),
        ({"allow_mnnvl": True}, "allow_mnnvl=True"),
    ],
)
def test_save_refuses_a_buffer_persistence_cannot_restore(
    srt: SimpleNamespace, ours: ModuleType, change: dict[str, Any], names: str
) -> None:
    with pytest.raises(Refused) as err:
        srt.deepep.refuse_facts(facts_of(srt, StandInBuffer(**change)))
    first, *_, advice = str(err.value).splitlines()
    assert first.startswith("graphpersist: cannot SAVE this DeepEP Buffer: ") and names in first
    assert advice.startswith("Instead, use --deepep-mode normal")


def test_save_and_load_refuse_a_deep_ep_that_is_not_ours(srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's deep_ep has no graphpersist_buffer (nor the fabric settings patch 0003 keeps on the Buffer)."""
    monkeypatch.setitem(sys.modules, "deep_ep", ModuleType("deep_ep"))
    with pytest.raises(Refused, match=r"needs graphpersist's deep_ep wheel \(dist/deep_ep-\*\+gp\.\*\.whl\)"):
        srt.deepep.buffer_facts(StandInBuffer())


def test_load_names_every_fact_that_differs_with_its_saved_and_live_value(
    srt: SimpleNamespace, ours: ModuleType
) -> None:
    saved = facts_of(srt, StandInBuffer())
    live = {**saved, "num_nvl_bytes": 1 << 29, "nvl_buffer": "0x7f3b00000000", "deep_ep_version": "1.2.1"}
    with pytest.raises(PersistError) as err:
        engine.check_noted(srt.deepep.NOTES_KEY, srt.deepep.WHAT, saved, live)  # as setup_buffer and restore do
    assert str(err.value).splitlines() == [
        "graphpersist: cannot LOAD: deepep.deep_ep_version: saved '1.2.1.post20251110+gp.1', live '1.2.1'",
        "graphpersist: cannot LOAD: deepep.num_nvl_bytes: saved 1073741824, live 536870912",
        "graphpersist: cannot LOAD: deepep.nvl_buffer: saved '0x7f3a00000000', live '0x7f3b00000000'",
        "Re-run with mode=save for this configuration.",
    ]
    engine.check_noted(srt.deepep.NOTES_KEY, srt.deepep.WHAT, saved, dict(saved))  # equal: nothing


def test_load_refuses_an_archive_saved_without_deepep(srt: SimpleNamespace, ours: ModuleType) -> None:
    with pytest.raises(PersistError, match=r"the archive records no DeepEP buffer \(notes.deepep = None\)"):
        engine.check_noted(srt.deepep.NOTES_KEY, srt.deepep.WHAT, None, facts_of(srt, StandInBuffer()))


# ---------------------------------------------------------------------- the Buffer in setup, and the communicator
@dataclass
class StandInNormal:
    buffer: StandInBuffer
    calls: int = 0

    def _get_buffer(self) -> StandInBuffer:
        self.calls += 1
        return self.buffer


class StandInModel:
    """Two MoE layers whose dispatchers (MaybeTboDeepEPDispatcher) each wrap one DeepEPDispatcher."""

    def __init__(self, buffer: StandInBuffer | None) -> None:
        self.normal = [StandInNormal(buffer) for _ in range(2)] if buffer is not None else []
        self.layers = [SimpleNamespace(dispatcher=SimpleNamespace(_inners=[SimpleNamespace(_normal_dispatcher=n)]))
                       for n in self.normal]  # fmt: skip

    def modules(self) -> Iterator[Any]:
        yield self
        yield from self.layers


class Phases:
    """The runtime phases a session opens (the region is the GPU's: recorded instead)."""

    def __init__(self) -> None:
        self.opened: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str, **_: Any) -> Iterator[None]:
        self.opened.append(name)
        yield
        self.opened.append(f"/{name}")


def without_torch(srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """buffer_facts as the session calls it: our deep_ep, with the stand-ins' dtype and its version."""
    our_deep_ep(monkeypatch)


def recording(sess: Any) -> Phases:
    sess.phase = Phases()
    return sess.phase


def test_save_makes_the_buffer_in_setup_through_upstreams_path_in_its_own_phase(
    srt: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_torch(srt, monkeypatch)
    sess = open_session(srt, switch.Mode.SAVE, tmp_path, saver=StandInSaver())
    phases = recording(sess)
    model = StandInModel(StandInBuffer())
    assert srt.deepep.setup_buffer(sess, model) is model.normal[0].buffer
    assert phases.opened == ["deepep", "/deepep"] and [n.calls for n in model.normal] == [1, 0]
    comm = srt.deepep.noted(model.normal[0].buffer)
    comm.after_capture(sess)
    assert sess.notes["deepep"] == facts_of(srt, StandInBuffer())


def test_save_refuses_a_low_latency_buffer_in_setup(
    srt: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_torch(srt, monkeypatch)
    sess = open_session(srt, switch.Mode.SAVE, tmp_path, saver=StandInSaver())
    recording(sess)
    with pytest.raises(Refused, match="low_latency_mode=True"):
        srt.deepep.setup_buffer(sess, StandInModel(StandInBuffer(low_latency_mode=True)))


def test_a_model_without_deepep_dispatchers_is_refused(srt: SimpleNamespace, tmp_path: Path) -> None:
    sess = open_session(srt, switch.Mode.SAVE, tmp_path, saver=StandInSaver())
    with pytest.raises(PersistError, match="no DeepEP normal-mode dispatcher"):
        srt.deepep.setup_buffer(sess, StandInModel(None))


def test_load_compares_the_buffer_in_setup_and_again_before_the_first_replay(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_torch(srt, monkeypatch)
    sess = open_session(srt, switch.Mode.LOAD, Path("/nowhere"))
    recording(sess)
    saved = facts_of(srt, StandInBuffer())
    sess.saved_notes = {"deepep": saved}
    buffer = srt.deepep.setup_buffer(sess, StandInModel(StandInBuffer()))
    srt.deepep.noted(buffer).restore(sess, {"deepep": saved})
    moved = StandInBuffer()
    moved.get_local_buffer_tensor = lambda dtype: StandInTensor(NVL_AT + (2 << 20))  # type: ignore[method-assign]
    with pytest.raises(PersistError, match=r"deepep.nvl_buffer: saved '0x7f3a00000000', live '0x7f3a00200000'"):
        srt.deepep.setup_buffer(sess, StandInModel(moved))
    with pytest.raises(PersistError, match=r"deepep.rank: saved 0, live 1"):
        srt.deepep.noted(StandInBuffer(rank=1)).restore(sess, {"deepep": saved})
    with pytest.raises(PersistError, match="no DeepEP Buffer was made in setup: refused"):
        srt.deepep.noted(None).restore(sess, {"deepep": saved})


def test_the_adapter_hands_the_deepep_communicator_over_only_with_deepep(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_deepep = srt.adapter.SglangAdapter(
        SimpleNamespace(server_args=deepep_args()), srt.adapter.SglangRun(deepep_buffer="buffer")
    )
    custom_all_reduce, deepep = with_deepep.communicators()
    assert type(custom_all_reduce).__name__ == "CustomAllReduceV2" and deepep.name == "deepep"
    monkeypatch.setattr(srt.deepep, "buffer_facts", lambda buffer: {"buffer": buffer})
    assert deepep.read() == {"buffer": "buffer"}  # the Buffer setup made
    without = srt.adapter.SglangAdapter(SimpleNamespace(server_args=StandInServerArgs()))
    assert [type(c).__name__ for c in without.communicators()] == ["CustomAllReduceV2"]


# --------------------------------------------------------------- breakable decode graphs and their DeepEP breaks
class StandInModule:
    pass


class StandInMoE(StandInModule):
    def _a2a_forward_with_output_impl(self, *args: Any) -> None:  # the break DeepEPMoE.forward makes
        calls.append((self, args))


calls: list[Any] = []


@pytest.fixture
def torch_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what the leaf functions ask of torch: its Tensor and nn.Module classes (no tensor is made here)."""
    torch = ModuleType("torch")
    torch.Tensor = type("Tensor", (), {})  # type: ignore[attr-defined]
    torch.nn = SimpleNamespace(Module=StandInModule)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)


@pytest.fixture
def deepep_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for SGLang's ep_moe layer module, whose DeepEPMoE the registry's "sglang.deepep_moe_a2a" names."""
    module = ModuleType("sglang.srt.layers.moe.ep_moe.layer")
    module.DeepEPMoE = StandInMoE  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)


class NamedModel:
    def __init__(self) -> None:
        self.moe = StandInMoE()

    def named_modules(self) -> Iterator[tuple[str, Any]]:
        yield "", self
        yield "model.layers.3.mlp.experts", self.moe


def test_save_records_breakable_decode_graphs_and_names_a_breaks_module_by_its_place_in_the_model(
    srt: SimpleNamespace, tmp_path: Path, torch_standin: None, deepep_layer: None
) -> None:
    model = NamedModel()
    sess = open_session(
        srt, switch.Mode.SAVE, tmp_path, saver=StandInSaver(), model_runner=SimpleNamespace(model=model)
    )
    sess.adapter.run.capturing = "decode"
    srt.capture.captured_break(StandInMoE._a2a_forward_with_output_impl, (model.moe, None, 7), {}, None)
    bg = SimpleNamespace(_segments=[StandInGraph(), StandInGraph()], _break_fns=[object()])
    srt.capture.captured_breakable(object(), Key(8), bg, ("rows",))
    assert [(n, s, m) for n, _, s, m in sess.saver.added] == [
        ("decode/8/000", 8, "decode"),
        ("decode/8/001", 8, "decode"),
    ]
    [record] = sess.notes["decode"]["decode/8"]["breaks"]
    assert (record["kind"], record["fn"]) == ("call", "sglang.deepep_moe_a2a")
    assert record["args"]["items"][0] == {"kind": "tensor", "spec": {"module": "model.layers.3.mlp.experts"}}
    with pytest.raises(PersistError, match=r"the module StandInMoE is not part of the model: SAVE refused \(serve"):
        srt.capture.captured_break(StandInMoE._a2a_forward_with_output_impl, (StandInMoE(),), {}, None)


def test_load_installs_breakable_decode_graphs_calling_the_live_layer(
    srt: SimpleNamespace, upstream_standins: None, torch_standin: None, deepep_layer: None
) -> None:
    model = NamedModel()
    record = {
        "kind": "call",
        "fn": "sglang.deepep_moe_a2a",
        "args": {"kind": "tuple", "items": [{"kind": "tensor", "spec": {"module": "model.layers.3.mlp.experts"}},
                                            {"kind": "value", "value": 7}]},
        "kwargs": {"kind": "dict", "keys": [], "items": []},
        "output": {"kind": "value", "value": None},
    }  # fmt: skip
    notes = {"decode": {"decode/8": {"size": 8, "segments": 2, "breaks": [record]}}, "prefill": {}}
    result = {n: loaded(n) for n in ("decode/8/000", "decode/8/001")}
    decode = SimpleNamespace(capture_bs=[8], backend=StandInBackend())
    assert srt.capture.install({"decode": decode}, result, notes, model) == 2
    bg = decode.backend._graphs[Key(8)]
    assert bg._segments == [result["decode/8/000"], result["decode/8/001"]]
    assert decode.backend._outputs[Key(8)] == "outputs of decode/8/001"
    calls.clear()
    bg._break_fns[0]()
    assert calls == [(model.moe, (7,))]
    record["args"]["items"][0]["spec"]["module"] = "model.layers.9.mlp.experts"
    with pytest.raises(PersistError, match=r"the model has no module 'model\.layers\.9\.mlp\.experts'"):
        srt.capture.install({"decode": SimpleNamespace(capture_bs=[8], backend=StandInBackend())}, result, notes, model)


# ----------------------------------------------------------------------- deep_ep patch 0003, on the pinned wheel
@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_our_deep_ep_buffer_keeps_the_fabric_settings_patch_0001_resolved(
    upstream_tree: Callable[[str], Path], repo_root: Path, tmp_path: Path
) -> None:
    from gptools import apply as gpapply
    from gptools import series as gpseries

    patches = repo_root / "patches" / "deep_ep"
    rel = "deep_ep/buffer.py"
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_bytes((upstream_tree("deep_ep") / rel).read_bytes())
    for name in gpseries.read_series(patches).names:
        gpapply.apply_patch(tmp_path, gpseries.read_patch(patches / name))
    tree = ast.parse((tmp_path / rel).read_text())
    [init] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    lines = [ast.unparse(s) for s in init.body if not isinstance(s, ast.Expr)]
    resolved = next(i for i, s in enumerate(lines) if s.startswith("allow_mnnvl, use_fabric = graphpersist_buffer"))
    kept = [lines.index("self.allow_mnnvl = allow_mnnvl"), lines.index("self.use_fabric = use_fabric")]
    made = next(i for i, s in enumerate(lines) if s.startswith("self.runtime = deep_ep_cpp.Buffer("))
    assert resolved < min(kept) and max(kept) < made


def test_a_start_the_flag_turns_off_tells_deep_ep_so(srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """deep_ep reads the mode from GRAPHPERSIST_MODE: with --graph-persist off under GRAPHPERSIST_MODE=save its Buffer
    must see off (upstream's fabric settings, low-latency allowed), as the engine does."""
    env = {switch.MODE_ENV: "save", switch.DIR_ENV: "/data/gp"}
    monkeypatch.setattr("os.environ", env)
    assert not srt.switch.resolve_server_args(SimpleNamespace(graph_persist="off", graph_persist_dir=None)).enabled
    assert env == {switch.MODE_ENV: "off", switch.DIR_ENV: "/data/gp"}
