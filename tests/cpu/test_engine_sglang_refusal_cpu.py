"""A refused LOAD in SGLang raises in the process that launched it (patch 0010), and that process survives.

Upstream's scheduler, failing to start, signals its parent with SIGQUIT, whose launch-phase handler kills the whole
process tree, the user's own Python process included. These tests run SGLang's own functions from the pinned wheel
(series applied) in a launcher process of their own, with stand-ins only where SGLang would need its GPU stack:
`run_scheduler_process` (its failure path: log, SIGQUIT to the parent), the launch-phase SIGQUIT handler of
`_set_envs_and_config`, `_wait_for_scheduler_ready` and `_scheduler_died_error`. The scheduler is a real child process
whose `Scheduler` stands in: it raises as a session step raises, inside the glue's recording. SGLang itself cannot
be imported here (CPython 3.12 only, no CPU torch), nor psutil, whose two uses stand in too.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERLAY_SRT = REPO / "overlays" / "sglang" / "sglang" / "srt"
ENGINE = "sglang/srt/entrypoints/engine.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (builds the interposer)")


def functions(source: str, names: tuple[str, ...]) -> str:
    """The source of the named functions, at any depth of `source` (a nested one is dedented to the top level)."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found[node.name] = textwrap.dedent(ast.get_source_segment(source, node, padded=True) or "")
    assert sorted(found) == sorted(names), f"missing in the pinned source: {set(names) - set(found)}"
    return "\n\n".join(found[n] for n in names)


