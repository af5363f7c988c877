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
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PIECES_ENV = "GP_DIAG_PIECES"
MODES = ("count", "record", "reuse")
PATHS = ("loaded", "hashed", "saved", "reused")
KEYS_FILE = "gpdiag-piece-keys.json"
STATS_DIR_ENV = "GRAPHPERSIST_STATS_DIR"  # where the runtime writes the rank's stats (graphpersist.rankstats)


@dataclass
class Tally:
    """What this process's compile calls and AOT loads did (a worker's start: one per process)."""

    mode: str
    seconds: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})  # path -> per call
    spans: dict[str, float] = field(default_factory=dict)  # finalize, split: seconds summed
    loads: list[dict[str, Any]] = field(default_factory=list)  # one per AOT load: seconds, loaded, device deltas

    def add(self, path: str, seconds: float) -> None:
        self.seconds[path].append(seconds)

    def add_span(self, name: str, seconds: float) -> None:
        self.spans[name] = self.spans.get(name, 0.0) + seconds

    def as_json(self) -> dict[str, Any]:
        pieces = {p: {"n": len(s), "s": round(sum(s), 4)} for p, s in self.seconds.items()}
        return {"mode": self.mode, "pieces": pieces, "spans": {k: round(v, 4) for k, v in self.spans.items()},
                "aot_loads": self.loads}  # fmt: skip

    def summary(self) -> str:
        parts = [f"{len(s)} {p} ({sum(s):.2f} s)" for p, s in self.seconds.items() if s]
        loads = ", ".join(f"{d['seconds']:.2f} s" for d in self.loads) or "none"
        spans = ", ".join(f"{k} {v:.2f} s" for k, v in self.spans.items())
        return f"compiled pieces: {', '.join(parts) or 'none'}; AOT load {loads}; {spans or 'no split'}"


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
    return _tally


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
        with collections() as passes:
            loaded = original(model, aot_compilation_path)
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
