"""What an engine driver of `python -m gptools prove` needs, and nothing else: standard library only.

Drivers run under the engine's Python on the GPU host (3.10 or newer), where only this file of gptools (and, for a
serve proof, serveproof.py and openai_http.py, standard library only too) has to be importable: the runner puts this
repository's tools/ folder first on the driver's PYTHONPATH, so `from gptools import proofkit` works without
installing anything. The contract itself (arguments, environment,
result.json, stats files) is described in gptools/prove.py.

A driver typically does::

    args, extra = proofkit.driver_args()          # --run --mode --archive --result, the rest is the recipe's
    phases = proofkit.Phases()
    before = proofkit.cache_snapshot()
    with proofkit.Timer() as ready:
        engine = make_engine(args.mode, args.archive, extra)
    at_ready = proofkit.cache_snapshot()
    ... serve the first request, then the workloads ...
    proofkit.write_result(args.result, {"ok": True, "start_to_ready_s": ready.seconds, ...,
        "jit": {"new_cache_files_start": len(proofkit.new_files(before, at_ready)), ...}})
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

# Environment the runner sets for each run.
STATS_DIR_ENV = "GRAPHPERSIST_STATS_DIR"  # engines write <dir>/rank_<r>.json there
CACHE_DIRS_ENV = "GP_PROOF_CACHE_DIRS"  # os.pathsep-joined folders of the run's JIT/compile caches
MODES = ("off", "save", "load")
E = TypeVar("E")  # an engine object: vllm.LLM, sglang.Engine


def driver_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The runner's arguments (run, mode, archive, result) and the recipe's own extra arguments, untouched."""
    parser = argparse.ArgumentParser(description="one run of a proof (started by `python -m gptools prove`)")
    parser.add_argument("--run", required=True, help="the run's name in proof.toml")
    parser.add_argument("--mode", required=True, choices=MODES, help="graph persistence mode")
    parser.add_argument("--archive", help="archive folder (save and load runs)")
    parser.add_argument("--result", required=True, help="where to write result.json")
    return parser.parse_known_args(argv)


class Timer:
    """Wall time of a `with` block: `with Timer() as t: ...` then `t.seconds`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


class Phases:
    """Ordered, named timings for result.json's `phases` (the runner keeps their order in its tables)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block and adds it to `name` (a phase entered twice adds up)."""
        with Timer() as t:
            yield
        self.add(name, t.seconds)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def to_dict(self) -> dict[str, float]:
        return dict(self.seconds)


def cache_dirs() -> list[Path]:
    """The run's cache folders, as the runner passed them."""
    return [Path(p) for p in os.environ.get(CACHE_DIRS_ENV, "").split(os.pathsep) if p]


def cache_snapshot(dirs: Sequence[Path] | None = None) -> set[str]:
    """Every file under the cache folders, as `<folder name>/<relative path>` (compare two with new_files)."""
    found: set[str] = set()
    for root in cache_dirs() if dirs is None else dirs:
        for folder, _subdirs, files in os.walk(root):
            for name in files:
                found.add(str(Path(root.name) / Path(folder, name).relative_to(root)))
    return found


def snapshot_names(paths: Iterable[str | os.PathLike[str]]) -> set[str]:
    """Absolute cache files (what a LOAD put back from its archive) named as cache_snapshot names them; files
    outside the run's cache folders are left out."""
    roots = cache_dirs()
    named = set()
    for path in map(Path, paths):
        for root in roots:
            if path.is_relative_to(root):
                named.add(str(Path(root.name) / path.relative_to(root)))
    return named


def new_files(before: set[str], after: set[str]) -> list[str]:
    """Files that appeared between two snapshots, sorted: the JIT/compile work a LOAD should not do. Lock files
    are not work (FlashInfer takes `<module>.lock` to load a module it does not build), so they do not count."""
    return sorted(f for f in after - before if not f.endswith(".lock"))


