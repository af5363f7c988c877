"""Archive strings as a terminal or a report shows them: control characters escaped, never interpreted.

An archive may come from anywhere, and its strings reach people: a graph or kernel name, an environment pin, a
host name. Raw, `ESC [ ... m` recolours or clears a terminal, a carriage return overwrites the line before it, a
newline forges a line of output ("archive fits"), a Unicode bidi override reorders what the reader sees. Every
archive string the runtime prints or writes into a report goes through `shown()`; the `graphpersist` command also
passes its whole output through `terminal_safe()`, which keeps only its own newlines and tabs.

A character is shown as it is when Python calls it printable (`str.isprintable`: no C0/C1 control, no format
character such as U+202E, no line or paragraph separator, no unassigned code point); any other is written as its
escape (`\\x1b`, `\\n`, `\\u202e`), the way `repr()` writes it, without quotes.
"""

from __future__ import annotations


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch]
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def shown(text: str, limit: int | None = None) -> str:
    """`text` with every non-printable character escaped, clipped to `limit` characters (with an ellipsis)."""
    if not isinstance(text, str):
        text = str(text)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else _escape(ch) for ch in text)
    if limit is not None and len(text) > limit:
        return f"{text[: max(limit - 1, 0)]}…"
    return text


def terminal_safe(text: str) -> str:
    """A whole output: each line through shown(), so only the output's own newlines and tabs stay raw."""
    if text.isprintable():
        return text
    return "\n".join("\t".join(shown(part) for part in line.split("\t")) for line in text.split("\n"))
