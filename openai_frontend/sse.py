"""Server-sent events, and noticing a client that leaves.

A streamed answer is `data: {chunk}` events ending with `data: [DONE]`. The HTTP status is
decided before the first byte: the first event is awaited first, so a request the ensemble
refuses gets its proper status and JSON error, not a 200 with an error inside. An error after
that is sent as an `{"error": ...}` event, which the `openai` client raises.

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
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone()
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


async def _body(first, events: AsyncIterator, stream) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            yield event(stream.chunk_json(first))
        async for item in events:
            yield event(stream.chunk_json(item))
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
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(_body(first, events, stream), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
