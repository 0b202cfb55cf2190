"""The FastAPI app: OpenAI's routes over one EngineThread.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or
not), GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET
/metrics.

LoRA (vLLM's way): each adapter given to build_app (`jaxinfer serve
--lora-modules name=path`) is served as a model of its own name, listed in
/v1/models with the base model as its `parent`; a request's `model` picks
the base model or an adapter. The adapters are read and checked when the
model has loaded, so a bad one stops the server from becoming ready (and
/health says why) rather than failing its first request. Every route but /health and /metrics wants the API key (when one is
set) as `Authorization: Bearer KEY`.

Handlers run on the event loop and do only cheap work: parse, tokenize,
check, submit to the engine thread, format. A client that disconnects
(streamed or not) cancels its handler, and leaving the engine thread's
generator aborts the request there.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jaxinfer.errors import RequestError
from jaxinfer.server import errors
from jaxinfer.server.engine_thread import EngineDead, EngineRequest, EngineThread, QueueFull
from jaxinfer.server.errors import APIError
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest)
from jaxinfer.server.responses import Choice, ResponseBuilder, chat_logprobs, completion_logprobs, sse
from jaxinfer.tokenizer import TokenizerError

logger = logging.getLogger("jaxinfer.server")

# Texts longer than this are tokenized in a worker thread, so that a long
# prompt does not stall the streams the event loop is serving meanwhile.
TOKENIZE_INLINE_CHARS = 16384
# Bodies larger than this are refused before they are read whole (413). A
# prompt of 128k token ids is ~1 MB of JSON, so 8 MiB leaves room.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
OPEN_PATHS = ("/health", "/metrics")  # no API key: probes and scrapers


class ServerState:
    """What the routes share: the LLM once loaded, its engine thread, metrics, settings."""

    def __init__(self, model_name: str, api_key: str | None, max_queue: int | None, lora_modules=None):
        self.model_name = model_name
        self.lora_modules = dict(lora_modules or {})  # served name -> LoRARequest
        if model_name in self.lora_modules:
            raise ValueError(f"LoRA module name {model_name!r} is the base model's served name; choose another")
        self.api_key = api_key
        self.max_queue = max_queue
        self.metrics = ServerMetrics(model_name)
        self.llm = None
        self.engine: EngineThread | None = None
        self.load_error: str | None = None

    def attach(self, llm) -> None:
        """Serve this LLM: start the engine thread over the engine it holds (one or data-parallel)."""
        for name, lora in self.lora_modules.items():  # raises RequestError for an adapter it cannot serve
            llm.engine.validate_lora(f"LoRA module {name!r}", lora)
        engine = EngineThread(llm.engine, self.metrics, self.max_queue)
        engine.start()
        self.llm, self.engine = llm, engine
        logger.info("serving %s (max_model_len %d)", self.model_name, llm.max_model_len)

    def ready(self) -> EngineThread:
        if self.engine is None:
            raise APIError(503, self.load_error or "the model is still loading", code="not_ready")
        if not self.engine.alive:
            raise APIError(503, self.engine.fatal_error or "the engine has stopped", code="engine_dead")
        return self.engine

    def check_model(self, model: str | None):
        """The LoRARequest the `model` field names, or None for the base model
        (also when the field is absent); 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        served = ", ".join(f"'{m}'" for m in [self.model_name, *self.lora_modules])
        raise APIError(404, f"the model '{errors.clip(model, 100)}' does not exist; this server serves {served}",
                       "model", "model_not_found")

    @property
    def tokenizer(self):
        if self.llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send prompts as token ids", "prompt")
        return self.llm.tokenizer


