"""The `vllm serve` proof driver (recipes/vllm-qwen3-8b-tp2-serve) on CPU, against a fake server.

What a GPU is not needed for: the SSE parser, the server command, the readiness and refusal logic, stopping the
server's process group, and the committed proof.toml end to end through `python -m gptools prove` with
fake_vllm_serve.py standing in for `vllm serve` (`--server-cmd`). The synthetic tokenizer is checked with the real
`tokenizers`, `transformers` and vLLM's own tokenizer loading in the CPU vLLM venv (network, slow).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import serve_fixtures

from gptools.__main__ import main as gptools_main

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "vllm-qwen3-8b-tp2-serve"
FAKE = Path(__file__).resolve().with_name("fake_vllm_serve.py")
sys.path.insert(0, str(RECIPE))

import serve_driver  # noqa: E402

from gptools import jsonfile, openai_http, serveproof  # noqa: E402

REFUSED = next(r for r in tomllib.loads((RECIPE / "proof.toml").read_text())["run"] if r["name"] == "serve_refused")


DRIVER = serve_fixtures.ServeDriver(RECIPE, FAKE, "max_model_len")
driver_command, drive, saved_archive = DRIVER.command, DRIVER.drive, DRIVER.saved_archive
free_port, gone = serve_fixtures.free_port, serve_fixtures.gone


@pytest.fixture
def fake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    serve_fixtures.runtime_importable(monkeypatch)


# ------------------------------------------------------------------------------------------- pure logic


def test_sse_events_are_the_json_data_up_to_done() -> None:
    stream = [
        b'data: {"a": 1}\n',
        b"\n",
        b": a comment keeps the connection open\n",
        b"\n",
        b'data: {"b":\r\n',
        b"data: 2}\r\n",
        b"event: ignored\r\n",
        b"\r\n",
        b"data: [DONE]\n",
        b"\n",
        b'data: {"after": "done"}\n',
        b"\n",
    ]
    assert list(openai_http.sse_events(stream)) == [{"a": 1}, {"b": 2}]


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        ([b'data: {"a": 1}\n', b"\n"], "the stream ended without `data: [DONE]`"),
        ([b"data: {not json\n", b"\n", b"data: [DONE]\n", b"\n"], "a streamed event is not JSON: {not json"),
    ],
)
def test_a_broken_stream_is_an_error(stream: list[bytes], message: str) -> None:
    with pytest.raises(openai_http.ServerError, match=message.replace("[", r"\[").replace("]", r"\]")):
        list(openai_http.sse_events(stream))


def parsed(*argv: str) -> tuple[Any, list[str]]:
    return serveproof.parse_args(serve_driver.ENGINE, "test", ["--run", "r", "--result", "/tmp/r.json", *argv])


def test_the_serve_command_pins_the_recipe_and_lets_extra_flags_replace_them() -> None:
    a, extra = parsed("--mode", "load", "--archive", "/a", "--", "--max-model-len", "2048", "--enable-prefix-caching")
    cmd = serve_driver.serve_command(a, Path("/m"), extra)
    exec_prefix = [sys.executable, "-m", "graphpersist", "exec", "--"]  # save/load: vLLM forks its processes
    assert cmd[:10] == [*exec_prefix, sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert cmd.count("--max-model-len") == 1 and cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert cmd[-1] == "--enable-prefix-caching"
    assert cmd[cmd.index("--graph-persist") :][:4] == ["--graph-persist", "load", "--graph-persist-dir", "/a"]
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert cmd[cmd.index("--shutdown-timeout") + 1] == "10"  # drain at the stop: no abort race in the log
    assert json.loads(cmd[cmd.index("--compilation-config") + 1]) == {"pass_config": {"fuse_allreduce_rms": False}}

    a, extra = parsed("--mode", "off", "--tp", "1", "--model", "/ckpt", "--", "--max-model-len=1024")
    cmd = serve_driver.serve_command(a, Path("/ckpt"), extra)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/ckpt"]  # off: upstream's
    assert "--graph-persist" not in cmd and "--load-format" not in cmd and "--compilation-config" not in cmd
    assert "--max-model-len" not in cmd and cmd[-1] == "--max-model-len=1024"


def test_an_archive_goes_with_save_and_load_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parsed("--mode", "load")
    assert "--archive is needed with --mode load" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parsed("--mode", "off", "--archive", "/a")
    assert "--archive is not allowed with --mode off" in capsys.readouterr().err


ACCESS = '(APIServer pid=1) INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 200 OK'
ENGINE = "(EngineCore_DP0 pid=2) INFO [core.py:348] init engine (profile, create kv cache, warmup model) took 3.1 s"
RESTORED = "(Worker_TP{r} pid=3) INFO graphpersist: rank {r}: restored 1938 graphs from /a in 1.10 s"


def test_readiness_needs_the_engine_and_every_graph_line_before_the_first_200() -> None:
    problems = serve_driver.READINESS.problems
    both = [RESTORED.format(r=0), RESTORED.format(r=1)]
    assert problems([*both, ENGINE, "Starting vLLM server", ACCESS], "load", 2)[0] == []
    found, evidence = problems([*both, ACCESS, ENGINE], "load", 2)
    assert found == ["log line 3 answered 200 before the engine was ready (line 4)"]
    assert evidence["first_200"] == {"line": 3, "text": ACCESS}
    late_rank = [RESTORED.format(r=0), ENGINE, ACCESS, RESTORED.format(r=1)]
    assert problems(late_rank, "load", 2)[0] == ["log line 3 answered 200 before the graphs were restored (line 4)"]
    assert problems([RESTORED.format(r=0), ENGINE, ACCESS], "load", 2)[0] == [
        "no 'graphpersist: rank R: restored N graphs' line from rank(s) [1]"
    ]
    assert problems([ENGINE, ACCESS], "save", 2)[0] == ["no 'graphpersist: rank R: saved N graphs' line in the log"]
    assert problems([ENGINE, ACCESS], "off", 2)[0] == []
    assert problems(["starting", ACCESS], "off", 2)[0] == [
        "log line 2 answered 200, but the engine never logged that it was ready"
    ]
    assert problems([ENGINE], "off", 2)[0] == [
        "no access-log line of a 200 from /health or /v1/models in the server's log"
    ]


# ------------------------------------------------------------------------------------------- against the fake


def test_a_refused_load_passes_as_a_refusal_run(tmp_path: Path, fake_env: None) -> None:
    result, printed = drive(tmp_path, "refused", "load", *REFUSED["args"], archive=saved_archive(tmp_path))
    assert result["ok"] is True, result["error"]
    refusal = result["refusal"]
    assert refusal["exit_code"] == 1 and refusal["exited_s"] > 0
    assert refusal["matched"].endswith("flags.max_model_len: saved 4096, live 2048")
    assert "graphpersist: cannot LOAD" in refusal["first_line"]
    assert result["outputs"] == {} and "/health 200" not in result["readiness"]["polls"]["answers"]
    command = result["server"]["command"]
    assert command.count("--max-model-len") == 1 and command[command.index("--max-model-len") + 1] == "2048"
    assert "serve_driver: refused as expected (exit 1)" in printed


def test_a_refusal_run_fails_when_the_server_becomes_healthy(tmp_path: Path, fake_env: None) -> None:
    result, _ = drive(tmp_path, "refused", "load", "--expect-refusal", "cannot LOAD", archive=saved_archive(tmp_path))
    assert result["ok"] is False
    assert "answered /health with 200 after" in result["error"] and "it was not refused" in result["error"]
    assert "does not match 'cannot LOAD'" in result["error"]


def test_a_refusal_for_another_reason_fails(tmp_path: Path, fake_env: None) -> None:
    archive = saved_archive(tmp_path, 8192)  # saved 8192, live 4096: refused, but not as expected
    result, _ = drive(tmp_path, "refused", "load", *REFUSED["args"][:2], archive=archive)
    assert result["ok"] is False
    assert result["error"] == f"the server's log does not match {REFUSED['args'][1]!r}"
    assert result["refusal"]["exit_code"] == 1


def test_a_refusal_that_never_exits_fails_and_the_server_is_ended(tmp_path: Path, fake_env: None) -> None:
    pid_file = tmp_path / "server.pid"
    behaviour = {"refuse_and_hang": True, "pid_file": str(pid_file)}
    args = [*REFUSED["args"][:2], "--ready-timeout", "3", "--stop-grace", "1", *REFUSED["args"][2:]]
    result, _ = drive(tmp_path, "refused", "load", *args, behaviour=behaviour, archive=saved_archive(tmp_path))
    assert result["ok"] is False
    assert result["error"] == "the server did not exit within 3 s (refusal logged: True)"
    assert gone(int(pid_file.read_text()))


def test_a_server_that_answers_before_its_engine_is_ready_fails(tmp_path: Path, fake_env: None) -> None:
    result, _ = drive(tmp_path, "early", "off", "--stop-grace", "1", behaviour={"answer_before_ready": True})
    assert result["ok"] is False
    assert "answered 200, but the engine never logged that it was ready" in result["error"]  # stopped before


def test_a_stream_that_differs_from_the_plain_answer_fails(tmp_path: Path, fake_env: None) -> None:
    result, _ = drive(tmp_path, "stream", "off", behaviour={"stream_differs": True})
    assert result["ok"] is False
    assert result["error"].startswith("the streamed completion differs from the same request unstreamed")


def test_a_server_that_exits_before_it_is_healthy_fails(tmp_path: Path, fake_env: None) -> None:
    result, printed = drive(tmp_path, "crash", "off", behaviour={"exit_code": 3})
    assert result == {
        "ok": False,
        "error": "RuntimeError: the server exited with code 3 before /health answered 200 (the log says why)",
    }
    assert "RuntimeError: the fake engine fell over" in printed  # the server's output is in the run's log


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path, fake_env: None) -> None:
    pid_file = tmp_path / "server.pid"
    behaviour = {"ignore_term": True, "pid_file": str(pid_file)}
    result, _ = drive(tmp_path, "stubborn", "off", "--stop-grace", "1", behaviour=behaviour)
    assert result["ok"] is True, result["error"]
    shutdown = result["server"]["shutdown"]
    assert shutdown["signal"] == "SIGTERM" and shutdown["killed_after_grace"] is True and shutdown["exit_code"] == -9
    assert gone(int(pid_file.read_text()))


def test_a_port_that_answers_already_is_refused_before_starting(tmp_path: Path, fake_env: None) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = driver_command(tmp_path, "busy", "off")
        cmd[cmd.index("--port") + 1] = str(port)
        subprocess.run(cmd, capture_output=True, timeout=60, check=True)
    result = json.loads((tmp_path / "busy" / "result.json").read_text())
    assert result["ok"] is False
    assert f"port {port} answers already (a server left from an earlier run?)" in result["error"]


def test_sigterm_to_the_driver_ends_the_servers_group(tmp_path: Path, fake_env: None) -> None:
    pid_file = tmp_path / "server.pid"
    env = dict(os.environ, FAKE_SERVE=json.dumps({"hang": True, "pid_file": str(pid_file)}))
    driver = subprocess.Popen(driver_command(tmp_path, "ended", "off"), env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    server = int(pid_file.read_text())
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while not gone(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(server)


# ------------------------------------------------------------------------------------------- the committed proof


@pytest.fixture(scope="module")
def proof(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The committed proof.toml, its driver pointed at the fake server, run by `python -m gptools prove`."""
    tmp = tmp_path_factory.mktemp("serve-proof")
    (tmp / "model").mkdir()
    recipe = tmp / "recipe"
    recipe.mkdir()
    fake = ["--model", str(tmp / "model"), "--port", str(free_port()), "--server-cmd", f"{sys.executable} {FAKE}"]
    text = (RECIPE / "proof.toml").read_text()
    [driver_line] = [line for line in text.splitlines() if line.startswith("driver = ")]
    driver = json.loads(driver_line.removeprefix("driver = "))
    driver[1] = str(RECIPE / driver[1])
    (recipe / "proof.toml").write_text(text.replace(driver_line, f"driver = {json.dumps(driver + fake)}"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(str(REPO / p) for p in ("overlays/graphpersist", "tools")))
        env.delenv("FAKE_SERVE", raising=False)
        code = gptools_main(["prove", str(recipe), "--out", str(tmp / "out")])
    report = jsonfile.load(tmp / "out" / "report.json.gz")
    assert code == 0, [c for c in report["checks"] if c["status"] != "pass"]
    return tmp / "out", report


def test_the_committed_proof_passes_against_the_fake_server(proof: tuple[Path, dict[str, Any]]) -> None:
    report = proof[1]
    checks = {c["name"]: c for c in report["checks"]}
    assert report["headline"] == "all checks passed"
    assert checks["outputs identical"]["detail"] == "4 runs identical in sequential, concurrent, streamed, chat"
    assert checks["serve_refused refused"]["detail"].endswith("flags.max_model_len: saved 4096, live 2048")
    assert checks["serve_load restored every graph"]["status"] == "pass"
    assert checks["serve_load_fork restored every graph"]["status"] == "pass"
    fork = json.loads((proof[0] / "serve_load_fork" / "run.json").read_text())
    assert fork["env"] == {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    assert not [name for name in checks if name.startswith("serve_refused") and "log clean" in name]
    assert [t["name"] for t in report["targets"] if t["status"] == "not measured"] == []


def test_each_serving_run_records_readiness_workloads_and_shutdown(proof: tuple[Path, dict[str, Any]]) -> None:
    out, _ = proof
    for run in ("serve_save", "serve_load", "serve_baseline"):
        result = json.loads((out / run / "result.json").read_text())
        answers = result["readiness"]["polls"]["answers"]
        assert answers["/health 200"] == 1 and answers["/health refused"] >= 1, answers
        assert [len(result["outputs"][w]) for w in ("sequential", "concurrent", "streamed", "chat")] == [4, 16, 1, 2]
        assert all(len(tokens) == serveproof.GEN for w in result["outputs"].values() for tokens in w)
        assert result["texts"]["chat"][0].startswith(" w")
        assert result["readiness"]["first_200"]["line"] > result["readiness"]["engine_ready"][0]["line"]
        assert sum(result["phases"].values()) == pytest.approx(result["start_to_ready_s"], abs=0.01)
        assert min(result["phases"].values()) >= 0 and result["phases"]["weights"] == 0.05
        assert result["server"]["shutdown"]["signal"] == "SIGTERM"
        assert result["server"]["shutdown"]["killed_after_grace"] is False
        log = (out / run / "log.txt").read_text()
        assert '"GET /health HTTP/1.1" 200' in log  # the server's own lines are in the run's log
    load = json.loads((out / "serve_load" / "result.json").read_text())
    assert [g["text"].split("graphpersist: ")[1][:25] for g in load["readiness"]["graphs"]] == [
        "rank 0: restored 3 graphs",
        "rank 1: restored 3 graphs",
    ]


# ------------------------------------------------------------------------------------------- the tokenizer

TOKENIZER_CHECK = """
import json, sys
from pathlib import Path
import model_folder
folder = model_folder.write_model(Path(sys.argv[1]))
from transformers import AutoTokenizer
from tokenizers.decoders import DecodeStream
from vllm.tokenizers import get_tokenizer
hf = AutoTokenizer.from_pretrained(folder)
vllm_tok = get_tokenizer(str(folder))
ids = [5, 1000, 872, 77091, 8948, 151935, 151642]
generated = [123, 151645, 99999, 151643, 7]
stream = DecodeStream(ids=ids, skip_special_tokens=True)
messages = [{"role": "system", "content": model_folder.words([11, 12])},
            {"role": "user", "content": model_folder.words([13, 14, 15])}]
print("RESULT " + json.dumps({
    "class": type(hf).__name__, "len": len(hf), "vllm_len": len(vllm_tok), "eos": hf.eos_token_id,
    "roundtrip": hf.encode(model_folder.words(ids), add_special_tokens=False),
    "decoded": hf.decode(generated, skip_special_tokens=True),
    "streamed": "".join(stream.step(hf._tokenizer, i) or "" for i in generated),
    "chat": vllm_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
    "chat_ids": hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False),
    "files": sorted(p.name for p in folder.iterdir()),
}))
"""


@pytest.mark.network
@pytest.mark.slow
def test_the_synthetic_tokenizer_loads_in_transformers_and_vllm(vllm_venv: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(RECIPE), str(REPO / "tools")])
    env |= {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [str(vllm_venv / "bin" / "python"), "-c", TOKENIZER_CHECK, str(tmp_path / "model")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    assert got["len"] == got["vllm_len"] == 151936  # every id of the config's vocabulary has a token
    assert got["eos"] == 151645
    assert got["roundtrip"] == [5, 1000, 872, 77091, 8948, 151935, 151642]
    assert got["decoded"] == "w123 w99999 w7"  # special tokens skipped, unknown ids impossible
    assert got["streamed"].strip() == got["decoded"]  # incremental decoding (vLLM's) agrees with a full decode
    turns = ["system\nw11 w12<|im_end|>", "user\nw13 w14 w15<|im_end|>", "assistant"]
    assert got["chat"] == "".join(f"<|im_start|>{t}\n" for t in turns)
    assert got["chat_ids"] == [151644, 8948, 11, 12, 151645, 151644, 872, 13, 14, 15, 151645, 151644, 77091]
    assert got["files"] == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert got["class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
