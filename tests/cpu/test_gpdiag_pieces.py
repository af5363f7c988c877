"""tools/gpdiag/vllm_pieces.py (GP_DIAG_PIECES) without vLLM: which compile calls `reuse` answers itself, what
`record` writes, how a call's path is told, what the rank's report holds, and how `count` splits the AOT load into its
steps (stand-ins that sleep) with the third section of startprofile's text. Its wiring into the real vLLM classes is
tested in the vLLM CPU venv (test_engine_vllm_persist_cpu.py, and the slow test at the end here)."""

from __future__ import annotations

import functools
import gc
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpdiag import startprofile
from gpdiag import vllm_pieces as vp


@dataclass(frozen=True)
class Range:  # vllm.config.utils.Range: hashable, start and end inclusive
    start: int
    end: int


@dataclass
class Compiler:
    name: str = "inductor_standalone"


@dataclass
class Counter:  # the vllm.compilation.counter fields the wrapper reads and moves
    num_compiled_artifacts_loaded: int = 0
    num_compiled_artifacts_saved: int = 0
    num_backend_compilations: int = 0
    num_inductor_compiles: int = 0


@dataclass
class Manager:
    """A CompilerManager as the wrapper sees it: its cache-file entries, the artifacts it loaded by key, where the cache
    file lies, and an upstream `compile` that loads, hashes or saves as `plan` says (and counts like vLLM's)."""

    cache_file_path: str
    counter: Counter
    plan: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (path, key)
    cache: dict[tuple[Range, int, str], Any] = field(default_factory=dict)
    loaded_artifacts: dict[str, Any] = field(default_factory=dict)
    compiler: Compiler = field(default_factory=Compiler)
    upstream_calls: list[int] = field(default_factory=list)

    def compile(self, graph: Any, example_inputs: Any, additional_inductor_config: Any, compilation_config: Any,
                compile_range: Range, graph_index: int = 0, num_graphs: int = 1,
                is_encoder: bool = False) -> Any:  # fmt: skip
        self.upstream_calls.append(graph_index)
        path, key = self.plan[graph_index]
        if key not in self.loaded_artifacts:  # loaded or compiled: a new object under its key
            self.loaded_artifacts[key] = object()
        if path == "loaded":
            self.counter.num_compiled_artifacts_loaded += 1
        elif path == "saved":
            self.counter.num_compiled_artifacts_saved += 1
        self.counter.num_backend_compilations += 1
        return self.loaded_artifacts[key]


ALL = Range(1, 16384)
# Qwen3-8B's warm start in small: pieces 0, 1 and 4 have cache-file entries; 2 and 3 equal piece 1 (key "a-mid").
PLAN = {0: ("loaded", "a-first"), 1: ("loaded", "a-mid"), 2: ("hashed", "a-mid"), 3: ("hashed", "a-mid"),
        4: ("loaded", "a-last")}  # fmt: skip


def _manager_class(tmp_path: Path, how: str) -> tuple[type, vp.Tally, Counter]:
    """A fresh Manager class with gpdiag's wrapper on it, and the tally and counter it feeds."""
    counter = Counter()
    cls = type("Manager", (Manager,), {})
    tally = vp.Tally(how)
    vp._wrap_compile(cls, counter, how, tally)
    vp._keys.clear()
    return cls, tally, counter


def _start(cls: type, tmp_path: Path, counter: Counter) -> tuple[Any, list[Any]]:
    """One warm start: every piece in order, as PiecewiseCompileInterpreter hands them to compile()."""
    manager = cls(str(tmp_path / "vllm_compile_cache.py"), counter, dict(PLAN))
    manager.cache = {(ALL, i, "inductor_standalone"): {} for i in (0, 1, 4)}
    artifacts = [manager.compile(f"graph{i}", [], {}, None, compile_range=ALL, graph_index=i, num_graphs=5)
                 for i in range(5)]  # fmt: skip
    return manager, artifacts


