"""One engine process's persistence session: the SAVE/LOAD lifecycle, run by the runtime in one order for every engine.

An engine's glue builds an `EngineAdapter` (graphpersist.engine.adapter) around its live objects and hands it to
`PersistSession.begin` at its first seam; from then on each upstream seam calls one session step, and the session
does the work and keeps the order (a step out of order is refused, naming both steps):

| step (the glue calls it from)       | SAVE                                    | LOAD                                 |
|-------------------------------------|-----------------------------------------|--------------------------------------|
| `begin` (before distributed init)   | refusals, interposer, region            | + early facts, caches back, anchors  |
| `phase`, `begin_phase`, `end_phase` | setup in anchored phases                | the same, at SAVE's offsets          |
| `memory_budget` (KV-cache sizing)   | profile, round down, agree, record      | SAVE's budget, checked against free  |
| `graphs` (where upstream captures)  | mark setup, capture, communicators;     | mark setup, restore, install,        |
|                                     | write (unless written when ready)       | communicators, declared state        |
| `ready` (the engine can serve)      | write if not yet; name late compiles    | -                                    |
| `finish` (end of start, or failure) | stats                                   | stats                                |

The adapter answers questions (facts, refusals, its graphs, where restored graphs go, communicators, caches); the
session never asks it to drive. Everything a run gathers lives on the session and its `run` (graphpersist.run),
the process's one slot: `current()` finds the session, and two sessions share nothing. A refusal a step raises is
recorded for the process that launched the engine, which raises it again (graphpersist.engine.refusal). No torch at
import: the engine glue imports this while it parses arguments.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec

from graphpersist import gcpause, rankstats, switch
from graphpersist.archive import Archive
from graphpersist.engine import budget, refusal
from graphpersist.engine.adapter import EngineAdapter
from graphpersist.engine.caches import SessionCaches
from graphpersist.engine.prepared import PreparedState
from graphpersist.errors import PersistError
from graphpersist.loadahead import ReadAhead
from graphpersist.records import Facts
from graphpersist.run import Run, active, fresh

KERNEL_WARMUP = "kernel_warmup_before_save"  # the stats phase of the SAVE's kernel warm-up (both engines)
FILES_LISTED = 500  # at most this many of the JIT cache files a kernel warm-up added are named in rank 0's stats

# The lifecycle's steps in order; a step may repeat itself (phases) but never go back.
STEPS = ("begin", "budget", "graphs", "ready", "finish")


def current() -> PersistSession | None:
    """The session of this process, or None when persistence is off (or this process runs no model)."""
    now = active()
    return now.session if now is not None else None


P = ParamSpec("P")


def while_saving(hook: Callable[Concatenate[PersistSession, P], None]) -> Callable[P, None]:
    """A capture site's hook (`captured_...`), called with this process's session first while it saves (SAVE, until
    its archive is written: later captures are upstream's own); persistence off, LOAD or a SAVE already written: the
    hook is not called, and the site does what upstream does."""

    @functools.wraps(hook)
    def called(*args: P.args, **kwargs: P.kwargs) -> None:
        sess = current()
        if sess is not None and sess.saving:
            hook(sess, *args, **kwargs)

    return called


def release_cached() -> None:
    """Drops torch's cached free blocks, so the next phase allocates fresh at its anchor, as in the other run."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def interposer_loaded() -> bool:
    """Whether this process runs under the runtime's interposer (LD_PRELOAD), which every model process needs."""
    from graphpersist.memory import region

    return region.loaded()


@dataclass
class PersistSession:
    """One engine process's SAVE or LOAD: everything the run knows, and the lifecycle every engine shares."""

    adapter: EngineAdapter
    mode: switch.Mode
    directory: Path
    rank: int
    world_size: int
    run: Run = field(default_factory=Run, repr=False)  # what the runtime gathers for this session
    saver: Any = None  # graphpersist.save.Saver while saving
    notes: dict[str, Any] = field(default_factory=dict)  # the engine's bookkeeping SAVE stores for this rank
    saved_notes: dict[str, Any] = field(default_factory=dict)  # LOAD: SAVE's notes of this rank (read at begin)
    saved_flags: dict[str, Any] = field(default_factory=dict)  # LOAD: SAVE's flags (read at begin)
    timings: dict[str, float] = field(default_factory=dict)  # phases in seconds, in order
    stats_extra: dict[str, Any] = field(default_factory=dict)  # engine-specific keys of the stats file
    captured: int = 0
    restored: int = 0
    capture_calls: int = 0
    budget_bytes: int | None = None  # the memory budget the engine sized its KV cache by (memory_budget)
    saved_budget: int | None = None  # LOAD: SAVE's budget (read at begin)
    read_ahead: ReadAhead | None = None  # LOAD: the archive read in a thread from begin on (start_reading_ahead)
    model: dict[str, str] = field(default_factory=dict)  # model facts, computed at begin in SAVE and LOAD alike
    caches: SessionCaches = field(default_factory=SessionCaches)
    written: bool = False  # SAVE: the archive is written (later captures are upstream's own)
    kept: list[Any] = field(default_factory=list)  # objects LOAD must keep alive (loaded graphs, peer mappings)
    frozen: int | None = None  # start-up heap objects gc.freeze() moved out of the collector's way (None: not yet)
    gc_meter: gcpause.CollectionMeter = field(default_factory=gcpause.CollectionMeter, repr=False)
    # the collector's automatic passes paused from _start() to memory_budget() (gcpause, "the setup window")
    setup_gc: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)
    step: str = "begin"
    _graphs_done: float | None = field(default=None, repr=False)
    _lapped: float = field(default_factory=time.perf_counter, repr=False)  # where the next lap starts (begin: its end)

    def __post_init__(self) -> None:
        for section in self.adapter.note_sections:  # where the engine's capture sites note each graph
            self.notes.setdefault(section, {})

    # -- begin ------------------------------------------------------------------------------------------------------
    @classmethod
    @refusal.recording()
    def begin(cls, adapter: EngineAdapter) -> PersistSession | None:
        """The engine process's first seam, before distributed init. Persistence off: None, and upstream runs
        untouched. On: the adapter's refusals, the interposer check, then the session (activated: `current()`), the
        address region on the rank's GPU and, at LOAD, the facts known this early, the JIT caches and the phases'
        anchors."""
        resolved = switch.resolve()
        if not resolved.enabled or resolved.directory is None:
            return None
        started = time.perf_counter()
        adapter.refuse()
        if not interposer_loaded():
            raise PersistError(
                f"graphpersist: this {adapter.name} process runs without the runtime's interposer (LD_PRELOAD); "
                f"start {adapter.name} through {adapter.entry_points}, which resolve --graph-persist so its processes "
                "inherit it, or under `python -m graphpersist exec`"
            )
        sess = cls.open(adapter, resolved, adapter.rank(), adapter.parallel()["world_size"])
        try:
            sess._start()
        except BaseException:
            sess.setup_gc.close()  # a refused start leaves the collector as it found it (an in-process engine lives on)
            raise
        sess.timed("start", started)
        sess._lapped = time.perf_counter()
        return sess

    @classmethod
    def open(cls, adapter: EngineAdapter, resolved: switch.Switch, rank: int, world_size: int) -> PersistSession:
        """The session of a resolved switch, activated (`current()`), before its region: SAVE's Saver, the model's
        facts, the cache folders as this process resolves them, every capture counted."""
        assert resolved.directory is not None
        if current() is not None:
            raise PersistError(
                f"graphpersist: a second {adapter.name} model runner in one process (a draft model?) cannot be "
                "persisted: serve without speculative decoding"
            )
        sess = cls(adapter, resolved.mode, resolved.directory, rank, world_size)
        sess.activate()
        sess.timings["process_start"] = rankstats.seconds_since_process_start()
        sess.model = adapter.model_facts()
        sess.caches.record(adapter.cache_resolvers(), sess.log)
        rankstats.count_captures(sess._count_capture)
        if sess.mode is switch.Mode.SAVE:
            from graphpersist.save import Saver

            sess.saver = Saver(unused_param_bytes=adapter.unused_param_bytes, output_types=adapter.output_types())
        return sess

    def activate(self) -> None:
        """Makes this session the process's (`current()`), with a fresh run: nothing of an earlier one carries over."""
        self.run = fresh(session=self)

    def _start(self) -> None:
        """Freezes the start-up heap and pauses the collector's automatic passes until the memory budget
        (graphpersist.gcpause), then starts the region on this rank's GPU (before any library allocates); LOAD also
        refuses what the facts known this early contradict, puts the JIT caches back before anything compiles, starts
        reading the archive ahead, and anchors the phases; then Inductor's kernel choices are pinned where the engine
        compiles with it."""
        import torch

        from graphpersist import api

        self.gc_meter.start()
        self.frozen = gcpause.freeze_at_start()  # the imports' heap, before any device memory exists
        self.setup_gc.enter_context(gcpause.paused_gc())  # frees of the setup at the same points in SAVE and LOAD
        torch.cuda.set_device(self.adapter.device_index())
        info = api.start_region()
        if self.loading:
            archive = self._check_before_setup()
            self.caches.restore(self)
            self.start_reading_ahead()
            api.use_layout(archive, rank=self.rank)  # the archive the check opened, not opened again
        if self.adapter.pins_kernel_choices:
            self._pin_kernel_choices()
        self.log("%s %s, region %#x + %d GiB", self.mode.value, self.directory, info.base, info.size >> 30)

    def _check_before_setup(self) -> Archive:
        """LOAD: versions, GPU, layout, model and the flags known this early, each named with its saved and live
        value; then what the session and the engine reuse from SAVE (the memory budget, the engine's notes), refused
        where the archive lacks it. Returns the archive as opened."""
        from graphpersist import api

        early = Facts(self.adapter.engine_facts(), self.model, self.adapter.parallel(), self.adapter.config_flags())
        archive = api.check_before_setup(self.directory, early, self.rank)
        self.saved_flags = dict(archive.manifest.world.flags)
        self.saved_notes = archive.rank_facts(self.rank).engine_notes()
        self.saved_budget = budget.saved(self.saved_flags, self.directory)
        self.adapter.read_saved(self)
        return archive

    def start_reading_ahead(self) -> None:
        """LOAD: the restore's reading in a thread, beside the engine's start. Started once the JIT caches are back:
        the caches' restore is Python work on the main thread too, and the two shared the GIL (LOAD's jitcache phase
        0.18 s without the thread, 0.35-0.62 s beside it, on H100 hosts of 2026-12-07)."""
        self.read_ahead = ReadAhead(self.directory, self.rank)

    def _pin_kernel_choices(self) -> None:
        """Inductor's timed launch configs (graphpersist.graph.kernelchoice): SAVE records its choices in the rank's
        notes, LOAD launches the archive's instead of timing again."""
        from graphpersist.graph import kernelchoice

        saved = self.saved_notes.get(kernelchoice.NOTES_KEY) if self.loading else None
        choices = kernelchoice.install(loading=self.loading, saved=saved, log=lambda m: self.log("%s", m))
        if not self.loading:
            self.notes[kernelchoice.NOTES_KEY] = choices.used  # filled as kernels first launch

    def _count_capture(self) -> None:
        if current() is self:  # LOAD must begin no capture; the proof reads the count
            self.capture_calls += 1

    # -- order ------------------------------------------------------------------------------------------------------
    def _enter(self, step: str) -> None:
        """Moves the lifecycle to `step`, refusing a step that comes back to an earlier one (a seam that moved)."""
        if STEPS.index(step) < STEPS.index(self.step):
            raise PersistError(
                f"graphpersist: {self.adapter.name} reached the step {step!r} after {self.step!r}: the engine's "
                f"seams run out of order (an upstream change the patch series does not know?); refused"
            )
        self.step = step

    # -- state ------------------------------------------------------------------------------------------------------
    @property
    def saving(self) -> bool:
        """SAVE, until the archive is written (later captures are upstream's own)."""
        return self.mode is switch.Mode.SAVE and not self.written

    @property
    def loading(self) -> bool:
        return self.mode is switch.Mode.LOAD

    @property
    def finished(self) -> bool:
        """The start is over (`finish` ran): what the engine does from now on is upstream's own."""
        return self.step == "finish"

    def log(self, message: str, *args: Any) -> None:
        """One line in the engine's own log (its logger: the engine configures where its lines go)."""
        self.adapter.logger.info("graphpersist: rank %d: " + message, self.rank, *args)

    def timed(self, name: str, started: float) -> float:
        """Records the time since `started` as phase `name`; returns it."""
        took = time.perf_counter() - started
        self.timings[name] = round(took, 4)
        return took

    def lap(self, name: str) -> None:
        """Records the time since the engine's previous lap (the first: since `begin` ended) as phase `name`: how an
        engine times its own setup between the session's steps."""
        now = time.perf_counter()
        self.timings[name] = round(now - self._lapped, 4)
        self._lapped = now

    def kernel_warmup(self, run: Callable[[], tuple[dict[str, Any], str]]) -> None:
        """SAVE: the engine's kernel warm-up `run()` (what compiles kernels only when the engine serves), synchronized
        and timed as KERNEL_WARMUP; rank 0 also lists the JIT cache files it added (a host's ranks share the folders).
        `run()` returns its summary, for the rank's stats (`kernel_warmup`, with those files), and a description."""
        import torch

        started = time.perf_counter()
        before = self.caches.listing() if self.rank == 0 else set()
        summary, described = run()
        torch.cuda.synchronize()
        added = sorted(self.caches.listing() - before) if self.rank == 0 else []
        took = self.timed(KERNEL_WARMUP, started)
        new = {"new_cache_files": len(added) if self.rank == 0 else None, "files": added[:FILES_LISTED]}
        self.stats_extra["kernel_warmup"] = {**summary, **new}
        self.log("kernel warm-up before save: %s in %.2f s%s", described, took,
                 f"; {len(added)} new JIT cache file(s), e.g. {', '.join(added[:3])}" if added else "")  # fmt: skip

    # -- setup phases -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(
        self, name: str, *, exact: bool = True, span: int | None = None, timed: str | None = None
    ) -> Iterator[None]:
        """A setup phase, anchored at SAVE's offset at LOAD (graphpersist.memory.layout); `timed` names its timing."""
        from graphpersist import api

        started = time.perf_counter()
        with refusal.recording(), api.phase(name, exact=exact, span=span):
            yield
        if timed:
            self.timed(timed, started)

    @refusal.recording()
    def begin_phase(self, name: str, *, exact: bool = True, span: int | None = None) -> None:
        from graphpersist import api

        api.begin_phase(name, exact=exact, span=span)

    @refusal.recording()
    def end_phase(self) -> None:
        from graphpersist import api

        api.end_phase()

    def declare_state(self, name: str, what: Any, how: str = "bytes") -> None:
        """Device state a post-capture phase writes and graphs read: SAVE stores it, LOAD proves or writes it."""
        from graphpersist import api

        api.declare_state(name, what, how=how)

    # -- memory budget ----------------------------------------------------------------------------------------------
    @refusal.recording()
    def memory_budget(self, profile: Callable[[], int] | None) -> int:
        """The bytes the engine sizes its KV cache (memory pool) by. SAVE: `profile()` (upstream's memory profile),
        the smallest rank's, rounded down to 1 GiB so that a cold and a warm SAVE lay out the same archive;
        recorded in the archive (flags.memory_budget_bytes). LOAD: SAVE's budget, never profiled (`profile` is not
        called), refused when this GPU's free memory cannot hold it."""
        self._enter("budget")
        self.setup_gc.close()  # the setup window ends: the collector's automatic passes run again
        if self.loading:
            assert self.saved_budget is not None  # read (and refused if absent) at begin
            budget.check_free(self.saved_budget, self.adapter.budget_what)
            self.budget_bytes = self.saved_budget
            return self.budget_bytes
        if profile is None:
            raise PersistError("graphpersist: SAVE needs the engine's memory profile to size its budget")
        mine = int(profile())
        values = self.adapter.cpu_gather()(mine) if self.world_size > 1 else [mine]
        self.budget_bytes = budget.rounded(values, self.adapter.budget_what, self.adapter.budget_advice)
        return self.budget_bytes

    # -- graphs -----------------------------------------------------------------------------------------------------
    def new_graph(self) -> Any:
        """The graph object a capture site records into: one SAVE can serialize while saving, else torch's own."""
        import torch

        if self.saving:
            from graphpersist.save import PersistentCUDAGraph

            return PersistentCUDAGraph()
        return torch.cuda.CUDAGraph()

    def add_graph(self, name: str, graph: Any, inputs: list[Any], outputs: Any, *, size: int, mode: str) -> None:
        """SAVE: one captured graph with its static input and output tensors (instantiated as torch would); a graph SAVE
        cannot keep is refused in the glue's words (`graphpersist: ...`)."""
        assert self.saver is not None
        graph.instantiate()  # keep_graph=True defers instantiation to the first replay: keep upstream's timing
        try:
            self.saver.add(name, graph, inputs, outputs, capture_size=size, mode=mode)
        except PersistError as exc:
            raise PersistError(f"graphpersist: {exc}") from None
        self.captured += 1

    @refusal.recording()
    def graphs(self, capture: Callable[[], Any], *, prepared: PreparedState | None = None) -> Any:
        """Where upstream captures: setup ends here (what graphs may read from it is fixed). SAVE runs `capture()`
        (upstream's capture; its sites call `add_graph`), proves the captures left the `prepared` state as setup made
        it and records it, then runs each communicator's post-capture registration, and writes the archive unless the
        adapter writes once the engine is ready. LOAD captures nothing: it restores every graph, proves the `prepared`
        state is SAVE's, installs the graphs where the engine replays them, repeats the communicators' registration
        and proves the declared state. Returns `capture()`'s result (None at LOAD)."""
        from graphpersist import api

        self._enter("graphs")
        before = prepared.read() if prepared is not None else {}
        api.mark_setup(self.adapter.setup_tensors())
        started = time.perf_counter()
        if self.loading:
            self._restore(prepared, before)
            result = None
        else:
            result = capture()
            if prepared is not None:
                self.notes[prepared.note] = prepared.after_capture(before)
            for comm in self.adapter.communicators():
                comm.after_capture(self)
            self.timed("capture", started)
            if not self.adapter.writes_when_ready:
                self._save()
        self._graphs_done = time.perf_counter()
        return result

    @refusal.recording()
    def ready(self) -> None:
        """The engine can serve: SAVE writes the archive now if the adapter writes when ready (its kernel warm-up runs
        first requests), then names what the engine compiled after the archive's caches were packed."""
        self._enter("ready")
        if self._graphs_done is not None:
            self.timed("after_graphs", self._graphs_done)  # the engine's own work between its graphs and serving
        if self.saving:
            self._save()
        if self.mode is switch.Mode.SAVE:
            self.caches.report_late(self)

    def finish(self) -> None:
        """The end of the start (also when it failed): the collection meter stops and the rank's stats are written."""
        if self.finished:
            return
        self.step = "finish"
        self.setup_gc.close()  # a start that failed before its budget
        self.gc_meter.stop()
        rankstats.write(self.rank, self.stats())

    # -- SAVE -------------------------------------------------------------------------------------------------------
    def flags(self) -> dict[str, Any]:
        """Every flag SAVE records and LOAD compares: the engine's, and the memory budget the session sized."""
        return {**self.adapter.flags(self), budget.FLAG: self.budget_bytes}

    def facts(self) -> Facts:
        """What SAVE records of the engine and LOAD compares."""
        return Facts(self.adapter.engine_facts(), self.model, self.adapter.parallel(), self.flags())

    def _save(self) -> dict[str, Any]:
        """Writes this rank's archive; rank 0 also carries the host's JIT caches. Once the archive's content is fixed
        and before those caches are packed, the adapter runs its kernel warm-up (`warm_kernels_before_save`)."""
        from graphpersist import breakdown

        assert self.saver is not None
        started = time.perf_counter()
        warm_s = 0.0

        def warm() -> None:  # runs once the archive's content is fixed, before rank 0 packs the caches
            nonlocal warm_s
            began = time.perf_counter()
            self.adapter.warm_kernels_before_save(self)
            warm_s = time.perf_counter() - began

        summary = self.saver.save(
            self.directory,
            self.facts(),
            rank=self.rank,
            overwrite=True,
            gather=self.adapter.cpu_gather(),
            notes=self.notes,
            shared=(lambda: self.caches.carry(self)) if self.rank == 0 else None,  # the host's ranks share them
            before_write=warm,
        )
        self.written = True
        took = time.perf_counter() - started
        self.timings["save"] = round(took - warm_s, 4)
        self.log("saved %d graphs to %s in %.2f s (kernel warm-up %.2f s; %s)", self.captured, self.directory, took,
                 warm_s, breakdown.of_save(summary))  # fmt: skip
        return summary

    # -- LOAD -------------------------------------------------------------------------------------------------------
    def _restore(self, prepared: PreparedState | None, before: dict[str, Any]) -> Any:
        """Validates the archive against this process, restores memory, images and graphs, installs them, repeats
        the communicators' registration and proves the declared state."""
        from graphpersist import api, breakdown

        started = time.perf_counter()
        inventory = self.adapter.inventory()
        result = api.load(
            self.directory,
            self.facts(),
            sizes=inventory.sizes,
            modes=inventory.modes,
            rank=self.rank,
            setup_tensors=self.adapter.setup_tensors(),
            gather=self.adapter.cpu_gather(),
            output_types=self.adapter.output_types(),
            ahead=self.read_ahead,
        )
        self.kept.append(result)
        if prepared is not None:
            prepared.check_saved(before, result.notes)
        self.restored = self.adapter.install(self, result)
        for comm in self.adapter.communicators():
            comm.restore(self, result.notes)
        api.verify_state()
        took = self.timed("restore", started)
        self.log("restored %d graphs from %s in %.2f s (%s)", self.restored, self.directory, took,
                 breakdown.of_load(result.timings))  # fmt: skip
        return result

    # -- stats ------------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The per-rank stats file's keys (the proof runner and the recipe drivers read them)."""
        stats: dict[str, Any] = {
            "rank": self.rank,
            "mode": self.mode.value,
            "captured": self.captured,
            "restored": self.restored,
            "capture_calls": self.capture_calls,
            "phases": self.timings,
            "jitcache_restored": self.caches.restored,
            "gc": {"frozen_at_start": self.frozen, **self.gc_meter.summary()},  # collections since begin
        }
        if self.run.kernel_choices is not None:  # only an engine that pins Inductor's choices counts them
            stats["kernel_choices"] = dict(self.run.kernel_choices.counts)
        return {**stats, **self.stats_extra}
