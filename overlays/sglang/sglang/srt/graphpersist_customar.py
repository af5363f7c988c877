"""SGLang's custom all-reduce (v2, the default on CUDA) under persistence: its graph-input registration as one
post-capture phase that LOAD re-runs (patches/sglang/README.md, "Custom all-reduce v2")."""

from __future__ import annotations

from typing import Any

from graphpersist import engine
from graphpersist.engine import PersistError

PHASE = "custom_all_reduce"


def register_graph_inputs(ca: Any) -> None:
    """Called where upstream registers at the end of `CustomAllReduceV2.capture()`: with persistence on (SAVE) the
    registration waits for the last capture (`CustomAllReduceV2.after_capture`); LOAD never captures, so never reaches
    here with inputs."""
    if engine.current() is None:
        ca._register_graph_inputs()


def group_communicators(attr: str) -> list[tuple[str, Any]]:
    """("tp", communicator) for the TP group's `attr` (e.g. `ca_comm`) when it has one, else nothing. In what
    persistence accepts it is the only group with a custom all-reduce or torch symmetric-memory communicator: SGLang
    0.5.17 makes them only on groups of more than one rank, and without pipeline, DCP, attention-context or
    MoE-data parallelism and DP attention (all refused) every other group is the TP group itself or has one rank."""
    from sglang.srt.distributed import get_tp_group

    comm = getattr(get_tp_group(), attr, None)
    return [] if comm is None else [("tp", comm)]


def live() -> list[tuple[str, Any]]:
    """(group name, communicator) of every enabled custom all-reduce of this process, once each, in a fixed order."""
    return [(name, ca) for name, ca in group_communicators("ca_comm") if not getattr(ca, "disabled", True)]


def describe_live() -> list[str]:
    """The live communicators as facts: group name and class (an archive of v2 does not fit the legacy one)."""
    return [f"{name}:{type(ca).__name__}" for name, ca in live()]


def torch_symm_mem_live() -> list[str]:
    """Each process group's torch symmetric-memory communicator as `group:on|off:<buffer bytes>`: whether it came
    on depends on more than the flag (world size, GPU, multicast, patch 0007's GRAPHPERSIST_SYMM_MEM_NO_MULTICAST), and
    which all-reduces it takes (those below its buffer size) is in the captured graphs."""
    return [
        f"{name}:off:0" if comm.disabled else f"{name}:on:{int(comm.max_size)}"
        for name, comm in group_communicators("torch_symm_mem_comm")
    ]


def _check_v2(name: str, ca: Any, loading: bool) -> None:
    if not hasattr(ca, "_graph_inputs") or not hasattr(ca, "_register_graph_inputs"):
        raise PersistError(
            f"graphpersist: the {name} group's custom all-reduce is {type(ca).__name__}, not CustomAllReduceV2: "
            "persistence supports only v2 (unset SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2) or --disable-custom-all-reduce"
        )
    if loading and (ca._graph_inputs or ca._graph_counter):
        raise PersistError(f"graphpersist: the {name} custom all-reduce already holds graph inputs at LOAD (something "
                           "captured): refused")  # fmt: skip


def _record(first_row: Any, inputs: Any) -> dict[str, Any]:
    """A communicator's registration as the notes record it: its first row of graph_params and its graph inputs."""
    return {"first_row": int(first_row), "inputs": [(int(p), int(n)) for p, n in inputs]}


def _register(session: engine.PersistSession, found: dict[str, Any], record: dict[str, Any], loading: bool) -> None:
    """Upstream's registration of each communicator's inputs (LOAD: SAVE's, set first), in the post-capture phase;
    then their rows declared as state LOAD recreates and proves equal to SAVE's."""
    with session.phase(PHASE):
        for name, rec in record.items():
            if rec["inputs"]:
                if loading:
                    found[name]._graph_counter, found[name]._graph_inputs = rec["first_row"], list(rec["inputs"])
                found[name]._register_graph_inputs()
    for name, rec in record.items():
        if rec["inputs"]:
            rows = found[name].graph_params[rec["first_row"] : rec["first_row"] + len(rec["inputs"])]
            session.declare_state(f"{PHASE}.{name}.graph_params", rows, how="recreated")
    session.log("custom all-reduce: %d graph inputs registered%s (%s)", sum(len(r["inputs"]) for r in record.values()),
                " again" if loading else "", ", ".join(record) or "none")  # fmt: skip


class CustomAllReduceV2(engine.Communicator):
    """SGLang's custom all-reduce v2 as the session sees it: SAVE registers every runner's graph inputs once, after
    the last capture; LOAD runs the same registration with SAVE's inputs, in the same post-capture phase."""

    name = PHASE

    def after_capture(self, session: engine.PersistSession) -> None:
        """SAVE, after the last capture: each communicator's pending graph inputs and first row, recorded in the notes
        and registered by upstream's code."""
        found = dict(live())
        for name, ca in found.items():
            _check_v2(name, ca, loading=False)
        record = {name: _record(ca._graph_counter, ca._graph_inputs) for name, ca in found.items()}
        _register(session, found, record, loading=False)
        session.notes[PHASE] = record

    def restore(self, session: engine.PersistSession, notes: Any) -> None:
        """LOAD: each communicator's registration again with SAVE's inputs, in the same phase."""
        saved: dict[str, Any] = notes.get(PHASE) or {}
        found = dict(live())
        if set(saved) != set(found):
            raise PersistError(
                "graphpersist: custom all-reduce differs: SAVE registered graph inputs for groups "
                f"{sorted(saved) or 'none'}, this LOAD has communicators for {sorted(found) or 'none'}. Re-run with "
                "mode=save for this configuration."
            )
        for name in saved:
            _check_v2(name, found[name], loading=True)
        record = {name: _record(rec["first_row"], rec["inputs"]) for name, rec in saved.items()}
        _register(session, found, record, loading=True)
