"""The structure of a graph's outputs as JSON: nested tuples, lists, dicts and dataclasses of tensors and values.

A captured forward returns whatever the model returns (a tensor, a tuple of hidden states and residuals, a
dataclass of logits and aux tensors, None for absent parts). SAVE records that shape with a spec at every tensor
(`encode`), LOAD rebuilds the same shape with live tensors at the saved addresses (`decode`). Leaves are handled
by the caller's functions, so this module needs neither torch nor CUDA:

    {"kind": "tensor", "spec": {...}}                     a leaf (the caller's spec)
    {"kind": "value", "value": 3}                         None, bool, int, finite float, str
    {"kind": "tuple" | "list", "items": [...]}
    {"kind": "dict", "keys": [...], "items": [...]}       keys: str or int, in insertion order
    {"kind": "dataclass", "class": "module:Qual.Name", "fields": {"name": ..., ...}}

Dataclasses are rebuilt by calling the class with their fields, so only classes reachable by their qualified
name (not defined inside a function) whose fields all take part in __init__ are accepted; SAVE refuses others,
and LOAD refuses a class it cannot find or that is no longer a dataclass, naming it. LOAD looks a class up only in
modules the process has already imported: an archive names a module, and reading one must never import (run) code
the engine did not load itself.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable
from typing import Any


class StructureError(ValueError):
    """An output structure that cannot be persisted (SAVE) or rebuilt (LOAD); the message names where."""


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> Any:
    """The object a `module:Qual.Name` string names in an already imported module (never importing one), or None."""
    module, _, qual = name.partition(":")
    obj: Any = sys.modules.get(module)
    if obj is None:
        return None
    try:
        for part in qual.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        return None
    return obj


def encode(obj: Any, leaf: Callable[[Any], dict[str, Any] | None], where: str = "outputs") -> dict[str, Any]:
    """The JSON tree of `obj`; `leaf(x)` returns the spec of a leaf (a tensor) or None for anything else."""
    spec = leaf(obj)
    if spec is not None:
        return {"kind": "tensor", "spec": spec}
    if obj is None or isinstance(obj, (bool, int, str)):
        return {"kind": "value", "value": obj}
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise StructureError(f"{where}: the float {obj!r} cannot be stored (JSON has no NaN or infinity)")
        return {"kind": "value", "value": obj}
    if type(obj) in (tuple, list):
        kind = type(obj).__name__
        return {"kind": kind, "items": [encode(x, leaf, f"{where}[{i}]") for i, x in enumerate(obj)]}
    if type(obj) is dict:
        keys = list(obj)
        for k in keys:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise StructureError(f"{where}: dict key {k!r} is not a str or int")
        return {"kind": "dict", "keys": keys, "items": [encode(obj[k], leaf, f"{where}[{k!r}]") for k in keys]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        name = _qualified(cls)
        if _resolve(name) is not cls:
            raise StructureError(
                f"{where}: dataclass {name} cannot be imported by its qualified name (defined inside a function?), "
                "so LOAD could not rebuild it: define it at module level"
            )
        fields = dataclasses.fields(obj)
        no_init = [f.name for f in fields if not f.init]
        if no_init:
            raise StructureError(f"{where}: dataclass {name} has fields outside __init__ ({', '.join(no_init)})")
        return {
            "kind": "dataclass",
            "class": name,
            "fields": {f.name: encode(getattr(obj, f.name), leaf, f"{where}.{f.name}") for f in fields},
        }
    raise StructureError(
        f"{where}: {type(obj).__module__}.{type(obj).__qualname__} is not a tensor, None, bool, int, float, str, "
        "tuple, list, dict or dataclass; return one of those from the captured function"
    )


def decode(tree: Any, leaf: Callable[[dict[str, Any]], Any], where: str = "outputs") -> Any:
    """Rebuilds the structure `encode` recorded; `leaf(spec)` makes the live leaf (a tensor at its address)."""
    kind = tree.get("kind") if isinstance(tree, dict) else None
    if kind == "tensor":
        return leaf(tree["spec"])
    if kind == "value":
        return tree["value"]
    if kind in ("tuple", "list"):
        items = [decode(x, leaf, f"{where}[{i}]") for i, x in enumerate(tree["items"])]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        if len(tree["keys"]) != len(tree["items"]):
            raise StructureError(f"{where}: damaged dict record ({len(tree['keys'])} keys, {len(tree['items'])} items)")
        return {k: decode(v, leaf, f"{where}[{k!r}]") for k, v in zip(tree["keys"], tree["items"], strict=True)}
    if kind == "dataclass":
        name = tree["class"]
        cls = _resolve(name)
        if cls is None:
            raise StructureError(
                f"{where}: output dataclass {name} is not loaded in this process: LOAD refused (LOAD never imports "
                "a module an archive names; load the engine code that defines it before LOAD, or re-run SAVE)"
            )
        if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
            raise StructureError(f"{where}: {name} is not a dataclass any more: LOAD refused (re-run SAVE)")
        fields = {k: decode(v, leaf, f"{where}.{k}") for k, v in tree["fields"].items()}
        want = {f.name for f in dataclasses.fields(cls) if f.init}
        if set(fields) != want:
            raise StructureError(
                f"{where}: dataclass {name} now has fields {sorted(want)}, SAVE recorded {sorted(fields)}: "
                "LOAD refused (re-run SAVE)"
            )
        return cls(**fields)
    raise StructureError(f"{where}: damaged output record {tree!r}")


def leaves(tree: Any) -> list[dict[str, Any]]:
    """The leaf specs of a tree in encode order (e.g. every output tensor's spec)."""
    kind = tree.get("kind") if isinstance(tree, dict) else None
    if kind == "tensor":
        return [tree["spec"]]
    if kind in ("tuple", "list", "dict"):
        return [s for x in tree["items"] for s in leaves(x)]
    if kind == "dataclass":
        return [s for x in tree["fields"].values() for s in leaves(x)]
    return []


MAX_DEPTH = 64  # output structures are a few levels deep; a deeper record is damaged (and would recurse too far)
_CLASS = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def check(tree: Any, leaf: Callable[[Any, str], None], where: str = "outputs", depth: int = 0) -> None:
    """Refuses (StructureError naming where) a record `decode` could not walk: an unknown kind, items that are not
    lists, dict keys that are not str or int or do not pair with their items, a dataclass name that is not
    `module:Qual.Name`, a value that is not JSON's scalar, nesting deeper than MAX_DEPTH. `leaf(spec, where)` checks
    each tensor's spec. Imports nothing: whether a dataclass still exists is LOAD's question (decode)."""
    if depth > MAX_DEPTH:
        raise StructureError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    kind = tree.get("kind") if isinstance(tree, dict) else None
    if kind == "tensor" and set(tree) == {"kind", "spec"}:
        leaf(tree["spec"], where)
    elif kind == "value" and set(tree) == {"kind", "value"}:
        value = tree["value"]
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise StructureError(f"{where}: a value record holds a {type(value).__name__}")
    elif kind in ("tuple", "list") and set(tree) == {"kind", "items"} and type(tree["items"]) is list:
        for i, x in enumerate(tree["items"]):
            check(x, leaf, f"{where}[{i}]", depth + 1)
    elif kind == "dict" and set(tree) == {"kind", "keys", "items"} and type(tree["keys"]) is list:
        keys, items = tree["keys"], tree["items"]
        if type(items) is not list or len(items) != len(keys):
            raise StructureError(f"{where}: damaged dict record (keys and items differ in number)")
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys) or len(set(keys)) != len(keys):
            raise StructureError(f"{where}: dict keys must be distinct strings or integers")
        for k, v in zip(keys, items, strict=True):
            check(v, leaf, f"{where}[{k!r:.40}]", depth + 1)
    elif kind == "dataclass" and set(tree) == {"kind", "class", "fields"} and type(tree["fields"]) is dict:
        name = tree["class"]
        if not isinstance(name, str) or not _CLASS.fullmatch(name):
            raise StructureError(f"{where}: dataclass name {str(name)[:80]!r} is not module:Qual.Name")
        for k, v in tree["fields"].items():
            if not k.isidentifier():
                raise StructureError(f"{where}: dataclass field {k[:40]!r} is not a name")
            check(v, leaf, f"{where}.{k}", depth + 1)
    else:
        raise StructureError(f"{where}: damaged output record ({'kind ' + repr(kind)[:40] if kind else 'no kind'})")
