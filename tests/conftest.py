"""Shared fixtures: the pins, pristine upstream trees and the built dist/ directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
for sub in ("build", "tools", "overlays/graphpersist"):
    path = str(REPO_ROOT / sub)
    if path not in sys.path:
        sys.path.insert(0, path)

from gpdist import pins as pins_mod  # noqa: E402
from gpdist.runtime import wheel_tag  # noqa: E402
from gpdist.unpack import upstream_tree as _upstream_tree  # noqa: E402
from gpdist.wheelmeta import WheelName  # noqa: E402


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


# Fixtures that download the pinned upstream wheels (unless the cache is warm) or build dist/: a test that uses one is
# a `network` test, marked here so that `make test-fast` (-m "not network ...") never runs it, even if unmarked.
NETWORK_FIXTURES = ("dist_dir", "upstream_tree")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in NETWORK_FIXTURES):
            item.add_marker(pytest.mark.network)
    if has_gpu():
        return
    skip = pytest.mark.skip(
        reason="no NVIDIA GPU on this machine: GPU test NOT RUN (run `make gpu-test` on a GPU host)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# How many tests -m/-k deselected: pytest's last line says so in one process, but under pytest-xdist the workers
# deselect, so each reports its count back (workeroutput) and the summary below says it.
DESELECTED = pytest.StashKey[list[int]]()  # in each process: what its collection deselected
WORKER_DESELECTED = pytest.StashKey[list[int]]()  # in the xdist controller: what each worker reported


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        items[0].config.stash.setdefault(DESELECTED, []).append(len(items))


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["gp_deselected"] = sum(session.config.stash.get(DESELECTED, []))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    count = getattr(node, "workeroutput", {}).get("gp_deselected")
    if count is not None:
        node.config.stash.setdefault(WORKER_DESELECTED, []).append(count)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """A test's `record_property("summary", line)` (counts a CI log should show) printed at the end of the run.
    Unlike a print with capture disabled, this reaches the terminal from pytest-xdist's workers too. Under xdist,
    how many tests the workers deselected, too."""
    lines = [
        str(value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == "summary"
    ]
    workers = terminalreporter.config.stash.get(WORKER_DESELECTED, [])
    if any(workers):
        lines.append(f"{max(workers)} deselected (by -m/-k, in each worker's collection)")
    if lines:
        terminalreporter.section("summaries")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def pins() -> pins_mod.Pins:
    return pins_mod.load()


@pytest.fixture(scope="session")
def upstream_tree(pins: pins_mod.Pins):
    """Callable: engine name -> pristine unpacked upstream wheel tree (read-only by convention)."""

    def get(engine: str) -> Path:
        return _upstream_tree(pins.engine(engine))

    return get


@pytest.fixture(scope="session")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheels `make build` wrote (GP_DIST_DIR), or a fresh build into a temporary folder."""
    given = os.environ.get("GP_DIST_DIR")
    if given:
        path = Path(given)
        assert any(path.glob("*.whl")), f"GP_DIST_DIR={given} holds no wheels: run `make build` first"
        return path
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "gpdist", "build", "--engine", "all", "--out", str(out)],
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return out


@pytest.fixture(scope="session")
def runtime_wheel(dist_dir: Path, pins: pins_mod.Pins) -> Path:
    """The runtime wheel `make build` wrote: a platform wheel for the build machine (it carries the interposer)."""
    path = dist_dir / WheelName(pins.runtime_name, pins.runtime_version, wheel_tag()).filename
    assert path.is_file(), f"{path.name} missing from {dist_dir}: {sorted(p.name for p in dist_dir.iterdir())}"
    return path
