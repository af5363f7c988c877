"""The function-length lint: no product function runs past LIMIT lines.

A function longer than a screen holds steps that have names of their own; named, they can be read, tested and
changed one at a time. `make check` fails on any function of the product (overlays/: the runtime, the engines' glue,
the interposer's C) longer than LIMIT lines, counted from its first line (`def`, or a C function's signature) to its
last, docstring, comments and blank lines included. AST for Python; for C, the top-level brace blocks whose header
is a signature, comments and strings set aside.

    python -m gptools funclen [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from gptools import lintcli

REPO = Path(__file__).resolve().parents[2]
PRODUCT = "overlays"
LIMIT = 80


@dataclass(frozen=True)
class Function:
    path: str  # relative to the repository
    line: int
    name: str  # Class.method for methods
    lines: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name}: {self.lines} lines"


def python_functions(path: str, source: str) -> Iterator[Function]:
    """Every function and method of a Python module (nested ones too), with its length."""

    def walk(node: ast.AST, prefix: str) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield Function(path, child.lineno, name, child.end_lineno - child.lineno + 1)
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source, filename=path), "")


_C_TOKENS = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_C_IDENT = re.compile(r"[A-Za-z_]\w*")


def _c_code(source: str) -> str:
    """`source` with comments, string and character literals and preprocessor lines blanked (newlines kept), so that
    only the code's own braces and parentheses are left."""
    code = _C_TOKENS.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), source)
    lines, continued = code.split("\n"), False
    for i, line in enumerate(lines):
        if continued or line.lstrip().startswith("#"):
            continued = line.rstrip().endswith("\\")
            lines[i] = ""
    return "\n".join(lines)


def c_functions(path: str, source: str) -> Iterator[Function]:
    """Every function defined at the top level of a C file: a `{` at depth 0 whose header ends in `)` (an
    initializer's header holds `=`), from its signature's first line (the first after a blank line, `;` or `}`) to
    its closing `}`."""
    code = _c_code(source)
    lines = code.split("\n")
    depth, start = 0, None
    for i, line in enumerate(lines):
        for ch in line:
            if ch == "{":
                if depth == 0:
                    start = _signature_start(lines, i)
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0 and start is not None:
                    header = " ".join(lines[start : i + 1]).split("{", 1)[0]
                    names = _C_IDENT.findall(header.split("(", 1)[0])
                    if header.rstrip().endswith(")") and "=" not in header and names:
                        yield Function(path, start + 1, names[-1], i - start + 1)  # the name before the parameters
                    start = None


def _signature_start(lines: list[str], i: int) -> int:
    """The first line of the header that ends on line `i`: back to the line after a blank one or one ending a
    statement or block."""
    while i > 0 and lines[i - 1].strip() and not lines[i - 1].rstrip().endswith((";", "}", "{")):
        i -= 1
    return i


def product_functions(repo: Path = REPO) -> list[Function]:
    """Every function of the product, Python and C, in path order."""
    found: list[Function] = []
    for path in sorted((repo / PRODUCT).rglob("*")):
        rel = path.relative_to(repo).as_posix()
        if path.suffix == ".py":
            found += python_functions(rel, path.read_text())
        elif path.suffix in (".c", ".h"):
            found += c_functions(rel, path.read_text())
    return found


def too_long(functions: list[Function], limit: int = LIMIT) -> list[Function]:
    return [f for f in functions if f.lines > limit]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `funclen` subcommand to `python -m gptools`."""
    lintcli.register_lint(
        subparsers,
        "funclen",
        f"refuse product functions (Python and the interposer's C) longer than {LIMIT} lines",
        __doc__,
        run,
    )


def run(args: argparse.Namespace) -> int:
    functions = product_functions()
    long = too_long(functions)
    if args.json:
        print(
            json.dumps({"functions": len(functions), "limit": LIMIT, "too_long": [asdict(f) for f in long]}, indent=1)
        )
        return 1 if long else 0
    longest = max(functions, key=lambda f: f.lines)
    print(f"funclen: {len(functions)} product functions, the longest {longest} (limit {LIMIT})")
    for f in long:
        print(f"funclen: {f}, more than {LIMIT}: split it into the steps it takes")
    return 1 if long else 0
