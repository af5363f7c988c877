"""The host plumbing the runtime recipes' proofs share (runtime-single-gpu, -tp2, -scale, -deepep-ep2-1gpu).

Each proof starts its steps or ranks as processes of their own (one per step, or one per rank of a group), bounds
them by a timeout, collects the JSON result each wrote, checks them and writes REPORT.md. What is the same in all
of them lives here, so that a fix to it (a rank that wrote no result, a port taken twice) lands in every proof:
the free port, the versions block, the step and rank runners, the group verdicts, the report's head and the
command line of the one-process-per-step proofs.

Like proofkit, it runs under the GPU host's Python (3.10 or newer) from this checkout, standard library only
(step_main alone imports the runtime, from overlays/ where the proof found it, to re-execute a step under its
interposer): a proof puts the repository's tools/ folder on sys.path, as the engine drivers do, and imports
`from gptools import hostkit`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO, Any, NoReturn

# The pins every proof runs under (host-pins.mk sets them for `make prove` too): NVLink multicast stays off.
PINNED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# What `versions` can ask the proof's Python, by the name the report shows; each prints one line.
PROBES = {
    "torch": "import torch; print(torch.__version__, 'cuda', torch.version.cuda)",
    "nccl": "import torch; print('.'.join(map(str, torch.cuda.nccl.version())))",
    "triton": "import triton; print(triton.__version__)",
    "cuda-bindings": "import cuda.bindings; print(cuda.bindings.__version__)",
}

Check = tuple[str, bool, str]  # (name, passed, detail): one row of the report's checks table


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now: the group's rendezvous (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- versions


def _lines(cmd: list[str]) -> list[str]:
    """The stdout lines of a host command; none where the command is missing (a host without nvidia-smi)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()
    except OSError:
        return []