class _Guard:
    """ASGI middleware: the API key on every path but OPEN_PATHS, and the body
    size limit (by Content-Length at once, and by counting what is received)."""

    class _TooLarge(Exception):
        pass

    def __init__(self, app, state: ServerState, max_body_bytes: int):
        self.app, self.state, self.max_body_bytes = app, state, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.state.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.state.api_key}"
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


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work):
    """Run `work` (a coroutine) unless the client goes away first; then cancel
    it (which aborts its engine requests) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        logger.info("client disconnected from %s; its request was aborted", request.url.path)
        return None
    return task.result()


def _failure(e: Exception) -> APIError:
    """Errors from the engine thread, as the HTTP status they deserve."""
    if isinstance(e, QueueFull):
        return APIError(429, f"the server is at capacity: {e}", code="queue_full")
    if isinstance(e, EngineDead):
        return APIError(503, str(e), code="engine_dead")
    return APIError(400, str(e))


def _stream_error(e: Exception) -> str:
    error = _failure(e)
    return sse(errors.error_body(error.status, error.message, error.param, error.code))


def build_app(llm=None, *, model_name: str, load=None, api_key: str | None = None, max_queue: int | None = 1024,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, lora_modules=None) -> FastAPI:
    """An app serving `llm` (an LLM, already loaded) or, when `load` is given,
    the LLM that `load()` returns, built in a background thread so /health
    can answer 503 meanwhile. lora_modules: {served name: LoRARequest} (the
    LLM needs enable_lora=True and max_lora_rank for them)."""
    state = ServerState(model_name, api_key, max_queue, lora_modules)

    @asynccontextmanager
    async def lifespan(app):
        if llm is not None:
            state.attach(llm)
        elif load is not None:
            def load_then_attach():
                try:
                    state.attach(load())
                except Exception as e:  # the server stays up and says why on /health
                    logger.exception("loading the model failed")
                    state.load_error = f"loading the model failed: {type(e).__name__}: {e}"

            threading.Thread(target=load_then_attach, name="jaxinfer-load", daemon=True).start()
        yield
        if state.engine is not None:
            aborted = state.engine.stop()  # none are left after a graceful shutdown
            if aborted:
                logger.warning("shutdown: aborted %d unfinished request(s)", aborted)

    app = FastAPI(title="jaxinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    errors.install(app)
    app.add_middleware(_Guard, state=state, max_body_bytes=max_body_bytes)

    # -- probes ------------------------------------------------------------------
    @app.get("/health")
    async def health():
        try:
            state.ready()
        except APIError as e:
            return JSONResponse(e.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        state.ready()
        created = int(time.time())
        base = {"id": state.model_name, "object": "model", "created": created, "owned_by": "jaxinfer",
                "root": str(state.llm.model.source), "parent": None, "max_model_len": state.llm.max_model_len}
        adapters = [dict(base, id=name, root=str(lora.lora_path), parent=state.model_name)
                    for name, lora in state.lora_modules.items()]
        return {"object": "list", "data": [base, *adapters]}

    # -- tokenizer -----------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.ready()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            text = _chat_text(state, body.messages, body.add_generation_prompt, None)
            tokens = state.tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": state.llm.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.ready()
        state.check_model(body.model)
        _check_token_ids(state, body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    # -- generation -----------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = state.ready()
        lora = state.check_model(body.model)
        body.check_unsupported()
        prompts = body.prompts()
        many = len(prompts) > 1
        requests, prompt_texts = [], []
        request_id = engine.new_id("cmpl")
        for i, prompt in enumerate(prompts):
            name = f"prompt[{i}]" if many else "prompt"
            if isinstance(prompt, str):
                token_ids = await _encode(state, prompt, add_special_tokens=True)
            else:
                token_ids = list(prompt)
                _check_token_ids(state, token_ids, name)
                prompt = state.tokenizer.decode(token_ids) if body.echo else None
            params = body.sampling_params(_max_tokens(state, body.max_tokens, len(token_ids), name),
                                          body.logprobs)
            _validate(state, name, token_ids, params)
            await _compile_grammar(state, name, params)
            requests.append(EngineRequest(f"{request_id}-{i}", token_ids, params, prompt, lora))
            prompt_texts.append(prompt or "")
        builder = ResponseBuilder(request_id, body.model or state.model_name, chat=False)
        return await _respond(engine, request, body, requests, builder, prompt_texts)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        engine = state.ready()
        lora = state.check_model(body.model)
        body.check_unsupported()
        text = _chat_text(state, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        token_ids = await _encode(state, text, add_special_tokens=False)  # the template writes BOS itself
        params = body.sampling_params(_max_tokens(state, body.requested_max_tokens, len(token_ids), "messages"),
                                      body.num_logprobs)
        _validate(state, "messages", token_ids, params)
        await _compile_grammar(state, "messages", params)
        request_id = engine.new_id("chatcmpl")
        builder = ResponseBuilder(request_id, body.model or state.model_name, chat=True)
        requests = [EngineRequest(f"{request_id}-0", token_ids, params, text, lora)]
        return await _respond(engine, request, body, requests, builder, [""])

    return app


async def _encode(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= TOKENIZE_INLINE_CHARS:
        return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens=add_special_tokens)


def _check_token_ids(state: ServerState, token_ids: list[int], name: str) -> None:
    vocab = state.llm.model.config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{name}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}", name)


def _chat_text(state: ServerState, messages, add_generation_prompt: bool, template_kwargs) -> str:
    try:
        return state.tokenizer.apply_chat_template([m.as_template_message() for m in messages],
                                                   add_generation_prompt=add_generation_prompt,
                                                   **(template_kwargs or {}))
    except TokenizerError as e:
        raise APIError(400, str(e), "messages") from None


def _max_tokens(state: ServerState, requested: int | None, prompt_len: int, name: str) -> int:
    """vLLM's rule: the prompt plus max_tokens must fit max_model_len; no
    max_tokens means the rest of the context."""
    limit = state.llm.max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"{name} has {prompt_len} tokens, but the model's context is max_model_len={limit} "
                            f"tokens (prompt and completion together)", name)
    if requested is not None and requested > limit - prompt_len:
        raise APIError(400, f"max_tokens={requested} plus the {prompt_len} tokens of {name} exceed "
                            f"max_model_len={limit}", "max_tokens")
    return requested if requested is not None else limit - prompt_len


def _validate(state: ServerState, name: str, token_ids, params) -> None:
    try:
        state.llm.engine.validate(name, token_ids, params)  # read-only: config and pool size
    except RequestError as e:
        raise APIError(400, str(e), name) from None


async def _compile_grammar(state: ServerState, name: str, params) -> None:
    """Structured outputs: compile the grammar (on the engine's compile worker;
    this handler waits in a thread) so that a spec that does not compile is a
    400, streamed or not; the engine then finds it in its cache."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(
            None, state.llm.engine.check_structured_outputs, name, params)
    except RequestError as e:
        raise APIError(400, str(e), "response_format") from None


