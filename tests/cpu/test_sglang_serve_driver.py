"""The SGLang serve proof driver (recipes/sglang-qwen3-8b-tp2-serve) on CPU, against a fake `sglang.launch_server`.

What a GPU is not needed for: the server command, the readiness rules on SGLang's log lines, the phases, the refusal
regex against graphpersist's own message, and every run of the committed proof.toml through `python -m gptools
prove` with fake_sglang_serve.py standing in for the server (`--server-cmd`): scheduler processes that report ready
only after their graphs, /health that answers 503 until SGLang's warm-up request returned, and a refused LOAD that
ends the way SGLang's does (SIGQUIT to the main process, which SIGKILLs its whole tree and itself).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import make_dataclass
from pathlib import Path
from typing import Any

import pytest
import serve_fixtures
from module_file import load_module

from gptools import jsonfile, proofkit, serveproof
from gptools.__main__ import main as gptools_main
from graphpersist.archive.validate import LoadRefused, Mismatch

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "sglang-qwen3-8b-tp2-serve"
FAKE = Path(__file__).resolve().with_name("fake_sglang_serve.py")


serve_driver = load_module(RECIPE / "serve_driver.py", "sglang_serve_driver")  # not the vLLM recipe's serve_driver
REFUSED = next(r for r in tomllib.loads((RECIPE / "proof.toml").read_text())["run"] if r["name"] == "serve_refused")


DRIVER = serve_fixtures.ServeDriver(RECIPE, FAKE, "context_length")
driver_command, drive, saved_archive = DRIVER.command, DRIVER.drive, DRIVER.saved_archive
free_port, gone, wait_gone = serve_fixtures.free_port, serve_fixtures.gone, serve_fixtures.wait_gone


@pytest.fixture
def fake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    serve_fixtures.runtime_importable(monkeypatch, "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION")


# ------------------------------------------------------------------------------------------- pure parts


def parsed(*argv: str) -> tuple[Any, list[str]]:
    return serveproof.parse_args(serve_driver.ENGINE, "test", ["--run", "r", "--result", "/tmp/r.json", *argv])


def test_the_launch_command_is_the_llm_recipes_settings_and_extra_flags_replace_them() -> None:
    a, extra = parsed("--mode", "load", "--archive", "/a", "--", "--context-length", "2048", "--enable-metrics")
    cmd = serve_driver.launch_command(a, Path("/m"), extra)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]  # SGLang spawns: no `graphpersist exec`
    flags = dict(zip(cmd[3:-1:2], cmd[4:-1:2], strict=True))
    assert flags == {
        "--model-path": "/m",
        "--host": "127.0.0.1",
        "--port": "8000",
        "--tp-size": "2",
        "--mem-fraction-static": "0.5",
        "--random-seed": "0",
        "--load-format": "dummy",
        "--graph-persist": "load",
        "--graph-persist-dir": "/a",
        "--context-length": "2048",  # the run's value, given once
    }
    assert cmd[-1] == "--enable-metrics"

    a, extra = parsed("--mode", "off", "--model", "/ckpt", "--server-cmd", "fake --x", "--", "--context-length=1024")
    cmd = serve_driver.launch_command(a, Path("/ckpt"), extra)
    assert cmd[:2] == ["fake", "--x"]
    assert "--graph-persist" not in cmd and "--load-format" not in cmd and "--context-length" not in cmd
    assert cmd[-1] == "--context-length=1024"
    assert str(serve_driver.llm_driver.CONTEXT_LENGTH) == "4096"  # the LLM recipe's, which proof.toml's refusal names


MAIN = "[2026-11-30 12:00:30] "
RESTORED = "[2026-11-30 12:00:20 TP{r}] graphpersist: rank {r}: restored 94 graphs from /a in 1.10 s (open ...)"
ENGINE_READY = MAIN + "Engine startup timings (s): load_weight=0.13, kv_cache_allocation=0.03, scheduler_e2e=9.00, ..."
MODELS_200 = MAIN + 'INFO:     127.0.0.1:51234 - "GET /v1/models HTTP/1.1" 200'
HEALTH_503 = MAIN + 'INFO:     127.0.0.1:51235 - "GET /health HTTP/1.1" 503'
GENERATE_200 = MAIN + 'INFO:     127.0.0.1:51236 - "POST /generate HTTP/1.1" 200'


def test_readiness_on_sglangs_lines_counts_any_200_and_not_a_503() -> None:
    problems = serve_driver.READINESS.problems
    both = [RESTORED.format(r=0), RESTORED.format(r=1)]
    assert problems([*both, ENGINE_READY, HEALTH_503, MODELS_200], "load", 2)[0] == []
    found, evidence = problems([RESTORED.format(r=0), ENGINE_READY, HEALTH_503, GENERATE_200, RESTORED.format(r=1)],
                               "load", 2)  # fmt: skip
    assert found == ["log line 4 answered 200 before the graphs were restored (line 5)"]  # the 503 is no answer
    assert evidence["first_200"]["text"] == GENERATE_200
    assert problems([*both, MODELS_200, ENGINE_READY], "load", 2)[0] == [
        "log line 3 answered 200 before the engine was ready (line 4)"
    ]
    assert problems([*both, ENGINE_READY, HEALTH_503], "load", 2)[0] == [
        "no access-log line of an HTTP 200 (any request) in the server's log"
    ]


class LoggedServer:
    """A Server's lines with read times, for phases() (no process)."""

    def __init__(self, lines: list[tuple[float, str]], births: list[tuple[float, int, str]] | None = None) -> None:
        self.lines, self.births = lines, births or []

    def born(self, title: str) -> float | None:
        return serveproof.proofkit.born(self.births, title)

    def log(self) -> list[str]:
        return [line for _, line in self.lines]

    def line_time(self, pattern: re.Pattern[str], last: bool = False) -> float | None:
        times = [t for t, line in self.lines if pattern.search(line)]
        return (times[-1] if last else times[0]) if times else None


