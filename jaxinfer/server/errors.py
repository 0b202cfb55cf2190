"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, for every failure.

Handlers raise APIError; the engine thread's errors are mapped to their
status by engine_failure; install() routes every exception through the shape.

FastAPI answers a body that fails validation with 422 and a list of pydantic
errors; OpenAI (and vLLM) answer 400 with one message, so the handlers here
turn the first pydantic error into a 400 that names the field. Messages are
clipped: a client that sends megabytes must not get megabytes back.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.errors import RequestError
from jaxinfer.server.engine_thread import EngineDead, EngineStepFailed, QueueFull

logger = logging.getLogger("jaxinfer.server")

MAX_MESSAGE_CHARS = 400


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# OpenAI's `type` per status (its API uses these words; vLLM uses exception class names).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """Raised anywhere in a handler; answered as OpenAI's error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


# What the engine thread raises at a request: engine_failure gives each its status.
ENGINE_ERRORS = (RequestError, EngineDead, QueueFull, EngineStepFailed)


def engine_failure(e: Exception) -> APIError:
    """An error from the engine thread, as the HTTP status it deserves."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(429, f"the server is at capacity: {e}", code="queue_full")
    if isinstance(e, EngineDead):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, EngineStepFailed):
        return APIError(500, str(e), code="engine_step_failed")
    return APIError(400, str(e))


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": clip(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _describe(error: dict) -> tuple[str, str | None]:
    """One pydantic error -> (message, top-level field). Locations look like
    ("body", "messages", 0, "content", "str"); union members add their type
    name, which says little to a client, so the path is shown as given."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    kind = error.get("type", "")
    if kind == "json_invalid":
        return f"invalid JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}", None
    param = loc[0] if loc else None
    path = ".".join(loc)
    if kind == "extra_forbidden":
        return f"unknown field '{path}'", param
    if kind == "missing":
        return (f"'{path}' is required" if path else "a JSON object body is required"), param
    if not path:
        return f"the body must be a JSON object ({error.get('msg')})", None
    return f"{path}: {error.get('msg')}", param


def _is_type_tag(part) -> bool:
    """Pydantic names a union member in the location by its type: 'str', 'list[int]', ..."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict") or "[" in part)


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """The first pydantic error as (message, field); a value that matched no
    member of a union (every error on the same field) says which types it may be."""
    message, param = _describe(errors[0])
    tags = [e["loc"][2] for e in errors if len(e.get("loc", ())) > 2 and _is_type_tag(e["loc"][2])]
    if param is not None and len(tags) > 1 and all(len(e["loc"]) > 1 and e["loc"][1] == param for e in errors):
        unique = list(dict.fromkeys(tags))
        message = f"{param} has the wrong type; it may be one of: {', '.join(unique)}"
    return message, param


def install(app: FastAPI) -> None:
    """Route every error through OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        message, param = describe_validation(errors) if errors else ("invalid request", None)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
