"""A stand-in for `python -m sglang.launch_server` on CPU: the processes, log lines, endpoints and failure path of
SGLang 0.5.17 that the SGLang serve driver relies on.

Started as `python fake_sglang_serve.py --model-path M --port P --tp-size N --context-length C
[--graph-persist save|load --graph-persist-dir DIR] ...`. As SGLang does, the main process starts one scheduler
process per rank (this file again, `--scheduler-rank R`), which logs with a `[time TP<R>]` prefix, writes the
runtime's per-rank stats and its "graphpersist: rank R: saved|restored N graphs" line, then reports ready through a
pipe; only when every rank is ready does the main process log "Engine startup timings (s): ..." and bind the port.
/health (and /health_generate) answer 503 until the server's own warm-up request (GET /model_info, then POST
/generate) has returned, /v1/models answers at once; access-log lines are uvicorn's as SGLang formats them.

A LOAD whose --context-length differs from the archive's is refused in every scheduler with graphpersist's own
message (graphpersist.archive.validate.LoadRefused): "Scheduler hit an exception: <traceback>", then SIGQUIT to the main
process, whose handler SIGKILLs every child and then itself (SGLang's launch-phase handler), so the server ends
killed by SIGKILL. With SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1 the scheduler also SIGKILLs its own process group,
as SGLang's opt-in does. SIGTERM: "Draining requests and shutting down...", then the same SIGKILL of the tree.

FAKE_SERVE (JSON) makes it misbehave: `answer_before_ready` (answer /health with 200 before the schedulers start),
`stream_differs`, `refuse_and_hang` (refuse, but the main process ignores SIGQUIT and never exits), `ignore_term`,
`exit_code` (fail before starting the schedulers), `hang` (never serve), `pid_file` (write the main pid there).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from fake_vllm_serve import VOCAB, Server, text_of, tokens_for

PID = os.getpid()
BEHAVIOUR: dict[str, Any] = json.loads(os.environ.get("FAKE_SERVE", "{}"))
OUT = threading.Lock()  # request threads log too: one whole line at a time
ARCHIVE_FILE = "fake-archive.json"


def say(line: str, prefix: str = "") -> None:
    with OUT:
        sys.stdout.write(f"[2026-11-30 12:00:00{prefix}] {line}\n")
        sys.stdout.flush()


def say_from_handler(line: str) -> None:
    """say() for the signal handlers below: the main thread they interrupt may be inside say() holding OUT, and a
    handler waiting for OUT would wait forever (seen once in CI: the launcher hung on the lock after a scheduler's
    SIGQUIT). So the line goes straight to the file descriptor; every say() has flushed what came before."""
    os.write(sys.stdout.fileno(), f"[2026-11-30 12:00:00] {line}\n".encode())


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--context-length", type=int, default=40960)
    ap.add_argument("--graph-persist", default="off")
    ap.add_argument("--graph-persist-dir")
    ap.add_argument("--scheduler-rank", type=int)
    ap.add_argument("--ready-fd", type=int)
    return ap.parse_known_args(argv)[0]


# ------------------------------------------------------------------------------------------- a scheduler process


def refuse(a: argparse.Namespace, saved: int, prefix: str) -> None:
    """What SGLang's run_scheduler_process does with an exception in Scheduler(...): log it, SIGQUIT the parent."""
    from graphpersist.archive.validate import LoadRefused, Mismatch

    try:
        raise LoadRefused(
            a.graph_persist_dir,
            [
                Mismatch("model.config_fingerprint", "e5ac4b95", "3df1da80"),
                Mismatch("flags.context_length", saved, a.context_length),
            ],
            a.scheduler_rank,
        )
    except LoadRefused:
        say(f"Scheduler hit an exception: {traceback.format_exc().rstrip()}", prefix)
    os.kill(os.getppid(), signal.SIGQUIT)
    if os.environ.get("SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION") == "1":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    if BEHAVIOUR.get("refuse_and_hang"):
        time.sleep(3600)


def write_stats(rank: int, mode: str) -> None:
    folder = os.environ.get("GRAPHPERSIST_STATS_DIR")
    if not folder or mode == "off":
        return
    stats = {"rank": rank, "mode": mode, "captured": 3 if mode == "save" else 0}
    stats |= {"restored": 3 if mode == "load" else 0, "capture_calls": 3 if mode == "save" else 0}
    Path(folder, f"rank_{rank}.json").write_text(json.dumps(stats))