def test_record_writes_every_pieces_key_beside_vllms_cache_file(tmp_path: Path) -> None:
    cls, tally, counter = _manager_class(tmp_path, "record")
    _start(cls, tmp_path, counter)
    written = json.loads((tmp_path / vp.KEYS_FILE).read_text())
    assert written == {"pieces": {f"1-16384/{i}": key for i, (_, key) in PLAN.items()}}
    assert {p: len(s) for p, s in tally.seconds.items()} == {"loaded": 3, "hashed": 2, "saved": 0, "reused": 0}


def test_reuse_hands_a_recorded_piece_the_artifact_already_loaded_without_upstreams_path(tmp_path: Path) -> None:
    record, _, counter = _manager_class(tmp_path, "record")
    _, recorded = _start(record, tmp_path, counter)
    reuse, tally, counter = _manager_class(tmp_path, "reuse")
    manager, got = _start(reuse, tmp_path, counter)
    assert manager.upstream_calls == [0, 1, 4]  # the pieces vLLM's cache file lists are vLLM's to load
    assert got[2] is got[3] is got[1] is manager.loaded_artifacts["a-mid"]
    assert got[2] is not recorded[2]  # this start's own artifact, not the recording start's
    assert {p: len(s) for p, s in tally.seconds.items()} == {"loaded": 3, "hashed": 0, "saved": 0, "reused": 2}
    assert (counter.num_backend_compilations, counter.num_inductor_compiles) == (5, 2)  # as upstream's path counts


def test_reuse_without_a_recorded_key_runs_upstreams_path(tmp_path: Path) -> None:
    reuse, tally, counter = _manager_class(tmp_path, "reuse")
    manager, _ = _start(reuse, tmp_path, counter)
    assert manager.upstream_calls == [0, 1, 2, 3, 4]
    assert {p: len(s) for p, s in tally.seconds.items()} == {"loaded": 3, "hashed": 2, "saved": 0, "reused": 0}


def test_reuse_leaves_a_piece_whose_key_no_artifact_has_yet_to_upstream(tmp_path: Path) -> None:
    """A recorded key names no artifact this start loaded (an entry missing, another order): upstream hashes it."""
    manager = Manager(str(tmp_path / "vllm_compile_cache.py"), Counter())
    assert vp.reusable(manager, ALL, 2, {"1-16384/2": "a-mid"}) is None
    manager.loaded_artifacts["a-mid"] = artifact = object()
    assert vp.reusable(manager, ALL, 2, {"1-16384/2": "a-mid"}) is artifact
    manager.cache[(ALL, 2, "inductor_standalone")] = {}
    assert vp.reusable(manager, ALL, 2, {"1-16384/2": "a-mid"}) is None  # vLLM's own entry wins


def test_a_compile_calls_path_is_told_by_vllms_artifact_counters() -> None:
    assert vp.path_of((3, 1), (4, 1)) == "loaded"
    assert vp.path_of((3, 1), (3, 2)) == "saved"
    assert vp.path_of((3, 1), (3, 1)) == "hashed"


def test_an_artifacts_key_is_found_by_identity_not_equality(tmp_path: Path) -> None:
    manager = Manager(str(tmp_path / "c.py"), Counter(), loaded_artifacts={"k1": [1], "k2": [1]})
    assert vp.artifact_key(manager, manager.loaded_artifacts["k2"]) == "k2"
    assert vp.artifact_key(manager, [1]) is None


def test_a_keys_file_that_is_not_one_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / vp.KEYS_FILE
    assert vp.read_keys(path) == {}
    vp.write_keys(path, {"1-8/2": "a2", "1-8/1": "a1"})
    assert vp.read_keys(path) == {"1-8/1": "a1", "1-8/2": "a2"}
    assert [p.name for p in tmp_path.iterdir()] == [vp.KEYS_FILE]  # no temporary file left
    path.write_text(json.dumps({"pieces": {"1-8/1": 7}}))
    with pytest.raises(ValueError, match=rf"{vp.KEYS_FILE}: not a gpdiag piece-key file.*GP_DIAG_PIECES=record"):
        vp.read_keys(path)


