"""Diagnosis only: how a vLLM start loads its compiled model, piece by piece, and what it saves to hand a piece the
artifact of an equal piece without hashing it again (`GP_DIAG_PIECES`; read
recipes/diagnosis/vllm-qwen3-8b-tp1-startup/DEFER-COMPILE.md).

vLLM 0.26.0 loads its compiled model at the first call of the compiled forward: torch deserializes the AOT-compiled
function, then vLLM splits its graph and hands each piece to `CompilerManager.compile`
(vllm/compilation/backends.py:264). A piece that vLLM's cache file (`vllm_compile_cache.py`) lists is loaded from its
artifact (:286, :223-261). A piece that equalled an earlier one when it was first compiled has no entry there (its
handle stayed None: :352-375), so every warm start runs Inductor's standalone compile on it up to AOTAutograd's cache
key, only to find that key among the artifacts already loaded (:328-362): Qwen3-8B's 34 middle layers.

GP_DIAG_PIECES chooses:

- `count`: every compile call is timed and sorted by what it did: `loaded` an artifact, `hashed` (its key named an
  artifact already loaded), `saved` (Inductor compiled, or took AOTAutograd's cache, and stored an artifact);
- `record` (SAVE): the same, and the key of the artifact each piece got goes to `gpdiag-piece-keys.json` beside
  `vllm_compile_cache.py`, so the archive's JIT caches carry it;
- `reuse` (LOAD): a piece the cache file lists no entry for, whose recorded key names an artifact already loaded, gets
  that artifact at once (`reused`): the object upstream's path returns (backends.py:360-364), without the hashing;
  any other piece runs upstream's path.

Every mode also times the AOT load as a whole (`_try_load_aot_compiled_fn`, decorators.py:284), its
`finalize_loading` (caching.py:375) and vLLM's split (backends.py:553), and counts the device allocations (the region's
events and cursor, torch's allocated bytes) and kernel images the AOT load made (whether it could move beside an exact
phase) and the garbage collector's passes during it (whether pausing the collector there would pay). The rank's
numbers go to `$GRAPHPERSIST_STATS_DIR/gpdiag-pieces.rank<r>.json` and one log line.

`count` also splits the AOT load (vLLM's "Dynamo bytecode transform time") into its steps (DEFER-COMPILE.md 8.1 numbers
them), each a call upstream looks up by name when it runs, so wrapping the name times it; a step is timed only while
the AOT load runs, unprofiled. The file's `steps` hold each step's calls and seconds (`n`, `s`):

| key | what | 8.1 |
|---|---|---|
| `aot_deserialize` | torch's `AOTCompiledFunction.deserialize`, `__post_init__` included | 2-7 |
| `post_init` | torch's `AOTCompiledFunction.__post_init__`: version checks, bytecode bound, guard manager | 7 |
| `pickler_loads` | torch's `GraphPickler.loads`: the example inputs, then the graph | 4-5 |
| `graph_unpickle` | vLLM's `VllmSerializableFunction.deserialize_graph_module` (its `loads` of the graph) | 5 |
| `recompile` | `GraphModule.recompile` inside torch's deserialize | 6 |
| `recompile_after` | `GraphModule.recompile` later in the AOT load (the split's pieces) | after 13 |
| `verify_source` | vLLM's `_verify_source_unchanged` | 8 |
| `env_factors` | vLLM's `envs.compile_factors` | 10 |
| `compute_hash` | vLLM's `CompilerManager.compute_hash` (Inductor's system, torch and config factors) | 11 |

`first_calls` says, for torch's `torch_key` and Triton's `triton_key` (each computed once per process, then cached),
who called each first (`by`: the calling function, "module:qualname"), how long that call took (`s`), whether it fell
inside the AOT load (`in_aot_load`), how many calls followed (`calls`), and whether it was already computed when gpdiag
was installed at the session's begin (`cached_before`; null where that cannot be told). `missing` lists what could not
be wrapped ("module:Class.name"): its step is absent, nothing else changes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PIECES_ENV = "GP_DIAG_PIECES"
MODES = ("count", "record", "reuse")
PATHS = ("loaded", "hashed", "saved", "reused")
KEYS_FILE = "gpdiag-piece-keys.json"
# `count`'s steps of the AOT load, in the order DEFER-COMPILE.md 8.1 numbers them (the stats file and log line keep it)
STEPS = ("aot_deserialize", "pickler_loads", "graph_unpickle", "recompile", "post_init", "verify_source", "env_factors",
         "compute_hash", "recompile_after")  # fmt: skip
STATS_DIR_ENV = "GRAPHPERSIST_STATS_DIR"  # where the runtime writes the rank's stats (graphpersist.rankstats)


@dataclass
class Tally:
    """What this process's compile calls and AOT loads did (a worker's start: one per process)."""

    mode: str
    seconds: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})  # path -> per call
    spans: dict[str, float] = field(default_factory=dict)  # finalize, split: seconds summed
    loads: list[dict[str, Any]] = field(default_factory=list)  # one per AOT load: seconds, loaded, device deltas
    steps: dict[str, list[float]] = field(default_factory=dict)  # `count`: the AOT load's steps, seconds per call
    first_calls: dict[str, dict[str, Any]] = field(default_factory=dict)  # torch_key, triton_key: their first call
    missing: list[str] = field(default_factory=list)  # what `count` found no name to wrap for ("module:Class.name")
    running: set[str] = field(default_factory=set)  # the AOT load and the steps running now (not reported)

    def add(self, path: str, seconds: float) -> None:
        self.seconds[path].append(seconds)

    def add_span(self, name: str, seconds: float) -> None:
        self.spans[name] = self.spans.get(name, 0.0) + seconds

    def add_step(self, name: str, seconds: float) -> None:
        self.steps.setdefault(name, []).append(seconds)

    def ordered_steps(self) -> list[tuple[str, list[float]]]:
        return sorted(self.steps.items(), key=lambda item: STEPS.index(item[0]) if item[0] in STEPS else len(STEPS))

    def as_json(self) -> dict[str, Any]:
        pieces = {p: {"n": len(s), "s": round(sum(s), 4)} for p, s in self.seconds.items()}
        steps = {k: {"n": len(s), "s": round(sum(s), 4)} for k, s in self.ordered_steps()}
        return {"mode": self.mode, "pieces": pieces, "spans": {k: round(v, 4) for k, v in self.spans.items()},
                "aot_loads": self.loads, "steps": steps, "first_calls": self.first_calls,
                "missing": self.missing}  # fmt: skip

    def summary(self) -> str:
        parts = [f"{len(s)} {p} ({sum(s):.2f} s)" for p, s in self.seconds.items() if s]
        loads = ", ".join(f"{d['seconds']:.2f} s" for d in self.loads) or "none"
        spans = ", ".join(f"{k} {v:.2f} s" for k, v in self.spans.items())
        line = f"compiled pieces: {', '.join(parts) or 'none'}; AOT load {loads}; {spans or 'no split'}"
        if self.steps:
            line += "; steps: " + ", ".join(f"{k} {len(s)}x {sum(s):.2f} s" for k, s in self.ordered_steps())
        line += "".join(f"; {first_call_words(k, v)}" for k, v in self.first_calls.items())
        return line + (f"; missing: {', '.join(self.missing)}" if self.missing else "")


def first_call_words(name: str, seen: dict[str, Any]) -> str:
    """One key's first call in the log line: who made it, how long it took, and whether inside the AOT load."""
    if seen.get("cached_before"):
        return f"{name} computed before gpdiag's install"
    if not seen["calls"]:
        return f"{name} not called"
    where = "inside" if seen["in_aot_load"] else "outside"
    return f"{name} first by {seen['by']} ({seen['s']:.2f} s, {where} the AOT load)"


