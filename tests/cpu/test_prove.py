"""`python -m gptools prove` end to end on CPU, with a fake engine driver that does what each test asks.

The fake driver follows the real contract (gptools.proofkit for arguments, cache snapshots and result.json; stats
files in GRAPHPERSIST_STATS_DIR; archives written with archive_fixtures, inspected by the real `graphpersist
inspect`). What it does wrong in a given run (crash, hang, different outputs ...) comes from behaviour.json in the
recipe folder, keyed by run name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from serve_fixtures import gone

from gptools import jsonfile, proofcheck, proofkit, proofreport, prove
from gptools.__main__ import main

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import json, os, signal, subprocess, sys, time
from pathlib import Path

from gptools import proofkit

proofkit.note_script_run(__name__)
args, extra = proofkit.driver_args()
todo = json.loads(Path("behaviour.json").read_text()).get(args.run, {})
for pid in todo.get("script_again", []):  # as a spawned engine process that ran this script again would note itself
    with open(Path(args.result).parent / proofkit.SCRIPT_RUNS, "a") as f:
        f.write(f"{pid} __mp_main__\\n")
print(f"driver: run {args.run}, mode {args.mode}, extra {extra}", flush=True)
if todo.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def sleeper(pid_file):
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if todo.get("ignore_term") else "")
                              + "time.sleep(120)"])
    Path(pid_file).write_text(str(child.pid))


if "refusal" in todo:  # the engine refused to start, as the run expects: the reason in the log, no outputs
    print("Traceback (most recent call last):\\nERROR graphpersist: cannot LOAD: flags.x: saved 1, live 2", flush=True)
    refusal = {"matched": todo["refusal"], **({"raised_type": todo["raised"]} if "raised" in todo else {})}
    proofkit.write_result(args.result, {"ok": True, "error": None, "refusal": refusal})
    sys.exit(0)

phases = proofkit.Phases()
before = proofkit.cache_snapshot()
with proofkit.Timer() as ready:
    with phases.phase("weights"):
        pass
    phases.add("compile", 0.0 if args.mode == "load" else 0.5)
    phases.add("graphs", 0.25)
    if todo.get("crash"):
        print("Traceback (most recent call last):", flush=True)
        print("RuntimeError: engine fell over", flush=True)
        sys.exit(3)
    if todo.get("sigkill"):  # as SGLang does to its whole process tree when a scheduler raises
        print("[TP0] Scheduler hit an exception: Traceback (most recent call last):", flush=True)
        print("graphpersist.errors.PersistError: graph 'decode/256': address 0x501a00000001 is not backed: "
              "SAVE refused", flush=True)
        print("[TP0] Received sigquit from a child process. It usually means the child failed.", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if todo.get("hang"):
        sleeper(todo["hang"])
        time.sleep(120)
    if args.mode == "save":
        with phases.phase("save"):
            from archive_fixtures import write_archive

            write_archive(Path(args.archive), **todo.get("world", {}))
at_ready = proofkit.cache_snapshot()
if todo.get("jit_file"):
    (proofkit.cache_dirs()[0] / todo["jit_file"]).write_text("a freshly compiled kernel")
after_first = proofkit.cache_snapshot()

outputs = {"sequential": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12]], "concurrent": [[13, 14], [15, 16, 17]],
           "oversize": [[18] * 12]}
if "change" in todo:
    workload, i, j = todo["change"]
    outputs[workload][i][j] += 100
stats = Path(os.environ["GRAPHPERSIST_STATS_DIR"])
if args.mode != "off" and not todo.get("no_stats"):
    for rank in (0, 1):
        captured = 4 if args.mode == "save" else 0
        restored = 4 - todo.get("missing_graphs", 0) * rank if args.mode == "load" else 0
        calls = captured if args.mode == "save" else todo.get("capture_calls", 0)
        record = {"rank": rank, "mode": args.mode, "captured": captured, "restored": restored,
                  "capture_calls": calls, "phases": {}}
        for counted in ("kernel_choices", "compiled_model"):
            if counted in todo:
                record[counted] = todo[counted]
        (stats / f"rank_{rank}.json").write_text(json.dumps(record))
if todo.get("log"):
    print(todo["log"], flush=True)
if todo.get("leftover"):
    sleeper(todo["leftover"])
# compile and graphs are simulated time the fake engine did not spend: its clock counts them as if it had
start_to_ready = ready.seconds + (0.0 if args.mode == "load" else 0.5) + 0.25
reported = {k: v for k, v in phases.to_dict().items() if k != todo.get("drop_phase")}
new_start, new_first = proofkit.new_files(before, at_ready), proofkit.new_files(at_ready, after_first)
proofkit.write_result(args.result, {
    "ok": True, "error": None, "start_to_ready_s": start_to_ready, "phases": reported, "outputs": outputs,
    "latency": todo.get("latency", {"first_request_s": 0.5, "decode_tps_b1": 250.0}),
    "jit": {"new_cache_files_start": len(new_start), "new_cache_files_first_request": len(new_first),
            "examples": (new_start + new_first)[:5]},
    "engine": {"name": "fake", "version": "1.0"},
    "script_runs": proofkit.script_runs(args.result),
    "seen": {"extra": extra, "env": {k: os.environ.get(k) for k in ("HOME", "TRITON_CACHE_DIR",
             "GP_PROOF_CACHE_DIRS", "PYTHONUNBUFFERED",
             "VLLM_WORKER_MULTIPROC_METHOD")}, "cache_files_at_start": sorted(before)},
})
if args.mode == "off":  # a warm run leaves a compiled kernel behind (a fresh run must not see it)
    (proofkit.cache_dirs()[0] / "warm-kernel.bin").write_text("compiled by a warm run")
"""

RUNS = {
    "baseline": 'mode = "off"',
    "eager": 'mode = "off"\nargs = ["--enforce-eager"]\ncompare_outputs = false',
    "save": 'mode = "save"\narchive = "a"',
    "save2": 'mode = "save"\narchive = "b"',
    "load": 'mode = "load"\narchive = "a"',
    "load_fresh": 'mode = "load"\narchive = "a"\ncache = "fresh"',
    "refused": 'mode = "load"\narchive = "a"\nexpect_refusal = true',
    # a real checkpoint's runs: their own output group, their own archive
    "save_real": 'mode = "save"\narchive = "r"\nargs = ["--model", "{real_model}"]\noutputs = "real"',
    "load_real": 'mode = "load"\narchive = "r"\nargs = ["--model", "{real_model}"]\noutputs = "real"',
    "baseline_real": 'mode = "off"\nargs = ["--model", "{real_model}"]\noutputs = "real"',
    "eager_real": 'mode = "off"\nargs = ["--model", "{real_model}"]\noutputs = "real"\ncompare_outputs = false',
}


def proof_toml(
    runs: tuple[str, ...] = ("baseline", "save", "save2", "load"), extra: str = "", timeout: float = 60
) -> str:
    if "phase_check" not in extra:  # every run that starts the fake engine: its phases add up
        checked = [n for n in runs if "expect_refusal" not in RUNS[n]]
        extra = f"phase_check = {json.dumps(checked)}\n{extra}"  # before any [[target]] of extra
    text = textwrap.dedent(f"""\
        title = "fake engine, TP=2"
        driver = ["{{python}}", "driver.py"]
        timeout_s = {timeout}
        cache_env = ["HOME", "TRITON_CACHE_DIR"]
        {extra}
        """)
    for name in runs:
        text += f'\n[[run]]\nname = "{name}"\n{RUNS[name]}\n'
    return text


def make_recipe(tmp_path: Path, behaviour: dict[str, dict[str, Any]] | None = None, **toml: Any) -> Path:
    recipe = tmp_path / "recipe"
    recipe.mkdir(parents=True)
    (recipe / "driver.py").write_text(DRIVER)
    (recipe / "proof.toml").write_text(proof_toml(**toml))
    (recipe / "behaviour.json").write_text(json.dumps(behaviour or {}))
    return recipe


