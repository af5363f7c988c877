"""vLLM's custom all-reduce under persistence: its post-capture registration as a phase LOAD re-runs
(patches/vllm/README.md, "Custom all-reduce")."""

from __future__ import annotations

import re
import struct
from typing import Any

import torch
import torch.distributed as dist

from graphpersist import engine
from graphpersist.engine import PersistError

PHASE = "custom_all_reduce"
STATE = "custom_all_reduce.rank_data"
ROW_BYTES = 64  # RankData: 8 device pointers
FIRST_GRAPH_ROW = 1  # row 0 holds the eager input buffer registered at init (register_buffer)


# `cross_device_reduce_{1,2}stage<T, ngpus>(RankData*, RankSignals, ...)`: 8 peer pointers by value, `ngpus` read.
_ALLREDUCE = re.compile(r"cross_device_reduce_[12]stage.*?Li(\d+)EE.*RankSignals")
_SIGNALS_PARAM, _SIGNAL_SLOTS = 1, 8


def unused_param_bytes(kernel: str, layout: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parameter bytes a custom all-reduce kernel never reads (its `RankSignals` slots past the world size),
    for the runtime's SAVE to write as zeros (graphpersist.save.Saver.unused_param_bytes); none for other kernels."""
    found = _ALLREDUCE.search(kernel)
    if found is None or len(layout) <= _SIGNALS_PARAM:
        return []
    ngpus = int(found.group(1))
    offset, size = layout[_SIGNALS_PARAM]
    if size != 8 * _SIGNAL_SLOTS or not 0 < ngpus <= _SIGNAL_SLOTS:
        raise PersistError(
            f"graphpersist: custom all-reduce kernel {kernel!r} has a {size}-byte RankSignals parameter for "
            f"{ngpus} GPUs; this integration expects {8 * _SIGNAL_SLOTS} bytes (8 peer pointers): SAVE refused"
        )
    return [(offset + 8 * ngpus, offset + size)] if ngpus < _SIGNAL_SLOTS else []


def register_graph_buffers(ca: Any) -> None:
    """Called where upstream calls `ca.register_graph_buffers()` at the end of capture."""
    sess = engine.current()
    if sess is None or not sess.saving:
        ca.register_graph_buffers()
        return
    from vllm import _custom_ops as ops

    with sess.phase(PHASE):
        _, offsets = ops.get_graph_buffer_ipc_meta(ca._ptr)  # what upstream's call below exports, counted
        ca.register_graph_buffers()
    torch.cuda.synchronize()
    sess.declare_state(STATE, ca.rank_data, how="bytes")
    sess.notes[PHASE] = {"own_pointers": _own_pointers(ca, len(offsets)), "world_size": dist.get_world_size(ca.group)}


def _own_pointers(ca: Any, n: int) -> list[int]:
    """This rank's buffer of each registered row, read back from rank_data (column `rank` of rows 1..n)."""
    rows = ca.rank_data[FIRST_GRAPH_ROW * ROW_BYTES : (FIRST_GRAPH_ROW + n) * ROW_BYTES].cpu().numpy().tobytes()
    rank = dist.get_rank(ca.group)  # its place in the group, as CustomAllreduce computes it
    own = [struct.unpack_from("<Q", rows, i * ROW_BYTES + 8 * rank)[0] for i in range(n)]
    if n and (0 in own or len(rows) != n * ROW_BYTES):
        raise PersistError(
            f"graphpersist: custom all-reduce registered {n} graph buffers, but rank_data rows "
            f"{FIRST_GRAPH_ROW}..{FIRST_GRAPH_ROW + n - 1} do not hold them (the C++ layout changed?): SAVE refused"
        )
    return own


def active() -> Any:
    """This rank's custom all-reduce when it is on (TP > 1 and not disabled), else None."""
    from vllm.distributed.parallel_state import get_tp_group

    comm = getattr(get_tp_group(), "device_communicator", None)
    ca = getattr(comm, "ca_comm", None)
    return ca if ca is not None and not ca.disabled else None


class CustomAllReduce(engine.Communicator):
    """vLLM's custom all-reduce as the session sees it: SAVE registers inside upstream's capture
    (`register_graph_buffers`), LOAD re-opens the peers' graph buffers at SAVE's addresses."""

    name = PHASE

    def restore(self, session: engine.PersistSession, notes: Any) -> None:
        """LOAD: re-open the peers' graph buffers at SAVE's addresses and declare the saved rows."""
        ca = active()
        saved = notes.get(PHASE)
        if ca is None and saved is None:
            return
        if ca is None or saved is None:
            live = "on" if ca is not None else "off"
            raise PersistError(
                f"graphpersist: custom all-reduce is {live} in this LOAD but was "
                f"{'off' if saved is None else 'on'} at SAVE. Re-run with mode=save for this configuration."
            )
        own = [int(p) for p in saved["own_pointers"]]
        with session.phase(PHASE):  # the handles go over the group's CPU (gloo) side
            opened = engine.open_peers(own, engine.torch_gather(ca.group), dist.get_rank(ca.group))
            session.kept.append(opened)
        session.declare_state(STATE, ca.rank_data, how="bytes")
        session.log("custom all-reduce: %d graph buffers, %d peer allocations re-opened", len(own), len(opened))
