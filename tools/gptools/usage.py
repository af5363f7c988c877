"""Who uses each name a contract declares, and whether the contract says so truthfully.

A declared name (a `[[hook]]` target, or one name of an `[[attrs]]` table) is used by

* the glue, as the glue lint (`gptools.glueflow`) sees it: a line that imports it, reads, writes, deletes or calls
  it on the declared class or module, overrides it in a glue class, builds the class with it as a keyword, reaches it
  by a getattr its table's `computed_in` lists, or reads it on an upstream value whose class the lint does not know
  (every declaration of that name then counts as used). Nobody writes these down, so they cannot go stale:
  `python -m gptools hooks --uses` lists them;
* a patch of the series, named in `used_by`: it must be listed in the series, and edit lines inside the declared
  function or class (in the pristine tree) or name it (a function or attribute by its name, a dunder method by its
  class) in its header or its changed lines: a patch relies on functions it does not edit too (`LLM(**kwargs)`
  forwarding keywords to EngineArgs), and says so;
* a glue file the lint cannot see use it, named in `used_by` by its path from the repository root: another
  engine's glue (SGLang's reads DeepEP's Buffer), or this engine's where the use is out of the lint's sight (keywords
  passed through a `**dict`, upstream code the glue mirrors). The file must name the declared name, and the lint
  must not see that file touch it already (then used_by says nothing the lint does not).

A declared name that none of these uses is dead, and a `used_by` entry that does not hold is stale: each fails
`make check` with the line to change.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from gptools.contract import Attrs, Contract, Hook
from gptools.glueflow import Site, Use, show
from gptools.series import read_patch, read_series
from gptools.treeast import Tree


@dataclass(frozen=True)
class Declared:
    """One declared name: a [[hook]] target, or one name of an [[attrs]] table."""

    key: str  # "module:Qual" (a hook), "module:name" (a module's name) or "module:Class.name" (a class's attribute)
    bare: str  # the attribute name an upstream value of unknown class is read by ("" for a module-level name)
    words: tuple[str, ...]  # what a patch or a file relying on it names: its class and its name, not dunders
    name: str = ""  # the [[attrs]] name ("" for a hook)

    @property
    def shown(self) -> str:
        return self.name or self.key

    @property
    def spelled(self) -> str:
        """How a patch names it: `Class.method` (a dunder method: `Class`), `function`, `Class.attribute`."""
        return ".".join(self.words[-2:])


def _words(parts: list[str]) -> tuple[str, ...]:
    return tuple(p for p in parts if not (p.startswith("__") and p.endswith("__"))) or (parts[-1],)


def declared_names(table: Hook | Attrs) -> list[Declared]:
    """The names one table declares."""
    if isinstance(table, Hook):
        parts = table.qualname.split(".")
        return [Declared(table.target, parts[-1] if len(parts) > 1 else "", _words(parts))]
    if table.is_module:
        return [Declared(f"{table.target}:{n}", "", (n,), n) for n in table.all_names]
    qual = table.target.split(":", 1)[1].split(".")
    return [Declared(f"{table.target}.{n}", n, _words([*qual, n]), n) for n in table.all_names]


def _names_all(words: frozenset[str], d: Declared) -> bool:
    return all(w in words for w in d.words)


def _list(items: Iterable[object]) -> str:
    return ", ".join(str(i) for i in items)


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


@dataclass
class TableUse:
    """What uses one table's names, and what its `used_by` gets wrong."""

    table: Hook | Attrs
    where: str  # "patches/vllm/hooks.toml:12 [[hook]] vllm.x:Y"
    sites: dict[str, list[Site]] = field(default_factory=dict)  # declared key -> the glue lines touching it
    vouched: dict[str, list[str]] = field(default_factory=dict)  # declared key -> the used_by entries that hold
    stale: list[str] = field(default_factory=list)  # each used_by entry that does not hold, and why
    stale_computed: list[str] = field(default_factory=list)  # computed_in sites with no computed getattr

    @property
    def dead(self) -> list[Declared]:
        return [d for d in declared_names(self.table) if not self.sites.get(d.key) and not self.vouched.get(d.key)]

    @property
    def used_by(self) -> list[str]:
        """The used_by entries that hold, in the order written."""
        held = {u for users in self.vouched.values() for u in users}
        return [u for u in self.table.used_by if u in held]

    def findings(self) -> list[str]:
        """One line per mismatch, each saying what to write."""
        dead, names = self.dead, declared_names(self.table)
        stale = "; ".join(self.stale)
        if len(dead) == len(names):
            what = "" if isinstance(self.table, Hook) else f" ({_list(d.name for d in dead)})"
            return [f"{self.where}: used by nothing{what}: no glue line touches it and no used_by entry holds"
                    f"{': ' + stale if stale else ''}. Remove the table."]  # fmt: skip
        out = []
        if self.stale:
            fix = f"write used_by = {_toml_list(self.used_by)}" if self.used_by else "delete its used_by line"
            out.append(f"{self.where}: {stale}. {fix[0].upper()}{fix[1:]}.")
        if dead:
            out.append(f"{self.where}: used by nothing: {_list(d.name for d in dead)} (no glue line touches them, "
                       "no used_by entry names them). Remove them from its names.")  # fmt: skip
        if self.stale_computed and isinstance(self.table, Attrs):
            kept = [c for c in self.table.computed_in if c not in self.stale_computed]
            fix = f"write computed_in = {_toml_list(kept)}" if kept else "delete its computed_in line"
            out.append(f"{self.where}: computed_in names {_list(self.stale_computed)}, where the lint finds no "
                       f"computed getattr on an upstream value. {fix[0].upper()}{fix[1:]}.")  # fmt: skip
        return out


