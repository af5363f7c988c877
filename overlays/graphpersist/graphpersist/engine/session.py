"""One engine process's persistence session: the SAVE/LOAD lifecycle, owned by the runtime, the same for every engine.

An engine's glue builds an `EngineAdapter` (graphpersist.engine.adapter) around its live objects and opens a
`PersistSession` with it; from then on the glue only calls the session at its seams, in start-up order:

| seam | SAVE | LOAD |
|---|---|---|
| `open` (before distributed init) | the Saver, capture counting, model facts, cache folders | the same |
| `start` | address region on the rank's GPU | region; early facts checked; caches back; phases anchored |
| `phase` / `begin_phase` / `end_phase` | setup divided into phases, each anchored | the same, at SAVE's offsets |
| `mark_setup` | setup ends: what graphs may read from setup is fixed | the same |
| `new_graph` / `add_graph` (capture sites) | keeps every captured graph with its static tensors | never reached |
| `after_capture` | communicators register what the graphs read (post-capture phase) | - |
| `save` / `restore` | writes the archive | validates; restores memory, images, graphs; installs; communicators |

All of a run's state lives on the session (mode, archive, rank and world, notes, timings, counts, what LOAD keeps
alive). The one process-wide thing is which session is active (`current()`), as the address region is process-wide:
an engine process has one; tests activate each of theirs in turn (`activated()`), and two sessions share nothing.

Optional observers (diagnosis, profiling) attach through `GRAPHPERSIST_PLUGINS`, a comma-separated list of
importable modules each with `attach(session)`; they subscribe to the events the session emits (`on`). The product
ships none. No torch at import: the engine glue imports this while it parses arguments.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpersist import gcpause, rankstats, switch
from graphpersist.engine.adapter import EngineAdapter
from graphpersist.errors import PersistError

PLUGINS_ENV = "GRAPHPERSIST_PLUGINS"

_active: PersistSession | None = None  # the process-wide slot: which session this engine process runs


def current() -> PersistSession | None:
    """The active session of this process, or None when persistence is off (or this process runs no model)."""
    return _active


@dataclass
class PersistSession:
    """One engine process's SAVE or LOAD: everything the run knows, and the lifecycle every engine shares."""

    adapter: EngineAdapter
    mode: switch.Mode
    directory: Path
    rank: int
    world_size: int
    saver: Any = None  # graphpersist.save.Saver while saving
    notes: dict[str, Any] = field(default_factory=dict)  # the engine's bookkeeping SAVE stores for this rank
    saved_notes: dict[str, Any] = field(default_factory=dict)  # LOAD: SAVE's notes of this rank (read at start)
    saved_flags: dict[str, Any] = field(default_factory=dict)  # LOAD: SAVE's flags (read at start)
    timings: dict[str, float] = field(default_factory=dict)  # phases in seconds, in order
    stats_extra: dict[str, Any] = field(default_factory=dict)  # engine-specific keys of the stats file
    options: dict[str, Any] = field(default_factory=dict)  # what observers may change (e.g. LOAD's profile forward)
    captured: int = 0
    restored: int = 0
    capture_calls: int = 0
    model: dict[str, str] = field(default_factory=dict)  # model facts, computed at open in SAVE and LOAD alike
    restored_files: list[str] = field(default_factory=list)  # LOAD: JIT cache files put back from the archive
    caches: dict[str, Path] = field(default_factory=dict)  # JIT cache folders by name
    carried: set[str] | None = None  # SAVE, rank 0: the cache files the archive carries
    kernel_choices: Any = None  # graphpersist.graph.kernelchoice.Choices when the engine pins Inductor's choices
    done: bool = False
    kept: list[Any] = field(default_factory=list)  # objects LOAD must keep alive (loaded graphs, peer mappings)
    frozen: int | None = None  # LOAD: objects of the start-up heap gc.freeze() moved out of the collector's way
    gc_meter: gcpause.CollectionMeter = field(default_factory=gcpause.CollectionMeter, repr=False)
    _listeners: dict[str, list[Callable[..., None]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for section in self.adapter.note_sections:  # where the engine's capture sites note each graph
            self.notes.setdefault(section, {})

    # -- opening ------------------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, adapter: EngineAdapter, resolved: switch.Switch, rank: int, world_size: int) -> PersistSession:
        """Opens and activates this process's session (persistence on); refuses a second one in the process."""
        if _active is not None:
            raise PersistError(
                f"graphpersist: a second {adapter.name} model runner in one process (a draft model?) cannot be "
                "persisted: serve without speculative decoding"
            )
        if not resolved.enabled or resolved.directory is None:
            raise PersistError("graphpersist: a persistence session opened with persistence off")
        sess = cls(adapter, resolved.mode, resolved.directory, rank, world_size)
        if sess.mode is switch.Mode.SAVE:
            from graphpersist.save import Saver

            sess.saver = Saver(unused_param_bytes=adapter.unused_param_bytes)
        sess.timings["process_start"] = rankstats.seconds_since_process_start()
        sess.model = adapter.model_facts()
        sess._record_caches()
        sess.count_every_capture()
        sess.activate()
        sess._attach_plugins()
        return sess

    def activate(self) -> None:
        global _active
        _active = self

    def deactivate(self) -> None:
        global _active
        if _active is self:
            _active = None

    @contextlib.contextmanager
    def activated(self) -> Iterator[PersistSession]:
        """This session active for a block, the one before it afterwards (tests; an engine keeps its one)."""
        global _active
        before, _active = _active, self
        try:
            yield self
        finally:
            _active = before

    # -- state ----------------------------------------------------------------------------------------------------
    @property
    def saving(self) -> bool:
        """SAVE, until the archive is written (later captures are upstream's own)."""
        return self.mode is switch.Mode.SAVE and not self.done

    @property
    def loading(self) -> bool:
        return self.mode is switch.Mode.LOAD

    def log(self, message: str, *args: Any) -> None:
        """One line in the engine's own log (its logger: the engine configures where its lines go)."""
        self.adapter.logger.info("graphpersist: rank %d: " + message, self.rank, *args)

    def timed(self, name: str, started: float) -> float:
        """Records the time since `started` as phase `name`; returns it."""
        took = time.perf_counter() - started
        self.timings[name] = round(took, 4)
        return took

    # -- observers ------------------------------------------------------------------------------------------------
    def on(self, event: str, listener: Callable[..., None]) -> None:
        """Calls `listener(session, **payload)` at every `event` (see `emit`'s callers for the events)."""
        self._listeners.setdefault(event, []).append(listener)

    def emit(self, event: str, **payload: Any) -> None:
        for listener in self._listeners.get(event, []):
            listener(self, **payload)

    def _attach_plugins(self) -> None:
        for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise PersistError(f"graphpersist: {PLUGINS_ENV} names {name!r}, which cannot be imported ({exc}): "
                                   f"fix the name or unset {PLUGINS_ENV}") from None  # fmt: skip
            module.attach(self)
            self.log("observer %s attached", name)

    # -- start ----------------------------------------------------------------------------------------------------
    def start(self) -> Any:
        """Before distributed init: the address region on this rank's GPU; LOAD also freezes the start-up heap
        (graphpersist.gcpause), refuses what the facts known this early contradict, puts the JIT caches back before
        anything compiles, and anchors the phases."""
        import torch

        from graphpersist import api

        self.gc_meter.start()
        self.frozen = gcpause.freeze_at_start(self.loading)  # the imports' heap, before any device memory exists
        torch.cuda.set_device(self.adapter.device_index())  # the region belongs to this rank's GPU
        info = api.start_region()
        if self.loading:
            self.check_before_setup()
            self.restore_caches()
            api.use_layout(self.directory, rank=self.rank)
        self.emit("started", region=info)
        self.log("%s %s, region %#x + %d GiB", self.mode.value, self.directory, info.base, info.size >> 30)
        return info

    def check_before_setup(self) -> None:
        """LOAD, before the engine sets anything up (`start` calls it): versions, GPU, layout, model and the
        configuration flags known this early, each named with its saved and live value; then the engine reads
        what it reuses from SAVE (`read_saved`)."""
        import torch

        from graphpersist import api
        from graphpersist.archive.liveenv import collect_live

        live = collect_live(
            device=torch.cuda.current_device(),
            engine=self.adapter.engine_facts(),
            model=self.model,
            parallel=self.adapter.parallel(),
            flags=self.adapter.config_flags(),
        )
        archive = api.check_before_setup(self.directory, live, self.rank)
        self.saved_flags = dict(archive.manifest.world.flags)
        self.saved_notes = archive.rank_facts(self.rank).engine_notes()
        self.adapter.read_saved(self, archive)

    def pin_kernel_choices(self) -> None:
        """Inductor's timed launch configs (graphpersist.graph.kernelchoice): SAVE records its choices in the rank's
        notes, LOAD launches the archive's instead of timing again."""
        from graphpersist.graph import kernelchoice

        saved = self.saved_notes.get(kernelchoice.NOTES_KEY) if self.loading else None
        self.kernel_choices = kernelchoice.install(loading=self.loading, saved=saved, log=lambda m: self.log("%s", m))
        if not self.loading:
            self.notes[kernelchoice.NOTES_KEY] = self.kernel_choices.used  # filled as kernels first launch

    # -- phases ---------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(
        self, name: str, *, exact: bool = True, span: int | None = None, timed: str | None = None
    ) -> Iterator[None]:
        """A setup phase, anchored at SAVE's offset at LOAD (graphpersist.memory.layout); `timed` names its timing."""
        from graphpersist import api

        started = time.perf_counter()
        with api.phase(name, exact=exact, span=span):
            yield
        if timed:
            self.timed(timed, started)

    def begin_phase(self, name: str, *, exact: bool = True, span: int | None = None) -> None:
        from graphpersist import api

        api.begin_phase(name, exact=exact, span=span)

    def end_phase(self) -> None:
        from graphpersist import api

        api.end_phase()

    def declare_state(self, name: str, what: Any, how: str = "bytes") -> None:
        """Device state a post-capture phase writes and graphs read: SAVE stores it, LOAD proves or writes it."""
        from graphpersist import api

        api.declare_state(name, what, how=how)

    def mark_setup(self) -> int:
        """Setup ends here: everything allocated so far is placed exactly at LOAD; the graphs come next."""
        from graphpersist import api

        return api.mark_setup(self.adapter.setup_tensors())

    # -- capture (SAVE) -------------------------------------------------------------------------------------------
    def new_graph(self) -> Any:
        """The graph object a capture site records into: one SAVE can serialize while saving, else torch's own."""
        import torch

        if self.saving:
            from graphpersist.save import PersistentCUDAGraph

            return PersistentCUDAGraph()
        return torch.cuda.CUDAGraph()

    def add_graph(self, name: str, graph: Any, inputs: list[Any], outputs: Any, *, size: int, mode: str) -> None:
        """SAVE: one captured graph with its static input and output tensors (instantiated as torch would)."""
        assert self.saver is not None
        graph.instantiate()  # keep_graph=True defers instantiation to the first replay: keep upstream's timing
        self.saver.add(name, graph, inputs, outputs, capture_size=size, mode=mode)
        self.captured += 1

    def count_every_capture(self) -> None:
        """Counts every CUDA-graph capture this process begins: LOAD must begin none, and the proof reads it."""

        def counted() -> None:
            if _active is self:
                self.capture_calls += 1

        rankstats.count_captures(counted)

    def after_capture(self) -> None:
        """SAVE, once every graph is captured: each communicator registers what the graphs read."""
        for comm in self.adapter.communicators():
            comm.after_capture(self)

    # -- SAVE -----------------------------------------------------------------------------------------------------
    def save(self) -> dict[str, Any]:
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
            engine=self.adapter.engine_facts(),
            model=self.model,
            rank=self.rank,
            parallel=self.adapter.parallel(),
            flags=self.adapter.flags(self),
            overwrite=True,
            gather=self.adapter.cpu_gather(),
            notes=self.notes,
            shared=self.carry_caches if self.rank == 0 else None,  # the ranks of one host share its caches
            before_write=warm,
        )
        self.done = True
        took = time.perf_counter() - started
        self.timings["save"] = round(took - warm_s, 4)
        self.emit("saved", saver=self.saver)
        self.log("saved %d graphs to %s in %.2f s (kernel warm-up %.2f s; %s)", self.captured, self.directory, took,
                 warm_s, breakdown.of_save(summary))  # fmt: skip
        return summary

    # -- LOAD -----------------------------------------------------------------------------------------------------
    def restore(self, *, check: Callable[[dict[str, Any]], None] | None = None) -> Any:
        """Validates the archive against this process, restores memory, images and graphs, installs them where the
        engine replays them, repeats the communicators' registration and proves the declared state. `check(notes)`
        runs the engine's own comparisons against the rank's saved notes before anything is installed."""
        from graphpersist import api, breakdown

        started = time.perf_counter()
        inventory = self.adapter.inventory()
        result = api.load(
            self.directory,
            engine=self.adapter.engine_facts(),
            model=self.model,
            sizes=inventory.sizes,
            modes=inventory.modes,
            rank=self.rank,
            parallel=self.adapter.parallel(),
            flags=self.adapter.flags(self),
            setup_tensors=self.adapter.setup_tensors(),
            gather=self.adapter.cpu_gather(),
            on_memory_restored=lambda ranges: self.emit("memory_restored", ranges=ranges),
        )
        self.kept.append(result)
        if check is not None:
            check(result.notes)
        self.restored = self.adapter.install(self, result)
        for comm in self.adapter.communicators():
            comm.restore(self, result.notes)
        api.verify_state()
        self.done = True
        took = self.timed("restore", started)
        self.emit("restored", result=result)
        self.log("restored %d graphs from %s in %.2f s (%s)", self.restored, self.directory, took,
                 breakdown.of_load(result.timings))  # fmt: skip
        return result

    # -- caches ---------------------------------------------------------------------------------------------------
    def _record_caches(self) -> None:
        """The engine's cache folders as this process resolves them at start, before the engine redirects any."""
        from graphpersist import cachefolders

        self.caches, left_out = cachefolders.resolve_all(self.adapter.cache_resolvers())
        if left_out:
            self.log("JIT caches not carried: %s", "; ".join(f"{n} ({why})" for n, why in left_out.items()))

    def carry_caches(self) -> dict[str, bytes]:
        """SAVE, rank 0: the archive's shared JIT-cache file; what it carries is kept for `report_late`."""
        from graphpersist import cachefolders
        from graphpersist.archive import jitcache

        shared = cachefolders.carry(self)
        self.carried = jitcache.listing(self.caches)
        return shared

    def restore_caches(self) -> None:
        """LOAD, before anything compiles: puts back the cache files this host lacks, keeps its own."""
        from graphpersist import cachefolders

        cachefolders.restore(self)

    def cache_listing(self) -> set[str]:
        """The cache files this process's folders hold now (what a warm-up added is the difference)."""
        from graphpersist.archive import jitcache

        return jitcache.listing(self.caches)

    def report_late(self) -> None:
        """SAVE, rank 0, once the engine's own warm-up is done: names what it compiled after the archive was written,
        which a LOAD on a fresh host would compile again."""
        if self.carried is None:
            return
        late = sorted(self.cache_listing() - self.carried)
        if late:
            self.log("%d JIT cache file(s) were compiled after the archive was written, so it lacks them (e.g. %s): "
                     "a LOAD on a fresh host compiles them again. SAVE once more on this host (its caches hold them "
                     "now) to carry them", len(late), ", ".join(late[:3]))  # fmt: skip

    # -- stats ----------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The per-rank stats file's keys (the proof runner and the recipe drivers read them)."""
        stats: dict[str, Any] = {
            "rank": self.rank,
            "mode": self.mode.value,
            "captured": self.captured,
            "restored": self.restored,
            "capture_calls": self.capture_calls,
            "phases": self.timings,
            "jitcache_restored": self.restored_files,
        }
        stats["gc"] = {"frozen_at_start": self.frozen, **self.gc_meter.summary()}  # collections since start()
        if self.kernel_choices is not None:  # only an engine that pins Inductor's choices counts them (vLLM)
            stats["kernel_choices"] = dict(self.kernel_choices.counts)
        return {**stats, **self.stats_extra}

    def write_stats(self) -> None:
        """Per-rank counts for the proof runner (only when GRAPHPERSIST_STATS_DIR is set); the end of the start, so
        the collection meter stops here."""
        self.gc_meter.stop()
        rankstats.write(self.rank, self.stats())


KERNEL_WARMUP = "kernel_warmup_before_save"  # the stats phase of the SAVE's kernel warm-up (both engines)
