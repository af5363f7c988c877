"""The errors SAVE and LOAD raise for user-facing refusals."""

from __future__ import annotations


class PersistError(RuntimeError):
    """SAVE or LOAD cannot proceed; the message names what differs or is unsupported."""


class JitCacheError(PersistError):
    """The JIT caches cannot be carried (too large) or restored (hostile content, a folder that cannot be written)."""
