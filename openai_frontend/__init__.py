"""An OpenAI-compatible HTTP API in front of a running tritonserver.

It speaks only to Triton, over gRPC streaming with tritonclient's asyncio client, and serves
`/v1/models`, `/v1/completions` and `/v1/chat/completions` with FastAPI + uvicorn. Start it with
`python -m openai_frontend` (or `make serve`, which starts Triton too). Modules, one concept each:
protocol (the schema), sampling (OpenAI fields → ensemble requests), chat (template rendering),
triton_client, stop (stop-string matcher), generation (choices), responses, sse, errors, app.
"""
