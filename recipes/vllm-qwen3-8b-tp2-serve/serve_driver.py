"""One `vllm serve` start of the proof: the OpenAI server in the given persistence mode, its workloads, result.json.

The proof runner (`python -m gptools.prove`, see proof.toml) starts this once per run as its own process group:
`python serve_driver.py --run NAME --mode off|save|load [--archive DIR] --result FILE [--tp N] [--port P]
[--expect-refusal REGEX] [-- MORE_VLLM_SERVE_FLAGS]`.

Without `--model` it writes the model folder once next to the run folders (model_folder.py: Qwen3-8B config.json
and a synthetic tokenizer; one path for every run, since the model path is part of the configuration LOAD compares)
and serves dummy weights. It starts `python -m vllm.entrypoints.cli.main serve` (what the `vllm` command runs) in a
process group of its own; every line the server prints goes through this driver into the run's log and is kept for
the checks. Start-up is the time from the process start to the first HTTP 200 from /health (polled every 0.25 s).

Readiness: in the server's log, the first access-log line of a 200 from /health or /v1/models must come after the
engine's "init engine ... took" line and, in SAVE and LOAD, after every "graphpersist: rank R: saved|restored N
graphs" line: the server says it is ready only once the archive is written or loaded.

Workloads (greedy, 32 tokens, ignore_eos; the server returns the generated token ids, `return_token_ids`): four
completions with token-id prompts one at a time, 16 concurrent completions, a streamed completion whose text and
tokens must equal the same request unstreamed, two chat conversations (the synthetic tokenizer's chat template).
Then the server is stopped: SIGTERM to vLLM's API server (its own ordered shutdown), SIGKILL to the whole group
after 30 s.

With `--expect-refusal REGEX` the run proves a refusal instead: ok only when the server exits non-zero without
ever answering /health with 200 and its log matches REGEX (`.` matches newlines too: a refusal lists one mismatch
per line).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tools"))
sys.path.insert(0, str(HERE.parent / "vllm-qwen3-8b-tp2"))

import driver as llm_driver  # noqa: E402  (the LLM() recipe's driver: prompts, vLLM's log phases)
import openai_http as api  # noqa: E402

from gptools import proofkit  # noqa: E402

VLLM_CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]  # what the `vllm` console script runs
GRAPHPERSIST_EXEC = [sys.executable, "-m", "graphpersist", "exec", "--"]  # what `graphpersist exec --` runs
POLL_S = 0.25
GEN = 32
# The engine is ready (vLLM's EngineCore logs it once every worker has finished its warm-up and graphs).
ENGINE_READY = re.compile(r"init engine \(profile, create kv cache, warmup model\) took")
GRAPHS_DONE = {
    "save": re.compile(r"graphpersist: rank \d+: saved \d+ graphs"),
    "load": re.compile(r"graphpersist: rank \d+: restored \d+ graphs"),
}
FIRST_ANSWER = re.compile(r'"GET /(?:health|v1/models) HTTP/1\.[01]" 200')  # uvicorn's access log
OUT_LOCK = threading.Lock()  # the driver's lines and the server's share one stdout (the run's log)


def say(message: str) -> None:
    with OUT_LOCK:
        print(f"serve_driver: {message}", flush=True)


# ------------------------------------------------------------------------------------------- the server process


@dataclass
class Server:
    """`vllm serve` in a process group of its own; its output is copied to our stdout and kept with read times."""

    command: list[str]
    proc: subprocess.Popen[bytes] = field(init=False)
    started: float = field(init=False)
    lines: list[tuple[float, str]] = field(default_factory=list, init=False)  # (seconds since start, line)
    _reader: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.started = time.perf_counter()
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

    def first_line_time(self, pattern: re.Pattern[str]) -> float | None:
        with OUT_LOCK:
            return next((t for t, line in self.lines if pattern.search(line)), None)

    def kill(self) -> None:
        """SIGKILL to the whole group at once (the driver itself is being ended)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, grace_s: float) -> dict[str, Any]:
        """SIGTERM to the API server, which shuts its engine down in order; SIGKILL to the group after `grace_s`."""
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


def serve_command(a: argparse.Namespace, model: Path, extra: list[str]) -> list[str]:
    """`vllm serve MODEL` with the recipe's flags; a flag given again in `extra` replaces the recipe's value."""
    flags = {
        "--port": str(a.port),
        "--tensor-parallel-size": str(a.tp),
        "--gpu-memory-utilization": "0.5",
        "--max-model-len": "4096",
        "--seed": "0",
    }
    if not a.model:
        flags["--load-format"] = "dummy"
    if a.tp > 1:  # see the LLM() recipe's README: the flashinfer fusion needs NVLink multicast (not on this host)
        flags["--compilation-config"] = json.dumps({"pass_config": {"fuse_allreduce_rms": False}})
    if a.mode != "off":
        flags |= {"--graph-persist": a.mode, "--graph-persist-dir": a.archive}
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}
    cmd = [*(shlex.split(a.server_cmd) if a.server_cmd else VLLM_CLI), "serve", str(model)]
    if a.mode != "off" and not a.server_cmd:  # as the README advises: vLLM then forks its processes
        cmd = [*GRAPHPERSIST_EXEC, *cmd]
    for flag, value in flags.items():
        if flag not in given:
            cmd += [flag, value]
    return cmd + extra


