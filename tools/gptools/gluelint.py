"""The glue lint: every upstream name an engine's glue touches must be declared in `patches/<engine>/hooks.toml`.

The glue is every Python file under `overlays/<engine>/` (modules copied into the engine's package). It reads the
engine's objects, calls its functions, subclasses and monkeypatches its classes; each name it touches that way is
part of the upstream contract, which `make rebase` can check against a new release only when it is declared.
The lint reads the glue by AST (it imports nothing; no upstream tree is needed) and follows, within and across the
glue's modules, where each value came from:

* **ours** (exempt): values of our runtime (`graphpersist`), of the glue's own modules and classes, of other
  libraries and the standard library (torch, os, ...), literals, and what those return; a parameter annotated with
  such a class (`sess: Session`, `path: Path`);
* **upstream, exactly**: a name imported from the engine (`from vllm.x import Y`, `import vllm.envs`), and `self`
  or `super()` in a glue class derived from an upstream class: an attribute must be declared on *that* class or
  module;
* **upstream**: the arguments of a glue function that no glue code calls (a patch, an upstream callback or a
  driver's RPC calls it; the series' added lines name the first), of a method that overrides a declared upstream
  method, what an upstream callable returns, and any attribute, item or element of an upstream value;
* **unknown**: what the lint loses track of: an item of a container of ours, a parameter whose callers pass ours
  and upstream's values, an argument of a method of a glue class built on one of ours (an adapter our runtime
  calls).

The rule, for each attribute read, write or delete (`x.name`, `getattr/setattr/hasattr/delattr(x, "name")`,
monkeypatching `Cls.method = ...`) on a value that is not ours:

1. Declared in hooks.toml (an `[[attrs]]` name or a `[[hook]]` member of an upstream class; on an exact upstream
   class or module, declared on that one): fine.
2. A name with a leading underscore (not a dunder) must be declared; nothing else exempts it but a library's
   private listed by name in `gluelint_allow.toml`, or, on an unknown value, a private name our own code defines.
3. A public name may otherwise be an attribute of the builtin types (str, list, dict, int, ...) or of the
   standard-library types `gluelint_allow.toml` lists, or a library's name it lists (torch tensors and modules that
   upstream objects hold); on an unknown value also an attribute our own code defines (the runtime's and the glue's
   classes). Anything else must be declared.
4. Dunders are exempt, except on an upstream module (`vllm.__version__` is declared). Attributes the series itself
   adds to upstream classes (`+    graph_persist: str | None = None`) are ours.

Also: every import from the engine names a declared module or a declared name of one; a computed attribute name
(`getattr(ps, f"_{name}")`) on a value that is not ours is allowed only in a glue function that an `[[attrs]]`
table lists in `computed_in` (its names are then declared) or that `gluelint_allow.toml` lists as reflective (it
walks objects generically); keywords passed to a declared upstream function, class or method must be among its
declared `params`/`requires` (for a class without a declared `__init__`, among its declared fields).

What it cannot see: a builtin or listed library name read on an upstream value (`runner.items()` passes whatever
`runner` is), and, on an unknown value, a name our own code also defines. Annotating a parameter with its class
says whose it is: with a class of ours it is ours; with an upstream class (imported, declared), its attributes are
checked against that class's declarations.

An undeclared name fails `make check` with `path:line: <name> is not declared in patches/<engine>/hooks.toml`.
`python -m gptools hooks --engine <engine> --undeclared` lists them with the upstream classes defining each.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gptools.contract import Contract
from gptools.glueflow import Allow, Analysis, Site, Undeclared, Use, entry_points, ours_names, patch_names, show
from gptools.treeast import Tree, own_attributes

ALLOW_FILE = Path(__file__).with_name("gluelint_allow.toml")
# The builtin types whose public attributes any value may have without a listing: the ones engines hand around
# (bytes.decode, complex.real and the like are left out: names that upstream classes have too).
_BUILTIN_TYPES = (object, str, int, float, bool, list, tuple, dict, set, frozenset, type, BaseException)


def _public_attributes(kind: type) -> set[str]:
    """dir() misses some (Enum's name and value are descriptors on the class): every class dict of the MRO too."""
    names = set(dir(kind)) | {n for c in kind.__mro__ for n in vars(c)}
    return {n for n in names if not n.startswith("_")}


def load_allow(path: Path = ALLOW_FILE) -> Allow:
    """gluelint_allow.toml: the listed standard-library types' and libraries' names, and the reflective sites."""
    data = tomllib.loads(path.read_text())
    kinds: list[type] = list(_BUILTIN_TYPES)
    for dotted in data.get("stdlib", {}).get("types", []):
        module, _, name = dotted.rpartition(".")
        kinds.append(getattr(importlib.import_module(module), name))
    generic = {n for kind in kinds for n in _public_attributes(kind)}
    library = {n for entry in data.get("library", []) for n in entry.get("names", [])}
    reflective = {entry["where"] for entry in data.get("reflective", [])}
    return Allow(frozenset(generic), frozenset(library), frozenset(reflective))


@dataclass
class LintReport:
    """What the lint found in one engine's glue: how many upstream names it touches, and the undeclared ones."""

    engine: str
    glue: Path
    hooks_file: str
    modules: int = 0
    touched: set[str] = field(default_factory=set)
    uses: dict[Use, set[Site]] = field(default_factory=dict)  # each declared name touched, and where
    computed_sites: set[str] = field(default_factory=set)  # the computed_in sites the glue has
    undeclared: list[Undeclared] = field(default_factory=list)
    modules_read: set[str] = field(default_factory=set)  # upstream modules declared or imported (for suggest)
    suggested: bool = False  # suggest() looked for the classes that define each undeclared name

    def lines(self) -> list[str]:
        where = show(self.glue)
        if not self.modules:
            return [f"{self.engine}: no glue to lint ({where} holds no Python module)"]
        if not self.undeclared:
            return [f"{self.engine}: the glue ({where}, {self.modules} modules) touches {len(self.touched)} upstream "
                    f"names, every one declared in {self.hooks_file}"]  # fmt: skip
        out = []
        for u in self.undeclared:
            out.append(u.text())
            if u.candidates:
                out.append(f"    defined upstream by: {', '.join(u.candidates)}")
            elif self.suggested and "(" not in u.name and ":" not in u.name:
                out.append("    no upstream class defines it: if it is ours or a library's, it belongs in "
                           f"{show(ALLOW_FILE)}")  # fmt: skip
        out.append(
            f"{self.engine}: {len(self.undeclared)} upstream name(s) the glue touches are not declared. Declare each "
            f"in {self.hooks_file}: a name on an upstream class under the [[attrs]] of that class (a method the glue "
            "calls with keywords as a [[hook]] with its params), an imported function or class as a [[hook]], a "
            "module-level name under the [[attrs]] of its module; each with why (no used_by: the lint finds the glue's "
            "uses). "
            f"`python -m gptools hooks --engine {self.engine} --undeclared` names the upstream classes that define "
            "each. A name that is not upstream's (ours, torch's, the standard library's) belongs in "
            f"{show(ALLOW_FILE)}, with why."
        )
        return out

    def to_json(self) -> dict:
        return {
            "glue": str(self.glue),
            "modules": self.modules,
            "touched": len(self.touched),
            "undeclared": [asdict(u) for u in self.undeclared],
        }

    def suggest(self, tree: Path | None) -> None:
        """Fill each undeclared attribute's candidates: the upstream classes in `tree` that define it, looked for in
        the modules the contract declares and the glue imports, then in their packages, then everywhere."""
        if tree is None or not self.undeclared:
            return
        self.suggested = True
        t = Tree(tree)
        wanted = [(u, u.name.split("(")[0].rsplit(".", 1)[-1].rsplit(":", 1)[-1]) for u in self.undeclared]
        for u, name in wanted:  # read on an upstream class the lint knows: that class, when it has the name
            for owner in u.owners:
                found, _ = t.class_attributes(*owner.split(":", 1))
                if found is not None and name in found.names:
                    u.candidates.append(owner)
        near = sorted(self.modules_read)
        packages = sorted({m.rpartition(".")[0] for m in near if "." in m})
        tiers = [near, _modules_under(tree, packages), _modules_under(tree, sorted({m.split(".")[0] for m in near}))]
        seen: set[str] = set()
        for modules in tiers:
            todo = {n for u, n in wanted if not u.candidates}
            if not todo:
                return
            for module in modules:
                if module in seen:
                    continue
                seen.add(module)
                path = t.module_file(module)
                text = path.read_text(encoding="utf-8", errors="replace") if path is not None else ""
                if not any(name in text for name in todo):
                    continue  # most files name none of them: skip parsing those
                info = t.module(module)
                if isinstance(info, str):
                    continue
                for node in ast.walk(info.tree):
                    if isinstance(node, ast.ClassDef):
                        found = own_attributes(node) & todo
                        for u, name in wanted:
                            if name in found and len(u.candidates) < 6:
                                u.candidates.append(f"{module}:{node.name}")


def _modules_under(tree: Path, packages: list[str]) -> list[str]:
    out: list[str] = []
    for package in packages:
        base = tree.joinpath(*package.split("."))
        for path in sorted(base.rglob("*.py")) if base.is_dir() else []:
            rel = path.relative_to(tree).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append(".".join(parts))
    return out


def lint(engine: str, contract: Contract, glue: Path, *, runtime: Path | None = None, allow: Allow | None = None,
         patches_dir: Path | None = None, root: Path | None = None) -> LintReport:  # fmt: skip
    """Lint an engine's glue (`glue` is overlays/<engine>) against its declared contract. `root` (default: `glue`)
    is the folder the glue's module names start from (tools/ for tools/gpdiag, whose modules are gpdiag.*)."""
    from gpdist import REPO_ROOT

    report = LintReport(engine, glue, show(contract.path))
    if not glue.is_dir():
        return report
    runtime = runtime if runtime is not None else REPO_ROOT / "overlays" / "graphpersist"
    allow = allow if allow is not None else load_allow()
    root = root if root is not None else glue
    names = {".".join(p.relative_to(root).with_suffix("").parts) for p in glue.rglob("*.py")}
    patches = patches_dir or contract.path.parent
    entries = entry_points(patches, names)
    analysis = Analysis(engine, contract, glue, allow, ours_names(runtime, glue), entries, patch_names(patches),
                        root=root)  # fmt: skip
    analysis.run()
    report.modules = len(analysis.modules)
    report.touched = analysis.touched
    report.uses = analysis.uses
    report.computed_sites = analysis.computed_sites
    report.undeclared = sorted(analysis.found.values(), key=lambda u: (u.path, u.line, u.name))
    report.modules_read = analysis.imported_modules | set(contract.modules)
    return report
