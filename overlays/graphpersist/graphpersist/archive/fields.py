"""One value of an archive file, checked where it is read: a refusal names the file, the field and what is wrong.

LOAD's CPU stage (graphpersist.loadplan) and the saved layout's reader (graphpersist.memory.savedlayout) read values
out of the archive's JSON files that native code and the region's cursor then use as sizes, counts and addresses;
each value is checked for its type and range once, here, and a problem is a `Refusal` that the reader turns into one
ArchiveError naming the file and the field.
"""

from __future__ import annotations

from typing import Any

from graphpersist.archive.shown import shown

U64 = (1 << 64) - 1
I64 = (1 << 63) - 1


class Refusal(Exception):
    """One problem found while reading: (file, field, what), and advice when its kind's default does not fit."""

    def __init__(self, rel: str, where: str, what: str, advice: str | None = None) -> None:
        super().__init__(f"{rel}: {where}: {what}" if where else f"{rel}: {what}")
        self.advice = advice


def uint_at(value: Any, rel: str, where: str, low: int = 0) -> int:
    """`value` when it is an integer from `low` to 2**64-1, else a Refusal naming file and field."""
    if type(value) is not int or not low <= value <= U64:
        raise Refusal(rel, where, f"must be an integer from {low} to 2**64-1, got {kind(value)}")
    return value


def kind(value: Any) -> str:
    """A value as a refusal shows it: short, escaped, never its whole repr."""
    if isinstance(value, bool) or value is None or (type(value) is int and abs(value) <= U64):
        return repr(value)
    if isinstance(value, str):
        return shown(repr(value), 60)
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} fields"
    return f"a {type(value).__name__}"


def list_at(value: Any, rel: str, where: str) -> list[Any]:
    """`value` when it is a JSON list, else a Refusal naming file and field."""
    if type(value) is not list:
        raise Refusal(rel, where, f"must be a list, got {kind(value)}")
    return value
