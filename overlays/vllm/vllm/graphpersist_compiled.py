"""LOAD builds vLLM's compiled model from SAVE's notes: each piece's place, SymInt positions and output form, and the
artifacts vLLM's cache file lists or the key SAVE saw each piece's artifact filed under, without unpickling the Dynamo
graph, splitting it, running it through an interpreter and hashing the unlisted pieces again (patches/vllm/README.md,
"The compiled model at LOAD"). What the notes do not cover takes vLLM's own path."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from graphpersist import engine

NOTES_KEY = engine.COMPILED_MODEL  # by prefix: {"folder": <hash>/<rank>/<model>, "pieces": [[name, sym, tuple, keys]]}
_NOT_STATE = ("optimized_call", "shape_env", "vllm_backend", "_fake_mode")  # VllmSerializableFunction's own
_installed: set[str] = set()  # the process-wide wrappers: "save" or "load"
_pending: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()  # LOAD: model file bytes by function
_unread: list[bool] = []  # LOAD: not empty while vLLM's deserializer reads a model file the notes cover


def install(sess: engine.PersistSession) -> None:
    """SAVE notes each compiled model's pieces as vLLM's backend made them; LOAD builds from those notes (refusing
    damaged ones here). Wraps once per process.

    Both sides first import the modules either side's wrappers need, before the worker starts: a module vLLM would
    import later, while it builds the model under the GPU as default device, would make any tensor it creates at
    import device memory there, so SAVE and LOAD must not import it at different times. (It does not explain the
    twenty-sixth session's refusal, layer 0's q_norm 512 bytes off: vLLM imports its backend only after the model's
    own __init__ has built every layer.)"""
    from vllm import config  # noqa: F401
    from vllm.compilation import backends, caching  # noqa: F401

    if sess.loading:
        plans(sess)
        threading.Thread(target=_hash_sources, name="graphpersist-source-hashes", daemon=True).start()
    side = "load" if sess.loading else "save"
    if side not in _installed:
        _installed.add(side)
        (_wrap_load if sess.loading else _wrap_save)()


def _wrap_save() -> None:
    from vllm.compilation.backends import VllmBackend

    upstream_call = VllmBackend.__call__

    @functools.wraps(upstream_call)
    def call(self: Any, graph: Any, example_inputs: Any) -> Any:
        made = upstream_call(self, graph, example_inputs)
        now = engine.current()
        if now is not None and not now.loading:
            now.notes.setdefault(NOTES_KEY, {})[self.prefix] = _plan_of(self)
        return made

    VllmBackend.__call__ = call


def _wrap_load() -> None:
    from vllm.compilation.caching import VllmSerializableFunction as Fn
    from vllm.config import set_current_vllm_config

    upstream_deserialize, upstream_finalize = Fn.deserialize_compile_artifacts, Fn.finalize_loading
    upstream_graph = Fn.deserialize_graph_module

    @functools.wraps(upstream_deserialize.__func__)
    def deserialize(cls: Any, data: bytes) -> Any:
        now = engine.current()
        if now is None or not now.loading or not plans(now):
            return upstream_deserialize(data)
        _unread.append(True)  # vLLM reads the model file's state; the notes make its Dynamo graph unneeded
        try:
            fn = upstream_deserialize(data)
        finally:
            _unread.pop()
        if fn._fake_mode is not None:  # else vLLM built it already (its mega artifact)
            _pending[fn] = data  # built in finalize_loading, once vLLM has checked the traced sources
        return fn

    @functools.wraps(upstream_graph.__func__)
    def deserialize_graph(cls: Any, data: bytes, fake_mode: Any) -> Any:
        return _Unread() if _unread else upstream_graph(data, fake_mode)

    @functools.wraps(upstream_finalize)
    def finalize_loading(self: Any, vllm_config: Any) -> None:
        data = _pending.pop(self, None)
        if data is None:
            return upstream_finalize(self, vllm_config)
        started = time.perf_counter()
        plan = plans(engine.current()).get(self.prefix)  # type: ignore[arg-type]
        built, why = (None, "SAVE noted no such model") if plan is None else _build(self, plan, vllm_config)
        if built is None:  # vLLM's own path, from the model file again (it reads the current config as at first)
            with set_current_vllm_config(vllm_config):
                whole = upstream_deserialize(data)
            upstream_finalize(whole, vllm_config)
            self.__dict__.update(whole.__dict__)
        else:
            self.optimized_call, self._fake_mode = built, None  # as vLLM's own finalize leaves it
        took, sess = time.perf_counter() - started, engine.current()
        made = {"built_from_notes": built is not None, "s": round(took, 4), "why_not": why}  # rank stats, by model
        sess.stats_extra.setdefault(NOTES_KEY, {})[self.prefix] = made  # type: ignore[union-attr]
        how = f"loaded by vLLM's own path ({why})" if built is None else "built from SAVE's notes"
        sess.log("compiled model %s %s in %.2f s", self.prefix, how, took)  # type: ignore[union-attr]

    Fn.deserialize_compile_artifacts = classmethod(deserialize)
    Fn.deserialize_graph_module = classmethod(deserialize_graph)
    Fn.finalize_loading = finalize_loading


class _Unread:
    """The Dynamo graph vLLM's deserializer did not unpickle: the notes' path never runs it."""

    def recompile(self) -> None:
        pass


def plans(sess: engine.PersistSession) -> dict[str, dict[str, Any]]:
    """LOAD: SAVE's notes by model prefix ({} where it noted none); an entry of another shape refuses the LOAD
    (graphpersist.archive.notedsections: `graphpersist check` refuses the same)."""
    return engine.read_noted_models(NOTES_KEY, sess.saved_notes.get(NOTES_KEY))


def _plan_of(backend: Any) -> dict[str, Any]:
    """SAVE: the pieces vLLM's backend compiled, in its compile order, each with the key its artifact is filed under by
    compile range, and the compile cache folder it used. vLLM files only the first of equal pieces in its cache file;
    the others find their artifact under that key after hashing as far as AOTAutograd's key, which LOAD skips."""
    from vllm.compilation.piecewise_backend import PiecewiseBackend

    manager, found = backend.compiler_manager, {}
    for name, _ in backend.split_gm.named_children():
        child = getattr(backend.split_gm, name)  # the wrapper vLLM put over the submodule
        piece = getattr(child, "runnable", child)
        if isinstance(piece, PiecewiseBackend):
            keys = {f"{r.start}-{r.end}": _key_of(entry.runnable, manager.loaded_artifacts)
                    for r, entry in piece.range_entries.items()}  # fmt: skip
            found[piece.piecewise_compile_index] = [name, list(piece.sym_shape_indices), bool(piece.returns_tuple),
                                                    {r: k for r, k in keys.items() if k is not None}]  # fmt: skip
    return {"folder": _folder_of(manager.cache_dir), "pieces": [found[i] for i in sorted(found)]}


