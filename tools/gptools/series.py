"""Read and lint a patch series: `patches/<engine>/series` plus one git-format patch per concern.

A patch header (the commit message) must say what the patch does (Subject), why it exists (free text), and
carry two trailers so that a rebase can decide its fate: `Upstream:` and `Drop-when:`. The lint reports every
finding on its own line so a reviewer can fix them all in one pass.
"""

from __future__ import annotations

import argparse
import email.header
import email.parser
import email.policy
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SERIES_FILE = "series"
UPSTREAM_RE = re.compile(r"^Upstream:\s*(not forwarded|forwarded\s+\S+|merged\s+\S+)\s*$")
DROP_WHEN_RE = re.compile(r"^Drop-when:\s*(\S.*)$")
TRAILER_RE = re.compile(r"^(Upstream|Drop-when|Signed-off-by|Co-authored-by|Reviewed-by|Link):", re.IGNORECASE)
NUMBERED_RE = re.compile(r"^(\d{4})-[A-Za-z0-9][A-Za-z0-9._-]*\.patch$")
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")
MARKER_RE = re.compile(r"^\+(<{7} |={7}$|>{7} )")


class SeriesError(Exception):
    """A series or patch file cannot be read at all (as opposed to a lint finding)."""


@dataclass(frozen=True)
class Hunk:
    """One `@@` hunk; `index` is 1-based within its file, as GNU patch and git number them."""

    index: int
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    header: str


@dataclass(frozen=True)
class FileDiff:
    """The part of a patch that touches one file (paths relative to the unpacked wheel root)."""

    old_path: str | None
    new_path: str | None
    text: str
    hunks: tuple[Hunk, ...]
    binary: bool = False

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or "?"


@dataclass(frozen=True)
class PatchHeader:
    author: str
    date: str
    subject: str
    body: str

    @property
    def why(self) -> str:
        """The body without trailers: the plain-words reason the patch exists."""
        lines = [ln for ln in self.body.splitlines() if not TRAILER_RE.match(ln)]
        return "\n".join(lines).strip()

    def trailer(self, name: str) -> list[str]:
        prefix = name.lower() + ":"
        return [ln for ln in self.body.splitlines() if ln.lower().startswith(prefix)]


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    header: PatchHeader
    files: tuple[FileDiff, ...]

    @property
    def hunk_count(self) -> int:
        return sum(len(f.hunks) for f in self.files)


