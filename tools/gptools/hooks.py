"""The upstream contract: every upstream name our patches and glue rely on is declared, used, and still there.

`patches/<engine>/hooks.toml` declares each upstream function, class, attribute and module-level name that a patch
edits or that the engine's glue (`overlays/<engine>/**/*.py`) reads, writes, calls, wraps or subclasses. A new
upstream release can rename a method, drop a parameter or an attribute without making any patch fail to apply
(when only the glue uses it); `python -m gptools hooks` catches that, in three parts, all run by `make check`:

1. the declarations against an unpacked upstream tree (default: the pristine pinned one), by AST, importing
   nothing, so it runs on CPU for every engine (SGLang's wheel is CPython 3.12 only); `make rebase` runs the same
   check against the new release and reports every declared name it removed or renamed;
2. the glue against the declarations (`gptools.gluelint`): a name the glue touches on upstream code that
   hooks.toml does not declare fails the check. Its rule is in gluelint's docstring;
   `python -m gptools hooks --engine vllm --undeclared` lists what is missing, with the upstream classes that
   define each name;
3. the declarations against their users (`gptools.usage`, with a tree): a declared name nothing uses (no glue line
   touches it, no `used_by` entry holds) fails, and so does a `used_by` entry that does not hold (a patch not in
   the series or that neither edits nor names the declaration, a file that does not name it). Who in the glue uses
   a name is never written: the lint finds it (`python -m gptools hooks --engine vllm --uses` lists each declared
   name with the glue lines touching it), so it cannot go stale. Its rule is in usage's docstring;
4. what a roll costs (`gptools.rollcost`, with a tree): the glue's lines and the upstream names it touches, held to
   hooks.toml's `[budget]`, each `[[backport]]` module counted apart with the release that lets it go.

`tools/gpdiag/contract.toml` (`--engine gpdiag`, and `all`) is the diagnosis tools' contract, in the same format and
checked the same way: the product's names it declares against overlays/graphpersist and overlays/vllm, vLLM's
against the pinned tree under them, and tools/gpdiag is its glue.

hooks.toml format::

    [[hook]]                         # an upstream function or class
    target = "vllm.engine.arg_utils:EngineArgs.add_cli_args"   # module:qualified.name
    kind = "function"                # optional: "function" or "class"
    params = ["parser"]              # optional: every parameter, in order ("*args", "**kw", "*", "/" markers)
    requires = ["model", "**kwargs"] # optional: parameters that must be present (any order, others allowed)
    used_by = "0001-add-graph-persistence-switch.patch"
                                     # optional (one name or a list): what relies on it out of the lint's sight:
                                     # a patch of the series that edits it or names it (`EngineArgs.add_cli_args`),
                                     # or a glue file (`overlays/...py`) that names it; never the glue the lint reads
    why = "the patch adds the flags at the end"

    [[attrs]]                        # names the glue touches on an upstream class, or on a module
    target = "vllm.v1.worker.gpu_worker:Worker"   # "module:Class", or "module" for module-level names
    names = ["model_runner", "rank"] # must exist: the class (or a base class in the tree) defines each in its
                                     # body (method, property, class variable, dataclass field, enum member,
                                     # __slots__) or assigns self.<name> in a method; a module binds each
                                     # (def, class, assignment, import or re-export)
    optional = ["__commit_id__"]     # optional: read with a fallback (getattr default); need not exist
    computed_in = ["sglang/srt/graphpersist_customar.py:group_communicators"]
                                     # optional: glue functions that reach these names by a computed getattr (each
                                     # must make one; every name of the table then counts as used there)
    why = "the worker reads its runner and rank"

    [budget]                         # an engine's: what its glue may cost a roll, backports apart
    glue_lines = 700                 # lines of overlays/<engine>/**/*.py
    upstream_names = 98              # declared names something other than a backport uses
    why = "issue 40"

    [[backport]]                     # a glue module doing what a later upstream release does itself
    glue = "vllm/graphpersist_compiled.py"   # its path under overlays/<engine>
    drop_when = "vLLM requires torch >= 2.12 (its mega AOT artifact on by default)"
    why = "..."

A method the glue calls with keywords is best declared as a [[hook]] with its params: the lint then checks the
keywords too. Several [[attrs]] tables may name one target (grouped by who uses them); a name is declared once. A
class the glue imports needs no [[hook]] of its own when an [[attrs]] table names it: that table checks the class.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gptools import gluelint, rollcost, usage
from gptools.contract import (
    HOOKS_FILE,
    KINDS,
    Attrs,
    Contract,
    Hook,
    HooksFileError,
    load_contract,
    load_hooks,
)
from gptools.treeast import Tree

__all__ = [
    "HOOKS_FILE",
    "KINDS",
    "Attrs",
    "Finding",
    "Hook",
    "HooksFileError",
    "check_contract",
    "check_hooks",
    "load_contract",
    "load_hooks",
    "signature",
]


@dataclass(frozen=True)
class Finding:
    """One declared name that does not match a tree: what was declared, what changed, and where it may have gone."""

    target: str  # the declaration's target ("module:Qual" or "module")
    name: str  # the declared attribute or module name ("" for a hook's own target)
    kind: str  # "function", "class", "attribute", "module name"
    change: str  # "removed", "parameters", "kind"
    message: str  # the line a person reads
    renamed_to: tuple[str, ...] = ()  # names new in that release that look like it

    @property
    def declared(self) -> str:
        if not self.name:
            return self.target
        return f"{self.target}{'.' if ':' in self.target else ':'}{self.name}"

    def __str__(self) -> str:
        return self.message


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names in order, with '/', '*', '*name' and '**name' markers, as written in hooks.toml."""
    a = node.args
    out = [p.arg for p in a.posonlyargs]
    if a.posonlyargs:
        out.append("/")
    out += [p.arg for p in a.args]
    if a.vararg is not None:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    out += [p.arg for p in a.kwonlyargs]
    if a.kwarg is not None:
        out.append("**" + a.kwarg.arg)
    return out


