"""One `python -m sglang.launch_server` start of the proof: SGLang's OpenAI server in a persistence mode, its workloads.

The proof runner (`python -m gptools.prove`, see proof.toml) starts this once per run as its own process group:
`python serve_driver.py --run NAME --mode off|save|load [--archive DIR] --result FILE [--tp N] [--port P]
[--expect-refusal REGEX] [-- MORE_LAUNCH_SERVER_FLAGS]`.

Without `--model` it serves dummy weights from the model folder of the vLLM serve recipe (its model_folder.py:
Qwen3-8B config.json and a synthetic tokenizer, written once next to the run folders, `<out>/qwen3-8b-dummy`, the
path the SGLang LLM recipe's driver uses too), so both serve proofs answer the same requests with the same words.
It starts `python -m sglang.launch_server` in a process group of its own, with persistence on as the README says
(`--graph-persist MODE --graph-persist-dir DIR`: the switch exports the interposer to the scheduler processes SGLang
spawns). What a run does (readiness, workloads, stop, refusal) is the engine-neutral serve proof in
tools/gptools/serveproof.py; this file says what is SGLang's (read in SGLang 0.5.17's source, README.md "When the
server answers"):

- readiness: the port is not bound before every scheduler has sent "ready", which it does after its CUDA graphs are
  captured or (LOAD) restored; the main process then logs "Engine startup timings (s): ..." and starts uvicorn. So the
  first access-log line of any HTTP 200 must come after that line and after every rank's "graphpersist: rank R:
  saved|restored N graphs" line. /health (and /health_generate, the same handler) answers 503 until SGLang's own
  warm-up request (a POST /generate of 8 tokens) has returned, then generates one token per call before it answers
  200; /v1/models answers 200 as soon as uvicorn listens, before the warm-up;
- phases: the SGLang LLM recipe's vocabulary up to the "Engine startup timings" line, then `serve_start` (uvicorn's
  start, to the first HTTP 200 in the log) and `server_warmup` (SGLang's warm-up request and the first /health
  generation, to /health's 200);
- a refused LOAD: the scheduler raises, logs "Scheduler hit an exception: <traceback>" and sends SIGQUIT to the
  server's main process, whose start-up handler SIGKILLs its whole process tree and itself: the server ends "killed
  by SIGKILL", which counts as non-zero. The driver is not in that tree (the server has its own process group).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tools"))
sys.path.insert(0, str(HERE.parent / "vllm-qwen3-8b-tp2-serve"))

import model_folder  # noqa: E402  (the vLLM serve recipe's model folder: Qwen3-8B config, synthetic tokenizer)

from gptools import openai_http as api  # noqa: E402
from gptools import proofkit, serveproof  # noqa: E402


def _sglang_recipe() -> ModuleType:
    """The SGLang LLM recipe's driver, for its context length, prompts and phases (it imports no engine at module
    level); loaded under its own name, since model_folder imports the vLLM recipe's `driver`."""
    path = HERE.parent / "sglang-qwen3-8b-tp2" / "driver.py"
    spec = importlib.util.spec_from_file_location("sglang_qwen3_8b_tp2_driver", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the SGLang recipe's driver from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


llm_driver = _sglang_recipe()

LAUNCH_SERVER = (sys.executable, "-m", "sglang.launch_server")
READINESS = serveproof.Readiness(
    # The main process, once every scheduler reported ready (their graphs captured or restored).
    engine_ready=re.compile(r"Engine startup timings \(s\): "),
    # uvicorn's access log as SGLang formats it: `[time] INFO:     127.0.0.1:5 - "GET /v1/models HTTP/1.1" 200`.
    first_answer=re.compile(r'"[A-Z]+ /\S* HTTP/1\.[01]" 200\b'),
    first_answer_text="an HTTP 200 (any request)",
)
WARMUP_DONE = re.compile(r"The server is fired up and ready to roll!")
# SGLang's /health generates a token and answers when the detokenizer replies, up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s)
HEALTH_TIMEOUT_S = 30.0


def launch_command(a: argparse.Namespace, model: Path, extra: list[str]) -> list[str]:
    """`python -m sglang.launch_server` with the SGLang LLM recipe's settings; a flag given again in `extra` replaces
    the recipe's value."""
    flags = {
        "--model-path": str(model),
        "--host": "127.0.0.1",
        "--port": str(a.port),
        "--tp-size": str(a.tp),
        "--mem-fraction-static": "0.5",
        "--context-length": str(llm_driver.CONTEXT_LENGTH),
        "--random-seed": "0",
    }
    if not a.model:
        flags["--load-format"] = "dummy"
    if a.mode != "off":
        flags |= {"--graph-persist": a.mode, "--graph-persist-dir": a.archive}
    return serveproof.with_flags(serveproof.program(a, ENGINE), flags, extra)


def stamp_marks(server: serveproof.Server) -> dict[str, float]:
    """The LLM recipe's stamps, read off the server's lines and processes (seconds since the server's start), with
    the server's first line (`front_first_line`: launch_server's imports and argument parsing end there)."""
    lines = {**llm_driver.STAMPED_FIRST, "front_first_line": llm_driver.FRONT_FIRST_LINE}
    return proofkit.stamp_marks(lambda p, last: server.line_time(re.compile(p), last=last), server.born, lines,
                                {"scheduler_born": llm_driver.SCHEDULER_TITLE}, llm_driver.STAMPED_LAST)  # fmt: skip


def phases(server: serveproof.Server, healthy_s: float, stats: list[dict[str, Any]]) -> dict[str, float]:
    """The LLM recipe's phases up to "Engine startup timings" (the server's imports as `front_boot`), then uvicorn's
    start and SGLang's warm-up."""
    engine_ready_s = server.line_time(READINESS.engine_ready)
    if engine_ready_s is None:
        return {}
    log = llm_driver.log_phases("\n".join(server.log()))
    found = llm_driver.start_phases(engine_ready_s, log, stats, stamp_marks(server))
    first_200 = min(max(server.line_time(READINESS.first_answer) or healthy_s, engine_ready_s), healthy_s)
    found["serve_start"] = round(first_200 - engine_ready_s, 3)
    found["server_warmup"] = round(healthy_s - first_200, 3)
    return found


ENGINE = serveproof.ServeEngine(
    name="sglang",
    server="python -m sglang.launch_server",
    program=LAUNCH_SERVER,
    command=launch_command,
    readiness=READINESS,
    phases=phases,
    version=lambda port: api.get_json(port, "/server_info")["version"],
    words=serveproof.Workloads(prompt=llm_driver.prompt, words=model_folder.words),
    write_model=model_folder.write_model,
    restored_files=llm_driver.restored_cache_files,
    health_timeout_s=HEALTH_TIMEOUT_S,
    milestones={"warmup_done_s": WARMUP_DONE},
)


if __name__ == "__main__":
    sys.exit(serveproof.main(ENGINE, __doc__.splitlines()[0]))
