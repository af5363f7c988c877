"""What rolling an engine onto a new upstream release costs: the glue's lines and the upstream names it touches.

Every line of `overlays/<engine>` and every name `patches/<engine>/hooks.toml` declares is something a roll must
read again and perhaps port. hooks.toml's `[budget]` caps both for the glue that stays; a `[[backport]]` module (what
a later upstream release does itself) is counted apart, since the roll to that release deletes it instead of
porting it. A declared name belongs to a backport when only that module uses it (no other glue line, no patch).
`make check` (`python -m gptools hooks`) prints the count and fails when the glue outside backports exceeds its
budget: raising a budget is a decision written in hooks.toml, never drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gptools.contract import Backport, Contract
from gptools.glueflow import show
from gptools.usage import UsageReport, declared_names


@dataclass(frozen=True)
class Part:
    """Lines of glue and the declared upstream names only they use."""

    lines: int
    names: int


@dataclass
class RollCost:
    """One engine's glue as a roll pays for it: what stays (held to the budget) and each backport."""

    engine: str
    contract: Contract
    glue: Part
    backports: list[tuple[Backport, Part]] = field(default_factory=list)
    missing: list[Backport] = field(default_factory=list)  # backports naming no file of the glue

    def findings(self) -> list[str]:
        where = show(self.contract.path)
        out = [f"{where}: [[backport]] names {b.glue}, which is not a file of overlays/{self.engine}: fix its glue "
               "path, or delete the table once the module is gone" for b in self.missing]  # fmt: skip
        budget = self.contract.budget
        if budget is None:
            return out
        measured = (
            ("lines", self.glue.lines, budget.glue_lines, "glue_lines"),
            ("upstream names", self.glue.names, budget.upstream_names, "upstream_names"),
        )
        for what, have, cap, key in measured:
            if have > cap:
                out.append(
                    f"{where}: {self.engine}'s glue outside backports takes {have} {what}, over its budget of {cap} "
                    f"([budget] {key}): every one is read again on a roll. Cut glue (the engine's steps belong in "
                    "graphpersist.engine.PersistSession), declare a module that a later upstream release makes "
                    "unneeded as a [[backport]] with its drop_when, or raise the budget there and say why"
                )
        return out

    def line(self) -> str:
        """The count `make check` prints."""
        budget = self.contract.budget
        lines = f"{self.glue.lines} glue lines" + (f" (budget {budget.glue_lines})" if budget else "")
        names = f"{self.glue.names} upstream names" + (f" (budget {budget.upstream_names})" if budget else "")
        text = f"{self.engine}: a roll reads {lines} and {names}"
        for backport, part in self.backports:
            text += (f"; backport {backport.glue} apart: {part.lines} lines, {part.names} names only it uses, "
                     f"dropped when {backport.drop_when}")  # fmt: skip
        return text


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8", errors="replace").splitlines())


def count(engine: str, contract: Contract, glue: Path, used: UsageReport) -> RollCost:
    """The roll cost of `glue` (overlays/<engine>) under `contract`, with what uses each declared name (`used`)."""
    files = {p.relative_to(glue).as_posix(): _lines(p) for p in sorted(glue.rglob("*.py"))}
    present = [b for b in contract.backports if b.glue in files]
    by_path = {show(glue / b.glue): b for b in present}
    only: dict[str, int] = {b.glue: 0 for b in present}
    names = 0
    for table in used.tables:
        for d in declared_names(table.table):
            users = {s.path for s in table.sites.get(d.key, [])} | set(table.vouched.get(d.key, []))
            owners = {by_path.get(u) for u in users}
            if len(owners) == 1 and (owner := owners.pop()) is not None:
                only[owner.glue] += 1
            else:
                names += 1
    kept = sum(n for path, n in files.items() if path not in only)
    return RollCost(
        engine,
        contract,
        Part(kept, names),
        [(b, Part(files[b.glue], only[b.glue])) for b in present],
        [b for b in contract.backports if b.glue not in files],
    )
