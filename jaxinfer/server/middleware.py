"""What wraps every route: the API key, the body size limit, CORS and OpenAI's error shape.

Every path but OPEN_PATHS wants the API key (when one is set) as
`Authorization: Bearer KEY`. CORS, when origins are allowed, is the
outermost layer: a browser's preflight carries no API key.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI

from jaxinfer.server import errors

OPEN_PATHS = ("/health", "/load", "/metrics", "/version")  # no API key: probes, routers, scrapers, version checks


class Guard:
    """ASGI middleware: the API key on every path but OPEN_PATHS, and the body
    size limit (by Content-Length at once, and by counting what is received)."""

    class _TooLarge(Exception):
        pass

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                response = errors.error_response(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        limit = self.max_body_bytes
        too_large = errors.error_response(413, f"request body exceeds the limit of {limit} bytes",
                                          code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await too_large(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self._TooLarge
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except self._TooLarge:
            if not started:
                await too_large(scope, receive, send)


def install(app: FastAPI, *, api_key: str | None, max_body_bytes: int, allowed_origins=None,
            allowed_methods=("*",), allowed_headers=("*",), allow_credentials: bool = False) -> None:
    """OpenAI's error shape for every exception, the Guard, and CORS when origins are given."""
    errors.install(app)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    if allowed_origins:  # added last, so outermost
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                           allow_headers=list(allowed_headers), allow_credentials=allow_credentials)
