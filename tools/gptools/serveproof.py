"""The engine-neutral part of a serve proof's driver: one OpenAI-compatible server start, its readiness, the workloads.

A serve recipe's driver (recipes/*-serve/serve_driver.py) describes its engine as a `ServeEngine` (the server
command, the log lines that say the engine is ready and the graphs are saved or restored, its start-up phases,
where it reports its version) and calls `main(engine)`; everything else is here, so the vLLM and the SGLang serve
proofs start, poll, load and stop their servers the same way. Standard library only, like proofkit: drivers run
under the engine's Python (3.10 or newer) on the GPU host, with tools/ on their PYTHONPATH.

One run: the server starts in a process group of its own (an engine that kills its whole process tree on a failed
start, as SGLang does, cannot take the driver with it); every line it prints goes through the driver into the run's
log and is kept with the time it was read. Start-up is the time from the process start to the first HTTP 200 from
/health. Readiness: in the log, the first access-log line of an HTTP 200 must come after the engine's ready line and,
in SAVE and LOAD, after every rank's "graphpersist: rank R: saved|restored N graphs" line: the server answers nothing
before the archive is written or loaded. Workloads (greedy, 32 tokens, ignore_eos, `return_token_ids` so the
answers carry the generated token ids): four completions with token-id prompts one at a time, 16 concurrent
completions, a streamed completion whose text and tokens must equal the same request unstreamed, two chat
conversations. Then the server is stopped: SIGTERM, SIGKILL to its whole group after the grace.

With `--expect-refusal REGEX` the run proves a refusal instead: ok only when the server exits non-zero (an exit code
or a signal) without ever answering /health with 200, and its log matches REGEX (`.` matches newlines too: a refusal
lists one mismatch per line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptools import openai_http as api
from gptools import proofkit

POLL_S = 0.25
GEN = 32
GRAPHS_DONE = {
    "save": re.compile(r"graphpersist: rank (\d+): saved \d+ graphs"),
    "load": re.compile(r"graphpersist: rank (\d+): restored \d+ graphs"),
}
OUT_LOCK = threading.Lock()  # the driver's lines and the server's share one stdout (the run's log)


def say(message: str) -> None:
    with OUT_LOCK:
        print(f"serve_driver: {message}", flush=True)


# ------------------------------------------------------------------------------------------- the server process


@dataclass
class Server:
    """The server in a process group of its own; its output is copied to our stdout and kept with read times."""

    command: list[str]
    proc: subprocess.Popen[bytes] = field(init=False)
    started: float = field(init=False)
    started_wall: float = field(init=False)  # the same moment on the wall clock, the clock every process shares
    lines: list[tuple[float, str]] = field(default_factory=list, init=False)  # (seconds since start, line)
    births: list[tuple[float, int, str]] = field(default_factory=list, init=False)  # (seconds since start, pid, cmd)
    _reader: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.started, self.started_wall = time.perf_counter(), time.time()
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._copy_output, name="server-output", daemon=True)
        self._reader.start()

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            text = raw.decode(errors="replace")
            with OUT_LOCK:
                sys.stdout.write(text if text.endswith("\n") else text + "\n")
                sys.stdout.flush()
                self.lines.append((self.seconds(), text.rstrip("\n")))

    def seconds(self) -> float:
        """Seconds since the process was started."""
        return time.perf_counter() - self.started

    def log(self) -> list[str]:
        with OUT_LOCK:
            return [line for _, line in self.lines]

    def line_time(self, pattern: re.Pattern[str], last: bool = False) -> float | None:
        """When the first (or last) line matching `pattern` was read, in seconds since the start; None: no such line."""
        with OUT_LOCK:
            times = [t for t, line in self.lines if pattern.search(line)]
        return (times[-1] if last else times[0]) if times else None

    def record_births(self) -> None:
        """When each live process of the server's group was born (seconds since the start): call it while the
        engine's processes run (at health), so the phases can say when the engine's own process began."""
        self.births = [(round(t - self.started_wall, 3), pid, cmd)
                       for t, pid, cmd in proofkit.process_births(self.proc.pid)]  # fmt: skip

    def born(self, title: re.Pattern[str] | str) -> float | None:
        """When the oldest process of the group whose command line matches `title` was born (seconds since the
        start); None when none did (or record_births was not called)."""
        return proofkit.born(self.births, title)

    def kill(self) -> None:
        """SIGKILL to the whole group at once (the driver itself is being ended)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, grace_s: float) -> dict[str, Any]:
        """SIGTERM to the server, which shuts its engine down its own way; SIGKILL to the group after `grace_s`."""
        began, killed, sent = time.perf_counter(), False, None
        if self.proc.poll() is None:
            sent = "SIGTERM"
            self.proc.send_signal(signal.SIGTERM)
        deadline = began + grace_s
        while proofkit.group_members(self.proc.pid) and time.perf_counter() < deadline:
            time.sleep(0.1)
        if proofkit.group_members(self.proc.pid):
            killed = True
            self.kill()
        self.proc.wait()
        self._reader.join(timeout=10)
        return {
            "signal": sent,
            "seconds": round(time.perf_counter() - began, 3),
            "killed_after_grace": killed,
            "exit_code": self.proc.returncode,
        }