def _key_of(artifact: Any, filed: dict[str, Any]) -> str | None:
    """The key vLLM's compiler manager filed `artifact` under, by identity (none for a compiler that files nothing)."""
    return next((key for key, made in filed.items() if made is artifact), None)


def _folder_of(cache_dir: str) -> str:
    """A compiled model's folder as the notes name it: the compile cache's hash, the rank and the model's prefix."""
    return "/".join(Path(cache_dir).parts[-3:])


def _hash_sources() -> None:
    """torch's and Triton's source hashes, computed once per process and cached (0.58 s on an H100, 2026-12-07): at
    LOAD a thread from the worker's start computes them while the model is built, not inside the compiled model's
    load, where the compile cache folder's name needs them. The same functions give the same values."""
    from torch._inductor.codecache import torch_key

    torch_key()
    with contextlib.suppress(ImportError):  # no Triton, no Inductor on GPUs: nothing to hash
        from triton.runtime.cache import triton_key

        triton_key()


def _build(fn: Any, plan: dict[str, Any], cfg: Any) -> tuple[Any | None, str]:
    """The compiled model's call, as vLLM's own builder for cached artifacts makes it, or None and why not. Under the
    functorch settings the model was compiled with, as vLLM's own load names the folder and builds (caching.py,
    `finalize_loading`): the compiler's hash, part of the folder's name, reads them."""
    import torch

    saved_config = fn.aot_autograd_config
    with torch._functorch.config.patch(saved_config) if saved_config else contextlib.nullcontext():
        return _build_patched(fn, plan, cfg)


