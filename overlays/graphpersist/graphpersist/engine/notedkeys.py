"""The keys under which an engine files objects that equal pieces share: SAVE notes the key each named piece got, LOAD
hands a piece the object the engine has already filed under that key, without working the key out again.

Why: vLLM compiles its model in pieces, and at every warm start it runs Inductor on each piece its compile cache does
not list as far as AOTAutograd's cache key, only to find that key among the artifacts it has already loaded (34 of
Qwen3-8B's 37 pieces: recipes/diagnosis/vllm-qwen3-8b-tp1-startup/DEFER-COMPILE.md, option (d)). Which key a piece
gets is a fact SAVE can note once. The engine's glue decides which pieces may be handed an object and where the
objects are filed; this module keeps the notes, refuses damaged ones and counts (the rank's stats, `noted_keys`).

An archive is data, never code: a noted key is a plain string, only compared with the keys the live engine filed its
own objects under. An entry of another shape refuses the LOAD, naming it. An archive saved before an engine noted its
keys has none: every piece then takes the engine's own path, and nothing is refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from graphpersist.archive.notedsections import read_keys as read


@dataclass
class NotedKeys:
    """One section of a rank's notes, piece name -> key: SAVE fills `noted` (the session's notes themselves), LOAD
    reads SAVE's into `saved`."""

    section: str
    loading: bool
    saved: dict[str, str] = field(default_factory=dict)
    noted: dict[str, str] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)  # reused, upstream: for the rank's stats

    @classmethod
    def of(cls, section: str, loading: bool, notes: dict[str, Any]) -> NotedKeys:
        """LOAD: SAVE's keys, read from its `notes` (a damaged entry is refused here); SAVE: a map kept in `notes`."""
        if loading:
            return cls(section, loading, saved=read(section, notes.get(section)))
        return cls(section, loading, noted=notes.setdefault(section, {}))

    def reuse(self, name: str, filed: Mapping[str, Any]) -> Any | None:
        """LOAD: the object the engine `filed` under the key SAVE noted for `name`, counted as reused; None where SAVE
        noted no key for it or nothing is filed under that key (the engine's own path then runs: `ran_upstream`)."""
        key = self.saved.get(name) if self.loading else None
        found = None if key is None else filed.get(key)
        if found is not None:
            self.counts["reused"] += 1
        return found

    def ran_upstream(self, name: str, made: Any, filed: Mapping[str, Any]) -> None:
        """The engine's own path made `made` for `name`: counted; SAVE notes the key the engine `filed` it under,
        found by identity (none where it filed it under none)."""
        self.counts["upstream"] += 1
        if self.loading:
            return
        key = next((k for k, v in filed.items() if v is made), None)
        if isinstance(key, str):
            self.noted[name] = key
