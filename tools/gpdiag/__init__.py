"""Diagnosis tools for the engines' persistence: never shipped, never imported by the product.

They attach to a running engine through the runtime's observer hook: a process started with
`GRAPHPERSIST_PLUGINS=gpdiag.vllm` (and this folder on PYTHONPATH; the proof runner puts tools/ there) calls
`gpdiag.vllm.attach(session)` when its persistence session opens. The `GP_DIAG_*` variables below choose what runs;
without any of them the observer does nothing.

| module | what |
|---|---|
| `vllm` | the observer: wires the switches below to the session's events |
| `vllm_state` | runner state, region sums, allocation history, SAVE's bytes, KV blocks, DOT (`GP_DIAG_DUMP` ...) |
| `startprofile` | cProfile of a worker's start (`GP_DIAG_CPROFILE`) |
| `restored_fill` | fill the memory a LOAD mapped afresh with one byte (`GP_DIAG_FILL_RESTORED`) |
| `vllm_rpc` | functions a driver runs in the worker through `LLM.collective_rpc` (bisect, probes) |
| `vllm_replaytime` | replay timing of the restored or captured graphs (`LLM.collective_rpc`) |
"""
