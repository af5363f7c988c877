"""Tensors at recorded addresses: the spec SAVE writes for a static tensor and the view LOAD rebuilds from it."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from graphpersist.archive.shown import shown
from graphpersist.errors import PersistError


@functools.cache
def dtypes() -> dict[str, torch.dtype]:
    """torch's dtypes by the name tensor specs write (str(dtype) without "torch."). LOAD finds a saved name in this
    table, never by getattr on the torch module: an archive string must not pick a module attribute (torch's
    __getattr__ even imports submodules by name). Made on first use (stand-in torch modules in tests have no dtypes)."""
    return {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def tensor_key(t: torch.Tensor) -> list[Any]:
    """[address, dtype, shape, stride]: what must match for a named setup tensor."""
    return [t.data_ptr(), str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride())]


def tensor_spec(t: torch.Tensor) -> dict[str, Any]:
    return {
        "addr": t.data_ptr(),
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "stride": list(t.stride()),
    }


class _RawCuda:
    """A device pointer presented through __cuda_array_interface__ so torch can view it without copying."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def tensor_at(spec: Mapping[str, Any]) -> torch.Tensor:
    """A tensor over the recorded address (memory owned by the region, not by torch's allocator)."""
    dtype = dtypes().get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise PersistError(f"tensor spec: dtype {shown(repr(spec['dtype']), 60)} is not a torch dtype: LOAD refused")
    item = torch.empty(0, dtype=dtype).element_size()
    extent = 1 + sum((s - 1) * st for s, st in zip(spec["shape"], spec["stride"], strict=True) if s > 0)
    if any(s == 0 for s in spec["shape"]):
        extent = 0
    raw = torch.as_tensor(_RawCuda(spec["addr"], max(extent, 1) * item), device="cuda")
    return raw.view(dtype).as_strided(spec["shape"], spec["stride"])


def bytes_at(addr: int, nbytes: int) -> torch.Tensor:
    """The `nbytes` bytes at device address `addr` as a uint8 tensor (a view, no copy)."""
    return tensor_at({"addr": addr, "dtype": "uint8", "shape": [nbytes], "stride": [1]})
