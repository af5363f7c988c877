"""REPORT.md, report.json and phases.png of `python -m gptools prove`: what the checks found, for people and machines.

REPORT.md's first line is exactly `all checks passed` or `FAILED: <check>, <check>, ...` (every check that did not
pass, "not run" included: a partial proof is not a passed one). Versions are probed with the --python interpreter,
the one the engines ran under; the chart needs matplotlib in the runner's Python and is left out, saying so,
without it.
"""

from __future__ import annotations

import colorsys
import dataclasses
import json
import platform
import shutil
import socket
import subprocess
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gptools import jsonfile, proofcheck
from gptools.proofcheck import Check, RunData
from gptools.proofrecipe import Recipe

ALL_PASSED = "all checks passed"
SHOWN_LOG_LINES = 8
CHART = "phases.png"
REPORT_JSON = "report.json.gz"  # read it with gptools.jsonfile.load (or zcat)
# Run with --python: the versions the engines saw (torch is optional: a CPU test host has none).
VERSION_PROBE = """
import json, platform
facts = {"python": platform.python_version()}
for name in ("torch", "graphpersist"):
    try:
        mod = __import__(name)
        facts[name] = mod.__version__ + (f" (CUDA {mod.version.cuda})" if name == "torch" else "")
    except Exception as exc:
        facts[name] = f"not importable ({type(exc).__name__})"
print(json.dumps(facts))
"""


def headline(checks: list[Check]) -> str:
    failed = [c.name for c in checks if c.status != proofcheck.PASS]
    return "FAILED: " + ", ".join(failed) if failed else ALL_PASSED