# ------------------------------------------------------------------------------------------- readiness


@dataclass
class Polls:
    """What /health and /v1/models answered while the server started (e.g. "/health refused": 212)."""

    answers: Counter[str] = field(default_factory=Counter)
    healthy_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"answers": dict(self.answers), "healthy_s": self.healthy_s}


def wait_healthy(server: Server, port: int, timeout_s: float) -> Polls:
    """Polls /health and /v1/models until /health answers 200, the server exits, or `timeout_s` passes."""
    polls = Polls()
    while server.seconds() < timeout_s and server.proc.poll() is None:
        health = api.probe(port, "/health")
        polls.answers[f"/health {health}"] += 1
        if health == "200":
            polls.healthy_s = server.seconds()
            return polls
        polls.answers[f"/v1/models {api.probe(port, '/v1/models')}"] += 1
        time.sleep(POLL_S)
    return polls


def readiness_problems(log: list[str], mode: str) -> tuple[list[str], dict[str, Any]]:
    """Why the log does not show the engine ready (and, in SAVE/LOAD, the graphs done) before the first 200.

    Returns the problems ([] when the order is right) and the evidence: line numbers (1-based) and lines.
    """
    first = next((i for i, line in enumerate(log) if FIRST_ANSWER.search(line)), None)
    engine = [i for i, line in enumerate(log) if ENGINE_READY.search(line)]
    graphs = [i for i, line in enumerate(log) if mode in GRAPHS_DONE and GRAPHS_DONE[mode].search(line)]
    evidence = {
        "first_200": None if first is None else {"line": first + 1, "text": log[first]},
        "engine_ready": [{"line": i + 1, "text": log[i]} for i in engine[:1]],
        "graphs": [{"line": i + 1, "text": log[i]} for i in graphs],
    }
    if first is None:
        return ["no access-log line of a 200 from /health or /v1/models in the server's log"], evidence
    problems = []
    if not engine:
        problems.append(f"log line {first + 1} answered 200, but the engine never logged that it was ready")
    elif engine[0] > first:
        problems.append(f"log line {first + 1} answered 200 before the engine was ready (line {engine[0] + 1})")
    if mode in GRAPHS_DONE:
        verb = "saved" if mode == "save" else "restored"
        if not graphs:
            problems.append(f"no 'graphpersist: rank R: {verb} N graphs' line in the log")
        elif graphs[-1] > first:
            problems.append(f"log line {first + 1} answered 200 before the graphs were {verb} (line {graphs[-1] + 1})")
    return problems, evidence


# ------------------------------------------------------------------------------------------- workloads


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


def conversations() -> list[list[dict[str, str]]]:
    """Two chats in the synthetic tokenizer's words (each word is one token id)."""
    from model_folder import words

    p = llm_driver.prompt
    return [
        [{"role": "system", "content": words(p(700, 12))}, {"role": "user", "content": words(p(701, 40))}],
        [
            {"role": "user", "content": words(p(702, 20))},
            {"role": "assistant", "content": words(p(703, 10))},
            {"role": "user", "content": words(p(704, 30))},
        ],
    ]


@dataclass
class Served:
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def add(self, workload: str, answers: list[tuple[list[int], str]]) -> None:
        self.outputs[workload] = [tokens for tokens, _ in answers]
        self.texts[workload] = [text for _, text in answers]


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def serve_workloads(port: int, model: str, with_chat: bool, after_first: Any) -> Served:
    """The workloads, in order; `after_first()` runs right after the first request (the JIT snapshot)."""
    p, served = llm_driver.prompt, Served()
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
        served.add("chat", [chat(port, model, messages) for messages in conversations()])
    served.latency = {
        "first_request_s": round(first_s, 4),
        "steady_request_s": round(statistics.median(steady), 4),
        "concurrent_16_s": round(concurrent_s, 4),
    }
    return served


# ------------------------------------------------------------------------------------------- one run


def model_path(a: argparse.Namespace) -> Path:
    if a.model:
        return Path(a.model)
    from model_folder import write_model

    return write_model(Path(a.result).resolve().parent.parent / "qwen3-8b-dummy")


def port_in_use(port: int) -> bool:
    return api.probe(port, "/health", timeout_s=1.0) != "refused"


