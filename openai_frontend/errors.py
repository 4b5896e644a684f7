"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see goes through `APIError`: the request schema's validation errors
become 400s naming the parameter, an unknown model a 404, Triton down or not ready a 503.
Anything unexpected is logged here and answered with a 500 that carries no stack trace.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openai_frontend.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger("openai_frontend")

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A failure to report to the client with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=_TYPES.get(self.status, "invalid_request_error"),
                             param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")


def unavailable(message: str) -> APIError:
    return APIError(503, message, None, "service_unavailable")


def from_validation(exc: RequestValidationError) -> APIError:
    """The first schema violation, phrased like OpenAI does, with its parameter named."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members add their type to the location ("stop", "str"); keep the field path only.
    param = ".".join(part for part in loc if not part.startswith(("str", "list[", "int", "dict[")))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request("We could not parse the JSON body of your request: "
                           f"{first.get('msg', 'invalid JSON')}.", None, "invalid_json")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if not param:
        return bad_request(f"The request body is not valid: {first.get('msg', '')}.", None)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"Invalid '{param}': {message}.", param)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        error = from_validation(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code if exc.status_code in (404, 405) else 400
        message = (f"Unknown request URL: {request.method} {request.url.path}."
                   if exc.status_code == 404 else str(exc.detail))
        return JSONResponse(APIError(status, message).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        return internal_error()


def internal_error() -> JSONResponse:
    """The answer to anything unexpected: a 500 without a stack trace (logged by the caller)."""
    error = APIError(500, "The server had an error while processing your request.")
    return JSONResponse(error.body(), status_code=500)
