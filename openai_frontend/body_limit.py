"""A bound on every request body, checked while it arrives.

Without one, a single 100 MB chat message reached the tokenizer, which grew to gigabytes. The
bound is applied before any route reads the body: a `Content-Length` over it gets a 413 at
once, without the body being read into memory (uvicorn buffers 64 KiB of it, then discards the
rest as it arrives once the answer is complete, so the client can finish sending and read the
413); any other body is read here, counted as it arrives, answered with a 413 as soon as it
passes the bound, and otherwise handed on whole. The answer is OpenAI's error shape, code `request_too_large`.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from openai_frontend.errors import APIError

DEFAULT_MAX_BODY_BYTES = 16 << 20


def _too_large(max_bytes: int) -> JSONResponse:
    error = APIError(413, f"The request body is larger than this server accepts ({max_bytes} bytes; "
                          "--max-body-bytes).", None, "request_too_large")
    return JSONResponse(error.body(), status_code=413)


class BodyLimit:
    """An ASGI app: `app` with request bodies of at most `max_bytes`."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _too_large(self.max_bytes)(scope, receive, send)
        chunks, num_bytes, message = [], 0, {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            if message["type"] != "http.request":  # gone before its body arrived
                return
            chunks.append(message.get("body", b""))
            num_bytes += len(chunks[-1])
            if num_bytes > self.max_bytes:
                return await _too_large(self.max_bytes)(scope, receive, send)
        await self.app(scope, replay(b"".join(chunks), receive), send)


def replay(body: bytes, receive):
    """A `receive` that hands over `body` once, then listens to the connection again."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
