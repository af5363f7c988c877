"""The name-resolution lint: the product resolves names at run time only in reviewed places.

An archive is data, never code (overlays/graphpersist/README.md, "What an archive may contain"): no string read
from an archive may reach an import, a getattr on a module, eval, unpickling or any other lookup of code by name;
what an engine rebuilds by name comes from its registry by id. This lint reads every Python file under overlays/
(by AST: nothing is imported) and finds each construct that resolves a name at run time:

* **import by name**: importlib.import_module, __import__, importlib.reload, importlib.util's spec and module
  makers, runpy.run_module/run_path, pkgutil.resolve_name, zipimport;
* **eval**: eval, exec, compile;
* **unpickling**: pickle (cPickle, _pickle, dill, cloudpickle) load/loads/Unpickler, marshal load/loads, shelve.open,
  torch.load, yaml.load/unsafe_load/full_load;
* **sys.modules lookup** by a key that is not a string literal (`sys.modules[k]`, `.get(k)`, `.pop(k)`,
  `.setdefault(k)`);
* **getattr on a module** by a name that is not a string literal (getattr, hasattr, `vars(m)[k]`, `m.__dict__[k]`):
  a module is a name an import binds, an attribute of one (`torch.ops`, `torch.ops.sglang`), what sys.modules or an
  import call gives, and what a getattr on any of these returns, followed through assignments within a function
  (so `obj = torch.ops; for part in parts: obj = getattr(obj, part)` is found);
* **attrgetter** (operator.attrgetter) of a name that is not a string literal.

A finding must be listed in `namelint_allow.toml` by file, function and construct, with the reason it never sees
archive data; an entry that matches nothing is stale and fails as well, so the list stays what was reviewed.
What it cannot see: a module object passed into a function as an argument, or kept in a container, then looked up
by a computed name (the taint does not cross calls or containers); reviewers still read new reflection.

    python -m gptools names [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from gptools import lintcli

REPO = Path(__file__).resolve().parents[2]
ALLOW_FILE = Path(__file__).with_name("namelint_allow.toml")
PRODUCT = "overlays"

IMPORTS = frozenset({
    "importlib.import_module", "importlib.__import__", "__import__", "builtins.__import__", "importlib.reload",
    "importlib.util.spec_from_file_location", "importlib.util.spec_from_loader", "importlib.util.module_from_spec",
    "runpy.run_module", "runpy.run_path", "pkgutil.resolve_name", "zipimport.zipimporter",
})  # fmt: skip
EVALS = frozenset({"eval", "exec", "compile", "builtins.eval", "builtins.exec", "builtins.compile"})
_PICKLERS = ("pickle", "cPickle", "_pickle", "dill", "cloudpickle")
UNPICKLES = frozenset(
    {f"{m}.{f}" for m in _PICKLERS for f in ("load", "loads", "Unpickler")}
    | {"marshal.load", "marshal.loads", "shelve.open", "torch.load", "yaml.load", "yaml.unsafe_load", "yaml.full_load"}
)
SYS_MODULES_LOOKUPS = ("sys.modules.get", "sys.modules.pop", "sys.modules.setdefault")
KINDS = ("import by name", "eval", "unpickling", "sys.modules lookup", "getattr on a module", "attrgetter")


@dataclass(frozen=True)
class Finding:
    path: str  # relative to the repository
    line: int
    function: str  # qualified within the file (Class.method, outer.inner); <module> at the top
    construct: str  # one of KINDS
    code: str  # the expression, shortened

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.construct} in {self.function}: {self.code}"


@dataclass(frozen=True)
class Allowed:
    file: str
    function: str
    construct: str
    reason: str

    def matches(self, finding: Finding) -> bool:
        return (self.file, self.function, self.construct) == (finding.path, finding.function, finding.construct)


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """`node` and what it holds, without functions, lambdas and classes (scopes of their own)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _own_nodes(child)


def _literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


