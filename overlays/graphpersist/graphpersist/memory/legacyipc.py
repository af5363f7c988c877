"""CUDA IPC handles in the driver's legacy form (cuIpcGetMemHandle / cuIpcOpenMemHandle), for an engine's post-capture
registration that opens its peers' buffers that way (vLLM's custom all-reduce). Under the runtime's interposer both
calls go through its VMM-IPC (graphpersist/native/gp_ipc_hooks.c), so an opened peer buffer lands at the address the
archive expects; the handles are exchanged over the engine's own CPU group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphpersist.errors import PersistError


def _check(drv: Any, err: Any, what: str) -> None:
    if err != drv.CUresult.CUDA_SUCCESS:
        raise PersistError(f"graphpersist: {what} failed ({err.name})")


def export_handle(ptr: int) -> bytes:
    """The IPC handle of the allocation holding `ptr` (one export per allocation, as the engines' C++ sides do)."""
    from cuda.bindings import driver as drv

    err, base = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)
    _check(drv, err, f"cuPointerGetAttribute(RANGE_START_ADDR, {ptr:#x})")
    err, handle = drv.cuIpcGetMemHandle(int(base))
    _check(drv, err, f"cuIpcGetMemHandle({int(base):#x})")
    return bytes(handle.reserved)


def open_handle(raw: bytes) -> int:
    """A peer's allocation opened from its handle (peer access enabled lazily); its address in this process."""
    from cuda.bindings import driver as drv

    handle = drv.CUipcMemHandle()
    handle.reserved = raw
    err, ptr = drv.cuIpcOpenMemHandle(handle, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    _check(drv, err, "cuIpcOpenMemHandle")
    return int(ptr)


def open_peers(own: list[int], gather: Callable[[Any], list[Any]], rank: int) -> dict[bytes, int]:
    """LOAD, for a registration that opened its peers' buffers after the capture (vLLM's custom all-reduce): each rank
    exports the handle of each of its buffers `own` (one export call per buffer, as the engine's C++ side does), the
    ranks exchange them over `gather`, and each peer's handle is opened once, buffer by buffer and peer by peer in
    rank order, the order the engine opened them at SAVE. Returns the opened allocations by handle (keep them)."""
    everyone = gather([export_handle(ptr) for ptr in own])
    opened: dict[bytes, int] = {}
    for i in range(len(own)):
        for peer, handles in enumerate(everyone):
            if peer != rank and handles[i] not in opened:
                opened[handles[i]] = open_handle(handles[i])
    return opened
