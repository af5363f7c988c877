"""The persistence session's own steps (graphpersist.engine.session), written once for every engine: the memory budget,
the lifecycle's order, the end of a start. Engine-free: a minimal adapter, and torch stood in where the session asks
the GPU (its free memory)."""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from graphpersist import gcpause, run, switch
from graphpersist.engine import EngineAdapter, Inventory, PersistSession, budget
from graphpersist.engine import session as session_module
from graphpersist.errors import PersistError

GIB, MIB = 1 << 30, 1 << 20


class Minimal(EngineAdapter):
    """An engine that answers what the steps under test ask; `gathered` stands in for the CPU group."""

    name = "minimal"
    budget_what = "cache"
    budget_advice = "give it more memory"

    def __init__(self, others: list[int] | None = None) -> None:
        self.others = others or []
        self.gathered: list[int] = []

    def cpu_gather(self) -> Any:
        return lambda mine: self.gathered.append(mine) or [mine, *self.others]

    def flags(self, session: Any) -> dict[str, Any]:
        return {"sizes": [1, 2]}

    def _unasked(self, *args: Any) -> Any:
        raise AssertionError("the session asked more than the steps under test need")

    engine_facts = model_facts = parallel = config_flags = rank = device_index = setup_tensors = _unasked
    inventory = install = _unasked


@pytest.fixture(autouse=True)
def own_run() -> Iterator[None]:
    with run.activated(run.Run()):
        yield


def session(mode: switch.Mode, adapter: EngineAdapter | None = None, world_size: int = 1) -> PersistSession:
    sess = PersistSession(adapter or Minimal(), mode, Path("/archive"), 0, world_size)
    sess.activate()
    return sess