def scheduler(a: argparse.Namespace) -> None:
    rank, mode, prefix = a.scheduler_rank, a.graph_persist, f" TP{a.scheduler_rank}"
    begin = time.perf_counter()  # Scheduler.__init__: its time to ready is scheduler_e2e, as SGLang's
    time.sleep(0.02)  # model config, distributed init
    say("Load weight begin. avail mem=139.00 GB", prefix)
    time.sleep(0.05)  # the weights take what the line says
    say("Load weight end. elapsed=0.05 s, type=Qwen3ForCausalLM, dtype=torch.bfloat16", prefix)
    time.sleep(0.04)  # KV cache and graphs (kv_cache_allocation + cuda_graph in the summary line)
    archive = Path(a.graph_persist_dir or ".")
    if mode == "load":
        saved = json.loads((archive / ARCHIVE_FILE).read_text())["context_length"]
        if saved != a.context_length:
            refuse(a, saved, prefix)
            return  # the process ends, as SGLang's scheduler does after its except block
    verb = {"save": "saved 3 graphs to", "load": "restored 3 graphs from"}.get(mode)
    if verb:
        say(f"graphpersist: rank {rank}: {verb} {archive} in 0.01 s", prefix)
    write_stats(rank, mode)
    time.sleep(0.05)  # the scheduler's set-up after its graphs
    os.write(a.ready_fd, f"ready {time.perf_counter() - begin:.3f}".encode())
    time.sleep(3600)  # the event loop, until the main process kills it


# ------------------------------------------------------------------------------------------- the main process


class State:
    """The server's status as SGLang's TokenizerManager keeps it."""

    up = threading.Event()  # the warm-up has returned: /health answers 200
    ready = threading.Event()  # every scheduler is ready: requests are served
    model = ""
    context_length = 0
    children: list[subprocess.Popen[bytes]] = []  # noqa: RUF012  (one server per process)


