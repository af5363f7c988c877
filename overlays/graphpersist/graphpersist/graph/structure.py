"""The structure of a graph's outputs as JSON: nested tuples, lists, dicts and dataclasses of tensors and values.

A captured forward returns whatever the model returns (a tensor, a tuple of hidden states and residuals, a
dataclass of logits and aux tensors, None for absent parts). SAVE records that shape with a spec at every tensor
(`encode`), LOAD rebuilds the same shape with live tensors at the saved addresses (`decode`). Leaves are handled
by the caller's functions, so this module needs neither torch nor CUDA:

    {"kind": "tensor", "spec": {...}}                     a leaf (the caller's spec)
    {"kind": "value", "value": 3}                         None, bool, int, finite float, str
    {"kind": "tuple" | "list", "items": [...]}
    {"kind": "dict", "keys": [...], "items": [...]}       keys: str or int, in insertion order
    {"kind": "dataclass", "type": "<id>", "fields": {"name": ..., ...}}

and, in an engine's notes, a function the engine calls again at LOAD with recorded arguments (SGLang's breaks):

    {"kind": "call", "fn": "<id>", "args": <tuple>, "kwargs": <dict>, "output": <any>}

An archive is data, never code. A dataclass or a function is stored as an *id* (ID: lowercase dotted words such as
`sglang.logits_processor_output`) of a registry the live engine's glue declares (`types`: id -> dataclass,
`functions`: id -> callable), never as a module path: SAVE refuses a dataclass or function its registry lacks,
naming it; LOAD looks an id up in the live registry and nowhere else (no import, no getattr on a module, no
sys.modules), and refuses an id the registry lacks, naming it. Because ids have a fixed shape, `check` and
`check_notes` refuse any other name on CPU without the engine; whether the live registry has an id is LOAD's
question (decode, decode_call).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from graphpersist.archive.shown import shown

Registry = Mapping[str, Any]  # id -> the live engine's object (a dataclass, a function), declared by its glue
ID = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)*")  # an id: no module path, no dunder, no attribute walk
MAX_ID = 64
MAX_DEPTH = 64  # output structures are a few levels deep; a deeper record is damaged (and would recurse too far)
REGISTRY_ADVICE = "Re-run with mode=save with this engine release (its registry names what it rebuilds by id)."


class StructureError(ValueError):
    """An output structure that cannot be persisted (SAVE) or rebuilt (LOAD); the message names where."""


class NotAnId(StructureError):
    """A record names a type or a function by something else than a registry id (a module path, a dunder, ...):
    no SAVE writes that, so the archive was edited or forged."""


def is_id(value: Any) -> bool:
    """Whether `value` has the shape of a registry id (what check can know without the engine)."""
    return isinstance(value, str) and len(value) <= MAX_ID and ID.fullmatch(value) is not None


def registered_id(obj: Any, registry: Registry) -> str | None:
    """The id under which `registry` holds exactly `obj` (by identity), None when it holds it under none."""
    for key in registry:
        if registry.get(key) is obj:
            return key
    return None


def _ids(registry: Registry) -> str:
    return ", ".join(sorted(registry)) or "none"


def _lookup(saved: Any, registry: Registry, what: str, where: str) -> Any:
    """LOAD: the live object of id `saved`, looked up in `registry` alone; StructureError naming field, saved value
    and the live registry's ids, then the advice."""
    found = registry.get(saved) if is_id(saved) else None
    if found is None:
        raise StructureError(
            f"{where}: {what} saved {shown(repr(saved), 80)}, live registry holds {_ids(registry)}: LOAD refused. "
            f"{REGISTRY_ADVICE}"
        )
    return found


def encode(
    obj: Any, leaf: Callable[[Any], dict[str, Any] | None], where: str = "outputs", types: Registry | None = None
) -> dict[str, Any]:
    """The JSON tree of `obj`; `leaf(x)` returns the spec of a leaf (a tensor) or None for anything else. A dataclass
    is stored by its id in `types` (the engine's registry of output types); SAVE refuses one the registry lacks."""
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
        return {"kind": kind, "items": [encode(x, leaf, f"{where}[{i}]", types) for i, x in enumerate(obj)]}
    if type(obj) is dict:
        keys = list(obj)
        for k in keys:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise StructureError(f"{where}: dict key {k!r} is not a str or int")
        items = [encode(obj[k], leaf, f"{where}[{k!r}]", types) for k in keys]
        return {"kind": "dict", "keys": keys, "items": items}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _encode_dataclass(obj, leaf, where, types or {})
    raise StructureError(
        f"{where}: {type(obj).__module__}.{type(obj).__qualname__} is not a tensor, None, bool, int, float, str, "
        "tuple, list, dict or dataclass; return one of those from the captured function"
    )