_tally: Tally | None = None
_keys: dict[str, dict[str, str]] = {}  # the keys file's path -> its pieces (read once, or as recorded)


def mode(environ: Any = os.environ) -> str | None:
    """The switch's value; None when unset. A value it does not know is refused, naming the variable."""
    how = environ.get(PIECES_ENV)
    if how is not None and how not in MODES:
        raise ValueError(f"{PIECES_ENV}={how!r}: use one of {', '.join(MODES)}")
    return how


def entry_name(compile_range: Any, index: int) -> str:
    """A piece's name in the keys file: its compile range and its index in the split (graph_index)."""
    return f"{compile_range.start}-{compile_range.end}/{index}"


def path_of(before: tuple[int, int], after: tuple[int, int]) -> str:
    """What upstream's compile call did, from vLLM's counters (artifacts loaded, artifacts saved): loaded an artifact
    (compiler_interface.py:431), stored one (:413), or neither: its key named an artifact already loaded."""
    if after[0] > before[0]:
        return "loaded"
    return "saved" if after[1] > before[1] else "hashed"


def artifact_key(manager: Any, artifact: Any) -> str | None:
    """The AOTAutograd key vLLM filed `artifact` under (backends.py:253 when loaded, :364 when compiled or reused)."""
    return next((key for key, value in manager.loaded_artifacts.items() if value is artifact), None)


