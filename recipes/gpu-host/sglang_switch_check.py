"""Prove the SGLang graph-persistence switch on the GPU host with the real ``ServerArgs`` (real torch, no stubs).

Run ON the host after installing ``.device/sglang-switch/*.whl`` into a folder on ``PYTHONPATH``::

    python3 recipes/gpu-host/sglang_switch_check.py --report SGLANG-SWITCH-REPORT.md

Each check is independent and ends PASS, FAIL or NOT RUN (with the reason). The report's first line is
``all checks passed`` only when every check passed; otherwise it names the failed and the not-run checks.
Nothing here starts an engine or touches the GPU beyond what ``ServerArgs.__post_init__`` itself does.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import inspect
import io
import json
import logging
import os
import platform
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SWITCH_LOGGER = "sglang.srt.graphpersist_switch"
OUR_FIELDS = ("graph_persist", "graph_persist_dir")
KERNEL_MODULES = ("sgl_kernel", "flashinfer")  # kernel wheels deliberately not carried (383 MB / 14 MB)
BAD_MODE_LINE = (
    "graphpersist: invalid persistence mode 'sav' (from keyword graph_persist); expected one of: off, save, load"
)

# A small Qwen3 config written by hand (no weights, no tokenizer): enough for transformers' AutoConfig.
QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "vocab_size": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclasses.dataclass
class Result:
    """One check's outcome: PASS, FAIL or NOT RUN, with a one-line detail and optional evidence."""

    name: str
    status: str
    detail: str
    evidence: str = ""


class NotRun(Exception):
    """Raised by a check that could not run here; the message says why, ``evidence`` may show where."""

    def __init__(self, why: str, evidence: str = "") -> None:
        super().__init__(why)
        self.evidence = evidence


