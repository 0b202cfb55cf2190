"""The FastAPI app: OpenAI's routes (routes.py) over one engine thread.

build_app wires the parts: the shared state (state.py: the LLM, its engine
thread, the served models), what wraps every route (middleware.py: the API
key, the body size limit, CORS, OpenAI's error shape) and the routes.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from jaxinfer.server import middleware
from jaxinfer.server.routes import router
from jaxinfer.server.state import ServerState

# Bodies larger than this are refused before they are read whole (413). A
# prompt of 128k token ids is ~1 MB of JSON, so 8 MiB leaves room.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def build_app(llm=None, *, model_name: str, load=None, api_key: str | None = None, max_queue: int | None = 1024,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, lora_modules=None, chat_template: str | None = None,
              tool_call_parser: str | None = None, allowed_origins=None, allowed_methods=("*",),
              allowed_headers=("*",), allow_credentials: bool = False) -> FastAPI:
    """An app serving `llm` (an LLM, already loaded) or, when `load` is given,
    the LLM that `load()` returns, built in a background thread so /health
    can answer 503 meanwhile. lora_modules: {served name: LoRARequest} (the
    LLM needs enable_lora=True and max_lora_rank for them). chat_template:
    a Jinja template replacing the model's own. tool_call_parser: one of
    tool_parsers.PARSERS, or None to detect it from the template.
    allowed_origins: CORS origins (["*"] for any), or None for no CORS."""
    state = ServerState(model_name, api_key, max_queue, lora_modules, chat_template, tool_call_parser)

    @asynccontextmanager
    async def lifespan(app):
        state.start(llm, load)
        yield
        state.stop()

    app = FastAPI(title="jaxinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    middleware.install(app, api_key=api_key, max_body_bytes=max_body_bytes, allowed_origins=allowed_origins,
                       allowed_methods=allowed_methods, allowed_headers=allowed_headers,
                       allow_credentials=allow_credentials)
    app.include_router(router)
    return app
