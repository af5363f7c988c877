"""Off means upstream, by upstream's own tests: vLLM's test suite passes, fails and skips the same tests on our
patched wheel (persistence off, the default) as on the pristine pinned wheel.

The pinned vLLM sdist (build/pins.toml, fetched by sha256) carries vLLM's tests/. We run the files that test what
our series patches (patches/vllm/*.patch) and that run without a GPU, once against each wheel, both installed
--no-deps into the same CPU venv layer (vllm_cpu_venv.py), and compare every node id's outcome:

| patched module (patch)                                 | upstream tests run here                           |
|--------------------------------------------------------|---------------------------------------------------|
| vllm/engine/arg_utils.py (0001: the switch's flags)    | tests/engine/test_arg_utils.py; the config tests  |
|                                                        | tests/config/ and tests/compile/test_config.py    |
| vllm/utils/system_utils.py (0004: the start method)    | tests/utils_/test_system_utils.py                 |
| vllm/v1/engine/utils.py (0006: a refused LOAD raised)  | none: no upstream test calls                      |
|                                                        | wait_for_engine_startup                           |
| vllm/compilation/cuda_graph.py,                        | none without a GPU: tests/v1/cudagraph/ and       |
| vllm/v1/worker/gpu/cudagraph_utils.py (0002),          | tests/distributed/ need CUDA, and their helper    |
| custom_all_reduce.py (0003)                            | tests/utils.py imports vLLM's OpenAI server stack |

The suite runs as upstream wrote it (its conftest.py and markers), offline: HF_HUB_OFFLINE=1 with an empty HF_HOME,
so the tests that need a model's config from the Hugging Face Hub fail, and fail alike on both wheels (the counts
are in the summary line). Not run, to keep this to a couple of minutes on 2 cores: tests/v1/engine/test_engine_args.py
(all four of its tests need the Hub), tests/test_config.py (VllmConfig and ModelConfig, which our series does not
patch: 160 tests, 106 of them need the Hub, 45 s of CPU per wheel, mostly upstream's per-test gc.collect()) and one
slow test (DESELECT). The tests run in a copy of the sdist's tests/ alone, so that the sdist's vllm/ sources cannot
shadow the installed wheel; the plugin (upstream_outcomes.py) records which vLLM each run imported.

SGLang publishes no sdist for 0.5.17, and its wheel carries none of its own test suite (the repository's test/): of
the wheel's 156 test_*.py files, 129 are sglang/multimodal_gen's (the diffusion runtime; 100 of them unit tests under
multimodal_gen/test/unit), 19 are modules of the sglang/test helper package (runners, eval harnesses, test_utils.py),
4 are GPU kernel tests (srt/layers/attention/minimax_sparse_ops/tests) and 4 storage-backend tests
(srt/mem_cache/storage). None tests a module our SGLang series patches (server_args, model_runner, the CUDA graph
runners and backends, kv_cache_configurator, custom_all_reduce_v2, torch_symm_mem); one, multimodal_gen's
test_disagg_trace.py, imports a helper from server_args. SGLang cannot be imported on this CPU machine anyway
(CPython 3.12, no CPU torch: see test_engine_sglang_cpu.py). So there is no SGLang counterpart here.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import tarfile
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_cpu_venv import built_wheels, make_vllm_venv

from gpdist.fetch import fetch
from gpdist.pins import Pins

pytestmark = [pytest.mark.network, pytest.mark.slow]

FILES = (
    "tests/engine/test_arg_utils.py",
    "tests/utils_/test_system_utils.py",
    "tests/compile/test_config.py",
    "tests/config",
)
DESELECT = (
    # Imports vLLM in two fresh interpreters to compare a hash of envs.py's factors (20-35 s on 2 cores); envs.py
    # is not patched.
    "tests/config/test_config_utils.py::test_envs_compile_factors_stable",
)
# Far fewer passes than this means the suite broke for both wheels alike (an import error, a missing package), which
# would make "equal" meaningless. 129 passed on 2026-12-03.
MIN_PASSED = 100
PLUGIN = Path(__file__).resolve().parent / "upstream_outcomes.py"
TIMEOUT_S = 900


@dataclass
class Run:
    """One wheel's run of the upstream files."""

    name: str
    exitstatus: int
    vllm_version: str
    vllm_file: str
    outcomes: dict[str, str]
    seconds: float
    log: str

    def counts(self) -> dict[str, int]:
        return dict(sorted(collections.Counter(self.outcomes.values()).items()))