class Captured(logging.Handler):
    """Collects the messages of the switch's logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def switch_log() -> Iterator[Captured]:
    """Capture what ``sglang.srt.graphpersist_switch`` logs while the block runs."""
    handler = Captured()
    logger = logging.getLogger(SWITCH_LOGGER)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@contextlib.contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Set (or, with None, unset) GRAPHPERSIST_* variables for the block, restoring them afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


NO_ENV: dict[str, str | None] = {"GRAPHPERSIST_MODE": None, "GRAPHPERSIST_DIR": None}


def missing_kernel(err: BaseException) -> str | None:
    """The kernel module whose absence stopped a build, or None when the error is anything else."""
    if isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] in KERNEL_MODULES:
        return err.name
    return None


class Checker:
    """Runs the checks against the installed SGLang; holds the temporary model and archive directories."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.model = work / "qwen3-tiny"
        self.model.mkdir()
        (self.model / "config.json").write_text(json.dumps(QWEN3_CONFIG, indent=2))
        self.archive = work / "archive"
        self.archive.mkdir()
        self.missing = work / "no-such-archive"
        self.results: list[Result] = []
        self.notes: list[str] = []
        from sglang.srt.server_args import ServerArgs

        self.ServerArgs = ServerArgs
        self.full_build_blocker: str | None = None

    # -- helpers -------------------------------------------------------------------------------------------------
    def run(self, name: str, fn: Callable[[], tuple[str, str]]) -> None:
        """Run one check; an exception other than NotRun is a FAIL with its traceback as evidence."""
        print(f"[check] {name} ...", flush=True)
        try:
            detail, evidence = fn()
            result = Result(name, "PASS", detail, evidence)
        except NotRun as why:
            result = Result(name, "NOT RUN", str(why), why.evidence)
        except Exception as err:
            result = Result(name, "FAIL", f"{type(err).__name__}: {err}".splitlines()[0], traceback.format_exc())
        print(f"[{result.status}] {name}: {result.detail}", flush=True)
        self.results.append(result)

    def build(self, **kwargs: Any) -> tuple[Any, list[str], str | None]:
        """ServerArgs with the Qwen3 dir; returns (args or None, switch log lines, missing kernel module or None).

        A build that gets past the switch but stops later because a kernel wheel was not carried returns
        (None, lines, module); any other exception propagates.
        """
        kwargs.setdefault("model_path", str(self.model))
        kwargs.setdefault("random_seed", 1)
        with switch_log() as log:
            try:
                return self.ServerArgs(**kwargs), log.lines, None
            except Exception as err:
                module = missing_kernel(err)
                if module is None:
                    raise
                return None, log.lines, module

    def later_stop(self, module: str | None) -> str:
        return (
            "" if module is None else f"; ServerArgs then stopped later at `No module named '{module}'` (not carried)"
        )

    # -- checks --------------------------------------------------------------------------------------------------
    def check_full_build(self) -> tuple[str, str]:
        """Plain ServerArgs(model_path=<Qwen3 dir>) builds completely (context for the other checks)."""
        with env(**NO_ENV):
            try:
                args = self.ServerArgs(model_path=str(self.model), random_seed=1)
            except Exception as err:
                module = missing_kernel(err)
                if module is None:
                    raise
                self.full_build_blocker = module
                frames = [f for f in traceback.extract_tb(err.__traceback__) if "/sglang/" in f.filename]
                where = "\n".join(f"{f.filename.split('/sglang/', 1)[1]}:{f.lineno} {f.line}" for f in frames)
                raise NotRun(
                    f"ServerArgs(model_path=<Qwen3 dir>) imports `{module}` on CUDA (import chain in the evidence); "
                    "its kernel wheel is not in the carried set, so the switch checks below use the Qwen3 dir up to "
                    "that point and model_path='dummy' for complete builds",
                    "sglang frames, outermost first:\n" + where,
                ) from None
        return f"built: model_path={args.model_path} dtype={args.dtype} attention_backend={args.attention_backend}", ""

    def check_save_kwargs(self) -> tuple[str, str]:
        with env(**NO_ENV):
            args, lines, module = self.build(graph_persist="save", graph_persist_dir=str(self.archive))
            want = f"graphpersist: mode=save dir={self.archive} (from keyword graph_persist, keyword graph_persist_dir)"
            assert lines == [want], lines
            if args is None:
                args, lines2, _ = self.build(
                    model_path="dummy", graph_persist="save", graph_persist_dir=str(self.archive)
                )
                assert lines2 == [want], lines2
            assert (args.graph_persist, args.graph_persist_dir) == ("save", str(self.archive))
            from sglang.srt.graphpersist_switch import resolve_server_args

            described = resolve_server_args(args).describe()
        assert described == want, described
        return f"logged `{want}`{self.later_stop(module)}", f"describe(): {described}"

    def check_env_applies(self) -> tuple[str, str]:
        with env(GRAPHPERSIST_MODE="load", GRAPHPERSIST_DIR=str(self.archive)):
            _, lines, module = self.build()
        want = f"graphpersist: mode=load dir={self.archive} (from GRAPHPERSIST_MODE, GRAPHPERSIST_DIR)"
        assert lines == [want], lines
        return f"no kwarg, env set -> logged `{want}`{self.later_stop(module)}", ""

    def check_kwarg_beats_env(self) -> tuple[str, str]:
        with env(GRAPHPERSIST_MODE="load", GRAPHPERSIST_DIR=str(self.missing)):
            _, lines, module = self.build(graph_persist="save", graph_persist_dir=str(self.archive))
        want = f"graphpersist: mode=save dir={self.archive} (from keyword graph_persist, keyword graph_persist_dir)"
        assert lines == [want], lines
        with env(GRAPHPERSIST_MODE="sav", GRAPHPERSIST_DIR=None):
            _, off_lines, _ = self.build(graph_persist="off")  # the bad env value must not be looked at
        assert off_lines == [], off_lines
        return (
            f"env load/<missing dir> + kwargs save/<dir> -> `{want}`; env 'sav' + kwarg 'off' -> accepted, "
            f"nothing logged{self.later_stop(module)}",
            "",
        )

    def expect_refusal(self, want: str, **kwargs: Any) -> tuple[str, str]:
        from graphpersist.api import SwitchError

        with switch_log() as log:
            try:
                self.ServerArgs(model_path=str(self.model), random_seed=1, **kwargs)
            except SwitchError as err:
                message, refused = str(err), err
            else:
                raise AssertionError("ServerArgs accepted it")
        assert isinstance(refused, ValueError)
        assert "\n" not in message, message
        assert message == want, message
        assert log.lines == [], log.lines
        return f"SwitchError (a ValueError), one line: `{message}`", ""

    def check_bad_mode(self) -> tuple[str, str]:
        with env(**NO_ENV):
            return self.expect_refusal(BAD_MODE_LINE, graph_persist="sav", graph_persist_dir=str(self.archive))

    def check_save_without_dir(self) -> tuple[str, str]:
        want = (
            "graphpersist: persistence mode 'save' (from keyword graph_persist) needs an archive directory; "
            "set --graph-persist-dir, keyword graph_persist_dir or GRAPHPERSIST_DIR"
        )
        with env(**NO_ENV):
            return self.expect_refusal(want, graph_persist="save")

    def check_load_missing_dir(self) -> tuple[str, str]:
        want = (
            f"graphpersist: cannot LOAD {self.missing} (from keyword graph_persist_dir): no such directory; "
            "run once with --graph-persist save to create the archive"
        )
        with env(**NO_ENV):
            return self.expect_refusal(want, graph_persist="load", graph_persist_dir=str(self.missing))

    def check_off_is_upstream(self) -> tuple[str, str]:
        model = str(self.model) if self.full_build_blocker is None else "dummy"
        with env(**NO_ENV):
            plain, plain_lines, _ = self.build(model_path=model)
            off, off_lines, _ = self.build(model_path=model, graph_persist="off", graph_persist_dir=str(self.archive))
        assert plain is not None and off is not None
        assert plain_lines == [] and off_lines == [], (plain_lines, off_lines)
        assert (plain.graph_persist, plain.graph_persist_dir) == (None, None)
        a, b = dataclasses.asdict(plain), dataclasses.asdict(off)
        for name in OUR_FIELDS:
            a.pop(name), b.pop(name)
        differing = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        assert not differing, f"fields differ: {differing}"
        return (
            f"model_path={model}: asdict() of ServerArgs() and ServerArgs(graph_persist='off', graph_persist_dir=...) "
            f"equal on all {len(a)} other fields; defaults graph_persist=None, graph_persist_dir=None; nothing logged",
            "",
        )

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="sglang serve")
        self.ServerArgs.add_cli_args(parser)
        return parser

    def check_cli_load(self) -> tuple[str, str]:
        ns = self.parser().parse_args(
            ["--model-path", str(self.model), "--graph-persist", "load", "--graph-persist-dir", str(self.archive)]
        )
        assert (ns.graph_persist, ns.graph_persist_dir) == ("load", str(self.archive)), vars(ns)
        want = f"graphpersist: mode=load dir={self.archive} (from --graph-persist, --graph-persist-dir)"
        with env(**NO_ENV), switch_log() as log:
            try:
                args = self.ServerArgs.from_cli_args(ns)
                module = None
            except Exception as err:
                module = missing_kernel(err)
                if module is None:
                    raise
                args = None
        assert log.lines == [want], log.lines
        if args is None:  # complete the same CLI round trip with the dummy model
            ns = self.parser().parse_args(
                ["--model-path", "dummy", "--graph-persist", "load", "--graph-persist-dir", str(self.archive)]
            )
            with env(**NO_ENV), switch_log() as log2:
                args = self.ServerArgs.from_cli_args(ns)
            assert log2.lines == [want], log2.lines
        assert (args.graph_persist, args.graph_persist_dir) == ("load", str(self.archive))
        return f"parse_args + from_cli_args -> `{want}`{self.later_stop(module)}", ""

    def check_cli_help(self) -> tuple[str, str]:
        text = self.parser().format_help()
        lines = [line.strip() for line in text.splitlines() if "--graph-persist" in line]
        assert any(line.startswith("--graph-persist {off,save,load}") for line in lines), lines
        assert any(line.startswith("--graph-persist-dir DIR") for line in lines), lines
        assert "graph persistence:" in text
        return f"--help has {len(lines)} lines naming --graph-persist, e.g. `{lines[0]}`", "\n".join(lines)

    def check_cli_bad_mode(self) -> tuple[str, str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                self.parser().parse_args(["--model-path", str(self.model), "--graph-persist", "sav"])
            except SystemExit as exit_:
                code = exit_.code
            else:
                raise AssertionError("argparse accepted --graph-persist sav")
        last = err.getvalue().strip().splitlines()[-1]
        assert code == 2, code
        want = "invalid persistence mode 'sav' (from --graph-persist); expected one of: off, save, load"
        assert want in last, last
        return f"SystemExit(2): `{last}`", err.getvalue()

    def engine_source(self) -> tuple[Path, ast.FunctionDef]:
        spec = importlib.util.find_spec("sglang.srt.entrypoints.engine")
        assert spec is not None and spec.origin is not None
        path = Path(spec.origin)
        tree = ast.parse(path.read_text())
        [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
        [init] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        return path, init

    def check_engine_order_static(self) -> tuple[str, str]:
        """In the installed engine.py, Engine.__init__ builds ServerArgs(**kwargs) before launching anything."""
        path, init = self.engine_source()
        calls = [n for n in ast.walk(init) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        build = [n.lineno for n in calls if n.func.attr == "server_args_class"]
        launch = [n.lineno for n in calls if n.func.attr == "_launch_subprocesses"]
        assert build and launch, (build, launch)
        assert max(build) < min(launch), (build, launch)
        return (
            f"{path.name}: self.server_args_class(**kwargs) at line {build[0]} "
            f"< _launch_subprocesses at line {launch[0]}",
            "",
        )

    def check_engine_runtime(self) -> tuple[str, str]:
        """sglang.Engine(graph_persist='sav') is refused before any subprocess is launched."""
        try:
            from sglang.srt.entrypoints.engine import Engine
        except Exception as err:
            frames = [f for f in traceback.extract_tb(err.__traceback__) if "/sglang/" in f.filename]
            raise NotRun(
                f"importing sglang.srt.entrypoints.engine failed: {type(err).__name__}: {err}",
                "\n".join(f"{f.filename.split('/sglang/', 1)[1]}:{f.lineno} {f.line}" for f in frames[-8:]),
            ) from None
        from graphpersist.api import SwitchError

        launched: list[str] = []

        def no_launch(*_a: Any, **_k: Any) -> None:
            launched.append("launch")
            raise RuntimeError("the check forbids launching subprocesses")

        original = inspect.getattr_static(Engine, "_launch_subprocesses")
        Engine._launch_subprocesses = staticmethod(no_launch)  # type: ignore[method-assign]
        try:
            with env(**NO_ENV):
                try:
                    Engine(model_path=str(self.model), graph_persist="sav", graph_persist_dir=str(self.archive))
                except SwitchError as err:
                    message = str(err)
                else:
                    raise AssertionError("Engine accepted graph_persist='sav'")
        finally:
            Engine._launch_subprocesses = original  # type: ignore[method-assign]
        assert not launched and message == BAD_MODE_LINE, (launched, message)
        return f"SwitchError before any launch: `{message}`", ""


def versions() -> dict[str, str]:
    """Versions of the packages that matter for this proof, as installed."""
    out = {"python": platform.python_version()}
    for name in ("sglang", "graphpersist", "torch", "transformers", "tokenizers", "xgrammar", "pydantic", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    try:
        import torch

        out["cuda device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        out["torch.version.cuda"] = str(torch.version.cuda)
    except Exception as err:
        out["cuda device"] = f"unknown ({err})"
    return out


def write_report(path: Path, results: list[Result], meta: dict[str, str], import_error: str | None) -> bool:
    """Write the Markdown report; return True when every check passed."""
    failed = [r.name for r in results if r.status == "FAIL"]
    not_run = [r.name for r in results if r.status == "NOT RUN"]
    if import_error:
        failed.insert(0, "import_server_args")
    if not failed and not not_run:
        first = "all checks passed"
    else:
        parts = []
        if failed:
            parts.append("FAILED: " + ", ".join(failed))
        if not_run:
            parts.append("NOT RUN: " + ", ".join(not_run))
        first = "; ".join(parts)
    lines = [first, "", "# SGLang graph-persistence switch on the GPU host", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| check | status | detail |", "|---|---|---|"]
    if import_error:
        lines.append(f"| import_server_args | FAIL | `{import_error.splitlines()[-1]}` |")
    for r in results:
        lines.append(f"| {r.name} | {r.status} | {r.detail.replace('|', '/')} |")
    for r in results:
        if r.evidence:
            lines += ["", f"## {r.name} ({r.status})", "", "```", r.evidence.rstrip(), "```"]
    if import_error:
        lines += ["", "## import_server_args (FAIL)", "", "```", import_error.rstrip(), "```"]
    path.write_text("\n".join(lines) + "\n")
    return first == "all checks passed"


def main(argv: list[str] | None = None) -> int:
    """Run every check, write the report, exit 0 only when all passed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", type=Path, required=True, help="Markdown report to write")
    opts = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
    }
    results: list[Result] = []
    import_error = None
    with tempfile.TemporaryDirectory(prefix="sglang-switch-") as tmp:
        try:
            checker = Checker(Path(tmp))
        except Exception:
            import_error = traceback.format_exc()
            print(import_error, file=sys.stderr, flush=True)
        else:
            meta["ServerArgs module"] = inspect.getfile(checker.ServerArgs)
            for name in (
                "full_build",
                "save_kwargs",
                "env_applies",
                "kwarg_beats_env",
                "bad_mode",
                "save_without_dir",
                "load_missing_dir",
                "off_is_upstream",
                "cli_load",
                "cli_help",
                "cli_bad_mode",
                "engine_order_static",
                "engine_runtime",
            ):
                checker.run(name, getattr(checker, f"check_{name}"))
            results = checker.results
    meta.update(versions())
    ok = write_report(opts.report, results, meta, import_error)
    print(opts.report.read_text().splitlines()[0], flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
