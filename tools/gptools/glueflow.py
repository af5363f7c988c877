"""How the glue lint (`gptools.gluelint`) follows the glue's values: where each came from, by AST, importing nothing.

A flow-insensitive pass over every scope of the glue (modules, classes, functions, lambdas) is repeated until
nothing changes: variables, parameters (from the calls the glue makes, the patches' calls, overrides and
annotations), return values, the fields of the glue's own classes and what the glue stores into upstream objects
each get an `Origin`. Origins only grow (a join), so the passes end; a last pass reports each upstream name the glue
touches that the contract does not declare. The rule it applies is in gluelint's docstring.
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass, field
from pathlib import Path

from gptools.contract import Contract
from gptools.treeast import absolute_module, own_attributes

_PASSTHROUGH = {"list", "tuple", "set", "frozenset", "sorted", "reversed", "iter", "next", "dict", "enumerate", "zip",
                "min", "max", "filter", "vars"}  # fmt: skip
_MUTATORS = {"append", "add", "extend", "insert", "update", "setdefault", "appendleft"}
_REFLECT = {"getattr", "setattr", "hasattr", "delattr"}
_PROPERTIES = {"property", "cached_property", "functools.cached_property"}


@dataclass(frozen=True)
class Allow:
    """What gluelint_allow.toml lets the glue read that is not upstream's."""

    generic: frozenset[str]  # public attributes of builtin and listed standard-library types
    library: frozenset[str]  # names listed for libraries (may be private)
    reflective: frozenset[str]  # glue functions ("path:qualname") that walk objects generically


# ----------------------------------------------------------------------------------------------------- origins


@dataclass(frozen=True)
class Origin:
    """Where a value came from (see the module docstring)."""

    kind: str  # bottom, local, builtin, gmod, gfunc, gclass, ginst, exact, upstream, unknown
    ref: str = ""  # exact: the declared target; glue kinds: the module, function or class key; builtin: its name
    what: str = ""  # exact: module, class, function; gfunc: "bound" for a method reached through an instance


BOTTOM, LOCAL, UNKNOWN, UPSTREAM = Origin("bottom"), Origin("local"), Origin("unknown"), Origin("upstream")
_UP = {"exact", "upstream"}
_OURS = {"local", "builtin", "gmod", "gfunc", "gclass", "ginst"}


def join(a: Origin, b: Origin) -> Origin:
    if a == b or b.kind == "bottom":
        return a
    if a.kind == "bottom":
        return b
    if a.kind in _UP and b.kind in _UP:
        return UPSTREAM
    if a.kind in _OURS and b.kind in _OURS:
        return LOCAL
    return UNKNOWN


def item(o: Origin) -> Origin:
    """An item or element of a value: of upstream's, upstream; of a container of glue instances, one of them; of
    other values of ours, unknown (our containers hold anything)."""
    if o.kind in _UP:
        return UPSTREAM
    if o.kind in ("bottom", "ginst"):
        return o
    return UNKNOWN


def _private(name: str) -> bool:
    return name.startswith("_") and not _dunder(name)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


# ---------------------------------------------------------------------------------------------------- findings


@dataclass(frozen=True)
class Use:
    """A declared name the glue touches: `kind` "exact" ("module:Qual" or "module:name", the declaration it is),
    "name" (an attribute read by name on an upstream value whose class the lint does not know: any declaration of
    that name) or "module" (an imported upstream module)."""

    kind: str
    name: str


@dataclass(frozen=True, order=True)
class Site:
    """A line of the glue."""

    path: str  # as the repository names it
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Undeclared:
    """One upstream name the glue touches that hooks.toml does not declare."""

    path: str
    line: int
    name: str
    how: str  # how the glue touches it
    hooks_file: str
    owners: list[str] = field(default_factory=list)  # the upstream classes it was read on, when the lint knows them
    candidates: list[str] = field(default_factory=list)  # upstream classes that define it (--undeclared)

    def text(self) -> str:
        return f"{self.path}:{self.line}: {self.name} is not declared in {self.hooks_file} ({self.how})"


def show(path: Path) -> str:
    """A path as the repository names it (relative to its root), else as given."""
    from gpdist import REPO_ROOT

    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------------------- glue model


@dataclass
class GModule:
    name: str  # dotted (vllm.graphpersist_worker)
    rel: str  # path inside the overlay folder (vllm/graphpersist_worker.py)
    path: Path
    tree: ast.Module
    package: str


@dataclass
class Scope:
    key: str  # "rel:qualname"; a module's is "rel:", a class body's "rel:Qual.<class>"
    node: ast.AST
    module: GModule
    parent: Scope | None
    params: list[str] = field(default_factory=list)  # positional, in order
    kwonly: list[str] = field(default_factory=list)
    vararg: str | None = None
    kwarg: str | None = None
    names: set[str] = field(default_factory=set)  # bound here
    globals: set[str] = field(default_factory=set)
    cls: GClass | None = None  # the class of a method or class body
    first: str = ""  # a method's first parameter: "self" (instance) or "cls" (classmethod)
    prop: bool = False  # a property: reading it on an instance gives what it returns
    entry: bool = False  # a patch calls it: its arguments are upstream's


@dataclass
class GClass:
    key: str
    node: ast.ClassDef
    module: GModule
    defined: set[str]
    methods: dict[str, Scope] = field(default_factory=dict)
    upstream_bases: list[str] = field(default_factory=list)
    glue_bases: list[str] = field(default_factory=list)
    local_bases: bool = False


