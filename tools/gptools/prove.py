"""`python -m gptools prove RECIPE --out DIR`: run a recipe's proof runs, check them, write REPORT.md.

The runner knows nothing about engines. A recipe describes its runs in `<recipe>/proof.toml` and brings a driver
(a program that starts the engine once and measures it); the runner starts each run as its own process group,
collects what the drivers wrote, checks it (gptools/proofcheck.py) and renders the report (gptools/proofreport.py).

The driver contract:

- argv: `<driver> --run NAME --mode off|save|load [--archive DIR] --result FILE <the run's args>`, started with
  cwd = the recipe folder, in a new session, stdout + stderr to `<out>/<run>/log.txt`. `{python}` in the driver's
  argv is the --python interpreter. `{real_model}` in a run's args is the real checkpoint's folder, from the
  environment variable GP_REAL_MODEL: a folder that `recipes/gpu-host/real_checkpoint.py` completed (it writes
  `.gp-complete` last). When a selected run uses it and the variable is unset or names no complete checkpoint, prove
  exits 2 before running anything, naming the run, the variable and the command that makes the checkpoint; runs
  that do not use it never need the variable. Drivers may use `gptools.proofkit` (tools/ is first on their PYTHONPATH),
  and one that starts an OpenAI-compatible server `gptools.serveproof`.
- environment: each `cache_env` variable points at its own folder of the run's cache root (`<out>/cache-warm`,
  shared by all warm runs and kept; a `cache = "fresh"` run gets the same paths emptied, the warm content moved
  aside for its length, and what it wrote is kept in `<out>/<run>/cache`);
  GP_PROOF_CACHE_DIRS lists those folders (os.pathsep-joined); GRAPHPERSIST_STATS_DIR = `<out>/<run>/stats`,
  where the engine writes one `rank_<r>.json` per rank (`rank`, `mode`, `captured`, `restored`, `capture_calls`);
  PYTHONUNBUFFERED=1; a run's `env = { NAME = "value" }` adds its own variables (not those the runner sets), and
  the report's Logs table names them.
- result: FILE, a JSON object: `ok`, `error`, `start_to_ready_s` (engine constructor wall time), `phases`
  (ordered name -> seconds), `outputs` (workload -> list of greedy token-id lists), `latency` (name -> number),
  `jit` (`new_cache_files_start`, `new_cache_files_first_request`, `examples`), `engine` (`name`, `version`).
- a run with `expect_refusal = true` proves that the engine refuses to start (e.g. a LOAD whose archive does not
  fit): its driver writes ok=true only when the engine refused, and `refusal` = {`matched`: the log line that shows
  the reason, `raised_type`: the qualified type the engine's start raised in the driver (optional; when given it
  must be the runtime's, `graphpersist.`...), `first_mismatch`, ...}; such a run has no outputs, and LOAD's checks
  and the clean-log check do not apply to it.
- optional `script_runs`: how many processes ran the driver's script (`proofkit.note_script_run` at its top level,
  `proofkit.script_runs`): a persistence run must count as many as the first persistence-off run.
- lifetime: at `timeout_s` the whole process group gets SIGTERM, then SIGKILL after 10 s; after a normal exit
  leftover processes of the group (engine workers) are ended the same way. Exit 0 means the run finished.
- phases: each run named in `phase_check` (none by default) gets the check `<run> unaccounted <= 5 %` (with
  `phase_check_stated = true`, a Targets row instead, stated and never failing the report), unaccounted
  being start to ready minus the sum of its measured phases; `residual_phases` (phases a driver computes as a
  remainder) count as unaccounted, not as measured.
- outputs: the runs of one model are compared with one another only. A run's `outputs = "<group>"` puts it in
  that group (default: the main group, the recipe's own model): "outputs identical" compares the main group's runs,
  each other group gets "outputs identical (<group>)" over its own; archives are compared within the group of the
  run that writes them, a `compare_outputs = false` run with its group's first compared run, and a run's script
  count with its group's first persistence-off run (e.g. `outputs = "real"` for the runs on a real checkpoint).
- repetitions: a run's `repeat = N` (1 to 9, default 1) makes N runs of its settings, `<name>`, `<name>_2` ...
  `<name>_N`, run one after another where it is listed. Each is an ordinary run (its own folder, result, log, checks
  and timing row); `--runs` takes them by exact name (`--runs load_2` runs that one). A [[target]]'s
  `<run>.<metric>` of a repeated run reads the median over the repetitions that have a result (statistics.median;
  the row's detail says of how many, and which have none), since start-up times vary from one start to the next.

Misuse (a bad proof.toml, an unknown run) exits 2 naming the key; otherwise exit 0 when every check passes, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gptools import proofcheck, proofkit, proofreport
from gptools.proofrecipe import MAIN_OUTPUTS, Recipe, RunSpec, Target

TOOLS_DIR = Path(__file__).resolve().parents[1]  # put first on drivers' PYTHONPATH for gptools.proofkit
TERM_GRACE_S = 10.0  # SIGTERM to SIGKILL
WARM_CACHE = "cache-warm"  # under --out: the cache folders every warm run shares, kept between invocations
DEFAULT_ERROR_PATTERNS = ("Traceback", "CUDA error", "CUBLAS_STATUS", "illegal memory", "ERROR")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # run and archive names become folder names
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
TOP_KEYS = {"title", "driver", "timeout_s", "archive_dir", "cache_env", "run", "target", "error_patterns"}
TOP_KEYS |= {"ignore_patterns", "residual_phases", "phase_check", "phase_check_stated"}
RUN_KEYS = {"name", "mode", "archive", "cache", "args", "compare_outputs", "expect_refusal", "env", "outputs", "repeat"}
MAX_REPEAT = 9  # a run's `repeat`: 1 (default) to this many starts with the same settings
TARGET_KEYS = {"name", "num", "den", "min", "max"}
RUNNER_ENV = {proofkit.CACHE_DIRS_ENV, proofkit.STATS_DIR_ENV, "PYTHONUNBUFFERED", "PYTHONPATH"}
REAL_MODEL = "{real_model}"  # in a run's args: the folder REAL_MODEL_ENV names
REAL_MODEL_ENV = "GP_REAL_MODEL"
REAL_MODEL_COMPLETE = ".gp-complete"  # real_checkpoint.py writes it after the last shard
REAL_CHECKPOINT = "recipes/gpu-host/real_checkpoint.py"  # makes the checkpoint (on the GPU host: it needs a GPU)


class ProofConfigError(ValueError):
    """proof.toml says something the runner cannot do; the message names the key."""


# ------------------------------------------------------------------------------------------- proof.toml


def _get(table: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in table:
        if default is ...:
            raise ProofConfigError(f"{where}{key}: missing")
        return default
    value = table[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProofConfigError(f"{where}{key}: wrong type {type(value).__name__} ({value!r})")
    return value


def _strings(table: dict[str, Any], key: str, where: str, default: Any = ()) -> tuple[str, ...]:
    value = _get(table, key, where, list, default if default is ... else list(default))
    if not all(isinstance(v, str) for v in value):
        raise ProofConfigError(f"{where}{key}: must be a list of strings")
    return tuple(value)


def _no_unknown(table: dict[str, Any], known: set[str], where: str) -> None:
    for key in table:
        if key not in known:
            hint = " (targets are [[target]] tables with name, num, den, min, max)" if key == "targets" else ""
            raise ProofConfigError(f"{where}{key}: unknown key{hint}")


def _parse_run(table: Any, i: int) -> RunSpec:
    where = f"run[{i}]."
    if not isinstance(table, dict):
        raise ProofConfigError(f"run[{i}]: must be a table ([[run]])")
    _no_unknown(table, RUN_KEYS, where)
    name = _get(table, "name", where, str)
    if not NAME.fullmatch(name):
        raise ProofConfigError(f"{where}name: {name!r} is not a plain name (letters, digits, _ . -)")
    mode = _get(table, "mode", where, str)
    if mode not in proofkit.MODES:
        raise ProofConfigError(f"{where}mode: must be one of {', '.join(proofkit.MODES)}, got {mode!r}")
    archive = _get(table, "archive", where, str, None)
    if (archive is None) != (mode == "off"):
        raise ProofConfigError(f"{where}archive: {'needed for' if archive is None else 'not allowed with'} {mode=}")
    if archive is not None and not NAME.fullmatch(archive):
        raise ProofConfigError(f"{where}archive: {archive!r} is not a plain name (letters, digits, _ . -)")
    cache = _get(table, "cache", where, str, "warm")
    if cache not in ("warm", "fresh"):
        raise ProofConfigError(f"{where}cache: must be warm or fresh, got {cache!r}")
    refusal = _get(table, "expect_refusal", where, bool, False)
    compare = _get(table, "compare_outputs", where, bool, not refusal)
    if refusal and compare:
        raise ProofConfigError(f"{where}compare_outputs: a run with expect_refusal = true has no outputs to compare")
    env = _run_env(table, where)
    outputs = _get(table, "outputs", where, str, MAIN_OUTPUTS)
    if not NAME.fullmatch(outputs):
        raise ProofConfigError(f"{where}outputs: {outputs!r} is not a plain name (letters, digits, _ . -)")
    args = _strings(table, "args", where)
    return RunSpec(name, mode, archive, cache, args, compare, refusal, env, outputs)


def _parse_runs(tables: list[Any]) -> tuple[RunSpec, ...]:
    """Every [[run]] in order, one with `repeat = N` followed by its repetitions `<name>_2` ... `<name>_N`: the same
    settings, each an ordinary run of its own (folder, result, checks), so that a target can take their median."""
    declared = {t["name"] for t in tables if isinstance(t, dict) and isinstance(t.get("name"), str)}
    runs: list[RunSpec] = []
    for i, table in enumerate(tables):
        spec = _parse_run(table, i)
        count = _get(table, "repeat", f"run[{i}].", int, 1)
        if not 1 <= count <= MAX_REPEAT:
            raise ProofConfigError(f"run[{i}].repeat: must be 1 to {MAX_REPEAT}, got {count}")
        again = [dataclasses.replace(spec, name=f"{spec.name}_{k}", repeats=spec.name) for k in range(2, count + 1)]
        if clash := [r.name for r in again if r.name in declared]:
            raise ProofConfigError(
                f"run[{i}].repeat: its repetition {clash[0]!r} has the name of another run; rename that run"
            )
        runs += [spec, *again]
    return tuple(runs)


def _run_env(table: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    """A run's `env = { NAME = "value" }`: what one run changes in its driver's environment (e.g. a start method),
    never the variables the runner owns (cache folders, stats, PYTHONPATH)."""
    env = _get(table, "env", where, dict, {})
    for var, value in env.items():
        if not ENV_NAME.fullmatch(var):
            raise ProofConfigError(f"{where}env: {var!r} is not an environment variable name")
        if not isinstance(value, str):
            raise ProofConfigError(f"{where}env.{var}: must be a string, got {type(value).__name__} ({value!r})")
        if var in RUNNER_ENV:
            raise ProofConfigError(f"{where}env.{var}: set by the runner for every run; it cannot be changed per run")
    return tuple(sorted(env.items()))


def _parse_target(table: Any, i: int, runs: set[str]) -> Target:
    where = f"target[{i}]."
    if not isinstance(table, dict):
        raise ProofConfigError(f"target[{i}]: must be a table ([[target]])")
    _no_unknown(table, TARGET_KEYS, where)
    num, den = _get(table, "num", where, str), _get(table, "den", where, str, None)
    for key, path in (("num", num), ("den", den)):
        if path is not None and ("." not in path or path.split(".", 1)[0] not in runs):
            raise ProofConfigError(f"{where}{key}: {path!r} must be <run>.<metric> with a run of proof.toml")
    low, high = _get(table, "min", where, (int, float), None), _get(table, "max", where, (int, float), None)
    if low is None and high is None:
        raise ProofConfigError(f"{where}min: a target needs min, max or both")
    return Target(_get(table, "name", where, str), num, den, low, high)


def parse_recipe(recipe_dir: Path) -> Recipe:
    """Reads and validates `<recipe_dir>/proof.toml`; ProofConfigError names the first bad key."""
    path = recipe_dir / "proof.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ProofConfigError(f"no proof.toml in {recipe_dir}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProofConfigError(f"not valid TOML: {exc}") from None
    _no_unknown(data, TOP_KEYS, "")
    driver = _strings(data, "driver", "", ...)
    if not driver:
        raise ProofConfigError('driver: must name a program (e.g. ["{python}", "driver.py"])')
    timeout = _get(data, "timeout_s", "", (int, float))
    if timeout <= 0:
        raise ProofConfigError(f"timeout_s: must be positive, got {timeout}")
    tables = _get(data, "run", "", list)
    runs = _parse_runs(tables)
    names = [r.name for r in runs]
    if not runs or len(set(names)) != len(names):
        raise ProofConfigError("run: needs at least one [[run]], each with its own name")
    archive_dir = _get(data, "archive_dir", "", str, "archives")
    taken = {WARM_CACHE, Path(archive_dir).parts[0] if archive_dir and not Path(archive_dir).is_absolute() else ""}
    if clash := [n for n in names if n in taken]:
        raise ProofConfigError(f"run: {clash[0]!r} is taken by a folder of --out (the warm cache or archive_dir)")
    if clash := [r.archive for r in runs if r.archive in {*names, WARM_CACHE}]:
        raise ProofConfigError(f"run: archive {clash[0]!r} has the name of a run's folder; choose another")
    cache_env = _strings(data, "cache_env", "")
    if bad := [v for v in cache_env if not ENV_NAME.fullmatch(v)]:
        raise ProofConfigError(f"cache_env: {bad[0]!r} is not an environment variable name")
    for i, run in enumerate(r for r in runs if r.repeats is None):  # a repetition has its run's env
        if clash := [var for var, _ in run.env if var in cache_env]:
            raise ProofConfigError(f"run[{i}].env.{clash[0]}: a cache_env variable; the runner sets it per run")
    patterns = {
        "error_patterns": _strings(data, "error_patterns", "", DEFAULT_ERROR_PATTERNS),
        "ignore_patterns": _strings(data, "ignore_patterns", ""),
    }
    for key, regexes in patterns.items():
        for regex in regexes:
            try:
                re.compile(regex)
            except re.error as exc:
                raise ProofConfigError(f"{key}: {regex!r} is not a regular expression: {exc}") from None
    targets = tuple(_parse_target(t, i, set(names)) for i, t in enumerate(_get(data, "target", "", list, [])))
    phase_check = _strings(data, "phase_check", "")
    if bad := [n for n in phase_check if n not in names or next(r for r in runs if r.name == n).expect_refusal]:
        raise ProofConfigError(f"phase_check: {bad[0]!r} is not a run of proof.toml that starts an engine")
    return Recipe(
        dir=recipe_dir.resolve(),
        title=_get(data, "title", "", str),
        driver=driver,
        timeout_s=float(timeout),
        archive_dir=archive_dir,
        cache_env=cache_env,
        runs=runs,
        targets=targets,
        error_patterns=patterns["error_patterns"],
        ignore_patterns=patterns["ignore_patterns"],
        residual_phases=_strings(data, "residual_phases", ""),
        phase_check=phase_check,
        phase_check_stated=_get(data, "phase_check_stated", "", bool, False),
    )


# ------------------------------------------------------------------------------------------- one run


def cache_folders(recipe: Recipe, out: Path, spec: RunSpec) -> dict[str, Path]:
    """Each cache variable's folder for this run: the shared warm folders, at the same paths for a fresh run too
    (a new host has the same paths as the old one, and some caches record absolute paths: FlashInfer's ninja files).
    A fresh run finds them empty: `fresh_caches` moves the warm content aside for its length."""
    return {var: out / WARM_CACHE / var for var in recipe.cache_env}


@contextmanager
def fresh_caches(out: Path, spec: RunSpec) -> Iterator[None]:
    """For a fresh run: the warm cache folder moved aside (kept), an empty one in its place; afterwards what the
    fresh run wrote goes to `<out>/<run>/cache` and the warm folder comes back."""
    if spec.cache != "fresh":
        yield
        return
    warm, aside, kept = out / WARM_CACHE, out / f"{WARM_CACHE}.aside", out / spec.name / "cache"
    if aside.exists():
        raise ProofConfigError(f"{aside} exists (a run was interrupted?): move it back to {warm} or delete it")
    if warm.exists():
        warm.rename(aside)
    try:
        yield
    finally:
        shutil.rmtree(kept, ignore_errors=True)
        if warm.exists():
            warm.rename(kept)
        if aside.exists():
            aside.rename(warm)


def driver_command(recipe: Recipe, out: Path, spec: RunSpec, python: str) -> list[str]:
    cmd = [part.replace("{python}", python) for part in recipe.driver]
    cmd += ["--run", spec.name, "--mode", spec.mode]
    if spec.archive:
        cmd += ["--archive", str(recipe.archive_path(out, spec.archive))]
    return [*cmd, "--result", str(out / spec.name / "result.json"), *expand_args(spec.args)]


def expand_args(args: tuple[str, ...]) -> list[str]:
    """A run's args with `{real_model}` replaced by REAL_MODEL_ENV's folder, absolute (drivers run in the recipe's
    folder); `real_model_problem` has made sure that the folder holds a complete checkpoint."""
    if not any(REAL_MODEL in a for a in args):
        return list(args)
    folder = str(Path(os.environ[REAL_MODEL_ENV]).resolve())
    return [a.replace(REAL_MODEL, folder) for a in args]


def real_model_problem(selected: list[RunSpec]) -> str | None:
    """Why the selected runs that use `{real_model}` cannot start (REAL_MODEL_ENV unset, not a folder, no complete
    checkpoint), with the advice; None when none uses it or the checkpoint is there."""
    users = [s.name for s in selected if any(REAL_MODEL in a for a in s.args)]
    value = os.environ.get(REAL_MODEL_ENV, "")
    if not users:
        return None
    if not value:
        why = "is unset"
    elif not Path(value).is_dir():
        why = f"is {value!r}, not a folder"
    elif not (Path(value) / REAL_MODEL_COMPLETE).is_file():
        why = f"is {value!r}, which holds no complete checkpoint (no {REAL_MODEL_COMPLETE})"
    else:
        return None
    return (
        f"run(s) {', '.join(users)}: args use {REAL_MODEL}, and {REAL_MODEL_ENV} {why}\n"
        f"make the checkpoint once on the GPU host with `python3 {REAL_CHECKPOINT} DIR` and set {REAL_MODEL_ENV}=DIR "
        f"(recipes/gpu-host/engine-proof.sh does both), or leave these runs out with --runs"
    )


def driver_env(caches: dict[str, Path], stats: Path, run_env: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env.update(run_env)
    env.update({var: str(folder) for var, folder in caches.items()})
    env[proofkit.CACHE_DIRS_ENV] = os.pathsep.join(str(p) for p in caches.values())
    env[proofkit.STATS_DIR_ENV] = str(stats)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TOOLS_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def end_group(pgid: int) -> int:
    """SIGTERM to the group, SIGKILL to what is left after TERM_GRACE_S; returns how many processes were running."""
    alive = proofkit.group_members(pgid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not proofkit.group_members(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + (TERM_GRACE_S if sig == signal.SIGTERM else 5.0)
        while proofkit.group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return len(alive)


def execute_run(recipe: Recipe, out: Path, spec: RunSpec, python: str) -> dict[str, Any]:
    """Starts one run as its own process group, waits (bounded by timeout_s), ends the group, records run.json."""
    run_dir = out / spec.name
    stats = run_dir / "stats"
    stats.mkdir(parents=True)
    with fresh_caches(out, spec):
        return _execute(recipe, out, spec, python, run_dir, stats)


def _execute(recipe: Recipe, out: Path, spec: RunSpec, python: str, run_dir: Path, stats: Path) -> dict[str, Any]:
    caches = cache_folders(recipe, out, spec)
    for folder in caches.values():
        folder.mkdir(parents=True, exist_ok=True)
    cmd = driver_command(recipe, out, spec, python)
    record: dict[str, Any] = {"name": spec.name, "recipe": recipe.dir.resolve().name, "command": cmd,
                              "env": dict(spec.env), "started": _now(), "timeout_s": recipe.timeout_s}  # fmt: skip
    start = time.monotonic()
    with (run_dir / "log.txt").open("wb") as log:
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=recipe.dir,
                env=driver_env(caches, stats, spec.env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            log.write(f"prove: cannot start the driver {shlex.join(cmd)}: {exc}\n".encode())
            record.update(exit_code=None, timed_out=False, wall_s=0.0, ended_processes=0, start_error=str(exc))
            return _save_record(run_dir, record)
        try:
            proc.wait(timeout=recipe.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        except KeyboardInterrupt:  # the run has its own session: Ctrl-C reached only us, so end the engine too
            end_group(proc.pid)
            raise
        record["wall_s"] = time.monotonic() - start
        running = end_group(proc.pid)
        proc.wait()
    record.update(exit_code=proc.returncode, timed_out=timed_out, ended_processes=running)
    return _save_record(run_dir, record)


def _save_record(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    (run_dir / "run.json").write_text(json.dumps(record, indent=1))
    return record


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _run_all(recipe: Recipe, out: Path, selected: list[RunSpec], python: str, keep_going: bool) -> None:
    for spec in selected:  # stale data of a selected run must never be read as this invocation's
        shutil.rmtree(out / spec.name, ignore_errors=True)
    for i, spec in enumerate(selected, 1):
        tag = f"prove: [{i}/{len(selected)}] {spec.name}:"
        where = f", archive={spec.archive}" if spec.archive else ""
        print(f"{tag} starting (mode={spec.mode}{where}, cache={spec.cache})", flush=True)
        if spec.mode == "save":
            old = recipe.archive_path(out, spec.archive or "")
            if old.exists():
                print(f"{tag} removing the old archive {old}", flush=True)
                shutil.rmtree(old)
        record = execute_run(recipe, out, spec, python)
        problem = proofcheck.run_problem(record, proofcheck.load_result(out / spec.name / "result.json"))
        if problem is None:
            print(f"{tag} done in {record['wall_s']:.1f} s", flush=True)
            continue
        log = out / spec.name / "log.txt"
        reason = proofcheck.last_reason(log) if not (out / spec.name / "result.json").exists() else None
        print(f"{tag} FAILED: {problem}{f'; the log says: {reason}' if reason else ''}; log: {log}", flush=True)
        if not keep_going and i < len(selected):
            rest = ", ".join(s.name for s in selected[i:])
            print(f"prove: stopping (--keep-going runs the rest anyway); not run: {rest}", flush=True)
            return


# ------------------------------------------------------------------------------------------- CLI

DESCRIPTION = (
    "Run each [[run]] of RECIPE_DIR/proof.toml as its own process group through the recipe's driver, then check: "
    "every run finished, outputs identical, SAVE archives identical, every graph restored, no capture and no new JIT "
    "files during LOAD, clean logs. Writes REPORT.md, report.json and phases.png under --out. Exit 0 when every "
    "check passes, 1 otherwise, 2 on misuse (a bad proof.toml: the message names the key)."
)


def _select(recipe: Recipe, runs: str | None) -> list[RunSpec]:
    if runs is None:
        return list(recipe.runs)
    names = [n for n in runs.split(",") if n]
    known = [r.name for r in recipe.runs]
    if unknown := [n for n in names if n not in known]:
        raise ProofConfigError(f"--runs: unknown run(s) {', '.join(unknown)}; proof.toml has {', '.join(known)}")
    return [r for r in recipe.runs if r.name in names]


def _misuse(message: str) -> int:
    print(f"gptools prove: {message}", file=sys.stderr)
    return 2


def _cmd_prove(args: argparse.Namespace) -> int:
    recipe_dir = Path(args.recipe)
    out = Path(args.out).resolve()
    try:
        recipe = parse_recipe(recipe_dir)
    except ProofConfigError as exc:
        return _misuse(f"{recipe_dir / 'proof.toml'}: {exc}")
    try:
        selected = _select(recipe, args.runs)
    except ProofConfigError as exc:
        return _misuse(str(exc))
    if args.check_only and args.runs:
        return _misuse("--runs and --check-only exclude each other (--check-only re-checks every run in --out)")
    if args.check_only and not out.is_dir():
        return _misuse(f"--check-only: {out} does not exist; run the proof first")
    if not args.check_only and (problem := real_model_problem(selected)):
        return _misuse(problem)
    out.mkdir(parents=True, exist_ok=True)
    if not args.check_only:
        _run_all(recipe, out, selected, args.python, args.keep_going)
    print("prove: checking", flush=True)
    runs = {spec.name: proofcheck.load_run(spec, out, recipe.dir) for spec in recipe.runs}
    checks = proofcheck.evaluate(recipe, out, runs, args.python)
    report = Path(args.report).resolve() if args.report else out / "REPORT.md"
    headline = proofreport.write(recipe, out, runs, checks, report, command=command_line(args), python=args.python)
    print(headline)
    print(f"prove: report: {report}")
    return 0 if headline == proofreport.ALL_PASSED else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", metavar="RECIPE_DIR", help="the recipe folder holding proof.toml")
    p.add_argument("--out", required=True, help="where runs, archives, caches and the report go")
    p.add_argument(
        "--runs",
        help="comma-separated runs to (re-)run, by exact name (a repeated run's repetitions are <name>_2, "
        "<name>_3 ...: name each one to run); the others keep what --out holds",
    )
    p.add_argument("--report", help="also write REPORT.md here (default: only <out>/REPORT.md)")
    p.add_argument("--python", default=sys.executable, help="the interpreter for {python} (default: this one)")
    p.add_argument("--keep-going", action="store_true", help="run the remaining runs after a failed one")
    p.add_argument("--check-only", action="store_true", help="run nothing: re-check what --out holds")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `prove` subcommand to `python -m gptools`."""
    p = subparsers.add_parser(
        "prove", help="run a recipe's proof (proof.toml), check it, write REPORT.md", description=DESCRIPTION
    )
    add_arguments(p)
    p.set_defaults(func=_cmd_prove)


def command_line(args: argparse.Namespace) -> str:
    """The invocation, rebuilt from the parsed arguments (for the report: how to run it again)."""
    words = ["python", "-m", "gptools", "prove", args.recipe, "--out", args.out]
    for flag in ("runs", "report"):
        if getattr(args, flag):
            words += [f"--{flag}", getattr(args, flag)]
    if args.python != sys.executable:
        words += ["--python", args.python]
    words += [f"--{f.replace('_', '-')}" for f in ("keep_going", "check_only") if getattr(args, f)]
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    """`python -m gptools.prove`: the same command without the other subcommands' imports (for a GPU host)."""
    parser = argparse.ArgumentParser(prog="python -m gptools.prove", description=DESCRIPTION)
    add_arguments(parser)
    try:
        return _cmd_prove(parser.parse_args(argv))
    except KeyboardInterrupt:
        print("gptools prove: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
