"""The upstream contract of one engine: what `patches/<engine>/hooks.toml` declares, loaded, validated and indexed.

Two kinds of tables (the format is documented in `gptools.hooks`, which checks them against an upstream tree):

* `[[hook]]`: an upstream function or class a patch edits or the glue calls, wraps or subclasses, with the
  parameters we rely on;
* `[[attrs]]`: names the glue reads, writes or wraps on an upstream class (`target = "module:Class"`) or module
  (`target = "module"`).

and, for an engine, what a roll may cost (`gptools.rollcost` counts it): `[budget]`, the glue lines and upstream
names the engine's glue may take, and `[[backport]]`, a glue module that carries what a later upstream release does
itself, with the release that lets it go (`drop_when`): it is deleted on that roll, never ported, so it is counted
apart from the budget.

`gptools.gluelint` reads the index to decide whether a name the glue touches is declared; `gptools.hooks` checks
each declaration against a tree, and `gptools.usage` that each is used (by the glue, or by what its `used_by` names).
Nothing here reads an upstream tree or imports the engine.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

HOOKS_FILE = "hooks.toml"
KINDS = ("function", "class")
HOOK_KEYS = {"target", "kind", "params", "requires", "used_by", "why"}
ATTRS_KEYS = {"target", "names", "optional", "computed_in", "used_by", "why"}
BUDGET_KEYS = {"glue_lines", "upstream_names", "why"}
BACKPORT_KEYS = {"glue", "drop_when", "why"}


class HooksFileError(Exception):
    """hooks.toml itself is unreadable or malformed (misuse, not a finding about the tree)."""


@dataclass(frozen=True)
class Hook:
    """One declared hook point: an upstream function or class."""

    target: str
    kind: str | None = None
    params: tuple[str, ...] | None = None
    requires: tuple[str, ...] = ()
    used_by: tuple[str, ...] = ()  # what relies on it out of the lint's sight (a patch, a glue file)
    why: str = ""
    line: int = field(default=0, compare=False)  # of its [[hook]] header in hooks.toml

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]

    @property
    def is_function(self) -> bool:
        return self.kind == "function" or (self.kind is None and (self.params is not None or bool(self.requires)))

    def accepts(self, keyword: str) -> bool | None:
        """Whether a call may pass `keyword`: None when the declaration says nothing about the parameters."""
        if self.params is None and not self.requires:
            return None
        declared = (*(self.params or ()), *self.requires)
        return keyword in declared or any(p.startswith("**") for p in declared)


@dataclass(frozen=True)
class Attrs:
    """Names the glue touches on one upstream class (`module:Class`) or module (`module`)."""

    target: str
    names: tuple[str, ...]
    optional: tuple[str, ...] = ()  # read with a fallback (getattr default): may be absent upstream
    computed_in: tuple[str, ...] = ()  # glue functions ("path:qualname") that reach these names by a computed getattr
    used_by: tuple[str, ...] = ()  # what relies on these names out of the lint's sight (a patch, a glue file)
    why: str = ""
    line: int = field(default=0, compare=False)  # of its [[attrs]] header in hooks.toml

    @property
    def is_module(self) -> bool:
        return ":" not in self.target

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def all_names(self) -> tuple[str, ...]:
        return (*self.names, *self.optional)


@dataclass(frozen=True)
class Budget:
    """What the engine's glue may cost a roll, backports apart: its lines and the upstream names it touches."""

    glue_lines: int
    upstream_names: int
    why: str = ""


@dataclass(frozen=True)
class Backport:
    """A glue module doing what a later upstream release does itself: deleted on the roll to that release."""

    glue: str  # its path under overlays/<engine> ("vllm/graphpersist_compiled.py")
    drop_when: str
    why: str = ""


def _known_keys(where: str, entry: dict, allowed: set[str]) -> None:
    """Refuses a table with keys its kind does not have (a typo would otherwise be ignored)."""
    unknown = set(entry) - allowed
    if unknown:
        raise HooksFileError(f"{where}: unknown keys {', '.join(sorted(unknown))}")


def _strings(where: str, key: str, value: object, *, required: bool = False) -> tuple[str, ...]:
    if value is None and not required:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or (required and not value):
        raise HooksFileError(f"{where}: {key} must be a {'non-empty ' if required else ''}list of strings")
    return tuple(value)


def _target(where: str, target: object, *, module_ok: bool) -> str:
    ok = isinstance(target, str) and (
        (target.count(":") == 1 and all(target.split(":")))
        or (module_ok and ":" not in target and all(target.split(".")))
    )
    if not ok:
        shape = (
            "'package.module:Qualified.name' or 'package.module'" if module_ok else "'package.module:Qualified.name'"
        )
        raise HooksFileError(f"{where}: target must be {shape}, got {target!r}")
    return str(target)


