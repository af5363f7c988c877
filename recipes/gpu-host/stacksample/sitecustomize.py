"""Start-up diagnosis on the GPU host: every Python process samples its threads' stacks while GP_STACKS_DIR is set.

Not part of the product. `engine-proof.sh` puts this folder first on PYTHONPATH when STACKS=1, so the driver, the
engine core and every worker (spawned processes inherit the environment) write `<GP_STACKS_DIR>/<pid>.stk`:
a header line, then one line per thread per sample, `<unix time>\t<thread>\t<root;...;leaf>`, where a thread whose
stack did not change since its last sample is written as `=`. `stackview.py` beside this file reads them.
The period is GP_STACKS_PERIOD_MS (default 20). Sampling slows pure-Python work: SAVE's serialization took
11.8-12.3 s sampled against 9.0-9.7 s unsampled on the GPU host.

A LOAD's processes are not sampled (GRAPHPERSIST_MODE=load in their environment; GP_STACKS_LOAD=1 samples them
anyway): holding a thread's frames for a moment keeps their locals alive past the function's return, so torch's
allocator can map a segment where SAVE reused a freed block, and LOAD then refuses its exact setup phase (measured
2026-12-01: recipes/diagnosis/vllm-qwen3-8b-tp1-startup/README.md). For LOAD use the worker's cProfile
(`GP_DIAG_CPROFILE`, tools/gpdiag/startprofile.py). The sampler drops every frame reference before it sleeps.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from types import FrameType

MAX_DEPTH = 80


def _frame_label(frame: FrameType) -> str:
    code = frame.f_code
    parts = code.co_filename.rsplit("/", 2)
    return f"{'/'.join(parts[-2:])}:{code.co_name}:{frame.f_lineno}"


def _stack(frame: FrameType | None) -> str:
    labels = []
    while frame is not None and len(labels) < MAX_DEPTH:
        labels.append(_frame_label(frame))
        frame = frame.f_back
    return ";".join(reversed(labels))


class _Sampler:
    """One daemon thread that samples every other thread of the process and appends to the process's file."""

    def __init__(self, folder: str, period_s: float) -> None:
        self.folder, self.period_s = folder, period_s
        self.lines: list[str] = []
        self.last: dict[int, str] = {}
        self.lock = threading.Lock()
        self.path = ""

    def start(self) -> None:
        if not _wanted():
            return
        self.path = os.path.join(self.folder, f"{os.getpid()}.stk")
        self.last, self.lines, self.lock = {}, [], threading.Lock()  # fresh after a fork: the parent's are not ours
        with open(self.path, "a") as f:
            f.write(f"# pid {os.getpid()} ppid {os.getppid()} start {time.time():.3f} argv {sys.argv!r}\n")
        threading.Thread(target=self.loop, name="gp-stacksample", daemon=True).start()

    def loop(self) -> None:
        me = threading.get_ident()
        flushed = time.monotonic()
        while True:
            time.sleep(self.period_s)
            now = time.time()
            names = {t.ident: t.name for t in threading.enumerate()}
            frames = sys._current_frames()
            stacks = {tid: _stack(frame) for tid, frame in frames.items() if tid != me}
            del frames  # no frame may outlive this step: it would keep the sampled function's locals alive
            with self.lock:
                for tid, stack in stacks.items():
                    same = self.last.get(tid) == stack
                    self.last[tid] = stack
                    self.lines.append(f"{now:.3f}\t{names.get(tid, tid)}\t{'=' if same else stack}\n")
            if time.monotonic() - flushed > 1.0:
                self.flush()
                flushed = time.monotonic()

    def flush(self) -> None:
        with self.lock:
            lines, self.lines = self.lines, []
        if lines:
            with open(self.path, "a") as f:
                f.writelines(lines)


def _wanted() -> bool:
    """False in a LOAD's processes (see the module's docstring), with one line on stderr saying so."""
    if os.environ.get("GRAPHPERSIST_MODE") != "load" or os.environ.get("GP_STACKS_LOAD") == "1":
        return True
    sys.stderr.write(f"stacksample: pid {os.getpid()} not sampled: a LOAD process (GRAPHPERSIST_MODE=load), which "
                     "sampling can make refuse its setup phase; GP_STACKS_LOAD=1 samples it anyway\n")  # fmt: skip
    return False


def _install() -> None:
    folder = os.environ.get("GP_STACKS_DIR")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    sampler = _Sampler(folder, float(os.environ.get("GP_STACKS_PERIOD_MS", "20")) / 1000)
    sampler.start()
    atexit.register(sampler.flush)
    os.register_at_fork(after_in_child=sampler.start)


def _chain() -> None:
    """Run the sitecustomize this one shadows (a later sys.path entry), if the host has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(candidate):
            with open(candidate) as f:
                exec(compile(f.read(), candidate, "exec"), {"__name__": "sitecustomize", "__file__": candidate})
            return


_install()
_chain()
