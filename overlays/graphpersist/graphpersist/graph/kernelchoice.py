"""Inductor's timed kernel choices, one per kernel source: SAVE records each timed Triton kernel's launch config,
LOAD launches SAVE's without timing.

Why: Inductor (torch 2.11) compiles some kernels with several launch configs and times them at the first launch
(`CachingAutotuner.autotune_to_one_config`); the winner decides the kernel a graph captures. vLLM compiles every
piece of the model before the first forward, so one kernel source can be held by several autotuner objects (one per
compiled piece that contains it), and in a cold process each of them is timed on its own at its first launch:
measured on one H200 (2026-12-02), a cold SAVE timed 24 times for 14 kernel sources. Each timing can pick another
config, and upstream's autotune cache (the `.best_config` file next to the kernel's source, which later starts read)
keeps whichever winner was written last. So a cold start may capture, in one piece, another config than the one every
later start loads: the tenth session's flip
(`recipes/diagnosis/vllm-qwen3-8b-tp1-kernel-choice/kernel-choice-flip/`, the final norm's
`triton_red_fused_fused_add_rms_norm_2`, compiled with R0_BLOCK 4096 and 2048, differing in piece 036 only).

SAVE: the first object of a kernel source is timed as upstream does (`counts["timed"]`); every later object of that
source launches the same winner (`counts["reused"]`), so the graphs of one SAVE hold one config per kernel and
upstream's cache file gets that config too. The later object is still timed (as upstream would) only to measure: where
its own timing preferred another config, that is logged and counted (`counts["overruled"]`). Every choice goes into
the rank's notes in the archive.
LOAD: only the archive's choices count (`counts["pinned"]`); a kernel SAVE never chose for, or whose candidate
configs differ from SAVE's, is timed as upstream does, named in the log and counted (`counts["timed"]`).
Off: nothing is installed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphpersist import run
from graphpersist.archive.shown import shown
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
        first = self.used.get(key)
        if first is None or first["candidates"] != candidates:  # timed as upstream does
            upstream(tuner, *args, **kwargs)
            self.counts["timed"] += 1
            chosen = config_text(tuner.launchers[0].config)
            if first is None:  # the source's first object: its choice is the one the archive keeps
                self.used[key] = {"kernel": name, "candidates": candidates, "chosen": chosen, "how": "timed",
                                  "objects": 1}  # fmt: skip
            else:  # same source, other configs: not kept; a LOAD will time one of them
                self.log(f"kernel {name} ({key}) timed again at SAVE with other candidates: first "
                         f"{first['candidates']}, now {candidates}; chose {chosen}; a LOAD will time it")  # fmt: skip
            return
        timings = tuner.benchmark_all_configs(*args, **kwargs)  # measured only: the choice is the first object's
        own = config_text(min(timings, key=timings.get).config)
        _keep(tuner, upstream, args, kwargs, first["chosen"])
        first["objects"] += 1
        self.counts["reused"] += 1
        if own != first["chosen"]:
            self.counts["overruled"] += 1
            self.log(f"kernel {name} ({key}): this object's timing preferred {own}; it launches {first['chosen']}, "
                     "the choice of the first object of its source")  # fmt: skip


def _short(saved: Any) -> str:
    """What the notes saved for a kernel, as the log shows it (archive text: escaped, clipped)."""
    return shown(str(saved.get("candidates") if isinstance(saved, Mapping) else saved), 300)


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


_upstream: Callable[..., None] | None = None  # Inductor's own method, once wrapped (the wrapper is process-wide)


def install(*, loading: bool, saved: Mapping[str, Any] | None, log: Callable[[str], None]) -> Choices:
    """Routes Inductor's timing of launch configs through a Choices, held by the process's run (graphpersist.run):
    the wrapper is installed once per process and defers to upstream whenever the current run pins nothing."""
    global _upstream
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
            active = run.active()
            choices = active.kernel_choices if active is not None else None
            if choices is None:
                return _upstream(self, *args, **kwargs)
            return choices.choose(self, _upstream, args, kwargs)

        CachingAutotuner.autotune_to_one_config = autotune_to_one_config
    choices = run.current().kernel_choices = Choices(loading, dict(saved or {}), log)
    return choices