def test_an_unknown_switch_value_is_refused_naming_the_values() -> None:
    assert vp.mode({}) is None
    assert vp.mode({vp.PIECES_ENV: "reuse"}) == "reuse"
    with pytest.raises(ValueError, match=r"GP_DIAG_PIECES='lazy': use one of count, record, reuse"):
        vp.mode({vp.PIECES_ENV: "lazy"})


def test_the_report_writes_the_ranks_numbers_and_one_log_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vp.STATS_DIR_ENV, str(tmp_path / "stats"))
    tally = vp.Tally("reuse")
    tally.add("loaded", 0.5)
    tally.add("reused", 0.001)
    tally.add_span("split", 0.25)
    tally.loads.append({"seconds": 2.0, "loaded": True, "region_events": 0, "torch_allocated": 0})
    monkeypatch.setattr(vp, "_tally", tally)
    lines: list[str] = []
    data = vp.report(3, lambda message, *args: lines.append(message % args))
    assert json.loads((tmp_path / "stats" / "gpdiag-pieces.rank3.json").read_text()) == data
    assert data is not None and data["pieces"]["loaded"] == {"n": 1, "s": 0.5}
    assert data["pieces"]["hashed"] == {"n": 0, "s": 0}
    assert lines == [
        "gpdiag GP_DIAG_PIECES=reuse: compiled pieces: 1 loaded (0.50 s), 1 reused (0.00 s); AOT load 2.00 s; "
        "split 0.25 s"
    ]


def test_without_the_switch_nothing_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vp, "_tally", None)
    assert vp.report(0, lambda *a: pytest.fail("logged")) is None


def test_a_device_delta_compares_only_what_both_snapshots_hold() -> None:
    before = {"torch_allocated": 100, "region_events": 40}
    after = {"torch_allocated": 100, "region_events": 43, "region_cursor": 9}
    assert vp.delta(before, after) == {"torch_allocated": 0, "region_events": 3}


def test_the_collectors_passes_inside_a_block_are_counted_and_timed() -> None:
    with vp.collections() as seen:
        gc.collect()
        gc.collect(0)
    after = dict(seen)
    gc.collect()  # outside the block: not counted
    assert seen == after and seen["gc_passes"] >= 2 and seen["gc_s"] >= 0
    assert all(getattr(c, "__name__", "") != "callback" for c in gc.callbacks)  # the callback is gone again


# ------------------------------------------------------------------------ count: the AOT load's steps (8.1 of the note)

NAP = 0.03  # what each stand-in step sleeps


def nap() -> None:
    time.sleep(NAP)


class Pickler:  # torch's GraphPickler: `loads` a staticmethod
    @staticmethod
    def loads(data: bytes, fake_mode: Any) -> bytes:
        nap()
        return data


class GraphModule:  # torch.fx.GraphModule: the graph's code made again
    def recompile(self) -> str:
        nap()
        return "code"


class Serializable:  # vLLM's VllmSerializableFunction: `deserialize_graph_module` a classmethod
    @classmethod
    def deserialize_graph_module(cls, data: bytes, fake_mode: Any) -> tuple[type, bytes]:
        return cls, Pickler.loads(data, fake_mode)


class Compiled:  # torch's AOTCompiledFunction: `deserialize` a classmethod that ends in __post_init__
    def __post_init__(self) -> None:
        nap()

    @classmethod
    def deserialize(cls, data: bytes) -> Compiled:
        Pickler.loads(b"inputs", None)
        Serializable.deserialize_graph_module(data, None)
        GraphModule().recompile()
        made = cls()
        made.__post_init__()
        return made


