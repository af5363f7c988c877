"""One `vllm serve` start of the proof: the OpenAI server in the given persistence mode, its workloads, result.json.

The proof runner (`python -m gptools.prove`, see proof.toml) starts this once per run as its own process group:
`python serve_driver.py --run NAME --mode off|save|load [--archive DIR] --result FILE [--tp N] [--port P]
[--expect-refusal REGEX] [-- MORE_VLLM_SERVE_FLAGS]`.

Without `--model` it writes the model folder once next to the run folders (model_folder.py: Qwen3-8B config.json
and a synthetic tokenizer; one path for every run, since the model path is part of the configuration LOAD compares)
and serves dummy weights. It starts `python -m vllm.entrypoints.cli.main serve` (what the `vllm` command runs) in a
process group of its own. What a run does (readiness, workloads, stop, refusal) is the engine-neutral serve proof in
tools/gptools/serveproof.py; this file says what is vLLM's:

- readiness: the first access-log line of a 200 from /health or /v1/models must come after the engine's "init engine
  ... took" line (vLLM's EngineCore logs it once every worker has finished its warm-up and graphs) and, in SAVE and
  LOAD, after every rank's "graphpersist: rank R: saved|restored N graphs" line;
- phases: the LLM() recipe's vocabulary up to the engine's ready line, then `serve_start` (the API server's start);
- stop: SIGTERM to vLLM's API server (its own ordered shutdown, in drain mode: `--shutdown-timeout 10`), SIGKILL to
  the whole group after 30 s.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tools"))
sys.path.insert(0, str(HERE.parent / "vllm-qwen3-8b-tp2"))

import driver as llm_driver  # noqa: E402  (the LLM() recipe's driver: prompts, vLLM's log phases)
import model_folder  # noqa: E402

from gptools import openai_http as api  # noqa: E402
from gptools import proofkit, serveproof  # noqa: E402

VLLM_CLI = (sys.executable, "-m", "vllm.entrypoints.cli.main")  # what the `vllm` console script runs
GRAPHPERSIST_EXEC = [sys.executable, "-m", "graphpersist", "exec", "--"]  # what `graphpersist exec --` runs
READINESS = serveproof.Readiness(
    engine_ready=re.compile(r"init engine \(profile, create kv cache, warmup model\) took"),
    first_answer=re.compile(r'"GET /(?:health|v1/models) HTTP/1\.[01]" 200'),  # uvicorn's access log
    first_answer_text="a 200 from /health or /v1/models",
)


def serve_command(a: argparse.Namespace, model: Path, extra: list[str]) -> list[str]:
    """`vllm serve MODEL` with the recipe's flags; a flag given again in `extra` replaces the recipe's value."""
    flags = {
        "--port": str(a.port),
        "--tensor-parallel-size": str(a.tp),
        "--gpu-memory-utilization": "0.5",
        "--max-model-len": "4096",
        "--seed": "0",
        # drain, not upstream's default abort (0): an abort kills the engine core while the API server's output
        # handler still reads from it, which then logs EngineDeadError at a clean stop (seen once in serve_save)
        "--shutdown-timeout": "10",
    }
    if not a.model:
        flags["--load-format"] = "dummy"
    if a.tp > 1:  # see the LLM() recipe's README: the flashinfer fusion needs NVLink multicast (not on this host)
        flags["--compilation-config"] = json.dumps({"pass_config": {"fuse_allreduce_rms": False}})
    if a.mode != "off":
        flags |= {"--graph-persist": a.mode, "--graph-persist-dir": a.archive}
    cmd = [*serveproof.program(a, ENGINE), "serve", str(model)]
    if a.mode != "off" and not a.server_cmd:  # as the README advises: vLLM then forks its processes
        cmd = [*GRAPHPERSIST_EXEC, *cmd]
    return serveproof.with_flags(cmd, flags, extra)


API_SERVER_FIRST_LINE = r"\(APIServer\w* pid=\d+\)"  # vLLM's API server prefixes its lines once it runs (decorate_logs)


def stamp_marks(server: serveproof.Server) -> dict[str, float]:
    """The LLM() recipe's stamps, read off the server's lines and processes (seconds since the server's start),
    with the API server's first line (`front_first_line`: its imports and argument parsing end there)."""
    lines = {"front_first_line": API_SERVER_FIRST_LINE, **llm_driver.STAMPED_LINES}
    return proofkit.stamp_marks(lambda p, last: server.line_time(re.compile(p), last=last), server.born, lines,
                                {"core_born": llm_driver.ENGINE_CORE_TITLE})  # fmt: skip


def phases(server: serveproof.Server, healthy_s: float, stats: list[dict[str, Any]]) -> dict[str, float]:
    """The LLM() recipe's phases up to the engine's ready line (the API server's imports as `front_boot`), then the
    API server's own start (`serve_start`: the engine core's last set-up, the app, uvicorn, to /health's 200)."""
    engine_ready_s = server.line_time(READINESS.engine_ready)
    if engine_ready_s is None:
        return {}
    log = llm_driver.log_phases("\n".join(server.log()))
    found = llm_driver.start_phases(engine_ready_s, log, stats, stamp_marks(server))
    found["serve_start"] = round(healthy_s - engine_ready_s, 3)
    return found


ENGINE = serveproof.ServeEngine(
    name="vllm",
    server="vllm serve",
    program=VLLM_CLI,
    command=serve_command,
    readiness=READINESS,
    phases=phases,
    version=lambda port: api.get_json(port, "/version")["version"],
    words=serveproof.Workloads(prompt=llm_driver.prompt, words=model_folder.words),
    write_model=model_folder.write_model,
)


if __name__ == "__main__":
    sys.exit(serveproof.main(ENGINE, __doc__.splitlines()[0]))