@pytest.fixture(autouse=True)
def driver_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake driver writes archives with archive_fixtures; `graphpersist inspect` needs the runtime on the path."""
    paths = [str(REPO / "tests" / "cpu"), str(REPO / "overlays" / "graphpersist")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")


def prove_cli(recipe: Path, out: Path, *extra: str) -> int:
    return main(["prove", str(recipe), "--out", str(out), *extra])


def report(out: Path) -> tuple[str, dict[str, Any], dict[str, dict[str, str]]]:
    text = (out / "REPORT.md").read_text()
    data = jsonfile.load(out / "report.json")  # report.json.gz since reports are gzipped; either reads
    return text, data, {c["name"]: c for c in data["checks"]}


def test_all_checks_pass_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    leftover = tmp_path / "leftover.pid"
    runs = ("baseline", "eager", "save", "save2", "load", "load_fresh")
    recipe = make_recipe(
        tmp_path, {"baseline": {"leftover": str(leftover)}, "eager": {"change": ["sequential", 0, 5]}}, runs=runs
    )
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0
    printed = capsys.readouterr().out
    assert "prove: [3/6] save: starting (mode=save, archive=a, cache=warm)" in printed
    assert "prove: [6/6] load_fresh: done in " in printed
    assert f"prove: report: {out / 'REPORT.md'}" in printed

    text, data, checks = report(out)
    assert text.splitlines()[0] == "all checks passed"
    assert data["ok"] is True
    assert all(c["status"] == "pass" for c in checks.values()), checks
    expected = {f"{r} finished" for r in runs} | {f"{r} log clean" for r in runs} | {"outputs identical"}
    expected |= (
        {"archives a = b"}
        | {f"{r} unaccounted <= 5 %" for r in runs}
        | {
            f"{r} {w}"
            for r in ("load", "load_fresh")
            for w in ("restored every graph", "captured nothing", "no new JIT files")
        }
        | {f"{r} runs the script as upstream" for r in ("save", "save2", "load", "load_fresh")}
    )
    assert set(checks) == expected
    assert "restored = captured by save per rank: [4, 4]" in checks["load restored every graph"]["detail"]
    assert checks["archives a = b"]["detail"].startswith("2 rank(s), graphs per rank [4, 4]")
    headings = ("## Checks", "## Timing (s)", "## Phases (s)", "## Latency", "## Targets", "## Archive sizes")
    headings += ("## Logs",)
    for heading in headings:
        assert heading in text
    assert "| run | mode | cache | wall | start to ready | weights | compile | graphs |" in text
    assert "| run | first_request_s | decode_tps_b1 |" in text
    assert "| archive | rank_0 | rank_1 | kernel images | shared | total |" in text
    assert "- engine: fake 1.0" in text
    # the eager run differs, but it is compared for information only
    assert "- eager vs baseline: differs at sequential[0] (token 5)" in text
    # the leftover process of a run that exited is ended with the run's process group
    assert gone(int(leftover.read_text()))
    assert "ended 1 leftover process(es) after exit" in text
    # the driver's environment: every run sees the same cache paths (some caches record absolute paths); a fresh
    # run finds them empty, the warm content is back afterwards, and what the fresh run wrote is kept aside
    seen = {r: json.loads((out / r / "result.json").read_text())["seen"] for r in ("load", "load_fresh", "eager")}
    assert seen["load"]["env"]["TRITON_CACHE_DIR"] == str(out / "cache-warm" / "TRITON_CACHE_DIR")
    assert seen["load_fresh"]["env"]["HOME"] == str(out / "cache-warm" / "HOME")
    assert "HOME/warm-kernel.bin" in seen["load"]["cache_files_at_start"]
    assert seen["load_fresh"]["cache_files_at_start"] == []
    assert (out / "cache-warm" / "HOME" / "warm-kernel.bin").is_file()
    assert (out / "load_fresh" / "cache" / "HOME").is_dir()
    assert not (out / "cache-warm.aside").exists()
    assert seen["load"]["env"]["GP_PROOF_CACHE_DIRS"].split(os.pathsep) == [
        str(out / "cache-warm" / "HOME"),
        str(out / "cache-warm" / "TRITON_CACHE_DIR"),
    ]
    assert seen["load"]["env"]["PYTHONUNBUFFERED"] == "1"
    assert seen["eager"]["extra"] == ["--enforce-eager"]


def test_a_phase_missing_from_the_table_fails_its_runs_unaccounted_check(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, {"load": {"drop_phase": "graphs"}}, runs=("baseline", "save", "load"))
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    text, data, checks = report(out)
    assert text.splitlines()[0] == "FAILED: load unaccounted <= 5 %"
    detail = checks["load unaccounted <= 5 %"]["detail"]
    assert checks["load unaccounted <= 5 %"]["status"] == "FAIL"
    assert detail.startswith("unaccounted 0.25") and "measured phases: weights, compile" in detail
    assert "time the missing part of the start-up as a phase of its own" in detail
    assert checks["baseline unaccounted <= 5 %"]["status"] == "pass"
    assert data["phase_accounting"]["load"]["unaccounted_s"] == pytest.approx(0.25, abs=0.01)
    table = text.split("## Phases (s)")[1].split("## Latency")[0]
    assert "| phase | baseline | save | load |" in table and "| graphs | 0.250 | 0.250 | - |" in table
    assert "| unaccounted share |" in table


def test_remainders_count_as_unaccounted_and_phase_check_picks_the_runs(tmp_path: Path) -> None:
    extra = 'residual_phases = ["compile"]\nphase_check = ["baseline", "load"]'
    recipe = make_recipe(tmp_path, runs=("baseline", "save", "load"), extra=extra)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    text, data, checks = report(out)
    assert [n for n in checks if "unaccounted" in n] == ["baseline unaccounted <= 5 %", "load unaccounted <= 5 %"]
    assert checks["baseline unaccounted <= 5 %"]["status"] == "FAIL"  # its compile (0.5 s) is a remainder
    assert "remainders counted as unaccounted: compile" in checks["baseline unaccounted <= 5 %"]["detail"]
    assert checks["load unaccounted <= 5 %"]["status"] == "pass"  # LOAD's compile is 0 s
    assert "| compile (remainder) | 0.500 | 0.000 |" in text
    assert set(data["phase_accounting"]) == {"baseline", "load"}


def test_a_stated_phase_check_is_a_targets_row_and_fails_nothing(tmp_path: Path) -> None:
    """`phase_check_stated = true` (the TP=1 recipes until their drivers time every phase): the same accounting, as a
    stated Targets row, so a remainder-heavy start-up does not fail a proof of persistence."""
    extra = 'residual_phases = ["compile"]\nphase_check = ["baseline", "load"]\nphase_check_stated = true'
    recipe = make_recipe(tmp_path, runs=("baseline", "save", "load"), extra=extra)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0
    text, data, checks = report(out)
    assert text.splitlines()[0] == "all checks passed"
    assert not [n for n in checks if "unaccounted" in n]
    rows = {t["name"]: t for t in data["targets"]}
    assert rows["baseline: unaccounted start-up / start to ready"]["status"] == "NOT met"  # compile is a remainder
    assert rows["load: unaccounted start-up / start to ready"]["status"] == "met"
    assert rows["load: unaccounted start-up / start to ready"]["bound"] == "<= 0.05"
    assert "## Phases (s)" in text


def test_phases_adding_up_to_more_than_start_to_ready_fail(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0
    result = json.loads((out / "baseline" / "result.json").read_text())
    result["phases"]["graphs"] += 0.5  # counted twice
    (out / "baseline" / "result.json").write_text(json.dumps(result))
    assert prove_cli(recipe, out, "--check-only") == 1
    _, _, checks = report(out)
    assert "the phases add up to more than start to ready" in checks["baseline unaccounted <= 5 %"]["detail"]


@pytest.mark.parametrize("n", [1, 2, 10, 16, 20])
def test_every_phase_of_the_chart_gets_a_colour_of_its_own(n: int) -> None:
    colors = proofreport.phase_colors(n)
    assert len(colors) == n == len(set(colors))
    assert all(len(c) == 7 and c.startswith("#") and int(c[1:], 16) >= 0 for c in colors)


def test_phases_chart_or_a_note_without_matplotlib(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, runs=("baseline", "save", "load"))
    out = tmp_path / "out"
    prove_cli(recipe, out, "--report", str(tmp_path / "copy" / "REPORT.md"))
    text, data, _ = report(out)
    assert (tmp_path / "copy" / "REPORT.md").read_text() == text
    assert jsonfile.load(tmp_path / "copy" / "report.json.gz") == data  # the recipe's folder gets the JSON too
    if importlib.util.find_spec("matplotlib") is None:
        assert "no chart: matplotlib is not importable" in text
        assert not (out / "phases.png").exists() and data["chart"] is None
    else:
        assert (out / "phases.png").read_bytes().startswith(b"\x89PNG")
        assert (tmp_path / "copy" / "phases.png").exists()
        assert "![phases per run](phases.png)" in text


def test_differing_outputs_name_the_run_and_workload(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, {"load": {"change": ["concurrent", 1, 2]}})
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    text, _, checks = report(out)
    assert text.splitlines()[0] == "FAILED: outputs identical"
    detail = checks["outputs identical"]["detail"]
    assert detail.startswith("load differs from baseline at concurrent[1] (token 2):")
    assert "baseline [15, 16, 17] (3 tokens) vs load [15, 16, 117] (3 tokens)" in detail


def test_a_crash_fails_its_run_with_the_log_tail_and_stops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = make_recipe(tmp_path, {"save": {"crash": True}})
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    printed = capsys.readouterr().out
    assert "prove: [2/4] save: FAILED: exit 3; the log says: RuntimeError: engine fell over; log: " in printed
    assert "not run: save2, load" in printed
    text, data, checks = report(out)
    assert checks["save finished"] == {
        "name": "save finished",
        "status": "FAIL",
        "detail": "exit 3; the log's last reason: RuntimeError: engine fell over",
    }
    assert checks["load finished"]["status"] == "not run"
    assert checks["save log clean"]["status"] == "FAIL"
    assert "line 2: Traceback (most recent call last):" in checks["save log clean"]["detail"]
    assert data["runs"]["save"]["log_tail"][-1] == "RuntimeError: engine fell over"
    assert "## Failed runs" in text and "RuntimeError: engine fell over" in text
    assert not (out / "load").exists()


def test_a_run_its_engine_killed_names_the_reason_from_its_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang SIGKILLs its process tree, the driver included, when a scheduler raises: no result.json, so the
    refusal in the log is the only reason there is (the first SGLang SAVE on the GPU host, 2026-11-30)."""
    recipe = make_recipe(tmp_path, {"save": {"sigkill": True}})
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    reason = ("graphpersist.errors.PersistError: graph 'decode/256': address 0x501a00000001 is not backed: "
              "SAVE refused")  # fmt: skip
    assert f"save: FAILED: killed by signal 9; the log says: {reason}; log: " in capsys.readouterr().out
    _, _, checks = report(out)
    assert checks["save finished"]["detail"] == f"killed by signal 9; the log's last reason: {reason}"