def kill_tree() -> None:
    """SGLang's kill_process_tree(os.getpid()): SIGKILL every child, then this process (from a signal handler)."""
    say_from_handler(f"kill_process_tree called: parent_pid={PID}, include_parent=True, pid={PID}")
    for child in State.children:
        if child.poll() is None:
            child.kill()
    os.kill(PID, signal.SIGKILL)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # uvicorn's access log, SGLang's format
        say(f'INFO:     127.0.0.1:{self.client_address[1]} - "{args[0]}" {args[1] if len(args) > 1 else "?"}')

    def reply(self, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path in ("/health", "/health_generate"):
            if not State.up.is_set():
                return self.reply({}, 503)
            time.sleep(0.05)  # one generated token
            return self.reply({})
        if self.path == "/v1/models":
            return self.reply({"object": "list", "data": [{"id": State.model, "object": "model",
                                                           "max_model_len": State.context_length}]})  # fmt: skip
        if self.path == "/model_info":
            return self.reply({"model_path": State.model, "is_generation": True, "has_image_understanding": False})
        if self.path == "/server_info":
            return self.reply({"version": "0.5.17+fake", "context_length": State.context_length})
        return self.reply({"detail": "Not Found"}, 404)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        State.ready.wait(timeout=60)  # a request that arrives early waits for the schedulers, as it would in SGLang
        if self.path == "/generate":
            tokens = tokens_for(sum(request["input_ids"]), request["sampling_params"]["max_new_tokens"])
            return self.reply({"text": text_of(tokens), "output_ids": tokens, "meta_info": {}})
        if self.path == "/v1/completions":
            seed = sum(request["prompt"]) * 31 + len(request["prompt"])
        elif self.path == "/v1/chat/completions":
            seed = sum(ord(c) for m in request["messages"] for c in m["role"] + m["content"])
        else:
            return self.reply({"detail": "Not Found"}, 404)
        tokens = tokens_for(seed, request["max_tokens"])
        if request.get("stream"):
            return self.stream(tokens, request.get("prompt", []))
        ids = {"token_ids": tokens} if request.get("return_token_ids") else {}
        if self.path == "/v1/completions":
            return self.reply({"choices": [{"index": 0, "text": text_of(tokens), **ids}]})
        return self.reply(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": text_of(tokens)}, **ids}]}
        )

    def stream(self, tokens: list[int], prompt: list[int]) -> None:
        """SGLang's completion stream: the prompt's ids on the first chunk, an empty last chunk with finish_reason."""
        if BEHAVIOUR.get("stream_differs"):
            tokens = [*tokens[:-1], (tokens[-1] + 1) % VOCAB]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(0, len(tokens), 5):
            chunk = tokens[i : i + 5]
            choice = {"index": 0, "text": text_of(chunk), "token_ids": chunk, "finish_reason": None}
            if i == 0:
                choice["prompt_token_ids"] = prompt
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        last = {"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}
        self.wfile.write(f"data: {json.dumps({'choices': [last]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def warm_up(port: int) -> None:
    """SGLang's _execute_server_warmup: wait for /model_info, one /generate, then the server is Up."""
    time.sleep(0.3)
    for path, body in (("/model_info", None), ("/generate", {"input_ids": [10, 11, 12]})):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        if body is None:
            conn.request("GET", path)
        else:
            body["sampling_params"] = {"temperature": 0, "max_new_tokens": 8}
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        conn.getresponse().read()
        conn.close()
    State.up.set()
    say("The server is fired up and ready to roll!")


def start_schedulers(argv: list[str], a: argparse.Namespace) -> float:
    """One scheduler process per rank; returns the slowest rank's scheduler_e2e once every rank reported ready
    (SGLang's _wait_for_scheduler_ready)."""
    pipes, e2e = [], 0.0
    for rank in range(a.tp_size):
        read_end, write_end = os.pipe()
        cmd = [sys.executable, __file__, *argv, "--scheduler-rank", str(rank), "--ready-fd", str(write_end)]
        State.children.append(subprocess.Popen(cmd, pass_fds=(write_end,)))
        os.close(write_end)
        pipes.append(read_end)
    for rank, read_end in enumerate(pipes):
        answer = os.read(read_end, 32)
        if not answer.startswith(b"ready"):
            code = State.children[rank].wait()
            raise RuntimeError(f"Rank {rank} scheduler died during initialization (exit code: {code}).")
        e2e = max(e2e, float(answer.split()[1]))
    return e2e


def launch_phase_sigquit(_signum: int, _frame: Any) -> None:
    say_from_handler("Received sigquit from a child process. It usually means the child failed.")
    kill_tree()


def sigterm(_signum: int, _frame: Any) -> None:
    say_from_handler("SIGTERM received. signum=15 frame=None. Draining requests and shutting down...")
    kill_tree()


def main() -> None:
    argv = sys.argv[1:]
    a = parse(argv)
    if a.scheduler_rank is not None:
        return scheduler(a)
    if BEHAVIOUR.get("pid_file"):
        Path(BEHAVIOUR["pid_file"]).write_text(str(PID))
    signal.signal(signal.SIGTERM, signal.SIG_IGN if BEHAVIOUR.get("ignore_term") else sigterm)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN if BEHAVIOUR.get("refuse_and_hang") else launch_phase_sigquit)
    State.model, State.context_length = a.model_path, a.context_length
    say(f"server_args=ServerArgs(model_path='{a.model_path}', tp_size={a.tp_size}, context_length={a.context_length})")
    time.sleep(0.3)  # imports, ServerArgs: the port is not served yet
    if "exit_code" in BEHAVIOUR:
        say("RuntimeError: the fake server fell over")
        sys.exit(BEHAVIOUR["exit_code"])
    if BEHAVIOUR.get("hang"):
        time.sleep(3600)
    if BEHAVIOUR.get("answer_before_ready"):  # a server that says it is healthy while its schedulers still start
        State.up.set()
        threading.Thread(target=Server(("127.0.0.1", a.port), Handler).serve_forever, daemon=True).start()
        time.sleep(1.5)  # the driver's first polls see it healthy
    e2e = start_schedulers(argv, a)
    if a.graph_persist == "save":
        Path(a.graph_persist_dir).mkdir(parents=True, exist_ok=True)
        Path(a.graph_persist_dir, ARCHIVE_FILE).write_text(json.dumps({"context_length": a.context_length}))
    say(f"Engine startup timings (s): load_weight=0.05, kv_cache_allocation=0.02, scheduler_e2e={e2e:.2f}, "
        "cuda_graph={prefill=0.01, decode=0.01}, tokenizer_e2e=0.45")  # fmt: skip
    State.ready.set()
    if BEHAVIOUR.get("answer_before_ready"):
        time.sleep(3600)
    server = Server(("127.0.0.1", a.port), Handler)
    say(f"INFO:     Uvicorn running on http://127.0.0.1:{a.port} (Press CTRL+C to quit)")
    threading.Thread(target=warm_up, args=(a.port,), daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
