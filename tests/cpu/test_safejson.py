"""safejson: any input gives a value or a JsonError naming the problem; strict mode bounds what records may hold."""

from __future__ import annotations

import json

import pytest

from graphpersist.archive.safejson import INT_MAX, INT_MIN, MAX_DEPTH, JsonError, loads


def test_plain_json_reads_the_same_as_the_json_module():
    text = json.dumps({"a": [1, -2, 3.5, None, True, "é😀"], "b": {"c": INT_MAX, "d": INT_MIN}}, ensure_ascii=False)
    assert loads(text.encode()) == json.loads(text)
    assert loads(text, strict=False) == json.loads(text)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b"[Infinity]", "Infinity is not a JSON number"),
        (b"[-Infinity]", "-Infinity is not a JSON number"),
        (b"[1e999]", "number 1e999 is out of range"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a": 1', "Expecting ',' delimiter at line 1 column 8"),
        (b"", "Expecting value at line 1 column 1"),
        (b'{"a": "\xff"}', "not UTF-8 text: byte 0xff at offset 7"),
        ('{"a": 1}'.encode("utf-16"), "not UTF-8 text: byte 0xff at offset 0"),
        (b'\xef\xbb\xbf{"a": 1}', "Unexpected UTF-8 BOM"),
    ],
)
def test_refused_in_both_modes(data: bytes, problem: str, strict: bool):
    with pytest.raises(JsonError) as info:
        loads(data, strict=strict)
    assert problem in str(info.value)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[" + "9" * 5000 + "]", "integer 99999"),
        (f"[{INT_MAX + 1}]", f"integer {INT_MAX + 1} (20 characters) does not fit in 64 bits"),
        (f"[{INT_MIN - 1}]", "does not fit in 64 bits"),
        ('{"a": 1, "a": 2}', "duplicate key 'a' in one object"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH} levels"),
        ('{"a": "\\ud800"}', "holds a lone UTF-16 surrogate (\\ud800), not text"),
        ('{"\\udfff": 1}', "holds a lone UTF-16 surrogate (\\udfff), not text"),
    ],
)
def test_refused_in_strict_mode(text: str, problem: str):
    with pytest.raises(JsonError) as info:
        loads(text)
    assert problem in str(info.value)


def test_payload_mode_keeps_the_json_modules_leniency_where_it_is_harmless():
    """Payloads skip the per-object checks (speed); the interpreter's own limits still end in JsonError."""
    assert loads('{"a": 1, "a": 2}', strict=False) == {"a": 2}
    assert loads(f"[{INT_MAX + 1}]", strict=False) == [INT_MAX + 1]
    assert loads("[" * 40 + "]" * 40, strict=False) == json.loads("[" * 40 + "]" * 40)
    with pytest.raises(JsonError, match="Exceeds the limit"):
        loads("[" + "9" * 5000 + "]", strict=False)


def test_depth_limit_is_inclusive():
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert loads('{"a": ' * (MAX_DEPTH - 1) + "[1]" + "}" * (MAX_DEPTH - 1))


def test_a_surrogate_pair_is_one_character():
    assert loads('["\\ud83d\\ude00"]') == ["😀"]
