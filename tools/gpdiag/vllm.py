"""The diagnosis observer of a vLLM worker's persistence session (`GRAPHPERSIST_PLUGINS=gpdiag.vllm`).

Wires the `GP_DIAG_*` switches to the session's events, at the points the product's worker emits them:
`started` (the region exists: allocation history begins), `memory_restored` (LOAD mapped memory afresh),
`saved` / `restored` (the graphs: DOT prints), `ready` (vLLM's warm-up done: runner-state fingerprints, SAVE's
bytes, KV blocks) and `stopped` (the start is over: the cProfile is written). `GP_DIAG_EXTRA_WARMUP=1` and
`GP_DIAG_LOAD_PROFILE=lean|full|small` set the session options the worker reads.
"""

from __future__ import annotations

import os
from typing import Any

from gpdiag import restored_fill, startprofile

EXTRA_WARMUP_ENV = "GP_DIAG_EXTRA_WARMUP"
LOAD_PROFILE_ENV = "GP_DIAG_LOAD_PROFILE"


def attach(session: Any) -> None:
    from gpdiag import vllm_state

    startprofile.start()
    if os.environ.get(EXTRA_WARMUP_ENV) == "1":
        session.options["warm_kernels_at_load"] = True
    if how := os.environ.get(LOAD_PROFILE_ENV):
        session.options["load_profile"] = how
    session.on("started", lambda s, region: vllm_state.start_history())
    session.on("memory_restored", restored_fill.fill)
    session.on("saved", lambda s, saver: vllm_state.dump_dots({n: e.graph.raw_cuda_graph()
                                                               for n, e in saver.entries.items()},
                                                              saving=True))  # fmt: skip
    session.on("restored", lambda s, result: vllm_state.dump_dots({n: g.graph for n, g in result.graphs.items()},
                                                                  saving=False))  # fmt: skip
    session.on("ready", lambda s, worker: vllm_state.dump_runner_state(worker.model_runner, s.rank,
                                                                       saving=not s.loading))  # fmt: skip
    session.on("stopped", lambda s, worker: startprofile.stop(s.rank))