def extract_tests(sdist: Path, dest: Path) -> Path:
    """The sdist's tests/ (only) under `dest`, with upstream's pytest markers, and the outcome plugin beside it."""
    with tarfile.open(sdist) as tf:
        top = tf.getmembers()[0].name.split("/")[0]
        members = [m for m in tf.getmembers() if m.name.startswith(f"{top}/tests/")]
        tf.extractall(dest / "x", members=members, filter="data")
    (dest / "x" / top / "tests").rename(dest / "tests")
    shutil.rmtree(dest / "x")
    with tarfile.open(sdist) as tf:
        project = tomllib.loads(tf.extractfile(f"{top}/pyproject.toml").read().decode())  # type: ignore[union-attr]
    markers = project["tool"]["pytest"]["ini_options"]["markers"]
    (dest / "pytest.ini").write_text("[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in markers))
    (dest / "plugin").mkdir()
    shutil.copyfile(PLUGIN, dest / "plugin" / PLUGIN.name)
    return dest


def run_upstream(name: str, venv: Path, root: Path) -> Run:
    """The upstream files under `venv`'s Python, in `root` (a copy of its own), offline, persistence off."""
    out = root / "outcomes.json"
    dropped = ("GRAPHPERSIST_", "GP_", "VLLM_", "CUDA_", "HF_", "PYTHON", "PYTEST_", "LD_PRELOAD", "TRANSFORMERS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env.update(
        GP_UPSTREAM_OUTCOMES=str(out),
        PYTHONPATH=str(root / "plugin"),
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(root / "hf-home"),  # empty: nothing cached on this machine changes the outcomes
        OMP_NUM_THREADS="1",  # two runs share the cores
    )
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider", "-p", PLUGIN.stem, "-q", *FILES]
    cmd += [arg for nodeid in DESELECT for arg in ("--deselect", nodeid)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    seconds = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert out.is_file(), f"{name}: the upstream run wrote no outcomes (exit {proc.returncode}):\n{log[-3000:]}"
    data = json.loads(out.read_text())
    return Run(name, data["exitstatus"], data["vllm_version"], data["vllm_file"] or "", data["outcomes"], seconds, log)


def differences(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """One line per node id whose outcome differs (or that only one run has)."""
    return [
        f"{nodeid}: patched {ours.get(nodeid, 'not run')}, pristine {theirs.get(nodeid, 'not run')}"
        for nodeid in sorted(ours.keys() | theirs.keys())
        if ours.get(nodeid) != theirs.get(nodeid)
    ]


def test_differences_name_each_node_whose_outcome_differs() -> None:
    ours = {"a::x": "passed", "a::y": "failed", "a::z": "skipped"}
    theirs = {"a::x": "passed", "a::y": "passed", "a::w": "passed"}
    assert differences(ours, theirs) == [
        "a::w: patched not run, pristine passed",
        "a::y: patched failed, pristine passed",
        "a::z: patched skipped, pristine not run",
    ]
    assert differences(ours, dict(ours)) == []


def test_upstream_vllm_tests_pass_fail_and_skip_alike_on_the_patched_and_the_pristine_wheel(
    dist_dir: Path, pins: Pins, repo_root: Path, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    pin = pins.engine("vllm")
    assert pin.sdist is not None, "build/pins.toml pins no vLLM sdist: vLLM's own tests come from it"
    sdist = fetch(pin.sdist)
    wheels = {"patched": built_wheels(dist_dir), "pristine": [fetch(pin.wheel)]}
    roots = {name: extract_tests(sdist, tmp_path / name) for name in wheels}
    venvs = {name: make_vllm_venv(tmp_path / f"venv-{name}", repo_root, w) for name, w in wheels.items()}
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:  # one per wheel, at the same time
        futures = {name: pool.submit(run_upstream, name, venvs[name], roots[name]) for name in wheels}
        runs = {name: f.result() for name, f in futures.items()}
    wall = time.monotonic() - start
    ours, theirs = runs["patched"], runs["pristine"]

    # Each run imported the wheel it was meant to, not the sdist's sources nor another venv's.
    assert ours.vllm_version == pins.dist_version(pin.version), ours.vllm_version
    assert theirs.vllm_version == pin.version, theirs.vllm_version
    for run in runs.values():
        assert Path(run.vllm_file).is_relative_to(venvs[run.name]), (run.name, run.vllm_file)
        assert run.exitstatus in (0, 1), f"{run.name}: pytest exit {run.exitstatus}:\n{run.log[-3000:]}"
    summary = (
        f"upstream vLLM tests ({len(FILES)} paths of the pinned sdist, {len(ours.outcomes)} tests, both wheels at "
        f"once in {wall:.0f} s): patched {ours.counts()}, pristine {theirs.counts()}"
    )
    record_property("summary", summary)
    diff = differences(ours.outcomes, theirs.outcomes)
    assert not diff, f"{len(diff)} upstream test(s) differ between the patched and the pristine wheel:\n" + "\n".join(
        diff[:50]
    )
    assert ours.counts().get("passed", 0) >= MIN_PASSED, f"{summary}\n{ours.log[-3000:]}"
    assert {nodeid.split("::")[0] for nodeid, o in ours.outcomes.items() if o == "passed"} >= {
        f for f in FILES if f.endswith(".py")
    }, "every file named in FILES has passing tests"