async def _respond(engine: EngineThread, request: Request, body, requests, builder, prompt_texts):
    if engine.max_queue is not None and engine.num_in_flight + len(requests) > engine.max_queue:
        raise _failure(QueueFull(f"{engine.num_in_flight} requests in flight; the server admits "
                                 f"{engine.max_queue}"))
    if body.stream:
        events = _chat_events if builder.chat else _completion_events
        return StreamingResponse(events(engine, body, requests, builder, prompt_texts),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = await _unless_disconnected(request, _complete(engine, body, requests, builder, prompt_texts))
    return Response(status_code=499) if result is None else result


async def _complete(engine, body, requests, builder, prompt_texts):
    n = body.n
    choices = [Choice() for _ in range(len(requests) * n)]
    try:
        async with aclosing(engine.generate(requests)) as stream:
            async for tag, delta in stream:
                for c in delta.completions:
                    choices[tag * n + c.index].add(c)
    except (RequestError, EngineDead, QueueFull) as e:
        raise _failure(e) from None
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    if builder.chat:
        k = body.num_logprobs
        shaped = [builder.chat_choice(i, c.text, c.finish_reason, c.stop_reason,
                                      chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None)
                  for i, c in enumerate(choices)]
        return builder.chat_completion(shaped, prompt_tokens, completion_tokens)
    shaped = []
    for i, c in enumerate(choices):
        prefix = prompt_texts[i // n] if body.echo else ""
        logprobs = (completion_logprobs(c.token_ids, c.logprobs, body.logprobs, 0)
                    if body.logprobs is not None else None)
        shaped.append(builder.completion_choice(i, prefix + c.text, c.finish_reason, c.stop_reason, logprobs))
    return builder.completion(shaped, prompt_tokens, completion_tokens)


async def _completion_events(engine, body, requests, builder, prompt_texts):
    n = body.n
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    completion_tokens = 0
    offsets = [0] * (len(requests) * n)  # characters sent per choice, for logprobs' text_offset
    try:
        if body.echo:  # the prompt first, as its own chunk per choice
            for i in range(len(offsets)):
                offsets[i] = len(prompt_texts[i // n])
                yield sse(builder.completion_chunk(builder.completion_choice(i, prompt_texts[i // n], None, None,
                                                                             None)))
        async with aclosing(engine.generate(requests)) as stream:
            async for tag, delta in stream:
                for c in delta.completions:
                    index = tag * n + c.index
                    logprobs = (completion_logprobs(c.token_ids, c.logprobs, body.logprobs, offsets[index])
                                if body.logprobs is not None else None)
                    offsets[index] += len(c.text)
                    completion_tokens += len(c.token_ids)
                    yield sse(builder.completion_chunk(
                        builder.completion_choice(index, c.text, c.finish_reason, c.stop_reason, logprobs)))
        if body.include_usage:
            yield sse(builder.usage_chunk(prompt_tokens, completion_tokens))
    except (RequestError, EngineDead, QueueFull) as e:
        yield _stream_error(e)
    yield sse("[DONE]")


async def _chat_events(engine, body, requests, builder, prompt_texts):
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    completion_tokens = 0
    k = body.num_logprobs
    try:
        for index in range(body.n):  # OpenAI's first chunk per choice carries the role
            yield sse(builder.chat_chunk(index, {"role": "assistant", "content": ""}))
        async with aclosing(engine.generate(requests)) as stream:
            async for _, delta in stream:
                for c in delta.completions:
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None and k is None:
                        continue  # tokens that have not become text yet (a split character, a held stop prefix)
                    logprobs = chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None
                    yield sse(builder.chat_chunk(c.index, {"content": c.text} if c.text else {}, c.finish_reason,
                                                 logprobs, c.stop_reason))
        if body.include_usage:
            yield sse(builder.usage_chunk(prompt_tokens, completion_tokens))
    except (RequestError, EngineDead, QueueFull) as e:
        yield _stream_error(e)
    yield sse("[DONE]")