def exit_text(code: int) -> str:
    """How a process ended, as people say it: "exit 1", "killed by SIGKILL"."""
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def with_flags(command: list[str], flags: dict[str, str], extra: list[str]) -> list[str]:
    """`command` + the recipe's `flags` + `extra`; a flag given again in `extra` (`--f v` or `--f=v`) replaces the
    recipe's value, so a run's args (proof.toml) can change one setting of the recipe."""
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}
    cmd = list(command)
    for flag, value in flags.items():
        if flag not in given:
            cmd += [flag, value]
    return cmd + extra


# ------------------------------------------------------------------------------------------- readiness


@dataclass
class Polls:
    """What the polled endpoints answered while the server started (e.g. "/health refused": 212), and when the
    first 200 came: from /health (`healthy_s`, the start-up time) and from any polled endpoint (`first_200_s`)."""

    answers: Counter[str] = field(default_factory=Counter)
    healthy_s: float | None = None
    first_200_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"answers": dict(self.answers), "healthy_s": self.healthy_s, "first_200_s": self.first_200_s}


def wait_healthy(server: Server, port: int, timeout_s: float, health_timeout_s: float) -> Polls:
    """Polls /health and /v1/models until /health answers 200, the server exits, or `timeout_s` passes.

    `health_timeout_s` bounds one /health request (SGLang's generates a token before it answers)."""
    polls = Polls()
    while server.seconds() < timeout_s and server.proc.poll() is None:
        health = api.probe(port, "/health", health_timeout_s)
        polls.answers[f"/health {health}"] += 1
        if health == "200":
            polls.healthy_s = server.seconds()
            polls.first_200_s = polls.first_200_s or polls.healthy_s
            return polls
        models = api.probe(port, "/v1/models")
        polls.answers[f"/v1/models {models}"] += 1
        if models == "200" and polls.first_200_s is None:
            polls.first_200_s = server.seconds()
        time.sleep(POLL_S)
    return polls


@dataclass(frozen=True)
class Readiness:
    """The log lines that show when an engine is ready and when the server first answered."""

    engine_ready: re.Pattern[str]  # the engine logs it once, when every rank has finished its start (graphs included)
    first_answer: re.Pattern[str]  # an access-log line of an HTTP 200
    first_answer_text: str  # what `first_answer` matches, in words ("a 200 from /health or /v1/models")

    def problems(self, log: list[str], mode: str, ranks: int) -> tuple[list[str], dict[str, Any]]:
        """Why the log does not show the engine ready (and, in SAVE/LOAD, every rank's graphs done) before the
        first 200. Returns the problems ([] when the order is right) and the evidence: line numbers (1-based), lines."""
        first = next((i for i, line in enumerate(log) if self.first_answer.search(line)), None)
        engine = [i for i, line in enumerate(log) if self.engine_ready.search(line)]
        done = GRAPHS_DONE.get(mode)
        graphs = [(i, int(m.group(1))) for i, line in enumerate(log) if done and (m := done.search(line))]
        evidence = {
            "first_200": None if first is None else {"line": first + 1, "text": log[first]},
            "engine_ready": [{"line": i + 1, "text": log[i]} for i in engine[:1]],
            "graphs": [{"line": i + 1, "text": log[i]} for i, _ in graphs],
        }
        if first is None:
            return [f"no access-log line of {self.first_answer_text} in the server's log"], evidence
        problems = []
        if not engine:
            problems.append(f"log line {first + 1} answered 200, but the engine never logged that it was ready")
        elif engine[0] > first:
            problems.append(f"log line {first + 1} answered 200 before the engine was ready (line {engine[0] + 1})")
        if done is not None:
            verb = "saved" if mode == "save" else "restored"
            missing = sorted(set(range(ranks)) - {rank for _, rank in graphs})
            if not graphs:
                problems.append(f"no 'graphpersist: rank R: {verb} N graphs' line in the log")
            elif missing:
                problems.append(f"no 'graphpersist: rank R: {verb} N graphs' line from rank(s) {missing}")
            elif graphs[-1][0] > first:
                line = graphs[-1][0] + 1
                problems.append(f"log line {first + 1} answered 200 before the graphs were {verb} (line {line})")
        return problems, evidence


