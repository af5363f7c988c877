"""The test harness itself: parallel runs still fail when nothing ran, summary lines reach the terminal from
pytest-xdist's workers, and the cached vLLM dependency layer is keyed by what it is made of and pruned safely."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vllm_cpu_venv

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "PYTEST_ADDOPTS")}


def test_make_test_fast_in_parallel_still_fails_when_no_test_ran() -> None:
    """pytest's exit 5 (nothing collected or everything deselected) must fail the verb under xdist too."""
    prefix = Path(sys.prefix)
    cmd = ["make", "-o", f"{prefix}/.ready", "test-fast", f"VENV={prefix}", "JOBS=2"]
    cmd.append("PYTEST_ARGS=tests/cpu/test_rebase.py -k no_test_is_named_like_this")
    returncode, out = _run_in_own_group(cmd, timeout=600)
    assert returncode != 0, out
    assert "-n 2 --dist loadfile" in out and "no tests ran" in out and "Error 5" in out, out


def _run_in_own_group(cmd: list[str], timeout: float) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `cmd` in a process group of its own. Alone it takes about 2 s; on a loaded CI
    machine it once ran past a 300 s limit with nothing said, so a run past `timeout` fails with what each process
    of the group was doing then, and the whole group (make, pytest and its workers) is killed, not make alone."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ps = subprocess.run(["ps", "-o", "pid,stat,etime,time,wchan:20,args", "-g", str(proc.pid)],
                            capture_output=True, text=True).stdout  # fmt: skip
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s; its processes then:\n{ps}\nits output:\n{out}")
    return proc.returncode, out


def test_a_summary_line_and_the_deselected_count_reach_the_terminal_from_xdist_workers(tmp_path: Path) -> None:
    (tmp_path / "test_counts.py").write_text(
        "def test_counts(record_property):\n    record_property('summary', 'fuzz: 1000 cases, 0 crashed')\n\n\n"
        "def test_other():\n    pass\n"
    )
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), *sys.path])}
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "2", "-q"]
    cmd += ["-k", "not other"]
    proc = subprocess.run([*cmd, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = proc.stdout.split(" summaries ", 1)
    assert len(section) == 2, proc.stdout
    assert "fuzz: 1000 cases, 0 crashed" in section[1] and "1 deselected (by -m/-k" in section[1], proc.stdout


def _fake_repo(root: Path) -> Path:
    (root / "tests" / "requirements").mkdir(parents=True)
    for name in vllm_cpu_venv.REQUIREMENTS:
        shutil.copyfile(REPO / "tests" / "requirements" / name, root / "tests" / "requirements" / name)
    return root


def test_the_dependency_layer_is_keyed_by_each_requirement_file(tmp_path: Path) -> None:
    repo = _fake_repo(tmp_path)
    key = vllm_cpu_venv.deps_key(repo)
    assert key == vllm_cpu_venv.deps_key(REPO)
    for name in vllm_cpu_venv.REQUIREMENTS:
        path = repo / "tests" / "requirements" / name
        before = path.read_text()
        path.write_text(before + "# changed\n")
        assert vllm_cpu_venv.deps_key(repo) != key, name
        path.write_text(before)


def test_pruning_keeps_the_recent_layers_and_any_used_in_the_last_hour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_cpu_venv, "KEEP_DEPS", 2)
    now = time.time()
    ages = {"a": 10, "b": 5 * 3600, "c": 2 * 86400, "d": 30 * 60, "e": 3 * 86400}  # seconds since last use
    for name, age in ages.items():
        layer = tmp_path / f"vllm-cpu-deps-{name}"
        layer.mkdir()
        (layer / vllm_cpu_venv.COMPLETE).write_text("x")
        os.utime(layer / vllm_cpu_venv.COMPLETE, (now - age, now - age))
    (tmp_path / "vllm-cpu-deps-half").mkdir()  # a build in progress elsewhere (no marker yet): never touched
    vllm_cpu_venv._prune(tmp_path, keep=tmp_path / "vllm-cpu-deps-e")
    left = sorted(p.name.removeprefix("vllm-cpu-deps-") for p in tmp_path.iterdir())
    assert left == ["a", "d", "e", "half"], left  # the two newest, the one asked for; b and c are older than 2