def test_keep_going_runs_the_rest_after_a_failure(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, {"save": {"crash": True}})
    out = tmp_path / "out"
    assert prove_cli(recipe, out, "--keep-going") == 1
    _, _, checks = report(out)
    assert checks["save2 finished"]["status"] == "pass"
    assert checks["load finished"]["status"] == "pass"  # it loads archive a, which the failed save did not write:
    assert checks["load restored every graph"]["status"] == "FAIL"  # the fake driver does not care, the check does
    assert checks["archives a = b"]["detail"] == "not measured: save did not finish"


def test_a_hang_is_killed_at_the_timeout_with_its_whole_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prove, "TERM_GRACE_S", 0.5)
    child = tmp_path / "child.pid"
    recipe = make_recipe(tmp_path, {"baseline": {"hang": str(child), "ignore_term": True}}, timeout=1.5)
    out = tmp_path / "out"
    started = time.monotonic()
    assert prove_cli(recipe, out) == 1
    assert time.monotonic() - started < 30
    _, data, checks = report(out)
    assert checks["baseline finished"]["detail"] == "timed out after 1.5 s (process group ended)"
    assert gone(int(child.read_text()))  # it ignored SIGTERM: SIGKILL ended it
    assert data["runs"]["baseline"]["record"]["timed_out"] is True


MISBEHAVING_LOADS = {
    "l_graphs": ({"missing_graphs": 1}, "restored every graph", "restored != captured by save: rank 1: 3 of 4"),
    "l_capture": ({"capture_calls": 2}, "captured nothing", "capture calls per rank [2, 2]"),
    "l_jit": ({"jit_file": "kernel.cubin"}, "no new JIT files", "start 0, first request 1; e.g. HOME/kernel.cubin"),
    "l_log": ({"log": "CUDA error: an illegal memory access"}, "log clean", "1 error line(s): line 2: CUDA error"),
    "l_stats": ({"no_stats": True}, "captured nothing", "not measured: no stats files in"),
    "l_timed": (
        {"kernel_choices": {"timed": 1, "pinned": 3}},
        "timed no kernel choice",
        "timed per rank [1, 1], launched SAVE's choice per rank [3, 3]",
    ),
    "l_choices": (
        {"kernel_choices": None},
        "timed no kernel choice",
        "not measured: kernel_choices is not a count table on every rank",
    ),
    "l_compiled": (
        {"compiled_model": {"backbone": {"built_from_notes": False, "s": 1.5, "why_not": "compiler inductor"}}},
        "built the compiled model from SAVE's notes",
        "built from notes per rank {0: {'backbone': False}, 1: {'backbone': False}}, seconds {0: {'backbone': 1.5}, "
        "1: {'backbone': 1.5}}; why not: {0: {'backbone': 'compiler inductor'}, 1: {'backbone': 'compiler inductor'}}",
    ),
    "l_models": (
        {"compiled_model": {}},
        "built the compiled model from SAVE's notes",
        "not measured: compiled_model is not a table of models on every rank",
    ),
}


def test_each_misbehaving_load_fails_its_own_check_and_only_it(tmp_path: Path) -> None:
    recipe = make_recipe(
        tmp_path, {name: b for name, (b, _, _) in MISBEHAVING_LOADS.items()}, runs=("baseline", "save")
    )
    with (recipe / "proof.toml").open("a") as f:
        f.writelines(f'\n[[run]]\nname = "{name}"\nmode = "load"\narchive = "a"\n' for name in MISBEHAVING_LOADS)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    text, _, checks = report(out)
    failed = {n for n, c in checks.items() if c["status"] != "pass"}
    expected = {f"{run} {check}" for run, (_, check, _) in MISBEHAVING_LOADS.items()} | {"l_stats restored every graph"}
    assert failed == expected
    assert text.splitlines()[0] == "FAILED: " + ", ".join(n for n in checks if n in expected)
    for run, (_, check, detail) in MISBEHAVING_LOADS.items():
        assert detail in checks[f"{run} {check}"]["detail"]
    # missing stats are "not measured", never passed
    assert checks["l_stats restored every graph"]["detail"].startswith("l_stats: not measured: no stats files in")


LOAD_COUNTED = {  # a LOAD check that only engines whose stats count it get: its stats, its name, its detail
    "kernel_choices": (
        {"pinned": 5, "unkeyed": 1},
        "timed no kernel choice",
        "timed per rank [0, 0], launched SAVE's choice per rank [5, 5]",
    ),
    "compiled_model": (  # vLLM's, per rank and compiled model (overlays/vllm/vllm/graphpersist_compiled.py)
        {"backbone": {"built_from_notes": True, "s": 0.05, "why_not": ""}},
        "built the compiled model from SAVE's notes",
        "built from notes per rank {0: {'backbone': True}, 1: {'backbone': True}}, seconds "
        "{0: {'backbone': 0.05}, 1: {'backbone': 0.05}}",
    ),
}