def standin_decorators() -> types.ModuleType:
    """vLLM's decorators module: an AOT load that deserializes, checks the source, then splits (one recompile)."""
    module = types.ModuleType("standin_decorators")

    def verify(source_info: Any, vllm_config: Any) -> None:
        nap()

    def aot_load(model: Any, aot_compilation_path: str) -> Compiled:
        compiled = Compiled.deserialize(b"graph")
        module._verify_source_unchanged(None, None)
        GraphModule().recompile()  # the split's pieces
        return compiled

    module._verify_source_unchanged = verify
    module._try_load_aot_compiled_fn = aot_load
    return module


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[types.ModuleType, vp.Tally]]:
    """The stand-ins, wrapped as `count` wraps vLLM's and torch's (classes restored afterwards)."""
    monkeypatch.setattr(vp, "device_snapshot", dict)  # no torch here: no device numbers
    for cls, name in ((Pickler, "loads"), (GraphModule, "recompile"), (Serializable, "deserialize_graph_module"),
                      (Compiled, "deserialize"), (Compiled, "__post_init__")):  # fmt: skip
        monkeypatch.setattr(cls, name, inspect.getattr_static(cls, name))
    decorators, tally = standin_decorators(), vp.Tally("count")
    vp._wrap_aot_load(decorators, tally)
    for owner, name, step in ((Compiled, "deserialize", "aot_deserialize"), (Compiled, "__post_init__", "post_init"),
                              (Pickler, "loads", "pickler_loads"), (GraphModule, "recompile", "recompile"),
                              (Serializable, "deserialize_graph_module", "graph_unpickle"),
                              (decorators, "_verify_source_unchanged", "verify_source")):  # fmt: skip
        vp._wrap_step(owner, name, step, tally, "standin")
    yield decorators, tally


def test_count_times_each_step_of_the_aot_load_and_nothing_outside_it(
    steps: tuple[types.ModuleType, vp.Tally],
) -> None:
    decorators, tally = steps
    Compiled.deserialize(b"before")  # outside the AOT load: not timed
    assert tally.steps == {}
    decorators._try_load_aot_compiled_fn(None, "model")
    got = {name: (len(s), sum(s)) for name, s in tally.steps.items()}
    assert {name: n for name, (n, _) in got.items()} == {
        "aot_deserialize": 1, "pickler_loads": 2, "graph_unpickle": 1, "recompile": 1, "post_init": 1,
        "verify_source": 1, "recompile_after": 1}  # fmt: skip
    sleeps = {"aot_deserialize": 4, "pickler_loads": 2}  # each step's naps, the others one
    for name, (_, seconds) in got.items():
        assert NAP * sleeps.get(name, 1) <= seconds < NAP * sleeps.get(name, 1) + 0.5, name
    assert got["aot_deserialize"][1] < tally.loads[0]["seconds"]


def test_count_keeps_a_staticmethod_and_a_classmethod_what_they_were(steps: tuple[types.ModuleType, vp.Tally]) -> None:
    assert isinstance(inspect.getattr_static(Pickler, "loads"), staticmethod)
    assert isinstance(inspect.getattr_static(Serializable, "deserialize_graph_module"), classmethod)
    assert Pickler().loads(b"x", None) == b"x"  # called on an instance: no self is passed
    assert Serializable.deserialize_graph_module(b"x", None) == (Serializable, b"x")


