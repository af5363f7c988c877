"""SGLang's custom all-reduce (v2, the default on CUDA) under persistence: its graph-input registration as one
post-capture phase that LOAD re-runs (patches/sglang/README.md, "Custom all-reduce v2")."""

from __future__ import annotations

from typing import Any

from graphpersist import engine
from graphpersist.engine import PersistError

PHASE = "custom_all_reduce"
GROUPS = ("tp", "pp", "dcp", "attn_tp", "moe_ep", "moe_tp")


def register_graph_inputs(ca: Any) -> None:
    """Called where upstream registers at the end of `CustomAllReduceV2.capture()`: with persistence on (SAVE) the
    registration waits for `register_after_capture`; LOAD never captures, so never reaches here with inputs."""
    if engine.current() is None:
        ca._register_graph_inputs()


def group_communicators(attr: str) -> list[tuple[str, Any]]:
    """(group name, communicator) of each process group's `attr` (e.g. `ca_comm`), once each (groups may share
    one), in a fixed order; groups without one are left out."""
    from sglang.srt.distributed import parallel_state as ps

    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name in GROUPS:
        comm = getattr(getattr(ps, f"_{name.upper()}", None), attr, None)
        if comm is None or id(comm) in seen:
            continue
        seen.add(id(comm))
        found.append((name, comm))
    return found


def live() -> list[tuple[str, Any]]:
    """(group name, communicator) of every enabled custom all-reduce of this process, once each, in a fixed order."""
    return [(name, ca) for name, ca in group_communicators("ca_comm") if not getattr(ca, "disabled", True)]


def describe_live() -> list[str]:
    """The live communicators as facts: group name and class (an archive of v2 does not fit the legacy one)."""
    return [f"{name}:{type(ca).__name__}" for name, ca in live()]


def _state_rows(ca: Any, first: int, count: int) -> Any:
    return ca.graph_params[first : first + count]


def _check_v2(name: str, ca: Any) -> None:
    if not hasattr(ca, "_graph_inputs") or not hasattr(ca, "_register_graph_inputs"):
        raise PersistError(
            f"graphpersist: the {name} group's custom all-reduce is {type(ca).__name__}, not CustomAllReduceV2: "
            "persistence supports only v2 (unset SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2) or --disable-custom-all-reduce"
        )


class CustomAllReduceV2(engine.Communicator):
    """SGLang's custom all-reduce v2 as the session sees it: SAVE registers every runner's graph inputs once, after
    the last capture; LOAD runs the same registration with SAVE's inputs, in the same post-capture phase."""

    name = PHASE

    def after_capture(self, session: engine.PersistSession) -> None:
        """SAVE, after the last capture: each communicator's pending graph inputs registered by upstream's code, in
        one post-capture phase; their rows declared as state and the inputs recorded in the notes."""
        record: dict[str, Any] = {}
        with session.phase(PHASE):
            for name, ca in live():
                _check_v2(name, ca)
                inputs = [(int(p), int(n)) for p, n in ca._graph_inputs]
                first = int(ca._graph_counter)
                if inputs:
                    ca._register_graph_inputs()
                record[name] = {"first_row": first, "inputs": inputs}
        for name, ca in live():
            rows = record[name]
            if rows["inputs"]:
                session.declare_state(f"{PHASE}.{name}.graph_params",
                                      _state_rows(ca, rows["first_row"], len(rows["inputs"])),
                                      how="recreated")  # fmt: skip
        session.notes[PHASE] = record
        total = sum(len(r["inputs"]) for r in record.values())
        session.log("custom all-reduce: %d graph inputs registered (%s)", total, ", ".join(record) or "none")

    def restore(self, session: engine.PersistSession, notes: Any) -> None:
        """LOAD: re-run each communicator's registration with SAVE's inputs, in the same phase; declare its rows."""
        saved: dict[str, Any] = notes.get(PHASE) or {}
        found = dict(live())
        if set(saved) != set(found):
            raise PersistError(
                "graphpersist: custom all-reduce differs: SAVE registered graph inputs for groups "
                f"{sorted(saved) or 'none'}, this LOAD has communicators for {sorted(found) or 'none'}. Re-run with "
                "mode=save for this configuration."
            )
        with session.phase(PHASE):
            for name, rec in saved.items():
                ca = found[name]
                _check_v2(name, ca)
                if ca._graph_inputs or ca._graph_counter:
                    raise PersistError(f"graphpersist: the {name} custom all-reduce already holds graph inputs at "
                                       "LOAD (something captured): refused")  # fmt: skip
                inputs = [(int(p), int(n)) for p, n in rec["inputs"]]
                if not inputs:
                    continue
                ca._graph_counter = int(rec["first_row"])
                ca._graph_inputs = list(inputs)
                ca._register_graph_inputs()
        total = 0
        for name, rec in saved.items():
            if rec["inputs"]:
                total += len(rec["inputs"])
                session.declare_state(f"{PHASE}.{name}.graph_params",
                                      _state_rows(found[name], int(rec["first_row"]), len(rec["inputs"])),
                                      how="recreated")  # fmt: skip
        session.log("custom all-reduce: %d graph inputs registered again (%s)", total, ", ".join(saved) or "none")
