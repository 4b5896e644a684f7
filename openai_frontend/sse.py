"""Server-sent events, and noticing a client that leaves.

A streamed answer is `data: {chunk}` events ending with `data: [DONE]`. The HTTP status is
decided before the first byte: the first event is awaited first, so a request the ensemble
refuses gets its proper status and JSON error, not a 200 with an error inside. An error after
that is sent as an `{"error": ...}` event, which the `openai` client raises. The headers and
the first event are written back to back as soon as that event is ready (nothing buffers or
compresses them).

When the client disconnects, Starlette cancels the streaming body; for a non-streamed answer
`until_disconnect` does the same. Either way the cancellation closes the choice generators,
which cancels their Triton requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from openai_frontend.errors import APIError

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def event(data: str) -> bytes:
    return b"data: " + data.encode("utf-8") + b"\n\n"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first.

    `work` runs in the caller's task, not a task of its own: its result reaches the caller
    without a hop through the event loop (the first token waits for each hop); a watcher task
    cancels the caller when the client goes."""
    caller = asyncio.current_task()
    gone = False

    async def watch():
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        caller.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        caller.uncancel()
        raise ClientGone() from None
    finally:
        watcher.cancel()
        if asyncio.iscoroutine(work):
            work.close()  # never started (cancelled at once): no "never awaited" warning


class _EventStream(StreamingResponse):
    """A StreamingResponse that writes its headers and its first event in the request's own task,
    at once: Starlette's starts a task group and a task first, and the time to first token pays
    for the hop. The rest streams as Starlette's does, cancelled when the client disconnects."""

    def __init__(self, first: bytes, body: AsyncIterator[bytes], events: AsyncIterator,
                 headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.first = first
        self.events = events  # closed here too, should the body never start

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()  # a no-op once the body has run

    async def stream_response(self, send) -> None:  # the headers are sent
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _body(events: AsyncIterator, stream) -> AsyncIterator[bytes]:
    try:
        async for item in events:
            data = stream.chunk_json(item)
            if data is not None:  # None: nothing new to send (a tool call still being written)
                yield event(data)
        final = stream.final_json()
        if final is not None:
            yield event(final)
    except APIError as exc:
        yield event(json.dumps(exc.body()))
    finally:
        await events.aclose()  # a disconnect lands here: cancel what still runs
    yield DONE


async def event_stream(request: Request, events: AsyncIterator, stream) -> StreamingResponse:
    """A text/event-stream response of `events` rendered by `stream` (a ChatStream or
    CompletionStream). Raises APIError, before any byte is sent, if the first event fails."""
    try:
        first = await until_disconnect(request, anext(events, None))
        body = _body(events, stream)
        if first is None:  # no event at all: the body has the final chunk and [DONE]
            first = await anext(body)
        else:
            first = event(stream.chunk_json(first))
    except BaseException:
        await events.aclose()
        raise
    return _EventStream(first, body, events, {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