def _similar(name: str, pool: set[str]) -> tuple[str, ...]:
    """Names that look like `name`: close spellings first, then names that contain it or that it contains
    (`setup` -> `setup_buffers`)."""
    close = difflib.get_close_matches(name, sorted(pool), n=3, cutoff=0.6)
    bare = name.strip("_").lower()

    def contains(p: str) -> bool:
        other = p.strip("_").lower()
        return bare in other or (len(other) >= 3 and other in bare)

    within = sorted(p for p in pool if len(bare) >= 3 and p not in close and contains(p))
    return tuple([*close, *within][:3])


class _Checker:
    """Checks declarations against a tree; with the previous release's tree, a removed name's likely new name is one
    that is new in this release and looks like it."""

    def __init__(self, tree: Path, old_tree: Path | None = None, layers: tuple[Path, ...] = ()) -> None:
        self.tree = Tree(*layers, tree)
        self.old = Tree(*layers, old_tree) if old_tree is not None else None

    def _renamed(self, name: str, new: set[str], old: set[str] | None) -> tuple[str, ...]:
        """Names new in this release that look like `name`; when none looks like it but only a few are new in its
        scope, those few (a rename can change a name entirely)."""
        if old is None:
            return _similar(name, new - {name})
        added = new - old
        return _similar(name, added) or (tuple(sorted(added)) if len(added) <= 3 else ())

    def _hint(self, renamed: tuple[str, ...]) -> str:
        """With the previous release at hand, a similar name new in this one is a likely rename; without it, the
        similar names are only that."""
        if not renamed:
            return ""
        if self.old is not None:
            return f"; renamed to {' or '.join(renamed)}?"
        return f"; similar names here: {', '.join(renamed)}"

    def _moved_module(self, module: str) -> tuple[str, ...]:
        """Modules of the same file name that are new in this release (a module that moved)."""
        base = module.rsplit(".", 1)[-1]
        found = []
        for path in sorted(p for root in self.tree.roots for p in root.rglob(f"{base}.py")):
            rel = Path(self.tree.rel(path)).with_suffix("")
            dotted = ".".join(rel.parts)
            if dotted != module and (self.old is None or self.old.module_file(dotted) is None):
                found.append(dotted)
        return tuple(found[:3])

    def _missing_def(self, hook_target: str, module: str, qualname: str, reason: str, kind: str) -> Finding:
        name = qualname.rsplit(".", 1)[-1]
        if self.tree.module_file(module) is None:
            renamed = self._moved_module(module) if self.old is not None else ()
        else:
            new = self.tree.scope_names(module, qualname)
            old = self.old.scope_names(module, qualname) if self.old is not None else None
            renamed = self._renamed(name, new, old)
        hint = self._hint(renamed)
        return Finding(hook_target, "", kind, "removed", f"{hook_target}: not found: {reason}{hint}", renamed)

    def hook(self, hook: Hook) -> list[Finding]:
        node, _, reason = self.tree.find(hook.module, hook.qualname)
        if node is None:
            return [self._missing_def(hook.target, hook.module, hook.qualname, reason, hook.kind or "function")]
        is_class = isinstance(node, ast.ClassDef)
        kind = "class" if is_class else "function"
        findings: list[Finding] = []
        if hook.kind is not None and hook.kind != kind:
            message = f"{hook.target}: expected a {hook.kind}, found a {kind} (line {node.lineno})"
            findings.append(Finding(hook.target, "", hook.kind, "kind", message))
        if is_class:
            if hook.params is not None or hook.requires:
                message = f"{hook.target}: is a class; declare params on its methods instead"
                findings.append(Finding(hook.target, "", "class", "parameters", message))
            return findings
        assert not isinstance(node, ast.ClassDef)
        found = signature(node)
        if hook.params is not None and tuple(found) != hook.params:
            findings.append(Finding(hook.target, "", "function", "parameters",
                                    f"{hook.target}: parameters changed: expected ({', '.join(hook.params)}), "
                                    f"found ({', '.join(found)}) at line {node.lineno}"))  # fmt: skip
        missing = [p for p in hook.requires if p not in found]
        if missing:
            findings.append(Finding(hook.target, "", "function", "parameters",
                                    f"{hook.target}: missing parameter(s) {', '.join(missing)}; found "
                                    f"({', '.join(found)}) at line {node.lineno}"))  # fmt: skip
        return findings

    def attrs(self, entry: Attrs) -> list[Finding]:
        return self._module_names(entry) if entry.is_module else self._class_attrs(entry)

    def _module_names(self, entry: Attrs) -> list[Finding]:
        findings = []
        for name in entry.names:
            ok, reason = self.tree.has_name(entry.module, name)
            if ok:
                continue
            old_names: set[str] | None = None
            if self.old is not None:
                info = self.old.module(entry.module)
                old_names = set(info.bindings) if not isinstance(info, str) else set()
            info = self.tree.module(entry.module)
            new_names = set(info.bindings) if not isinstance(info, str) else set()
            renamed = self._renamed(name, new_names, old_names)
            hint = self._hint(renamed)
            findings.append(Finding(entry.target, name, "module name", "removed",
                                    f"{entry.module}:{name}: not found: {reason}{hint}", renamed))  # fmt: skip
        return findings

    def _class_attrs(self, entry: Attrs) -> list[Finding]:
        module, qualname = entry.target.split(":", 1)
        found, reason = self.tree.class_attributes(module, qualname)
        if found is None:
            missing = self._missing_def(entry.target, module, qualname, reason, "class")
            names = ", ".join(entry.names)
            return [Finding(entry.target, "", "class", "removed", f"{missing.message}; its declared attributes go "
                            f"with it: {names}", missing.renamed_to)]  # fmt: skip
        old_names: set[str] | None = None
        if self.old is not None:
            old, _ = self.old.class_attributes(module, qualname)
            old_names = old.names if old is not None else set()
        findings = []
        for name in entry.names:
            if name in found.names:
                continue
            renamed = self._renamed(name, found.names, old_names)
            where = f"searched {', '.join(found.searched)}"
            if found.outside:
                where += f"; bases outside the tree: {', '.join(found.outside)}"
            hint = self._hint(renamed)
            message = f"{entry.target}.{name}: attribute not found ({where}){hint}"
            findings.append(Finding(entry.target, name, "attribute", "removed", message, renamed))
        return findings