@dataclass
class UsageReport:
    """Every table of a contract with what uses it."""

    tables: list[TableUse]

    def findings(self) -> list[str]:
        return [line for t in self.tables for line in t.findings()]

    @property
    def used(self) -> int:
        """Declared names something uses."""
        return sum(len(declared_names(t.table)) - len(t.dead) for t in self.tables)

    def lines(self) -> list[str]:
        """The listing `python -m gptools hooks --uses` prints: each declared name and what uses it."""
        out = []
        for t in self.tables:
            out.append(t.where)
            for d in declared_names(t.table):
                users = [str(s) for s in t.sites.get(d.key, [])] + t.vouched.get(d.key, [])
                out.append(f"    {d.shown}: {', '.join(users) if users else 'NOTHING'}")
        return out


# --------------------------------------------------------------------------------------------------- evidence


def _stamp(path: Path) -> tuple[Path, int, int]:
    """A file with its modification time and size: what the caches below are keyed by (an edited file reads
    afresh)."""
    st = path.stat()
    return path, st.st_mtime_ns, st.st_size


def _patch_names(path: Path) -> frozenset[str]:
    return _patch_names_of(_stamp(path))


@cache
def _patch_names_of(stamp: tuple[Path, int, int]) -> frozenset[str]:
    """The names a patch says in its header and its changed lines (hunk headers included), not in its context: each
    word, and each pair of words joined by a dot (`EngineArgs.from_cli_args`)."""
    patch = read_patch(stamp[0])
    text = [patch.header.subject, patch.header.body]
    for diff in patch.files:
        text += [ln for ln in diff.text.splitlines() if ln[:1] in "+-@" and not ln.startswith(("+++", "---"))]
    names: set[str] = set()
    for dotted in re.findall(r"\w+(?:\.\w+)*", "\n".join(text)):
        parts = dotted.split(".")
        names.update(parts)
        names.update(f"{a}.{b}" for a, b in itertools.pairwise(parts))
    return frozenset(names)


_HUNK = re.compile(r"^@@ -(\d+)")


def _edited_lines(path: Path) -> dict[str, frozenset[int]]:
    return _edited_lines_of(_stamp(path))


@cache
def _edited_lines_of(stamp: tuple[Path, int, int]) -> dict[str, frozenset[int]]:
    """Per file a patch edits (its path in the tree), the lines of the pristine file its changes sit at: a removed
    line's own, an added line's last non-blank predecessor (code added after a function's trailing blank line is
    still the function's)."""
    out: dict[str, frozenset[int]] = {}
    for diff in read_patch(stamp[0]).files:
        lines: set[int] = set()
        old = last = 0
        for line in diff.text.splitlines()[1:]:
            if m := _HUNK.match(line):
                old = int(m.group(1))
                last = old - 1
            elif old and line[:1] == "-" and not line.startswith("---"):
                lines.add(old)
                old, last = old + 1, old
            elif old and line[:1] == "+" and not line.startswith("+++"):
                lines.add(last)
            elif old and line[:1] in (" ", ""):
                last = old if line.strip() else last
                old += 1
        if diff.old_path:
            out[diff.old_path] = frozenset(lines)
    return out


def _edits_inside(patch: Path, tree: Tree, target: str) -> bool:
    """Whether `patch` changes lines inside the definition of `target` ("module:Qual") in the pristine tree."""
    module, qualname = target.split(":", 1)
    node, where, _ = tree.find(module, qualname)
    file = tree.module_file(where) if node is not None else None
    if node is None or file is None:
        return False
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    edited = _edited_lines(patch).get(tree.rel(file), frozenset())
    return any(first <= line <= (node.end_lineno or node.lineno) for line in edited)


@cache
def _tree(root: Path) -> Tree:
    return Tree(root)


def _file_words(path: Path) -> frozenset[str]:
    return _file_words_of(_stamp(path))