@pytest.mark.parametrize("counted", sorted(LOAD_COUNTED))
def test_a_load_whose_stats_count_it_passes_and_one_without_such_stats_has_no_such_check(
    tmp_path: Path, counted: str
) -> None:
    """Kernel choices launched from SAVE's (none timed) and vLLM's compiled model built from SAVE's notes: checked
    for a LOAD whose stats report them; a LOAD whose stats do not (SGLang's) has no such check."""
    stats, check, detail = LOAD_COUNTED[counted]
    recipe = make_recipe(tmp_path, {"load": {counted: stats}}, runs=("baseline", "save", "load", "load_fresh"))
    out = tmp_path / "out"
    prove_cli(recipe, out)
    checks = report(out)[2]
    assert checks[f"load {check}"] == {"name": f"load {check}", "status": "pass", "detail": detail}
    assert f"load_fresh {check}" not in checks


COUNT_TABLES = {
    "kernel_choices": (
        {"save": {"kernel_choices": {"timed": 14, "reused": 10, "overruled": 1}},
         "load": {"kernel_choices": {"pinned": 5}}},
        "## Inductor kernel choices (graphpersist.graph.kernelchoice, per rank)",
        ["| run | rank | timed | reused | overruled | pinned |", "|---|---|---|---|---|---|",
         "| save | 0 | 14 | 10 | 1 | 0 |", "| save | 1 | 14 | 10 | 1 | 0 |",
         "| load | 0 | 0 | 0 | 0 | 5 |", "| load | 1 | 0 | 0 | 0 | 5 |"],
    ),
    "compiled_model": (
        {"load": {"compiled_model": {"backbone": {"built_from_notes": True, "s": 0.41, "why_not": ""},
                                     "encoder": {"built_from_notes": False, "s": 3.2, "why_not": "an encoder"}}}},
        "## The compiled model at LOAD (graphpersist_compiled, per rank)",
        ["| run | rank | model | built from | s |", "|---|---|---|---|---|",
         "| load | 0 | backbone | SAVE's notes | 0.410 |",
         "| load | 0 | encoder | vLLM's own path: an encoder | 3.20 |",
         "| load | 1 | backbone | SAVE's notes | 0.410 |",
         "| load | 1 | encoder | vLLM's own path: an encoder | 3.20 |"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("counted", sorted(COUNT_TABLES))
def test_the_report_tables_the_counts_of_the_runs_whose_stats_have_them(tmp_path: Path, counted: str) -> None:
    """Kernel choices (graphpersist.graph.kernelchoice) and how LOAD made vLLM's compiled model, per run and rank."""
    behaviour, heading, table = COUNT_TABLES[counted]
    recipe = make_recipe(tmp_path, behaviour, runs=("baseline", "save", "load"))
    out = tmp_path / "out"
    prove_cli(recipe, out)
    lines = report(out)[0].splitlines()
    at = lines.index(heading)
    assert lines[at + 2 : at + 8] == table


def test_a_report_without_kernel_choices_or_compiled_models_has_no_such_table(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, {}, runs=("baseline", "save", "load"))
    out = tmp_path / "out"
    prove_cli(recipe, out)
    text = report(out)[0]
    assert "Inductor kernel choices" not in text and "## The compiled model at LOAD" not in text


def test_ignore_patterns_silence_known_log_lines(tmp_path: Path) -> None:
    extra = 'error_patterns = ["CUDA error"]\nignore_patterns = ["harmless"]'
    behaviour = {"baseline": {"log": "CUDA error: harmless, printed by a probe\nCUDA error: out of memory"}}
    recipe = make_recipe(tmp_path, behaviour, runs=("baseline",), extra=extra)
    out = tmp_path / "out"
    prove_cli(recipe, out)
    assert report(out)[2]["baseline log clean"]["detail"] == "1 error line(s): line 3: CUDA error: out of memory"


def test_a_run_that_expects_a_refusal_is_checked_for_it_not_for_graphs_or_a_clean_log(tmp_path: Path) -> None:
    reason = "graphpersist: cannot LOAD: flags.x: saved 1, live 2"
    recipe = make_recipe(tmp_path, {"refused": {"refusal": reason}}, runs=("baseline", "save", "load", "refused"))
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0
    text, _, checks = report(out)
    assert checks["refused refused"] == {"name": "refused refused", "status": "pass", "detail": reason}
    assert not [n for n in checks if n.startswith("refused ") and n != "refused refused" and n != "refused finished"]
    assert "refused vs" not in text  # no outputs, and none expected: not listed among the runs not compared


def test_a_refusal_whose_quoted_line_is_not_in_the_log_fails(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, {"refused": {"refusal": "a line nobody printed"}}, runs=("save", "refused"))
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    detail = report(out)[2]["refused refused"]["detail"]
    assert detail.startswith("result.json quotes a line that is not in ") and detail.endswith("a line nobody printed")


@pytest.mark.parametrize(
    ("raised", "status", "detail"),
    [
        ("graphpersist.archive.validate.LoadRefused", "pass", "LoadRefused in the driver: "),
        (
            "builtins.RuntimeError",
            "FAIL",
            "the driver's engine start raised builtins.RuntimeError, not the runtime's "
            "refusal (the engine did not hand it back); the log has it: ",
        ),
    ],
    ids=["the-runtimes-refusal", "the-engines-own-error"],
)
def test_a_refusal_must_be_raised_in_the_driver_as_the_runtimes_own(
    tmp_path: Path, raised: str, status: str, detail: str
) -> None:
    """A driver that records what the engine's start raised (issue 43: the engine hands the refusal back to the
    process that started it): the runtime's refusal passes, the engine's own error fails, the log notwithstanding."""
    reason = "graphpersist: cannot LOAD: flags.x: saved 1, live 2"
    behaviour = {"refused": {"refusal": reason, "raised": raised}}
    recipe = make_recipe(tmp_path, behaviour, runs=("baseline", "save", "refused"))
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == (0 if status == "pass" else 1)
    check = report(out)[2]["refused refused"]
    assert (check["status"], check["detail"]) == (status, detail + reason)


@pytest.mark.parametrize(("again", "status"), [([], "pass"), ([99999], "FAIL")], ids=["once", "again-in-a-child"])
def test_a_persistence_run_must_run_the_script_as_often_as_the_baseline(
    tmp_path: Path, again: list[int], status: str
) -> None:
    recipe = make_recipe(tmp_path, {"load": {"script_again": again}}, runs=("baseline", "save", "load"))
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == (0 if status == "pass" else 1)
    checks = report(out)[2]
    assert checks["save runs the script as upstream"]["status"] == "pass"
    load = checks["load runs the script as upstream"]
    count = 1 + len(again)
    assert (load["status"], load["detail"]) == (status, f"{count} process(es) ran the driver's script, baseline 1")
    assert "baseline runs the script as upstream" not in checks  # the reference itself


def test_without_a_persistence_off_run_the_script_count_is_not_compared(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, runs=("save", "load"))
    out = tmp_path / "out"
    prove_cli(recipe, out)
    check = report(out)[2]["load runs the script as upstream"]
    assert (check["status"], check["detail"]) == (
        "not run",
        "1 process(es) ran the script; no persistence-off run counted",
    )


def test_a_driver_notes_each_process_that_runs_it_as_a_script(tmp_path: Path) -> None:
    """proofkit.note_script_run at a driver's top level: the driver itself (`__main__`) and a child that ran it again
    (`__mp_main__`, multiprocessing's spawn) are noted beside --result; a driver imported by another is not."""
    result = tmp_path / "run" / "result.json"
    argv = ["driver.py", "--run", "r", "--mode", "load", "--result", str(result)]
    proofkit.note_script_run("__main__", argv)
    proofkit.note_script_run("__main__", argv)  # the same process again (re-executed under the interposer)
    proofkit.note_script_run("vllm_qwen3_8b_tp2_driver", argv)  # loaded by the SGLang driver for its helpers
    assert proofkit.script_runs(result) == 1
    proofkit.note_script_run("__mp_main__", ["driver.py", f"--result={result}"])
    lines = (result.parent / proofkit.SCRIPT_RUNS).read_text().splitlines()
    assert lines == [f"{os.getpid()} __main__"] * 2 + [f"{os.getpid()} __mp_main__"]
    assert proofkit.script_runs(tmp_path / "elsewhere" / "result.json") == 0
    proofkit.note_script_run("__main__", ["driver.py"])  # no --result: nowhere to note, nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_refusal_run_that_did_not_finish_is_not_measured(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, {"refused": {"crash": True}}, runs=("save", "refused"))
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    assert report(out)[2]["refused refused"] == {
        "name": "refused refused",
        "status": "FAIL",
        "detail": "not measured: exit 3",
    }


def test_archives_differing_in_one_field_name_its_path(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, {"save2": {"world": {"nccl.version": "2.27.5"}}})
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    text, _, checks = report(out)
    assert text.splitlines()[0] == "FAILED: archives a = b"
    assert checks["archives a = b"]["detail"] == (
        '1 field(s) differ: world.nccl.version: "2.27.3" vs "2.27.5"; graph by graph: archives-a-b.diff.txt'
    )
    diff = (out / "archives-a-b.diff.txt").read_text()  # the stand-in archives hold no graph pack to compare
    assert "it has no rank_0/graphs/index.json" in diff and diff.endswith("graphpersist diff failed (exit 2)\n")


def test_archive_differences_show_an_archives_keys_and_values_escaped() -> None:
    """A report quotes what differs between two archives: their strings never reach it as control characters."""
    a = {"env": {"NCCL_\x1b[2JX": "1\x1b[0m", "B\u202e": "x"}}
    b = {"env": {"NCCL_\x1b[2JX": "2", "B\u202e": "y\r\nforged"}}
    found = list(proofcheck.differences(a, b))
    assert found == ['env.NCCL_\\u001b[2JX: "1\\u001b[0m" vs "2"', 'env.B\\u202e: "x" vs "y\\r\\nforged"']
    assert not [c for line in found for c in line if not c.isprintable()]


def test_archive_projection_compares_phase_anchors_and_ignores_creation() -> None:
    def doc(anchor: int, created: str) -> dict[str, Any]:
        rank = {
            "region": {"base": 1 << 40, "size": 1 << 36, "final_offset": 4096},
            "pointers": {"fingerprint": "p", "count": 3},
            "graphs": [{"name": "g1", "topology_fingerprint": "t", "node_count": 5, "file": "rank_0/x"}],
            "images": [{"sha256": "i2"}, {"sha256": "i1"}],
            "extra": {"phases": [{"name": "weights", "start": 0}, {"name": "kv", "start": anchor, "end": anchor}]},
        }
        return {
            "manifest": {"format_version": 2, "created": {"created_at": created}, "world": {"w": 1}, "ranks": [0]},
            "ranks": {"0": rank},
        }

    same = proofcheck.archive_projection(doc(8192, "monday")), proofcheck.archive_projection(doc(8192, "tuesday"))
    assert list(proofcheck.differences(*same)) == []
    moved = proofcheck.archive_projection(doc(8192, "x")), proofcheck.archive_projection(doc(12288, "x"))
    assert list(proofcheck.differences(*moved)) == ["rank.0.phase_anchors[1].start: 8192 vs 12288"]


def test_targets_are_met_not_met_or_not_measured(tmp_path: Path) -> None:
    targets = textwrap.dedent("""\
        [[target]]
        name = "first request, LOAD / baseline"
        num = "load.first_request_s"
        den = "baseline.first_request_s"
        max = 0.5
        [[target]]
        name = "decode b1, LOAD / baseline"
        num = "load.decode_tps_b1"
        den = "baseline.decode_tps_b1"
        min = 0.99
        [[target]]
        name = "graphs phase of LOAD"
        num = "load.phases.graphs"
        max = 1
        [[target]]
        name = "ttft"
        num = "load.ttft_long_s"
        den = "baseline.ttft_long_s"
        max = 1
        """)
    load_latency = {"first_request_s": 0.1, "decode_tps_b1": 240.0}
    recipe = make_recipe(tmp_path, {"load": {"latency": load_latency}}, extra=targets)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0  # targets are stated, not checked
    text, data, _ = report(out)
    got = {t["name"]: (t["status"], t["value"]) for t in data["targets"]}
    assert got == {
        "first request, LOAD / baseline": ("met", pytest.approx(0.2)),
        "decode b1, LOAD / baseline": ("NOT met", pytest.approx(0.96)),
        "graphs phase of LOAD": ("met", pytest.approx(0.25)),
        "ttft": ("not measured", None),
    }
    assert "| decode b1, LOAD / baseline | 0.960 | >= 0.99 | NOT met | 240 / 250 |" in text
    assert "| ttft | - | <= 1 | not measured | load.ttft_long_s not in result.json |" in text


def repeated_load(times: int = 3, extra: str = "") -> str:
    """proof.toml with baseline, save and a load that runs `times` times (`repeat`), load listed between the two."""
    toml = proof_toml(("baseline", "load", "save"), extra=extra)
    return toml.replace('mode = "load"\narchive = "a"\n', f'mode = "load"\narchive = "a"\nrepeat = {times}\n')


def test_repeat_makes_repetitions_right_after_their_run_with_its_settings(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path)
    toml = repeated_load().replace("repeat = 3\n", 'repeat = 3\nargs = ["--x", "1"]\ncache = "fresh"\n')
    (recipe / "proof.toml").write_text(toml)
    parsed = prove.parse_recipe(recipe)
    got = [(r.name, r.mode, r.archive, r.args, r.cache, r.repeats) for r in parsed.runs]
    assert got == [
        ("baseline", "off", None, (), "warm", None),
        ("load", "load", "a", ("--x", "1"), "fresh", None),
        ("load_2", "load", "a", ("--x", "1"), "fresh", "load"),
        ("load_3", "load", "a", ("--x", "1"), "fresh", "load"),
        ("save", "save", "a", (), "warm", None),
    ]
    assert [r.name for r in parsed.repetitions("load")] == ["load", "load_2", "load_3"]
    assert [r.name for r in parsed.repetitions("save")] == ["save"]
    assert [r.name for r in parsed.repetitions("load_2")] == ["load_2"]


@pytest.mark.parametrize(
    ("repeat", "message"),
    [
        ("0", "run[1].repeat: must be 1 to 9, got 0"),
        ("10", "run[1].repeat: must be 1 to 9, got 10"),
        ("2.5", "run[1].repeat: wrong type float (2.5)"),
        ('"3"', "run[1].repeat: wrong type str ('3')"),
        ("true", "run[1].repeat: wrong type bool (True)"),
    ],
)
def test_a_repeat_out_of_1_to_9_or_not_an_integer_is_misuse_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], repeat: str, message: str
) -> None:
    recipe = make_recipe(tmp_path)
    (recipe / "proof.toml").write_text(repeated_load().replace("repeat = 3", f"repeat = {repeat}"))
    assert prove_cli(recipe, tmp_path / "out") == 2
    assert message in capsys.readouterr().err


def test_a_repetition_named_as_a_declared_run_is_misuse_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = make_recipe(tmp_path)
    (recipe / "proof.toml").write_text(repeated_load() + '\n[[run]]\nname = "load_2"\nmode = "off"\n')
    assert prove_cli(recipe, tmp_path / "out") == 2
    assert "run[1].repeat: its repetition 'load_2' has the name of another run" in capsys.readouterr().err


MEDIAN_TARGETS = """\
[[target]]
name = "first request, LOAD / baseline"
num = "load.first_request_s"
den = "baseline.first_request_s"
max = 1
"""


def first_request(seconds: float) -> dict[str, Any]:
    return {"latency": {"first_request_s": seconds, "decode_tps_b1": 250.0}}


def test_a_target_over_a_repeated_run_reads_the_median_of_its_repetitions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    behaviour = {"load": first_request(0.1), "load_2": first_request(0.3), "load_3": first_request(0.2)}
    recipe = make_recipe(tmp_path, behaviour)
    (recipe / "proof.toml").write_text(repeated_load(extra=MEDIAN_TARGETS))
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0
    assert "prove: [3/5] load_2: starting (mode=load, archive=a, cache=warm)" in capsys.readouterr().out
    text, data, checks = report(out)
    for run in ("load_2", "load_3"):  # each repetition is a run with LOAD's checks and its own timing row
        assert checks[f"{run} restored every graph"]["status"] == "pass"
        assert f"| {run} | load | warm |" in text
    (row,) = data["targets"]
    assert (row["status"], row["value"]) == ("met", pytest.approx(0.4))  # median 0.2 over the baseline's 0.5
    assert row["detail"] == "median of 3 (0.1, 0.3, 0.2) / 0.5"


def test_a_median_names_the_repetitions_without_a_result_and_runs_selects_one_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    behaviour = {"load": first_request(0.1), "load_2": first_request(0.3), "load_3": first_request(0.2)}
    recipe = make_recipe(tmp_path, behaviour)
    (recipe / "proof.toml").write_text(repeated_load(extra=MEDIAN_TARGETS))
    out = tmp_path / "out"
    assert prove_cli(recipe, out, "--runs", "baseline,load,save") == 1
    (row,) = report(out)[1]["targets"]
    assert row["value"] == pytest.approx(0.2)  # 0.1 alone
    assert row["detail"] == "median of 1 (0.1; load_2, load_3 have no result) / 0.5"
    capsys.readouterr()
    assert prove_cli(recipe, out, "--runs", "load_3") == 1  # an exact name: that repetition alone
    assert "prove: [1/1] load_3: starting" in capsys.readouterr().out
    (row,) = report(out)[1]["targets"]
    assert row["value"] == pytest.approx(0.3)  # the median of 0.1 and 0.2, over 0.5
    assert row["detail"] == "median of 2 (0.1, 0.2; load_2 has no result) / 0.5"


def test_a_failing_repetition_fails_its_own_checks_and_only_them(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, {"load_2": {"crash": True}})
    (recipe / "proof.toml").write_text(repeated_load())
    out = tmp_path / "out"
    assert prove_cli(recipe, out, "--keep-going") == 1
    checks = report(out)[2]
    assert checks["load_2 finished"]["detail"] == "exit 3; the log's last reason: RuntimeError: engine fell over"
    assert checks["load_2 log clean"]["status"] == "FAIL"
    assert {n for n, c in checks.items() if c["status"] != "pass"} == {
        "load_2 finished",
        "load_2 log clean",
        "load_2 restored every graph",
        "load_2 captured nothing",
        "load_2 no new JIT files",
        "outputs identical",
    }
    assert checks["outputs identical"]["detail"] == "not measured: no outputs from load_2"


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        (proof_toml().replace('mode = "load"', 'mode = "lod"'), "run[3].mode: must be one of off, save, load"),
        (proof_toml() + "\n[targets]\nx = 1\n", "targets: unknown key"),
        (proof_toml().replace('driver = ["{python}", "driver.py"]', ""), "driver: missing"),
        (proof_toml().replace('archive = "b"', ""), "run[2].archive: needed for mode='save'"),
        (proof_toml() + '\n[[target]]\nname = "x"\nnum = "nosuch.start_to_ready_s"\nmax = 1\n', "target[0].num"),
        (proof_toml() + '\n[[target]]\nname = "x"\nnum = "load.start_to_ready_s"\n', "target[0].min: a target needs"),
        (proof_toml().replace("timeout_s = 60", 'timeout_s = "long"'), "timeout_s: wrong type str"),
        (proof_toml(extra='phase_check = ["nosuch"]'), "phase_check: 'nosuch' is not a run of proof.toml"),
        (
            proof_toml(("save", "refused"), extra='phase_check = ["refused"]'),
            "phase_check: 'refused' is not a run of proof.toml that starts an engine",
        ),
        ("title = [", "not valid TOML"),
        (
            proof_toml().replace('archive = "b"\n', 'archive = "b"\noutputs = "real weights"\n'),
            "run[2].outputs: 'real weights' is not a plain name",
        ),
        (
            proof_toml().replace(
                'archive = "a"\n', 'archive = "a"\nexpect_refusal = true\ncompare_outputs = true\n', 1
            ),
            "run[1].compare_outputs: a run with expect_refusal = true has no outputs to compare",
        ),
    ],
)
def test_a_bad_proof_toml_is_misuse_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, key: str
) -> None:
    recipe = make_recipe(tmp_path)
    (recipe / "proof.toml").write_text(toml)
    assert prove_cli(recipe, tmp_path / "out") == 2
    assert key in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_runs_env_reaches_only_its_driver_and_the_report_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    recipe = make_recipe(tmp_path, runs=("baseline", "save", "load"))
    toml = (recipe / "proof.toml").read_text()
    toml += '\n[[run]]\nname = "load_fork"\nmode = "load"\narchive = "a"\n'
    toml += 'env = { VLLM_WORKER_MULTIPROC_METHOD = "fork" }\n'
    (recipe / "proof.toml").write_text(toml)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0
    seen = {run: json.loads((out / run / "result.json").read_text())["seen"]["env"] for run in ("load", "load_fork")}
    assert seen["load_fork"]["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert seen["load"]["VLLM_WORKER_MULTIPROC_METHOD"] is None
    assert json.loads((out / "load_fork" / "run.json").read_text())["env"] == {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    logs = {line.split("|")[1].strip(): line for line in report(out)[0].split("## Logs")[1].splitlines()[3:] if line}
    assert logs["load_fork"].endswith("| env VLLM_WORKER_MULTIPROC_METHOD=fork |")
    assert "env " not in logs["load"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ('{ "1BAD" = "x" }', "run[1].env: '1BAD' is not an environment variable name"),
        ("{ FOO = 1 }", "run[1].env.FOO: must be a string, got int (1)"),
        ('{ GRAPHPERSIST_STATS_DIR = "/tmp" }', "run[1].env.GRAPHPERSIST_STATS_DIR: set by the runner for every run"),
        ('{ HOME = "/tmp" }', "run[1].env.HOME: a cache_env variable; the runner sets it per run"),
        ('"fork"', "run[1].env: wrong type str"),
    ],
)
def test_a_bad_run_env_is_misuse_naming_the_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], env: str, message: str
) -> None:
    recipe = make_recipe(tmp_path)
    toml = (recipe / "proof.toml").read_text().replace('archive = "a"\n', f'archive = "a"\nenv = {env}\n', 1)
    (recipe / "proof.toml").write_text(toml)
    assert prove_cli(recipe, tmp_path / "out") == 2
    assert message in capsys.readouterr().err