# ------------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workloads:
    """The requests' words: `prompt(seed, length)` gives token ids, `words(ids)` text the tokenizer reads as them."""

    prompt: Callable[[int, int], list[int]]
    words: Callable[[list[int]], str]

    def conversations(self) -> list[list[dict[str, str]]]:
        """Two chats in the tokenizer's words."""
        p, w = self.prompt, self.words
        return [
            [{"role": "system", "content": w(p(700, 12))}, {"role": "user", "content": w(p(701, 40))}],
            [
                {"role": "user", "content": w(p(702, 20))},
                {"role": "assistant", "content": w(p(703, 10))},
                {"role": "user", "content": w(p(704, 30))},
            ],
        ]


def completion_body(model: str, prompt: list[int]) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": GEN,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def _tokens(choice: dict[str, Any], what: str) -> list[int]:
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise api.ServerError(f"{what}: the answer has no token_ids (return_token_ids): {json.dumps(choice)[:300]}")
    return ids


def complete(port: int, model: str, prompt: list[int]) -> tuple[list[int], str]:
    """One greedy completion: (generated token ids, text)."""
    choice = api.post_json(port, "/v1/completions", completion_body(model, prompt))["choices"][0]
    return _tokens(choice, "/v1/completions"), choice["text"]


def complete_streamed(port: int, model: str, prompt: list[int]) -> tuple[list[int], str]:
    """The same completion streamed: token ids and text concatenated over the events."""
    tokens: list[int] = []
    text = ""
    for event in api.post_stream(port, "/v1/completions", completion_body(model, prompt)):
        for choice in event.get("choices", []):
            tokens += choice.get("token_ids") or []
            text += choice.get("text") or ""
    return tokens, text


def chat(port: int, model: str, messages: list[dict[str, str]]) -> tuple[list[int], str]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": GEN,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    choice = api.post_json(port, "/v1/chat/completions", body)["choices"][0]
    return _tokens(choice, "/v1/chat/completions"), choice["message"]["content"]


@dataclass
class Served:
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, workload: str, answers: list[tuple[list[int], str]]) -> None:
        self.outputs[workload] = [tokens for tokens, _ in answers]
        self.texts[workload] = [text for _, text in answers]


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def serve_workloads(port: int, model: str, words: Workloads, with_chat: bool, after_first: Callable[[], Any]) -> Served:
    """The workloads, in order; `after_first()` runs right after the first request (the JIT snapshot)."""
    p, served = words.prompt, Served()
    sequential_prompts = [p(i, n) for i, n in enumerate((7, 64, 300, 1000))]
    first, first_s = timed(complete, port, model, sequential_prompts[0])
    after_first()
    served.add("sequential", [first] + [complete(port, model, q) for q in sequential_prompts[1:]])
    steady = [timed(complete, port, model, sequential_prompts[0])[1] for _ in range(3)]

    concurrent_prompts = [p(100 + i, 16 + 9 * i) for i in range(16)]
    with ThreadPoolExecutor(max_workers=len(concurrent_prompts)) as pool:
        began = time.perf_counter()
        concurrent = list(pool.map(lambda q: complete(port, model, q), concurrent_prompts))
        concurrent_s = time.perf_counter() - began
    served.add("concurrent", concurrent)

    stream_prompt = p(300, 50)
    streamed, plain = complete_streamed(port, model, stream_prompt), complete(port, model, stream_prompt)
    served.add("streamed", [streamed])
    if streamed != plain:
        served.problems.append(
            f"the streamed completion differs from the same request unstreamed: tokens {streamed[0][:8]}... vs "
            f"{plain[0][:8]}..., text {streamed[1][:60]!r} vs {plain[1][:60]!r}"
        )
    if with_chat:
        served.add("chat", [chat(port, model, messages) for messages in words.conversations()])
    served.latency = {
        "first_request_s": round(first_s, 4),
        "steady_request_s": round(statistics.median(steady), 4),
        "concurrent_16_s": round(concurrent_s, 4),
    }
    return served


