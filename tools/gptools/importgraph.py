"""The import graph of the project's own Python: which module imports which, and the loops in it.

`make check` refuses an import loop anywhere in the product (the runtime and the engine glue) or the tools, type-only
imports (`if TYPE_CHECKING:`) and imports inside functions included: a loop means two modules that cannot be read,
tested or moved apart. It refuses a loop between packages too (`graphpersist.archive` importing from
`graphpersist.memory` while memory imports from the archive, through any of their modules): the runtime's packages
form a line, each importing only the ones below it, so each can be read knowing only what lies under it. It also
holds each engine's glue to the engine interface: the glue may import the runtime only through `graphpersist.engine`
(plus the package itself, to name it), and recipes and tools to the runtime's facade, `graphpersist.api`, except the
diagnosis listed in facade_allow.toml. AST only: nothing is imported.

    python -m gptools imports [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gptools import lintcli

REPO = Path(__file__).resolve().parents[2]
# Each root: (folder whose children are top-level packages, glob of the module files under it).
ROOTS = (
    ("overlays/graphpersist", "graphpersist/**/*.py"),
    ("overlays/vllm", "vllm/graphpersist_*.py"),
    ("overlays/sglang", "sglang/srt/graphpersist_*.py"),
    ("overlays/deep_ep", "deep_ep/graphpersist_*.py"),
    ("tools", "gptools/**/*.py"),
    ("tools", "gpdiag/**/*.py"),
    ("build", "gpdist/**/*.py"),
)
GLUE_PREFIXES = ("vllm.graphpersist_", "sglang.srt.graphpersist_", "deep_ep.graphpersist_")
GLUE_MAY_IMPORT = ("graphpersist", "graphpersist.engine")  # the runtime, as engine glue may see it
CLIENTS = ("recipes", "tools")  # folders whose Python uses the runtime as its users do
FACADE = ("graphpersist", "graphpersist.api")  # the runtime, as recipes and tools may see it
FACADE_ALLOW = Path(__file__).with_name("facade_allow.toml")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module of the project by dotted name (as it is imported once installed)."""
    found: dict[str, Path] = {}
    for root, pattern in ROOTS:
        for path in sorted((repo / root).glob(pattern)):
            found[module_name(repo / root, path)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, list[str]]]:
    """(module imported, names taken from it) for one import statement; relative imports resolved."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, []
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        yield base, [a.name for a in node.names]


def edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import of one project module by another: `from pkg import mod` counts as importing pkg.mod."""
    found: list[Edge] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target, names in _imported(node, name, path.name == "__init__.py"):
                hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                if not hits and target in modules:
                    hits = [target]
                found += [Edge(name, hit, node.lineno) for hit in hits if hit != name]
    return found


