"""pytest plugin for a run of an upstream test suite: every node id with its outcome, and which vLLM ran them.

Loaded with `-p upstream_outcomes` into the upstream suite's own pytest (tests/cpu/test_upstream_vllm.py); it writes
JSON to $GP_UPSTREAM_OUTCOMES when the session ends. A node's outcome is its call's (passed, failed, skipped,
xfailed, xpassed), or `error` when its setup or teardown failed, or `skipped` when its setup skipped it; a file that
failed to collect is `collect-error`. Standard library only: it runs under the upstream suite's Python.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from typing import Any

import pytest

_outcomes: dict[str, str] = {}


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _outcomes[report.nodeid or "<collection>"] = "collect-error"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    earlier = _outcomes.get(report.nodeid)
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            _outcomes[report.nodeid] = "xfailed" if report.skipped else "xpassed"
        else:
            _outcomes[report.nodeid] = report.outcome
    elif report.failed:  # setup or teardown
        _outcomes[report.nodeid] = "error"
    elif report.skipped and earlier is None:  # skipped in setup (skip marks, skipif)
        _outcomes[report.nodeid] = "skipped"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    vllm = sys.modules.get("vllm")
    data: dict[str, Any] = {
        "exitstatus": int(exitstatus),
        "vllm_version": importlib.metadata.version("vllm"),
        "vllm_file": getattr(vllm, "__file__", None),
        "outcomes": dict(sorted(_outcomes.items())),
    }
    with open(os.environ["GP_UPSTREAM_OUTCOMES"], "w") as f:
        json.dump(data, f, indent=1)