# ------------------------------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class ServeEngine:
    """What a serve driver says about its engine; `main(engine)` does the rest.

    `command(args, model_folder, extra)` is the server's command line; `phases(server, healthy_s, stats)` the
    start-up phases (adding up to `healthy_s`); `version(port)` asks the running server its version;
    `restored_files(stats)` names the cache files LOAD put back from the archive (they are not new JIT work);
    `milestones` are log lines whose read times go into readiness.times (name -> pattern).
    """

    name: str  # result.json's engine.name
    server: str  # how help texts and messages name the server ("vllm serve")
    program: tuple[str, ...]  # what --server-cmd replaces
    command: Callable[[argparse.Namespace, Path, list[str]], list[str]]
    readiness: Readiness
    phases: Callable[[Server, float, list[dict[str, Any]]], dict[str, float]]
    version: Callable[[int], str]
    words: Workloads
    write_model: Callable[[Path], Path]  # the dummy model's folder (config and tokenizer), written where it differs
    restored_files: Callable[[list[dict[str, Any]]], set[str]] = lambda _stats: set()
    health_timeout_s: float = 2.0
    milestones: dict[str, re.Pattern[str]] = field(default_factory=dict)  # more log lines to time (readiness.times)


def program(a: argparse.Namespace, engine: ServeEngine) -> list[str]:
    """The server program: the engine's, or --server-cmd (the tests' fake server)."""
    return shlex.split(a.server_cmd) if a.server_cmd else list(engine.program)


def model_path(a: argparse.Namespace, engine: ServeEngine) -> Path:
    """The checkpoint (--model) or the dummy model's folder, one path for every run of the proof's --out (the model
    path is part of the configuration LOAD compares)."""
    if a.model:
        return Path(a.model)
    return engine.write_model(Path(a.result).resolve().parent.parent / "qwen3-8b-dummy")


def port_in_use(port: int) -> bool:
    return api.probe(port, "/health", timeout_s=1.0) != "refused"


def start_server(engine: ServeEngine, a: argparse.Namespace, extra: list[str]) -> Server:
    if port_in_use(a.port):
        raise RuntimeError(f"port {a.port} answers already (a server left from an earlier run?): end it or use --port")
    cmd = engine.command(a, model_path(a, engine), extra)
    say(f"starting {shlex.join(cmd)}")
    server = Server(cmd)

    def ended(signum: int, _frame: Any) -> None:
        """The runner ends a run with SIGTERM to the driver's group; the server's group is its own: end it too."""
        server.kill()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, ended)
    return server


def timeline(server: Server, engine: ServeEngine, mode: str, polls: Polls) -> dict[str, float | None]:
    """When (seconds since the server's start, as the driver read the lines) the graphs were done, the engine was
    ready and the server first answered 200: the restore must come before any answer."""
    done = GRAPHS_DONE.get(mode)
    return {
        "graphs_done_s": server.line_time(done, last=True) if done else None,
        "engine_ready_s": server.line_time(engine.readiness.engine_ready),
        "first_200_line_s": server.line_time(engine.readiness.first_answer),
        "first_200_polled_s": polls.first_200_s,
        "healthy_s": polls.healthy_s,
        **{name: server.line_time(pattern) for name, pattern in engine.milestones.items()},
    }