def cycles(modules: Iterable[str], graph: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {m: set() for m in modules}
    for e in graph:
        succ.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(succ):
            if v not in index:
                visit(v)
    finally:  # the caller's limit back (a test process kept 10000: later tests parsed 5000-deep JSON in full)
        sys.setrecursionlimit(limit)
    return sorted(out)


def package_of(module: str) -> str:
    """The package a module counts for in the package graph: its subpackage under the top-level package
    (graphpersist.memory for graphpersist.memory.region and for graphpersist.memory itself); a module at the top of
    its package (graphpersist.save, gptools.prove) counts as a package of its own."""
    return ".".join(module.split(".")[:2])


def package_loops(modules: Iterable[str], graph: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """The loops between packages (package_of): each as its packages, sorted, and the imports that cross between
    them, so the message can name the modules to move."""
    between = [e for e in graph if package_of(e.source) != package_of(e.target)]
    packages = {package_of(m) for m in modules}
    lifted = [Edge(package_of(e.source), package_of(e.target), e.line) for e in between]
    out = []
    for loop in cycles(packages, lifted):
        members = set(loop)
        crossing = [e for e in between if package_of(e.source) in members and package_of(e.target) in members]
        out.append((loop, sorted(crossing, key=lambda e: (e.source, e.line, e.target))))
    return out


def glue_violations(modules: dict[str, Path], graph: list[Edge]) -> list[str]:
    """Engine glue importing a runtime module other than the engine interface, as `path:line: message`."""
    bad = []
    for e in graph:
        runtime = e.target.startswith("graphpersist") and e.target not in GLUE_MAY_IMPORT
        if e.source.startswith(GLUE_PREFIXES) and runtime:
            path = modules[e.source]
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            bad.append(f"{where}:{e.line}: engine glue imports {e.target}; use graphpersist.engine")
    return bad


@dataclass(frozen=True)
class Allowance:
    """One reviewed exception to the facade rule: a file or folder (`path`, a folder ends in /) and the runtime
    modules it may import."""

    path: str
    modules: tuple[str, ...]
    why: str

    def covers(self, rel: str) -> bool:
        return rel.startswith(self.path) if self.path.endswith("/") else rel == self.path


def load_allowances(path: Path = FACADE_ALLOW) -> list[Allowance]:
    rows = tomllib.loads(path.read_text()).get("allow", [])
    return [Allowance(row["path"], tuple(row["modules"]), row["why"]) for row in rows]


@dataclass(frozen=True)
class ClientImport:
    """A recipe's or tool's import of a runtime module: the file (relative to the repository), the line, the module."""

    path: str
    line: int
    target: str


def client_imports(repo: Path, runtime: Iterable[str]) -> list[ClientImport]:
    """Every import of the runtime (graphpersist and its modules, as `edges` resolves them) in recipes/ and tools/."""
    known = set(runtime)
    found = []
    for folder in CLIENTS:
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if getattr(node, "level", 0):
                    continue  # relative: within the client's own package
                for target, names in _imported(node, "", False):
                    if target != "graphpersist" and not target.startswith("graphpersist."):
                        continue
                    hits = {f"{target}.{n}" if f"{target}.{n}" in known else target for n in names or [""]}
                    found += [ClientImport(rel, node.lineno, hit) for hit in sorted(hits)]
    return found


def facade_violations(imports: list[ClientImport], allowances: list[Allowance]) -> list[str]:
    """Recipes and tools importing a runtime module other than the facade and their allowances, and allowances that
    no import uses any more (stale), as `path:line: message`."""
    bad, used = [], set()
    for imp in imports:
        if imp.target in FACADE:
            continue
        allowed = [a for a in allowances if a.covers(imp.path) and imp.target in a.modules]
        used |= {(a.path, imp.target) for a in allowed}
        if not allowed:
            bad.append(f"{imp.path}:{imp.line}: imports {imp.target}; recipes and tools use graphpersist.api")
    for a in allowances:
        bad += [
            f"tools/gptools/{FACADE_ALLOW.name}: {a.path} may import {m}, which nothing there imports any more"
            for m in a.modules
            if (a.path, m) not in used
        ]
    return bad


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `imports` subcommand to `python -m gptools`."""
    lintcli.register_lint(
        subparsers,
        "imports",
        "refuse import loops (of modules and of packages) in the product and tools, engine glue that bypasses "
        "graphpersist.engine, and recipes and tools that bypass graphpersist.api",
        __doc__,
        run,
    )


def run(args: argparse.Namespace) -> int:
    modules = project_modules()
    graph = edges(modules)
    loops = cycles(modules, graph)
    by_package = package_loops(modules, graph)
    glue = glue_violations(modules, graph)
    runtime = [m for m in modules if m == "graphpersist" or m.startswith("graphpersist.")]
    facade = facade_violations(client_imports(REPO, runtime), load_allowances())
    failed = bool(loops or by_package or glue or facade)
    if args.json:
        crossing = [
            {"packages": packages, "imports": [f"{e.source}:{e.line} -> {e.target}" for e in edges]}
            for packages, edges in by_package
        ]
        print(json.dumps({"modules": len(modules), "imports": len(graph), "loops": loops, "package_loops": crossing,
                          "glue": glue, "facade": facade}, indent=1))  # fmt: skip
        return 1 if failed else 0
    print(f"imports: {len(modules)} modules, {len(graph)} imports between them")
    for loop in loops:
        print(f"imports: loop: {' <-> '.join(loop)}")
    for packages, crossing in by_package:
        listed = "; ".join(f"{e.source}:{e.line} imports {e.target}" for e in crossing[:12])
        more = f"; … ({len(crossing)} in all)" if len(crossing) > 12 else ""
        print(f"imports: package loop: {' <-> '.join(packages)} ({listed}{more})")
    for line in glue + facade:
        print(f"imports: {line}")
    if failed:
        print("imports: break each loop (move what both need into a module of its own, below both), import the "
              "runtime from engine glue only through graphpersist.engine and from recipes and tools only through "
              f"graphpersist.api (diagnosis: tools/gptools/{FACADE_ALLOW.name})")  # fmt: skip
    else:
        print("imports: no loops of modules or packages; engine glue uses only graphpersist.engine, recipes and "
              "tools only graphpersist.api")  # fmt: skip
    return 1 if failed else 0
