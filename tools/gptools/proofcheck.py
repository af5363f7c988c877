"""The checks of `python -m gptools prove`, computed from what the runs left in --out (so --check-only can redo them).

Every check is pass, FAIL or "not run" (a run it needs has not run). Data a check needs but cannot find makes it
FAIL with "not measured: ...": a proof never passes on missing evidence. Targets and the comparison of runs with
`compare_outputs = false` are computed here too, but they are statements for the report, not checks (a target over
a run proof.toml repeats reads the median of its repetitions). A run with
`expect_refusal = true` gets one check of its own, "<run> refused", instead of LOAD's checks and the clean-log check.
A persistence run whose driver counts the processes that ran its script (`script_runs`) must count as many as the
first persistence-off run ("<run> runs the script as upstream"). Runs are compared only within their output group
(proof.toml `outputs`, gptools.prove's docstring): a run of another model never meets the main group's runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptools import jsonfile, proofkit
from gptools.proofrecipe import MAIN_OUTPUTS, Recipe, RunSpec

PASS, FAIL, NOT_RUN = "pass", "FAIL", "not run"
LOG_TAIL_LINES = 20
INSPECT_TIMEOUT_S = 600
DIFF_TIMEOUT_S = 300.0  # two archives' graph packs read and compared word by word
UNACCOUNTED_MAX = 0.05  # of start to ready: the phase table must explain where start-up time goes


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


@dataclass
class RunData:
    """What one run left in `<out>/<run>/`: run.json (None: it has not run), result.json, stats and its log."""

    spec: RunSpec
    dir: Path
    record: dict[str, Any] | None
    result: dict[str, Any] | None
    result_problem: str | None
    stats: list[dict[str, Any]]
    stats_problem: str | None
    foreign: str | None = None  # the recipe whose run of the same name the folder holds (then it counts as not run)

    @property
    def ran(self) -> bool:
        return self.record is not None and self.foreign is None

    @property
    def log(self) -> Path:
        return self.dir / "log.txt"

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines() if self.log.is_file() else []

    def problem(self) -> str | None:
        """Why this run did not finish; None when it did."""
        if not self.ran:
            return self.not_run()
        assert self.record is not None
        return run_problem(self.record, (self.result, self.result_problem))

    def not_run(self) -> str:
        return f"not run (its folder holds a run of {self.foreign})" if self.foreign else "not run"


def load_result(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """result.json, or None and why it cannot be used."""
    try:
        data = jsonfile.load(path)
    except FileNotFoundError:
        return None, "the driver wrote no result.json"
    except (OSError, ValueError) as exc:
        return None, f"result.json is not valid JSON: {exc}"
    if not isinstance(data, dict):
        return None, "result.json is not a JSON object"
    return data, None


def load_run(spec: RunSpec, out: Path, recipe_dir: Path | None = None) -> RunData:
    """What `<out>/<run>` holds. With `recipe_dir`, a folder that another recipe's run of the same name wrote (two
    recipes sharing one --out for their warm caches) counts as not run, so one recipe's report never checks the
    other's outputs. A recipe is known by its folder's name: the same recipe in another checkout is the same."""
    run_dir = out / spec.name
    try:
        record = jsonfile.load(run_dir / "run.json")
    except (OSError, ValueError):
        record = None
    owner = record.get("recipe") if isinstance(record, dict) else None
    foreign = owner if recipe_dir is not None and owner not in (None, recipe_dir.resolve().name) else None
    result, result_problem = load_result(run_dir / "result.json")
    try:
        stats, stats_problem = proofkit.read_stats(run_dir / "stats"), None
    except ValueError as exc:
        stats, stats_problem = [], str(exc)
    return RunData(spec, run_dir, record, result, result_problem, stats, stats_problem, foreign)


# A line that says why an engine stopped: the runtime's refusals and Python's exception lines.
_REASON = re.compile(r"(graphpersist[^\n]*(refused|cannot)|\b[A-Z]\w*(Error|Refused|Exception): )")


def last_reason(log: Path, limit: int = 300) -> str | None:
    """The log's last line that says why something stopped, shortened: a run SIGKILLed by its engine (SGLang kills
    its process tree when a scheduler raises) leaves no result.json, only its log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if _REASON.search(line):
            line = line.strip()
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return None


