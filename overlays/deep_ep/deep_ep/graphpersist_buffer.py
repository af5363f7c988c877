"""DeepEP under graph persistence: which Buffer settings a start with persistence on may use.

The patched ``deep_ep/buffer.py`` calls ``buffer_settings()`` first thing in ``Buffer.__init__`` (before any device
work), and ``refuse_unsupported()`` where ``low_latency_dispatch``/``low_latency_combine`` get keyword arguments this
DeepEP build does not have. Everything the patch does is decided here.

Persistence off (``GRAPHPERSIST_MODE`` unset, empty or ``off``; the engines export the resolved mode there when it is
on) returns the caller's values unchanged: upstream behaviour. With persistence on (``save`` or ``load``):

- the NVL buffer takes the no-fabric path, ``use_fabric=False`` (``cudaMalloc`` plus ``cudaIpcGetMemHandle``, which
  the runtime turns into deterministic VMM-IPC mappings) and ``allow_mnnvl=False`` (no multi-node NVLink);
- NVSHMEM is refused: ``low_latency_mode=True`` (NVSHMEM with IBGDA, even within one node) and ``num_rdma_bytes > 0``
  (an NVSHMEM RDMA buffer: internode, or low-latency) each get one line naming the setting, then one line saying what
  to use instead (DeepEP's normal mode within one node).

An engine's persistence records a live Buffer's facts in its archive and compares them at LOAD (``recorded``), and
refuses to SAVE a Buffer whose facts it cannot restore (``unrestorable``).

Standard library only at import (``recorded`` imports torch, which deep_ep needs anyway) and Python 3.10+, like the
oldest deep_ep wheel we build.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

MODE_ENV = "GRAPHPERSIST_MODE"

# Keyword arguments that SGLang 0.5.17 and vLLM 0.26.0 pass to DeepEP builds that have these features, and that the
# pinned build (tokenspeed-deepep 1.2.1) lacks: upstream raises a bare TypeError for them.
NVFP4_KWARGS = ("use_nvfp4", "x_global_scale")
SINGLE_BATCH_OVERLAP_KWARGS = (
    "overlap",
    "packed_recv_count",
    "comp_signal",
    "block_m",
    "threshold",
    "num_sms",
    "src_signals",
    "src_signal_expect_value",
)

NORMAL_MODE_ADVICE = (
    "Use DeepEP's normal (high-throughput) mode within one node: low_latency_mode=False and num_rdma_bytes=0, at most "
    "8 ranks (SGLang: --deepep-mode normal; vLLM: --all2all-backend deepep_high_throughput on one node)."
)

logger = logging.getLogger(__name__)


class Settings(NamedTuple):
    """What Buffer.__init__ passes on (the patch unpacks it)."""

    allow_mnnvl: bool
    use_fabric: bool


class PersistRefusal(ValueError):
    """A Buffer configuration that graph persistence cannot take; the message says what to use instead."""


class UnsupportedByThisBuild(TypeError):
    """A keyword argument this DeepEP build lacks. A TypeError, as upstream raises for it, with a message that says
    which feature is missing and how to start without it."""


def persistence_mode(environ: Mapping[str, str] | None = None) -> str:
    """``off``, ``save`` or ``load`` from ``GRAPHPERSIST_MODE``. Off needs nothing; any other value is read by the
    runtime's switch (the one place that decides what a mode is), which refuses a bad value naming it."""
    value = (os.environ if environ is None else environ).get(MODE_ENV, "")
    if value in ("", "off"):  # an empty variable counts as unset, as in graphpersist.switch
        return "off"
    from graphpersist.engine import switch

    return switch.parse_mode(value, MODE_ENV).value


def refusals(*, num_rdma_bytes: int, low_latency_mode: bool, mode: str) -> list[str]:
    """One line per Buffer setting that persistence cannot take (empty when it can); the advice is not included."""
    where = f"deep_ep.Buffer under graph persistence (mode {mode}, from {MODE_ENV})"
    lines = []
    if low_latency_mode:
        lines.append(
            f"graphpersist: cannot take {where}: low_latency_mode=True: low-latency mode runs on NVSHMEM with "
            "IBGDA (an InfiniBand NIC, even within one node), and persistence keeps only DeepEP's NVLink buffers "
            "over CUDA IPC"
        )
    if num_rdma_bytes > 0:
        lines.append(
            f"graphpersist: cannot take {where}: num_rdma_bytes={num_rdma_bytes}: an RDMA buffer is allocated by "
            "NVSHMEM (internode expert parallelism, or low-latency mode), which persistence does not place or restore"
        )
    return lines


