"""What an engine must tell the runtime: the `EngineAdapter` interface, and the communicators it hands over.

The runtime owns the SAVE/LOAD lifecycle (`graphpersist.engine.session.PersistSession`); an engine only answers the
questions below, each about its own objects (its configuration, where its graphs live, its communicators, its
caches). A new engine (TensorRT-LLM, say) implements one adapter and calls the session at a few seams; it never
re-implements phases, facts, caches, capture bookkeeping or the archive.

Nothing here imports torch: engines build their adapter while they parse arguments, before CUDA exists.
"""

from __future__ import annotations

import abc
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from graphpersist.engine.caches import SessionCaches
from graphpersist.errors import PersistError

if TYPE_CHECKING:
    from graphpersist.load import LoadResult
    from graphpersist.ranks import Gather

Resolver = Callable[[], "Path | None"]
UnusedBytes = Callable[[str, list[tuple[int, int]]], list[tuple[int, int]]]


class SessionView(Protocol):
    """What an adapter or a communicator may use of the session it serves (implemented by
    graphpersist.engine.session.PersistSession): the run's identity and bookkeeping, its log and timings, and the
    runtime's phases and declared state."""

    rank: int
    world_size: int
    directory: Path
    notes: dict[str, Any]
    saved_notes: dict[str, Any]
    saved_flags: dict[str, Any]
    stats_extra: dict[str, Any]
    kept: list[Any]
    budget_bytes: int | None
    caches: SessionCaches

    @property
    def loading(self) -> bool: ...

    def log(self, message: str, *args: Any) -> None: ...

    def timed(self, name: str, started: float) -> float: ...

    def kernel_warmup(self, run: Callable[[], tuple[dict[str, Any], str]]) -> None: ...

    def phase(
        self, name: str, *, exact: bool = True, span: int | None = None, timed: str | None = None
    ) -> AbstractContextManager[None]: ...

    def declare_state(self, name: str, what: Any, how: str = "bytes") -> None: ...


@dataclass(frozen=True)
class Inventory:
    """The graphs a live configuration would capture: capture sizes and modes (what LOAD must find saved)."""

    sizes: list[int]
    modes: list[str]
    by_mode: dict[str, list[int]] = field(default_factory=dict)


class Communicator(abc.ABC):
    """A communicator whose state the captured graphs read and which LOAD must set up again after the restore
    (custom all-reduce's registered graph buffers today; DeepEP's buffers later). Its SAVE side runs inside the
    runtime's post-capture phase; its LOAD side re-creates the same mappings in the same phase."""

    name: str = "communicator"

    def after_capture(self, session: SessionView) -> None:  # noqa: B027 (most communicators register in upstream's capture)
        """SAVE, once every graph is captured: register what the graphs read, record it in `session.notes`."""

    @abc.abstractmethod
    def restore(self, session: SessionView, notes: Mapping[str, Any]) -> None:
        """LOAD, once the graphs are restored: re-create the registration SAVE recorded in `notes`."""


def graphs_differ(what: str, saved: Iterable[str], live: Iterable[str]) -> PersistError:
    """LOAD's refusal when the saved graphs of one kind are not exactly those this configuration replays."""
    saved, live = set(saved), set(live)
    missing, extra = sorted(live - saved), sorted(saved - live)
    return PersistError(
        f"graphpersist: {what} graphs differ: not in the archive {missing[:5] or 'none'}"
        f"{' ...' if len(missing) > 5 else ''}, saved but not replayed by this configuration {extra[:5] or 'none'}"
        f"{' ...' if len(extra) > 5 else ''}. Re-run with mode=save for this configuration."
    )


def bytes_in_param(
    layout: list[tuple[int, int]], index: int, ranges: tuple[tuple[int, int], ...]
) -> list[tuple[int, int]]:
    """`ranges` (offsets into the kernel's parameter buffer, as SAVE's diff names them) when they all lie inside
    parameter `index` of `layout`, else none. For `unused_param_bytes` rules: a parameter buffer places each parameter
    at its aligned offset (FA3's 128-aligned Params block sits at 112), so a rule stated in buffer offsets must not be
    shifted by it, and must not fire on a kernel whose parameters are laid out otherwise."""
    if index >= len(layout):
        return []
    start, size = layout[index]
    if all(start <= a <= b <= start + size for a, b in ranges):
        return list(ranges)
    return []


@dataclass(frozen=True)
class UnreadBytes:
    """A rule for `unused_param_bytes`: the kernels whose name `pattern` matches never read these `ranges` (parameter
    buffer offsets) of the one parameter block at buffer byte `at`, as proven for that layout. A kernel it matches
    with another layout keeps its bytes as captured, said in a warning (`what` names the kernels)."""

    what: str
    pattern: re.Pattern[str]
    at: int
    ranges: tuple[tuple[int, int], ...]

    def __call__(self, kernel: str, layout: list[tuple[int, int]], logger: logging.Logger) -> list[tuple[int, int]]:
        if not self.pattern.search(kernel):
            return []
        if len(layout) == 1 and layout[0][0] == self.at and (found := bytes_in_param(layout, 0, self.ranges)):
            return found
        logger.warning(
            "graphpersist: %s %s has the parameter layout %s, not the one checked (one parameter block at buffer byte "
            "%d holding bytes %d-%d): its unread bytes are kept as captured, so two SAVEs may differ there",
            self.what, kernel[:120], layout, self.at, self.ranges[0][0], self.ranges[-1][1] - 1,
        )  # fmt: skip
        return []


