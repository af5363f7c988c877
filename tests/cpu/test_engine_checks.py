"""The checks an engine's glue makes through the runtime (graphpersist.engine.checks): an opt-in environment variable,
the facts SAVE noted of an object compared with the live object's at LOAD (and `NotedFacts`, the communicator that
notes and compares them); and the form of a start-up refusal (graphpersist.engine.refuser)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from graphpersist import engine
from graphpersist.errors import PersistError

NAME = "GRAPHPERSIST_TEST_OPT_IN"
WHAT = "keep the test's thing on"


@pytest.mark.parametrize(("environ", "expected"), [({}, False), ({NAME: ""}, False), ({NAME: "0"}, False),
                                                   ({NAME: "1"}, True)])  # fmt: skip
def test_an_opt_in_is_1_and_off_is_unset_or_0(environ: dict[str, str], expected: bool) -> None:
    assert engine.opted_in(NAME, WHAT, environ) is expected


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1", "off"])
def test_any_other_value_of_an_opt_in_is_refused_naming_the_values_and_what_1_does(value: str) -> None:
    with pytest.raises(ValueError) as err:
        engine.opted_in(NAME, WHAT, {NAME: value})
    assert str(err.value) == (f"graphpersist: {NAME}={value!r} is not 1 or 0. Set {NAME}=1 to keep the test's thing "
                              "on, or unset it for upstream behaviour.")  # fmt: skip


def test_an_opt_in_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "1")
    assert engine.opted_in(NAME, WHAT)
    monkeypatch.delenv(NAME)
    assert not engine.opted_in(NAME, WHAT)


def test_noted_facts_that_differ_are_named_one_line_each_with_saved_and_live_then_the_advice() -> None:
    saved = {"size": 1024, "address": "0x7f00", "version": "1.2", "gone": True}
    live = {"size": 512, "address": "0x7f00", "version": "1.3", "new": 0}
    with pytest.raises(PersistError) as err:
        engine.check_noted("buf", "test buffer", saved, live)
    assert str(err.value).splitlines() == [
        "graphpersist: cannot LOAD: buf.gone: saved True, live None",
        "graphpersist: cannot LOAD: buf.new: saved None, live 0",
        "graphpersist: cannot LOAD: buf.size: saved 1024, live 512",
        "graphpersist: cannot LOAD: buf.version: saved '1.2', live '1.3'",
        "Re-run with mode=save for this configuration.",
    ]


def test_equal_noted_facts_pass() -> None:
    engine.check_noted("buf", "test buffer", {"size": 1, "at": "0x1"}, {"at": "0x1", "size": 1})


@pytest.mark.parametrize("saved", [None, [], "buf"])
def test_an_archive_that_noted_nothing_is_refused_naming_what_it_lacks(saved: object) -> None:
    with pytest.raises(PersistError) as err:
        engine.check_noted("buf", "test buffer", saved, {"size": 1})
    assert str(err.value) == (f"graphpersist: cannot LOAD: the archive records no test buffer (notes.buf = {saved!r}), "
                              "this start has one. Re-run with mode=save for this configuration.")  # fmt: skip


def test_a_start_up_refusal_names_what_cannot_be_persisted_what_instead_and_what_is_supported() -> None:
    refused = engine.refuser("supported: dense models")("LoRA", "serve without it")
    assert isinstance(refused, engine.Refused) and isinstance(refused, PersistError)
    assert str(refused) == "graphpersist: LoRA cannot be persisted: serve without it. (supported: dense models)"


def noted_buffer(facts: dict[str, Any], refused: list[dict[str, Any]]) -> engine.NotedFacts:
    return engine.NotedFacts("buffer", "test buffer", lambda: facts, refused.append)


def test_save_notes_an_objects_facts_once_refuse_had_its_say() -> None:
    refused: list[dict[str, Any]] = []
    session = SimpleNamespace(loading=False, notes={})
    noted_buffer({"size": 8}, refused).after_capture(session)  # type: ignore[arg-type]
    assert session.notes == {"buffer": {"size": 8}} and refused == [{"size": 8}]

    def no(facts: Any) -> None:
        raise engine.Refused("graphpersist: cannot SAVE this test buffer")

    with pytest.raises(engine.Refused, match="cannot SAVE this test buffer"):
        engine.NotedFacts("buffer", "test buffer", lambda: {"size": 8}, no).after_capture(session)  # type: ignore[arg-type]


def test_load_compares_an_objects_facts_with_what_save_noted_and_refuses_none_noted() -> None:
    refused: list[dict[str, Any]] = []
    session = SimpleNamespace(loading=True)
    noted_buffer({"size": 8}, refused).restore(session, {"buffer": {"size": 8}})  # type: ignore[arg-type]
    with pytest.raises(PersistError, match=r"buffer.size: saved 4, live 8"):
        noted_buffer({"size": 8}, refused).restore(session, {"buffer": {"size": 4}})  # type: ignore[arg-type]
    with pytest.raises(PersistError, match=r"records no test buffer \(notes.buffer = None\)"):
        noted_buffer({"size": 8}, refused).check(session, None)  # type: ignore[arg-type]
    assert refused == []  # LOAD never asks what SAVE would refuse