def test_a_driver_that_cannot_start_fails_its_run(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, runs=("baseline",))
    toml = (recipe / "proof.toml").read_text().replace('["{python}", "driver.py"]', '["./no-such-driver"]')
    (recipe / "proof.toml").write_text(toml)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    detail = report(out)[2]["baseline finished"]["detail"]
    assert detail.startswith("the driver could not be started: [Errno 2]")


def test_unknown_run_in_runs_is_misuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prove_cli(make_recipe(tmp_path), tmp_path / "out", "--runs", "baseline,lod") == 2
    assert "--runs: unknown run(s) lod" in capsys.readouterr().err


def test_runs_subset_runs_only_those_and_reports_the_rest_not_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert prove_cli(make_recipe(tmp_path), out, "--runs", "baseline,save") == 1
    assert sorted(p.name for p in out.iterdir() if (p / "run.json").exists()) == ["baseline", "save"]
    text, _, checks = report(out)
    assert checks["outputs identical"]["status"] == "pass"
    assert checks["outputs identical"]["detail"] == (
        "2 runs identical in sequential, concurrent, oversize; not run: save2, load"
    )
    assert checks["archives a = b"] == {"name": "archives a = b", "status": "not run", "detail": "needs save2"}
    assert {n for n, c in checks.items() if c["status"] == "not run"} == {
        "save2 finished",
        "load finished",
        "archives a = b",
        "load restored every graph",
        "load captured nothing",
        "load no new JIT files",
        "save2 unaccounted <= 5 %",
        "load unaccounted <= 5 %",
        "save2 log clean",
        "load log clean",
    }
    assert text.splitlines()[0].startswith("FAILED: save2 finished, load finished, archives a = b")
    # the rest later, into the same --out: the report then covers every run
    assert prove_cli(make_recipe(tmp_path / "again"), out, "--runs", "save2,load") == 0