def write_result(path: str | os.PathLike[str], result: dict[str, Any]) -> None:
    """Writes result.json atomically (a crash mid-write leaves no half file for the runner to misread)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".result-", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_and_exit(work: Callable[[], dict[str, Any]], result_path: str | os.PathLike[str]) -> NoReturn:
    """Runs a driver's workload, writes its result.json whatever it raised, and ends the process at once.

    A workload that raises becomes `{"ok": False, "error": ...}` (the traceback goes to the log, which the runner
    keeps). The process ends with `os._exit(0)`: engines' and NCCL's teardown can hang after the results are
    written (REFERENCE-GPU.md), and the runner ends the run's process group anyway.
    """
    try:
        result = work()
    except Exception as exc:
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    write_result(result_path, result)
    print(f"driver: wrote {result_path}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group; zombies wait for a reaper that may never come.

    The runner ends each run's group with it; a driver that starts a server in a group of its own stops it with it.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


SCRIPT_RUNS = "script-runs.txt"  # beside a run's result.json: one line per process that ran the driver's script


def note_script_run(module_name: str, argv: Sequence[str] | None = None) -> None:
    """A driver's first statement (`proofkit.note_script_run(__name__)`): notes this process in the run's SCRIPT_RUNS
    file (beside `--result`) when the driver runs as a script: `__main__`, or `__mp_main__` where multiprocessing's
    spawn ran it again in an engine process; not when another driver imports it. An engine under persistence must
    run a user's script as often as upstream runs it (vLLM: once)."""
    if module_name not in ("__main__", "__mp_main__"):
        return
    args = list(sys.argv if argv is None else argv)
    given = [a.split("=", 1)[1] for a in args if a.startswith("--result=")]
    given += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--result"]
    if not given:
        return
    path = Path(given[0]).parent / SCRIPT_RUNS
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(f"{os.getpid()} {module_name}\n")


def script_runs(result_path: str | os.PathLike[str]) -> int:
    """How many processes have run the driver's script in this run (note_script_run); 0 when none noted it."""
    path = Path(result_path).parent / SCRIPT_RUNS
    lines = path.read_text().splitlines() if path.is_file() else []
    return len({line.split()[0] for line in lines if line.strip()})


def rank_stats() -> list[dict[str, Any]]:
    """The engine's per-rank stats of this run (read_stats of the folder the runner passed); [] outside a run."""
    where = os.environ.get(STATS_DIR_ENV)
    return read_stats(Path(where)) if where else []


def read_stats(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The engine's per-rank stats files (`rank_<r>.json`), ordered by rank; [] when there are none.

    Raises ValueError naming the file when one is not a JSON object with an integer `rank`.
    """
    stats = []
    for path in sorted(Path(folder).glob("rank_*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: unreadable stats file: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("rank"), int):
            raise ValueError(f"{path}: a stats file must be a JSON object with an integer `rank`")
        stats.append(data)
    return sorted(stats, key=lambda s: s["rank"])


def refusal_lines(text: str, match: re.Match[str]) -> tuple[str, str]:
    """The log lines where a match begins and ends (what a run that must be refused quotes as its evidence)."""

    def line_at(pos: int) -> str:
        start = text.rfind("\n", 0, pos) + 1
        end = text.find("\n", pos)
        return text[start : end if end >= 0 else len(text)]

    return line_at(match.start()), line_at(max(match.start(), match.end() - 1))


# A mismatch line of a refused LOAD, as the runtime writes it (graphpersist.archive.validate.Mismatch).
MISMATCH_LINE = re.compile(r"^\s+\S+: saved .*, live .*$")


def expected_refusal(log: Path, pattern: str, raised: BaseException | str, *, settle_s: float = 2.0) -> dict[str, Any]:
    """result.json of a run that had to be refused (recipe `expect_refusal`) and whose engine did not start: ok when
    the engine's log (this run's log.txt, written by the runner as the driver and its processes print) matches
    `pattern`, quoting the line. `raised` is what the engine's start raised in the driver: its type (`raised_type`,
    qualified: the runtime's own refusal when the engine hands it back, else the engine's error) and the first
    mismatch line of its message (`first_mismatch`, None without one) are recorded. Waits `settle_s` for the
    engine's own processes to flush their last lines."""
    time.sleep(settle_s)
    why = str(raised)
    text = log.read_text(errors="replace") if log.is_file() else ""
    match = re.search(pattern, text, re.DOTALL)
    first, last = refusal_lines(text, match) if match else (None, None)
    kind = None if isinstance(raised, str) else f"{type(raised).__module__}.{type(raised).__qualname__}"
    mismatch = next((line.strip() for line in why.splitlines() if MISMATCH_LINE.match(line)), None)
    refusal = {"pattern": pattern, "first_line": first, "matched": last, "raised": why[:500]}
    refusal |= {"raised_type": kind, "first_mismatch": mismatch}
    return {
        "ok": match is not None,
        "error": None if match else f"the start failed ({why[:300]}) but {log} does not match {pattern!r}",
        "outputs": {},
        "refusal": refusal,
    }