def buffer_settings(
    *,
    num_rdma_bytes: int,
    low_latency_mode: bool,
    allow_mnnvl: bool,
    use_fabric: bool,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """The (allow_mnnvl, use_fabric) a Buffer is created with: the caller's own with persistence off; False and False
    with persistence on, after refusing NVSHMEM (PersistRefusal: every refused setting, then the advice)."""
    mode = persistence_mode(environ)
    if mode == "off":
        return Settings(allow_mnnvl, use_fabric)
    lines = refusals(num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode, mode=mode)
    if lines:
        raise PersistRefusal("\n".join([*lines, NORMAL_MODE_ADVICE]))
    overridden = [name for name, value in (("use_fabric", use_fabric), ("allow_mnnvl", allow_mnnvl)) if value]
    if overridden:
        logger.warning(
            "graphpersist: deep_ep.Buffer: %s=True set to False (persistence %s): the NVL buffer takes cudaMalloc and "
            "CUDA IPC, which the runtime places and restores; fabric handles it does not",
            "=True, ".join(overridden),
            mode,
        )
    return Settings(allow_mnnvl=False, use_fabric=False)


def refuse_unsupported(method: str, kwargs: Mapping[str, Any]) -> None:
    """Nothing when `kwargs` is empty; else UnsupportedByThisBuild naming the missing feature and what to do."""
    if not kwargs:
        return
    call = f"deep_ep.Buffer.{method}()"
    build = _build()
    nvfp4 = [k for k in kwargs if k in NVFP4_KWARGS]
    overlap = [k for k in kwargs if k in SINGLE_BATCH_OVERLAP_KWARGS]
    other = [k for k in kwargs if k not in NVFP4_KWARGS and k not in SINGLE_BATCH_OVERLAP_KWARGS]
    lines = []
    if nvfp4:
        lines.append(
            f"graphpersist: {call} got {', '.join(nvfp4)}: {build} has no NVFP4 low-latency dispatch; dispatch in "
            "FP8 or BF16 instead (SGLang: --deepep-dispatcher-output-dtype fp8 or bf16; vLLM: "
            "VLLM_DEEPEPLL_NVFP4_DISPATCH=0)"
        )
    if overlap:
        lines.append(
            f"graphpersist: {call} got {', '.join(overlap)}: {build} has no single-batch-overlap combine; start "
            "SGLang without --enable-single-batch-overlap"
        )
    if other:
        lines.append(f"graphpersist: {call} got unexpected keyword argument(s) {', '.join(other)} ({build})")
    raise UnsupportedByThisBuild("\n".join(lines))


def recorded(buffer: Any, version: str | None = None, byte: Any = None) -> dict[str, Any]:
    """What an archive records of a live Buffer: its sizes, mode and fabric settings (patch 0003 keeps them), its rank
    and group size, where its NVL buffer lies, and this build. (Tests without torch pass `byte` and `version`.)"""
    if byte is None:
        import torch

        byte = torch.uint8
    nvl = int(buffer.num_nvl_bytes)
    address = buffer.get_local_buffer_tensor(byte).data_ptr() if nvl > 0 else 0
    return {
        "num_nvl_bytes": nvl, "num_rdma_bytes": int(buffer.num_rdma_bytes),
        "low_latency_mode": bool(buffer.low_latency_mode), "use_fabric": bool(buffer.use_fabric),
        "allow_mnnvl": bool(buffer.allow_mnnvl), "rank": int(buffer.rank), "group_size": int(buffer.group_size),
        "nvl_buffer": f"{address:#x}", "deep_ep_version": _version() if version is None else version,
    }  # fmt: skip


def unrestorable(facts: Mapping[str, Any]) -> list[str]:
    """One line per recorded fact persistence cannot restore (NVSHMEM, fabric handles): a Buffer made while this
    module did not see persistence on. Empty when it can."""
    lines = []
    if facts["low_latency_mode"]:
        lines.append("low_latency_mode=True: low-latency mode runs on NVSHMEM (IBGDA), which persistence does not keep")
    if facts["num_rdma_bytes"]:
        lines.append(f"num_rdma_bytes={facts['num_rdma_bytes']}: an NVSHMEM RDMA buffer, not kept by persistence")
    if facts["use_fabric"] or facts["allow_mnnvl"]:
        lines.append(f"use_fabric={facts['use_fabric']}, allow_mnnvl={facts['allow_mnnvl']}: fabric handles are not "
                     "placed or restored (persistence sets both False)")  # fmt: skip
    return lines


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deep_ep")
    except PackageNotFoundError:
        return ""


def _build() -> str:
    return f"this DeepEP build (deep_ep {_version()})" if _version() else "this DeepEP build"