class _Scanner(ast.NodeVisitor):
    """One file: the names its imports bind (aliases), then each function's module-like names and findings."""

    def __init__(self, rel: str, tree: ast.Module) -> None:
        self.rel = rel
        self.aliases: dict[str, str] = {}  # bound name -> the dotted name it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.partition(".")[0]  # `import a.b` binds a; `import a.b as c` binds c to a.b
                    self.aliases[a.asname or top] = a.name if a.asname else top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        self.scope: list[str] = []
        self.modules: set[str] = set()
        self.found: list[Finding] = []

    # -- names --------------------------------------------------------------------------------------------------
    def dotted(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def is_module(self, node: ast.AST) -> bool:
        """Whether `node` may be a module object: see the module's docstring."""
        if isinstance(node, ast.Name):
            return node.id in self.aliases or node.id in self.modules
        if isinstance(node, ast.Attribute):
            return self.is_module(node.value)
        if isinstance(node, ast.Subscript):
            return self.dotted(node.value) == "sys.modules"
        if isinstance(node, ast.Call):
            name = self.dotted(node.func)
            if name in IMPORTS or name in SYS_MODULES_LOOKUPS:
                return True
            return name == "getattr" and bool(node.args) and self.is_module(node.args[0])
        return False

    # -- scopes -------------------------------------------------------------------------------------------------
    def scope_body(self, body: list[ast.AST]) -> None:
        """A scope's statements: first the names bound to modules in it, then each construct."""
        for _ in range(2):  # twice: a loop may taint a name on a line above its use (obj = getattr(obj, part))
            for stmt in body:
                self._taint(stmt)
        for stmt in body:
            self.visit(stmt)

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> None:
        saved = self.modules
        self.scope.append(name)
        self.modules = set(saved)  # a function sees the module-like names of the scopes around it
        self.scope_body([*node.decorator_list, *node.args.defaults, *node.body])
        self.scope.pop()
        self.modules = saved

    def _taint(self, node: ast.AST) -> None:
        for sub in _own_nodes(node):
            if isinstance(sub, ast.Assign):
                targets, value = sub.targets, sub.value
            elif isinstance(sub, (ast.AnnAssign, ast.NamedExpr)):
                targets, value = [sub.target], sub.value
            else:
                continue
            if value is not None and self.is_module(value):
                self.modules |= {t.id for t in targets if isinstance(t, ast.Name)}

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    # -- findings -----------------------------------------------------------------------------------------------
    def _add(self, node: ast.AST, construct: str) -> None:
        code = ast.unparse(node)
        self.found.append(Finding(self.rel, node.lineno, ".".join(self.scope) or "<module>", construct,
                                  code if len(code) <= 100 else code[:99] + "…"))  # fmt: skip

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        args = node.args
        if name in IMPORTS:
            self._add(node, "import by name")
        elif name in EVALS:
            self._add(node, "eval")
        elif name in UNPICKLES:
            self._add(node, "unpickling")
        elif name in SYS_MODULES_LOOKUPS and args and not _literal(args[0]):
            self._add(node, "sys.modules lookup")
        elif name in ("getattr", "hasattr") and len(args) >= 2 and not _literal(args[1]) and self.is_module(args[0]):
            self._add(node, "getattr on a module")
        elif name == "operator.attrgetter" and not all(_literal(a) for a in args):
            self._add(node, "attrgetter")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if not _literal(node.slice):
            value = node.value
            if self.dotted(value) == "sys.modules":
                self._add(node, "sys.modules lookup")
            elif isinstance(value, ast.Call) and self.dotted(value.func) == "vars" and value.args:
                if self.is_module(value.args[0]):
                    self._add(node, "getattr on a module")
            elif isinstance(value, ast.Attribute) and value.attr == "__dict__" and self.is_module(value.value):
                self._add(node, "getattr on a module")
        self.generic_visit(node)


def scan_source(rel: str, source: str) -> list[Finding]:
    """The findings of one file's source (`rel` names it in them)."""
    tree = ast.parse(source, filename=rel)
    scanner = _Scanner(rel, tree)
    scanner.scope_body(tree.body)
    return sorted(scanner.found, key=lambda f: f.line)


def product_files(repo: Path = REPO) -> Iterator[Path]:
    yield from sorted((repo / PRODUCT).rglob("*.py"))


def scan(repo: Path = REPO, files: Iterable[Path] | None = None) -> list[Finding]:
    out: list[Finding] = []
    for path in files if files is not None else product_files(repo):
        out += scan_source(path.relative_to(repo).as_posix(), path.read_text())
    return out


def load_allow(path: Path = ALLOW_FILE) -> list[Allowed]:
    """namelint_allow.toml's entries; a ValueError naming an entry without its four keys or with another construct."""
    entries = []
    for i, row in enumerate(tomllib.loads(path.read_text()).get("allow", [])):
        if set(row) != {"file", "function", "construct", "reason"} or row["construct"] not in KINDS:
            raise ValueError(f"{path.name}: entry {i} must hold file, function, construct (one of {', '.join(KINDS)})"
                             " and reason")  # fmt: skip
        if not row["reason"].strip():
            raise ValueError(f"{path.name}: entry {i} ({row['file']} {row['function']}) gives no reason")
        entries.append(Allowed(**row))
    return entries


def verdict(findings: list[Finding], allowed: list[Allowed]) -> tuple[list[Finding], list[Allowed]]:
    """(findings no entry allows, entries that allow nothing)."""
    unlisted = [f for f in findings if not any(a.matches(f) for a in allowed)]
    stale = [a for a in allowed if not any(a.matches(f) for f in findings)]
    return unlisted, stale


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `names` subcommand to `python -m gptools`."""
    lintcli.register_lint(
        subparsers,
        "names",
        "refuse run-time name resolution (imports by name, eval, unpickling, module getattr) in the product "
        "outside the reviewed places of namelint_allow.toml",
        __doc__,
        run,
    )


def run(args: argparse.Namespace) -> int:
    findings = scan()
    try:
        allowed = load_allow()
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"names: {exc}")
        return 1
    unlisted, stale = verdict(findings, allowed)
    if args.json:
        print(json.dumps({"findings": [asdict(f) for f in findings], "unlisted": [asdict(f) for f in unlisted],
                          "stale": [asdict(a) for a in stale]}, indent=1))  # fmt: skip
        return 1 if unlisted or stale else 0
    listed = len(findings) - len(unlisted)
    print(f"names: {len(findings)} run-time name lookup(s) in {PRODUCT}/, {listed} of them in the {len(allowed)} "
          f"reviewed place(s) of {ALLOW_FILE.name}")  # fmt: skip
    for f in unlisted:
        print(f"names: {f}: not in tools/gptools/{ALLOW_FILE.name}")
    for a in stale:
        print(f"names: {ALLOW_FILE.name} allows {a.construct} in {a.file} {a.function}, which no longer has one: "
              "remove the entry")  # fmt: skip
    if unlisted:
        print("names: an archive is data, never code: look engine objects up in the engine's registry by id (see "
              f"overlays/graphpersist/README.md); a place that never sees archive data goes into {ALLOW_FILE.name} "
              "with its reason")  # fmt: skip
    return 1 if unlisted or stale else 0
