"""Check that the upstream functions our patches and overlays hook still exist with the parameters we expect.

`patches/<engine>/hooks.toml` declares every hook point (a patch edits it, an overlay calls or wraps it, or a
later runtime seam will). A new upstream release can rename a method or drop a parameter without making any
patch fail to apply, e.g. when the seam is only called from an overlay; this check catches that. It reads the
tree with `ast` and imports nothing, so it runs on CPU for both engines (SGLang's wheel is CPython 3.12 only).

hooks.toml format, one table per hook point::

    [[hook]]
    target = "vllm.engine.arg_utils:EngineArgs.add_cli_args"   # module:qualified.name
    kind = "function"                # optional: "function" or "class"
    params = ["parser"]              # optional: every parameter, in order ("*args", "**kw", "*", "/" markers)
    requires = ["model", "**kwargs"] # optional: parameters that must be present (any order, others allowed)
    used_by = "0001-add-graph-persistence-switch.patch"
    why = "the patch adds the flags at the end"
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

HOOKS_FILE = "hooks.toml"
KINDS = ("function", "class")
_Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


class HooksFileError(Exception):
    """hooks.toml itself is unreadable or malformed (misuse, not a finding about the tree)."""


@dataclass(frozen=True)
class Hook:
    """One declared hook point."""

    target: str
    kind: str | None = None
    params: tuple[str, ...] | None = None
    requires: tuple[str, ...] = ()
    used_by: str = ""
    why: str = ""

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]


@dataclass
class Report:
    """What one check found: how many hooks were looked at and one line per problem."""

    engine: str
    tree: Path
    checked: int = 0
    findings: list[str] = field(default_factory=list)


def load_hooks(hooks_file: Path) -> list[Hook]:
    """Parse and validate hooks.toml; raise HooksFileError naming the entry on any malformed field."""
    try:
        data = tomllib.loads(hooks_file.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise HooksFileError(f"{hooks_file}: {err}") from err
    entries = data.get("hook", [])
    if not isinstance(entries, list) or not entries:
        raise HooksFileError(f"{hooks_file}: no [[hook]] tables")
    hooks: list[Hook] = []
    for i, entry in enumerate(entries, 1):
        where = f"{hooks_file}: hook #{i}"
        target = entry.get("target")
        if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
            raise HooksFileError(f"{where}: target must be 'package.module:Qualified.name', got {target!r}")
        kind = entry.get("kind")
        if kind is not None and kind not in KINDS:
            raise HooksFileError(f"{where} ({target}): kind must be one of {', '.join(KINDS)}, got {kind!r}")
        params, requires = entry.get("params"), entry.get("requires", [])
        for name, value in (("params", params), ("requires", requires)):
            if value is not None and (not isinstance(value, list) or not all(isinstance(p, str) for p in value)):
                raise HooksFileError(f"{where} ({target}): {name} must be a list of strings")
        unknown = set(entry) - {"target", "kind", "params", "requires", "used_by", "why"}
        if unknown:
            raise HooksFileError(f"{where} ({target}): unknown keys {', '.join(sorted(unknown))}")
        hooks.append(
            Hook(
                target=target,
                kind=kind,
                params=tuple(params) if params is not None else None,
                requires=tuple(requires),
                used_by=str(entry.get("used_by", "")),
                why=str(entry.get("why", "")),
            )
        )
    return hooks


def module_file(tree: Path, module: str) -> Path | None:
    """The source file of a dotted module inside an unpacked wheel tree, or None."""
    base = tree.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _definitions(body: list[ast.stmt]) -> dict[str, _Def]:
    """Names defined by def/class in a body, looking through if/try/with blocks; the last definition wins,
    as it does when Python runs the module."""
    found: dict[str, _Def] = {}
    for node in body:
        if isinstance(node, _Def):
            found[node.name] = node
        elif isinstance(node, ast.If | ast.With | ast.AsyncWith):
            found.update(_definitions(node.body))
            found.update(_definitions(getattr(node, "orelse", [])))
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                found.update(_definitions(block))
    return found


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


def find(tree: Path, hook: Hook) -> tuple[_Def | None, str]:
    """Locate a hook's definition; on failure return None and a reason that names what is missing."""
    path = module_file(tree, hook.module)
    if path is None:
        return None, f"module {hook.module} not found (no {hook.module.replace('.', '/')}.py in the tree)"
    try:
        module = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError) as err:
        return None, f"cannot parse {path.relative_to(tree).as_posix()}: {err}"
    scope: list[ast.stmt] = module.body
    node: _Def | None = None
    walked: list[str] = []
    for part in hook.qualname.split("."):
        node = _definitions(scope).get(part)
        if node is None:
            owner = ".".join(walked) or f"module {hook.module}"
            return None, f"{owner} has no definition named {part!r} ({path.relative_to(tree).as_posix()})"
        walked.append(part)
        scope = node.body
    return node, ""


