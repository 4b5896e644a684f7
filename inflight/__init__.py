"""The in-flight batching engine, in two wings over a common ground.

- Ground: `api` (the Executor-interface types and configs), `platform` (device policy),
  `fatal_errors`.
- Below both wings: `core` (scheduler, paged KV blocks, sequences; no torch), `model`
  (Llama-family model), `kernels` (Triton-language kernels), `sampling`, `distributed`.
- Device wing: `runner` (the worker, step inputs, CUDA graphs, KV sizing, ranks).
- Request wing: `engine` (`LLMEngine` and each request's state).
- `hosts`: what drives an engine (thread, process, offline); `serving`: the Triton stub's side.
Each folder imports only folders below it (tests/unit/test_layering.py).
"""
