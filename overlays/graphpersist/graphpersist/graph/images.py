"""Kernel images: which loaded image (by content hash) each graph kernel comes from, and reloading them.

SAVE maps a graph node's CUfunction to its owning CUmodule (cuFuncGetModule) and that module to an image the
interposer saw being loaded (cuModuleLoad* directly, cuLibraryLoadData through cuLibraryGetModule). LOAD loads
the saved bytes again and resolves (image hash, kernel name) to a live CUfunction, which also forces the lazy
loader to load the function now rather than at first replay.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass, field
from typing import Any

from graphpersist.graph.format import SETTABLE_FUNC_ATTRS
from graphpersist.memory import region

# (offset, size) of each kernel parameter, as cuFuncGetParamInfo answers for a live function.
ParamLayout = tuple[tuple[int, int], ...]
_MAX_PARAMS = 4096  # what the native rebuild takes (gp_add_kernel_nodes)


class ImageError(RuntimeError):
    """A kernel image cannot be found, trusted or loaded."""


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def check(result: tuple | Any, what: str) -> Any:
    """Unwraps a cuda-bindings (err, *values) result; raises naming the call on failure."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise ImageError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


@dataclass
class ImageTable:
    """The images this process loaded, keyed by module handle, with their content hashes computed on demand."""

    by_module: dict[int, region.ImageLoad] = field(default_factory=dict)
    by_sha: dict[str, region.ImageLoad] = field(default_factory=dict)
    _sha: dict[int, str] = field(default_factory=dict)
    kernels: dict[int, Any] = field(default_factory=dict)  # per CUfunction: what graphwalk reads once (see there)
    fresh_attrs: dict[tuple[int, int], int] = field(default_factory=dict)  # per (CUfunction, attribute): see there

    @classmethod
    def current(cls) -> ImageTable:
        drv = _driver()
        table = cls()
        for load in region.image_loads():
            if load.kind == "library":
                err, mod = drv.cuLibraryGetModule(drv.CUlibrary(load.handle))
                if int(err) != 0:
                    continue  # unloaded since, or not for this context
                table.by_module[int(mod)] = load
            else:
                table.by_module[load.handle] = load
        return table

    def resolve(self, func: Any) -> tuple[str, str, region.ImageLoad]:
        """(image sha256, kernel name, image load) for a CUfunction; refuses kernels from unrecorded images."""
        drv = _driver()
        name = check(drv.cuFuncGetName(func), "cuFuncGetName")
        name = name.decode() if isinstance(name, bytes) else str(name)
        mod = int(check(drv.cuFuncGetModule(func), f"cuFuncGetModule({name})"))
        load = self.by_module.get(mod)
        if load is None:
            raise ImageError(
                f"kernel {name!r}: its module {mod:#x} was not loaded through the interposer "
                "(loaded before LD_PRELOAD took effect, or from a file with cuModuleLoad/cuLibraryLoadFromFile)"
            )
        if mod not in self._sha:
            self._sha[mod] = hashlib.sha256(load.data()).hexdigest()
            self.by_sha[self._sha[mod]] = load
        return self._sha[mod], name, load


def param_layout(func: Any, name: str) -> ParamLayout:
    """The live function's parameter layout, what the driver reads from each kernelParams entry at launch: one
    native call (gp_func_param_layout) instead of one cuda-bindings call per parameter. Needs the interposer."""
    words = (ctypes.c_uint32 * (1 + 2 * _MAX_PARAMS))()
    n = region.lib().gp_func_param_layout(int(func), words, len(words))
    if n < 0:
        raise ImageError(f"kernel {name!r}: cannot read its parameter layout: {region.last_error()}")
    flat = words[1 : 1 + 2 * n]
    return tuple(zip(flat[0::2], flat[1::2], strict=True))


def func_attributes(func: Any) -> dict[str, int]:
    """The settable function attributes of a live CUfunction (see SETTABLE_FUNC_ATTRS)."""
    drv = _driver()
    out = {}
    for attr in SETTABLE_FUNC_ATTRS:
        err, value = drv.cuFuncGetAttribute(drv.CUfunction_attribute(attr), func)
        if int(err) == 0:
            out[str(attr)] = int(value)
    return out


@dataclass
class LoadedImages:
    """Images loaded at LOAD, plus (sha, name) -> CUfunction with the saved attributes applied."""

    handles: dict[str, Any] = field(default_factory=dict)
    funcs: dict[tuple[str, str], Any] = field(default_factory=dict)
    keep: list[bytes] = field(default_factory=list)
    layouts: dict[tuple[str, str], ParamLayout] = field(default_factory=dict)

    def load(self, sha: str, kind: str, data: bytes, *, verified: bool = False) -> None:
        """Loads one image after checking its bytes hash to `sha` (a tampered image is refused here).

        `verified=True` skips that hash for bytes already proven to hash to `sha` (an archive read whose file
        table entry open_archive checked equals the image's sha256).
        """
        got = sha if verified else hashlib.sha256(data).hexdigest()
        if got != sha:
            raise ImageError(f"kernel image {sha[:16]}… is tampered: its bytes hash to {got[:16]}…; refusing to load")
        drv = _driver()
        self.keep.append(data)
        if kind == "library":
            self.handles[sha] = check(drv.cuLibraryLoadData(data, None, None, 0, None, None, 0), "cuLibraryLoadData")
        else:
            self.handles[sha] = check(drv.cuModuleLoadData(data), "cuModuleLoadData")

    def function(self, sha: str, name: str, attrs: dict[str, int]) -> Any:
        key = (sha, name)
        fn = self.funcs.get(key)
        if fn is not None:
            return fn
        drv = _driver()
        handle = self.handles.get(sha)
        if handle is None:
            raise ImageError(
                f"kernel {name!r} needs image {sha[:16]}…, which the archive's rank record does not list: the graph "
                "description and the image list disagree (a damaged or hand-edited archive); re-run SAVE"
            )
        if isinstance(handle, drv.CUlibrary):
            kern = check(drv.cuLibraryGetKernel(handle, name.encode()), f"cuLibraryGetKernel({name})")
            fn = check(drv.cuKernelGetFunction(kern), f"cuKernelGetFunction({name})")
        else:
            fn = check(drv.cuModuleGetFunction(handle, name.encode()), f"cuModuleGetFunction({name})")
        fresh = func_attributes(fn)
        for attr, value in attrs.items():
            if fresh.get(attr) != value:
                check(
                    drv.cuFuncSetAttribute(fn, drv.CUfunction_attribute(int(attr)), value),
                    f"cuFuncSetAttribute({name}, {attr}={value})",
                )
        self.funcs[key] = fn
        return fn

    def layout(self, sha: str, name: str, attrs: dict[str, int]) -> ParamLayout:
        """The parameter layout of function(sha, name, attrs), asked of the driver once per function: LOAD checks
        every kernel row of the archive against it (gp_add_kernel_nodes), ~80000 rows of a few hundred functions."""
        key = (sha, name)
        got = self.layouts.get(key)
        if got is None:
            got = self.layouts[key] = param_layout(self.function(sha, name, attrs), name)
        return got