def check_hook(tree: Path, hook: Hook) -> list[str]:
    """Findings for one hook point (empty when it matches)."""
    node, reason = find(tree, hook)
    if node is None:
        return [f"{hook.target}: not found: {reason}"]
    is_class = isinstance(node, ast.ClassDef)
    kind = "class" if is_class else "function"
    findings: list[str] = []
    if hook.kind is not None and hook.kind != kind:
        findings.append(f"{hook.target}: expected a {hook.kind}, found a {kind} (line {node.lineno})")
    if is_class:
        if hook.params is not None or hook.requires:
            findings.append(f"{hook.target}: is a class; declare params on its methods instead")
        return findings
    found = signature(node)
    if hook.params is not None and tuple(found) != hook.params:
        findings.append(
            f"{hook.target}: parameters changed: expected ({', '.join(hook.params)}), "
            f"found ({', '.join(found)}) at line {node.lineno}"
        )
    missing = [p for p in hook.requires if p not in found]
    if missing:
        findings.append(
            f"{hook.target}: missing parameter(s) {', '.join(missing)}; found ({', '.join(found)}) "
            f"at line {node.lineno}"
        )
    return findings


def check_hooks(tree: Path, hooks_file: Path) -> list[str]:
    """Every finding for the hooks declared in hooks_file against an unpacked tree; empty means all match."""
    findings: list[str] = []
    for hook in load_hooks(hooks_file):
        findings += check_hook(tree, hook)
    return findings


def default_tree(engine: str) -> Path:
    """The pristine pinned upstream tree (unpacked on first use)."""
    from gpdist import pins
    from gpdist.unpack import upstream_tree

    return upstream_tree(pins.load().engine(engine))


def default_hooks_file(engine: str) -> Path:
    from gpdist import pins

    return pins.load().engine(engine).patches_dir / HOOKS_FILE


def run(engine: str, tree: Path | None = None, hooks_file: Path | None = None) -> Report:
    """Check one engine; tree defaults to the pristine pinned upstream, hooks_file to patches/<engine>/."""
    tree = tree if tree is not None else default_tree(engine)
    hooks_file = hooks_file if hooks_file is not None else default_hooks_file(engine)
    report = Report(engine=engine, tree=tree)
    report.checked = len(load_hooks(hooks_file))
    report.findings = check_hooks(tree, hooks_file)
    return report


def _cmd_hooks(args: argparse.Namespace) -> int:
    from gptools.series import engines_arg

    engines = engines_arg(args.engine)
    if (args.tree or args.hooks_file) and len(engines) > 1:
        print("gptools hooks: --tree/--hooks-file need a single --engine", file=sys.stderr)
        return 2
    reports: list[Report] = []
    for engine in engines:
        try:
            reports.append(
                run(engine, Path(args.tree) if args.tree else None, Path(args.hooks_file) if args.hooks_file else None)
            )
        except HooksFileError as err:
            print(f"gptools hooks: {err}", file=sys.stderr)
            return 2
    if args.json:
        print(
            json.dumps(
                [
                    {"engine": r.engine, "tree": str(r.tree), "checked": r.checked, "findings": r.findings}
                    for r in reports
                ],
                indent=2,
            )
        )
    else:
        for r in reports:
            if r.findings:
                print(f"{r.engine}: {len(r.findings)} of {r.checked} hook points changed in {r.tree}")
                for line in r.findings:
                    print(f"  {line}")
            else:
                print(f"{r.engine}: all {r.checked} hook points match ({r.tree})")
    return 1 if any(r.findings for r in reports) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `hooks` subcommand to `python -m gptools`."""
    p = subparsers.add_parser(
        "hooks",
        help="check that hooked upstream functions still exist with the expected parameters",
        description="Read patches/<engine>/hooks.toml and check each declared function/class against an unpacked "
        "tree by AST (nothing is imported). Default tree: the pristine pinned upstream. Exit 1 on a finding.",
    )
    from gpdist.pins import engine_names

    p.add_argument("--engine", default="all", choices=(*engine_names(), "all"), help="engine name or `all` (default)")
    p.add_argument("--tree", help="unpacked tree to check instead of the pristine pinned upstream")
    p.add_argument("--hooks-file", help="hooks declaration to use instead of patches/<engine>/hooks.toml")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_hooks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptools.hooks")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["hooks", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
