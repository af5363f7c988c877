"""Inductor's timed kernel choices, made the way every later start makes them: SAVE records each timed Triton
kernel's launch config, LOAD launches SAVE's without timing.

Why: Inductor (torch 2.11) compiles some reductions with one config and, where that config needs many registers,
adds a copy with half the reduction block (`CachingAutotuner._dynamic_scale_rblock`) and times both at the kernel's
first launch. Only the process that compiles does that: the compiled artifact keeps the one config it was compiled
with, and a process that loads it (every warm start, and every LOAD, whose archive carries the compile cache) times
nothing and launches that config. Upstream keeps no record of the timed choice (its autotune cache only covers
kernels compiled with several configs; pytorch/pytorch#189121), so a cold start may run the halved copy where every
later start runs the original. Measured on one H200 (2026-12-01, recipes/vllm-qwen3-8b-tp1/kernel-choice-flip/):
a cold SAVE and a warm SAVE captured different images of `triton_red_fused_fused_add_rms_norm_2` in 102 of 1938
graphs; in the next proof, the cold SAVE chose a config for 24 kernels, the warm SAVE and LOADs after it for
none. The two configs reduce in a different order, so the graphs of a cold SAVE could compute in other last bits
than what the same host runs outside graphs (a prefill above the largest capture size) once its caches are warm.

SAVE: a kernel upstream keeps no record for (one compiled config, the rest added by the scaling) launches its
compiled config, as every later start will, without timing (`counts["compiled"]`); a kernel compiled with several
configs is timed as upstream does (`counts["timed"]`), and upstream's autotune cache hands its winner to later
starts. Every choice goes into the rank's notes in the archive.
LOAD: only the archive's choices count (`counts["pinned"]`); a kernel SAVE never chose for, or whose candidate
configs differ from SAVE's, is timed as upstream does, named in the log and counted (`counts["timed"]`).
Off: nothing is installed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphpersist.errors import PersistError

NOTES_KEY = "kernel_choices"  # where the choices go in the rank's engine notes


def config_text(config: Any) -> str:
    """A launch config as text, its identity (what Inductor's triton_config_to_hashable covers)."""
    items = [f"{k}={v}" for k, v in sorted(config.kwargs.items())]
    return ",".join([*items, f"num_warps={config.num_warps}", f"num_stages={config.num_stages}"])


@dataclass
class Choices:
    """This process's choices: SAVE's as it makes them (`used`), LOAD's from the archive (`saved`)."""

    loading: bool
    saved: Mapping[str, Any]
    log: Callable[[str], None]
    used: dict[str, dict[str, Any]] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)

    def choose(self, tuner: Any, upstream: Callable[..., None], args: tuple, kwargs: dict) -> None:
        """Leaves `tuner` with one launcher, as upstream's autotune_to_one_config does."""
        key = getattr(tuner, "kernel_hash", "") or ""
        name = getattr(getattr(tuner, "fn", None), "__name__", "?")
        candidates = [config_text(launcher.config) for launcher in tuner.launchers]
        if not key:  # no source file to name the kernel by: nothing to match across processes
            self.counts["unkeyed"] += 1
            upstream(tuner, *args, **kwargs)
            return
        if self.loading:
            self._load_choice(tuner, upstream, args, kwargs, key, name, candidates)
        else:
            self._save_choice(tuner, upstream, args, kwargs, key, name, candidates)

    def _load_choice(self, tuner: Any, upstream: Callable[..., None], args: tuple, kwargs: dict, key: str,
                     name: str, candidates: list[str]) -> None:  # fmt: skip
        saved = self.saved.get(key)
        if isinstance(saved, Mapping) and saved.get("candidates") == candidates and saved.get("chosen") in candidates:
            _keep(tuner, upstream, args, kwargs, str(saved["chosen"]))
            self.counts["pinned"] += 1
            return
        why = ("SAVE made no choice for it" if saved is None
               else f"its candidates differ: saved {_short(saved)}, live {candidates}")  # fmt: skip
        upstream(tuner, *args, **kwargs)
        self.counts["timed"] += 1
        self.log(f"kernel {name} ({key}) timed at LOAD: {why}; chose {config_text(tuner.launchers[0].config)}")

    def _save_choice(self, tuner: Any, upstream: Callable[..., None], args: tuple, kwargs: dict, key: str,
                     name: str, candidates: list[str]) -> None:  # fmt: skip
        if tuner.save_cache_hook is None:  # one compiled config, the rest scaled copies: launch what later starts do
            _keep(tuner, upstream, args, kwargs, candidates[0])
            how = "compiled"
        else:
            upstream(tuner, *args, **kwargs)
            how = "timed"
        chosen = config_text(tuner.launchers[0].config)
        self.counts[how] += 1
        self.used[key] = {"kernel": name, "candidates": candidates, "chosen": chosen, "how": how}


def _short(saved: Any) -> str:
    return str(saved.get("candidates") if isinstance(saved, Mapping) else saved)


def _keep(tuner: Any, upstream: Callable[..., None], args: tuple, kwargs: dict, chosen: str) -> None:
    """Runs upstream's autotune_to_one_config with timings that make `chosen` the winner: upstream's own bookkeeping
    (launchers, its autotune cache, the bundle's winners) stays as it is; only the GPU timing is not run."""
    own = tuner.__dict__.get("benchmark_all_configs")
    tuner.benchmark_all_configs = lambda *a, **k: {
        launcher: 0.0 if config_text(launcher.config) == chosen else 1.0 for launcher in tuner.launchers
    }
    try:
        upstream(tuner, *args, **kwargs)
    finally:
        if own is None:
            del tuner.benchmark_all_configs
        else:
            tuner.benchmark_all_configs = own


_active: Choices | None = None
_upstream: Callable[..., None] | None = None


def install(*, loading: bool, saved: Mapping[str, Any] | None, log: Callable[[str], None]) -> Choices:
    """Routes Inductor's timing of launch configs through a Choices for the rest of the process (save or load)."""
    global _active, _upstream
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError as exc:
        raise PersistError(f"graphpersist: torch's Inductor runtime cannot be imported ({exc}): this torch is "
                           "not one the distribution supports; use the pinned torch") from None  # fmt: skip
    upstream = getattr(CachingAutotuner, "autotune_to_one_config", None)
    if upstream is None:
        raise PersistError("graphpersist: torch's CachingAutotuner has no autotune_to_one_config: this torch is not "
                           "one the distribution supports (torch 2.11); use the pinned torch")  # fmt: skip
    if _upstream is None:
        _upstream = upstream

        def autotune_to_one_config(self: Any, *args: Any, **kwargs: Any) -> None:
            assert _upstream is not None
            if _active is None:
                return _upstream(self, *args, **kwargs)
            return _active.choose(self, _upstream, args, kwargs)

        CachingAutotuner.autotune_to_one_config = autotune_to_one_config
    _active = Choices(loading, dict(saved or {}), log)
    return _active


def uninstall() -> None:
    """Puts upstream's method back (tests; a process never leaves its mode)."""
    global _active, _upstream
    if _upstream is not None:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        CachingAutotuner.autotune_to_one_config = _upstream
    _active = _upstream = None