def _build_patched(fn: Any, plan: dict[str, Any], cfg: Any) -> tuple[Any | None, str]:
    import torch
    from vllm.compilation.backends import CompilerManager
    from vllm.compilation.caching import StandaloneCompiledArtifacts, reconstruct_serializable_fn_from_mega_artifact

    cc, prefix = cfg.compilation_config, fn.prefix
    if fn.is_encoder or cc.cudagraph_copy_inputs or cc.dynamic_shapes_config.evaluate_guards or not fn.execution_code:
        return None, "an encoder, compiler-managed input copies, guards evaluated at run time or no stitching code"
    manager = CompilerManager(cc)
    if manager.compiler.name != "inductor_standalone":
        return None, f"compiler {manager.compiler.name}"
    cache_dir, local = _cache_folders(cfg, manager, prefix)
    if _folder_of(local) != plan["folder"]:
        return None, f"compile cache folder {_folder_of(local)}, SAVE's {plan['folder']}"
    manager.initialize_cache(local, False, prefix)
    wanted = [(name, rng, index) for index, (name, *_) in enumerate(plan["pieces"]) for rng in _ranges(cc)]
    listed = {(rng, index): _entry(manager.cache.get((rng, index, manager.compiler.name))) for _, rng, index in wanted}
    by_key = {  # loaded as vLLM's adaptor loads them, without its wrapper (the pieces' own wraps the output)
        key: torch._inductor.CompiledArtifact.load(path=path, format=manager.compiler.save_format)
        for key, path in (e for e in listed.values() if e is not None)
    }  # fmt: skip
    handed = {f"{name}_{rng}": listed[(rng, index)] or (plan["pieces"][index][3].get(f"{rng.start}-{rng.end}"), "")
              for name, rng, index in wanted}  # fmt: skip
    if lacking := [shape_key for shape_key, (key, _) in handed.items() if key not in by_key]:
        return None, f"{len(lacking)} artifact(s) neither listed in vLLM's cache file nor noted, e.g. {lacking[0]}"
    artifacts = StandaloneCompiledArtifacts()
    for shape_key, (key, _) in handed.items():
        artifacts.submodule_bytes[shape_key] = key
        artifacts.submodule_bytes_store[key] = b""  # nothing to load: `load_all` finds every one loaded
        artifacts.loaded_submodule_store[key] = by_key[key]
    built = reconstruct_serializable_fn_from_mega_artifact(
        state={k: v for k, v in vars(fn).items() if k not in _NOT_STATE},  # what vLLM's constructor takes
        standalone_compile_artifacts=artifacts, vllm_config=cfg,
        sym_shape_indices_map={name: sym for name, sym, *_ in plan["pieces"]},
        returns_tuple_map={name: returns for name, _, returns, _ in plan["pieces"]}, fake_mode=None,
    )  # fmt: skip
    cc.cache_dir, cc.local_cache_dir = cache_dir, local  # as vLLM's backend leaves them
    cc.traced_files.clear()
    return built.optimized_call, ""


def _entry(value: Any) -> tuple[str, str] | None:
    """A listed piece's AOTAutograd key and artifact path, from an entry of vLLM's cache file; None for another shape
    (vLLM's own load ignores such an entry too)."""
    handle = value.get("graph_handle") if isinstance(value, dict) else None
    key = value.get("cache_key") if isinstance(value, dict) else None
    if isinstance(handle, tuple) and len(handle) == 2 and all(isinstance(part, str) for part in (*handle, key)):
        return key, handle[1]
    return None


def _cache_folders(cfg: Any, manager: Any, prefix: str) -> tuple[str, str]:
    """The compile cache folder and the model's folder in it, named from the factors vLLM's backend names them by
    (backends.py, `VllmBackend.__call__`): vLLM's environment, its configuration's hash, the traced sources' text and
    the compiler's hash. Nothing is changed: the notes' path sets them only once it has built the model."""
    from vllm import envs
    from vllm.config.utils import hash_factors

    cc = cfg.compilation_config
    cache_dir = cc.cache_dir
    if not cache_dir:
        texts = []
        for path in sorted(cc.traced_files):
            if path != "<string>":  # made by exec(): vLLM cannot read it either
                texts.append(path)
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    texts.append(Path(path).read_text())
        code_hash = hashlib.sha256("\n".join(texts).encode()).hexdigest()
        factors = [hash_factors(envs.compile_factors()), cfg.compute_hash(), code_hash, manager.compute_hash(cfg)]
        name = hashlib.sha256(str(factors).encode()).hexdigest()[:10]
        cache_dir = os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", name)
    par = cfg.parallel_config
    return cache_dir, os.path.join(cache_dir, f"rank_{par.rank}_{par.data_parallel_index}", prefix)


def _ranges(cc: Any) -> list[Any]:
    """The compile ranges every piece has an artifact for, as vLLM's piecewise backend lists them."""
    from vllm.config.utils import Range

    ranges = list(cc.get_compile_ranges())
    return [r for r in (Range(start=s, end=s) for s in cc.compile_sizes or ()) if r not in ranges] + ranges
