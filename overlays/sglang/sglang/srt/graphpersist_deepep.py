"""SGLang's DeepEP expert parallelism (`--moe-a2a-backend deepep`) under persistence: normal mode only, its Buffer made
in setup, its facts recorded and compared (patches/sglang/README.md, "DeepEP")."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from graphpersist import engine
from graphpersist.engine import PersistError, Refused

PHASE = "deepep"
NOTES_KEY = "deepep"
WHAT = "DeepEP buffer"
MODES = ("normal",)
USE_INSTEAD = (
    "use --deepep-mode normal (DeepEP's high-throughput kernels over NVLink within one node; SGLang then runs them "
    "as eager breaks of breakable CUDA graphs), or serve without --moe-a2a-backend deepep"
)

logger = logging.getLogger(__name__)


def refuse(sa: Any) -> None:
    """What DeepEP configurations persistence cannot take, refused at start-up naming the setting and what to use
    (several nodes, where DeepEP runs on NVSHMEM, are refused with every start over several nodes)."""
    if (mode := str(sa.deepep_mode)) not in MODES:
        which = "decode batches in auto mode run" if mode == "auto" else "it runs"
        raise Refused(
            f"graphpersist: DeepEP's low-latency mode (--deepep-mode {mode}: {which} it) cannot be persisted: it is "
            "captured in the decode graphs and needs NVSHMEM with an InfiniBand NIC (IBGDA), even within one node, "
            f"while persistence keeps only DeepEP's NVLink buffers. Instead, {USE_INSTEAD}"
        )
    if sa.enable_single_batch_overlap:
        raise Refused("graphpersist: DeepEP with --enable-single-batch-overlap cannot be persisted (this DeepEP build "
                      "has no single-batch-overlap combine): serve without it")  # fmt: skip


def keep_graphs_in_normal_mode(sa: Any) -> bool:
    """Called where `ServerArgs._handle_a2a_moe` turns every CUDA graph off for `--deepep-mode normal` (patch 0009).

    Persistence off: False, and upstream turns them off. On: the decode graphs use the breakable backend (DeepEP
    runs as an eager break, as upstream's breakable prefill graphs already run it), a breakable or disabled prefill
    backend stays, any other prefill backend (which would capture DeepEP's dispatch) becomes disabled; True."""
    if not engine.switch.resolve(sa.graph_persist, sa.graph_persist_dir).enabled:
        return False
    cfg = sa.cuda_graph_config  # backends by the values graphpersist_facts checks them by (the tests: upstream's)
    if cfg.decode.backend != "disabled":
        cfg.decode.backend = "breakable"
    if cfg.prefill.backend not in ("breakable", "disabled"):
        cfg.prefill.backend = "disabled"
    logger.info(
        "graphpersist: --deepep-mode normal: CUDA graphs kept on for persistence (decode %s, prefill %s); DeepEP's "
        "dispatch and combine run as eager breaks between graph segments",
        cfg.decode.backend,
        cfg.prefill.backend,
    )
    return True


# --------------------------------------------------------------------------------------------- the Buffer in setup
def first_normal_dispatcher(model: Any) -> Any:
    """The first normal-mode DeepEP dispatcher of the model's MoE layers, in module order (one per layer and inner),
    None without one."""
    for module in model.modules():
        for inner in getattr(getattr(module, "dispatcher", None), "_inners", None) or []:
            if (normal := getattr(inner, "_normal_dispatcher", None)) is not None:
                return normal
    return None


def setup_buffer(session: engine.PersistSession, model: Any) -> Any:
    """Setup, before the memory pool is sized: the Buffer made by upstream's own path (the first normal dispatcher's
    `_get_buffer`, which its first dispatch would call; SGLang keeps one per process) in the exact phase `deepep`.
    SAVE refuses what it cannot persist; LOAD compares its facts with SAVE's at once. Returns the Buffer."""
    dispatcher = first_normal_dispatcher(model)
    if dispatcher is None:
        raise PersistError("graphpersist: --moe-a2a-backend deepep but the model has no DeepEP normal-mode dispatcher "
                           "(no MoE layer?): refused")  # fmt: skip
    with session.phase(PHASE):
        buffer = dispatcher._get_buffer()
    facts = noted(buffer).check(session, session.saved_notes.get(NOTES_KEY))
    session.log("DeepEP buffer: %d NVL bytes at %s, rank %d of %d, deep_ep %s", facts["num_nvl_bytes"],
                facts["nvl_buffer"], facts["rank"], facts["group_size"], facts["deep_ep_version"])  # fmt: skip
    return buffer


def buffer_facts(buffer: Any) -> dict[str, Any]:
    """The live Buffer's facts as our deep_ep records them (`deep_ep.graphpersist_buffer.recorded`); a deep_ep
    without that module (not graphpersist's wheel) is refused: it does not keep the fabric settings a Buffer took."""
    try:
        from deep_ep import graphpersist_buffer
    except ImportError:
        raise Refused(
            "graphpersist: --moe-a2a-backend deepep under persistence needs graphpersist's deep_ep wheel "
            "(dist/deep_ep-*+gp.*.whl), which keeps the fabric settings a Buffer took: install it"
        ) from None
    return graphpersist_buffer.recorded(buffer)


def refuse_facts(facts: Mapping[str, Any]) -> None:
    """SAVE: a Buffer persistence cannot restore is refused, every reason named, then what to do."""
    from deep_ep import graphpersist_buffer

    if lines := graphpersist_buffer.unrestorable(facts):
        raise Refused("\n".join([f"graphpersist: cannot SAVE this DeepEP Buffer: {line}" for line in lines]
                                + [f"Instead, {USE_INSTEAD}."]))  # fmt: skip


def noted(buffer: Any) -> engine.NotedFacts:
    """The DeepEP Buffer as the session sees it (`buffer`: the one setup_buffer made): nothing registers after the
    capture (the peers' NVL buffers were opened when the Buffer was made, in setup); SAVE records its facts, refusing
    what it cannot restore, LOAD compares them before the first replay."""

    def live() -> dict[str, Any]:
        if buffer is None:
            raise PersistError("graphpersist: --moe-a2a-backend deepep but no DeepEP Buffer was made in setup: refused "
                               "(the persistence seam in KVCacheConfigurator.configure did not run?)")  # fmt: skip
        return buffer_facts(buffer)

    return engine.NotedFacts(NOTES_KEY, WHAT, live, refuse_facts)