def run_serve(engine: ServeEngine, a: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    before = proofkit.cache_snapshot()
    server = start_server(engine, a, extra)
    snapshots: dict[str, set[str]] = {}
    try:
        polls = wait_healthy(server, a.port, a.ready_timeout, engine.health_timeout_s)
        if polls.healthy_s is None:
            code = server.proc.poll()
            why = f"did not answer within {a.ready_timeout:g} s"
            if code is not None:
                why = f"exited with code {code}" if code >= 0 else f"was {exit_text(code)}"
            raise RuntimeError(f"the server {why} before /health answered 200 (the log says why)")
        server.record_births()  # the engine's processes run now: their birth times are in /proc
        snapshots["ready"] = proofkit.cache_snapshot()
        say(f"/health answered 200 after {polls.healthy_s:.2f} s")
        model = api.get_json(a.port, "/v1/models")["data"][0]["id"]
        version = engine.version(a.port)
        served = serve_workloads(
            a.port, model, engine.words, not a.no_chat, lambda: snapshots.setdefault("first", proofkit.cache_snapshot())
        )
    finally:
        shutdown = server.stop(a.stop_grace)
        say(f"server stopped: {shutdown}")
    problems, evidence = engine.readiness.problems(server.log(), a.mode, a.tp)
    problems += served.problems
    stats = proofkit.rank_stats()
    restored = engine.restored_files(stats)
    new_start = [f for f in proofkit.new_files(before, snapshots["ready"]) if f not in restored]
    new_first = proofkit.new_files(snapshots["ready"], snapshots["first"])
    return {
        "ok": not problems,
        "error": "; ".join(problems) or None,
        "start_to_ready_s": round(polls.healthy_s, 3),
        "phases": engine.phases(server, polls.healthy_s, stats),
        "outputs": served.outputs,
        "texts": served.texts,
        "latency": served.latency,
        "jit": {
            "new_cache_files_start": len(new_start),
            "new_cache_files_first_request": len(new_first),
            "examples": (new_start + new_first)[:10],
        },
        "engine": {"name": engine.name, "version": version},
        "readiness": {"polls": polls.to_dict(), "times": timeline(server, engine, a.mode, polls), **evidence},
        "server": {"command": server.command, "shutdown": shutdown},
        "graphpersist_stats": stats,
    }


def run_refusal(engine: ServeEngine, a: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """The server must stop by itself, non-zero, never healthy, with the expected reason in its log."""
    server = start_server(engine, a, extra)
    try:
        polls = wait_healthy(server, a.port, a.ready_timeout, engine.health_timeout_s)
        exited_s = server.seconds()
        code = server.proc.poll()
    finally:
        shutdown = server.stop(a.stop_grace)
        say(f"server stopped: {shutdown}")
    text = "\n".join(server.log())
    match = re.search(a.expect_refusal, text, re.DOTALL)
    problems = []
    if polls.healthy_s is not None:
        problems.append(f"the server answered /health with 200 after {polls.healthy_s:.2f} s: it was not refused")
    elif code is None:
        problems.append(f"the server did not exit within {a.ready_timeout:g} s (refusal logged: {bool(match)})")
    elif code == 0:
        problems.append("the server exited with code 0: a refusal must stop it with an error")
    if match is None:
        problems.append(f"the server's log does not match {a.expect_refusal!r}")
    first, last = proofkit.refusal_lines(text, match) if match else (None, None)
    if match and code is not None:
        say(f"refused as expected ({exit_text(code)}): {last.strip()}")
    return {
        "ok": not problems,
        "error": "; ".join(problems) or None,
        "outputs": {},
        "refusal": {
            "pattern": a.expect_refusal,
            "exit_code": code,
            "exit": exit_text(code) if code is not None else None,
            "exited_s": round(exited_s, 3) if code is not None else None,
            "first_line": first,
            "matched": last,
        },
        "readiness": {"polls": polls.to_dict()},
        "server": {"command": server.command, "shutdown": shutdown},
    }


def parse_args(
    engine: ServeEngine, description: str, argv: list[str] | None = None
) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        description=description,
        epilog=f"Flags after `--` go to `{engine.server}` unchanged; one of the driver's own flags given there "
        "replaces it.",
    )
    ap.add_argument("--run", required=True, help="run name (for the logs)")
    ap.add_argument("--mode", choices=proofkit.MODES, required=True)
    ap.add_argument("--archive", help="archive directory (save/load)")
    ap.add_argument("--result", required=True, help="where to write result.json")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    ap.add_argument("--port", type=int, default=8000, help="the server's port (default 8000)")
    ap.add_argument("--model", help="a real checkpoint directory (default: dummy Qwen3-8B weights, written here)")
    ap.add_argument("--expect-refusal", metavar="REGEX", help="the server must refuse to start, saying this")
    ap.add_argument("--ready-timeout", type=float, default=450.0, help="seconds to wait for /health (default 450)")
    ap.add_argument("--stop-grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL (default 30)")
    ap.add_argument("--no-chat", action="store_true", help="skip the chat workload (a checkpoint without template)")
    ap.add_argument(
        "--server-cmd", help=f"the program instead of `{shlex.join(engine.program)}` (the tests' fake server)"
    )
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:split])
    if (a.archive is None) != (a.mode == "off"):
        ap.error(f"--archive is {'needed' if a.archive is None else 'not allowed'} with --mode {a.mode}")
    return a, argv[split + 1 :]


def main(engine: ServeEngine, description: str) -> int:
    """One run: the server served (or refused), result.json written; exit 0 whenever result.json was written."""
    a, extra = parse_args(engine, description)
    say(f"run {a.run}: mode={a.mode} tp={a.tp} archive={a.archive} port={a.port} extra={extra}")
    try:
        result = run_refusal(engine, a, extra) if a.expect_refusal else run_serve(engine, a, extra)
    except Exception as exc:  # the runner reports it; the log has the traceback
        import traceback

        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    proofkit.write_result(Path(a.result), result)
    say(f"wrote {a.result}: ok={result['ok']}" + (f" ({result['error']})" if result.get("error") else ""))
    return 0