def start_server(a: argparse.Namespace, extra: list[str]) -> Server:
    if port_in_use(a.port):
        raise RuntimeError(f"port {a.port} answers already (a server left from an earlier run?): end it or use --port")
    model = model_path(a)
    cmd = serve_command(a, model, extra)
    say(f"starting {shlex.join(cmd)}")
    server = Server(cmd)

    def ended(signum: int, _frame: Any) -> None:
        """The runner ends a run with SIGTERM to the driver's group; the server's group is its own: end it too."""
        server.kill()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, ended)
    return server


def run_serve(a: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    before = proofkit.cache_snapshot()
    server = start_server(a, extra)
    snapshots: dict[str, set[str]] = {}
    try:
        polls = wait_healthy(server, a.port, a.ready_timeout)
        if polls.healthy_s is None:
            code = server.proc.poll()
            why = f"exited with code {code}" if code is not None else f"did not answer within {a.ready_timeout:g} s"
            raise RuntimeError(f"the server {why} before /health answered 200 (the log says why)")
        snapshots["ready"] = proofkit.cache_snapshot()
        say(f"/health answered 200 after {polls.healthy_s:.2f} s")
        model = api.get_json(a.port, "/v1/models")["data"][0]["id"]
        version = api.get_json(a.port, "/version")["version"]
        served = serve_workloads(
            a.port, model, not a.no_chat, lambda: snapshots.setdefault("first", proofkit.cache_snapshot())
        )
        engine_ready_s = server.first_line_time(ENGINE_READY)
    finally:
        shutdown = server.stop(a.stop_grace)
        say(f"server stopped: {shutdown}")
    problems, evidence = readiness_problems(server.log(), a.mode)
    problems += served.problems
    stats = llm_driver.rank_stats()
    phases = {}
    if engine_ready_s is not None:  # the LLM() recipe's phases up to the engine, then the API server's own start
        phases = llm_driver.start_phases(engine_ready_s, llm_driver.log_phases("\n".join(server.log())), stats)
        phases["serve_start"] = round(polls.healthy_s - engine_ready_s, 3)
    new_start = proofkit.new_files(before, snapshots["ready"])
    new_first = proofkit.new_files(snapshots["ready"], snapshots["first"])
    return {
        "ok": not problems,
        "error": "; ".join(problems) or None,
        "start_to_ready_s": round(polls.healthy_s, 3),
        "phases": phases,
        "outputs": served.outputs,
        "texts": served.texts,
        "latency": served.latency,
        "jit": {
            "new_cache_files_start": len(new_start),
            "new_cache_files_first_request": len(new_first),
            "examples": (new_start + new_first)[:10],
        },
        "engine": {"name": "vllm", "version": version},
        "readiness": {"polls": polls.to_dict(), **evidence},
        "server": {"command": server.command, "shutdown": shutdown},
        "graphpersist_stats": stats,
    }


def refusal_lines(text: str, match: re.Match[str]) -> tuple[str, str]:
    """The log lines where a match begins and ends."""

    def line_at(pos: int) -> str:
        start = text.rfind("\n", 0, pos) + 1
        end = text.find("\n", pos)
        return text[start : end if end >= 0 else len(text)]

    return line_at(match.start()), line_at(max(match.start(), match.end() - 1))


def run_refusal(a: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """The server must stop by itself, non-zero, never healthy, with the expected reason in its log."""
    server = start_server(a, extra)
    try:
        polls = wait_healthy(server, a.port, a.ready_timeout)
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
    first, last = refusal_lines(text, match) if match else (None, None)
    if match:
        say(f"refused as expected (exit {code}): {last.strip()}")
    return {
        "ok": not problems,
        "error": "; ".join(problems) or None,
        "outputs": {},
        "refusal": {
            "pattern": a.expect_refusal,
            "exit_code": code,
            "exited_s": round(exited_s, 3) if code is not None else None,
            "first_line": first,
            "matched": last,
        },
        "readiness": {"polls": polls.to_dict()},
        "server": {"command": server.command, "shutdown": shutdown},
    }


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Flags after `--` go to `vllm serve` unchanged; one of the driver's own flags given there replaces it.",
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
        "--server-cmd", help="the command that takes `serve MODEL ...` (default: this Python's vLLM CLI; tests: a fake)"
    )
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:split])
    if (a.archive is None) != (a.mode == "off"):
        ap.error(f"--archive is {'needed' if a.archive is None else 'not allowed'} with --mode {a.mode}")
    return a, argv[split + 1 :]


def main() -> int:
    a, extra = parse_args()
    say(f"run {a.run}: mode={a.mode} tp={a.tp} archive={a.archive} port={a.port} extra={extra}")
    try:
        result = run_refusal(a, extra) if a.expect_refusal else run_serve(a, extra)
    except Exception as exc:  # the runner reports it; the log has the traceback
        import traceback

        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    proofkit.write_result(Path(a.result), result)
    say(f"wrote {a.result}: ok={result['ok']}" + (f" ({result['error']})" if result.get("error") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
