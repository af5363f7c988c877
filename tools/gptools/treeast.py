"""Read an unpacked upstream tree by AST, importing nothing: modules, the names they bind (following re-exports),
definitions by qualified name, and the attributes a class has (its own and its bases' within the tree).

`gptools.hooks` checks declarations with it; one `Tree` caches each parsed module, so checking a few hundred names
parses each upstream file once.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
_TRIVIAL_BASES = {"object", "ABC", "abc.ABC", "Generic", "typing.Generic", "Protocol", "typing.Protocol"}


def definitions(body: list[ast.stmt]) -> dict[str, Def]:
    """Names defined by def/class in a body, looking through if/try/with blocks; the last definition wins,
    as it does when Python runs the module."""
    found: dict[str, Def] = {}
    for node in body:
        if isinstance(node, Def):
            found[node.name] = node
        elif isinstance(node, ast.If | ast.With | ast.AsyncWith):
            found.update(definitions(node.body))
            found.update(definitions(getattr(node, "orelse", [])))
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                found.update(definitions(block))
    return found


def _blocks(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a body with those of its if/try/with blocks, flattened (not into defs or loops)."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If | ast.With | ast.AsyncWith):
            out += _blocks(node.body) + _blocks(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                out += _blocks(block)
    return out


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


@dataclass(frozen=True)
class Binding:
    """What a module-level name is bound to: a definition here, a value, a module, or a name imported from one."""

    kind: str  # "def", "value", "module", "from"
    node: Def | None = None
    module: str = ""  # "def": the module defining it; "module": the module; "from": the module it is imported from
    name: str = ""  # "from": the name imported


@dataclass
class ModuleInfo:
    path: Path
    tree: ast.Module
    bindings: dict[str, Binding]
    stars: list[str]  # modules star-imported, in order
    has_getattr: bool  # a module-level __getattr__ (names it provides are invisible here)


@dataclass
class ClassAttrs:
    """Every attribute name a class defines (its body, `self.<name>` in its methods, `__slots__`), with its bases'
    that lie in the tree; `searched` lists the classes read, `outside` the bases that could not be followed."""

    names: set[str] = field(default_factory=set)
    searched: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)


class Tree:
    """An unpacked package tree (a wheel's contents) read by AST, with every parsed module cached; with `more`
    roots, a module is looked for in `root` first, then in each of them (our overlays over a pristine upstream)."""

    def __init__(self, root: Path, *more: Path) -> None:
        self.root = root
        self.roots = (root, *more)
        self._modules: dict[str, ModuleInfo | str] = {}
        self._classes: dict[str, ClassAttrs] = {}

    # ------------------------------------------------------------------------------------------------ modules

    def module_file(self, module: str) -> Path | None:
        """The source file of a dotted module inside the tree, or None."""
        for root in self.roots:
            base = root.joinpath(*module.split("."))
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
        return None

    def rel(self, path: Path) -> str:
        root = next((r for r in self.roots if path.is_relative_to(r)), self.root)
        return path.relative_to(root).as_posix()

    def module(self, module: str) -> ModuleInfo | str:
        """The parsed module, or a reason why it cannot be read."""
        if module not in self._modules:
            self._modules[module] = self._read(module)
        return self._modules[module]

    def _read(self, module: str) -> ModuleInfo | str:
        path = self.module_file(module)
        if path is None:
            return f"module {module} not found (no {module.replace('.', '/')}.py in the tree)"
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError) as err:
            return f"cannot parse {self.rel(path)}: {err}"
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        bindings: dict[str, Binding] = {}
        stars: list[str] = []
        has_getattr = False
        for node in _blocks(tree.body):
            if isinstance(node, Def):
                bindings[node.name] = Binding("def", node, module=module)
                has_getattr |= node.name == "__getattr__"
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for name in _target_names(t):
                        bindings[name] = Binding("value")
            elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
                bindings[node.target.id] = Binding("value")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bindings[alias.asname] = Binding("module", module=alias.name)
                    else:
                        top = alias.name.split(".")[0]
                        bindings[top] = Binding("module", module=top)
            elif isinstance(node, ast.ImportFrom):
                source = absolute_module(package, node.module, node.level)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(source)
                    else:
                        bindings[alias.asname or alias.name] = Binding("from", module=source, name=alias.name)
        return ModuleInfo(path, tree, bindings, stars, has_getattr)

    def resolve(self, module: str, name: str, _seen: frozenset[tuple[str, str]] = frozenset()) -> Binding | None:
        """What `module.name` is, following re-exports (`from x import name`, `from x import *`) through the tree;
        None when the module does not bind it. A name imported from outside the tree is a "from" binding."""
        if (module, name) in _seen:
            return None
        seen = _seen | {(module, name)}
        info = self.module(module)
        if isinstance(info, str):
            return None
        binding = info.bindings.get(name)
        if binding is None:
            for star in reversed(info.stars):
                found = self.resolve(star, name, seen)
                if found is not None:
                    return found
            if self.module_file(f"{module}.{name}") is not None:
                return Binding("module", module=f"{module}.{name}")
            return None
        if binding.kind == "from":
            if self.module_file(f"{binding.module}.{binding.name}") is not None:
                return Binding("module", module=f"{binding.module}.{binding.name}")
            if self.module_file(binding.module) is None:
                return binding  # imported from outside the tree: bound, but not followed
            return self.resolve(binding.module, binding.name, seen)
        return binding

    def has_name(self, module: str, name: str) -> tuple[bool, str]:
        """Whether a module binds `name` (directly or re-exported); on False, why not."""
        info = self.module(module)
        if isinstance(info, str):
            return False, info
        if self.resolve(module, name) is not None:
            return True, ""
        extra = " (it defines __getattr__: names it makes up are invisible to this check)" if info.has_getattr else ""
        return False, f"module {module} binds no name {name!r} ({self.rel(info.path)}){extra}"

    # ------------------------------------------------------------------------------------------- definitions

    def find(self, module: str, qualname: str) -> tuple[Def | None, str, str]:
        """(definition, module it lies in, reason): the first part may be re-exported from another module; the
        rest are definitions nested in it. On failure the definition is None and the reason names what is
        missing."""
        info = self.module(module)
        if isinstance(info, str):
            return None, module, info
        first, *rest = qualname.split(".")
        node = definitions(info.tree.body).get(first)
        where = module
        if node is None:
            binding = self.resolve(module, first)
            if binding is not None and binding.kind == "def" and binding.node is not None:
                node, where = binding.node, binding.module
        if node is None:
            return None, module, f"module {module} has no definition named {first!r} ({self.rel(info.path)})"
        walked = [first]
        for part in rest:
            inner = definitions(node.body).get(part)
            if inner is None:
                path = self.module(where)
                file = self.rel(path.path) if isinstance(path, ModuleInfo) else where
                return None, where, f"{'.'.join(walked)} has no definition named {part!r} ({file})"
            walked.append(part)
            node = inner
        return node, where, ""

    def scope_names(self, module: str, qualname: str) -> set[str]:
        """The names defined in the scope that holds `qualname` (a module's, or its owner class's body)."""
        owner, _, _ = qualname.rpartition(".")
        if not owner:
            info = self.module(module)
            return set(info.bindings) if isinstance(info, ModuleInfo) else set()
        attrs, _ = self.class_attributes(module, owner)
        return attrs.names if attrs is not None else set()

    # ---------------------------------------------------------------------------------------------- classes

    def class_attributes(self, module: str, qualname: str) -> tuple[ClassAttrs | None, str]:
        """The attributes of class `module:qualname` and of its bases in the tree; None and a reason when the
        class itself is not there."""
        node, where, reason = self.find(module, qualname)
        if node is None:
            return None, reason
        if not isinstance(node, ast.ClassDef):
            return None, f"{module}:{qualname} is a function, not a class (line {node.lineno})"
        return self._collect(where, qualname, node), ""

    def _collect(self, module: str, qualname: str, node: ast.ClassDef) -> ClassAttrs:
        key = f"{module}:{qualname}"
        if key in self._classes:
            return self._classes[key]
        out = ClassAttrs(searched=[key])
        self._classes[key] = out  # a cycle of bases ends here
        out.names |= own_attributes(node)
        for base in node.bases:
            text = ast.unparse(base)
            target = self._base_target(module, base)
            if target is None:
                if text not in _TRIVIAL_BASES and not text.startswith(("Generic[", "typing.Generic[", "Protocol[")):
                    out.outside.append(text)
                continue
            base_module, base_qual, base_node = target
            inherited = self._collect(base_module, base_qual, base_node)
            out.names |= inherited.names
            out.searched += [s for s in inherited.searched if s not in out.searched]
            out.outside += [o for o in inherited.outside if o not in out.outside]
        return out

    def _base_target(self, module: str, base: ast.expr) -> tuple[str, str, ast.ClassDef] | None:
        """The class a base expression names, when it lies in the tree."""
        if isinstance(base, ast.Subscript):
            return self._base_target(module, base.value)
        dotted: list[str] = []
        expr: ast.expr = base
        while isinstance(expr, ast.Attribute):
            dotted.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        info = self.module(module)
        if isinstance(info, str):
            return None
        first = expr.id
        local = definitions(info.tree.body).get(first)
        if local is not None and not dotted:
            return (module, first, local) if isinstance(local, ast.ClassDef) else None
        binding = self.resolve(module, first)
        if binding is None:
            return None
        if binding.kind == "def" and not dotted and isinstance(binding.node, ast.ClassDef):
            return binding.module, binding.node.name, binding.node
        if binding.kind == "module" and dotted:
            mod = binding.module
            while len(dotted) > 1 and self.module_file(f"{mod}.{dotted[0]}") is not None:
                mod = f"{mod}.{dotted.pop(0)}"
            node, where, _ = self.find(mod, ".".join(dotted))
            return (where, ".".join(dotted), node) if isinstance(node, ast.ClassDef) else None
        return None


def absolute_module(package: str, module: str | None, level: int) -> str:
    """The absolute name of `from <level dots><module> import ...` inside `package`."""
    if level == 0:
        return module or ""
    parts = package.split(".") if package else []
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*base, module] if module else base)


def own_attributes(node: ast.ClassDef) -> set[str]:
    """The attribute names a class defines itself: definitions, assignments and annotations in its body (dataclass
    fields, enum members, class variables), `__slots__`, and `self.<name>` (or setattr(self, "<name>", ...)) in its
    methods."""
    names: set[str] = set()
    for stmt in _blocks(node.body):
        if isinstance(stmt, Def):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                names.update(_target_names(t))
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets):
                names.update(_slot_names(stmt.value))
        elif isinstance(stmt, ast.AnnAssign | ast.AugAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
            if stmt.target.id == "__slots__" and stmt.value is not None:
                names.update(_slot_names(stmt.value))
    for method in (s for s in _blocks(node.body) if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)):
        args = [*method.args.posonlyargs, *method.args.args]
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in method.decorator_list)
        if not args or static:
            continue
        names |= _self_assigned(method, args[0].arg)
    return names


def _slot_names(value: ast.expr) -> set[str]:
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return {value.value}
    if isinstance(value, ast.Tuple | ast.List | ast.Set):
        return {e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    if isinstance(value, ast.Dict):
        return {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


def _self_assigned(method: ast.FunctionDef | ast.AsyncFunctionDef, me: str) -> set[str]:
    """`me.<name>` targets of assignments, loops and with-items in a method, and constant setattr names on `me`."""
    names: set[str] = set()

    def targets(t: ast.expr) -> None:
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
            names.add(t.attr)
        elif isinstance(t, ast.Tuple | ast.List):
            for elt in t.elts:
                targets(elt)
        elif isinstance(t, ast.Starred):
            targets(t.value)

    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.For | ast.AsyncFor):
            targets(node.target)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets(node.optional_vars)
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            fn = ast.unparse(node.func)
            obj, name = node.args[0], node.args[1]
            if fn == "super().__setattr__":
                obj, name = ast.Name(me), node.args[0]
            if (
                fn in ("setattr", "object.__setattr__", "super().__setattr__")
                and isinstance(obj, ast.Name)
                and obj.id == me
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
            ):
                names.add(name.value)
    return names
