"""Triton-free helpers behind `model_repository/tensorrt_llm/1/model.py`, on the stub's side of
the engine process, and the protocol between the two (`wire`, `channel`).

The model file stays a thin adapter: it reads tensors, calls `convert.request_rows`, enqueues
into an executor made by `inflight.hosts.backend.create_executor`, and sends what
`convert.response_tensors` builds. Everything here is unit-tested without a Triton server.
Nothing here imports the engine: the engine process (`inflight.hosts.engine_process`) imports
this package, not the other way round.
"""