def test_check_only_rechecks_an_existing_out_without_running(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0
    started = json.loads((out / "load" / "run.json").read_text())["started"]
    result = json.loads((out / "load" / "result.json").read_text())
    result["outputs"]["oversize"][0][3] = 7
    proofkit.write_result(out / "load" / "result.json", result)
    assert prove_cli(recipe, out, "--check-only") == 1
    _, _, checks = report(out)
    assert checks["outputs identical"]["detail"].startswith("load differs from baseline at oversize[0] (token 3)")
    assert json.loads((out / "load" / "run.json").read_text())["started"] == started


def test_runs_of_another_recipe_in_a_shared_out_count_as_not_run(tmp_path: Path) -> None:
    """Two recipes may share one --out for its warm caches; one whose runs have the other's names must not check the
    other's outputs (a TP=1 report once compared TP=2 runs' tokens this way)."""
    first = make_recipe(tmp_path)
    second = shutil.copytree(first, tmp_path / "another-recipe")  # recipes are known by their folder's name
    out = tmp_path / "out"
    assert prove_cli(first, out) == 0
    assert json.loads((out / "load" / "run.json").read_text())["recipe"] == "recipe"
    assert prove_cli(second, out, "--check-only") == 1
    text, _, checks = report(out)
    assert text.splitlines()[0].startswith("FAILED: ")  # nothing of its own ran: its checks are not passes
    assert checks["load finished"] == {
        "name": "load finished",
        "status": "not run",
        "detail": "not run (its folder holds a run of recipe)",
    }
    assert checks["outputs identical"]["status"] == "not run"
    assert prove_cli(first, out, "--check-only") == 0  # its own runs still check as they did


def test_check_only_without_an_out_is_misuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prove_cli(make_recipe(tmp_path), tmp_path / "nothing", "--check-only") == 2
    assert "does not exist; run the proof first" in capsys.readouterr().err


def test_proofkit_snapshots_results_and_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, triton = tmp_path / "HOME", tmp_path / "TRITON"
    (home / ".cache").mkdir(parents=True)
    triton.mkdir()
    (home / ".cache" / "old").write_text("x")
    monkeypatch.setenv(proofkit.CACHE_DIRS_ENV, os.pathsep.join([str(home), str(triton)]))
    before = proofkit.cache_snapshot()
    assert before == {"HOME/.cache/old"}
    (triton / "k.cubin").write_text("y")
    (triton / "sampling.lock").write_text("")  # a lock taken to load a module is not JIT work
    assert proofkit.new_files(before, proofkit.cache_snapshot()) == ["TRITON/k.cubin"]

    proofkit.write_result(tmp_path / "r" / "result.json", {"ok": True})
    assert json.loads((tmp_path / "r" / "result.json").read_text()) == {"ok": True}
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["result.json"]

    stats = tmp_path / "stats"
    stats.mkdir()
    for rank in (1, 0):
        (stats / f"rank_{rank}.json").write_text(json.dumps({"rank": rank, "captured": 3}))
    assert [s["rank"] for s in proofkit.read_stats(stats)] == [0, 1]
    (stats / "rank_2.json").write_text("{")
    with pytest.raises(ValueError, match=r"rank_2\.json: unreadable stats file"):
        proofkit.read_stats(stats)

    args, extra = proofkit.driver_args(["--run", "load", "--mode", "load", "--result", "r.json", "--tp", "2"])
    assert (args.run, args.mode, args.archive, extra) == ("load", "load", None, ["--tp", "2"])


@pytest.mark.parametrize(
    ("work", "result"),
    [
        ("return {'ok': True, 'n': 1}", {"ok": True, "n": 1}),
        ("raise RuntimeError('engine did not start')", {"ok": False, "error": "RuntimeError: engine did not start"}),
    ],
)
def test_a_drivers_workload_always_leaves_its_result_and_the_process_ends_at_once(
    tmp_path: Path, work: str, result: dict[str, Any]
) -> None:
    """run_and_exit: result.json whatever the workload raised, exit 0 without teardown (no atexit handler runs)."""
    import subprocess

    script = textwrap.dedent(f"""\
        import atexit, sys
        from gptools import proofkit
        atexit.register(lambda: print("teardown ran"))
        def work():
            {work}
        proofkit.run_and_exit(work, sys.argv[1])
        print("not reached")
        """)
    env = dict(os.environ, PYTHONPATH=str(REPO / "tools"))
    target = tmp_path / "run" / "result.json"
    proc = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(target.read_text()) == result
    assert proc.stdout.splitlines() == [f"driver: wrote {target}"]
    assert ("Traceback" in proc.stderr) == (not result["ok"])


@pytest.mark.parametrize("command", [["gptools", "prove"], ["gptools.prove"]])
def test_the_command_has_help_both_ways(command: list[str]) -> None:
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("build", "tools")))
    proc = subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0
    assert "--check-only" in proc.stdout and "--keep-going" in proc.stdout


