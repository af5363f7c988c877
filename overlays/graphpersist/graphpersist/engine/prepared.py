"""State an engine prepares in setup for its captures, which its graphs read but the address layout does not prove.

An attention backend may keep metadata per captured shape (entries keyed by a captured batch size) that it fills
before each capture; made in setup, SAVE and LOAD own it at the same addresses. The session proves it (its `graphs`
step, `prepared=`): SAVE, that the captures left it as prepared (else LOAD could not prepare what the graphs read),
recording it in the rank's notes; LOAD, that what it prepared is SAVE's, before anything is installed. A refusal names
the first path that differs, both values and how many differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from graphpersist.errors import PersistError

Described = dict[str, list[Any]]  # path -> [address, dtype, shape, strides]
_PLAIN = (str, bytes, int, float, bool, type(None))


def per_shape_tensors(root: Any, name: str, sizes: Iterable[int], depth: int = 4) -> Described:
    """The CUDA tensors reachable from `root` (named `name`) under a dict entry keyed by one of `sizes`, through
    dicts, lists, tuples and plain objects at most `depth` levels down, each as [address, dtype, shape, strides] by
    its path. Modules are not entered: their parameters and buffers are setup tensors, proven elsewhere."""
    import torch

    wanted = set(sizes)
    found: Described = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, level: int, per_shape: bool) -> None:
        if isinstance(obj, torch.Tensor):
            if per_shape and obj.is_cuda:
                found[path] = [obj.data_ptr(), str(obj.dtype), list(obj.shape), list(obj.stride())]
            return
        if level > depth or id(obj) in seen or isinstance(obj, _PLAIN):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in obj.items():
                if isinstance(k, (str, int)):
                    walk(v, f"{path}[{k!r}]", level + 1, per_shape or (isinstance(k, int) and k in wanted))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]", level + 1, per_shape)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            for k, v in vars(obj).items():
                walk(v, f"{path}.{k}", level + 1, per_shape)

    walk(root, name, 0, False)
    return found


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The paths whose state differs between `a` and `b` (present in one only, or not equal)."""
    return sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))


@dataclass(frozen=True)
class PreparedState:
    """One engine's prepared state: `read()` describes it now; SAVE records it in the rank's notes under `note`."""

    note: str  # the notes key ("attn_shapes")
    what: str  # how refusals name it ("the attention backend's per-shape state")
    read: Callable[[], Described]
    advice: str  # what SAVE's refusal tells the user to use instead

    def after_capture(self, prepared: Described) -> Described:
        """SAVE, once every graph is captured: refused when the captures changed what setup prepared."""
        captured = self.read()
        if changed := _differences(prepared, captured):
            first = changed[0]
            raise PersistError(
                f"graphpersist: {self.what} changed during the capture ({first}: prepared {prepared.get(first)}, "
                f"captured {captured.get(first)}; {len(changed)} in all), so LOAD could not prepare it exactly: SAVE "
                f"refused ({self.advice})"
            )
        return prepared

    def check_saved(self, prepared: Described, notes: Mapping[str, Any]) -> None:
        """LOAD, before anything is installed: refused when what setup prepared here is not SAVE's."""
        saved = notes.get(self.note, {})
        if changed := _differences(prepared, saved):
            first = changed[0]
            raise PersistError(
                f"graphpersist: {self.what} differs from SAVE's ({first}: saved {saved.get(first)}, live "
                f"{prepared.get(first)}; {len(changed)} in all): LOAD refused. Re-run with mode=save for this "
                "configuration."
            )