@pytest.fixture(scope="module")
def sglang_functions(upstream_tree: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SGLang's functions under test, as the built wheel has them: engine.py with the series applied."""
    from gptools import apply as gpapply
    from gptools import series as gpseries

    patches_dir = REPO / "patches" / "sglang"
    patches = [gpseries.read_patch(patches_dir / n) for n in gpseries.read_series(patches_dir).names]
    tree = tmp_path_factory.mktemp("sglang-engine")
    (tree / ENGINE).parent.mkdir(parents=True)
    shutil.copyfile(upstream_tree("sglang") / ENGINE, tree / ENGINE)
    for patch in patches:
        if ENGINE in gpapply.touched_paths([patch]):
            gpapply.apply_patch(tree, patch)
    engine = (tree / ENGINE).read_text()
    scheduler = (upstream_tree("sglang") / SCHEDULER).read_text()
    out = tree / "sglang_functions.py"
    out.write_text(
        "from __future__ import annotations\n\n"
        + functions(engine, ("launch_phase_sigquit_handler", "_scheduler_died_error", "_wait_for_scheduler_ready"))
        + "\n\n"
        + functions(scheduler, ("run_scheduler_process",))
    )
    return out


LAUNCHER = '''
import json, logging, multiprocessing, os, signal, sys, types

# The overlay modules as sglang.srt.* (no SGLang here), and the stand-ins of what SGLang's functions call.
for name, path in (("sglang", [os.path.dirname({srt!r})]), ("sglang.srt", [{srt!r}]), ("sglang.srt.utils", [])):
    module = types.ModuleType(name)
    module.__path__ = path
    sys.modules[name] = module
kill_calls = []


def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=None):
    """Upstream's semantics (sglang.srt.utils.common): SIGKILL to every child, then to the parent if asked."""
    kill_calls.append(include_parent)
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGKILL)
    if include_parent:
        os.kill(parent_pid, signal.SIGKILL)


common = types.ModuleType("sglang.srt.utils.common")
common.kill_process_tree = kill_process_tree
sys.modules["sglang.srt.utils.common"] = common

from graphpersist.archive.validate import LoadRefused, Mismatch
from graphpersist.engine import PersistError
from sglang.srt import graphpersist_switch


class Scheduler:
    """The scheduler's start, failing as a session step fails (inside the glue's recording)."""

    def __init__(self, *args):
        from graphpersist import engine

        with engine.recording_refusals():
            if {failure!r} == "refused":
                raise LoadRefused(os.environ.get("GRAPHPERSIST_DIR", "archive"),
                                  [Mismatch("flags.context_length", 32768, 4096)], 0)
            raise ValueError("an error of SGLang's own")


def parent():
    return types.SimpleNamespace(send_signal=lambda sig: os.kill(os.getppid(), sig))


SGLANG = dict(
    os=os, signal=signal, logger=logging.getLogger("sglang"), kill_process_tree=kill_process_tree, List=list,
    Dict=dict, load_plugins=lambda: None, configure_scheduler_process=lambda *a, **k: a[7],
    publish=lambda *a, **k: None, psutil=types.SimpleNamespace(Process=lambda: types.SimpleNamespace(parent=parent)),
    Scheduler=Scheduler, get_exception_traceback=lambda: "Traceback ...",
    envs=types.SimpleNamespace(SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=types.SimpleNamespace(get=lambda: False)),
)
exec(compile(open({functions!r}).read(), "sglang (pinned, series applied)", "exec"), SGLANG)

graphpersist_switch.resolve_server_args(types.SimpleNamespace(graph_persist={mode!r}, graph_persist_dir={archive!r}))
signal.signal(signal.SIGQUIT, SGLANG["launch_phase_sigquit_handler"])
fork = multiprocessing.get_context("fork")
reader, writer = fork.Pipe(duplex=False)
server_args = types.SimpleNamespace(enable_trace=False)
scheduler = fork.Process(target=SGLANG["run_scheduler_process"],
                         args=(server_args, None, 0, 0, 0, 0, 0, 0, None, writer))
scheduler.start()
try:
    SGLANG["_wait_for_scheduler_ready"]([reader], [scheduler])
except Exception as exc:
    cause = exc.__cause__
    print(json.dumps({{"raised": type(exc).__name__, "lines": str(exc).splitlines(), "kill_calls": kill_calls,
                      "cause": None if cause is None else str(cause).split(". ")[0],
                      "alive": [p.pid for p in multiprocessing.active_children()]}}))
'''


def launch(functions_file: Path, tmp_path: Path, mode: str, failure: str) -> subprocess.CompletedProcess[str]:
    """The launcher above in a process of its own (SIGQUIT may kill it), persistence `mode`, the scheduler failing
    with `failure` (refused: a LoadRefused; else an error of SGLang's own)."""
    archive = tmp_path / "archive"
    archive.mkdir()
    source = LAUNCHER.format(srt=str(OVERLAY_SRT), functions=str(functions_file), mode=mode, archive=str(archive),
                             failure=failure)  # fmt: skip
    dropped = ("GRAPHPERSIST_", "GP_REGION", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env |= {"PYTHONPATH": str(REPO / "overlays" / "graphpersist"), "TMPDIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=120)


@needs_gcc
def test_a_refused_load_raises_load_refused_in_the_launching_process_which_survives(
    sglang_functions: Path, tmp_path: Path
) -> None:
    proc = launch(sglang_functions, tmp_path, "load", "refused")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["raised"] == "LoadRefused"
    assert got["lines"] == [f"graphpersist: cannot LOAD {tmp_path / 'archive'} (rank 0): 1 mismatch",
                            "  flags.context_length: saved 32768, live 4096",
                            "Re-run with mode=save for this configuration."]  # fmt: skip
    assert re.fullmatch(r"Rank 0 scheduler died during initialization \(exit code: (0|-9)\)", got["cause"])  # chained
    assert got["kill_calls"] == [False, False]  # the SIGQUIT handler, then refusal_or: the children, not this process
    assert got["alive"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive"]  # the refusal, read, is gone


@needs_gcc
@pytest.mark.parametrize(("mode", "failure"), [("load", "other"), ("off", "refused")], ids=["not-a-refusal", "off"])
def test_otherwise_the_sigquit_handler_kills_the_launching_process_as_upstream(
    sglang_functions: Path, tmp_path: Path, mode: str, failure: str
) -> None:
    """A scheduler that failed for another reason, and any failure with persistence off (where nothing names a
    refusal file, so nothing is recorded): upstream's handler, killing the whole tree, this process included."""
    proc = launch(sglang_functions, tmp_path, mode, failure)
    assert proc.returncode == -9 and proc.stdout == "", proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive"]