COMMITTED_RECIPES = sorted(
    str(p.parent.relative_to(REPO / "recipes"))
    for pattern in ("*/proof.toml", "diagnosis/*/proof.toml")
    for p in (REPO / "recipes").glob(pattern)
)


@pytest.mark.parametrize("recipe", COMMITTED_RECIPES)
def test_committed_recipes_parse_and_name_an_existing_driver(recipe: str) -> None:
    """Every committed engine recipe, validated configuration or diagnosis record, parses and its driver file exists
    (a typo fails here, not on a GPU host). A configuration runs all three modes; a diagnosis record may study one
    (e.g. upstream alone, persistence off)."""
    from gptools import prove

    parsed = prove.parse_recipe(REPO / "recipes" / recipe)
    scripts = [part for part in parsed.driver if part.endswith(".py")]
    assert scripts, f"{recipe}: the driver command names no .py file: {parsed.driver}"
    for script in scripts:
        assert (REPO / "recipes" / recipe / script).resolve().is_file(), f"{recipe}: {script} does not exist"
    modes = {r.mode for r in parsed.runs}
    assert modes == {"off", "save", "load"} or (recipe.startswith("diagnosis/") and modes <= {"off", "save", "load"})


def test_a_driver_whose_engine_was_refused_quotes_the_line_from_its_log(tmp_path: Path) -> None:
    """proofkit.expected_refusal: an engine start that raised is ok only when the run's log holds the expected reason,
    and the result quotes that line (check_refused then finds it in the same log)."""
    from gptools import proofkit

    log = tmp_path / "log.txt"
    refusal = "graphpersist: the fused all-reduce + RMSNorm pass (flashinfer) at TP > 1 cannot be persisted: off"
    log.write_text(f"INFO starting\n(EngineCore pid=7) {refusal}\nRuntimeError: Engine core failed\n")
    pattern = r"fused all-reduce \+ RMSNorm pass .* cannot be persisted"
    got = proofkit.expected_refusal(log, pattern, "Engine core initialization failed", settle_s=0)
    assert got["ok"] is True and got["error"] is None
    assert got["refusal"]["matched"].startswith("(EngineCore pid=7) graphpersist: the fused all-reduce")
    assert (got["refusal"]["raised_type"], got["refusal"]["first_mismatch"]) == (None, None)  # only a message given
    missed = proofkit.expected_refusal(log, r"enforce_eager .* cannot be persisted", "boom", settle_s=0)
    assert missed["ok"] is False and "does not match" in missed["error"] and missed["refusal"]["matched"] is None
    absent = proofkit.expected_refusal(tmp_path / "none.txt", pattern, "boom", settle_s=0)
    assert absent["ok"] is False