@cache
def _file_words_of(stamp: tuple[Path, int, int]) -> frozenset[str]:
    return frozenset(re.findall(r"\w+", stamp[0].read_text(encoding="utf-8", errors="replace")))


@dataclass(frozen=True)
class Places:
    """What `used_by` entries are checked against: the contract's patches (None: it has none), its own glue, the
    repository, and the pristine tree the patches apply to (where a patch's edits are placed)."""

    patches: Path | None
    glue_roots: tuple[Path, ...]  # where the glue files used_by may name lie (overlays/, or gpdiag's own folder)
    repo: Path
    tree: Path | None


def _check_patch(entry: str, names: list[Declared], places: Places) -> tuple[list[Declared], str]:
    series = read_series(places.patches) if places.patches is not None else None
    if series is None or entry not in series.names:
        listed = show(series.path) if series is not None else "a series (this contract has no patches)"
        return [], f"used_by names {entry}, which is not in {listed}"
    path = series.path.parent / entry
    said = _patch_names(path)
    tree = _tree(places.tree) if places.tree is not None else None

    def edited(d: Declared) -> bool:
        return not d.name and tree is not None and _edits_inside(path, tree, d.key)

    named = [d for d in names if d.spelled in said or edited(d)]
    if not named:
        edits = " nor edits it" if len(names) == 1 and not names[0].name else ""
        return [], f"used_by names {entry}, which does not name {_list(d.spelled for d in names)}{edits}"
    return named, ""


def _check_file(entry: str, names: list[Declared], places: Places,
                sites: dict[str, list[Site]]) -> tuple[list[Declared], str]:  # fmt: skip
    path = places.repo / entry
    glue = any(path.resolve().is_relative_to(root.resolve()) for root in places.glue_roots)
    if not glue or not path.is_file() or path.suffix != ".py":
        patch = f"a patch of {show(places.patches / 'series')} nor " if places.patches is not None else ""
        roots = " or ".join(f"{show(root)}/..." for root in places.glue_roots)
        what = f"a glue file (its path from the repository root: {roots})"
        return [], f"used_by names {entry}, which is neither {patch}{what}"
    words = _file_words(path)
    named = [d for d in names if _names_all(words, d)]
    if not named:
        return [], f"used_by names {entry}, which does not name {_list(d.spelled for d in names)}"
    seen = [d for d in named if any(s.path == entry for s in sites.get(d.key, []))]
    if len(seen) == len(named):
        lines = _list(str(s) for d in seen for s in sites[d.key] if s.path == entry)
        return [], f"used_by names {entry}, whose use the lint sees ({lines}): used_by adds nothing"
    return [d for d in named if d not in seen], ""


def check(contract: Contract, uses: dict[Use, set[Site]], places: Places,
          computed_sites: frozenset[str] = frozenset()) -> UsageReport:  # fmt: skip
    """What uses each table of `contract`: the glue lines the lint found (`uses`) and the used_by entries that hold;
    a computed_in entry must name a glue function where the lint found a computed getattr (`computed_sites`)."""
    by_name: dict[str, set[Site]] = {}
    exact: dict[str, set[Site]] = {}
    for use, found in uses.items():
        if use.kind in ("name", "exact"):
            (by_name if use.kind == "name" else exact).setdefault(use.name, set()).update(found)
    shown = show(contract.path)
    tables: list[TableUse] = []
    for table in sorted((*contract.hooks, *contract.attrs), key=lambda t: t.line):
        kind = "hook" if isinstance(table, Hook) else "attrs"
        t = TableUse(table, f"{shown}:{table.line} [[{kind}]] {table.target}")
        names = declared_names(table)
        for d in names:
            sites = exact.get(d.key, set()) | (by_name.get(d.bare, set()) if d.bare else set())
            if sites:
                t.sites[d.key] = sorted(sites)
        for entry in table.used_by:
            if entry.endswith(".patch"):
                vouched, why = _check_patch(entry, names, places)
            else:
                vouched, why = _check_file(entry, names, places, t.sites)
            if why:
                t.stale.append(why)
            for d in vouched:
                t.vouched.setdefault(d.key, []).append(entry)
        if isinstance(table, Attrs):
            t.stale_computed = [c for c in table.computed_in if c not in computed_sites]
        tables.append(t)
    return UsageReport(tables)


def advice(subject: str, hooks_file: str) -> str:
    """The line after the findings: what each kind of declaration needs."""
    return (
        f"{subject}: declarations in {hooks_file} that nothing uses, or whose used_by does not hold. The glue's uses "
        f"are found by the lint and never written (`python -m gptools hooks --engine {subject} --uses` lists each "
        "declared name with the glue lines touching it); used_by names only what the lint cannot see: a patch of "
        "the series that edits or names it, or a glue file (path from the repository root) that names it where the "
        "lint does not see it. A name nothing uses is removed."
    )