def check_contract(tree: Path, contract: Contract, old_tree: Path | None = None, *,
                   layers: tuple[Path, ...] = ()) -> list[Finding]:  # fmt: skip
    """Every declaration of `contract` that `tree` does not match; `old_tree` (the release the declarations were
    written for) lets a removed name point at its likely new name; `layers` are read before `tree` (our overlays,
    for a contract that declares our own names too)."""
    checker = _Checker(tree, old_tree, layers)
    findings: list[Finding] = []
    for hook in contract.hooks:
        findings += checker.hook(hook)
    for entry in contract.attrs:
        findings += checker.attrs(entry)
    return findings


def check_hooks(tree: Path, hooks_file: Path, old_tree: Path | None = None) -> list[str]:
    """Every finding for the names declared in hooks_file against an unpacked tree, one line each; empty means all
    match."""
    return [f.message for f in check_contract(tree, load_contract(hooks_file), old_tree)]


# ------------------------------------------------------------------------------------------------------- CLI


GPDIAG = "gpdiag"  # the diagnosis tools' contract (tools/gpdiag/contract.toml): checked with the engines'


def engine_choices() -> list[str]:
    """Pinned engines, then any other folder under patches/ that declares a contract (hooks.toml)."""
    from gpdist import REPO_ROOT
    from gpdist.pins import engine_names

    names = list(engine_names())
    patches = REPO_ROOT / "patches"
    names += sorted(p.parent.name for p in patches.glob(f"*/{HOOKS_FILE}") if p.parent.name not in names)
    return names