def _bound_names(body: list[ast.stmt]) -> tuple[set[str], set[str]]:
    """(names a function or module body binds, names it declares global), not looking into nested scopes; names
    declared nonlocal are bound by an enclosing function, not here."""
    bound: set[str] = set()
    declared_global: set[str] = set()
    declared_nonlocal: set[str] = set()
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
            stack += node.decorator_list
            if not isinstance(node, ast.ClassDef):
                stack += [d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None]
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Global):
            declared_global.update(node.names)
        elif isinstance(node, ast.Nonlocal):
            declared_nonlocal.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            bound.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name != "*":
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        stack += list(ast.iter_child_nodes(node))
    return bound - declared_global - declared_nonlocal, declared_global


def _field_name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _expression_lambdas(node: ast.AST) -> list[ast.Lambda]:
    """The lambdas in a statement's own expressions (not in the statements it contains: those are walked apart)."""
    found: list[ast.Lambda] = []
    stack = [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt)]
    while stack:
        child = stack.pop()
        if isinstance(child, ast.Lambda):
            found.append(child)
        stack += [c for c in ast.iter_child_nodes(child) if not isinstance(c, ast.stmt)]
    return found


def entry_points(patches_dir: Path, module_names: set[str]) -> set[tuple[str, str]]:
    """(glue module, function) pairs that the series' added lines call or import: their arguments are upstream's."""
    by_base: dict[str, list[str]] = {}
    for name in module_names:
        by_base.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    found: set[tuple[str, str]] = set()
    for patch in sorted(patches_dir.glob("*.patch")):
        for line in patch.read_text(errors="replace").splitlines():
            if not line.startswith("+") or line.startswith("+++"):
                continue
            for base, func in re.findall(r"\b(\w+)\.(\w+)\s*\(", line):
                found.update((m, func) for m in by_base.get(base, []))
            imported = re.search(r"from\s+([\w.]+)\s+import\s+\(?([\w\s,]+)", line)
            if imported:
                base = imported.group(1).rsplit(".", 1)[-1]
                for part in imported.group(2).split(","):
                    name = part.split(" as ")[0].strip()
                    if name:
                        found.update((m, name) for m in by_base.get(base, []))
    return found


_PATCH_FIELD = re.compile(r"^\+(?: {4}| {8})(\w+)\s*:\s*[^=]+=")  # a class-level annotated field
_PATCH_SELF = re.compile(r"\bself\.(\w+)\s*(?::[^=]+)?=(?!=)")


def patch_names(patches_dir: Path) -> set[str]:
    """Attributes the series itself adds to upstream classes (`+    graph_persist: str | None = None`, `self.x =`):
    ours, although they live on upstream objects, and absent from the pristine tree hooks.toml is checked against."""
    names: set[str] = set()
    for patch in sorted(patches_dir.glob("*.patch")):
        for line in patch.read_text(errors="replace").splitlines():
            if line.startswith("+") and not line.startswith("+++"):
                names.update(_PATCH_FIELD.findall(line))
                names.update(_PATCH_SELF.findall(line))
    return names


def ours_names(*roots: Path) -> set[str]:
    """Every attribute a class in our own code defines (runtime and glue): methods, class variables, fields,
    `self.<name>` assignments."""
    names: set[str] = set()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    names |= own_attributes(node)
    return names


# --------------------------------------------------------------------------------------------------- analysis


