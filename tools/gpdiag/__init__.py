"""Diagnosis tools for the engines' persistence: never shipped, never imported by the product.

The product keeps no hook for them: a diagnosis run puts `tools/gpdiag/site` on PYTHONPATH (the vLLM driver does
whenever a `GP_DIAG_*` switch is set), whose `sitecustomize` calls `gpdiag.vllm.install()` in every process, which
wraps the session's steps from outside (what it wraps: `contract.toml`). The `GP_DIAG_*` variables below choose what
runs; without any of them nothing is wrapped.

| module | what |
|---|---|
| `vllm` | the wiring: wraps the session's steps and runs the switches below there |
| `vllm_state` | runner state, region sums, allocation history, SAVE's bytes, KV blocks, DOT (`GP_DIAG_DUMP` ...) |
| `startprofile` | cProfile of a worker's start (`GP_DIAG_CPROFILE`) |
| `vllm_pieces` | the compiled model's load piece by piece, equal pieces' artifacts reused (`GP_DIAG_PIECES`) |
| `restored_fill` | fill the memory a LOAD mapped afresh with one byte (`GP_DIAG_FILL_RESTORED`) |
| `vllm_rpc` | functions a driver runs in the worker through `LLM.collective_rpc` (bisect, probes) |
| `vllm_replaytime` | replay timing of the restored or captured graphs (`LLM.collective_rpc`) |
| `rebuild` | the reference rebuild (one cuda-bindings call per node) and `in_load()`, which makes load() use it |
"""