@dataclass(frozen=True)
class Subject:
    """What one contract covers: an engine's (patches/<engine>/hooks.toml: its series and its glue,
    overlays/<engine>) or gpdiag's (tools/gpdiag/contract.toml: the upstream vLLM names and the product's own names
    the diagnosis tools reach, checked against the pinned vLLM tree under the product's overlays)."""

    name: str
    hooks_file: Path
    glue: Path  # the folder the lint reads
    root: Path  # the glue's module names are its paths under it
    upstream: str  # the pinned engine whose tree the declarations are checked against
    layers: tuple[Path, ...] = ()  # our source read before that tree: the overlays whose names the contract declares
    runtime: Path | None = None  # our classes the lint accepts names of on values it cannot place (None: the runtime)


def subject(name: str) -> Subject:
    from gpdist import REPO_ROOT

    if name == GPDIAG:
        tools, overlays = REPO_ROOT / "tools", REPO_ROOT / "overlays"
        layers = (overlays / "graphpersist", overlays / "vllm")
        return Subject(name, tools / GPDIAG / "contract.toml", tools / GPDIAG, tools, "vllm", layers, tools / GPDIAG)
    glue = REPO_ROOT / "overlays" / name
    return Subject(name, REPO_ROOT / "patches" / name / HOOKS_FILE, glue, glue, name)


def default_tree(engine: str) -> Path | None:
    """The pristine pinned upstream tree (unpacked on first use); None for an engine that is not pinned."""
    from gpdist import pins
    from gpdist.unpack import upstream_tree

    loaded = pins.load()
    if engine not in loaded.engines:
        return None
    return upstream_tree(loaded.engine(engine))