def host_facts(python: str) -> dict[str, str]:
    """Host name, GPUs and driver (nvidia-smi, when there is one), and the versions --python sees."""
    facts = {"host": socket.gethostname(), "gpus": "none found (no nvidia-smi)", "driver": "-"}
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        try:
            smi = subprocess.run(query, capture_output=True, text=True, timeout=60)
            rows = [[f.strip() for f in line.split(",")] for line in smi.stdout.splitlines() if "," in line]
            facts["gpus"] = "; ".join(r[0] for r in rows) or f"nvidia-smi failed: {smi.stderr.strip()[:200]}"
            facts["driver"] = ", ".join(sorted({r[1] for r in rows})) or "-"
        except (OSError, subprocess.TimeoutExpired) as exc:
            facts["gpus"] = f"nvidia-smi failed: {exc}"
    try:
        probe = subprocess.run([python, "-c", VERSION_PROBE], capture_output=True, text=True, timeout=300)
        facts |= json.loads(probe.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        facts["python"] = f"{python}: version probe failed ({exc})"
    return facts


def _engines(runs: dict[str, RunData]) -> str:
    seen = []
    for data in runs.values():
        engine = (data.result or {}).get("engine") or {}
        text = f"{engine.get('name', '?')} {engine.get('version', '?')}" if engine else ""
        if text and text not in seen:
            seen.append(text)
    return ", ".join(seen) or "not reported"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"
    return str(value).replace("|", "\\|").replace("\n", " / ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def _keys(runs: dict[str, RunData], field: str) -> list[str]:
    """Every key of result[field] seen in any run, in first-seen order."""
    keys: list[str] = []
    for data in runs.values():
        values = (data.result or {}).get(field)
        keys += [k for k in values if k not in keys] if isinstance(values, dict) else []
    return keys


def _section(result: dict[str, Any] | None, field: str) -> dict[str, Any]:
    values = (result or {}).get(field)
    return values if isinstance(values, dict) else {}


def timing_rows(runs: dict[str, RunData], phases: list[str]) -> list[list[Any]]:
    rows = []
    for name, data in runs.items():
        if data.ran:
            result = data.result or {}
            wall = (data.record or {}).get("wall_s")
            row = [name, data.spec.mode, data.spec.cache, wall, result.get("start_to_ready_s")]
            rows.append(row + [_section(result, "phases").get(p) for p in phases])
    return rows


def phase_table(accounting: dict[str, dict[str, Any]], phases: list[str]) -> tuple[list[str], list[list[Any]]]:
    """Phases as rows, runs as columns: each measured phase, the driver's remainders (marked), `unaccounted` (start
    to ready minus the measured phases, remainders included) and its share of start to ready."""
    runs = list(accounting)
    residual = [p for p in phases if any(p in a["residual"] for a in accounting.values())]
    measured = [p for p in phases if p not in residual]
    rows: list[list[Any]] = [[p, *(accounting[r]["measured"].get(p) for r in runs)] for p in measured]
    rows += [[f"{p} (remainder)", *(accounting[r]["residual"].get(p) for r in runs)] for p in residual]
    rows.append(["unaccounted", *(accounting[r]["unaccounted_s"] for r in runs)])
    rows.append(["start to ready", *(accounting[r]["start_to_ready_s"] for r in runs)])
    rows.append(["unaccounted share", *(f"{accounting[r]['unaccounted_share']:.1%}" for r in runs)])
    return ["phase", *runs], rows


CHOICE_COUNTS = (
    "timed",
    "reused",
    "overruled",
    "pinned",
)  # graphpersist.graph.kernelchoice's counts, in the report's order


def kernel_choice_rows(runs: dict[str, RunData]) -> list[list[Any]]:
    """Per run and rank, what Inductor's kernel choices were (graphpersist.graph.kernelchoice): SAVE's timed / reused /
    overruled, LOAD's pinned and timed. Runs whose stats count no choices (SGLang, mode off) have no row."""
    rows = []
    for name, d in runs.items():
        for stat in d.stats if d.ran else []:
            counts = stat.get("kernel_choices")
            if isinstance(counts, dict):
                rows.append([name, stat.get("rank"), *(counts.get(k, 0) for k in CHOICE_COUNTS)])
    return rows


def compiled_model_rows(runs: dict[str, RunData]) -> list[list[Any]]:
    """Per run, rank and compiled model, how vLLM's LOAD made it: from SAVE's notes or by vLLM's own path (and why),
    and in how many seconds (overlays/vllm/vllm/graphpersist_compiled.py). Runs whose stats have none have no row."""
    rows = []
    for name, d in runs.items():
        for stat in d.stats if d.ran else []:
            models = stat.get("compiled_model")
            for prefix, made in models.items() if isinstance(models, dict) else ():
                if isinstance(made, dict):
                    how = "SAVE's notes" if made.get("built_from_notes") else f"vLLM's own path: {made.get('why_not')}"
                    rows.append([name, stat.get("rank"), prefix, how, made.get("s")])
    return rows


def archive_sizes(recipe: Recipe, out: Path) -> tuple[list[str], list[list[Any]]]:
    """Per archive: bytes under each rank_<r>/ folder, in the kernel images all ranks share (`images/`, one file
    per image since 2026-12-02; older archives kept them in their rank folders) and in the other shared files."""
    per_archive = {}
    for name in proofcheck.archive_writers(recipe):
        root = recipe.archive_path(out, name)
        if root.is_dir():
            sizes: dict[str, int] = {}
            for f in (p for p in root.rglob("*") if p.is_file()):
                top = f.relative_to(root).parts[0]
                is_folder = len(f.relative_to(root).parts) > 1
                if is_folder and top.startswith("rank_"):
                    key = top
                elif is_folder and top == "images":
                    key = "images"
                else:
                    key = "shared"
                sizes[key] = sizes.get(key, 0) + f.stat().st_size
            per_archive[name] = sizes
    shared = ("images", "shared")
    ranks = sorted({k for s in per_archive.values() for k in s if k not in shared}, key=lambda k: (len(k), k))
    header = ["archive", *ranks, "kernel images", "shared", "total"]
    rows = [
        [name, *(_size(s.get(r)) for r in ranks), *(_size(s.get(k, 0)) for k in shared), _size(sum(s.values()))]
        for name, s in per_archive.items()
    ]
    return header, rows


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def phase_colors(n: int) -> list[str]:
    """`n` colours no two of which are alike, one per phase (a plotting library's default cycle repeats after ten,
    and a start-up has more phases): hues spread around the circle, alternately darker and lighter."""
    shades = ((0.75, 0.80), (0.55, 0.95))
    return [
        "#{:02x}{:02x}{:02x}".format(*(round(255 * c) for c in colorsys.hsv_to_rgb(i / max(n, 1), *shades[i % 2])))
        for i in range(n)
    ]


def write_chart(path: Path, title: str, rows: list[tuple[str, dict[str, float]]], phases: list[str]) -> str:
    """A horizontal stacked bar per run (its phases, in seconds); returns "" or why there is no chart."""
    if not phases or not rows:
        return "no chart: no run reported phases"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not importable in the runner's Python (install it to get phases.png)"
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.45 * len(rows)))
    names = [name for name, _ in rows]
    left = [0.0] * len(rows)
    for phase, color in zip(phases, phase_colors(len(phases)), strict=True):
        widths = [float(p.get(phase) or 0.0) for _, p in rows]
        ax.barh(names, widths, left=left, label=phase, color=color)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f} s", va="center")
    ax.set_xlim(0, 1.12 * max(left) or 1.0)  # room for the totals
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(textwrap.fill(f"{title}: start-up phases per run", 90), fontsize="medium")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars, whatever their count
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the title and the legend whole
    plt.close(fig)
    return ""


