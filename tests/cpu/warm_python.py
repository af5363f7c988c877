"""A warm interpreter in another venv that runs each test's snippet in a fresh fork of itself.

Importing vLLM with torch takes about 8 s; a test module with twenty subprocesses would spend minutes importing.
The server below imports a prelude once, then forks for every snippet: each snippet starts from the same
imported state, whatever the previous one patched, and pays a few milliseconds. A snippet sets `result` (JSON);
what it raises comes back as the exception's type and message, and everything it printed or logged as `output`.
"""

from __future__ import annotations

import json
import queue
import subprocess
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DONE = "@@warm-python-done@@"
READY = "@@warm-python-ready@@"

SERVER = textwrap.dedent(
    f"""
    import json, os, runpy, sys, traceback

    prelude = runpy.run_path(sys.argv[1])
    print({READY!r}, flush=True)
    while line := sys.stdin.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                scope = dict(prelude)
                exec(compile(request["code"], "<snippet>", "exec"), scope)
                answer = {{"value": scope.get("result")}}
            except BaseException as exc:
                answer = {{"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}}
            sys.stdout.flush()
            sys.stderr.flush()
            with open(request["answer"], "w") as f:
                json.dump(answer, f, default=repr)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("\\n{DONE}", status, flush=True)
    """
)


@dataclass
class Outcome:
    """What one snippet did: its `result`, or the exception it raised, and its output."""

    value: Any
    error: str | None
    message: str
    output: str
    traceback: str

    def ok(self) -> Any:
        assert self.error is None, f"the snippet raised {self.error}: {self.message}\n{self.traceback}\n{self.output}"
        return self.value

    def raised(self, error: str) -> str:
        """The message of the exception the snippet had to raise (by class name)."""
        assert self.error == error, f"expected {error}, got {self.error}: {self.message}\n{self.traceback}"
        return self.message


class WarmPython:
    """`python` running `prelude` once, then every `run(code)` in a fresh fork (see the module docstring)."""

    def __init__(self, python: Path, prelude: Path, env: dict[str, str], workdir: Path, start_timeout: float = 300):
        self._workdir = workdir
        self._count = 0
        self._lines: queue.Queue[str | None] = queue.Queue()
        script = workdir / "warm_python_server.py"
        script.write_text(SERVER)
        self._proc = subprocess.Popen(
            [str(python), str(script), str(prelude)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=workdir,
        )
        threading.Thread(target=self._read, daemon=True).start()
        self._collect(READY, start_timeout, "importing the prelude")

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _collect(self, marker: str, timeout: float, what: str) -> list[str]:
        seen: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"warm python: {what} took over {timeout} s; output:\n{''.join(seen)}") from None
            if line is None:
                raise RuntimeError(f"warm python exited ({self._proc.wait()}) while {what}; output:\n{''.join(seen)}")
            if line.startswith(marker):
                return seen
            seen.append(line)

    def run(self, code: str, timeout: float = 120) -> Outcome:
        """Runs `code` (dedented) in a fork of the warm interpreter; the fork's `result` comes back."""
        self._count += 1
        answer = self._workdir / f"answer-{self._count}.json"
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"code": textwrap.dedent(code), "answer": str(answer)}) + "\n")
        self._proc.stdin.flush()
        output = "".join(self._collect(DONE, timeout, "running a snippet"))
        if not answer.exists():
            raise RuntimeError(f"the snippet's process died without an answer; output:\n{output}")
        got = json.loads(answer.read_text())
        return Outcome(got.get("value"), got.get("error"), got.get("message", ""), output, got.get("traceback", ""))

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
