"""A refusal raised in an engine process comes back in the process that launched the engine
(graphpersist.engine.refusal): recorded by the session's steps and the glue's seams, raised again where upstream
turns the child's failure into its own error. Engine processes are real forked children here; the engines' own
seams are tested against their pinned sources in test_engine_vllm_persist_cpu.py and
test_engine_sglang_persist_cpu.py."""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from graphpersist import switch
from graphpersist.archive.validate import MISSING, LoadRefused, Mismatch
from graphpersist.engine import PersistSession, Refused, RefusedInEngine, refusal, resolve_switch
from graphpersist.errors import PersistError

MISMATCHES = [Mismatch("flags.max_model_len", 4096, 2048), Mismatch("env.NCCL_ALGO", None, "Ring"),
              Mismatch("flags.seed", MISSING, 0)]  # fmt: skip


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process as the one that launches an engine with persistence on: the switch's environment and the
    start's refusal file named (in a folder of the test's own)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(refusal.tempfile, "tempdir", None)  # tempfile caches its folder
    monkeypatch.setattr(refusal, "_named", None)
    monkeypatch.delenv(refusal.ENV, raising=False)
    monkeypatch.setenv(switch.MODE_ENV, "load")
    refusal.export(os.environ)
    yield Path(os.environ[refusal.ENV])


def in_engine_process(body: Callable[[], None]) -> int:
    """Runs `body` in a forked child, as an engine process runs a seam: its refusals are recorded. Its exit code."""

    def seam() -> None:
        with refusal.recording():
            body()

    child = multiprocessing.get_context("fork").Process(target=seam)
    child.start()
    child.join()
    return child.exitcode or 0


def refuse_load() -> None:
    raise LoadRefused("/archives/a", MISMATCHES, rank=1)


def test_a_refused_load_comes_back_as_load_refused_with_every_mismatch(launcher: Path) -> None:
    assert in_engine_process(refuse_load) == 1
    upstream = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    raised = refusal.refusal_or(upstream)
    assert type(raised) is LoadRefused and raised.__cause__ is upstream
    assert str(raised) == str(LoadRefused("/archives/a", MISMATCHES, rank=1))  # the engine's lines, word for word
    assert "  flags.max_model_len: saved 4096, live 2048" in str(raised).splitlines()
    assert str(raised).splitlines()[-1] == "Re-run with mode=save for this configuration."
    assert (raised.archive_dir, raised.rank, raised.mismatches) == (Path("/archives/a"), 1, MISMATCHES)
    assert refusal.refusal_or(upstream) is upstream  # consumed: a later start of this process starts clean
    assert not launcher.exists()


def test_any_other_refusal_comes_back_with_its_message_and_type(launcher: Path) -> None:
    def refuse() -> None:
        raise Refused("graphpersist: this configuration captures no decode CUDA graphs: turn persistence off")

    in_engine_process(refuse)
    raised = refusal.refusal_or(RuntimeError("upstream"))
    assert isinstance(raised, RefusedInEngine) and isinstance(raised, PersistError)
    assert str(raised) == "graphpersist: this configuration captures no decode CUDA graphs: turn persistence off"
    assert raised.kind == "graphpersist.engine.Refused"


def test_without_a_recorded_refusal_upstreams_error_stands(launcher: Path) -> None:
    def engine_bug() -> None:
        raise ValueError("an engine's own error, not a refusal")

    assert in_engine_process(engine_bug) == 1
    upstream = RuntimeError("upstream")
    assert refusal.refusal_or(upstream) is upstream and not refusal.recorded()
    assert list(launcher.parent.iterdir()) == []


def test_the_first_refusal_of_a_start_wins(launcher: Path) -> None:
    def refuse_phase() -> None:
        raise PersistError("graphpersist: rank 0's phase kv_cache moved")

    in_engine_process(refuse_load)
    in_engine_process(refuse_phase)  # another rank, later: its refusal follows from the first
    assert refusal.recorded()
    assert type(refusal.refusal_or(RuntimeError("upstream"))) is LoadRefused


def test_an_engine_process_keeps_the_file_it_inherited_and_never_reads_it(launcher: Path) -> None:
    """A forked child (vLLM's engine core under `graphpersist exec`) resolves the switch again: the launcher's file
    stays, and only the launcher reads it."""
    in_engine_process(refuse_load)

    def child_resolves_again() -> None:
        refusal.export(os.environ)
        assert os.environ[refusal.ENV] == str(launcher)
        assert refusal.refusal_or(RuntimeError("x")).args == ("x",) and not refusal.recorded()

    assert in_engine_process(child_resolves_again) == 0
    assert launcher.exists() and refusal.recorded()


def test_persistence_off_names_reads_and_writes_no_refusal_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(refusal.tempfile, "tempdir", None)
    monkeypatch.setattr(refusal, "_named", None)
    for name in (refusal.ENV, switch.MODE_ENV, switch.DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    resolve_switch("off", None, logging.getLogger("test"))
    assert refusal.ENV not in os.environ
    in_engine_process(refuse_load)
    upstream = RuntimeError("upstream")
    assert refusal.refusal_or(upstream) is upstream and not refusal.recorded()
    assert list(tmp_path.iterdir()) == []


def test_a_start_with_persistence_off_after_one_with_it_on_reads_nothing(launcher: Path) -> None:
    in_engine_process(refuse_load)
    os.environ[switch.MODE_ENV] = "off"  # what the switch exports when a later start turns it off
    upstream = RuntimeError("upstream")
    assert refusal.refusal_or(upstream) is upstream and not refusal.recorded()
    assert launcher.exists()  # not read, not consumed


def test_a_refusal_the_sessions_first_step_raises_is_recorded(launcher: Path, tmp_path: Path) -> None:
    """`PersistSession.begin` records what it raises: here the engine's refusal of its configuration."""

    def refuse() -> None:
        raise Refused("graphpersist: LoRA cannot be persisted: serve without it")

    def begin() -> None:
        os.environ[switch.DIR_ENV] = str(tmp_path)
        PersistSession.begin(SimpleNamespace(refuse=refuse))  # type: ignore[arg-type]  (asks nothing else first)

    in_engine_process(begin)
    raised = refusal.refusal_or(RuntimeError("upstream"))
    assert isinstance(raised, RefusedInEngine)
    assert str(raised) == "graphpersist: LoRA cannot be persisted: serve without it"