def render(recipe: Recipe, runs: dict[str, RunData], checks: list[Check], data: dict[str, Any], chart: str) -> str:
    facts, phases = data["host"], data["phase_names"]
    lines = [data["headline"], "", f"# {recipe.title}: proof report", ""]
    lines += [
        f"- date: {data['date']}",
        f"- host: {facts['host']}",
        f"- gpus: {facts['gpus']}",
        f"- driver: {facts['driver']}",
        f"- python: {facts.get('python')}",
        f"- torch: {facts.get('torch')}",
        f"- graphpersist: {facts.get('graphpersist')}",
        f"- engine: {_engines(runs)}",
        f"- command: `{data['command']}`",
        f"- out: {data['out']}",
        "",
        "## Checks",
        "",
    ]
    lines += _table(["check", "result", "detail"], [[c.name, c.status, c.detail] for c in checks])
    failed = [(name, d) for name, d in runs.items() if d.ran and d.problem()]
    if failed:
        lines += ["", "## Failed runs", ""]
        for name, d in failed:
            tail = d.log_lines()[-SHOWN_LOG_LINES:]
            lines += ["", f"{name}: {d.problem()} (last {len(tail)} lines of {d.log}):", "", "```", *tail, "```"]
    lines += ["", "## Timing (s)", ""]
    lines += _table(["run", "mode", "cache", "wall", "start to ready", *phases], timing_rows(runs, phases))
    if data["phase_accounting"]:
        limit = f"{proofcheck.UNACCOUNTED_MAX:.0%}"
        lines += ["", f"## Phases (s): unaccounted is checked to be <= {limit} of start to ready", ""]
        lines += _table(*phase_table(data["phase_accounting"], phases))
    latency = _keys(runs, "latency")
    lines += ["", "## Latency", ""]
    lines += _table(
        ["run", *latency],
        [[n, *(_section(d.result, "latency").get(k) for k in latency)] for n, d in runs.items() if d.ran],
    )
    lines += ["", "## Targets (stated, not checks)", ""]
    targets = [[t["name"], t["value"], t["bound"], t["status"], t["detail"]] for t in data["targets"]]
    lines += _table(["target", "value", "bound", "result", "from"], targets) if targets else ["none in proof.toml"]
    choices = kernel_choice_rows(runs)
    if choices:
        lines += ["", "## Inductor kernel choices (graphpersist.graph.kernelchoice, per rank)", ""]
        lines += _table(["run", "rank", *CHOICE_COUNTS], choices)
    models = compiled_model_rows(runs)
    if models:
        lines += ["", "## The compiled model at LOAD (graphpersist_compiled, per rank)", ""]
        lines += _table(["run", "rank", "model", "built from", "s"], models)
    if data["informational"]:
        lines += ["", "## Outputs of runs not compared (compare_outputs = false)", ""]
        lines += [f"- {n['run']} vs {n['reference']}: {n['comparison']}" for n in data["informational"]]
    header, rows = archive_sizes(recipe, Path(data["out"]))
    lines += ["", "## Archive sizes", ""] + (_table(header, rows) if rows else ["no archive found"])
    lines += ["", "## Phases chart", "", chart if chart else f"![phases per run]({CHART})", "", "## Logs", ""]
    logs = [[n, (d.record or {}).get("started"), str(d.log), _log_note(d)] for n, d in runs.items() if d.ran]
    lines += _table(["run", "started", "log", "note"], logs)
    return "\n".join(lines) + "\n"


