"""A stand-in for `vllm serve` on CPU: the log lines, endpoints and archive behaviour the serve driver relies on.

Started as `python fake_vllm_serve.py serve MODEL --port P ... [--graph-persist save|load --graph-persist-dir DIR]`.
It logs like vLLM (process prefixes, the engine's "init engine ... took" line, graphpersist's per-rank saved/restored
lines, uvicorn's access log), then answers /health, /version, /v1/models, /v1/completions (also streamed) and
/v1/chat/completions with greedy-looking tokens computed from the request, the same every time. SAVE writes a tiny
archive with its max_model_len; a LOAD whose max_model_len differs is refused with graphpersist's own message
(graphpersist.archive.validate.LoadRefused) and exits 1, as vLLM does when its engine fails to start. Stats files go to
GRAPHPERSIST_STATS_DIR like the real engine's.

FAKE_SERVE (JSON) makes it misbehave: `answer_before_ready` (serve before the engine's line), `stream_differs`,
`refuse_and_hang` (refuse, then never exit), `ignore_term`, `exit_code` (fail before serving), `hang` (never serve),
`pid_file` (write its pid there).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

VOCAB = 151936
PID = os.getpid()
BEHAVIOUR: dict[str, Any] = json.loads(os.environ.get("FAKE_SERVE", "{}"))


OUT = threading.Lock()  # request threads log too: one whole line at a time


def say(line: str) -> None:
    with OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def log(process: str, message: str) -> None:
    say(f"({process} pid={PID}) INFO 11-30 12:00:00 [fake.py:1] {message}")


def tokens_for(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 104729 * i) % VOCAB for i in range(n)]


def text_of(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens)


class Server(ThreadingHTTPServer):
    request_queue_size = 64  # 16 concurrent requests must not overflow the listen backlog (uvicorn's is 2048)


class Handler(BaseHTTPRequestHandler):
    model = ""

    def log_message(self, format: str, *args: Any) -> None:  # uvicorn's access-log format
        status = args[1] if len(args) > 1 else "?"
        phrase = "OK" if status == "200" else ""
        say(f'(APIServer pid={PID}) INFO:     127.0.0.1:{self.client_address[1]} - "{args[0]}" {status} {phrase}')

    def reply(self, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/version":
            self.reply({"version": "0.26.0+fake"})
        elif self.path == "/v1/models":
            self.reply({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            self.reply({"error": {"message": "not found"}}, 404)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = request["max_tokens"]
        if self.path == "/v1/completions":
            seed = sum(request["prompt"]) * 31 + len(request["prompt"])
        elif self.path == "/v1/chat/completions":
            seed = sum(ord(c) for m in request["messages"] for c in m["role"] + m["content"])
        else:
            return self.reply({"error": {"message": "not found"}}, 404)
        tokens = tokens_for(seed, n)
        if request.get("stream"):
            return self.stream(tokens)
        ids = {"token_ids": tokens} if request.get("return_token_ids") else {}
        if self.path == "/v1/completions":
            return self.reply({"choices": [{"index": 0, "text": text_of(tokens), **ids}]})
        return self.reply(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": text_of(tokens)}, **ids}]}
        )

    def stream(self, tokens: list[int]) -> None:
        if BEHAVIOUR.get("stream_differs"):
            tokens = [*tokens[:-1], (tokens[-1] + 1) % VOCAB]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(0, len(tokens), 5):
            chunk = tokens[i : i + 5]
            event = {"choices": [{"index": 0, "text": text_of(chunk), "token_ids": chunk}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def write_stats(mode: str, tp: int) -> None:
    folder = os.environ.get("GRAPHPERSIST_STATS_DIR")
    if not folder or mode == "off":
        return
    for rank in range(tp):
        stats = {"rank": rank, "mode": mode, "captured": 3 if mode == "save" else 0}
        stats |= {"restored": 3 if mode == "load" else 0, "capture_calls": 3 if mode == "save" else 0}
        Path(folder, f"rank_{rank}.json").write_text(json.dumps(stats))


def refuse(archive: Path, saved: int, live: int, tp: int) -> None:
    from graphpersist.archive.validate import LoadRefused, Mismatch

    for rank in range(tp):
        reason = LoadRefused(archive, [Mismatch("flags.max_model_len", saved, live)], rank)
        say(f"(Worker_TP{rank} pid={PID}) ERROR 11-30 12:00:01 [multiproc_executor.py:901] WorkerProc failed to start.")
        for line in f"graphpersist.archive.validate.LoadRefused: {reason}".splitlines():
            say(f"(Worker_TP{rank} pid={PID}) {line}")
    say(f"(APIServer pid={PID}) RuntimeError: Engine core initialization failed. See root cause above.")
    if BEHAVIOUR.get("refuse_and_hang"):
        time.sleep(3600)
    sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--graph-persist", default="off")
    ap.add_argument("--graph-persist-dir")
    a, _ = ap.parse_known_args()
    if BEHAVIOUR.get("pid_file"):
        Path(BEHAVIOUR["pid_file"]).write_text(str(PID))
    if BEHAVIOUR.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log("APIServer", f"vLLM API server version 0.26.0+fake, model {a.model}")
    time.sleep(0.3)  # imports and engine start: the port is not served yet
    if "exit_code" in BEHAVIOUR:
        say(f"(APIServer pid={PID}) RuntimeError: the fake engine fell over")
        sys.exit(BEHAVIOUR["exit_code"])
    if BEHAVIOUR.get("hang"):
        time.sleep(3600)
    tp, mode = a.tensor_parallel_size, a.graph_persist
    archive = Path(a.graph_persist_dir or ".") / "fake-archive.json"
    if mode == "load":
        saved = json.loads(archive.read_text())["max_model_len"]
        if saved != a.max_model_len:
            refuse(archive.parent, saved, a.max_model_len, tp)
    log("EngineCore_DP0", "Initializing a V1 LLM engine (v0.26.0+fake)")
    time.sleep(0.07)  # the worker's set-up, then the weights take what their line says
    log("EngineCore_DP0", "Model loading took 1.00 GiB and 0.05 seconds")
    started_init = time.perf_counter()
    for rank in range(tp):
        verb = {"save": "saved 3 graphs to", "load": "restored 3 graphs from"}.get(mode)
        if verb:
            log(f"Worker_TP{rank}", f"graphpersist: rank {rank}: {verb} {archive.parent} in 0.01 s")
    if mode == "save":
        archive.parent.mkdir(parents=True, exist_ok=True)
        archive.write_text(json.dumps({"max_model_len": a.max_model_len}))
    write_stats(mode, tp)
    Handler.model = a.model
    if BEHAVIOUR.get("answer_before_ready"):  # a server that says it is healthy while its engine still starts
        early = Server(("127.0.0.1", a.port), Handler)
        threading.Thread(target=early.serve_forever, daemon=True).start()
        time.sleep(1.5)
    time.sleep(max(0.0, 0.1 - (time.perf_counter() - started_init)))
    took = time.perf_counter() - started_init
    log("EngineCore_DP0", f"init engine (profile, create kv cache, warmup model) took {took:.2f} s")
    log("APIServer", f"Starting vLLM server on http://0.0.0.0:{a.port}")
    if BEHAVIOUR.get("answer_before_ready"):
        time.sleep(3600)
    Server(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