def test_phases_add_up_to_healthy_and_split_the_api_start_from_sglangs_warm_up() -> None:
    summary = ("Engine startup timings (s): load_weight=1.50, kv_cache_allocation=0.40, scheduler_e2e=25.00, "
               "cuda_graph={prefill=1.10, decode=0.50}, tokenizer_e2e=30.00")  # fmt: skip
    server = LoggedServer([(40.0, MAIN + summary), (41.5, MODELS_200), (44.0, GENERATE_200)])
    stats = [{"rank": r, "phases": {"restore": 1.2 + r / 10, "kv_cache": 0.5, "warmup": 0.3}} for r in (0, 1)]
    phases = serve_driver.phases(server, 45.0, stats)
    assert list(phases) == [
        "start", "handoff", "weights", "profile", "kv_warmup", "graphs", "save", "rest_of_init", "serve_start",
        "server_warmup",
    ]  # fmt: skip
    assert phases["start"] == 15.0 and phases["graphs"] == 1.3  # the slowest rank's restore
    assert phases["handoff"] == 0.0  # the summary line is the engine's ready line
    assert phases["serve_start"] == 1.5 and phases["server_warmup"] == 3.5
    assert sum(phases.values()) == pytest.approx(45.0, abs=0.01)
    assert serve_driver.phases(LoggedServer([(3.0, MODELS_200)]), 4.0, []) == {}  # no summary line: not measured


def test_with_the_servers_first_line_and_the_schedulers_birth_the_start_is_measured() -> None:
    summary = ("Engine startup timings (s): load_weight=1.50, kv_cache_allocation=0.40, scheduler_e2e=25.00, "
               "cuda_graph={prefill=1.10, decode=0.50}, tokenizer_e2e=30.00")  # fmt: skip
    lines = [(9.0, "server_args=ServerArgs(model_path='m')"), (20.0, "[TP0] Load weight end. elapsed=1.50 s"),
             (38.0, "[TP0] graphpersist: rank 0: restored 3 graphs from a in 1.20 s"), (40.0, MAIN + summary),
             (41.5, MODELS_200)]  # fmt: skip
    server = LoggedServer(
        lines, births=[(0.0, 10, "python -m sglang.launch_server"), (10.0, 11, "sglang::scheduler_TP0")]
    )
    stats = [{"rank": 0, "phases": {"restore": 1.2, "kv_cache": 0.5, "warmup": 0.3}}]
    phases = serve_driver.phases(server, 45.0, stats)
    assert (phases["front_boot"], phases["engine_launch"], phases["scheduler_boot"]) == (9.0, 1.0, 5.0)
    assert (phases["scheduler_setup"], phases["after_graphs"], phases["start"]) == (3.5, 2.0, 0.0)
    assert phases["rest_of_init"] == pytest.approx(25.0 - 1.5 - 0.8 - 1.2 - 3.5 - 2.0)  # weights end to restore end
    assert sum(phases.values()) == pytest.approx(45.0, abs=0.01)


