"""The error SAVE and LOAD raise for user-facing refusals."""

from __future__ import annotations


class PersistError(RuntimeError):
    """SAVE or LOAD cannot proceed; the message names what differs or is unsupported."""