@dataclasses.dataclass
class EngineStart(Generic[E]):
    """An in-process engine start, timed and stamped: `engine` when it started; else `result`, the run's
    result.json (refused as the recipe expected, or started when it had to be refused)."""

    engine: E | None
    result: dict[str, Any] | None
    ready_s: float  # start to ready on the driver's clock
    stamps: LogStamps  # the log's lines during the start, on the wall clock
    t0_wall: float  # where the start-up's clock began, on the wall clock


def start_engine(build: Callable[[], E], log: Path, expect_refusal: str | None) -> EngineStart[E]:
    """Runs `build()` (LLM(...), sglang.Engine(...)) with the start-up clock running and `log` (the run's log, where
    every process of the run writes) stamped. A start that raises is the run's end when the recipe expected a
    refusal (expected_refusal reads the log for it), and raised on otherwise."""
    stamps = LogStamps(log)
    stamps.start()
    t0, t0_wall = time.perf_counter(), time.time()
    try:
        engine = build()
    except Exception as exc:
        stamps.stop()
        if not expect_refusal:
            raise
        print(f"driver: the engine did not start ({type(exc).__name__}); looking for the expected refusal", flush=True)
        return EngineStart(None, expected_refusal(log, expect_refusal, exc), time.perf_counter() - t0, stamps,
                           t0_wall)  # fmt: skip
    ready = time.perf_counter() - t0
    stamps.stop()
    if expect_refusal:
        started = {"ok": False, "error": f"the engine started: it had to be refused ({expect_refusal!r})"}
        return EngineStart(engine, started, ready, stamps, t0_wall)
    print(f"driver: engine ready in {ready:.2f} s", flush=True)
    return EngineStart(engine, None, ready, stamps, t0_wall)


# ------------------------------------------------------------------------------------------- start-up stamps
# One clock for every process of a run: the wall clock (time.time(), CLOCK_REALTIME). A driver stamps when a log
# line first appeared and when an engine process was born, and turns consecutive stamps into measured phases, so
# that the start-up's remainders (proof.toml `residual_phases`) hold only what no stamp reaches.


