"""Triton-free helpers behind `model_repository/tensorrt_llm/1/model.py`.

The model file stays a thin adapter: it reads tensors, calls `convert.request_rows`, enqueues
into an executor made by `backend.create_executor`, and sends what `convert.response_tensors`
builds. Everything here is unit-tested without a Triton server.
"""
