"""What the two serve drivers' tests share: a serve driver run against a fake server, and the process checks.

Each serve recipe's driver (`recipes/<engine>-qwen3-8b-tp2-serve/serve_driver.py`) is run as a subprocess with
`--server-cmd` naming the engine's fake (`fake_vllm_serve.py`, `fake_sglang_serve.py`), which logs, answers and
refuses as the real server does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(pid: int) -> bool:
    """A process that no longer runs: absent, or a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pid)


def runtime_importable(monkeypatch: pytest.MonkeyPatch, *unset: str) -> None:
    """The fakes refuse with graphpersist's own message: the runtime and tools must be importable there; `unset`
    names variables of this machine's environment a run must not inherit (FAKE_SERVE: each run sets its own)."""
    paths = [str(REPO / "overlays" / "graphpersist"), str(REPO / "tools")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    for name in ("FAKE_SERVE", *unset):
        monkeypatch.delenv(name, raising=False)


@dataclasses.dataclass(frozen=True)
class ServeDriver:
    """One serve recipe's driver, run against its fake server."""

    recipe: Path
    fake: Path
    archive_flag: str  # what the fake's SAVE writes and its LOAD compares (max_model_len, context_length)

    def command(self, tmp_path: Path, run: str, mode: str, *args: str, archive: Path | None = None) -> list[str]:
        (tmp_path / "model").mkdir(exist_ok=True)
        cmd = [sys.executable, str(self.recipe / "serve_driver.py"), "--run", run, "--mode", mode]
        cmd += ["--result", str(tmp_path / run / "result.json"), "--model", str(tmp_path / "model")]
        cmd += ["--port", str(free_port()), "--server-cmd", f"{sys.executable} {self.fake}"]
        return cmd + (["--archive", str(archive)] if archive else []) + list(args)

    def drive(
        self,
        tmp_path: Path,
        run: str,
        mode: str,
        *args: str,
        behaviour: dict[str, Any] | None = None,
        archive: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> tuple[dict[str, Any], str]:
        """One driver run: its result.json and everything it printed (the server's lines included). `behaviour`
        tells the fake how to misbehave (FAKE_SERVE)."""
        stats = tmp_path / run / "stats"
        stats.mkdir(parents=True)
        full = dict(os.environ, FAKE_SERVE=json.dumps(behaviour or {}), GRAPHPERSIST_STATS_DIR=str(stats))
        proc = subprocess.run(self.command(tmp_path, run, mode, *args, archive=archive), env=full | (env or {}),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads((tmp_path / run / "result.json").read_text()), proc.stdout

    def saved_archive(self, tmp_path: Path, value: int = 4096) -> Path:
        """What the fake's SAVE leaves: the one setting its LOAD compares, saved as `value`."""
        archive = tmp_path / "archive"
        archive.mkdir()
        (archive / "fake-archive.json").write_text(json.dumps({self.archive_flag: value}))
        return archive
