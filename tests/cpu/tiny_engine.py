"""A third engine, written as an adapter alone: `TinyEngine`, a small PyTorch decoder that captures one CUDA graph per
batch size and serves by replaying it, persisted through `graphpersist.engine` without a lifecycle of its own.

What the engine writes for persistence: an `EngineAdapter` that answers the session's questions about its objects
(`TinyAdapter`), and one session call at each seam of its start (`begin`, `memory_budget`, `graphs`, `ready`,
`finish`: the lines marked `# seam`), each where a patch would call in a real engine. Region, phases, the memory
budget, the archive, validation and the restore are the session's. With persistence off (`GRAPHPERSIST_MODE` unset)
every seam is a no-op and the engine runs as it would without the runtime.

Used by tests/cpu/test_tiny_engine.py (the session's protocol, with CUDA stood in) and tests/gpu/test_tiny_engine_gpu.py
(SAVE and LOAD in fresh processes on a GPU, outputs bit-identical). overlays/graphpersist/graphpersist/engine/README.md
shows it as the recipe for a third engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from graphpersist import engine


@dataclass(frozen=True)
class TinyConfig:
    """The engine's configuration: what its graphs depend on."""

    hidden: int = 512
    layers: int = 4
    sizes: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0
    cache_bytes: int = (1 << 30) + (300 << 20)  # what its memory profile finds (SAVE rounds it down to 1 GiB)


