"""Breakable graphs, for any engine that captures them: a graph captured as segments with an eager call (a "break")
between two, replayed by launching the segments and making the calls again.

SAVE records each break as a call record (graphpersist.graph.structure): the function by its id in the engine's
registry, its arguments and output as data (tensors by address, modules of the live model by their name in it,
plain values). Each segment is an ordinary graph of the archive, named `<base>/<segment>`. LOAD rebuilds every replay
function from the live registry alone, before anything is installed: an archive is data, never code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from graphpersist.errors import PersistError
from graphpersist.graph import structure

MODULE_KEY = "module"  # a leaf that is a module of the model: {"module": "<its name in model.named_modules()>"}


class Registry(Mapping[str, Any]):
    """id -> a live object of the engine, each found on first use by the finder the engine's glue wrote for it (an
    entry whose module this process cannot import is absent: `in` is False, `get` None). A lookup runs only the
    glue's own finder for that id: the archive's string never reaches an import or an attribute walk."""

    def __init__(self, finders: Mapping[str, Callable[[], Any]]) -> None:
        self._finders = finders
        self._found: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._found:
            finder = self._finders[key]  # KeyError: not an id of this registry
            try:
                self._found[key] = finder()
            except (ImportError, AttributeError):
                raise KeyError(key) from None
        return self._found[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._finders)

    def __len__(self) -> int:
        return len(self._finders)


def segment_name(base: str, index: int) -> str:
    return f"{base}/{index:03d}"


def _leaf(model: Any, tensor_spec: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any] | None]:
    """A break argument as data: a tensor by its spec, a module of `model` by its name in it, else None."""
    names: dict[int, str] | None = None

    def leaf(x: Any) -> dict[str, Any] | None:
        nonlocal names
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        if isinstance(x, torch.Tensor):
            return tensor_spec(x)
        if model is None or not isinstance(x, torch.nn.Module):
            return None
        if names is None:
            names = {id(m): name for name, m in model.named_modules()}
        if id(x) not in names:
            raise structure.StructureError(f"the module {type(x).__name__} is not part of the model")
        return {MODULE_KEY: names[id(x)]}

    return leaf


def _view(model: Any, tensor_at: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """LOAD: a leaf back to its live object: a tensor at its address, or the model's module of that name (looked up
    among `model.named_modules()`: data of the live model, never an attribute walk by the archive's string)."""
    modules: dict[str, Any] | None = None

    def view(spec: dict[str, Any]) -> Any:
        nonlocal modules
        if MODULE_KEY not in spec:
            return tensor_at(spec)
        if modules is None:
            modules = dict(model.named_modules()) if model is not None else {}
        found = modules.get(spec[MODULE_KEY])
        if found is None:
            raise structure.StructureError(f"the model has no module {structure.shown(repr(spec[MODULE_KEY]), 80)}")
        return found

    return view


def record_break(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, *, model: Any, functions: Registry,
    types: Registry, tensor_spec: Callable[[Any], dict[str, Any]], instead: str, owner: str, where: str
) -> dict[str, Any]:  # fmt: skip
    """SAVE: the call record of one break (`fn(*args, **kwargs)` returned `output`, tensors recorded by
    `tensor_spec`); refuses a function `owner`'s registry (the glue file `where`) lacks, or arguments that are not
    data, saying what to do `instead`."""
    fn_id = structure.registered_id(fn, functions)
    if fn_id is None:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
        raise PersistError(
            f"graphpersist: the breakable CUDA graph breaks at {name}, which is not in {owner}'s registry of break "
            f"functions ({', '.join(functions)}), so LOAD could not call it again: SAVE refused ({instead}, or add "
            f"it to {where} and declare it in patches/{owner.lower()}/hooks.toml)"
        )
    try:
        leaf = _leaf(model, tensor_spec)
        return structure.encode_call(fn, args, kwargs, output, leaf, f"break {fn_id}", functions, types)
    except structure.StructureError as exc:
        raise PersistError(f"graphpersist: {exc}: SAVE refused ({instead})") from None


def add_breakable(
    sess: Any, base: str, segments: list[Any], n_break_fns: int, breaks: list[dict[str, Any]], stored: Any, *,
    size: int, mode: str
) -> None:  # fmt: skip
    """SAVE: one breakable graph, its segments as graphs of the archive (the last one's output is what replay
    returns) and its breaks in the rank's notes under `mode`/`base`."""
    if len(breaks) != n_break_fns or len(segments) != len(breaks) + 1:
        raise PersistError(
            f"graphpersist: {base}: {len(segments)} segments, {n_break_fns} breaks, {len(breaks)} recorded: the "
            "breakable graph's structure is not what persistence expects: SAVE refused"
        )
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        sess.add_graph(segment_name(base, i), seg, [], stored if last else None, size=size, mode=mode)
    sess.notes[mode][base] = {"size": size, "segments": len(segments), "breaks": breaks}


def rebuild(
    base: str, record: Mapping[str, Any], result: Any, *, model: Any, functions: Registry, types: Registry,
    tensor_at: Callable[[dict[str, Any]], Any], copy_output: Callable[[Any, Any], Any]
) -> tuple[list[Any], list[Callable[[], Any]]]:  # fmt: skip
    """LOAD: (segments, replay functions) of a breakable graph SAVE recorded, each replay function making its call
    again with the live registry's function (tensors at their addresses: `tensor_at`) and `copy_output(saved output,
    new output)` as the capture did."""
    segments = [result[segment_name(base, i)] for i in range(int(record["segments"]))]
    view = _view(model, tensor_at)
    calls = []
    for i, call in enumerate(record["breaks"]):
        try:
            fn, args, kwargs, output = structure.decode_call(call, view, f"{base} break {i}", functions, types)
        except structure.StructureError as exc:
            raise PersistError(f"graphpersist: {exc}") from None
        calls.append(lambda fn=fn, args=args, kwargs=kwargs, output=output: copy_output(output, fn(*args, **kwargs)))
    return segments, calls