def _used_by(where: str, value: object) -> tuple[str, ...]:
    """One name or a list of names."""
    if isinstance(value, str):
        return (value,) if value else ()
    return _strings(where, "used_by", value)


def _hook(where: str, entry: dict, line: int = 0) -> Hook:
    target = _target(where, entry.get("target"), module_ok=False)
    where = f"{where} ({target})"
    kind = entry.get("kind")
    if kind is not None and kind not in KINDS:
        raise HooksFileError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    params = entry.get("params")
    for name, value in (("params", params), ("requires", entry.get("requires", []))):
        if value is not None and (not isinstance(value, list) or not all(isinstance(p, str) for p in value)):
            raise HooksFileError(f"{where}: {name} must be a list of strings")
    _known_keys(where, entry, HOOK_KEYS)
    return Hook(
        target=target,
        kind=kind,
        params=tuple(params) if params is not None else None,
        requires=tuple(entry.get("requires", [])),
        used_by=_used_by(where, entry.get("used_by")),
        why=str(entry.get("why", "")),
        line=line,
    )


def _attrs(where: str, entry: dict, line: int = 0) -> Attrs:
    target = _target(where, entry.get("target"), module_ok=True)
    where = f"{where} ({target})"
    _known_keys(where, entry, ATTRS_KEYS)
    names = _strings(where, "names", entry.get("names", []))
    optional = _strings(where, "optional", entry.get("optional"))
    if not names and not optional:
        raise HooksFileError(f"{where}: names (or optional) must list at least one name")
    bad = [n for n in (*names, *optional) if not n.isidentifier()]
    if bad:
        raise HooksFileError(f"{where}: not attribute names: {', '.join(bad)}")
    computed = _strings(where, "computed_in", entry.get("computed_in"))
    bad = [c for c in computed if c.count(":") != 1 or not all(c.split(":"))]
    if bad:
        raise HooksFileError(f"{where}: computed_in entries must be 'path/inside/overlay.py:function', got {bad}")
    used_by = _used_by(where, entry.get("used_by"))
    return Attrs(target, names, optional, computed, used_by, str(entry.get("why", "")), line)


