"""Graphs by name, in capture order: duplicate names refused, unknown names answered with the closest ones.

Engines name graphs by batch descriptor and piece (`PIECEWISE/bs8/piece3`); with thousands of names a typo or a
capture-order change must fail loudly, never silently overwrite or return None. Needs neither torch nor CUDA.
"""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

V = TypeVar("V")


class GraphNotFound(KeyError):
    """No graph of that name; the message lists the closest names."""

    def __str__(self) -> str:  # KeyError's str() would print the message as a quoted repr
        return str(self.args[0])


class DuplicateGraph(ValueError):
    """A graph name registered twice."""


class GraphSet(dict[str, V]):
    """A dict of graphs in insertion (capture) order whose `add` refuses duplicates and whose lookups explain misses."""

    def add(self, name: str, item: V) -> None:
        if name in self:
            raise DuplicateGraph(
                f"graph {name!r} is already registered ({len(self)} graphs so far): each captured graph needs its own "
                "name (include the batch size and piece index)"
            )
        self[name] = item

    def __missing__(self, name: str) -> Any:
        raise GraphNotFound(missing_message(name, list(self)))


def missing_message(name: Any, names: list[str]) -> str:
    """'no graph X' plus the closest known names (or how many there are)."""
    close = difflib.get_close_matches(str(name), names, n=5, cutoff=0.6)
    if close:
        hint = "closest: " + ", ".join(repr(n) for n in close)
    elif names:
        hint = f"known: {', '.join(repr(n) for n in names[:5])}" + (
            f" and {len(names) - 5} more" if len(names) > 5 else ""
        )
    else:
        hint = "there are none"
    return f"no graph {name!r} among {len(names)} loaded graphs ({hint})"