class Analysis:
    """Origins of the glue's values, found by repeating a flow-insensitive pass over every scope until nothing
    changes; a last pass reports the undeclared names."""

    def __init__(self, engine: str, contract: Contract, glue: Path, allow: Allow, ours: set[str],
                 entries: set[tuple[str, str]], patched: frozenset[str] = frozenset(),
                 root: Path | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.root = root if root is not None else glue  # module names are paths under it
        self.entries = entries
        self.patched = set(patched)
        self.contract = contract
        self.glue = glue
        self.allow = allow
        self.ours = ours
        self.hooks_file = show(contract.path)
        self.modules: dict[str, GModule] = {}
        self.scopes: dict[str, Scope] = {}
        self.classes: dict[str, GClass] = {}
        self.env: dict[str, dict[str, Origin]] = {}
        self.args: dict[str, dict[str, Origin]] = {}
        self.returns: dict[str, Origin] = {}
        self.stored: dict[str, Origin] = {}  # attribute name -> what the glue stores into upstream objects under it
        self.changed = False
        self.emit = False
        self.found: dict[tuple[str, int, str], Undeclared] = {}
        self.touched: set[str] = set()
        self.uses: dict[Use, set[Site]] = {}  # each declared name touched, with the lines that touch it
        self.computed_sites: set[str] = set()  # the computed_in sites that make a computed getattr on upstream's
        self.imported_modules: set[str] = set()
        self._load()
        tops = {m.split(".")[0] for m in self.modules}
        tops |= {m.split(".")[0] for m in contract.modules}
        self.upstream_tops = tops

    # ------------------------------------------------------------------------------------------------ build

    def _load(self) -> None:
        for path in sorted(self.glue.rglob("*.py")):
            rel = path.relative_to(self.root).as_posix()
            parts = rel[:-3].split("/")
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            name = ".".join(parts)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            package = name if is_pkg else name.rpartition(".")[0]
            self.modules[name] = GModule(name, rel, path, tree, package)
        for module in self.modules.values():
            scope = Scope(f"{module.rel}:", module.tree, module, None)
            scope.names, _ = _bound_names(module.tree.body)
            self._add(scope)
            self._walk(module, module.tree.body, scope, "")

    def _add(self, scope: Scope) -> None:
        self.scopes[scope.key] = scope
        self.env[scope.key] = {}

    def _walk(
        self, module: GModule, body: list[ast.stmt], parent: Scope, prefix: str, cls: GClass | None = None
    ) -> None:
        """Scopes for the functions, lambdas and classes under a body."""
        for node in body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                for sub in _expression_lambdas(node):
                    self._lambda(module, sub, parent, prefix)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self._function(module, node, parent, prefix, cls)
            elif isinstance(node, ast.ClassDef):
                self._class(module, node, parent, prefix)
            elif isinstance(node, ast.If | ast.With | ast.AsyncWith | ast.Try | ast.For | ast.AsyncFor | ast.While
                                  | ast.Match):  # fmt: skip
                blocks = [getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", [])]
                blocks += [h.body for h in getattr(node, "handlers", [])] + [c.body for c in getattr(node, "cases", [])]
                for block in blocks:
                    self._walk(module, block, parent, prefix, cls)

    def _lambda(self, module: GModule, node: ast.Lambda, parent: Scope, prefix: str) -> None:
        key = f"{module.rel}:{prefix}<lambda@{node.lineno}:{node.col_offset}>"
        scope = Scope(key, node, module, parent)
        a = node.args
        scope.params = [p.arg for p in (*a.posonlyargs, *a.args)]
        scope.kwonly = [p.arg for p in a.kwonlyargs]
        scope.vararg = a.vararg.arg if a.vararg else None
        scope.kwarg = a.kwarg.arg if a.kwarg else None
        scope.names = {*scope.params, *scope.kwonly, *(n for n in (scope.vararg, scope.kwarg) if n)}
        scope.names |= {n.id for n in ast.walk(node.body) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        self._add(scope)

    def _function(self, module: GModule, node: ast.FunctionDef | ast.AsyncFunctionDef, parent: Scope, prefix: str,
                  cls: GClass | None) -> None:  # fmt: skip
        qual = f"{prefix}{node.name}"
        scope = Scope(f"{module.rel}:{qual}", node, module, parent, cls=cls)
        a = node.args
        scope.params = [p.arg for p in (*a.posonlyargs, *a.args)]
        scope.kwonly = [p.arg for p in a.kwonlyargs]
        scope.vararg = a.vararg.arg if a.vararg else None
        scope.kwarg = a.kwarg.arg if a.kwarg else None
        bound, declared_global = _bound_names(node.body)
        scope.names = bound | {*scope.params, *scope.kwonly, *(n for n in (scope.vararg, scope.kwarg) if n)}
        scope.globals = declared_global
        decorators = {ast.unparse(d) for d in node.decorator_list}
        if cls is not None and scope.params and "staticmethod" not in decorators:
            scope.first = "cls" if "classmethod" in decorators else "self"
            scope.prop = bool(decorators & _PROPERTIES)
            cls.methods[node.name] = scope
        scope.entry = parent.parent is None and cls is None and (module.name, node.name) in self.entries
        self._add(scope)
        for d in (*node.decorator_list, *a.defaults, *(d for d in a.kw_defaults if d is not None)):
            for sub in ast.walk(d):
                if isinstance(sub, ast.Lambda):
                    self._lambda(module, sub, parent, prefix)
        self._walk(module, node.body, scope, f"{qual}.")

    def _class(self, module: GModule, node: ast.ClassDef, parent: Scope, prefix: str) -> None:
        qual = f"{prefix}{node.name}"
        cls = GClass(f"{module.rel}:{qual}", node, module, own_attributes(node))
        self.classes[cls.key] = cls
        body = Scope(f"{module.rel}:{qual}.<class>", node, module, parent, cls=cls)
        body.names, _ = _bound_names(node.body)
        self._add(body)
        self._walk(module, node.body, parent, f"{qual}.", cls)

    # --------------------------------------------------------------------------------------------- running

    def _settle(self) -> None:
        for _ in range(30):
            self.changed = False
            for scope in list(self.scopes.values()):
                self._run_scope(scope)
            if not self.changed:
                return

    def run(self) -> None:
        self._settle()
        # A function no glue code calls is called from outside the glue: by a patch, an upstream callback or a
        # driver's RPC, with upstream's arguments; or, for a method of a glue class built on one of ours (an adapter
        # our runtime calls), with anything: unknown.
        for scope in self.scopes.values():
            if not isinstance(scope.node, ast.Module | ast.ClassDef) and scope.key not in self.args:
                outside = UNKNOWN if scope.cls is not None and scope.cls.local_bases else UPSTREAM
                for name in [*scope.params, *scope.kwonly, *(n for n in (scope.vararg, scope.kwarg) if n)]:
                    self.args.setdefault(scope.key, {})[name] = outside
        self._settle()
        self.emit = True
        for scope in list(self.scopes.values()):
            self._run_scope(scope)

    def _run_scope(self, scope: Scope) -> None:
        node = scope.node
        if isinstance(node, ast.Module):
            self._block(scope, node.body)
        elif isinstance(node, ast.ClassDef):
            self._class_body(scope, node)
        elif isinstance(node, ast.Lambda):
            self._params(scope)
            self._return(scope, self.ev(scope, node.body))
        else:
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            self._params(scope)
            self._block(scope, node.body)

    def _class_body(self, scope: Scope, node: ast.ClassDef) -> None:
        cls = scope.cls
        assert cls is not None
        for base in node.bases:
            o = self.ev(scope.parent or scope, base)
            text = ast.unparse(base)
            if o.kind == "exact" and o.what == "class":
                if o.ref not in cls.upstream_bases:
                    cls.upstream_bases.append(o.ref)
            elif o.kind == "gclass":
                if o.ref not in cls.glue_bases:
                    cls.glue_bases.append(o.ref)
            elif o.kind in ("local", "builtin") and text not in ("object", "Generic", "Protocol"):
                cls.local_bases = not text.startswith(("Generic[", "Protocol["))
        for ref in cls.glue_bases:
            base = self.classes[ref]
            cls.defined |= base.defined
            for name, method in base.methods.items():
                cls.methods.setdefault(name, method)
            cls.upstream_bases += [b for b in base.upstream_bases if b not in cls.upstream_bases]
            cls.local_bases |= base.local_bases
        for kw in node.keywords:
            self.ev(scope.parent or scope, kw.value)
        self._block(scope, node.body)

    def _params(self, scope: Scope) -> None:
        self._current = scope
        given = self.args.get(scope.key, {})
        overridden = self._overridden(scope)
        names = [*scope.params, *scope.kwonly, *(n for n in (scope.vararg, scope.kwarg) if n)]
        for i, name in enumerate(names):
            o = given.get(name, BOTTOM)
            annotated = self._annotated(scope, name)
            if i == 0 and scope.first and scope.cls is not None:
                o = Origin("ginst" if scope.first == "self" else "gclass", scope.cls.key)
            elif annotated != BOTTOM:
                o = annotated  # what the code says it is, whoever calls it
            elif scope.entry or overridden:
                o = join(o, UPSTREAM)
            self.assign(scope, name, o)
        if overridden:  # upstream calls it by that name: a use of the declaration
            self.touch(overridden, scope.node)

    def _overridden(self, scope: Scope) -> str:
        """The declared method of its upstream base ("module:Class.name") that a method of a glue class overrides:
        upstream calls it; "" for any other function."""
        if scope.cls is None or not scope.cls.upstream_bases or not isinstance(scope.node, ast.FunctionDef):
            return ""
        name = scope.node.name
        base = next((b for b in scope.cls.upstream_bases if name in self.contract.members(b)), "")
        return f"{base}.{name}" if base else ""

    def _annotated(self, scope: Scope, name: str) -> Origin:
        """A parameter annotated with a plain class of ours (`sess: gps.Session`, `path: Path`) is ours; one of
        upstream's is upstream's; containers, `Any` and unannotated parameters say nothing."""
        node = scope.node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return BOTTOM
        a = node.args
        arg = next((p for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg == name), None)
        ann = arg.annotation if arg is not None else None
        if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):  # X | None
            sides = [s for s in (ann.left, ann.right) if not (isinstance(s, ast.Constant) and s.value is None)]
            ann = sides[0] if len(sides) == 1 else None
        if not isinstance(ann, ast.Name | ast.Attribute) or ast.unparse(ann) in ("Any", "typing.Any", "object"):
            return BOTTOM
        o = self.ev(scope.parent or scope, ann, quiet=True)
        if o.kind == "gclass":
            return Origin("ginst", o.ref)
        if o.kind == "exact" and o.what == "class":
            return Origin("exact", o.ref, "instance")  # checked against that class's declarations
        if o.kind in _UP:
            return UPSTREAM
        return LOCAL if o.kind in _OURS else BOTTOM

    # ---------------------------------------------------------------------------------------- environment

    def _owner(self, scope: Scope, name: str) -> Scope | None:
        if name in scope.globals:
            return self._module_scope(scope)
        s: Scope | None = scope
        while s is not None:
            if name in s.names:
                return s
            s = s.parent
            while s is not None and isinstance(s.node, ast.ClassDef):
                s = s.parent  # class bodies are not enclosing scopes of their methods
        return None

    def _module_scope(self, scope: Scope) -> Scope:
        return self.scopes[f"{scope.module.rel}:"]

    def assign(self, scope: Scope, name: str, o: Origin) -> None:
        owner = self._owner(scope, name) or scope
        env = self.env[owner.key]
        new = join(env.get(name, BOTTOM), o)
        if env.get(name) != new:
            env[name] = new
            self.changed = True

    def lookup(self, scope: Scope, name: str) -> Origin:
        owner = self._owner(scope, name)
        if owner is not None:
            return self.env[owner.key].get(name, BOTTOM)
        if hasattr(builtins, name):
            return Origin("builtin", name)
        return LOCAL if _dunder(name) else UNKNOWN

    def _set_cls_attr(self, cls: GClass, name: str, o: Origin) -> None:
        env = self.env[f"{cls.key}.<class>"]
        new = join(env.get(name, BOTTOM), o)
        if env.get(name) != new:
            env[name] = new
            self.changed = True

    def _return(self, scope: Scope, o: Origin) -> None:
        new = join(self.returns.get(scope.key, BOTTOM), o)
        if self.returns.get(scope.key) != new:
            self.returns[scope.key] = new
            self.changed = True

    def _give(self, key: str, name: str, o: Origin) -> None:
        given = self.args.setdefault(key, {})
        new = join(given.get(name, BOTTOM), o)
        if given.get(name) != new:
            given[name] = new
            self.changed = True

    # ------------------------------------------------------------------------------------------- reporting

    def report(self, node: ast.AST, name: str, how: str, owners: list[str] | None = None) -> None:
        if not self.emit:
            return
        module = self._current.module
        line = getattr(node, "lineno", 0)
        key = (module.rel, line, name)
        if key not in self.found:
            self.found[key] = Undeclared(show(module.path), line, name, how, self.hooks_file, list(owners or []))

    def touch(self, name: str, node: ast.AST, kind: str = "exact") -> None:
        """Record a declared name the glue touches, and where: `kind` "exact" for "module:Qual" or "module:name",
        "name" for an attribute read by name on an upstream value of unknown class, "module" for a module."""
        if self.emit:
            self.touched.add(name)
            site = Site(show(self._current.module.path), getattr(node, "lineno", 0))
            self.uses.setdefault(Use(kind, name), set()).add(site)

    # ------------------------------------------------------------------------------------------ statements

    _current: Scope

    def _block(self, scope: Scope, body: list[ast.stmt]) -> None:
        self._current = scope
        for st in body:
            self._stmt(scope, st)

    def _stmt(self, scope: Scope, st: ast.stmt) -> None:
        self._current = scope
        if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef):
            key = self._def_key(scope, st.name)
            self.assign(scope, st.name, Origin("gfunc", key))
            for d in (*st.decorator_list, *st.args.defaults, *(d for d in st.args.kw_defaults if d is not None)):
                self.ev(scope, d)
        elif isinstance(st, ast.ClassDef):
            self.assign(scope, st.name, Origin("gclass", self._def_key(scope, st.name)))
            for d in st.decorator_list:
                self.ev(scope, d)
        elif isinstance(st, ast.Return):
            if st.value is not None:
                self._return(scope, self.ev(scope, st.value))
        elif isinstance(st, ast.Assign):
            value = self.ev(scope, st.value)
            for target in st.targets:
                self.bind(scope, target, value, st.value)
        elif isinstance(st, ast.AnnAssign):
            if st.value is not None:
                self.bind(scope, st.target, self.ev(scope, st.value), st.value)
        elif isinstance(st, ast.AugAssign):
            value = self.ev(scope, st.value)
            if isinstance(st.target, ast.Attribute):
                self.ev(scope, st.target)  # read, then written
            self.bind(scope, st.target, value, None)
        elif isinstance(st, ast.For | ast.AsyncFor):
            self.bind(scope, st.target, item(self.ev(scope, st.iter)), None)
            self._block(scope, st.body)
            self._block(scope, st.orelse)
        elif isinstance(st, ast.While | ast.If):
            self.ev(scope, st.test)
            self._block(scope, st.body)
            self._block(scope, st.orelse)
        elif isinstance(st, ast.With | ast.AsyncWith):
            for it in st.items:
                o = self.ev(scope, it.context_expr)
                if it.optional_vars is not None:
                    self.bind(scope, it.optional_vars, o, None)
            self._block(scope, st.body)
        elif isinstance(st, ast.Try):
            self._block(scope, st.body)
            for h in st.handlers:
                if h.type is not None:
                    self.ev(scope, h.type)
                if h.name:
                    self.assign(scope, h.name, LOCAL)
                self._block(scope, h.body)
            self._block(scope, st.orelse)
            self._block(scope, st.finalbody)
        elif isinstance(st, ast.Expr):
            self.ev(scope, st.value)
        elif isinstance(st, ast.Delete):
            for t in st.targets:
                if isinstance(t, ast.Attribute):
                    self.attr(scope, self.ev(scope, t.value), t.attr, t, "deleted")
                else:
                    self.ev(scope, t)
        elif isinstance(st, ast.Raise):
            for part in (st.exc, st.cause):
                if part is not None:
                    self.ev(scope, part)
        elif isinstance(st, ast.Assert):
            self.ev(scope, st.test)
            if st.msg is not None:
                self.ev(scope, st.msg)
        elif isinstance(st, ast.Import):
            for alias in st.names:
                if alias.asname:
                    self.assign(scope, alias.asname, self.module_origin(alias.name, st))
                else:
                    self.module_origin(alias.name, st)  # checked as imported; the name bound is its top package
                    top = alias.name.split(".")[0]
                    self.assign(scope, top, self.module_origin(top, st))
        elif isinstance(st, ast.ImportFrom):
            source = absolute_module(scope.module.package, st.module, st.level)
            for alias in st.names:
                if alias.name != "*":
                    self.assign(scope, alias.asname or alias.name, self.import_origin(source, alias.name, st))
        elif isinstance(st, ast.Match):
            self.ev(scope, st.subject)
            for case in st.cases:
                self._block(scope, case.body)

    def _def_key(self, scope: Scope, name: str) -> str:
        if scope.key.endswith(":"):
            return f"{scope.key}{name}"
        if scope.key.endswith(".<class>"):
            return f"{scope.key[: -len('.<class>')]}.{name}"
        return f"{scope.key}.{name}"

    def bind(self, scope: Scope, target: ast.expr, value: Origin, value_node: ast.expr | None) -> None:
        if isinstance(target, ast.Name):
            self.assign(scope, target.id, value)
        elif isinstance(target, ast.Tuple | ast.List):
            pairwise = (
                isinstance(value_node, ast.Tuple | ast.List)
                and len(value_node.elts) == len(target.elts)
                and not any(isinstance(e, ast.Starred) for e in (*value_node.elts, *target.elts))
            )
            for i, elt in enumerate(target.elts):
                if pairwise:
                    assert isinstance(value_node, ast.Tuple | ast.List)
                    self.bind(scope, elt, self.ev(scope, value_node.elts[i], quiet=True), value_node.elts[i])
                else:
                    self.bind(scope, elt, value if value.kind in _OURS else item(value), None)
        elif isinstance(target, ast.Starred):
            self.bind(scope, target.value, value, None)
        elif isinstance(target, ast.Attribute):
            self.store(scope, self.ev(scope, target.value), target.attr, target, value)
        elif isinstance(target, ast.Subscript):
            self.ev(scope, target.slice)
            self.ev(scope, target.value)
            self.contain(scope, target.value, value)

    def contain(self, scope: Scope, container: ast.expr, value: Origin) -> None:
        """`container[k] = value`, `container.append(value)`: the container holds upstream's values from now on."""
        while isinstance(container, ast.Subscript):
            container = container.value
        if isinstance(container, ast.Name):
            self.assign(scope, container.id, value)
        elif isinstance(container, ast.Attribute):
            base = self.ev(scope, container.value, quiet=True)
            if base.kind == "ginst" and container.attr in self.classes[base.ref].defined:  # a glue class's own field
                self._set_cls_attr(self.classes[base.ref], container.attr, value)

    # ----------------------------------------------------------------------------------------- expressions

    def ev(self, scope: Scope, node: ast.expr, quiet: bool = False) -> Origin:
        if quiet:
            emit, self.emit = self.emit, False
            try:
                return self.ev(scope, node)
            finally:
                self.emit = emit
        self._current = scope
        if isinstance(node, ast.Name):
            return self.lookup(scope, node.id)
        if isinstance(node, ast.Constant):
            return BOTTOM
        if isinstance(node, ast.JoinedStr):
            for v in node.values:
                self.ev(scope, v)
            return BOTTOM
        if isinstance(node, ast.FormattedValue):
            self.ev(scope, node.value)
            return BOTTOM
        if isinstance(node, ast.Attribute):
            return self.attr(scope, self.ev(scope, node.value), node.attr, node, "read")
        if isinstance(node, ast.Subscript):
            base = self.ev(scope, node.value)
            self.ev(scope, node.slice)
            if base.kind == "exact" and base.what == "class":
                return UPSTREAM  # Enum["NAME"], Generic[...]
            return item(base)
        if isinstance(node, ast.Call):
            return self.call(scope, node)
        if isinstance(node, ast.BoolOp):
            out = BOTTOM
            for v in node.values:
                out = join(out, self.ev(scope, v))
            return out
        if isinstance(node, ast.IfExp):
            self.ev(scope, node.test)
            return join(self.ev(scope, node.body), self.ev(scope, node.orelse))
        if isinstance(node, ast.BinOp):
            return join(self.ev(scope, node.left), self.ev(scope, node.right))
        if isinstance(node, ast.UnaryOp):
            return self.ev(scope, node.operand)
        if isinstance(node, ast.Compare):
            self.ev(scope, node.left)
            for c in node.comparators:
                self.ev(scope, c)
            return LOCAL
        if isinstance(node, ast.Lambda):
            return Origin("gfunc", f"{scope.module.rel}:{self._prefix(scope)}<lambda@{node.lineno}:{node.col_offset}>")
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            for gen in node.generators:
                self.bind(scope, gen.target, item(self.ev(scope, gen.iter)), None)
                for cond in gen.ifs:
                    self.ev(scope, cond)
            if isinstance(node, ast.DictComp):
                self.ev(scope, node.key)
                return self.ev(scope, node.value)
            return self.ev(scope, node.elt)
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            out = BOTTOM
            for e in node.elts:
                o = self.ev(scope, e)
                out = join(out, item(o) if isinstance(e, ast.Starred) and o.kind in _UP else o)
            return out
        if isinstance(node, ast.Dict):
            out = BOTTOM
            for k, v in zip(node.keys, node.values, strict=True):
                if k is not None:
                    self.ev(scope, k)
                out = join(out, self.ev(scope, v))
            return out
        if isinstance(node, ast.Starred):
            return self.ev(scope, node.value)
        if isinstance(node, ast.NamedExpr):
            value = self.ev(scope, node.value)
            self.bind(scope, node.target, value, node.value)
            return value
        if isinstance(node, ast.Slice):
            for part in (node.lower, node.upper, node.step):
                if part is not None:
                    self.ev(scope, part)
            return LOCAL
        if isinstance(node, ast.Await | ast.Yield | ast.YieldFrom):
            if node.value is not None:
                self.ev(scope, node.value)
            return UNKNOWN
        return UNKNOWN

    def _prefix(self, scope: Scope) -> str:
        qual = scope.key.split(":", 1)[1]
        if qual.endswith(".<class>"):
            qual = qual[: -len(".<class>")]
        return f"{qual}." if qual else ""

    # -------------------------------------------------------------------------------------------- imports

    def is_upstream(self, module: str) -> bool:
        return module.split(".")[0] in self.upstream_tops and module not in self.modules

    def module_origin(self, module: str, node: ast.AST) -> Origin:
        if module in self.modules:
            return Origin("gmod", module)
        if not self.is_upstream(module):
            return LOCAL
        self.imported_modules.add(module)
        if self.contract.is_module(module):
            self.touch(module, node, "module")
            return Origin("exact", module, "module")
        self.report(node, module, "an imported upstream module")
        return UPSTREAM

    def import_origin(self, module: str, name: str, node: ast.AST) -> Origin:
        full = f"{module}.{name}"
        if full in self.modules:
            return Origin("gmod", full)
        if module in self.modules:
            return self.env[f"{self.modules[module].rel}:"].get(name, BOTTOM)
        if not self.is_upstream(module):
            return LOCAL
        self.imported_modules.add(module)
        if self.contract.is_module(full):
            self.touch(full, node, "module")
            return Origin("exact", full, "module")
        target = f"{module}:{name}"
        kind = self.contract.kind_of(target)
        if kind is None:
            self.report(node, target, "imported from upstream")
            return UPSTREAM
        self.touch(target, node)
        return Origin("exact", target, kind) if kind != "value" else UPSTREAM

    # ---------------------------------------------------------------------------------------- attributes

    def attr(self, scope: Scope, base: Origin, name: str, node: ast.AST, how: str) -> Origin:
        k = base.kind
        if k == "bottom":  # not known yet (or never): checked as unknown, and nothing is inferred from it
            if self.emit:
                self.by_name(UNKNOWN, name, node, how)
            return BOTTOM
        if k in ("local", "builtin", "gfunc"):
            return LOCAL
        if k == "gmod":
            module = self.modules[base.ref]
            sub = f"{base.ref}.{name}"
            if sub in self.modules:
                return Origin("gmod", sub)
            return self.env[f"{module.rel}:"].get(name, BOTTOM)  # not bound (yet): nothing known
        if k == "gclass":
            cls = self.classes[base.ref]
            method = cls.methods.get(name)
            if method is not None:
                return Origin("gfunc", method.key, "bound" if method.first == "cls" else "")
            return self.env[f"{cls.key}.<class>"].get(name, BOTTOM)
        if k == "ginst":
            cls = self.classes[base.ref]
            method = cls.methods.get(name)
            if method is not None and method.prop:
                return self.returns.get(method.key, BOTTOM)
            if method is not None:
                return Origin("gfunc", method.key, "bound" if method.first == "self" else "")
            if name in cls.defined:
                return self.env[f"{cls.key}.<class>"].get(name, BOTTOM)  # what the glue assigns to it
            if cls.local_bases or not cls.upstream_bases:
                return self.env[f"{cls.key}.<class>"].get(name, LOCAL)  # the runtime base class's
            self.exact_member(
                cls.upstream_bases, name, node, how, f"{how} on self, a {' and '.join(cls.upstream_bases)}"
            )
            return UPSTREAM
        if k == "exact":
            return join(self.exact_attr(base, name, node, how), self.stored.get(name, BOTTOM))
        return join(self.by_name(base, name, node, how), self.stored.get(name, BOTTOM))

    def store(self, scope: Scope, base: Origin, name: str, node: ast.AST, value: Origin) -> None:
        if base.kind == "ginst":
            cls = self.classes[base.ref]
            if name in cls.defined or cls.local_bases or not cls.upstream_bases:
                self._set_cls_attr(cls, name, value)
                return
        if base.kind not in _OURS:  # what the glue puts into an upstream attribute is read back as such
            new = join(self.stored.get(name, BOTTOM), value)
            if self.stored.get(name) != new:
                self.stored[name] = new
                self.changed = True
        self.attr(scope, base, name, node, "written")

    def exact_member(self, targets: list[str], name: str, node: ast.AST, how: str, text: str) -> bool:
        if name in self.patched:
            return True
        if _dunder(name):
            self.touch(f"{targets[0]}.{name}", node)
            return True
        owner = next((t for t in targets if name in self.contract.members(t)), None)
        if owner is not None:
            self.touch(f"{owner}{'.' if ':' in owner else ':'}{name}", node)
            return True
        self.report(node, name, text, [t for t in targets if ":" in t])
        return False

    def exact_attr(self, base: Origin, name: str, node: ast.AST, how: str) -> Origin:
        target, what = base.ref, base.what
        if what == "module":
            sub = f"{target}.{name}"
            if sub in self.modules:
                return Origin("gmod", sub)
            if self.contract.is_module(sub):
                self.touch(sub, node, "module")
                return Origin("exact", sub, "module")
            if name not in self.contract.members(target):
                self.report(node, f"{target}:{name}", f"{how} on the upstream module {target}")
                return UPSTREAM
            self.touch(f"{target}:{name}", node)
            kind = self.contract.kind_of(f"{target}:{name}")
            return Origin("exact", f"{target}:{name}", kind) if kind in ("class", "function") else UPSTREAM
        if what in ("class", "instance"):
            where = f"the upstream class {target}" if what == "class" else f"a {target}"
            if not self.exact_member([target], name, node, how, f"{how} on {where}"):
                return UPSTREAM
            member = f"{target}.{name}"
            kind = self.contract.kind_of(member)
            return Origin("exact", member, kind) if kind in ("class", "function") else UPSTREAM
        if _dunder(name):
            return UPSTREAM
        return self.by_name(UPSTREAM, name, node, how)

    def by_name(self, base: Origin, name: str, node: ast.AST, how: str) -> Origin:
        """An attribute of an upstream value whose class is not known, or of a value the lint cannot place."""
        unknown = base.kind != "upstream"
        if _dunder(name) or name in self.patched:
            return UNKNOWN if unknown else UPSTREAM
        if name in self.contract.member_names:
            self.touch(name, node, "name")
            return UPSTREAM if not (unknown and name in self.ours) else UNKNOWN
        if name in self.allow.library or (not _private(name) and name in self.allow.generic):
            return UNKNOWN if unknown else UPSTREAM
        if unknown and name in self.ours:
            return UNKNOWN
        where = "a value the lint cannot tell is ours" if unknown else "an upstream value"
        self.report(node, name, f"{how} on {where}")
        return UNKNOWN if unknown else UPSTREAM

    # -------------------------------------------------------------------------------------------- calls

    def call(self, scope: Scope, node: ast.Call) -> Origin:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else ""
        if name in _REFLECT | _PASSTHROUGH | {"type", "super"} and self.lookup(scope, name).kind == "builtin":
            return self._builtin(scope, name, node)
        callee = self.ev(scope, func)
        args = [self.ev(scope, a) for a in node.args]
        kwargs = {k.arg: self.ev(scope, k.value) for k in node.keywords}
        if _field_name(func) == "field" and callee.kind in _OURS:  # dataclasses.field(): the field holds what the
            return kwargs.get("default", BOTTOM)  # code puts there, not its (empty) default
        if isinstance(func, ast.Attribute) and func.attr in _MUTATORS:
            for a in args[-1:]:
                self.contain(scope, func.value, a)
        k = callee.kind
        if k == "gfunc":
            self._bind_call(callee, node, args, kwargs)
            return self.returns.get(callee.ref, BOTTOM)
        if k == "gclass":
            cls = self.classes[callee.ref]
            init = cls.methods.get("__init__")
            if init is not None:
                self._bind_call(Origin("gfunc", init.key, "bound"), node, args, kwargs)
            else:
                for name, o in kwargs.items():
                    if name is not None:
                        self._set_cls_attr(cls, name, o)
            return Origin("ginst", cls.key)
        if k == "exact":
            if callee.what in ("class", "function"):
                self._keywords(node, [callee.ref], callee.what)
            if callee.what == "class" and self.contract.hook(f"{callee.ref}.__init__") is not None:
                self.touch(f"{callee.ref}.__init__", node)  # building it calls its declared __init__
            return UPSTREAM
        method = func.attr if isinstance(func, ast.Attribute) and k in ("upstream", "unknown", "bottom") else ""
        if method and (k == "upstream" or method not in self.ours):
            hooks = [h.target for h in self.contract.hooks_named(method)]
            if hooks:
                self._keywords(node, hooks, "function")
        return {"upstream": UPSTREAM, "unknown": UNKNOWN, "bottom": BOTTOM}.get(k, LOCAL)

    def _bind_call(self, callee: Origin, node: ast.Call, args: list[Origin], kwargs: dict[str | None, Origin]) -> None:
        scope = self.scopes.get(callee.ref)
        if scope is None:
            return
        params = scope.params[1:] if callee.what == "bound" else scope.params
        starred = BOTTOM
        for i, (a, o) in enumerate(zip(node.args, args, strict=True)):
            if isinstance(a, ast.Starred):
                starred = join(starred, item(o) if o.kind in _UP else o)
                continue
            if i < len(params):
                self._give(scope.key, params[i], o)
            elif scope.vararg:
                self._give(scope.key, scope.vararg, o)
        for name, o in kwargs.items():
            if name is None:
                starred = join(starred, item(o) if o.kind in _UP else o)
            elif name in (*params, *scope.kwonly):
                self._give(scope.key, name, o)
            elif scope.kwarg:
                self._give(scope.key, scope.kwarg, o)
        if starred != BOTTOM:
            for name in (*params, *scope.kwonly, *(n for n in (scope.vararg, scope.kwarg) if n)):
                self._give(scope.key, name, starred)

    def _keywords(self, node: ast.Call, targets: list[str], what: str) -> None:
        """Keywords passed to declared upstream callables must be declared parameters (or fields)."""
        for kw in node.keywords:
            if kw.arg is None:
                continue
            ok = False
            for target in targets:
                if what == "class":
                    init = self.contract.hook(f"{target}.__init__")
                    answer = init.accepts(kw.arg) if init is not None else kw.arg in self.contract.members(target)
                    if answer is not False:  # the declaration that let it pass is used
                        self.touch(init.target if init is not None else f"{target}.{kw.arg}", kw.value)
                else:
                    hook = self.contract.hook(target)
                    answer = hook.accepts(kw.arg) if hook is not None else None
                ok = ok or answer is None or answer
            if not ok:
                shown = targets[0] if len(targets) == 1 else f"{targets[0]} (or {len(targets) - 1} more)"
                field_hint = ", or among the class's [[attrs]] when it is a dataclass field" if what == "class" else ""
                how = f"a keyword argument: declare it in the params/requires of that hook{field_hint}"
                self.report(kw.value, f"{shown}({kw.arg}=)", how)

    def _builtin(self, scope: Scope, name: str, node: ast.Call) -> Origin:
        args = node.args
        if name == "super":
            cls = scope.cls
            if cls is not None and cls.upstream_bases:
                return Origin("exact", cls.upstream_bases[0], "class")
            return LOCAL
        origins = [self.ev(scope, a) for a in args]
        for k in node.keywords:
            self.ev(scope, k.value)
        if name in _REFLECT:
            if len(args) < 2:
                return LOCAL
            base, attr = origins[0], args[1]
            if isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                how = {"getattr": "read", "hasattr": "read", "setattr": "written", "delattr": "deleted"}[name]
                if name == "setattr" and len(origins) > 2:
                    self.store(scope, base, attr.value, node, origins[2])
                    return LOCAL
                got = self.attr(scope, base, attr.value, node, f"{how} (by {name})")
                if name == "getattr":
                    return join(got, origins[2]) if len(origins) > 2 else got
                return LOCAL
            if base.kind not in _OURS:
                site = f"{scope.module.rel}:{self._site(scope)}"
                if site in self.contract.computed or site in self.allow.reflective:
                    if self.emit:
                        self.computed_sites.add(site)
                    for entry in (a for a in self.contract.attrs if site in a.computed_in):
                        for computed in entry.all_names:
                            self.touch(f"{entry.target}{':' if entry.is_module else '.'}{computed}", node)
                else:
                    self.report(node, f"{name}(..., {ast.unparse(attr)})",
                                f"a computed attribute name on a value that is not ours: list {site} in the "
                                "computed_in of the [[attrs]] declaring the names it takes (or, for a generic "
                                "walk, as reflective in gluelint_allow.toml)")  # fmt: skip
            if name == "getattr":
                out = {"bottom": BOTTOM, "unknown": UNKNOWN}.get(base.kind, item(base) if base.kind in _UP else LOCAL)
                return join(out, origins[2]) if len(origins) > 2 else out
            return LOCAL
        if name == "type":
            o = origins[0] if origins else LOCAL
            if o.kind == "ginst":
                return Origin("gclass", o.ref)
            return UPSTREAM if o.kind in _UP else o
        # containers and iterators of their arguments' values
        out = BOTTOM
        for o in origins[:1] if name in ("vars", "sorted", "reversed", "iter", "next", "enumerate") else origins:
            out = join(out, o)
        if name == "next" and len(origins) > 1:
            out = join(out, origins[1])
        return item(out) if name == "next" else out

    def _site(self, scope: Scope) -> str:
        s = scope
        while s.node is not None and isinstance(s.node, ast.Lambda) and s.parent is not None:
            s = s.parent
        qual = s.key.split(":", 1)[1]
        return qual[: -len(".<class>")] if qual.endswith(".<class>") else qual
