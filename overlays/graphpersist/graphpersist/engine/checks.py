"""Checks an engine's glue makes, written once: an opt-in environment switch, and the facts a communicator recorded
at SAVE compared with the live ones at LOAD. Engine-neutral: the glue supplies the names and the words."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from graphpersist.archive.validate import ADVICE
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