def probe(code: str) -> str:
    """The last line a fresh interpreter prints for `code` (its error's last line when it fails), or "?"."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return (p.stdout or p.stderr).strip().splitlines()[-1] if (p.stdout or p.stderr) else "?"


def versions(probes: Sequence[str], *, every_gpu: bool = False, gcc: bool = False) -> dict[str, str]:
    """The report's versions block: host, GPU, python, then each of `probes` (names in PROBES) in that order.

    One GPU recipes show the first GPU as "gpu / driver"; multi-rank ones (`every_gpu`) every GPU with its PCI bus
    id as "gpus", so that the report says which GPUs the ranks had.
    """
    facts = {"host": socket.gethostname()}
    if every_gpu:
        rows = _lines(["nvidia-smi", "--query-gpu=name,driver_version,pci.bus_id", "--format=csv,noheader"])
        facts["gpus"] = "; ".join(rows) or "?"
    else:
        rows = _lines(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
        facts["gpu / driver"] = rows[0] if rows else "?"
    facts["python"] = platform.python_version()
    facts.update({name: probe(PROBES[name]) for name in probes})
    if gcc:  # the interposer's compiler
        facts["gcc"] = (_lines(["gcc", "--version"]) or ["?"])[0]
    return facts


# ------------------------------------------------------------------------------------------- processes


def read_result(path: Path) -> dict[str, Any] | None:
    """The JSON a step or rank wrote; None when it wrote none (or was killed while writing it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_step(argv: Sequence[str], out: Path, name: str, env: Mapping[str, str], timeout: float) -> dict[str, Any]:
    """Runs one step process (`argv --result out/NAME.json`, log in out/NAME.log) to its end or `timeout`.

    Returns what it wrote plus `_rc` (the exit status, or "timeout"), `_wall_s`, and `_log_tail` unless it exited 0.
    """
    result, log = out / f"{name}.json", out / f"{name}.log"
    a = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc: int | str = subprocess.run([*argv, "--result", str(result)], env={**env, "PYTHONUNBUFFERED": "1"},
                                           stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    data = read_result(result) or {}
    data["_rc"], data["_wall_s"] = rc, time.perf_counter() - a
    if rc != 0:
        data["_log_tail"] = log.read_text()[-3000:]
    return data


def run_ranks(
    name: str,
    out: Path,
    world: int,
    argv: Callable[[int, Path], list[str]],
    env: Mapping[str, str],
    timeout: float,
    tag: str,
) -> dict[str, Any]:
    """Starts one process per rank (`argv(rank, result file)`, log in out/NAME.rank<r>.log) and waits for all of
    them, killing what still runs `timeout` seconds after the start: a hung rendezvous must not hang the proof.

    Each rank gets `env` with a fresh MASTER_PORT and its RANK, LOCAL_RANK, WORLD_SIZE. Returns `wall_s` and
    `ranks`, each rank's result; a rank that wrote none has `error` "no result (rc N)", and an erring rank its
    log's tail.
    """
    group_env = {**env, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs: list[tuple[subprocess.Popen[bytes], IO[str], Path]] = []
    results = []
    t = time.perf_counter()
    for r in range(world):
        result = out / f"{name}.rank{r}.json"
        result.unlink(missing_ok=True)
        log = open(out / f"{name}.rank{r}.log", "w")  # noqa: SIM115 - closed below
        rank_env = {**group_env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world)}
        procs.append((subprocess.Popen(argv(r, result), env=rank_env, stdout=log, stderr=subprocess.STDOUT), log,
                      result))  # fmt: skip
    deadline = time.monotonic() + timeout
    for p, log, result in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        data = read_result(result) or {"error": f"no result (rc {p.returncode})"}
        if "error" in data:
            data["log_tail"] = Path(log.name).read_text()[-2500:]
        results.append(data)
    wall = time.perf_counter() - t
    print(f"[{tag}] {name}: {wall:.1f} s, " + ", ".join(
        f"rank {r}: {'error' if 'error' in d else 'refused' if 'refused' in d else 'ok'}"
        for r, d in enumerate(results)), flush=True)  # fmt: skip
    return {"wall_s": wall, "ranks": results}


def finish_rank(rank: int, result: Path, body: Callable[[], dict[str, Any]]) -> NoReturn:
    """Runs one rank's `body`, writes its result (or its error with the traceback's tail) and exits 0 at once.

    No process-group teardown: NCCL teardown can hang after the results are written (REFERENCE-GPU.md), and the
    result is what the group is judged by.
    """
    try:
        res = body()
    except Exception as exc:
        res = {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    result.write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------- verdicts


def group_ok(group: Mapping[str, Any] | None) -> bool:
    """A group ran: it has ranks, and none erred or was refused."""
    ranks = (group or {}).get("ranks", [])
    return bool(ranks) and all("error" not in r and "refused" not in r for r in ranks)


def where(trace: str) -> str:
    """The innermost frames of a rank's traceback, on one line."""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    return " <- ".join(reversed(frames[-3:]))


def group_errors(group: Mapping[str, Any] | None, width: int = 400) -> str:
    """What went wrong on each rank that erred or was refused, `width` characters a rank, plus where it raised."""
    ranks = enumerate((group or {}).get("ranks", []))
    return " / ".join(f"rank {i}: {r.get('error') or r.get('refused', {}).get('message', '')}"[:width]
                      + (f" at {where(r['trace'])}" if r.get("trace") else "")
                      for i, r in ranks if "error" in r or "refused" in r)  # fmt: skip


# ------------------------------------------------------------------------------------------- report


def report_head(
    title: str, started: datetime, host: Mapping[str, str], facts: Sequence[str], checks: Sequence[Check]
) -> tuple[list[str], list[str]]:
    """REPORT.md up to and including the checks table, and the names of the failed checks.

    The first line is `all checks passed` or `FAILED: <checks>`; then the title, the date, the `host` block
    (`versions()`), the recipe's own `facts` (bullet lines), and one table row per check.
    """
    failed = [name for name, ok, _ in checks if not ok]
    lines = ["all checks passed" if not failed else "FAILED: " + "; ".join(failed), "", f"# {title}", ""]
    lines += [f"- date: {started.isoformat(timespec='seconds')}"]
    lines += [f"- {k}: {v}" for k, v in host.items()]
    lines += [*facts, "", "## Checks", "", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {name} | {'PASS' if ok else 'FAIL'} | {detail.replace('|', '/')} |" for name, ok, detail in checks]
    return lines, failed


def publish(
    out: Path, report: Path, res: dict[str, Any], render: Callable[[dict[str, Any]], tuple[str, list[str]]]
) -> int:
    """Writes every step's results (out/results.json, not committed; first, so that a render that fails leaves
    them), then the report (at `report` and in out/); prints it and returns the exit status: 1 when a check failed."""
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    text, failed = render(res)
    report.write_text(text)
    if report.resolve() != (out / "REPORT.md").resolve():
        (out / "REPORT.md").write_text(text)
    print(text)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------- command line


def step_main(here: Path, prove: Callable[[Path, Path], int], steps: Mapping[str, Callable[..., Any]]) -> int:
    """The command line of a proof made of step processes: `proof.py prove [--out DIR] [--report FILE]` runs them
    all; `proof.py STEP PATH... --result FILE` (what `prove` starts) is one step, re-executed under the runtime's
    interposer first, its result written as JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["prove", *steps])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--result")
    ap.add_argument("--out", default=str(here / "out"))
    ap.add_argument("--report", default=str(here / "REPORT.md"))
    a = ap.parse_args()
    if a.step == "prove":
        return prove(Path(a.out), Path(a.report))
    from graphpersist import api  # the recipe put the runtime on sys.path

    api.reexec_with_interposer()
    data = steps[a.step](*[Path(p) for p in a.paths])
    Path(a.result).write_text(json.dumps(data, indent=2, default=str))
    return 0


def rank_cli(doc: str, here: Path, prove_help: str) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line of a proof made of rank groups: `proof.py prove [--out DIR] [--report FILE] ...` (the
    returned `prove` parser takes the recipe's own options) and `proof.py rank ...`, one rank of one group, which
    the recipe dispatches before parsing (its options are the rank's own)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    prove = sub.add_parser("prove", help=prove_help)
    prove.add_argument("--out", default="out", type=Path)
    prove.add_argument("--report", default=here / "REPORT.md", type=Path)
    sub.add_parser("rank", help="one rank of one group (started by prove)")
    return ap, prove