def _encode_dataclass(obj: Any, leaf: Callable[[Any], dict[str, Any] | None], where: str, types: Registry) -> dict:
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    type_id = registered_id(cls, types)
    if type_id is None:
        raise StructureError(
            f"{where}: dataclass {name} is not in the engine's registry of output types (it holds {_ids(types)}), "
            "so LOAD could not rebuild it: SAVE refused. Return a registered type, or add this one to the engine "
            "glue's registry under an id"
        )
    fields = dataclasses.fields(obj)
    no_init = [f.name for f in fields if not f.init]
    if no_init:
        raise StructureError(f"{where}: dataclass {name} has fields outside __init__ ({', '.join(no_init)})")
    return {
        "kind": "dataclass",
        "type": type_id,
        "fields": {f.name: encode(getattr(obj, f.name), leaf, f"{where}.{f.name}", types) for f in fields},
    }


def decode(
    tree: Any, leaf: Callable[[dict[str, Any]], Any], where: str = "outputs", types: Registry | None = None
) -> Any:
    """Rebuilds the structure `encode` recorded; `leaf(spec)` makes the live leaf (a tensor at its address). A
    dataclass comes from `types` (the live engine's registry) by its saved id, from nowhere else."""
    kind = tree.get("kind") if isinstance(tree, dict) else None
    if kind == "tensor":
        return leaf(tree["spec"])
    if kind == "value":
        return tree["value"]
    if kind in ("tuple", "list"):
        items = [decode(x, leaf, f"{where}[{i}]", types) for i, x in enumerate(tree["items"])]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        if len(tree["keys"]) != len(tree["items"]):
            raise StructureError(f"{where}: damaged dict record ({len(tree['keys'])} keys, {len(tree['items'])} items)")
        return {k: decode(v, leaf, f"{where}[{k!r}]", types) for k, v in zip(tree["keys"], tree["items"], strict=True)}
    if kind == "dataclass":
        return _decode_dataclass(tree, leaf, where, types or {})
    raise _damaged(where, kind)


def _damaged(where: str, kind: Any) -> StructureError:
    return StructureError(f"{where}: damaged output record ({'kind ' + shown(repr(kind), 40) if kind else 'no kind'})")


def _decode_dataclass(tree: dict[str, Any], leaf: Callable[[dict[str, Any]], Any], where: str, types: Registry) -> Any:
    type_id = tree.get("type")
    cls = _lookup(type_id, types, "output type", f"{where}.type")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise StructureError(f"{where}.type: the registry's {type_id} is not a dataclass: LOAD refused")
    fields = {k: decode(v, leaf, f"{where}.{k}", types) for k, v in tree["fields"].items()}
    want = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(fields) != want:
        raise StructureError(
            f"{where}: dataclass {type_id} now has fields {sorted(want)}, SAVE recorded {sorted(fields)}: "
            f"LOAD refused. {REGISTRY_ADVICE}"
        )
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:  # the class's own __post_init__ refused the saved values
        raise StructureError(f"{where}: {type_id} refused its saved fields ({shown(str(exc), 120)}): LOAD refused. "
                             f"{REGISTRY_ADVICE}") from None  # fmt: skip


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


def check(tree: Any, leaf: Callable[[Any, str], None], where: str = "outputs", depth: int = 0) -> None:
    """Refuses (StructureError naming where) a record `decode` could not walk: an unknown kind, items that are not
    lists, dict keys that are not str or int or do not pair with their items, a dataclass type that is not an id, a
    value that is not JSON's scalar, nesting deeper than MAX_DEPTH. `leaf(spec, where)` checks each tensor's spec.
    Resolves nothing: whether the live registry has a type id is LOAD's question (decode)."""
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
            check(v, leaf, f"{where}[{shown(repr(k), 40)}]", depth + 1)
    elif kind == "dataclass" and set(tree) == {"kind", "type", "fields"} and type(tree["fields"]) is dict:
        if not is_id(tree["type"]):
            raise NotAnId(f"{where}.type: {shown(repr(tree['type']), 80)} is not a registry id {_ID_SHAPE}")
        for k, v in tree["fields"].items():
            if not k.isidentifier():
                raise StructureError(f"{where}: dataclass field {shown(repr(k), 40)} is not a name")
            check(v, leaf, f"{where}.{k}", depth + 1)
    else:
        raise _damaged(where, kind)