class LogStamps:
    """Lines of a growing log file, each with the wall-clock time its first byte was read.

    A thread polls the file (the runner writes the run's log.txt directly from every process of the run, so the
    engine's processes are not touched); `\\r` ends a piece as `\\n` does, so a progress bar's first state is a
    line of its own. Start it before the engine starts, stop it once the start-up is over.
    """

    def __init__(self, path: str | os.PathLike[str], poll_s: float = 0.01) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self.lines: list[tuple[float, str]] = []
        self._offset = 0
        self._pending = ""
        self._pending_since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="log-stamps", daemon=True)

    def __enter__(self) -> LogStamps:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """From the log's current end: what was written before is not this start-up's."""
        with contextlib.suppress(OSError):
            self._offset = self.path.stat().st_size
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.read_once()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.read_once()

    def read_once(self) -> None:
        """Stamps what was appended since the last read (also callable without the thread, as the tests do)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        if not data:
            return
        now = time.time()
        self._offset += len(data)
        for piece in re.split(r"([\r\n])", data.decode(errors="replace")):
            if piece in ("\r", "\n"):
                if self._pending:
                    self.lines.append((self._pending_since, self._pending))
                self._pending = ""
            elif piece:
                if not self._pending:
                    self._pending_since = now
                self._pending += piece

    def first(self, pattern: re.Pattern[str] | str) -> float | None:
        """When the first line matching `pattern` appeared (wall clock); None: no such line."""
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def last(self, pattern: re.Pattern[str] | str) -> float | None:
        """When the last line matching `pattern` appeared (wall clock); None: no such line."""
        return next((t for t, line in reversed(self.lines) if re.search(pattern, line)), None)


def clock_ticks_to_wall(ticks: int) -> float:
    """A /proc/<pid>/stat start time (clock ticks since boot) on the wall clock, to the tick (10 ms)."""
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else _uptime()
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def process_births(pgid: int) -> list[tuple[float, int, str]]:
    """(born, pid, command line) of every live process of a process group, born on the wall clock, oldest first.
    The command line is what the process shows now (engines retitle theirs: `VLLM::EngineCore`,
    `sglang::scheduler_TP0`). [] without /proc."""
    births = []
    for pid in group_members(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        births.append((clock_ticks_to_wall(int(fields[19])), pid, cmdline.strip()))
    return sorted(births)


def born(births: list[tuple[float, int, str]], title: re.Pattern[str] | str) -> float | None:
    """When the oldest process whose command line matches `title` was born (wall clock); None: none matches."""
    return next((t for t, _pid, cmd in births if re.search(title, cmd)), None)


def stamp_marks(
    line_time: Callable[[str, bool], float | None],
    birth_time: Callable[[str], float | None],
    lines: Mapping[str, str],
    births: Mapping[str, str],
    last_lines: Mapping[str, str] | None = None,
    t0: float | None = None,
) -> dict[str, float]:
    """A run's start-up marks from wherever its lines and processes were seen (a log's LogStamps, a server's
    output): `line_time(pattern, last)` for each of `lines` (first match) and `last_lines` (last match),
    `birth_time(title)` for each of `births`; as found, or in seconds since `t0` to the millisecond. A mark not
    found is left out."""
    found = {name: line_time(pattern, False) for name, pattern in lines.items()}
    found |= {name: line_time(pattern, True) for name, pattern in (last_lines or {}).items()}
    found |= {name: birth_time(title) for name, title in births.items()}
    return {name: t if t0 is None else round(t - t0, 3) for name, t in found.items() if t is not None}


def before(mark: float | None, seconds: float | None) -> float | None:
    """When something that took `seconds` and logged its line at `mark` began (None when either is unknown)."""
    return None if mark is None or seconds is None else mark - seconds


STAMP_SLACK_S = 0.05  # how far a stamped end may fall before its begin and still be read as "no time between"


def consecutive(marks: Sequence[tuple[str, float | None]]) -> dict[str, float]:
    """Measured phases from stamps on one clock, in order: phase `name` is the time from the stamp before it to
    its own. The first mark is where the clock starts (its name is not a phase). A phase with either end missing
    (None) is left out, so what it held stays in the caller's remainder instead of being named wrongly.
    A stamp seen a few ms late, or a logged time rounded to 0.01 s, can put an end a hair before its begin: such a
    phase is 0 (up to STAMP_SLACK_S below); one further below means the stamps are not in the order named, so it
    is left out like a missing end."""
    phases: dict[str, float] = {}
    for (_, begin), (name, end) in itertools.pairwise(marks):
        if begin is not None and end is not None and end - begin >= -STAMP_SLACK_S:
            phases[name] = round(max(0.0, end - begin), 3)
    return phases