def test_the_refusal_regex_matches_what_a_refused_load_prints() -> None:
    # The overlay's facts (no SGLang import at module level): context_length is among the flags LOAD compares.
    graphpersist_facts = load_module(
        REPO / "overlays/sglang/sglang/srt/graphpersist_facts.py", "sglang_graphpersist_facts"
    )
    server_args = make_dataclass("ServerArgs", [("context_length", int), ("model_path", str)])(2048, "m")
    assert graphpersist_facts.config_flags(server_args, {})["context_length"] == 2048
    message = str(LoadRefused("/out/archives/serve_a", [Mismatch("model.config_fingerprint", "e5", "3d"),
                                                        Mismatch("flags.context_length", 4096, 2048)], 0))  # fmt: skip
    log = f"[2026-11-30 12:00:00 TP0] Scheduler hit an exception: Traceback (most recent call last):\n{message}\n"
    pattern = REFUSED["args"][REFUSED["args"].index("--expect-refusal") + 1]
    match = re.search(pattern, log, re.DOTALL)
    assert match is not None
    assert proofkit.refusal_lines(log, match)[1] == "  flags.context_length: saved 4096, live 2048"
    assert REFUSED["args"][-2:] == ["--context-length", "2048"]


def test_help_needs_no_sglang() -> None:
    proc = subprocess.run([sys.executable, str(RECIPE / "serve_driver.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "python -m sglang.launch_server" in proc.stdout and "--expect-refusal" in proc.stdout


def test_exit_text_names_the_signal_that_ended_a_server() -> None:
    assert [serveproof.exit_text(c) for c in (0, 1, -9, -15)] == ["exit 0", "exit 1", "killed by SIGKILL",
                                                                   "killed by SIGTERM"]  # fmt: skip


# ------------------------------------------------------------------------------------------- against the fake


@pytest.mark.parametrize("killpg", [False, True], ids=["sigquit-to-main", "killpg-opt-in"])
def test_a_refused_load_ends_the_server_by_sigkill_and_the_driver_records_it(
    tmp_path: Path, fake_env: None, killpg: bool
) -> None:
    """SGLang's scheduler SIGQUITs the main process, which SIGKILLs its tree and itself (or, opted in, the scheduler
    SIGKILLs its process group): the driver, outside that tree and group, writes its result all the same."""
    pid_file = tmp_path / "server.pid"
    env = {"SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1"} if killpg else {}
    result, printed = drive(tmp_path, "refused", "load", *REFUSED["args"], archive=saved_archive(tmp_path),
                            behaviour={"pid_file": str(pid_file)}, env=env)  # fmt: skip
    assert result["ok"] is True, result["error"]
    refusal = result["refusal"]
    assert (refusal["exit_code"], refusal["exit"]) == (-9, "killed by SIGKILL") and refusal["exited_s"] > 0
    assert refusal["matched"] == "  flags.context_length: saved 4096, live 2048"
    assert refusal["first_line"].startswith("graphpersist.archive.validate.LoadRefused: graphpersist: cannot LOAD ")
    assert "Scheduler hit an exception: Traceback" in printed
    if not killpg:  # the opt-in group kill may end the main process before its handler runs
        assert "Received sigquit from a child process. It usually means the child failed." in printed
    assert result["outputs"] == {} and "/health 200" not in result["readiness"]["polls"]["answers"]
    assert result["server"]["shutdown"]["signal"] is None  # it had ended by itself
    command = result["server"]["command"]
    assert command.count("--context-length") == 1 and command[command.index("--context-length") + 1] == "2048"
    assert "serve_driver: refused as expected (killed by SIGKILL)" in printed
    assert proofkit.group_members(int(pid_file.read_text())) == []  # no scheduler left behind


def test_a_refusal_run_fails_when_the_server_becomes_healthy(tmp_path: Path, fake_env: None) -> None:
    result, _ = drive(tmp_path, "refused", "load", "--expect-refusal", "cannot LOAD", archive=saved_archive(tmp_path))
    assert result["ok"] is False
    assert "answered /health with 200 after" in result["error"] and "it was not refused" in result["error"]


def test_a_refusal_that_never_exits_fails_and_the_server_is_ended(tmp_path: Path, fake_env: None) -> None:
    pid_file = tmp_path / "server.pid"
    behaviour = {"refuse_and_hang": True, "pid_file": str(pid_file)}
    args = [*REFUSED["args"][:2], "--ready-timeout", "4", "--stop-grace", "1", *REFUSED["args"][2:]]
    result, _ = drive(tmp_path, "refused", "load", *args, behaviour=behaviour, archive=saved_archive(tmp_path))
    assert result["ok"] is False
    assert result["error"] == "the server did not exit within 4 s (refusal logged: True)"
    assert wait_gone(int(pid_file.read_text()))


def test_a_load_that_fits_serves_and_every_answer_comes_after_the_restore(tmp_path: Path, fake_env: None) -> None:
    result, printed = drive(tmp_path, "load", "load", archive=saved_archive(tmp_path))
    assert result["ok"] is True, result["error"]
    times = result["readiness"]["times"]
    assert times["graphs_done_s"] < times["engine_ready_s"] <= times["first_200_line_s"]
    assert times["first_200_polled_s"] <= times["warmup_done_s"] <= times["healthy_s"]  # /v1/models before warm-up
    answers = result["readiness"]["polls"]["answers"]
    assert answers["/health 503"] >= 1 and answers["/health 200"] == 1  # 503 while SGLang warmed itself up
    lines = [g["line"] for g in result["readiness"]["graphs"]]
    assert len(lines) == 2 and max(lines) < result["readiness"]["first_200"]["line"]
    assert result["engine"] == {"name": "sglang", "version": "0.5.17+fake"}
    assert [len(result["outputs"][w]) for w in ("sequential", "concurrent", "streamed", "chat")] == [4, 16, 1, 2]
    assert result["server"]["shutdown"]["exit_code"] == -9  # SGLang's SIGTERM path ends by SIGKILLing itself
    assert result["server"]["shutdown"]["killed_after_grace"] is False
    assert "Draining requests and shutting down" in printed


def test_a_server_that_answers_before_its_graphs_are_restored_fails(tmp_path: Path, fake_env: None) -> None:
    result, _ = drive(tmp_path, "early", "load", "--stop-grace", "1", behaviour={"answer_before_ready": True},
                      archive=saved_archive(tmp_path))  # fmt: skip
    assert result["ok"] is False
    assert re.search(r"log line \d+ answered 200 before the engine was ready \(line \d+\)", result["error"])
    assert re.search(r"log line \d+ answered 200 before the graphs were restored \(line \d+\)", result["error"])


def test_a_stream_that_differs_from_the_plain_answer_fails(tmp_path: Path, fake_env: None) -> None:
    result, _ = drive(tmp_path, "stream", "off", behaviour={"stream_differs": True})
    assert result["ok"] is False
    assert result["error"].startswith("the streamed completion differs from the same request unstreamed")


def test_a_server_that_exits_before_it_is_healthy_fails(tmp_path: Path, fake_env: None) -> None:
    result, printed = drive(tmp_path, "crash", "off", behaviour={"exit_code": 3})
    assert result == {
        "ok": False,
        "error": "RuntimeError: the server exited with code 3 before /health answered 200 (the log says why)",
    }
    assert "RuntimeError: the fake server fell over" in printed


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path, fake_env: None) -> None:
    pid_file = tmp_path / "server.pid"
    result, _ = drive(tmp_path, "stubborn", "off", "--stop-grace", "1",
                      behaviour={"ignore_term": True, "pid_file": str(pid_file)})  # fmt: skip
    assert result["ok"] is True, result["error"]
    shutdown = result["server"]["shutdown"]
    assert shutdown["signal"] == "SIGTERM" and shutdown["killed_after_grace"] is True and shutdown["exit_code"] == -9
    assert wait_gone(int(pid_file.read_text()))


# ------------------------------------------------------------------------------------------- the committed proof


@pytest.fixture(scope="module")
def proof(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The committed proof.toml, its driver pointed at the fake server, run by `python -m gptools prove`."""
    tmp = tmp_path_factory.mktemp("sglang-serve-proof")
    (tmp / "model").mkdir()
    recipe = tmp / "recipe"
    recipe.mkdir()
    fake = ["--model", str(tmp / "model"), "--port", str(free_port()), "--server-cmd", f"{sys.executable} {FAKE}"]
    text = (RECIPE / "proof.toml").read_text()
    [driver_line] = [line for line in text.splitlines() if line.startswith("driver = ")]
    driver = json.loads(driver_line.removeprefix("driver = "))
    driver[1] = str(RECIPE / driver[1])
    (recipe / "proof.toml").write_text(text.replace(driver_line, f"driver = {json.dumps(driver + fake)}"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(str(REPO / p) for p in ("overlays/graphpersist", "tools")))
        for name in ("FAKE_SERVE", "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION"):
            env.delenv(name, raising=False)
        code = gptools_main(["prove", str(recipe), "--out", str(tmp / "out")])
    report = jsonfile.load(tmp / "out" / "report.json.gz")
    assert code == 0, [c for c in report["checks"] if c["status"] != "pass"]
    return tmp / "out", report


def test_the_committed_proof_passes_against_the_fake_server(proof: tuple[Path, dict[str, Any]]) -> None:
    report = proof[1]
    checks = {c["name"]: c for c in report["checks"]}
    assert report["headline"] == "all checks passed"
    assert checks["outputs identical"]["detail"] == "3 runs identical in sequential, concurrent, streamed, chat"
    assert checks["serve_refused refused"]["detail"].endswith("flags.context_length: saved 4096, live 2048")
    assert checks["serve_load restored every graph"]["status"] == "pass"
    assert checks["serve_load captured nothing"]["status"] == "pass"
    assert not [name for name in checks if name.startswith("serve_refused") and "log clean" in name]
    assert [t["name"] for t in report["targets"] if t["status"] == "not measured"] == []


def test_each_serving_run_records_readiness_phases_and_shutdown(proof: tuple[Path, dict[str, Any]]) -> None:
    out, _ = proof
    for run in ("serve_save", "serve_load", "serve_baseline"):
        result = json.loads((out / run / "result.json").read_text())
        readiness = result["readiness"]
        assert readiness["first_200"]["line"] > readiness["engine_ready"][0]["line"]
        assert sum(result["phases"].values()) == pytest.approx(result["start_to_ready_s"], abs=0.01)
        assert min(result["phases"].values()) >= 0 and result["phases"]["weights"] == 0.05
        assert result["phases"]["server_warmup"] > 0.25  # the fake's warm-up waits 0.3 s, as SGLang's waits 1 s
        assert all(len(tokens) == serveproof.GEN for w in result["outputs"].values() for tokens in w)
        assert result["texts"]["chat"][0].startswith(" w")
        log = (out / run / "log.txt").read_text()
        assert '"POST /generate HTTP/1.1" 200' in log  # SGLang's warm-up request, in the run's log
    load = json.loads((out / "serve_load" / "result.json").read_text())
    assert sorted(g["text"].split("graphpersist: ")[1][:25] for g in load["readiness"]["graphs"]) == [
        "rank 0: restored 3 graphs",
        "rank 1: restored 3 graphs",
    ]
    refused = json.loads((out / "serve_refused" / "result.json").read_text())
    assert refused["refusal"]["exit"] == "killed by SIGKILL"
