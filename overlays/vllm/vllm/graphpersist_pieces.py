"""LOAD hands each compiled piece vLLM's cache file does not list the artifact SAVE saw it get, without running
Inductor up to AOTAutograd's key (patches/vllm/README.md, "The worker's start"; graphpersist.engine.notedkeys)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from graphpersist import engine

NOTES_KEY = engine.COMPILED_PIECES  # the rank's notes: AOTAutograd's key by piece, <hash>/<rank>/<model>/<range>/<i>
_INDUCTOR = ("inductor_standalone", "inductor")  # their compile moves num_inductor_compiles first (compiler_interface)
_upstream: Any = None  # CompilerManager.compile as vLLM defines it, once wrapped (the wrapper is process-wide)


def install(sess: engine.PersistSession) -> None:
    """Reads SAVE's keys (LOAD refuses a damaged entry here); wraps CompilerManager.compile once per process."""
    global _upstream
    from vllm.compilation.backends import CompilerManager
    from vllm.compilation.counter import compilation_counter as counter

    sess.noted_keys(NOTES_KEY)
    if _upstream is not None:
        return
    _upstream = upstream = CompilerManager.compile

    @functools.wraps(upstream)
    def compile_piece(self: Any, graph: Any, example_inputs: Any, inductor_config: Any, compilation_config: Any,
                      compile_range: Any, graph_index: int = 0, num_graphs: int = 1,
                      is_encoder: bool = False) -> Any:  # fmt: skip
        now = engine.current()
        keys = now.noted_keys(NOTES_KEY) if now is not None else None
        name = f"{folder_of(self.cache_dir)}/{compile_range.start}-{compile_range.end}/{graph_index}"
        # Upstream would hash it (backends.py:296-364): not listed; after an Inductor compile set its process-wide
        # settings; neither the first nor the last piece (vLLM's compile timing and log lines).
        hashed = ((compile_range, graph_index, self.compiler.name) not in self.cache and self.compiler.name in _INDUCTOR
                  and counter.num_inductor_compiles > 0 and 0 < graph_index < num_graphs - 1)  # fmt: skip
        artifact = keys.reuse(name, self.loaded_artifacts) if keys is not None and hashed else None
        if artifact is not None:  # what StopCompiling returns, with the counters its path moves
            counter.num_backend_compilations += 1
            counter.num_inductor_compiles += 1
            return artifact
        artifact = upstream(self, graph, example_inputs, inductor_config, compilation_config, compile_range,
                            graph_index, num_graphs, is_encoder)  # fmt: skip
        if keys is not None:
            keys.ran_upstream(name, artifact, self.loaded_artifacts)
        return artifact

    CompilerManager.compile = compile_piece


def folder_of(cache_dir: str) -> str:
    """A compiled model's folder as the notes name it: the compile cache's hash, the rank and the model's prefix."""
    return "/".join(Path(cache_dir).parts[-3:])