@pytest.fixture
def free_memory(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch.cuda.mem_get_info as the test sets it: [free, total]."""
    memory = [40 * GIB, 140 * GIB]
    torch = ModuleType("torch")
    torch.cuda = SimpleNamespace(mem_get_info=lambda: tuple(memory))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    return memory


# ------------------------------------------------------------------------------------------------ the memory budget


@pytest.mark.parametrize(
    "profiled, expected",
    [
        ([5 * GIB + 300 * MIB], 5 * GIB),
        ([5 * GIB + 700 * MIB, 5 * GIB + 660 * MIB], 5 * GIB),  # a cold and a warm profile, 40 MiB apart
        ([30 * GIB + 20 * MIB, 29 * GIB + 1000 * MIB], 29 * GIB),  # the smallest rank decides, then rounding
        ([7 * GIB, 9 * GIB], 7 * GIB),
        ([GIB], GIB),
    ],
)
def test_the_budget_is_the_smallest_profile_rounded_down_to_a_gib(profiled: list[int], expected: int) -> None:
    assert budget.rounded(profiled, "KV cache", "advice") == expected


@pytest.mark.parametrize(
    "profiled, shown", [([GIB - 1], "1023 MiB"), ([300 * MIB, 40 * GIB], "300 MiB"), ([0], "0 MiB")]
)
def test_a_budget_below_a_gib_is_refused_naming_what_it_sizes_and_the_advice(profiled: list[int], shown: str) -> None:
    with pytest.raises(PersistError) as refused:
        budget.rounded(profiled, "memory pool", "raise --mem-fraction-static")
    assert str(refused.value) == (
        f"graphpersist: the memory profile leaves {shown} for the memory pool, less than the 1 GiB SAVE needs: "
        "raise --mem-fraction-static"
    )


def test_save_profiles_agrees_over_the_ranks_and_records_the_budget_in_its_flags() -> None:
    one = session(switch.Mode.SAVE)
    assert one.memory_budget(lambda: 9 * GIB + 5) == 9 * GIB and one.adapter.gathered == []  # type: ignore[attr-defined]
    adapter = Minimal(others=[8 * GIB + 7 * MIB])
    two = session(switch.Mode.SAVE, adapter, world_size=2)
    assert two.memory_budget(lambda: 9 * GIB + 5) == 8 * GIB
    assert adapter.gathered == [9 * GIB + 5]
    assert two.flags() == {"sizes": [1, 2], budget.FLAG: 8 * GIB}


def test_load_reuses_the_saved_budget_without_profiling_and_checks_free_memory(free_memory: list[int]) -> None:
    sess = session(switch.Mode.LOAD)
    sess.saved_budget = 30 * GIB

    def profile() -> int:
        raise AssertionError("LOAD never profiles")

    assert sess.memory_budget(profile) == 30 * GIB and sess.flags()[budget.FLAG] == 30 * GIB
    free_memory[0] = 12 * GIB
    again = session(switch.Mode.LOAD)
    again.saved_budget = 30 * GIB
    with pytest.raises(PersistError) as refused:
        again.memory_budget(None)
    assert str(refused.value) == (
        "graphpersist: the archive's cache needs 30.00 GiB but only 12.00 GiB of 140.00 GiB are free on this GPU: "
        "free the GPU (other processes?) or re-run with mode=save on this host"
    )


@pytest.mark.parametrize("flags, shown", [({}, "None"), ({budget.FLAG: 0}, "0"), ({budget.FLAG: "8"}, "'8'")])
def test_an_archive_without_a_budget_is_refused(flags: dict[str, Any], shown: str) -> None:
    with pytest.raises(PersistError) as refused:
        budget.saved(flags, "/archive")
    assert str(refused.value) == (
        f"graphpersist: /archive records no memory budget (flags.{budget.FLAG} = {shown}). Re-run with mode=save."
    )


# ------------------------------------------------------------------------------------------- the lifecycle's order


def test_a_step_that_comes_back_to_an_earlier_one_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    sess = session(switch.Mode.SAVE)
    sess.memory_budget(lambda: 2 * GIB)
    monkeypatch.setattr(sess.caches, "report_late", lambda s: None)
    sess.written = True
    sess.ready()
    with pytest.raises(PersistError, match=r"minimal reached the step 'budget' after 'ready': .*out of order"):
        sess.memory_budget(lambda: 2 * GIB)


def test_finish_writes_the_stats_once_and_ends_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPERSIST_STATS_DIR", str(tmp_path))
    sess = session(switch.Mode.LOAD)
    sess.finish()
    first = json.loads((tmp_path / "rank_0.json").read_text())
    sess.restored = 99
    sess.finish()  # the end of a start happens once (an error path may reach it again)
    assert json.loads((tmp_path / "rank_0.json").read_text()) == first
    assert sess.finished and first["mode"] == "load" and first["restored"] == 0
    assert "kernel_choices" not in first  # an engine that pins no Inductor choices counts none


def test_the_collector_comes_back_at_the_budget_or_when_a_start_ends_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_start() pauses the collector's automatic passes until memory_budget(), whose profile runs with them again; a
    start that fails before it (a LOAD refused at begin, an engine error) must not leave the process without them:
    finish() ends the window."""
    monkeypatch.setenv("GRAPHPERSIST_STATS_DIR", str(tmp_path))
    assert gc.isenabled()
    sess = session(switch.Mode.LOAD)
    sess.setup_gc.enter_context(gcpause.paused_gc())  # what _start() does (it needs a GPU)
    assert not gc.isenabled()
    try:
        sess.finish()
        assert gc.isenabled()
        saving = session(switch.Mode.SAVE)
        saving.setup_gc.enter_context(gcpause.paused_gc())
        on_in_profile: list[bool] = []
        assert saving.memory_budget(lambda: on_in_profile.append(gc.isenabled()) or 4 << 30) == 4 << 30
        assert on_in_profile == [True] and gc.isenabled()  # the window ends where the budget begins
    finally:
        gc.enable()


def test_a_load_refused_in_its_start_turns_the_collector_back_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine run in the user's process (vLLM's in-process core) lives on after a refused LOAD: begin() must not
    leave it without the collector's passes when _start() refuses inside the setup window."""

    class Starting(Minimal):
        def rank(self) -> int:
            return 0

        def parallel(self) -> dict[str, int]:
            return {"world_size": 1}

        def model_facts(self) -> dict[str, str]:
            return {}

    def refusing_start(sess: PersistSession) -> None:
        sess.setup_gc.enter_context(gcpause.paused_gc())  # as _start() does, before its early check refuses
        raise PersistError("graphpersist: cannot LOAD: flags.max_model_len: saved 4096, live 2048")

    monkeypatch.setenv("GRAPHPERSIST_MODE", "load")
    monkeypatch.setenv("GRAPHPERSIST_DIR", str(tmp_path))
    monkeypatch.setattr(session_module, "interposer_loaded", lambda: True)
    monkeypatch.setattr(PersistSession, "_start", refusing_start)
    monkeypatch.setattr(session_module.rankstats, "count_captures", lambda on_capture: None)  # needs torch
    try:
        with pytest.raises(PersistError, match="max_model_len"):
            PersistSession.begin(Starting())
        assert gc.isenabled()
    finally:
        gc.enable()