def reusable(manager: Any, compile_range: Any, index: int, keys: dict[str, str]) -> Any | None:
    """The artifact `reuse` hands a piece: only where vLLM's cache file has no entry for it (upstream would hash it)
    and its recorded key names an artifact this manager already loaded; else None (upstream's path runs)."""
    if (compile_range, index, manager.compiler.name) in manager.cache:
        return None
    key = keys.get(entry_name(compile_range, index))
    return None if key is None else manager.loaded_artifacts.get(key)


def keys_file(manager: Any) -> Path:
    return Path(manager.cache_file_path).with_name(KEYS_FILE)


def read_keys(path: Path) -> dict[str, str]:
    """The recorded keys by piece name; {} when no SAVE recorded them here."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    pieces = data.get("pieces") if isinstance(data, dict) else None
    if not isinstance(pieces, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in pieces.items()):
        raise ValueError(f"{path}: not a gpdiag piece-key file ({{'pieces': {{name: key}}}}); delete it and SAVE "
                         f"again with {PIECES_ENV}=record")  # fmt: skip
    return pieces


def write_keys(path: Path, pieces: dict[str, str]) -> None:
    """Atomically, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pieces": dict(sorted(pieces.items()))}, indent=1))
    tmp.replace(path)


def _keys_of(manager: Any) -> dict[str, str]:
    path = keys_file(manager)
    if str(path) not in _keys:
        _keys[str(path)] = read_keys(path)
    return _keys[str(path)]


def _record(manager: Any, name: str, key: str | None) -> None:
    if key is not None:
        pieces = _keys_of(manager)
        pieces[name] = key
        write_keys(keys_file(manager), pieces)


def install(how: str) -> Tally:
    """Wraps vLLM's compile calls and the AOT load's steps for this process (idempotent); returns the tally."""
    global _tally
    from vllm.compilation import backends, caching, decorators
    from vllm.compilation.counter import compilation_counter

    if _tally is None:
        _tally = Tally(how)
    _wrap_compile(backends.CompilerManager, compilation_counter, how, _tally)
    _wrap_aot_load(decorators, _tally)
    finalize = caching.VllmSerializableFunction.finalize_loading
    if not getattr(finalize, "_gpdiag", False):
        caching.VllmSerializableFunction.finalize_loading = _timed(finalize, "finalize", _tally)
    if not getattr(backends.split_graph, "_gpdiag", False):  # VllmBackend.__call__ looks it up at each call
        backends.split_graph = _timed(backends.split_graph, "split", _tally)
    if how == "count":
        _install_steps(_tally)
    return _tally


# `count`'s steps in torch, wrapped where torch defines them: (module, class, attribute, step). The names are torch
# 2.11's (tools/gpdiag/contract.toml lists them; its lint checks vLLM's alone). torch.compiler.load_compiled_function
# looks the class up at each call, the dataclass's __init__ calls __post_init__ on the class, vLLM calls
# GraphPickler.loads on the class, and `gm.recompile()` finds GraphModule's by the MRO.
TORCH_STEPS = (
    ("torch._dynamo.aot_compile", "AOTCompiledFunction", "deserialize", "aot_deserialize"),
    ("torch._dynamo.aot_compile", "AOTCompiledFunction", "__post_init__", "post_init"),
    ("torch.fx._graph_pickler", "GraphPickler", "loads", "pickler_loads"),
    ("torch.fx.graph_module", "GraphModule", "recompile", "recompile"),
)
# The keys computed once per process whose first call `count` times: (the module defining it, its name).
FIRST_CALLS = (("torch._inductor.codecache", "torch_key"), ("triton.runtime.cache", "triton_key"))