@dataclass(frozen=True)
class Finding:
    """One lint finding, printed as `<where>: <what>`."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclass
class SeriesEntry:
    name: str
    line: int


@dataclass
class Series:
    """The parsed `series` file: entries in order plus its leading comment block (kept by export)."""

    path: Path
    entries: list[SeriesEntry] = field(default_factory=list)
    preamble: list[str] = field(default_factory=list)
    exists: bool = True

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]


def read_series(patches_dir: Path) -> Series:
    """Parse `series`: one patch file name per line; `#` starts a comment; blank lines are ignored."""
    path = patches_dir / SERIES_FILE
    series = Series(path=path)
    if not path.is_file():
        series.exists = False
        return series
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            if not series.entries:
                series.preamble.append(raw)
            continue
        series.entries.append(SeriesEntry(name=line, line=lineno))
    while series.preamble and not series.preamble[-1].strip():
        series.preamble.pop()
    return series


def write_series(patches_dir: Path, names: list[str], preamble: list[str]) -> None:
    """Canonical series file: the kept comment block, a blank line if there was one, then one name per line."""
    lines = list(preamble)
    if lines:
        lines.append("")
    lines.extend(names)
    (patches_dir / SERIES_FILE).write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")


def _decode(value: str | None) -> str:
    if value is None:
        return ""
    parts = email.header.decode_header(str(value))
    out = []
    for chunk, charset in parts:
        out.append(chunk.decode(charset or "utf-8", "replace") if isinstance(chunk, bytes) else chunk)
    return re.sub(r"\s+", " ", "".join(out)).strip()


def _split_message(text: str) -> tuple[str, str]:
    """Split a format-patch file into (mail header + message, diff part) at the first `diff --git` line."""
    m = re.search(r"^diff --git ", text, re.MULTILINE)
    if m is None:
        return text, ""
    return text[: m.start()], text[m.start() :]


def parse_header(message: str) -> PatchHeader:
    """Mail headers plus the commit message body up to the `---` separator (what `git am` keeps)."""
    head, _, rest = message.partition("\n\n")
    msg = email.parser.Parser(policy=email.policy.compat32).parsestr(head + "\n\n", headersonly=True)
    subject = re.sub(r"^\[[^\]]*PATCH[^\]]*\]\s*", "", _decode(msg.get("Subject")))
    body_lines = []
    for line in rest.splitlines():
        if line == "---" or line.startswith("diff --git "):
            break
        body_lines.append(line)
    return PatchHeader(
        author=_decode(msg.get("From")),
        date=_decode(msg.get("Date")),
        subject=subject,
        body="\n".join(body_lines).strip(),
    )


def _strip_path(raw: str) -> str | None:
    raw = raw.split("\t", 1)[0].strip()
    if raw == "/dev/null":
        return None
    if raw.startswith('"'):
        raise SeriesError(f"quoted path {raw} is not supported")
    return raw[2:] if raw[:2] in ("a/", "b/") else raw


def parse_diff(diff: str) -> tuple[FileDiff, ...]:
    """Split the diff part into files and hunks, counting hunk lines so that a trailing `-- ` signature is not
    mistaken for a removed line."""
    files: list[FileDiff] = []
    lines = diff.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if not lines[i].startswith("diff --git "):
            i += 1
            continue
        start = i
        i += 1
        old_path = new_path = None
        binary = False
        hunks: list[Hunk] = []
        seen_old = seen_new = False
        while i < len(lines) and not lines[i].startswith("diff --git "):
            line = lines[i]
            if line.startswith("--- ") and not hunks:
                old_path, seen_old = _strip_path(line[4:]), True
            elif line.startswith("+++ ") and not hunks:
                new_path, seen_new = _strip_path(line[4:]), True
            elif line.startswith(("Binary files ", "GIT binary patch")):
                binary = True
            elif line.startswith("@@ "):
                m = HUNK_RE.match(line.rstrip("\n"))
                if m is None:
                    raise SeriesError(f"malformed hunk header: {line.strip()}")
                old_len = int(m.group(2)) if m.group(2) is not None else 1
                new_len = int(m.group(4)) if m.group(4) is not None else 1
                hunks.append(
                    Hunk(len(hunks) + 1, int(m.group(1)), old_len, int(m.group(3)), new_len, line.rstrip("\n"))
                )
                i += 1
                need_old, need_new = old_len, new_len
                while i < len(lines) and (need_old > 0 or need_new > 0):
                    tag = lines[i][:1]
                    if tag == " ":
                        need_old, need_new = need_old - 1, need_new - 1
                    elif tag == "-":
                        need_old -= 1
                    elif tag == "+":
                        need_new -= 1
                    elif tag == "\\":
                        pass
                    elif lines[i] in ("\n", "\r\n"):  # an empty context line whose space was stripped
                        need_old, need_new = need_old - 1, need_new - 1
                    else:
                        raise SeriesError(f"hunk {line.strip()} ends early (line {lines[i].rstrip()!r})")
                    i += 1
                while i < len(lines) and lines[i].startswith("\\"):
                    i += 1
                continue
            elif line.startswith("-- ") and hunks:
                break  # mail signature after the last hunk
            elif hunks and line[:1] in ("+", "-", " "):
                # git apply and GNU patch both ignore such a line: a hunk whose header undercounts would
                # silently lose it. Refuse, so lint reports it.
                raise SeriesError(
                    f"line {i + 1} of the diff ({line.rstrip()!r}) lies outside every hunk: "
                    "a hunk header undercounts its lines (re-export the patch instead of editing it by hand)"
                )
            i += 1
        if not (seen_old and seen_new) and not binary:
            # Pure mode changes or renames carry no ---/+++ lines; take the names from the diff --git line.
            parts = lines[start].split()
            old_path = old_path or _strip_path(parts[2]) if len(parts) > 3 else old_path
            new_path = new_path or _strip_path(parts[3]) if len(parts) > 3 else new_path
        files.append(FileDiff(old_path, new_path, "".join(lines[start:i]), tuple(hunks), binary))
        if i < len(lines) and lines[i].startswith("-- "):
            break
    return tuple(files)


def read_patch(path: Path) -> Patch:
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    message, diff = _split_message(text)
    return Patch(name=path.name, path=path, header=parse_header(message), files=parse_diff(diff))


def load_series(patches_dir: Path) -> list[Patch]:
    """The listed patches in order; raises SeriesError when the series file or a listed patch is missing (a
    mis-pathed or deleted series must never read as "no patches": the build would ship unpatched wheels)."""
    series = read_series(patches_dir)
    if not series.exists:
        raise SeriesError(f"{series.path}: no series file (create an empty one if the engine has no patches)")
    patches = []
    for entry in series.entries:
        path = patches_dir / entry.name
        if not path.is_file():
            raise SeriesError(f"{patches_dir / SERIES_FILE}:{entry.line}: {entry.name} is listed but missing")
        patches.append(read_patch(path))
    return patches


def lint_patch(patch: Patch) -> list[Finding]:
    where = patch.name
    out: list[Finding] = []
    h = patch.header
    if not h.subject:
        out.append(Finding(where, "no Subject: line (say what the patch does)"))
    if not h.author:
        out.append(Finding(where, "no From: line (author; write patches with `gptools export`)"))
    if not h.date:
        out.append(Finding(where, "no Date: line (write patches with `gptools export`)"))
    if not h.why:
        out.append(Finding(where, "empty description: say in plain words why this patch exists"))
    upstream = h.trailer("Upstream")
    if not upstream:
        out.append(Finding(where, "no `Upstream:` trailer (not forwarded | forwarded <link> | merged <commit>)"))
    elif len(upstream) > 1:
        out.append(Finding(where, "more than one `Upstream:` trailer"))
    elif not UPSTREAM_RE.match(upstream[0]):
        out.append(Finding(where, f"invalid {upstream[0]!r}: use not forwarded | forwarded <link> | merged <commit>"))
    drop = h.trailer("Drop-when")
    if not drop:
        out.append(Finding(where, "no `Drop-when:` trailer (the condition for deleting this patch)"))
    elif len(drop) > 1:
        out.append(Finding(where, "more than one `Drop-when:` trailer"))
    elif not DROP_WHEN_RE.match(drop[0]):
        out.append(Finding(where, "empty `Drop-when:` trailer"))
    if not patch.files:
        out.append(Finding(where, "contains no diff"))
    for f in patch.files:
        if f.binary:
            out.append(Finding(where, f"{f.path}: binary diff (only text files may be patched)"))
        elif not f.hunks and f.old_path == f.new_path:
            out.append(Finding(where, f"{f.path}: diff without hunks (mode-only changes are not supported)"))
        for line in f.text.splitlines():
            if MARKER_RE.match(line):
                out.append(Finding(where, f"{f.path}: adds a conflict marker line {line[1:9]!r}…"))
                break
    return out


def lint(patches_dir: Path) -> list[Finding]:
    """Every finding for one series directory; an empty list means clean (an empty series is clean)."""
    series = read_series(patches_dir)
    where = str(series.path)
    if not series.exists:
        return [Finding(where, "no series file (create an empty one if the engine has no patches)")]
    findings: list[Finding] = []
    seen: dict[str, int] = {}
    for e in series.entries:
        if "/" in e.name or not e.name.endswith(".patch"):
            findings.append(Finding(f"{where}:{e.line}", f"{e.name!r} is not a *.patch file name in this folder"))
        if e.name in seen:
            findings.append(Finding(f"{where}:{e.line}", f"{e.name} listed again (first on line {seen[e.name]})"))
            continue
        seen[e.name] = e.line
        if not (patches_dir / e.name).is_file():
            findings.append(Finding(f"{where}:{e.line}", f"{e.name} is listed but missing"))
    for p in sorted(patches_dir.glob("*.patch")):
        if p.name not in seen:
            findings.append(Finding(str(p), "not listed in series (add it or delete it)"))
    numbered = [NUMBERED_RE.match(n) for n in seen]
    if any(numbered) and not all(numbered):
        plain = [n for n, m in zip(seen, numbered, strict=True) if not m]
        findings.append(Finding(where, f"mixes NNNN-slug.patch names with others: {', '.join(plain)}"))
    elif numbered and all(numbered):
        numbers = [int(m.group(1)) for m in numbered if m]
        if numbers != sorted(set(numbers)):
            findings.append(Finding(where, "NNNN- prefixes are not strictly increasing in series order"))
    for name in seen:
        path = patches_dir / name
        if not path.is_file():
            continue
        try:
            patch = read_patch(path)
        except (SeriesError, UnicodeError) as exc:
            findings.append(Finding(name, f"cannot parse: {exc}"))
            continue
        findings.extend(lint_patch(patch))
    return findings


# ---------------------------------------------------------------------------------------------------- CLI


def engines_arg(value: str) -> list[str]:
    """`--engine all` means every pinned engine."""
    if value != "all":
        return [value]
    from gpdist.pins import engine_names

    return list(engine_names())


def patches_dir_for(engine: str, override: str | None) -> Path:
    if override:
        return Path(override)
    from gpdist import REPO_ROOT

    return REPO_ROOT / "patches" / engine


def _cmd_lint(args: argparse.Namespace) -> int:
    if args.patches_dir and args.engine == "all":
        print("gptools lint: --patches-dir needs a single --engine", file=sys.stderr)
        return 2
    report: dict[str, list[str]] = {}
    for engine in engines_arg(args.engine):
        pdir = patches_dir_for(engine, args.patches_dir)
        report[engine] = [str(f) for f in lint(pdir)]
        count = len(read_series(pdir).entries)
        if not args.json:
            for line in report[engine]:
                print(line)
            state = "clean" if not report[engine] else f"{len(report[engine])} finding(s)"
            print(f"lint {engine}: {count} patch(es) listed, {state}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    return 1 if any(report.values()) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "lint",
        help="check series files and patch headers",
        description="Check that every patch is listed once, every listed patch exists, and each header has a "
        "Subject, a why-text, an `Upstream:` and a `Drop-when:` trailer. Exit 1 with one line per finding.",
    )
    p.add_argument("--engine", default="all", help="engine name or `all` (default)")
    p.add_argument("--patches-dir", help="lint this folder instead of patches/<engine>/")
    p.add_argument("--json", action="store_true", help="print findings as JSON")
    p.set_defaults(func=_cmd_lint)