class TinyModel(torch.nn.Module):
    """A stack of linear layers with SiLU, reading a cache row per request (as attention reads a KV cache)."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(cfg.seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(cfg.hidden, cfg.hidden) for _ in range(cfg.layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(cfg.hidden, cfg.hidden, generator=gen) / math.sqrt(cfg.hidden))
                layer.bias.copy_(torch.randn(cfg.hidden, generator=gen) / 16)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.silu(layer(x)) + cache[: x.shape[0]]
        return x


class TinyEngine:
    """Builds the model, sizes its cache, captures (or restores) one graph per batch size, serves by replay."""

    def __init__(self, cfg: TinyConfig, device: str = "cuda") -> None:
        self.cfg, self.device = cfg, device
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.persist = engine.PersistSession.begin(TinyAdapter(self))  # seam: before anything allocates
        try:
            self.model = TinyModel(cfg).to(device)
            budget = self.persist.memory_budget(self._profile) if self.persist else self._profile()  # seam
            rows = budget >> 16  # one cache row per 64 KiB of budget, as a KV cache has blocks per byte budget
            self.cache = (torch.randn(rows, cfg.hidden, generator=torch.Generator().manual_seed(1)) / 8).to(device)
            self.inputs = {bs: torch.zeros(bs, cfg.hidden, device=device) for bs in cfg.sizes}
            if self.persist:
                self.persist.graphs(self._capture)  # seam: SAVE captures and writes, LOAD restores
                self.persist.ready()  # seam
            else:
                self._capture()
        finally:
            if self.persist:
                self.persist.finish()  # seam

    def _profile(self) -> int:
        return self.cfg.cache_bytes

    @torch.no_grad()
    def _capture(self) -> None:
        warm = torch.cuda.Stream() if self.device == "cuda" else None
        with torch.cuda.stream(warm) if warm is not None else contextlib.nullcontext():
            for bs in self.cfg.sizes:  # warm-up before capture, as engines do
                self.model(self.inputs[bs], self.cache)
        if warm is not None:
            torch.cuda.current_stream().wait_stream(warm)
        for bs in self.cfg.sizes:
            graph, out = self._capture_one(bs)
            self.graphs[bs] = (graph, out)
            sess = engine.current()
            if sess is not None and sess.saving:  # the capture site reports its graph
                sess.add_graph(graph_name(bs), graph, [self.inputs[bs]], out, size=bs, mode="decode")
                sess.notes["decode"][graph_name(bs)] = {"size": bs}

    def _capture_one(self, bs: int) -> tuple[Any, torch.Tensor]:
        graph = engine.new_graph()
        with torch.cuda.graph(graph):
            out = self.model(self.inputs[bs], self.cache)
        return graph, out

    @torch.no_grad()
    def generate(self, x: torch.Tensor) -> torch.Tensor:
        """One step for a batch of `x.shape[0]` requests: the captured (or restored) graph of that size, replayed."""
        graph, out = self.graphs[x.shape[0]]
        self.inputs[x.shape[0]].copy_(x)
        graph.replay()
        return out.clone()


def graph_name(bs: int) -> str:
    return f"tiny/{bs}"


class TinyAdapter(engine.EngineAdapter):
    """TinyEngine as the persistence session asks about it."""

    name = "tinyllm"
    note_sections = ("decode",)
    logger = logging.getLogger("tinyllm.graphpersist")
    entry_points = "TinyEngine(...)"
    budget_what = "cache"
    budget_advice = "raise TinyConfig.cache_bytes"

    def __init__(self, eng: TinyEngine) -> None:
        self.eng = eng

    @property
    def cfg(self) -> TinyConfig:
        return self.eng.cfg

    def engine_facts(self) -> dict[str, str]:
        return {"name": "tinyllm", "version": "1", "commit": ""}

    def model_facts(self) -> dict[str, str]:
        shape = {"hidden": self.cfg.hidden, "layers": self.cfg.layers, "seed": self.cfg.seed}
        return {"dtype": "torch.float32", "config_fingerprint": hashlib.sha256(json.dumps(shape).encode()).hexdigest()}

    def parallel(self) -> dict[str, int]:
        return {"world_size": 1, "tp_size": 1, "pp_size": 1, "ep_size": 1}

    def config_flags(self) -> dict[str, Any]:
        return {"sizes": list(self.cfg.sizes), "cache_bytes": self.cfg.cache_bytes}

    def flags(self, session: engine.SessionView) -> dict[str, Any]:
        return {**self.config_flags(), "cache_rows": int(self.eng.cache.shape[0])}

    def rank(self) -> int:
        return 0

    def device_index(self) -> int:
        return 0

    def cpu_gather(self) -> Callable[[Any], list[Any]]:
        return lambda mine: [mine]  # one rank

    def setup_tensors(self) -> dict[str, Any]:
        named = {f"param.{n}": p.data for n, p in self.eng.model.named_parameters()}
        return {**named, "cache": self.eng.cache, **{f"input.{bs}": t for bs, t in self.eng.inputs.items()}}

    def inventory(self) -> engine.Inventory:
        return engine.Inventory(sorted(self.cfg.sizes), ["decode"])

    def install(self, session: engine.SessionView, result: Any) -> int:
        saved, live = result.notes.get("decode", {}), {graph_name(bs) for bs in self.cfg.sizes}
        if set(saved) != live:
            raise engine.graphs_differ("decode", saved, live)
        for bs in self.cfg.sizes:
            graph = result[graph_name(bs)]
            self.eng.graphs[bs] = (graph, graph.outputs)
        return len(live)


def config_of(text: str) -> TinyConfig:
    """A TinyConfig from its JSON (what the tests pass between processes)."""
    fields = json.loads(text)
    return TinyConfig(**{**fields, "sizes": tuple(fields.get("sizes", TinyConfig.sizes))})


def config_text(cfg: TinyConfig) -> str:
    return json.dumps(asdict(cfg))


@contextlib.contextmanager
def persisting(mode: str, directory: str) -> Iterator[None]:
    """GRAPHPERSIST_MODE/DIR for a block (the engine reads its switch from the environment, as vLLM's workers do)."""
    import os

    before = {k: os.environ.get(k) for k in ("GRAPHPERSIST_MODE", "GRAPHPERSIST_DIR")}
    os.environ.update(GRAPHPERSIST_MODE=mode, GRAPHPERSIST_DIR=directory)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