def _log_note(data: RunData) -> str:
    """The Logs table's note: the run's own environment (proof.toml `env`) and processes it left behind."""
    record = data.record or {}
    notes = [f"env {' '.join(f'{k}={v}' for k, v in sorted(record['env'].items()))}"] if record.get("env") else []
    ended = record.get("ended_processes", 0)
    if ended and not record.get("timed_out"):
        notes.append(f"ended {ended} leftover process(es) after exit")
    return "; ".join(notes)


def write(
    recipe: Recipe, out: Path, runs: dict[str, RunData], checks: list[Check], report: Path, *, command: str, python: str
) -> str:
    """Writes <out>/REPORT.md, <out>/report.json.gz, <out>/phases.png, and the same three next to `report` (the
    recipe's folder, for committing) when it is elsewhere. The JSON is gzipped: an engine run's is up to 1 MB."""
    phases = _keys(runs, "phases")
    chart_rows = [(n, _section(d.result, "phases")) for n, d in runs.items() if d.ran and _section(d.result, "phases")]
    (out / CHART).unlink(missing_ok=True)
    chart = write_chart(out / CHART, recipe.title, chart_rows, phases)
    data: dict[str, Any] = {
        "headline": headline(checks),
        "ok": headline(checks) == ALL_PASSED,
        "title": recipe.title,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": host_facts(python),
        "runner_python": platform.python_version(),
        "command": command,
        "out": str(out),
        "checks": [dataclasses.asdict(c) for c in checks],
        "targets": proofcheck.evaluate_targets(recipe, runs),
        "informational": proofcheck.informational(runs),
        "phase_names": phases,
        "phase_accounting": {
            spec.name: acc
            for spec in proofcheck.phase_check_runs(recipe)
            if (acc := proofcheck.phase_accounting(runs[spec.name].result, recipe.residual_phases))
        },
        "chart": str(out / CHART) if not chart else None,
        "chart_note": chart,
        "runs": {n: _run_json(d) for n, d in runs.items()},
    }
    text = render(recipe, runs, checks, data, chart)
    (out / "REPORT.md").write_text(text)
    written = jsonfile.dump_gz(out / REPORT_JSON, data)
    if report != out / "REPORT.md":
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(text)
        if report.parent.resolve() != out.resolve():
            shutil.copyfile(written, report.parent / REPORT_JSON)
            (report.parent / REPORT_JSON.removesuffix(jsonfile.GZ)).unlink(missing_ok=True)
        if not chart:
            shutil.copyfile(out / CHART, report.parent / CHART)
    return data["headline"]


def _run_json(data: RunData) -> dict[str, Any]:
    problem = data.problem()
    return {
        "spec": dataclasses.asdict(data.spec),
        "ran": data.ran,
        "problem": problem,
        "record": data.record,
        "result": data.result,
        "stats": data.stats,
        "log": str(data.log),
        "log_tail": data.log_lines()[-proofcheck.LOG_TAIL_LINES :] if data.ran and problem else [],
    }