def run_problem(record: dict[str, Any], loaded: tuple[dict[str, Any] | None, str | None]) -> str | None:
    """Why a run did not finish (exit status, timeout, result.json), or None."""
    result, result_problem = loaded
    code = record.get("exit_code")
    if record.get("timed_out"):
        return f"timed out after {record.get('timeout_s', 0):g} s (process group ended)"
    if code is None:
        return f"the driver could not be started: {record.get('start_error')}"
    if code != 0:
        why = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        return why + (f": {result.get('error')}" if result and result.get("error") else "")
    if result is None:
        return result_problem
    if result.get("ok") is not True:
        return f"result.json says ok={result.get('ok')!r}: {result.get('error')}"
    return None


def evaluate(recipe: Recipe, out: Path, runs: dict[str, RunData], python: str) -> list[Check]:
    """Every check, in the report's order: runs finished, outputs, archives, LOAD's graphs / captures / JIT, logs."""
    checks = [check_finished(data) for data in runs.values()]
    checks += [check_outputs(runs, group) for group in output_groups(runs)]
    checks += check_archives(recipe, out, runs, python)
    for spec in recipe.runs:
        if spec.mode == "load" and not spec.expect_refusal:
            load = runs[spec.name]
            checks += [check_restored(recipe, runs, load), check_no_capture(load), check_no_jit(load)]
            checks += check_kernel_choices(load) + check_compiled_model(load)
    checks += check_unaccounted(recipe, runs)
    checks += check_script_runs(runs)
    checks += [
        check_refused(data)
        if data.spec.expect_refusal
        else check_log(data, recipe.error_patterns, recipe.ignore_patterns)
        for data in runs.values()
    ]
    return checks


# ------------------------------------------------------------------------------------------- runs and outputs


def check_finished(data: RunData) -> Check:
    name = f"{data.spec.name} finished"
    if not data.ran:
        return Check(name, NOT_RUN, data.not_run())
    problem = data.problem()
    wall = f"{data.record.get('wall_s', 0):.1f} s" if data.record else ""
    if problem is None:
        return Check(name, PASS, f"exit 0 in {wall}")
    if data.result is None and (reason := last_reason(data.dir / "log.txt")):
        problem += f"; the log's last reason: {reason}"
    return Check(name, FAIL, problem)


def _tokens(seq: list[Any], at: int) -> str:
    """A token list shortened around position `at`."""
    lo = max(0, at - 3)
    shown = ", ".join(str(t) for t in seq[lo : at + 5])
    return f"[{'…, ' if lo else ''}{shown}{', …' if at + 5 < len(seq) else ''}] ({len(seq)} tokens)"


