"""Checks an engine's glue makes, written once: an opt-in environment switch, and the facts a communicator recorded
at SAVE compared with the live ones at LOAD. Engine-neutral: the glue supplies the names and the words."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from graphpersist.archive.validate import ADVICE
from graphpersist.engine.adapter import Communicator, SessionView
from graphpersist.errors import PersistError


def opted_in(name: str, what: str, environ: Mapping[str, str] | None = None) -> bool:
    """An opt-in variable: "1" on, unset or "0" off; any other value is refused, naming the values it takes and what
    `name=1` does (`what`), so a typo never silently means off."""
    value = (os.environ if environ is None else environ).get(name, "")
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"graphpersist: {name}={value!r} is not 1 or 0. Set {name}=1 to {what}, or unset it for "
                     "upstream behaviour.")  # fmt: skip


def check_noted(section: str, what: str, saved: Any, live: Mapping[str, Any]) -> None:
    """LOAD: the facts SAVE noted of an object (`notes[section]`) against the live object's, one line per difference
    (field, saved value, live value), then the advice; an archive that noted none is refused naming `what` it lacks."""
    if not isinstance(saved, dict):
        raise PersistError(f"graphpersist: cannot LOAD: the archive records no {what} (notes.{section} = {saved!r}), "
                           f"this start has one. {ADVICE}")  # fmt: skip
    lines = [
        f"graphpersist: cannot LOAD: {section}.{name}: saved {saved.get(name)!r}, live {live.get(name)!r}"
        for name in sorted(set(saved) | set(live))
        if saved.get(name) != live.get(name)
    ]
    if lines:
        raise PersistError("\n".join([*lines, ADVICE]))


class NotedFacts(Communicator):
    """An object the graphs depend on that nothing registers after the capture (SGLang's DeepEP Buffer: its peers'
    buffers were opened when it was made, in setup), as a communicator: SAVE notes its facts (`read()`) under `name`
    once every graph is captured, after `refuse` (which raises for facts persistence cannot restore) had its say;
    LOAD compares them with SAVE's before the first replay. `check` does the same at an earlier step (where the glue
    makes the object)."""

    def __init__(
        self, name: str, what: str, read: Callable[[], Mapping[str, Any]], refuse: Callable[[Mapping[str, Any]], None]
    ) -> None:
        self.name = name
        self.what = what
        self.read = read
        self.refuse = refuse

    def check(self, session: SessionView, saved: Any) -> dict[str, Any]:
        """The live facts, refused at SAVE as `refuse` says, compared at LOAD with `saved` (what SAVE noted)."""
        facts = dict(self.read())
        if session.loading:
            check_noted(self.name, self.what, saved, facts)
        else:
            self.refuse(facts)
        return facts

    def after_capture(self, session: SessionView) -> None:
        session.notes[self.name] = self.check(session, None)

    def restore(self, session: SessionView, notes: Mapping[str, Any]) -> None:
        self.check(session, notes.get(self.name))
