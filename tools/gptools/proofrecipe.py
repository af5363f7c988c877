"""A recipe's proof as the runner reads it from proof.toml: its runs and targets (parsed by `gptools.prove`).

Its own module so that the runner, the checks and the report share the types without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAIN_OUTPUTS = "main"  # the output group of runs that name none: the recipe's own model (dummy weights)


@dataclass(frozen=True)
class RunSpec:
    """One [[run]] of proof.toml."""

    name: str
    mode: str
    archive: str | None
    cache: str
    args: tuple[str, ...]
    compare_outputs: bool
    expect_refusal: bool = False  # the engine must refuse to start: no outputs, no graphs, errors in the log
    env: tuple[tuple[str, str], ...] = ()  # variables this run's driver gets on top of the runner's environment
    # Runs are compared (outputs, archives, script runs) only within their group: a group's runs start one model,
    # e.g. "real" for the runs on a real checkpoint, whose tokens never equal the dummy-weight runs'.
    outputs: str = MAIN_OUTPUTS
    # The run this one repeats (proof.toml `repeat = N`: `<name>_2` ... `<name>_N` after `<name>`), None for a declared
    # run: a target over a repeated run reads the median of its repetitions (start-up times vary from start to start).
    repeats: str | None = None


@dataclass(frozen=True)
class Target:
    """One [[target]]: `num` (/ `den`) must lie within [min, max]; stated in the report, never a check."""

    name: str
    num: str
    den: str | None
    min: float | None
    max: float | None


@dataclass(frozen=True)
class Recipe:
    """A parsed proof.toml."""

    dir: Path
    title: str
    driver: tuple[str, ...]
    timeout_s: float
    archive_dir: str
    cache_env: tuple[str, ...]
    runs: tuple[RunSpec, ...]
    targets: tuple[Target, ...]
    error_patterns: tuple[str, ...]
    ignore_patterns: tuple[str, ...]
    # Phases the driver computes as a remainder (start to ready minus the others): they count as unaccounted time.
    residual_phases: tuple[str, ...] = ()
    # Runs whose unaccounted start-up time is checked (<= proofcheck.UNACCOUNTED_MAX); none unless declared.
    phase_check: tuple[str, ...] = ()
    # True: their unaccounted share is a stated Targets row, not a check (until the driver times every phase).
    phase_check_stated: bool = False

    def repetitions(self, name: str) -> tuple[RunSpec, ...]:
        """The run `name` and the runs that repeat it, in run order (the run itself first); one when not repeated."""
        return tuple(r for r in self.runs if name in (r.name, r.repeats))

    def archive_path(self, out: Path, name: str) -> Path:
        """Where a named archive lives: under `archive_dir`, which is relative to --out unless absolute."""
        return (out / self.archive_dir / name).resolve()