def test_the_steps_land_in_the_stats_file_and_the_log_line(
    steps: tuple[types.ModuleType, vp.Tally], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decorators, tally = steps
    decorators._try_load_aot_compiled_fn(None, "model")
    monkeypatch.setenv(vp.STATS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(vp, "_tally", tally)
    lines: list[str] = []
    data = vp.report(0, lambda message, *args: lines.append(message % args))
    assert data == json.loads((tmp_path / "gpdiag-pieces.rank0.json").read_text())
    assert data["steps"]["pickler_loads"]["n"] == 2
    assert data["steps"]["verify_source"]["s"] == round(sum(tally.steps["verify_source"]), 4)
    assert list(data["steps"]) == ["aot_deserialize", "pickler_loads", "graph_unpickle", "recompile", "post_init",
                                   "verify_source", "recompile_after"]  # 8.1's order  # fmt: skip
    assert f"; steps: aot_deserialize 1x {sum(tally.steps['aot_deserialize']):.2f} s, pickler_loads 2x " in lines[0]


def test_a_step_whose_name_is_gone_is_listed_as_missing_and_the_others_still_timed(
    steps: tuple[types.ModuleType, vp.Tally],
) -> None:
    decorators, tally = steps
    vp._wrap_step(None, "deserialize", "aot_deserialize", tally, "torch._dynamo.aot_compile:AOTCompiledFunction")
    vp._wrap_step(types.ModuleType("vllm.envs"), "compile_factors", "env_factors", tally, "vllm.envs")
    vp._wrap_step(types.ModuleType("vllm.envs"), "compile_factors", "env_factors", tally, "vllm.envs")  # once listed
    vp._wrap_first_call("gpdiag_no_such_module", "triton_key", tally)
    decorators._try_load_aot_compiled_fn(None, "model")
    assert tally.missing == ["torch._dynamo.aot_compile:AOTCompiledFunction.deserialize", "vllm.envs:compile_factors",
                             "gpdiag_no_such_module:triton_key"]  # fmt: skip
    assert "env_factors" not in tally.steps and tally.steps["verify_source"]
    listed = "torch._dynamo.aot_compile:AOTCompiledFunction.deserialize, vllm.envs:compile_factors, gpdiag_no_such"
    assert vp.Tally("count", missing=tally.missing).summary().endswith(f"; missing: {listed}_module:triton_key")


def cached_once(compute: Callable[[], bytes]) -> Callable[[], bytes]:
    """torch_key's kind of cache: the value kept in a closure's list `_cache`."""
    _cache: list[bytes] = []

    def key() -> bytes:
        if not _cache:
            _cache.append(compute())
        return _cache[0]

    return key


def slow_key() -> bytes:
    nap()
    return b"key"


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, types.ModuleType]:
    """A module defining torch_key (torch's cache) and triton_key (functools' cache), and one that bound both by name
    before gpdiag's install, as torch's triton_compat binds triton_key."""
    defining, bound = types.ModuleType("gpdiag_standin_keys"), types.ModuleType("gpdiag_standin_bound")
    defining.torch_key = bound.torch_key = cached_once(slow_key)
    defining.triton_key = bound.triton_key = functools.lru_cache(slow_key)
    monkeypatch.setitem(sys.modules, defining.__name__, defining)
    monkeypatch.setitem(sys.modules, bound.__name__, bound)
    return defining, bound


def get_system_standin(module: types.ModuleType) -> bytes:
    return module.triton_key()


def test_the_first_caller_of_torch_key_and_triton_key_is_named_with_its_seconds(
    keys: tuple[types.ModuleType, types.ModuleType],
) -> None:
    defining, bound = keys
    tally = vp.Tally("count")
    for name in ("torch_key", "triton_key"):
        vp._wrap_first_call(defining.__name__, name, tally)
    assert bound.torch_key is defining.torch_key and getattr(bound.triton_key, "_gpdiag", False)
    tally.running.add("aot_load")
    assert get_system_standin(bound) == b"key"
    tally.running.discard("aot_load")
    assert defining.torch_key() == bound.torch_key() == b"key"
    assert defining.triton_key() == b"key"
    torch_key, triton_key = tally.first_calls["torch_key"], tally.first_calls["triton_key"]
    here = __name__
    assert triton_key["by"] == f"{here}:get_system_standin" and triton_key["in_aot_load"] is True
    assert torch_key["by"] == f"{here}:test_the_first_caller_of_torch_key_and_triton_key_is_named_with_its_seconds"
    assert torch_key["in_aot_load"] is False and (torch_key["calls"], triton_key["calls"]) == (2, 2)
    assert NAP <= torch_key["s"] < NAP + 0.5 and NAP <= triton_key["s"] < NAP + 0.5
    assert torch_key["cached_before"] is False and triton_key["cached_before"] is False
    assert "; triton_key first by " + f"{here}:get_system_standin ({triton_key['s']:.2f} s, inside the AOT load)" in (
        tally.summary()
    )


def test_a_key_computed_before_the_install_says_so(keys: tuple[types.ModuleType, types.ModuleType]) -> None:
    defining, _ = keys
    defining.torch_key()
    defining.triton_key()
    tally = vp.Tally("count")
    for name in ("torch_key", "triton_key"):
        vp._wrap_first_call(defining.__name__, name, tally)
    assert [tally.first_calls[k]["cached_before"] for k in ("torch_key", "triton_key")] == [True, True]
    assert vp.computed(len) is None  # a kind of cache it does not know
    assert "; torch_key computed before gpdiag's install; triton_key computed before" in tally.summary()


STEP_FILES = {
    "torch/_dynamo/aot_compile.py": "def deserialize():\n    return callee_of_deserialize()\n\n"
    "def callee_of_deserialize():\n    return sum(range(1000))\n",
    "torch/_inductor/codecache.py": "def torch_key():\n    return b'key'\n",
}


def test_startprofiles_third_section_names_the_steps_callees_and_the_keys_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modules = {}
    for relative, source in STEP_FILES.items():
        path = tmp_path / "lib" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"gpdiag_standin_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        modules[path.stem] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

    def who_asks_for_torch_key() -> bytes:
        return modules["codecache"].torch_key()

    monkeypatch.setenv(startprofile.CPROFILE_ENV, str(tmp_path / "prof"))
    startprofile.start()
    modules["aot_compile"].deserialize()
    who_asks_for_torch_key()
    startprofile.stop(0)
    text = (tmp_path / "prof" / "cprofile.rank0.txt").read_text()
    third = text.split("=== the AOT load's steps")[1]
    assert "aot_compile.py" in third and "callee_of_deserialize" in third and "who_asks_for_torch_key" in third
    absent = third.split("not in the profile: ")[1]
    assert "torch/fx/graph_module.py:recompile" in absent and "triton/runtime/cache.py:triton_key" in absent
    assert "aot_compile.py:deserialize" not in absent and "codecache.py:torch_key" not in absent


REAL_STEPS = """
import inspect, json, sys
from gpdiag import vllm_pieces as vp
from torch._dynamo.aot_compile import AOTCompiledFunction
from torch.fx import GraphModule
from torch.fx._graph_pickler import GraphPickler
from vllm import envs
from vllm.compilation import backends, caching, decorators

tally = vp.install("count")
vp.install("count")  # a second install wraps nothing twice


def asks_for_torch_key():
    from torch._inductor.codecache import torch_key
    return torch_key()


asks_for_torch_key()
places = {"deserialize": (AOTCompiledFunction, "deserialize"), "post_init": (AOTCompiledFunction, "__post_init__"),
          "loads": (GraphPickler, "loads"), "recompile": (GraphModule, "recompile"),
          "graph_unpickle": (caching.VllmSerializableFunction, "deserialize_graph_module"),
          "verify": (decorators, "_verify_source_unchanged"), "env": (envs, "compile_factors"),
          "hash": (backends.CompilerManager, "compute_hash")}
raw = {k: inspect.getattr_static(owner, name) for k, (owner, name) in places.items()}
print(json.dumps({
    "kinds": {k: type(v).__name__ for k, v in raw.items()},
    "wrapped": sorted(k for k, v in raw.items() if getattr(getattr(v, "__func__", v), "_gpdiag", False)),
    "missing": tally.missing,
    "torch_key": tally.first_calls["torch_key"],
}))
"""


@pytest.mark.network
@pytest.mark.slow
def test_count_finds_every_step_in_the_pinned_vllm_and_the_venvs_torch(vllm_venv: Path) -> None:
    """The names are the real ones: vLLM 0.26.0's, and torch's of the CPU venv (its torch is not the bundle's 2.11;
    it has no Triton, so triton_key is listed missing there)."""
    tools = Path(__file__).resolve().parents[2] / "tools"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHPERSIST_", "GP_", "VLLM_", "PYTHONPATH"))}
    proc = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", REAL_STEPS], env={**env, "PYTHONPATH": str(tools)},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["kinds"] == {"deserialize": "classmethod", "post_init": "function", "loads": "staticmethod",
                            "recompile": "function", "graph_unpickle": "classmethod", "verify": "function",
                            "env": "function", "hash": "function"}  # fmt: skip
    assert got["wrapped"] == sorted(got["kinds"])
    assert got["missing"] in ([], ["triton.runtime.cache:triton_key"])
    assert got["torch_key"]["by"] == "__main__:asks_for_torch_key" and got["torch_key"]["calls"] == 1