_ID_SHAPE = "(lowercase dotted words: an archive names no module, class, function or attribute path)"

# ------------------------------------------------------------------------------------------- calls (engine notes)


def encode_call(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    leaf: Callable[[Any], dict[str, Any] | None],
    where: str,
    functions: Registry,
    types: Registry | None = None,
) -> dict[str, Any]:
    """SAVE: a call LOAD makes again (`fn(*args, **kwargs)`, which returned `output`), with `fn` by its id in
    `functions` (the engine's registry); refuses a function the registry lacks, naming it."""
    fn_id = registered_id(fn, functions)
    if fn_id is None:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
        raise StructureError(f"{where}: {shown(name, 120)} is not in the engine's registry of functions LOAD calls "
                             f"again (it holds {_ids(functions)})")  # fmt: skip
    return {
        "kind": "call",
        "fn": fn_id,
        "args": encode(tuple(args), leaf, f"{where} args", types),
        "kwargs": encode(dict(kwargs), leaf, f"{where} kwargs", types),
        "output": encode(output, leaf, f"{where} output", types),
    }


def decode_call(
    tree: Any, leaf: Callable[[dict[str, Any]], Any], where: str, functions: Registry, types: Registry | None = None
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Any]:
    """LOAD: (function, args, kwargs, output) of a call record, the function from `functions` (the live registry)
    by its saved id and from nowhere else; the record's shape is checked first (a damaged one is a refusal)."""
    check_call(tree, _any_leaf, where)
    fn = _lookup(tree["fn"], functions, "function", f"{where}.fn")
    if not callable(fn):
        raise StructureError(f"{where}.fn: the registry's {tree['fn']} is not callable: LOAD refused")
    args = decode(tree["args"], leaf, f"{where} args", types)
    kwargs = decode(tree["kwargs"], leaf, f"{where} kwargs", types)
    return fn, args, kwargs, decode(tree["output"], leaf, f"{where} output", types)


def _any_leaf(spec: Any, where: str) -> None:
    if type(spec) is not dict:
        raise StructureError(f"{where}: a leaf's spec must be an object")


def check_call(tree: Any, leaf: Callable[[Any, str], None], where: str) -> None:
    """Refuses a call record `decode_call` could not walk: other keys, a function that is not an id, args that are
    not a tuple record, kwargs that are not a dict record of names, any part `check` refuses."""
    if not (isinstance(tree, dict) and tree.get("kind") == "call" and set(tree) == set(_CALL_KEYS)):
        raise StructureError(f"{where}: damaged call record (it must hold exactly {', '.join(_CALL_KEYS)})")
    if not is_id(tree["fn"]):
        raise NotAnId(f"{where}.fn: {shown(repr(tree['fn']), 80)} is not a registry id {_ID_SHAPE}")
    args, kwargs = tree["args"], tree["kwargs"]
    if not (isinstance(args, dict) and args.get("kind") == "tuple"):
        raise StructureError(f"{where}.args: must be a tuple record")
    if not (isinstance(kwargs, dict) and kwargs.get("kind") == "dict" and type(kwargs.get("keys")) is list
            and all(isinstance(k, str) for k in kwargs["keys"])):  # fmt: skip
        raise StructureError(f"{where}.kwargs: must be a dict record with string keys")
    for part in ("args", "kwargs", "output"):
        check(tree[part], leaf, f"{where}.{part}", 1)


_CALL_KEYS = ("kind", "fn", "args", "kwargs", "output")


def check_notes(notes: Any, leaf: Callable[[Any, str], None], where: str = "engine_notes") -> None:
    """Refuses engine notes whose records name code other than by id. Notes are the engine's free-form JSON, but
    two keys are reserved wherever they appear: an object holding `fn` must be a call record (check_call), and an
    object holding `kind` a structure record (check). So `graphpersist check` refuses, without the engine, any
    module path, dunder or attribute walk where LOAD would look a function or a type up."""
    if isinstance(notes, list):
        for i, x in enumerate(notes):
            check_notes(x, leaf, f"{where}[{i}]")
    elif isinstance(notes, dict):
        if "fn" in notes or notes.get("kind") == "call":
            check_call(notes, leaf, where)
        elif "kind" in notes:
            check(notes, leaf, where)
        else:
            for k, v in notes.items():
                check_notes(v, leaf, f"{where}.{shown(str(k), 60)}")