def _install_steps(tally: Tally) -> None:
    """`count`: the AOT load's steps (the module's docstring) and the first calls of torch_key and triton_key."""
    from vllm import envs
    from vllm.compilation import backends, caching, decorators

    for module, cls, name, step in TORCH_STEPS:
        _wrap_step(_owner(module, cls), name, step, tally, f"{module}:{cls}")
    # vLLM's, each looked up by name when it runs: a module global, `self.compiler_manager.compute_hash`,
    # `cls.deserialize_graph_module`, `envs.compile_factors()`.
    _wrap_step(decorators, "_verify_source_unchanged", "verify_source", tally, "vllm.compilation.decorators")
    _wrap_step(envs, "compile_factors", "env_factors", tally, "vllm.envs")
    _wrap_step(backends.CompilerManager, "compute_hash", "compute_hash", tally,
               "vllm.compilation.backends:CompilerManager")  # fmt: skip
    _wrap_step(caching.VllmSerializableFunction, "deserialize_graph_module", "graph_unpickle", tally,
               "vllm.compilation.caching:VllmSerializableFunction")  # fmt: skip
    for module, name in FIRST_CALLS:
        _wrap_first_call(module, name, tally)


def _owner(module: str, cls: str) -> Any | None:
    """A library's class, or None where its module or the class is gone (the step is then listed as missing)."""
    try:
        return getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return None


def _wrap_step(owner: Any, name: str, step: str, tally: Tally, where: str) -> None:
    """Wraps `owner.name` (a function, method, classmethod or staticmethod, kept what it was) so that each call while
    the AOT load runs is timed as `step`; a missing owner or name is noted in `tally.missing`."""
    raw = None if owner is None else inspect.getattr_static(owner, name, None)
    if raw is None:
        _missing(tally, f"{where}{'.' if ':' in where else ':'}{name}")
        return
    binder = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    fn = raw.__func__ if binder is not None else raw
    if getattr(fn, "_gpdiag", False):
        return
    timed = _step_timer(fn, step, tally)
    setattr(owner, name, binder(timed) if binder is not None else timed)


def _missing(tally: Tally, name: str) -> None:
    if name not in tally.missing:
        tally.missing.append(name)


def _step_timer(fn: Callable[..., Any], step: str, tally: Tally) -> Callable[..., Any]:
    """Times `fn` as `step` while the AOT load runs and `step` is not running already (a call inside it is its own)."""

    @functools.wraps(fn)
    def step_timed(*args: Any, **kwargs: Any) -> Any:
        if "aot_load" not in tally.running or step in tally.running:
            return fn(*args, **kwargs)
        # step 6 is the recompile inside torch's deserialize; the split's pieces recompile later in the load
        name = "recompile_after" if step == "recompile" and "aot_deserialize" not in tally.running else step
        tally.running.add(step)
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            tally.running.discard(step)
            tally.add_step(name, time.perf_counter() - started)

    step_timed._gpdiag = True  # type: ignore[attr-defined]
    return step_timed


def _wrap_first_call(module_name: str, name: str, tally: Tally) -> None:
    """Wraps a key computed once per process (torch_key, triton_key) in its module and in every module that bound it
    by name already, so its first call's caller (one frame above), seconds and place are recorded."""
    try:
        original = getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        original = None
    if original is None:
        _missing(tally, f"{module_name}:{name}")
        return
    if getattr(original, "_gpdiag", False):
        return
    seen = tally.first_calls.setdefault(name, {"calls": 0, "cached_before": computed(original)})

    @functools.wraps(original)
    def first_call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seen["calls"] += 1
            if seen["calls"] == 1:
                seen.update(by=caller_name(sys._getframe(1)), s=round(time.perf_counter() - started, 4),
                            in_aot_load="aot_load" in tally.running)  # fmt: skip

    first_call._gpdiag = True  # type: ignore[attr-defined]
    for module in list(sys.modules.values()):  # rebound in each namespace that holds it (triton_compat, autotuner)
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name) is original:
            namespace[name] = first_call


def computed(key_fn: Any) -> bool | None:
    """Whether a cached key was computed already: functools' cache (triton_key) or torch's `torch_key_cache`, whose
    closure keeps the value in a list `_cache`; None for any other kind."""
    if hasattr(key_fn, "cache_info"):
        return key_fn.cache_info().currsize > 0
    if not inspect.isfunction(key_fn):
        return None
    cache = inspect.getclosurevars(key_fn).nonlocals.get("_cache")
    return bool(cache) if isinstance(cache, list) else None