def test_the_graphs_differ_refusal_names_both_sides_and_the_advice() -> None:
    from graphpersist.engine import graphs_differ

    message = str(graphs_differ("decode", {"decode/1", "decode/8"}, {"decode/1", "decode/4"}))
    assert message == (
        "graphpersist: decode graphs differ: not in the archive ['decode/4'], saved but not replayed by this "
        "configuration ['decode/8']. Re-run with mode=save for this configuration."
    )
    assert Inventory([1], ["decode"]).by_mode == {}


def test_a_capture_sites_hook_runs_with_the_session_only_while_it_saves() -> None:
    """Persistence off, LOAD and a SAVE whose archive is written leave the site to upstream: the hook is not called."""
    from graphpersist.engine import while_saving

    calls: list[tuple[Any, ...]] = []

    @while_saving
    def captured(sess: PersistSession, graph: str, *, size: int) -> None:
        calls.append((sess, graph, size))

    assert captured("off", size=1) is None and calls == []  # no session: persistence off
    session(switch.Mode.LOAD)
    captured("load", size=2)
    assert calls == []
    saving = session(switch.Mode.SAVE)
    captured("save", size=3)
    saving.written = True
    captured("written", size=4)
    assert calls == [(saving, "save", 3)]


def test_a_graph_save_cannot_keep_is_refused_in_the_glues_words() -> None:
    """What the saver refuses (a duplicate name, an output it cannot store: graphpersist.save.Saver.add) reaches the
    engine's log as its other refusals do, after `graphpersist:`; the graph is not counted."""

    def add(name: str, *args: Any, **kwargs: Any) -> None:
        raise PersistError(f"graph {name!r} is already registered: SAVE refused")  # as Saver.add words it

    sess = session(switch.Mode.SAVE)
    sess.saver = SimpleNamespace(add=add)
    with pytest.raises(PersistError) as refused:
        sess.add_graph("decode/8", SimpleNamespace(instantiate=lambda: None), [], None, size=8, mode="decode")
    assert str(refused.value) == "graphpersist: graph 'decode/8' is already registered: SAVE refused"
    assert sess.captured == 0


# --------------------------------------------------------------------------------------- SAVE's kernel warm-up


@pytest.mark.parametrize("rank", [0, 1])
def test_the_kernel_warmup_is_timed_and_rank_0_names_the_cache_files_it_added(
    rank: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch = ModuleType("torch")
    torch.cuda = SimpleNamespace(synchronize=lambda: None)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    sess = session(switch.Mode.SAVE)
    sess.rank, sess.caches.folders = rank, {"triton": tmp_path}
    (tmp_path / "old.cubin").write_bytes(b"x")

    def first_requests() -> tuple[dict[str, Any], str]:
        (tmp_path / "new.cubin").write_bytes(b"y")
        return {"batches": 2}, "2 batches"

    with caplog.at_level("INFO", logger="graphpersist"):
        sess.kernel_warmup(first_requests)
    files = ["triton/new.cubin"] if rank == 0 else []
    assert sess.stats_extra["kernel_warmup"] == {"batches": 2, "new_cache_files": len(files) if rank == 0 else None,
                                                 "files": files}  # fmt: skip
    assert list(sess.timings) == ["kernel_warmup_before_save"]
    assert "kernel warm-up before save: 2 batches in " in caplog.text
    assert ("1 new JIT cache file(s), e.g. triton/new.cubin" in caplog.text) == (rank == 0)


def test_an_engines_laps_time_its_setup_between_the_steps_each_from_the_previous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sess = session(switch.Mode.SAVE)
    sess._lapped = 100.0  # begin ended here
    ticks = iter([103.5, 110.0])
    monkeypatch.setattr("graphpersist.engine.session.time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    sess.lap("setup")
    sess.lap("kv_cache")
    assert sess.timings == {"setup": 3.5, "kv_cache": 6.5}
