"""gptools.hostkit, the runtime recipes' shared host plumbing, without a GPU: ranks that pass, raise, die without a
result or hang; a step process; the group verdicts; the versions block on a host without nvidia-smi; the report's
head and where the results land. What the proofs' reports say stays theirs (test_deepep_ep2_proof.py renders one)."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gptools import hostkit

TOOLS = Path(hostkit.__file__).resolve().parents[1]  # what a proof puts on sys.path


def script(tmp_path: Path, body: str) -> Path:
    """A rank or step program that imports hostkit the way the proofs do."""
    path = tmp_path / "prog.py"
    path.write_text(f"import json, os, sys, time\nsys.path.insert(0, {str(TOOLS)!r})\n"
                    "from gptools import hostkit\n"
                    + textwrap.dedent(body))  # fmt: skip
    return path


def test_free_port_is_one_nobody_listens_on() -> None:
    port = hostkit.free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: a rendezvous can listen there


def test_ranks_that_pass_raise_or_die_are_each_reported(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        rank, result = int(os.environ["RANK"]), __import__("pathlib").Path(sys.argv[1])
        env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "PYTHONUNBUFFERED", "X")}
        def boom():
            raise RuntimeError("rank 1 broke")
        if rank == 0:
            hostkit.finish_rank(0, result, lambda: {"rank": 0, "env": env, "port": os.environ["MASTER_PORT"]})
        if rank == 1:
            hostkit.finish_rank(1, result, boom)
        print("rank 2 dies before writing", flush=True)
        sys.exit(3)
    """)  # fmt: skip
    (tmp_path / "g.rank2.json").write_text('{"stale": "from an earlier run"}')
    group = hostkit.run_ranks("g", tmp_path, 3, lambda r, res: [sys.executable, str(prog), str(res)], {"X": "1"},
                              timeout=60, tag="test")  # fmt: skip
    ok, raised, died = group["ranks"]
    assert ok["env"] == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                         "PYTHONUNBUFFERED": "1", "X": "1"}  # fmt: skip
    assert int(ok["port"]) > 0 and "error" not in ok and "log_tail" not in ok
    assert raised["error"] == "RuntimeError: rank 1 broke" and "in boom" in raised["trace"]
    assert died == {"error": "no result (rc 3)", "log_tail": "rank 2 dies before writing\n"}
    assert not hostkit.group_ok(group)
    errors = hostkit.group_errors(group)
    assert errors.startswith("rank 1: RuntimeError: rank 1 broke at File ") and "in boom" in errors
    assert "rank 2: no result (rc 3)" in errors and "rank 0" not in errors


def test_a_rank_past_the_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        print("waiting for a peer that never comes", flush=True)
        time.sleep(60)
    """)  # fmt: skip
    group = hostkit.run_ranks("hang", tmp_path, 1, lambda r, res: [sys.executable, str(prog)], {}, timeout=0, tag="t")
    (rank,) = group["ranks"]
    assert rank["error"] == "no result (rc -9)" and "never comes" in rank["log_tail"]
    assert group["wall_s"] < 30


def test_a_step_process_returns_its_result_or_its_log(tmp_path: Path) -> None:
    prog = script(tmp_path, """
        if sys.argv[1] == "hang":
            print("stuck", flush=True)
            time.sleep(60)
        result = sys.argv[sys.argv.index("--result") + 1]
        open(result, "w").write(json.dumps({"unbuffered": os.environ["PYTHONUNBUFFERED"]}))
    """)  # fmt: skip
    done = hostkit.run_step([sys.executable, str(prog), "ok"], tmp_path, "ok", {}, timeout=60)
    assert done["unbuffered"] == "1" and done["_rc"] == 0 and "_log_tail" not in done
    stuck = hostkit.run_step([sys.executable, str(prog), "hang"], tmp_path, "hang", {}, timeout=1)
    assert stuck["_rc"] == "timeout" and stuck["_log_tail"] == "stuck\n"
    assert set(stuck) == {"_rc", "_wall_s", "_log_tail"}


def test_a_result_cut_short_reads_as_no_result(tmp_path: Path) -> None:
    (tmp_path / "half.json").write_text('{"rank": 0, "outp')
    assert hostkit.read_result(tmp_path / "half.json") is None
    assert hostkit.read_result(tmp_path / "missing.json") is None


def test_group_verdicts() -> None:
    refused = {"ranks": [{"rank": 0}, {"rank": 1, "refused": {"message": "LOAD refused: tp_size"}}]}
    assert hostkit.group_ok({"ranks": [{"rank": 0}, {"rank": 1}]})
    assert not hostkit.group_ok(refused) and not hostkit.group_ok({"ranks": []}) and not hostkit.group_ok(None)
    assert hostkit.group_errors(refused) == "rank 1: LOAD refused: tp_size"
    assert hostkit.group_errors({"ranks": [{"error": "x" * 900}]}, width=500) == "rank 0: " + "x" * 492
    assert hostkit.group_errors(None) == ""


def test_versions_in_the_reports_order_on_a_host_without_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, no gcc
    monkeypatch.setitem(hostkit.PROBES, "answer", "print('noise'); print(42)")
    monkeypatch.setitem(hostkit.PROBES, "missing", "import no_such_module_here")
    one = hostkit.versions(["answer", "missing"], gcc=True)
    assert list(one) == ["host", "gpu / driver", "python", "answer", "missing", "gcc"]
    assert one["gpu / driver"] == "?" and one["gcc"] == "?" and one["answer"] == "42"
    assert one["missing"] == "ModuleNotFoundError: No module named 'no_such_module_here'"
    assert list(hostkit.versions([], every_gpu=True)) == ["host", "gpus", "python"]


def test_report_head_says_what_failed_first() -> None:
    started = datetime(2026, 12, 1, 6, 24, 51, tzinfo=UTC)
    checks = [("LOAD ran", True, "rc 0"), ("outputs identical", False, "a | b"), ("zero captures", False, "")]
    lines, failed = hostkit.report_head("r: GPU proof report", started, {"host": "vm"}, ["- model: m"], checks)
    assert failed == ["outputs identical", "zero captures"]
    assert lines == [
        "FAILED: outputs identical; zero captures", "", "# r: GPU proof report", "",
        "- date: 2026-12-01T06:24:51+00:00", "- host: vm", "- model: m", "",
        "## Checks", "", "| check | result | detail |", "|---|---|---|",
        "| LOAD ran | PASS | rc 0 |", "| outputs identical | FAIL | a / b |", "| zero captures | FAIL |  |",
    ]  # fmt: skip
    assert hostkit.report_head("r", started, {}, [], checks[:1])[0][0] == "all checks passed"


def test_publish_keeps_the_results_when_the_render_fails(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "REPORT.md"
    out.mkdir()
    assert hostkit.publish(out, report, {"a": 1}, lambda res: ("all checks passed\n", [])) == 0
    assert report.read_text() == (out / "REPORT.md").read_text() == "all checks passed\n"
    assert hostkit.publish(out, report, {"a": 2}, lambda res: ("FAILED: x\n", ["x"])) == 1

    def broken(res: Any) -> tuple[str, list[str]]:
        raise KeyError("save")

    with pytest.raises(KeyError):
        hostkit.publish(out, report, {"a": 3}, broken)
    assert json.loads((out / "results.json").read_text()) == {"a": 3}
