"""The generation routes without FastAPI's per-request machinery, in front of the FastAPI app.

FastAPI's routing, body parsing, dependency solving and its middlewares (each wraps `send`)
cost about 1 ms of every streamed answer's time to first token on a 2-core machine, more than
the rest of the frontend. `FastPath` takes a POST to a generation route whose JSON body the
route's schema accepts, validated as FastAPI validates it (`json.loads`, then the model), and
calls the route's function itself. Everything else goes to FastAPI unchanged, the body replayed:
other routes and methods, other content types, and bodies that fail to parse or validate, so
every error keeps FastAPI's handling and OpenAI's shape. Errors the route function raises are
answered by the same handlers (errors.py).
"""

from __future__ import annotations

import email.message
import functools
import json
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from openai_frontend.body_limit import replay
from openai_frontend.errors import APIError, internal_error

logger = logging.getLogger("openai_frontend")
Route = tuple[type[BaseModel], Callable[[BaseModel, Request], Awaitable[Response]]]


@functools.lru_cache(maxsize=64)
def _is_json(content_type: bytes) -> bool:
    """FastAPI's test: application/json or application/*+json, parameters allowed."""
    message = email.message.Message()
    message["content-type"] = content_type.decode("latin-1")
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class FastPath:
    """An ASGI app: `routes` (path → (request model, route function)) for POSTs, else `app`."""

    def __init__(self, app: FastAPI, routes: dict[str, Route]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None) if route else None
        if content_type is None or not _is_json(content_type):
            return await self.app(scope, receive, send)
        chunks, message = [], {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            if message["type"] != "http.request":  # gone before its body arrived
                return
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        model, function = route
        try:
            parsed = model.model_validate(json.loads(body))
        except (ValueError, ValidationError):  # JSONDecodeError is a ValueError
            return await self.app(scope, replay(body, receive), send)
        try:
            response = await function(parsed, Request(scope, receive))
        except APIError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status)
        except Exception:  # noqa: BLE001 - answered as FastAPI's handler answers it
            logger.exception("unexpected error serving %s", scope["path"])
            response = internal_error()
        await response(scope, receive, send)