def first_difference(ref_name: str, ref: dict[str, Any], name: str, other: dict[str, Any]) -> str | None:
    """Where two runs' outputs first differ (workload, sequence index, token), or None when identical."""
    for workload in [*ref, *(w for w in other if w not in ref)]:
        if workload not in ref or workload not in other:
            return f"{workload}: only {ref_name if workload in ref else name} has it"
        a, b = ref[workload], other[workload]
        if not isinstance(a, list) or not isinstance(b, list):
            return f"{workload}: not a list of token lists"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                if not isinstance(x, list) or not isinstance(y, list):
                    return f"{workload}[{i}]: {ref_name} {x!r} vs {name} {y!r}"
                at = next((j for j, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
                return f"{workload}[{i}] (token {at}): {ref_name} {_tokens(x, at)} vs {name} {_tokens(y, at)}"
        if len(a) != len(b):
            return f"{workload}: {ref_name} has {len(a)} sequences, {name} {len(b)}"
    return None


def _outputs(data: RunData) -> dict[str, Any] | None:
    outputs = (data.result or {}).get("outputs")
    return outputs if isinstance(outputs, dict) and outputs else None


def output_groups(runs: dict[str, RunData]) -> list[str]:
    """The output groups of proof.toml's runs in first-seen order, the main group first (it always has its check)."""
    groups = [MAIN_OUTPUTS]
    groups += [g for g in dict.fromkeys(d.spec.outputs for d in runs.values()) if g != MAIN_OUTPUTS]
    return groups


def check_outputs(runs: dict[str, RunData], group: str = MAIN_OUTPUTS) -> Check:
    """The group's compared runs gave identical tokens; the main group's check keeps its name of old."""
    name = "outputs identical" if group == MAIN_OUTPUTS else f"outputs identical ({group})"
    compared = [d for d in runs.values() if d.spec.compare_outputs and d.spec.outputs == group]
    ran = [d for d in compared if d.ran]
    if len(ran) < 2:
        return Check(name, NOT_RUN, f"needs 2 runs with compare_outputs; ran: {', '.join(d.spec.name for d in ran)}")
    if missing := [d.spec.name for d in ran if _outputs(d) is None]:
        return Check(name, FAIL, f"not measured: no outputs from {', '.join(missing)}")
    ref = ran[0]
    for data in ran[1:]:
        diff = first_difference(ref.spec.name, _outputs(ref) or {}, data.spec.name, _outputs(data) or {})
        if diff:
            return Check(name, FAIL, f"{data.spec.name} differs from {ref.spec.name} at {diff}")
    workloads = ", ".join(_outputs(ref) or {})
    skipped = [d.spec.name for d in compared if not d.ran]
    return Check(
        name,
        PASS,
        f"{len(ran)} runs identical in {workloads}" + (f"; not run: {', '.join(skipped)}" if skipped else ""),
    )


def informational(runs: dict[str, RunData]) -> list[dict[str, str]]:
    """Runs with compare_outputs = false against their group's first compared run: a statement, not a check."""
    notes = []
    for data in runs.values():
        if data.spec.compare_outputs or data.spec.expect_refusal or not data.ran:
            continue
        group = data.spec.outputs
        ref = next((d for d in runs.values() if d.spec.compare_outputs and d.spec.outputs == group and _outputs(d)),
                   None)  # fmt: skip
        if ref is None or _outputs(data) is None:
            text = "not compared: " + ("no reference run with outputs" if ref is None else "it has no outputs")
        else:
            diff = first_difference(ref.spec.name, _outputs(ref) or {}, data.spec.name, _outputs(data) or {})
            text = "identical" if diff is None else f"differs at {diff}"
        notes.append({"run": data.spec.name, "reference": ref.spec.name if ref else "", "comparison": text})
    return notes


# ------------------------------------------------------------------------------------------- archives


def archive_projection(doc: dict[str, Any]) -> dict[str, Any]:
    """What two SAVEs of one configuration must agree on, from `graphpersist inspect --json`: world facts, and
    per rank region, pointer inventory, graphs (topology, node count), image hashes and phase anchors."""
    manifest = doc["manifest"]
    ranks = {}
    for rank, rec in doc["ranks"].items():
        entry = {
            "region": {k: rec["region"][k] for k in ("base", "size", "final_offset")},
            "pointers": {k: rec["pointers"][k] for k in ("fingerprint", "count")},
            "graphs": {
                g["name"]: {"topology_fingerprint": g["topology_fingerprint"], "node_count": g["node_count"]}
                for g in rec["graphs"]
            },
            "images": sorted(im["sha256"] for im in rec["images"]),
        }
        if phases := rec.get("extra", {}).get("phases"):
            entry["phase_anchors"] = [{"name": p["name"], "start": p["start"]} for p in phases]
        ranks[rank] = entry
    return {
        "format_version": manifest["format_version"],
        "world": manifest["world"],
        "ranks": manifest["ranks"],
        "rank": ranks,
    }


def differences(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """Dotted paths where two JSON values differ, with both values (shortened)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            shown = json.dumps(str(key))[1:-1]  # an archive's key, escaped as JSON escapes it: the report shows it
            sub = f"{path}.{shown}" if path else shown
            if key not in a or key not in b:
                yield f"{sub}: only in {'first' if key in a else 'second'}"
            else:
                yield from differences(a[key], b[key], sub)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from differences(x, y, f"{path}[{i}]")
    elif a != b:
        yield f"{path}: {_short(a)} vs {_short(b)}"


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def run_graphpersist(python: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | str:
    """`<python> -m graphpersist ARGS` (the engine host's graphpersist reads its own archives), or why it could not
    run."""
    try:
        return subprocess.run([python, "-m", "graphpersist", *args], capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ))  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)


def inspect_archive(path: Path, python: str) -> tuple[dict[str, Any] | None, str]:
    """`<python> -m graphpersist inspect DIR --json`."""
    proc = run_graphpersist(python, ["inspect", str(path), "--json"], INSPECT_TIMEOUT_S)
    if isinstance(proc, str):
        return None, f"graphpersist inspect {path}: {proc}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"graphpersist inspect {path} failed (exit {proc.returncode}): {last}"
    try:
        return json.loads(proc.stdout), ""
    except ValueError as exc:
        return None, f"graphpersist inspect {path} printed no JSON: {exc}"


def write_graph_diff(recipe: Recipe, out: Path, first: str, second: str, python: str) -> str:
    """`<python> -m graphpersist diff` of two archives (which graph, kernel and parameter word differ) into
    `<out>/archives-<first>-<second>.diff.txt`; returns the file's name."""
    target = out / f"archives-{first}-{second}.diff.txt"
    args = ["diff", str(recipe.archive_path(out, first)), str(recipe.archive_path(out, second))]
    proc = run_graphpersist(python, args, DIFF_TIMEOUT_S)
    if isinstance(proc, str):
        text = f"graphpersist diff could not run: {proc}\n"
    else:
        failed = "" if proc.returncode in (0, 1) else f"graphpersist diff failed (exit {proc.returncode})\n"
        text = proc.stdout + proc.stderr + failed
    target.write_text(text)
    return target.name


def archive_writers(recipe: Recipe) -> dict[str, RunSpec]:
    """Archive name -> the save run that writes it last, in first-seen order."""
    writers: dict[str, RunSpec] = {}
    for spec in recipe.runs:
        if spec.mode == "save" and spec.archive:
            writers[spec.archive] = spec
    return writers


def check_archives(recipe: Recipe, out: Path, runs: dict[str, RunData], python: str) -> list[Check]:
    """`archives <first> = <other>`: each archive against the first one its output group's save runs write (another
    model's archives hold other graphs)."""
    writers = archive_writers(recipe)
    groups: dict[str, list[str]] = {}
    for archive, spec in writers.items():
        groups.setdefault(spec.outputs, []).append(archive)
    checks = []
    for names in groups.values():
        checks += _compare_archives(recipe, out, runs, python, {name: writers[name] for name in names})
    return checks


def _compare_archives(
    recipe: Recipe, out: Path, runs: dict[str, RunData], python: str, writers: dict[str, RunSpec]
) -> list[Check]:
    """One group's archives, each against its first."""
    names = list(writers)
    seen: dict[str, tuple[dict[str, Any] | None, str]] = {}
    checks = []
    for other in names[1:]:
        name = f"archives {names[0]} = {other}"
        pair = [runs[writers[names[0]].name], runs[writers[other].name]]
        if not_run := [d.spec.name for d in pair if not d.ran]:
            checks.append(Check(name, NOT_RUN, f"needs {', '.join(not_run)}"))
            continue
        if failed := [d.spec.name for d in pair if d.problem()]:
            checks.append(Check(name, FAIL, f"not measured: {', '.join(failed)} did not finish"))
            continue
        docs = []
        for archive in (names[0], other):
            if archive not in seen:
                seen[archive] = inspect_archive(recipe.archive_path(out, archive), python)
            docs.append(seen[archive])
        if bad := [why for doc, why in docs if doc is None]:
            checks.append(Check(name, FAIL, f"not measured: {bad[0]}"))
            continue
        try:
            first, second = (archive_projection(doc) for doc, _ in docs if doc is not None)
        except (KeyError, TypeError) as exc:
            checks.append(Check(name, FAIL, f"not measured: inspect --json lacks {exc}"))
            continue
        diffs = list(differences(first, second))
        if diffs:
            more = f" (+{len(diffs) - 5} more)" if len(diffs) > 5 else ""
            details = write_graph_diff(recipe, out, names[0], other, python)
            checks.append(Check(name, FAIL, f"{len(diffs)} field(s) differ: " + "; ".join(diffs[:5]) + more +
                                f"; graph by graph: {details}"))  # fmt: skip
        else:
            ranks = first["rank"].values()
            equal = "world facts, region, pointers, graphs, images" + (
                " and phase anchors" if all("phase_anchors" in r for r in ranks) else ""
            )
            graphs = [len(r["graphs"]) for r in ranks]
            checks.append(Check(name, PASS, f"{len(graphs)} rank(s), graphs per rank {graphs}: {equal} equal"))
    return checks


# ------------------------------------------------------------------------------------------- LOAD runs


def _writer_of(recipe: Recipe, load: RunSpec) -> RunSpec | None:
    """The save run whose archive this load reads: the last one before it, else the last one at all."""
    at = recipe.runs.index(load)
    saves = [(i, s) for i, s in enumerate(recipe.runs) if s.mode == "save" and s.archive == load.archive]
    before = [s for i, s in saves if i < at]
    return (before or [s for _, s in saves] or [None])[-1]


def _stats_problem(data: RunData) -> str | None:
    if data.stats_problem:
        return f"not measured: {data.stats_problem}"
    if not data.stats:
        return f"not measured: no stats files in {data.dir / 'stats'} (did the engine run with persistence?)"
    return None


def _ints(stats: list[dict[str, Any]], key: str) -> dict[int, int] | None:
    values = {s["rank"]: s.get(key) for s in stats}
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in values.values())
    return values if ok else None  # type: ignore[return-value]


def check_restored(recipe: Recipe, runs: dict[str, RunData], load: RunData) -> Check:
    name = f"{load.spec.name} restored every graph"
    writer = _writer_of(recipe, load.spec)
    if not load.ran:
        return Check(name, NOT_RUN, "not run")
    if writer is None:
        return Check(name, FAIL, f"not measured: no save run of proof.toml writes archive {load.spec.archive}")
    save = runs[writer.name]
    if not save.ran:
        return Check(name, NOT_RUN, f"needs {writer.name}")
    for data in (load, save):
        if problem := _stats_problem(data):
            return Check(name, FAIL, f"{data.spec.name}: {problem}")
    for data, mode in ((load, "load"), (save, "save")):
        if wrong := [s["rank"] for s in data.stats if s.get("mode") != mode]:
            return Check(name, FAIL, f"{data.spec.name}: stats of rank(s) {wrong} do not say mode {mode!r}")
    restored, captured = _ints(load.stats, "restored"), _ints(save.stats, "captured")
    if restored is None or captured is None:
        which = f"{load.spec.name} restored" if restored is None else f"{writer.name} captured"
        return Check(name, FAIL, f"not measured: {which} is not an integer on every rank")
    if set(restored) != set(captured):
        return Check(name, FAIL, f"ranks differ: {load.spec.name} {sorted(restored)}, {writer.name} {sorted(captured)}")
    if not any(captured.values()):
        return Check(name, FAIL, f"{writer.name} captured no graph (captured {list(captured.values())})")
    short = [f"rank {r}: {restored[r]} of {captured[r]}" for r in sorted(captured) if restored[r] != captured[r]]
    if short:
        return Check(name, FAIL, f"restored != captured by {writer.name}: " + ", ".join(short))
    per_rank = [captured[r] for r in sorted(captured)]
    return Check(name, PASS, f"restored = captured by {writer.name} per rank: {per_rank}")


def check_no_capture(load: RunData) -> Check:
    name = f"{load.spec.name} captured nothing"
    if not load.ran:
        return Check(name, NOT_RUN, "not run")
    if problem := _stats_problem(load):
        return Check(name, FAIL, problem)
    calls = _ints(load.stats, "capture_calls")
    if calls is None:
        return Check(name, FAIL, "not measured: capture_calls is not an integer on every rank")
    per_rank = [calls[r] for r in sorted(calls)]
    return Check(name, PASS if not any(per_rank) else FAIL, f"capture calls per rank {per_rank}")


def check_kernel_choices(load: RunData) -> list[Check]:
    """LOAD launched SAVE's timed kernel configs and timed none itself (graphpersist.graph.kernelchoice), as far as its
    start went. Only for engines whose stats count the choices (vLLM); SGLang's recipes compile nothing with Inductor.
    """
    name = f"{load.spec.name} timed no kernel choice"
    if not load.ran or _stats_problem(load) or not any("kernel_choices" in s for s in load.stats):
        return []
    counts = {s["rank"]: s.get("kernel_choices") for s in load.stats}
    if not all(isinstance(c, dict) for c in counts.values()):
        return [Check(name, FAIL, f"not measured: kernel_choices is not a count table on every rank: {counts}")]
    timed = [int(counts[r].get("timed", 0)) for r in sorted(counts)]
    pinned = [int(counts[r].get("pinned", 0)) for r in sorted(counts)]
    detail = f"timed per rank {timed}, launched SAVE's choice per rank {pinned}"
    return [Check(name, PASS if not any(timed) else FAIL, detail)]


def check_compiled_model(load: RunData) -> list[Check]:
    """LOAD built every compiled model from SAVE's notes, not by the engine's own load (vLLM's Dynamo graph unpickled
    and split again: overlays/vllm/vllm/graphpersist_compiled.py). Only for stats that report it (vLLM's)."""
    name = f"{load.spec.name} built the compiled model from SAVE's notes"
    if not load.ran or _stats_problem(load) or not any("compiled_model" in s for s in load.stats):
        return []
    models = {s["rank"]: s.get("compiled_model") for s in load.stats}
    if not all(isinstance(m, dict) and m and all(isinstance(v, dict) for v in m.values()) for m in models.values()):
        return [Check(name, FAIL, f"not measured: compiled_model is not a table of models on every rank: {models}")]
    built = {r: {p: v.get("built_from_notes") is True for p, v in models[r].items()} for r in sorted(models)}
    seconds = {r: {p: v.get("s") for p, v in models[r].items()} for r in sorted(models)}
    ok = all(all(b.values()) for b in built.values())
    why = {r: {p: v.get("why_not") for p, v in models[r].items() if v.get("why_not")} for r in sorted(models)}
    detail = f"built from notes per rank {built}, seconds {seconds}" + ("" if ok else f"; why not: {why}")
    return [Check(name, PASS if ok else FAIL, detail)]


def check_no_jit(load: RunData) -> Check:
    name = f"{load.spec.name} no new JIT files"
    if not load.ran:
        return Check(name, NOT_RUN, "not run")
    jit = (load.result or {}).get("jit")
    keys = ("new_cache_files_start", "new_cache_files_first_request")
    if not isinstance(jit, dict) or not all(isinstance(jit.get(k), int) for k in keys):
        return Check(name, FAIL, f"not measured: result.json has no jit.{keys[0]} / jit.{keys[1]}")
    counts = f"start {jit[keys[0]]}, first request {jit[keys[1]]}"
    if jit[keys[0]] or jit[keys[1]]:
        examples = ", ".join(str(e) for e in (jit.get("examples") or [])[:3])
        return Check(name, FAIL, f"new cache files: {counts}" + (f"; e.g. {examples}" if examples else ""))
    return Check(name, PASS, f"new cache files: {counts}")


# ------------------------------------------------------------------------------------------- logs


def error_lines(lines: list[str], patterns: tuple[str, ...], ignore: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line number, line) of each line matching an error pattern and no ignore pattern."""
    errors = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
    skip = re.compile("|".join(f"(?:{p})" for p in ignore)) if ignore else None
    return [
        (i, line)
        for i, line in enumerate(lines, 1)
        if errors and errors.search(line) and not (skip and skip.search(line))
    ]


def check_log(data: RunData, patterns: tuple[str, ...], ignore: tuple[str, ...]) -> Check:
    name = f"{data.spec.name} log clean"
    if not data.ran:
        return Check(name, NOT_RUN, "not run")
    if not data.log.is_file():
        return Check(name, FAIL, f"not measured: no log at {data.log}")
    lines = data.log_lines()
    hits = error_lines(lines, patterns, ignore)
    if not hits:
        return Check(name, PASS, f"no error pattern in {len(lines)} line(s)")
    quoted = "; ".join(f"line {i}: {line.strip()[:120]}" for i, line in hits[:3])
    return Check(name, FAIL, f"{len(hits)} error line(s): {quoted}")


def check_refused(data: RunData) -> Check:
    """A run with expect_refusal: the driver found the refusal, and the line it quotes is in the run's log."""
    name = f"{data.spec.name} refused"
    if not data.ran:
        return Check(name, NOT_RUN, "not run")
    if problem := data.problem():
        return Check(name, FAIL, f"not measured: {problem}")
    refusal = (data.result or {}).get("refusal")
    matched = refusal.get("matched") if isinstance(refusal, dict) else None
    if not isinstance(matched, str) or not matched.strip():
        return Check(name, FAIL, "not measured: result.json has no refusal.matched (the line that shows the reason)")
    if not any(matched.strip() in line for line in data.log_lines()):
        return Check(name, FAIL, f"result.json quotes a line that is not in {data.log}: {matched.strip()[:120]}")
    raised = refusal.get("raised_type")  # what the engine's start raised in the driver (drivers since issue 43)
    if raised is None:
        return Check(name, PASS, matched.strip()[:200])
    if not str(raised).startswith("graphpersist."):
        return Check(name, FAIL, f"the driver's engine start raised {raised}, not the runtime's refusal (the engine "
                     f"did not hand it back); the log has it: {matched.strip()[:120]}")  # fmt: skip
    said = refusal.get("first_mismatch") or matched.strip()
    return Check(name, PASS, f"{str(raised).rsplit('.', 1)[-1]} in the driver: {said[:200]}")


def check_script_runs(runs: dict[str, RunData]) -> list[Check]:
    """Every persistence run whose driver counts how many processes ran its script (result.json `script_runs`,
    proofkit.note_script_run) ran it in as many as its output group's first persistence-off run: an engine under
    persistence runs a user's script as often as upstream does (vLLM: once; spawning its engine core must not run it
    again)."""
    counted = {n: d for n, d in runs.items() if d.ran and isinstance((d.result or {}).get("script_runs"), int)}
    checks = []
    for name, data in counted.items():
        if data.spec.mode == "off" or data.spec.expect_refusal:
            continue
        base = next((d for d in counted.values() if d.spec.mode == "off" and d.spec.outputs == data.spec.outputs), None)
        check = f"{name} runs the script as upstream"
        got = int((data.result or {})["script_runs"])
        if base is None:
            group = "" if data.spec.outputs == MAIN_OUTPUTS else f" of output group {data.spec.outputs}"
            detail = f"{got} process(es) ran the script; no persistence-off run{group} counted"
            checks.append(Check(check, NOT_RUN, detail))
            continue
        want = int((base.result or {})["script_runs"])
        what = f"{got} process(es) ran the driver's script, {base.spec.name} {want}"
        checks.append(Check(check, PASS if got == want else FAIL, what))
    return checks


# ------------------------------------------------------------------------------------------- phases


def phase_accounting(result: dict[str, Any] | None, residual: tuple[str, ...]) -> dict[str, Any] | None:
    """Where a run's start-up time went: its measured phases, the remainders the driver computed (`residual`), and
    `unaccounted` = start to ready minus the measured phases (remainders included, so a remainder hides nothing).
    None when the run reported no start-up time or no phases."""
    total, phases = (result or {}).get("start_to_ready_s"), (result or {}).get("phases")
    if not isinstance(total, int | float) or isinstance(total, bool) or not isinstance(phases, dict) or not phases:
        return None
    seconds = {k: float(v) for k, v in phases.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    measured = {k: v for k, v in seconds.items() if k not in residual}
    unaccounted = float(total) - sum(measured.values())
    return {
        "start_to_ready_s": float(total),
        "measured": measured,
        "residual": {k: v for k, v in seconds.items() if k in residual},
        "unaccounted_s": unaccounted,
        "unaccounted_share": unaccounted / total if total > 0 else math.inf,
    }


def phase_check_runs(recipe: Recipe) -> list[RunSpec]:
    """The runs whose unaccounted time is checked, as proof.toml's `phase_check` names them (opt-in: a recipe whose
    driver reports no phases, or phases that need not add up, has no such check)."""
    return [r for r in recipe.runs if r.name in recipe.phase_check]


def check_unaccounted(recipe: Recipe, runs: dict[str, RunData]) -> list[Check]:
    """`<run> unaccounted <= 5 %`: a phase table that leaves more of the start-up unexplained fails, and so do phases
    adding up to more than start to ready by as much (time counted twice). A run without phases is not measured."""
    checks: list[Check] = []
    if recipe.phase_check_stated:
        return checks  # a Targets row instead (evaluate_targets)
    limit = f"{UNACCOUNTED_MAX:.0%}".replace("%", " %")
    for spec in phase_check_runs(recipe):
        data, name = runs[spec.name], f"{spec.name} unaccounted <= {limit}"
        if not data.ran or data.result is None:
            checks.append(
                Check(
                    name,
                    NOT_RUN if not data.ran else FAIL,
                    data.not_run() if not data.ran else f"not measured: {data.problem() or 'no result.json'}",
                )
            )
            continue
        acc = phase_accounting(data.result, recipe.residual_phases)
        if acc is None:
            checks.append(
                Check(
                    name,
                    FAIL,
                    "not measured: result.json has no start_to_ready_s or no phases; the "
                    "driver must report its start-up phases",
                )
            )
            continue
        share, total = acc["unaccounted_share"], acc["start_to_ready_s"]
        detail = (
            f"unaccounted {acc['unaccounted_s']:.3f} s of {total:.3f} s start to ready ({share:.1%}); measured "
            f"phases: {', '.join(acc['measured']) or 'none'}"
        )
        if acc["residual"]:
            detail += f"; remainders counted as unaccounted: {', '.join(acc['residual'])}"
        if abs(share) <= UNACCOUNTED_MAX:
            checks.append(Check(name, PASS, detail))
            continue
        fix = (
            "the phases add up to more than start to ready: one is counted twice, or overlaps another; time them "
            "apart in the driver"
            if share < 0
            else "time the missing part of the start-up as a phase of its own in the driver"
        )
        checks.append(Check(name, FAIL, f"{detail}; {fix}"))
    return checks


# ------------------------------------------------------------------------------------------- targets


def metric(runs: dict[str, RunData], path: str) -> tuple[float | None, str]:
    """`run.name` (start_to_ready_s, then latency.name, then phases.name) or `run.a.b` (a path in result.json)."""
    run, _, rest = path.partition(".")
    data = runs[run]
    if not data.ran or data.result is None:
        return None, f"{run} has no result"
    if "." in rest:
        candidates = [_walk(data.result, rest.split("."))]
    else:
        candidates = [data.result.get(rest)] + [_walk(data.result, [part, rest]) for part in ("latency", "phases")]
    for value in candidates:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value), ""
    return None, f"{path} not in result.json"


def _walk(data: Any, keys: list[str]) -> Any:
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def target_metric(recipe: Recipe, runs: dict[str, RunData], path: str) -> tuple[float | None, str]:
    """`metric`, and how the Targets row states it (the value, or why there is none); for a run proof.toml repeats,
    the median over the repetitions that have the value, naming those that have none (one start can be slow)."""
    run, _, rest = path.partition(".")
    reps = recipe.repetitions(run)
    if len(reps) == 1:
        value, why = metric(runs, path)
        return value, why if value is None else f"{value:.4g}"
    got: dict[str, float] = {}
    no_result: list[str] = []
    other: list[str] = []
    for spec in reps:
        data = runs[spec.name]
        if not data.ran or data.result is None:
            no_result.append(spec.name)
            continue
        value, why = metric(runs, f"{spec.name}.{rest}")
        if value is None:
            other.append(why)
        else:
            got[spec.name] = value
    if no_result:
        other.insert(0, f"{', '.join(no_result)} {'has' if len(no_result) == 1 else 'have'} no result")
    lacking = "; ".join(other)
    if not got:
        return None, lacking
    values = ", ".join(f"{v:.4g}" for v in got.values()) + (f"; {lacking}" if lacking else "")
    return statistics.median(got.values()), f"median of {len(got)} ({values})"


def evaluate_targets(recipe: Recipe, runs: dict[str, RunData]) -> list[dict[str, Any]]:
    rows = []
    for t in recipe.targets:
        bounds = (f">= {t.min:g}" if t.min is not None else "", f"<= {t.max:g}" if t.max is not None else "")
        bound = " and ".join(b for b in bounds if b)
        num, num_text = target_metric(recipe, runs, t.num)
        den, den_text = target_metric(recipe, runs, t.den) if t.den else (1.0, "")
        row: dict[str, Any] = {"name": t.name, "num": t.num, "den": t.den, "bound": bound, "value": None}
        if num is None or den is None or den == 0:
            why = num_text if num is None else den_text if den is None else f"{t.den} is 0"
            row.update(status="not measured", detail=why)
        else:
            value = num / den
            met = (t.min is None or value >= t.min) and (t.max is None or value <= t.max)
            detail = f"{num_text} / {den_text}" if t.den else num_text
            row.update(value=value, status="met" if met else "NOT met", detail=detail)
        rows.append(row)
    if recipe.phase_check_stated:
        rows += [_unaccounted_row(recipe, runs, spec) for spec in phase_check_runs(recipe)]
    return rows


def _unaccounted_row(recipe: Recipe, runs: dict[str, RunData], spec: RunSpec) -> dict[str, Any]:
    """The stated form of `<run> unaccounted <= 5 %`: unaccounted start-up / start to ready."""
    name = f"{spec.name}: unaccounted start-up / start to ready"
    row: dict[str, Any] = {"name": name, "num": f"{spec.name} unaccounted", "den": f"{spec.name}.start_to_ready_s",
                           "bound": f"<= {UNACCOUNTED_MAX:g}", "value": None}  # fmt: skip
    data = runs[spec.name]
    acc = phase_accounting(data.result, recipe.residual_phases) if data.ran else None
    if acc is None:
        row.update(status="not measured", detail=f"{spec.name} reported no start-up phases")
        return row
    share = acc["unaccounted_share"]
    row.update(value=share, status="met" if abs(share) <= UNACCOUNTED_MAX else "NOT met",
               detail=f"{acc['unaccounted_s']:.4g} / {acc['start_to_ready_s']:.4g}")  # fmt: skip
    return row