def test_a_refused_load_raised_in_the_driver_is_recorded_with_its_type_and_first_mismatch(tmp_path: Path) -> None:
    from graphpersist.archive.validate import LoadRefused, Mismatch

    refused = LoadRefused("/a", [Mismatch("flags.max_model_len", 32768, 4096), Mismatch("flags.seed", 0, 1)], 0)
    log = tmp_path / "log.txt"
    log.write_text(f"(EngineCore pid=7) {refused}\n")
    got = proofkit.expected_refusal(log, r"cannot LOAD .*flags\.max_model_len", refused, settle_s=0)["refusal"]
    assert got["raised_type"] == "graphpersist.archive.validate.LoadRefused"
    assert got["first_mismatch"] == "flags.max_model_len: saved 32768, live 4096"
    assert got["raised"] == str(refused)


def test_archive_sizes_count_the_shared_kernel_images_once(tmp_path: Path) -> None:
    """images/ (one file per kernel image for all ranks) is its own column, apart from the ranks and other files."""

    recipe = prove.parse_recipe(make_recipe(tmp_path))
    out = tmp_path / "out"
    root = recipe.archive_path(out, "a")
    for rel, size in {"rank_0/pack.bin": 3 << 20, "rank_1/pack.bin": 3 << 20, "images/k.bin": 5 << 20,
                      "jitcache.tar": 1 << 20, "manifest.json": 1 << 20}.items():  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\0" * size)
    header, rows = proofreport.archive_sizes(recipe, out)
    assert header == ["archive", "rank_0", "rank_1", "kernel images", "shared", "total"]
    assert rows == [["a", "3.0 MiB", "3.0 MiB", "5.0 MiB", "2.0 MiB", "13.0 MiB"]]


# ------------------------------------------------------------------------------------------- real checkpoint runs

REAL_RUNS = ("baseline", "save", "save2", "load", "save_real", "load_real", "baseline_real")


def real_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, complete: bool = True) -> Path:
    """A folder as recipes/gpu-host/real_checkpoint.py leaves it (`.gp-complete` last), named by GP_REAL_MODEL."""
    folder = tmp_path / "qwen3-8b-random"
    folder.mkdir()
    if complete:
        (folder / prove.REAL_MODEL_COMPLETE).write_text("{}\n")
    monkeypatch.setenv(prove.REAL_MODEL_ENV, str(folder))
    return folder


def test_each_output_group_is_compared_only_within_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real checkpoint's runs give other tokens and another archive than the dummy-weight runs: each group passes
    on its own, and no check compares one group's run or archive with the other's."""
    real_model_run = {"change": ["sequential", 0, 3]}
    behaviour = {r: real_model_run for r in ("load_real", "baseline_real", "eager_real")}
    behaviour["save_real"] = {**real_model_run, "world": {"nccl.version": "2.27.5"}}
    real_checkpoint(tmp_path, monkeypatch)
    recipe = make_recipe(tmp_path, behaviour, runs=(*REAL_RUNS, "eager_real"))
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 0
    text, _, checks = report(out)
    assert all(c["status"] == "pass" for c in checks.values()), checks
    assert checks["outputs identical"]["detail"].startswith("4 runs identical in ")
    assert checks["outputs identical (real)"]["detail"].startswith("3 runs identical in ")
    assert [n for n in checks if n.startswith("archives")] == ["archives a = b"]
    assert checks["load_real restored every graph"]["detail"] == "restored = captured by save_real per rank: [4, 4]"
    assert checks["load_real runs the script as upstream"]["detail"].endswith("baseline_real 1")
    assert "- eager_real vs save_real: identical" in text  # not the dummy-weight baseline, which differs


def test_two_real_runs_that_differ_fail_their_groups_check_naming_the_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_checkpoint(tmp_path, monkeypatch)
    recipe = make_recipe(tmp_path, {"load_real": {"change": ["concurrent", 1, 2]}}, runs=REAL_RUNS)
    out = tmp_path / "out"
    assert prove_cli(recipe, out) == 1
    text, _, checks = report(out)
    assert text.splitlines()[0] == "FAILED: outputs identical (real)"
    assert checks["outputs identical"]["status"] == "pass"
    assert checks["outputs identical (real)"]["detail"] == (
        "load_real differs from save_real at concurrent[1] (token 2): "
        "save_real [15, 16, 17] (3 tokens) vs load_real [15, 16, 117] (3 tokens)"
    )


def test_the_real_model_placeholder_becomes_the_checkpoints_absolute_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = real_checkpoint(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(prove.REAL_MODEL_ENV, folder.name)  # relative to prove's cwd; drivers run in the recipe's
    recipe = make_recipe(tmp_path, runs=REAL_RUNS)
    out = tmp_path / "out"
    prove_cli(recipe, out, "--runs", "baseline_real")
    assert json.loads((out / "baseline_real" / "result.json").read_text())["seen"]["extra"] == ["--model", str(folder)]
    assert json.loads((out / "baseline_real" / "run.json").read_text())["command"][-2:] == ["--model", str(folder)]


@pytest.mark.parametrize(
    ("setting", "why"),
    [
        (None, "GP_REAL_MODEL is unset"),
        ("missing", "GP_REAL_MODEL is '{folder}', not a folder"),
        ("incomplete", "GP_REAL_MODEL is '{folder}', which holds no complete checkpoint (no .gp-complete)"),
    ],
)
def test_a_real_model_run_without_a_complete_checkpoint_is_misuse_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], setting: str | None, why: str
) -> None:
    folder = real_checkpoint(tmp_path, monkeypatch, complete=False)
    if setting is None:
        monkeypatch.delenv(prove.REAL_MODEL_ENV)
    elif setting == "missing":
        folder = tmp_path / "nowhere"
        monkeypatch.setenv(prove.REAL_MODEL_ENV, str(folder))
    recipe = make_recipe(tmp_path, runs=REAL_RUNS)
    out = tmp_path / "out"
    assert prove_cli(recipe, out, "--runs", "baseline,load_real") == 2
    first, advice = capsys.readouterr().err.splitlines()
    assert first == f"gptools prove: run(s) load_real: args use {{real_model}}, and {why.format(folder=folder)}"
    assert "python3 recipes/gpu-host/real_checkpoint.py DIR" in advice and "GP_REAL_MODEL=DIR" in advice
    assert not out.exists()  # not even the baseline ran


def test_runs_without_the_real_model_need_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prove.REAL_MODEL_ENV, raising=False)
    recipe = make_recipe(tmp_path, runs=REAL_RUNS)
    out = tmp_path / "out"
    assert prove_cli(recipe, out, "--runs", "baseline,save,save2,load") == 1  # the real runs' checks: not run
    _, _, checks = report(out)
    assert {n for n, c in checks.items() if c["status"] != "pass"} == {
        f"{r} {what}"
        for r in ("save_real", "load_real", "baseline_real")
        for what in ("finished", "log clean", "unaccounted <= 5 %")
    } | {f"load_real {w}" for w in ("restored every graph", "captured nothing", "no new JIT files")} | {
        "outputs identical (real)"
    }
    assert checks["outputs identical (real)"]["status"] == "not run"
