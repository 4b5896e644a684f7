"""A bound on every request body, checked while it arrives.

Without one, a single 100 MB chat message reached the tokenizer, which grew to gigabytes. The
bound is applied before any route reads the body, and its answer is a 413 in OpenAI's error
shape (code `request_too_large`):
- a `Content-Length` over the bound is answered without the body being kept: at once when the
  client waits for `100 Continue` (curl does, for large bodies), else after the body is read and
  dropped, so that a client that sends the whole body before it reads (urllib, with
  `Connection: close`) gets the 413 rather than a reset connection;
- any other body is counted as it arrives, answered once it passes the bound (the rest dropped
  in the same way), and otherwise handed on whole.
Dropping stops at DRAIN_FACTOR times the bound; a larger body gets its answer and a closed
connection.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from openai_frontend.errors import APIError

DEFAULT_MAX_BODY_BYTES = 16 << 20
DRAIN_FACTOR = 8


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
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await self._drop(receive, 0)
            return await _too_large(self.max_bytes)(scope, receive, send)
        chunks, num_bytes, message = [], 0, {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            if message["type"] != "http.request":  # gone before its body arrived
                return
            chunks.append(message.get("body", b""))
            num_bytes += len(chunks[-1])
            if num_bytes > self.max_bytes:
                if message.get("more_body"):
                    await self._drop(receive, num_bytes)
                return await _too_large(self.max_bytes)(scope, receive, send)
        await self.app(scope, replay(b"".join(chunks), receive), send)

    async def _drop(self, receive, num_bytes: int) -> None:
        """Reads the rest of a body and keeps none of it, up to DRAIN_FACTOR times the bound."""
        message = {"more_body": True}
        while message.get("more_body") and num_bytes <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            num_bytes += len(message.get("body", b""))


def replay(body: bytes, receive):
    """A `receive` that hands over `body` once, then listens to the connection again."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