def caller_name(frame: Any) -> str:
    """A frame's function as "module:qualname"."""
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_qualname}"


def _wrap_compile(manager_cls: Any, counter: Any, how: str, tally: Tally) -> None:
    """CompilerManager.compile, timed per path; `record` notes each piece's key, `reuse` hands out recorded ones."""
    original = manager_cls.compile
    if getattr(original, "_gpdiag", False):
        return

    @functools.wraps(original)
    def compile_piece(self: Any, graph: Any, example_inputs: Any, additional_inductor_config: Any,
                      compilation_config: Any, compile_range: Any, graph_index: int = 0, num_graphs: int = 1,
                      is_encoder: bool = False) -> Any:  # fmt: skip
        started = time.perf_counter()
        artifact = reusable(self, compile_range, graph_index, _keys_of(self)) if how == "reuse" else None
        if artifact is not None:
            counter.num_backend_compilations += 1  # vLLM's counters move as upstream's path moves them
            counter.num_inductor_compiles += 1
            path = "reused"
        else:
            before = (counter.num_compiled_artifacts_loaded, counter.num_compiled_artifacts_saved)
            artifact = original(self, graph, example_inputs, additional_inductor_config, compilation_config,
                                compile_range=compile_range, graph_index=graph_index, num_graphs=num_graphs,
                                is_encoder=is_encoder)  # fmt: skip
            path = path_of(before, (counter.num_compiled_artifacts_loaded, counter.num_compiled_artifacts_saved))
            if how == "record":
                _record(self, entry_name(compile_range, graph_index), artifact_key(self, artifact))
        tally.add(path, time.perf_counter() - started)
        return artifact

    compile_piece._gpdiag = True  # type: ignore[attr-defined]
    manager_cls.compile = compile_piece


def _wrap_aot_load(decorators: Any, tally: Tally) -> None:
    """The AOT load as a whole (what vLLM's compile monitor counts), with the device work it did."""
    original = decorators._try_load_aot_compiled_fn
    if getattr(original, "_gpdiag", False):
        return

    @functools.wraps(original)
    def aot_load(model: Any, aot_compilation_path: str) -> Any:
        before = device_snapshot()
        started = time.perf_counter()
        tally.running.add("aot_load")  # `count`'s steps are timed only now
        try:
            with collections() as passes:
                loaded = original(model, aot_compilation_path)
        finally:
            tally.running.discard("aot_load")
        seconds = round(time.perf_counter() - started, 4)
        tally.loads.append({"seconds": seconds, "loaded": loaded is not None, **passes,
                            **delta(before, device_snapshot())})  # fmt: skip
        return loaded

    aot_load._gpdiag = True  # type: ignore[attr-defined]
    decorators._try_load_aot_compiled_fn = aot_load


def _timed(fn: Callable[..., Any], span: str, tally: Tally) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            tally.add_span(span, time.perf_counter() - started)

    timed._gpdiag = True  # type: ignore[attr-defined]
    return timed


@contextlib.contextmanager
def collections() -> Iterator[dict[str, Any]]:
    """The garbage collector's passes inside the block and the seconds they took (gc.callbacks)."""
    seen: dict[str, Any] = {"gc_passes": 0, "gc_s": 0.0}
    began = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            seen["gc_passes"] += 1
            seen["gc_s"] = round(seen["gc_s"] + time.perf_counter() - began[0], 4)

    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def device_snapshot() -> dict[str, int]:
    """torch's allocated bytes and, under the interposer, the region's events, images and cursor."""
    import torch

    from graphpersist.memory import region

    snap = {"torch_allocated": int(torch.cuda.memory_allocated()) if torch.cuda.is_initialized() else 0}
    if region.loaded():
        info = region.info()
        snap.update(region_events=info.n_events, region_images=info.n_images, region_cursor=info.cursor)
    return snap


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after if name in before}


def report(rank: int, log: Callable[..., None]) -> dict[str, Any] | None:
    """At the end of the start: the rank's numbers to the stats folder and one log line; None when not installed."""
    if _tally is None:
        return None
    data = _tally.as_json()
    where = os.environ.get(STATS_DIR_ENV)
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"gpdiag-pieces.rank{rank}.json").write_text(json.dumps(data, indent=1))
    log("gpdiag %s=%s: %s", PIECES_ENV, _tally.mode, _tally.summary())
    return data
