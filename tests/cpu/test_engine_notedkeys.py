"""The keys an engine's equal pieces share, noted at SAVE and handed back at LOAD (graphpersist.engine.notedkeys,
PersistSession.noted_keys): what SAVE notes, what LOAD hands out and counts, and the notes it refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_engine_session import own_run  # noqa: F401  (fixture: each test its own run)
from test_engine_session import session as open_session

from graphpersist import switch
from graphpersist.engine import PersistSession
from graphpersist.engine.notedkeys import NotedKeys
from graphpersist.errors import PersistError

SECTION = "pieces"
FIRST, LAYER = object(), object()
FILED = {"k-first": FIRST, "k-layer": LAYER}  # what the engine filed its objects under


def session(mode: switch.Mode, saved_notes: dict[str, Any] | None = None) -> PersistSession:
    """test_engine_session's session (its Minimal engine answers nothing the keys need), with SAVE's notes."""
    sess = open_session(mode)
    sess.saved_notes = saved_notes or {}
    return sess


def test_save_notes_the_key_each_piece_got_in_the_sessions_notes_found_by_identity() -> None:
    sess = session(switch.Mode.SAVE)
    keys = sess.noted_keys(SECTION)
    keys.ran_upstream("p/0", FIRST, FILED)
    keys.ran_upstream("p/1", LAYER, FILED)
    keys.ran_upstream("p/2", LAYER, FILED)  # an equal piece: the same object, so the same key
    keys.ran_upstream("p/3", object(), FILED)  # filed under no key: nothing to note
    assert sess.notes[SECTION] == {"p/0": "k-first", "p/1": "k-layer", "p/2": "k-layer"}
    assert json.loads(json.dumps(sess.notes)) == sess.notes  # the archive stores them as they are
    assert sess.noted_keys(SECTION) is keys
    assert sess.stats()["noted_keys"] == {SECTION: {"upstream": 4}}


def test_save_hands_nothing_out() -> None:
    keys = session(switch.Mode.SAVE).noted_keys(SECTION)
    assert keys.reuse("p/1", FILED) is None
    assert keys.counts == {}


def test_load_hands_a_piece_the_object_filed_under_its_noted_key_and_counts_it() -> None:
    sess = session(switch.Mode.LOAD, {SECTION: {"p/1": "k-layer", "p/2": "k-layer"}})
    keys = sess.noted_keys(SECTION)
    assert keys.reuse("p/2", FILED) is LAYER
    keys.ran_upstream("p/1", LAYER, FILED)
    assert sess.stats()["noted_keys"] == {SECTION: {"reused": 1, "upstream": 1}}
    assert SECTION not in sess.notes  # LOAD notes nothing


@pytest.mark.parametrize("name", ["p/9", "p/gone"], ids=["no-key-noted", "key-names-nothing-filed"])
def test_load_hands_nothing_where_no_key_was_noted_or_nothing_is_filed_under_it(name: str) -> None:
    keys = session(switch.Mode.LOAD, {SECTION: {"p/gone": "k-other"}}).noted_keys(SECTION)
    assert keys.reuse(name, FILED) is None
    assert keys.counts == {}


def test_an_archive_without_noted_keys_hands_nothing_out_and_is_not_refused() -> None:
    keys = session(switch.Mode.LOAD, {"other": {}}).noted_keys(SECTION)
    assert keys.saved == {}
    assert keys.reuse("p/1", FILED) is None


def test_a_session_that_hands_out_no_keys_has_no_stats_entry() -> None:
    assert "noted_keys" not in session(switch.Mode.LOAD).stats()


@pytest.mark.parametrize(
    ("saved", "lines"),
    [
        (["k-layer"], ["graphpersist: cannot LOAD: notes.pieces: saved ['k-layer'], expected an object of keys by "
                       "piece name"]),
        ({"p/1": "k-layer", "p/2": 7, "p/3": {"fn": "os:system"}}, [
            "graphpersist: cannot LOAD: notes.pieces['p/2']: saved 7, expected a string (the key SAVE noted for "
            "that piece)",
            "graphpersist: cannot LOAD: notes.pieces['p/3']: saved {'fn': 'os:system'}, expected a string (the key "
            "SAVE noted for that piece)",
        ]),
        ({"p/\x1b[2J": None}, ["graphpersist: cannot LOAD: notes.pieces['p/\\x1b[2J']: saved None, expected a "
                               "string (the key SAVE noted for that piece)"]),
    ],
    ids=["not-an-object", "values-not-strings", "escaped"],
)  # fmt: skip
def test_a_damaged_entry_refuses_the_load_naming_each_one_with_its_saved_value_then_the_advice(
    saved: Any, lines: list[str]
) -> None:
    with pytest.raises(PersistError) as err:
        session(switch.Mode.LOAD, {SECTION: saved}).noted_keys(SECTION)
    assert str(err.value).splitlines() == [*lines, "Re-run with mode=save for this configuration."]


def test_noted_keys_are_one_per_section() -> None:
    sess = session(switch.Mode.SAVE)
    assert sess.noted_keys("a") is not sess.noted_keys("b")
    assert isinstance(sess.noted_keys("a"), NotedKeys)