class EngineAdapter(abc.ABC):
    """The questions only an engine can answer. One instance per engine process, built by the engine's glue around
    its live objects (worker, model runner, configuration); the session asks, the adapter never drives."""

    #: the engine's name as archives record it ("vllm", "sglang")
    name: str = "engine"
    #: where the session's lines go: a logger the engine's own logging configuration prints
    logger: logging.Logger = logging.getLogger("graphpersist")
    #: where the engine keeps its graphs, by mode, for the rank's notes ({"full": {}, "pieces": {}})
    note_sections: tuple[str, ...] = ()
    #: the entry points that start the engine under the runtime (named when a process lacks the interposer)
    entry_points: str = "its own entry points"
    #: what the memory budget sizes, and what to change when the profile leaves less than SAVE needs
    budget_what: str = "KV cache"
    budget_advice: str = "give the engine more GPU memory"
    #: the engine compiles with Inductor, whose timed launch configs the session pins (graphpersist.graph.kernelchoice)
    pins_kernel_choices: bool = False
    #: SAVE writes the archive when the engine is ready (`PersistSession.ready`), not right after the capture: the
    #: engine's kernel warm-up (`warm_kernels_before_save`) runs requests, which need the graphs installed
    writes_when_ready: bool = False

    def refuse(self) -> None:  # noqa: B027 (an engine that refuses nothing)
        """Raises `Refused` for a configuration this integration cannot restore exactly (before anything is
        allocated), saying what to use instead."""

    # -- facts (the archive's manifest; LOAD compares them field by field) --------------------------------------------
    @abc.abstractmethod
    def engine_facts(self) -> dict[str, str]:
        """name, version and commit of the engine."""

    @abc.abstractmethod
    def model_facts(self) -> dict[str, str]:
        """dtype and a fingerprint of the model's configuration, known before the weights."""

    @abc.abstractmethod
    def parallel(self) -> dict[str, int]:
        """world_size, tp_size, pp_size, ep_size."""

    @abc.abstractmethod
    def config_flags(self) -> dict[str, Any]:
        """Flags known from the configuration alone (compared before setup, and again at LOAD)."""

    @abc.abstractmethod
    def flags(self, session: SessionView) -> dict[str, Any]:
        """Every flag SAVE records and LOAD compares, once the engine's memory and graph runners exist."""

    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in the engine's world (its archive part is `rank_<r>/`)."""

    @abc.abstractmethod
    def device_index(self) -> int:
        """The CUDA device this rank uses: its address region belongs to that GPU."""

    @abc.abstractmethod
    def cpu_gather(self) -> Gather:
        """Rank agreement over the engine's CPU group (never the GPU or NCCL)."""

    # -- memory ---------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def setup_tensors(self) -> dict[str, Any]:
        """The setup tensors the graphs read, by name (weights, buffers, KV cache): LOAD proves their place."""

    def read_saved(self, session: SessionView) -> None:  # noqa: B027 (optional)
        """LOAD, before setup: what the engine reuses from SAVE (`session.saved_flags`, `session.saved_notes`) instead
        of measuring again; refuses what it cannot reuse."""

    def unused_param_bytes(self, kernel: str, layout: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Byte ranges of `kernel`'s parameters it never reads, which SAVE writes as zeros (see Saver)."""
        return []

    # -- graphs ---------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def inventory(self) -> Inventory:
        """The capture sizes and modes this live configuration would capture."""

    @abc.abstractmethod
    def install(self, session: SessionView, result: LoadResult) -> int:
        """LOAD: put every restored graph where the engine replays it; refuse a saved inventory that differs."""

    def output_types(self) -> Mapping[str, type]:
        """The dataclasses the engine's graphs may return, by id (its registry): SAVE stores an output dataclass by
        its id here and refuses one it lacks; LOAD looks ids up here and nowhere else (an archive is data, never
        code). Ids are lowercase dotted words (graph.structure.ID), e.g. "sglang.logits_processor_output"."""
        return {}

    def communicators(self) -> list[Communicator]:
        """The communicators whose post-capture registration LOAD must repeat, in a fixed order."""
        return []

    # -- caches and warm-up ---------------------------------------------------------------------------------------
    def cache_resolvers(self) -> Mapping[str, Resolver]:
        """The JIT and compile cache folders the engine reads, by name (carried by SAVE, put back by LOAD)."""
        return {}

    def warm_kernels_before_save(self, session: SessionView) -> None:  # noqa: B027 (optional)
        """SAVE, once the archive's content is fixed: run what compiles kernels only at serving time, so the caches
        the archive carries hold them and a LOAD on a fresh host compiles nothing."""