@dataclass
class Report:
    """What one contract's check found: the declarations against a tree, the glue against the declarations, and
    what uses each declaration."""

    engine: str
    tree: Path | None
    hooks_file: Path
    checked: int = 0  # hook points
    declared: int = 0  # declared attribute and module names
    changes: list[Finding] = field(default_factory=list)
    lint: gluelint.LintReport | None = None  # when the glue was linted
    usage: usage.UsageReport | None = None  # with the lint and a tree
    roll: rollcost.RollCost | None = None  # with the usage, for a contract with a budget or backports
    layers: tuple[Path, ...] = ()  # our source read before the tree

    @property
    def findings(self) -> list[str]:
        lines = [f.message for f in self.changes]
        if self.lint is not None:
            lines += [u.text() for u in self.lint.undeclared]
        if self.usage is not None:
            lines += self.usage.findings()
        if self.roll is not None:
            lines += self.roll.findings()
        return lines


def run(
    engine: str,
    tree: Path | None = None,
    hooks_file: Path | None = None,
    *,
    glue: Path | None = None,
    check_tree: bool = True,
    lint: bool = True,
) -> Report:
    """Check one contract (an engine's, or gpdiag's): the declarations against `tree` (default: the pristine pinned
    upstream, under our overlays for gpdiag), the glue (default: overlays/<engine>) against the declarations, and,
    with both, that each declaration is used by what it says."""
    from gpdist import REPO_ROOT

    sub = subject(engine)
    hooks_file = hooks_file if hooks_file is not None else sub.hooks_file
    contract = load_contract(hooks_file)
    if check_tree and tree is None:
        tree = default_tree(sub.upstream)
    report = Report(engine, tree, hooks_file, len(contract.hooks), sum(len(a.all_names) for a in contract.attrs))
    report.layers = sub.layers if tree is not None else ()
    if check_tree and tree is not None:
        report.changes = check_contract(tree, contract, layers=sub.layers)
    if lint:
        glue = glue if glue is not None else sub.glue
        root = sub.root if glue == sub.glue else glue
        report.lint = gluelint.lint(engine, contract, glue, runtime=sub.runtime, root=root)
        if tree is not None:  # where a patch's edits lie: without it, what a patch relies on is not known
            patches = hooks_file.parent if engine != GPDIAG else None
            overlays = REPO_ROOT / "overlays"
            roots = (overlays,) if sub.glue.is_relative_to(overlays) else (overlays, sub.glue)
            places = usage.Places(patches, roots, REPO_ROOT, tree)
            report.usage = usage.check(contract, report.lint.uses, places, frozenset(report.lint.computed_sites))
            if contract.budget is not None or contract.backports:
                report.roll = rollcost.count(engine, contract, glue, report.usage)
    return report


def _print_human(r: Report, *, show_tree: bool) -> None:
    total = r.checked + r.declared
    what = f"{r.checked} hook points, {r.declared} attributes and module names"
    names = "declared upstream names"
    if r.layers:
        what += f"; ours checked in {', '.join(gluelint.show(p) for p in r.layers)}"
        names = "declared names (upstream's and ours)"
    if show_tree:
        if r.tree is None:
            print(f"{r.engine}: no pinned upstream tree: its {total} declared names ({what}) are not checked against "
                  "one (--tree DIR checks them)")  # fmt: skip
        elif r.changes:
            print(f"{r.engine}: {len(r.changes)} of {total} {names} ({what}) changed in {r.tree}")
            for f in r.changes:
                print(f"  {f.message}")
        else:
            print(f"{r.engine}: all {total} {names} match ({what}; {r.tree})")
    if r.lint is not None:
        for line in r.lint.lines():
            print(line)
    found = r.usage.findings() if r.usage is not None else []
    for line in found:
        print(line)
    if found:
        print(usage.advice(r.engine, gluelint.show(r.hooks_file)))
    elif r.usage is not None:
        print(f"{r.engine}: each of the {r.usage.used} declared names is used: by the glue, or by what its used_by "
              "names")  # fmt: skip
    if r.roll is not None:
        print(r.roll.line())
        for line in r.roll.findings():
            print(line)


