"""Inductor's timed kernel choices, made once: SAVE records which launch config each timed Triton kernel won,
LOAD launches SAVE's winners without timing them again.

Why: Inductor (torch 2.11) compiles some reductions with one config and, where that config needs many registers,
adds a copy with half the reduction block (`CachingAutotuner._dynamic_scale_rblock`), then times both at the
kernel's first launch and keeps the faster. That choice is never written to Inductor's autotune cache (it only
caches kernels compiled with several configs), so every process times again and near ties flip
(pytorch/pytorch#189121). Two SAVEs of Qwen3-8B at TP=1 on one H200 (2026-12-01, recipes/vllm-qwen3-8b-tp1) captured
different images of `triton_red_fused_fused_add_rms_norm_2` in 102 of 1938 graphs. The two configs reduce in a
different order, so what a LOAD runs outside its graphs (a prefill above the largest capture size) could differ in
the last bits from what SAVE's graphs compute, and two SAVEs could not be compared.

SAVE: a choice this host already made (a JSON file per kernel and candidate set in `store_dir()`, written once,
never replaced) is taken as it is; otherwise the kernel is timed as upstream does and the winner published, unless
another process (another rank) published first, whose winner is then taken. So every SAVE on a host, every rank,
launches the same configs. Every choice the SAVE used is returned for the rank's notes in the archive.
LOAD: only the archive's choices count; a kernel SAVE never timed, or whose candidate configs differ from SAVE's,
is timed as upstream does and named in the log, and counted (`counts["timed"]`), since its launches may then differ
from SAVE's outside the graphs. LOAD writes nothing.
Off: nothing is installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpersist.errors import PersistError

NOTES_KEY = "kernel_choices"  # where the choices go in the rank's engine notes
STORE_ENV = "GRAPHPERSIST_KERNEL_CHOICES_DIR"


def store_dir() -> Path:
    """Where SAVE keeps the host's choices: $GRAPHPERSIST_KERNEL_CHOICES_DIR, else
    <cache home>/graphpersist/kernel-choices."""
    if value := os.environ.get(STORE_ENV):
        return Path(value)
    home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(home) / "graphpersist" / "kernel-choices"


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
    store: Path | None
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
        why = ("SAVE never timed it" if saved is None
               else f"its candidates differ: saved {_short(saved)}, live {candidates}")  # fmt: skip
        upstream(tuner, *args, **kwargs)
        self.counts["timed"] += 1
        self.log(f"kernel {name} ({key}) timed at LOAD: {why}; chose {config_text(tuner.launchers[0].config)}")

    def _save_choice(self, tuner: Any, upstream: Callable[..., None], args: tuple, kwargs: dict, key: str,
                     name: str, candidates: list[str]) -> None:  # fmt: skip
        path = self.store / f"{key}-{_digest(candidates)}.json" if self.store else None
        chosen = _read(path, candidates) if path else None
        how = "host"
        if chosen is None:  # time as upstream does, then keep whatever winner the host records first
            timings = tuner.benchmark_all_configs(*args, **kwargs)
            chosen = config_text(min(timings, key=timings.get).config)
            how = "timed"
            if path:
                chosen = _publish(path, {"kernel": name, "candidates": candidates, "chosen": chosen}) or chosen
        _keep(tuner, upstream, args, kwargs, chosen)
        self.counts[how] += 1
        self.used[key] = {"kernel": name, "candidates": candidates, "chosen": chosen, "how": how}


def _short(saved: Any) -> str:
    return str(saved.get("candidates") if isinstance(saved, Mapping) else saved)


def _digest(candidates: list[str]) -> str:
    return hashlib.sha256("\n".join(candidates).encode()).hexdigest()[:16]


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


def _read(path: Path, candidates: list[str]) -> str | None:
    """The host's recorded winner for exactly these candidates, or None (absent, unreadable, or another set)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("candidates") != candidates or record.get("chosen") not in candidates:
        return None
    return str(record["chosen"])


def _publish(path: Path, record: dict[str, Any]) -> str | None:
    """Writes `record` unless the file exists (os.link fails then); returns the winner now on disk, None if the
    store cannot be written (SAVE goes on with its own choice)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        temp.write_text(json.dumps(record, sort_keys=True))
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()
    except OSError:
        return None
    return _read(path, record["candidates"])


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
    _active = Choices(loading, dict(saved or {}), log, None if loading else store_dir())
    return _active


def uninstall() -> None:
    """Puts upstream's method back (tests; a process never leaves its mode)."""
    global _active, _upstream
    if _upstream is not None:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        CachingAutotuner.autotune_to_one_config = _upstream
    _active = _upstream = None