def _budget(where: str, entry: object) -> Budget:
    if not isinstance(entry, dict):
        raise HooksFileError(f"{where}: budget must be a table ([budget])")
    _known_keys(f"{where}: budget", entry, BUDGET_KEYS)
    counts = [entry.get(key) for key in ("glue_lines", "upstream_names")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        raise HooksFileError(f"{where}: budget: glue_lines and upstream_names must be positive integers, got {counts}")
    return Budget(counts[0], counts[1], str(entry.get("why", "")))


def _backport(where: str, entry: dict) -> Backport:
    _known_keys(where, entry, BACKPORT_KEYS)
    glue, drop_when = entry.get("glue"), entry.get("drop_when")
    if not isinstance(glue, str) or not glue.endswith(".py") or glue.startswith("/") or ".." in glue.split("/"):
        raise HooksFileError(f"{where}: glue must be a .py path under the engine's overlay folder, got {glue!r}")
    if not isinstance(drop_when, str) or not drop_when.strip():
        raise HooksFileError(f"{where} ({glue}): drop_when must say which upstream release lets it go")
    return Backport(glue, drop_when, str(entry.get("why", "")))


@dataclass(frozen=True)
class Contract:
    """Every declaration of one hooks.toml, with the look-ups the glue lint needs."""

    path: Path
    hooks: tuple[Hook, ...]
    attrs: tuple[Attrs, ...] = ()
    budget: Budget | None = None
    backports: tuple[Backport, ...] = ()

    @cached_property
    def modules(self) -> frozenset[str]:
        """Every module a declaration names."""
        return frozenset({h.module for h in self.hooks} | {a.module for a in self.attrs})

    def is_module(self, name: str) -> bool:
        """A declared module, or a package above one (`import vllm` when `vllm.envs` is declared)."""
        return name in self.modules or any(m.startswith(name + ".") for m in self.modules)

    @cached_property
    def _members(self) -> dict[str, set[str]]:
        """target ("module" or "module:Qual") -> the names declared on it (attributes, methods, module names)."""
        out: dict[str, set[str]] = {}
        for a in self.attrs:
            out.setdefault(a.target, set()).update(a.all_names)
        for h in self.hooks:
            parts = h.qualname.split(".")
            out.setdefault(h.module, set()).add(parts[0])
            for i in range(1, len(parts)):
                out.setdefault(f"{h.module}:{'.'.join(parts[:i])}", set()).add(parts[i])
        return out

    def members(self, target: str) -> set[str]:
        return self._members.get(target, set())

    def kind_of(self, target: str) -> str | None:
        """The kind of a declared "module:Qual" ("class", "function" or "value"); None when it is not declared."""
        module, _, qual = target.partition(":")
        hook = self.hook(target)
        if hook is not None:
            if hook.kind is not None:
                return hook.kind
            if hook.is_function:
                return "function"
            return "class" if target in self._members or qual.rsplit(".", 1)[-1][:1].isupper() else "function"
        if target in self._members:
            return "class"  # attributes or methods declared on it
        if "." not in qual and qual in self.members(module):
            return "value"
        return None

    def hook(self, target: str) -> Hook | None:
        return next((h for h in self.hooks if h.target == target), None)

    @cached_property
    def member_names(self) -> frozenset[str]:
        """Every name declared on an upstream class (attributes and methods), for checks by name."""
        names: set[str] = set()
        for a in self.attrs:
            if not a.is_module:
                names.update(a.all_names)
        for h in self.hooks:
            if "." in h.qualname:
                names.add(h.qualname.rsplit(".", 1)[1])
        return frozenset(names)

    def hooks_named(self, name: str) -> list[Hook]:
        """The declared methods called `name` (any class)."""
        return [h for h in self.hooks if "." in h.qualname and h.qualname.rsplit(".", 1)[1] == name]

    @cached_property
    def computed(self) -> dict[str, set[str]]:
        """Glue function ("path:qualname") -> names declared as reached there by a computed getattr."""
        out: dict[str, set[str]] = {}
        for a in self.attrs:
            for site in a.computed_in:
                out.setdefault(site, set()).update(a.all_names)
        return out

    @property
    def count_names(self) -> int:
        """Declared names: hook points plus declared attributes and module names."""
        return len(self.hooks) + sum(len(a.all_names) for a in self.attrs)


def _header_lines(text: str, kind: str, count: int) -> list[int]:
    """The line of each `[[kind]]` header, in order (as tomllib lists the tables); zeros where the headers cannot be
    told apart from the text (an inline array of tables)."""
    found = [i for i, line in enumerate(text.splitlines(), 1) if re.match(rf"\s*\[\[\s*{kind}\s*\]\]", line)]
    return found if len(found) == count else [0] * count


def load_contract(hooks_file: Path) -> Contract:
    """Parse and validate hooks.toml; raise HooksFileError naming the entry on any malformed field."""
    try:
        text = hooks_file.read_text()
        data = tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise HooksFileError(f"{hooks_file}: {err}") from err
    unknown = set(data) - {"hook", "attrs", "budget", "backport"}
    if unknown:
        raise HooksFileError(f"{hooks_file}: unknown tables {', '.join(sorted(unknown))} (use [[hook]], [[attrs]], "
                             "[budget] or [[backport]])")  # fmt: skip
    hook_entries, attrs_entries = data.get("hook", []), data.get("attrs", [])
    if not isinstance(hook_entries, list) or not isinstance(attrs_entries, list):
        raise HooksFileError(f"{hooks_file}: hook and attrs must be arrays of tables ([[hook]], [[attrs]])")
    if not hook_entries and not attrs_entries:
        raise HooksFileError(f"{hooks_file}: no [[hook]] tables")
    hook_lines = _header_lines(text, "hook", len(hook_entries))
    attrs_lines = _header_lines(text, "attrs", len(attrs_entries))
    hooks = tuple(_hook(f"{hooks_file}: hook #{i}", e, line)
                  for i, (e, line) in enumerate(zip(hook_entries, hook_lines, strict=True), 1))  # fmt: skip
    attrs = tuple(_attrs(f"{hooks_file}: attrs #{i}", e, line)
                  for i, (e, line) in enumerate(zip(attrs_entries, attrs_lines, strict=True), 1))  # fmt: skip
    seen: dict[tuple[str, str], int] = {}
    for i, a in enumerate(attrs, 1):
        for name in a.all_names:
            first = seen.setdefault((a.target, name), i)
            if first != i:
                raise HooksFileError(
                    f"{hooks_file}: attrs #{i} ({a.target}): {name} is declared already (attrs #{first})"
                )
    budget = _budget(str(hooks_file), data["budget"]) if "budget" in data else None
    backport_entries = data.get("backport", [])
    if not isinstance(backport_entries, list) or not all(isinstance(e, dict) for e in backport_entries):
        raise HooksFileError(f"{hooks_file}: backport must be an array of tables ([[backport]])")
    backports = tuple(_backport(f"{hooks_file}: backport #{i}", e) for i, e in enumerate(backport_entries, 1))
    if len({b.glue for b in backports}) < len(backports):
        raise HooksFileError(f"{hooks_file}: a glue module is named by two [[backport]] tables")
    return Contract(hooks_file, hooks, attrs, budget, backports)


def load_hooks(hooks_file: Path) -> list[Hook]:
    """The [[hook]] tables alone (validated with the rest of the file)."""
    return list(load_contract(hooks_file).hooks)