def _cmd_hooks(args: argparse.Namespace) -> int:
    engines = [*engine_choices(), GPDIAG] if args.engine == "all" else [args.engine]
    if (args.tree or args.hooks_file or args.glue) and len(engines) > 1:
        print("gptools hooks: --tree/--hooks-file/--glue need a single --engine", file=sys.stderr)
        return 2
    reports: list[Report] = []
    for engine in engines:
        try:
            report = run(
                engine,
                Path(args.tree) if args.tree else None,
                Path(args.hooks_file) if args.hooks_file else None,
                glue=Path(args.glue) if args.glue else None,
                check_tree=not (args.lint_only or args.undeclared),
                lint=not args.no_lint,
            )
        except HooksFileError as err:
            print(f"gptools hooks: {err}", file=sys.stderr)
            return 2
        if args.undeclared and report.lint is not None:
            report.lint.suggest(Path(args.tree) if args.tree else default_tree(subject(engine).upstream))
        reports.append(report)
    if args.json:
        out = []
        for r in reports:
            entry = {
                "engine": r.engine,
                "tree": str(r.tree) if r.tree else None,
                "checked": r.checked,
                "declared": r.declared,
                "findings": r.findings,
                "changes": [asdict(f) for f in r.changes],
            }
            if r.lint is not None:
                entry["lint"] = r.lint.to_json()
            if r.roll is not None:
                entry["roll_cost"] = {
                    "glue": asdict(r.roll.glue),
                    "budget": asdict(r.roll.contract.budget) if r.roll.contract.budget else None,
                    "backports": [{**asdict(b), **asdict(part)} for b, part in r.roll.backports],
                }
            out.append(entry)
        print(json.dumps(out, indent=2))
    elif args.uses:
        for r in reports:
            for line in r.usage.lines() if r.usage is not None else []:
                print(line)
    else:
        for r in reports:
            _print_human(r, show_tree=not (args.lint_only or args.undeclared))
    return 1 if any(r.findings for r in reports) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `hooks` subcommand to `python -m gptools`."""
    p = subparsers.add_parser(
        "hooks",
        help="check the upstream contract: declared names exist upstream, the glue touches only declared ones",
        description="Read patches/<engine>/hooks.toml; check each declared function, class, attribute and module "
        "name against an unpacked tree by AST (nothing is imported; default tree: the pristine pinned upstream), "
        "then lint the engine's glue (overlays/<engine>) for upstream names it touches that hooks.toml does not "
        "declare. Exit 1 on a finding.",
    )
    p.add_argument(
        "--engine",
        default="all",
        choices=(*engine_choices(), GPDIAG, "all"),
        help=f"engine name, {GPDIAG} (the diagnosis tools' contract) or `all` (every engine and {GPDIAG})",
    )
    p.add_argument("--tree", help="unpacked tree to check instead of the pristine pinned upstream")
    p.add_argument("--hooks-file", help="hooks declaration to use instead of patches/<engine>/hooks.toml")
    p.add_argument("--glue", help="overlay folder to lint instead of overlays/<engine>")
    p.add_argument("--lint-only", action="store_true", help="only the glue lint (no upstream tree needed)")
    p.add_argument("--no-lint", action="store_true", help="only the declarations against the tree")
    p.add_argument(
        "--undeclared",
        action="store_true",
        help="list the upstream names the glue touches that hooks.toml does not declare, each with the upstream "
        "classes that define it (reads the pristine tree) and a [[attrs]] line to start from",
    )
    p.add_argument(
        "--uses",
        action="store_true",
        help="list each declared name with what uses it: the glue lines that touch it, the used_by entries that hold",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_hooks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptools.hooks")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["hooks", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
