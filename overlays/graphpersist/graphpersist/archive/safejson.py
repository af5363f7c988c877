"""Total JSON reading for archive files: any bytes give a value or a JsonError that names the problem.

Why not plain json.loads: on hostile or rotten input it raises RecursionError (deep nesting) and ValueError
(integers over 4300 digits), accepts NaN and Infinity (and turns 1e999 into inf), lets a duplicate key silently
replace the first, guesses UTF-16/32 from bytes, and returns lone UTF-16 surrogates that cannot be printed. Any of
those would escape the archive reader as a bare traceback, or reach code that recurses or formats the value.

Two strengths, one function:

* strict (the manifest and rank records, small and read field by field): UTF-8 only, no duplicate keys, integers
  within 64 bits (-2**63 .. 2**64-1), finite numbers only, at most MAX_DEPTH levels of nesting, strings that are
  valid Unicode. Whatever passes can be walked, rendered and re-serialised by recursive code without a limit.
* not strict (payload files, possibly megabytes, read by code that knows their shape): UTF-8 only, finite numbers
  only, and every parser failure (including too-deep nesting and too-long integers) becomes a JsonError; the
  per-object checks above are skipped because they would make LOAD several times slower to parse.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 32
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
_INT_TEXT_MAX = len(str(INT_MIN))  # longer digit strings are out of range: refuse before converting them


class JsonError(ValueError):
    """Text that is not the JSON an archive file may hold. The message says what is wrong (and where, if known)."""


def loads(data: bytes | bytearray | memoryview | str, *, strict: bool = True) -> Any:
    """Parses `data` (UTF-8 bytes, or text); raises JsonError, and nothing else, on anything it refuses."""
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonError(f"not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset {exc.start}") from None
        raw_surrogates = False  # the UTF-8 decoder refuses encoded surrogates
    elif isinstance(data, str):
        text = data
        raw_surrogates = not _encodes(text)
    else:
        raise JsonError(f"expected bytes or text, got {type(data).__name__}")
    hooks: dict[str, Any] = {"parse_constant": _refuse_constant, "parse_float": _finite_float}
    if strict:
        hooks |= {"parse_int": _bounded_int, "object_pairs_hook": _unique_keys}
    try:
        value = json.loads(text, **hooks)
    except JsonError:
        raise
    except json.JSONDecodeError as exc:
        raise JsonError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise JsonError("nested too deeply") from None
    except ValueError as exc:  # e.g. an integer longer than the interpreter converts (sys.get_int_max_str_digits)
        raise JsonError(_clip(str(exc), 120)) from None
    if strict:
        if raw_surrogates or _SURROGATE_ESCAPE.search(text):
            _check_tree(value)
        else:  # no string can hold a lone surrogate: only the depth is left to check
            _check_depth(value)
    return value


# A lone surrogate in a parsed string comes from a \ud800-\udfff escape (or from text that already held one).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_depth(value: Any) -> None:
    """Nesting depth only, one level of containers at a time (the scalars of a record are most of its values)."""
    level = [value] if type(value) in (dict, list) else []
    depth = 1
    while level:
        if depth > MAX_DEPTH:
            raise JsonError(f"nested deeper than {MAX_DEPTH} levels")
        nxt: list[Any] = []
        for item in level:
            values = item.values() if type(item) is dict else item
            nxt += [v for v in values if type(v) in (dict, list)]
        level = nxt
        depth += 1


def _refuse_constant(name: str) -> Any:
    raise JsonError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"number {_clip(text)} is out of range")
    return value


def _bounded_int(text: str) -> int:
    value = int(text) if len(text) <= _INT_TEXT_MAX else None
    if value is None or not INT_MIN <= value <= INT_MAX:
        raise JsonError(f"integer {_clip(text)} ({len(text)} characters) does not fit in 64 bits")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonError(f"duplicate key {_clip(repr(key))} in one object")
            seen.add(key)
    return out


def _check_tree(value: Any) -> None:
    """Nesting depth and valid Unicode, without recursion (the tree may be as deep as the parser allowed)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise JsonError(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            for key in item:
                _check_text(key)
            stack.extend((v, depth + 1) for v in item.values())
        else:
            stack.extend((v, depth + 1) for v in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = f"\\u{ord(text[exc.start]):04x}"
        raise JsonError(f"string {_clip(repr(text))} holds a lone UTF-16 surrogate ({surrogate}), not text") from None


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"
