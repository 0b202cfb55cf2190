"""The FastAPI app: OpenAI's routes over one EngineThread.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or
not), GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET
/metrics, GET /version, and vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter.

LoRA (vLLM's way): each adapter given to build_app (`jaxinfer serve
--lora-modules name=path`) or loaded at run time (load_lora_adapter, with
enable_lora) is served as a model of its own name, listed in /v1/models
with the base model as its `parent`; a request's `model` picks the base
model or an adapter. The adapters given at start are read and checked when
the model has loaded, so a bad one stops the server from becoming ready
(and /health says why) rather than failing its first request. Every route
but /health, /metrics and /version wants the API key (when one is set) as
`Authorization: Bearer KEY`; CORS (`allowed_origins`) answers browsers'
preflights before that check.

Handlers run on the event loop and do only cheap work. Each generation
request is admitted first (its sequences against --max-queue, engine_thread
.reserve), before anything costly; then its text is tokenized and its chat
template rendered off the loop (server/host_work.py; a prompt longer than
the context could hold is refused before it is tokenized), its grammar
compiled on the engine's compile worker (awaited, not waited on by a
thread; a full compile queue is a 429), and it is submitted to the engine
thread. A client that disconnects (streamed or not) cancels its handler,
and leaving the engine thread's generator aborts the request there.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jaxinfer.errors import RequestError
from jaxinfer.server import errors, tool_calls
from jaxinfer.server.engine_thread import EngineDead, EngineRequest, EngineStepFailed, EngineThread, QueueFull
from jaxinfer.server.errors import APIError
from jaxinfer.server.generation_defaults import generation_defaults
from jaxinfer.server.host_work import HostWork
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.prompt_logprobs import prompt_logprobs
from jaxinfer.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      LoadLoRARequest, TokenizeRequest, UnloadLoRARequest)
from jaxinfer.server.responses import (Choice, ResponseBuilder, chat_logprobs, completion_logprobs,
                                       echoed_prompt_logprobs, prompt_logprobs_json, sse, usage)
from jaxinfer.server.tool_parsers import PARSERS, ToolCallStream, detect_parser, final_message
from jaxinfer.structured.grammar import GrammarError, GrammarQueueFull
from jaxinfer.tokenizer import TokenizerError

logger = logging.getLogger("jaxinfer.server")

# Bodies larger than this are refused before they are read whole (413). A
# prompt of 128k token ids is ~1 MB of JSON, so 8 MiB leaves room.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
OPEN_PATHS = ("/health", "/metrics", "/version")  # no API key: probes, scrapers, version checks
# A prompt's characters may exceed max_model_len * (the longest token's characters)
# by this factor before it is refused untokenized: tokenizers that drop or merge
# characters (sentencepiece's whitespace runs) make fewer tokens than that bound says.
PROMPT_CHARS_SLACK = 4


class ServerState:
    """What the routes share: the LLM once loaded, its engine thread, metrics, settings."""

    def __init__(self, model_name: str, api_key: str | None, max_queue: int | None, lora_modules=None,
                 chat_template: str | None = None, tool_call_parser: str | None = None):
        self.model_name = model_name
        self.lora_modules = dict(lora_modules or {})  # served name -> LoRARequest
        if model_name in self.lora_modules:
            raise ValueError(f"LoRA module name {model_name!r} is the base model's served name; choose another")
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {PARSERS}, got {tool_call_parser!r}")
        self.api_key = api_key
        self.max_queue = max_queue
        self.chat_template = chat_template  # replaces the model's own (--chat-template)
        self.tool_call_parser = tool_call_parser
        self.metrics = ServerMetrics(model_name)
        self.work = HostWork()
        self.llm = None
        self.engine: EngineThread | None = None
        self.load_error: str | None = None
        self.sampling_defaults: dict = {}
        self.max_prompt_chars: int | None = None

    def attach(self, llm) -> None:
        """Serve this LLM: start the engine thread over the engine it holds (one or data-parallel)."""
        for name, lora in self.lora_modules.items():  # raises RequestError for an adapter it cannot serve
            llm.engine.validate_lora(f"LoRA module {name!r}", lora)
        self.sampling_defaults = generation_defaults(llm.model.source)
        if llm.tokenizer is not None:
            self.max_prompt_chars = llm.max_model_len * llm.tokenizer.max_token_chars * PROMPT_CHARS_SLACK
            if self.tool_call_parser is None:
                self.tool_call_parser = detect_parser(self.chat_template or llm.tokenizer.chat_template)
        engine = EngineThread(llm.engine, self.metrics, self.max_queue)
        engine.start()
        self.llm, self.engine = llm, engine
        logger.info("serving %s (max_model_len %d, tool-call parser %s)", self.model_name, llm.max_model_len,
                    self.tool_call_parser)

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

    def check_prompt_chars(self, name: str, num_chars: int) -> None:
        """Refuse, untokenized, a text too long for any tokenization of it to fit the context."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(400, f"{name} has {num_chars} characters, more than max_model_len="
                                f"{self.llm.max_model_len} tokens can hold (refused without tokenizing)", name)

    async def encode(self, name: str, text: str, add_special_tokens: bool) -> list[int]:
        self.check_prompt_chars(name, len(text))
        return await self.work.encode(self.tokenizer, text, add_special_tokens)

    async def chat_text(self, messages, add_generation_prompt: bool, template_kwargs, tools=None) -> str:
        self.check_prompt_chars("messages", sum(len(m.text) for m in messages))
        tokenizer = self.tokenizer
        variables = dict(template_kwargs or {})
        if tools is not None:
            variables["tools"] = tools
        rendered = [m.as_template_message() for m in messages]

        def render():
            return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                 chat_template=self.chat_template, **variables)

        try:
            return await self.work.text.run(render)
        except TokenizerError as e:
            raise APIError(400, str(e), "messages") from None


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
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError(429, f"the server is at capacity: {e}", code="queue_full")
    if isinstance(e, EngineDead):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, EngineStepFailed):
        return APIError(500, str(e), code="engine_step_failed")
    return APIError(400, str(e))


_ENGINE_ERRORS = (RequestError, EngineDead, QueueFull, EngineStepFailed)


def _stream_error(e: Exception) -> str:
    error = _failure(e)
    return sse(errors.error_body(error.status, error.message, error.param, error.code))


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
        state.work.shutdown()

    app = FastAPI(title="jaxinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    errors.install(app)
    app.add_middleware(_Guard, state=state, max_body_bytes=max_body_bytes)
    if allowed_origins:  # outermost: a browser's preflight carries no API key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                           allow_headers=list(allowed_headers), allow_credentials=allow_credentials)

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

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("jaxinfer")}
        except PackageNotFoundError:
            return {"version": "unknown"}

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
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = await state.chat_text(body.messages, body.add_generation_prompt, None, tools)
            tokens = await state.encode("messages", text, add_special_tokens=False)
        else:
            tokens = await state.encode("prompt", body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": state.llm.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.ready()
        state.check_model(body.model)
        _check_token_ids(state, body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    # -- LoRA adapters at run time (vLLM's routes) ----------------------------
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest):
        engine = state.ready()
        from jaxinfer.lora.request import LoRARequest

        if body.lora_name == state.model_name or body.lora_name in state.lora_modules:
            raise APIError(400, f"the name '{body.lora_name}' is already served", "lora_name")
        taken = [lora.lora_int_id for lora in state.lora_modules.values()]
        lora = LoRARequest(body.lora_name, max(taken, default=0) + 1, body.lora_path)
        try:  # reads and checks the adapter on the engine thread (its slots are the engine's)
            await engine.call(lambda e: e.validate_lora(f"LoRA adapter '{body.lora_name}'", lora))
        except RequestError as e:
            raise APIError(400, str(e), "lora_path") from None
        state.lora_modules[body.lora_name] = lora
        logger.info("loaded LoRA adapter %r from %s", body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest):
        state.ready()
        if body.lora_name not in state.lora_modules:
            raise APIError(404, f"no LoRA adapter named '{body.lora_name}' is served", "lora_name",
                           "model_not_found")
        # Requests already running keep their adapter (the engine holds it); new ones cannot name it.
        del state.lora_modules[body.lora_name]
        logger.info("unloaded LoRA adapter %r", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # -- generation -----------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine = state.ready()
        lora = state.check_model(body.model)
        body.check_unsupported()
        prompts = body.prompts()
        _check_priority(state, body.priority)
        num_prompt_logprobs = body.num_prompt_logprobs
        if num_prompt_logprobs is not None and lora is not None:
            raise APIError(400, "prompt logprobs (prompt_logprobs, or echo with logprobs) are not computed "
                                "for LoRA adapters", "prompt_logprobs")
        reservation = _reserve(engine, len(prompts) * body.n)  # before any work: a full server refuses cheaply
        try:
            many = len(prompts) > 1
            requests, prompt_texts, scored = [], [], []
            request_id = engine.new_id("cmpl")
            for i, prompt in enumerate(prompts):
                name = f"prompt[{i}]" if many else "prompt"
                if isinstance(prompt, str):
                    token_ids = await state.encode(name, prompt, add_special_tokens=True)
                else:
                    token_ids = list(prompt)
                    _check_token_ids(state, token_ids, name)
                    prompt = state.tokenizer.decode(token_ids) if body.echo else None
                params = body.sampling_params(_max_tokens(state, body.max_tokens, len(token_ids), name),
                                              body.logprobs, state.sampling_defaults)
                _validate(state, name, token_ids, params)
                await _compile_grammar(state, name, params)
                requests.append(EngineRequest(f"{request_id}-{i}", token_ids, params, prompt, lora, body.priority))
                prompt_texts.append(prompt or "")
            if num_prompt_logprobs is not None:
                for r in requests:
                    scored.append(await _score_prompt(state, r.prompt_token_ids, num_prompt_logprobs))
        except BaseException:
            reservation.release()
            raise
        builder = ResponseBuilder(request_id, body.model or state.model_name, chat=False)
        return await _respond(engine, request, body, requests, builder, prompt_texts, reservation,
                              Extras(scored=scored))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        engine = state.ready()
        lora = state.check_model(body.model)
        body.check_unsupported()
        _check_priority(state, body.priority)
        plan = tool_calls.plan(body, state.tool_call_parser)
        if body.prompt_logprobs is not None and lora is not None:
            raise APIError(400, "prompt_logprobs are not computed for LoRA adapters", "prompt_logprobs")
        reservation = _reserve(engine, body.n)
        try:
            text = await state.chat_text(body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                                         tool_calls.template_tools(body))
            token_ids = await state.encode("messages", text, add_special_tokens=False)  # the template writes BOS
            overrides = {"skip_special_tokens": False} if plan.keep_special_tokens else {}
            params = body.sampling_params(_max_tokens(state, body.requested_max_tokens, len(token_ids), "messages"),
                                          body.num_logprobs, state.sampling_defaults, plan.structured, **overrides)
            _validate(state, "messages", token_ids, params)
            await _compile_grammar(state, "messages", params)
            scored = ([await _score_prompt(state, token_ids, body.prompt_logprobs)]
                      if body.prompt_logprobs is not None else [])
        except BaseException:
            reservation.release()
            raise
        request_id = engine.new_id("chatcmpl")
        builder = ResponseBuilder(request_id, body.model or state.model_name, chat=True)
        requests = [EngineRequest(f"{request_id}-0", token_ids, params, text, lora, body.priority)]
        return await _respond(engine, request, body, requests, builder, [""], reservation,
                              Extras(scored=scored, plan=plan))

    return app


class Extras:
    """What a response carries beyond the engine's deltas: prompt logprobs, the tool plan."""

    def __init__(self, scored=(), plan=None):
        self.scored = list(scored)  # per prompt: prompt_logprobs entries
        self.plan = plan


def _reserve(engine: EngineThread, num_sequences: int):
    try:
        return engine.reserve(num_sequences)
    except (QueueFull, EngineDead) as e:
        raise _failure(e) from None


def _check_priority(state: ServerState, priority: int) -> None:
    if priority == 0:
        return
    policy = state.llm.engine.config.scheduling_policy
    if policy != "priority":
        raise APIError(400, f"priority {priority} needs the priority scheduling policy (this server runs "
                            f"{'fcfs' if policy == 'continuous' else policy}; start it with --scheduling-policy "
                            "priority)", "priority")


async def _score_prompt(state: ServerState, token_ids: list[int], k: int) -> list:
    return await state.work.scoring.run(prompt_logprobs, state.llm.model, state.llm.tokenizer, token_ids, k)


def _check_token_ids(state: ServerState, token_ids: list[int], name: str) -> None:
    vocab = state.llm.model.config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{name}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}", name)


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
    """Structured outputs: compile the grammar on the engine's compile worker,
    awaited here (no thread waits on it), so that a spec that does not
    compile is a 400, streamed or not, and the engine then finds it in its
    cache. A full compile queue is a 429."""
    if params.structured_outputs is None:
        return
    engine = state.llm.engine
    try:
        future = engine.grammar_compiler.submit(params.structured_outputs)
    except GrammarQueueFull as e:
        raise APIError(429, f"the server is at capacity: {e}", "response_format", "queue_full") from None
    except RequestError as e:
        raise APIError(400, str(e), "response_format") from None
    timeout = engine.config.structured_outputs_compile_timeout
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
    except asyncio.TimeoutError:
        raise APIError(400, f"{name}: structured_outputs.{params.structured_outputs.kind}: the grammar did not "
                            f"compile within structured_outputs_compile_timeout={timeout} s",
                       "response_format") from None
    except GrammarError as e:
        raise APIError(400, f"{name}: {e}", "response_format") from None


async def _respond(engine: EngineThread, request: Request, body, requests, builder, prompt_texts, reservation,
                   extras: Extras):
    if body.stream:
        events = _chat_events if builder.chat else _completion_events
        return StreamingResponse(events(engine, body, requests, builder, prompt_texts, reservation, extras),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = await _unless_disconnected(request, _complete(engine, body, requests, builder, prompt_texts,
                                                           reservation, extras))
    return Response(status_code=499) if result is None else result


def _chat_choice_body(builder, index, choice: Choice, plan, logprobs):
    """A finished chat choice: content, or content and tool calls (tool_calls.py)."""
    if plan is None or plan.parse is None:
        return builder.chat_choice(index, choice.text, choice.finish_reason, choice.stop_reason, logprobs)
    content, calls = final_message(plan.parse, choice.text)
    return builder.chat_choice(index, content, tool_calls.finish_reason(plan, choice.finish_reason, len(calls)),
                               choice.stop_reason, logprobs, calls)


async def _complete(engine, body, requests, builder, prompt_texts, reservation, extras: Extras):
    n = body.n
    choices = [Choice() for _ in range(len(requests) * n)]
    try:
        async with aclosing(engine.generate(requests, reservation)) as stream:
            async for tag, delta in stream:
                for c in delta.completions:
                    choices[tag * n + c.index].add(c)
    except _ENGINE_ERRORS as e:
        raise _failure(e) from None
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    if builder.chat:
        k = body.num_logprobs
        shaped = [_chat_choice_body(builder, i, c, extras.plan,
                                    chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None)
                  for i, c in enumerate(choices)]
        if extras.scored:
            for choice in shaped:
                choice["prompt_logprobs"] = prompt_logprobs_json(extras.scored[0])
        return builder.chat_completion(shaped, prompt_tokens, completion_tokens)
    shaped = []
    for i, c in enumerate(choices):
        prefix = prompt_texts[i // n] if body.echo else ""
        logprobs = (completion_logprobs(c.token_ids, c.logprobs, body.logprobs, len(prefix))
                    if body.logprobs is not None else None)
        if body.echo and logprobs is not None:
            logprobs = _echoed(requests[i // n], extras.scored[i // n], body.logprobs, logprobs, engine)
        choice = builder.completion_choice(i, prefix + c.text, c.finish_reason, c.stop_reason, logprobs)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(extras.scored[i // n])
        shaped.append(choice)
    return builder.completion(shaped, prompt_tokens, completion_tokens)


def _echoed(request, scored, k, completion, engine) -> dict:
    """OpenAI's echo with logprobs: the prompt's columns, then the completion's."""
    tokenizer = engine.engine.tokenizer
    first_text = tokenizer.decode(request.prompt_token_ids[:1]) if tokenizer is not None else ""
    prompt = echoed_prompt_logprobs(request.prompt_token_ids, scored, k, first_text)
    return {key: prompt[key] + completion[key] for key in prompt}


async def _completion_events(engine, body, requests, builder, prompt_texts, reservation, extras: Extras):
    n = body.n
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    completion_tokens = 0
    offsets = [0] * (len(requests) * n)  # characters sent per choice, for logprobs' text_offset
    try:
        if body.echo or extras.scored:  # the prompt (and its logprobs) first, as its own chunk per choice
            for i in range(len(offsets)):
                text = prompt_texts[i // n] if body.echo else ""
                offsets[i] = len(text)
                logprobs = None
                if body.echo and body.logprobs is not None:
                    r = requests[i // n]
                    first = engine.engine.tokenizer.decode(r.prompt_token_ids[:1])
                    logprobs = echoed_prompt_logprobs(r.prompt_token_ids, extras.scored[i // n], body.logprobs, first)
                choice = builder.completion_choice(i, text, None, None, logprobs)
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(extras.scored[i // n])
                yield sse(builder.completion_chunk(choice))
        async with aclosing(engine.generate(requests, reservation)) as stream:
            async for tag, delta in stream:
                for c in delta.completions:
                    index = tag * n + c.index
                    logprobs = (completion_logprobs(c.token_ids, c.logprobs, body.logprobs, offsets[index])
                                if body.logprobs is not None else None)
                    offsets[index] += len(c.text)
                    completion_tokens += len(c.token_ids)
                    chunk = builder.completion_chunk(
                        builder.completion_choice(index, c.text, c.finish_reason, c.stop_reason, logprobs))
                    if body.continuous_usage:
                        chunk["usage"] = usage(prompt_tokens, completion_tokens)
                    yield sse(chunk)
        if body.include_usage:
            yield sse(builder.usage_chunk(prompt_tokens, completion_tokens))
    except _ENGINE_ERRORS as e:
        yield _stream_error(e)
    finally:
        reservation.release()
    yield sse("[DONE]")


async def _chat_events(engine, body, requests, builder, prompt_texts, reservation, extras: Extras):
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    completion_tokens = 0
    k = body.num_logprobs
    plan = extras.plan
    parse = plan.parse if plan is not None else None
    streams = [ToolCallStream(parse) for _ in range(body.n)] if parse is not None else None
    texts = [""] * body.n
    num_calls = [0] * body.n

    def chunk(index, delta, finish_reason=None, logprobs=None, stop_reason=None):
        body_ = builder.chat_chunk(index, delta, finish_reason, logprobs, stop_reason)
        if body.continuous_usage:
            body_["usage"] = usage(prompt_tokens, completion_tokens)
        return sse(body_)

    try:
        for index in range(body.n):  # OpenAI's first chunk per choice carries the role
            first = builder.chat_chunk(index, {"role": "assistant", "content": ""})
            if extras.scored:
                first["choices"][0]["prompt_logprobs"] = prompt_logprobs_json(extras.scored[0])
            yield sse(first)
        async with aclosing(engine.generate(requests, reservation)) as stream:
            async for _, delta in stream:
                for c in delta.completions:
                    completion_tokens += len(c.token_ids)
                    logprobs = chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None
                    finish_reason = c.finish_reason
                    if streams is None:
                        if not c.text and finish_reason is None and k is None:
                            continue  # tokens that have not become text yet (a split character, a held stop prefix)
                        yield chunk(c.index, {"content": c.text} if c.text else {}, finish_reason, logprobs,
                                    c.stop_reason)
                        continue
                    texts[c.index] += c.text
                    content, calls = streams[c.index].update(texts[c.index], finish_reason is not None)
                    num_calls[c.index] = len(streams[c.index].ids)
                    message = {}
                    if content:
                        message["content"] = content
                    if calls:
                        message["tool_calls"] = calls
                    if finish_reason is not None:
                        finish_reason = tool_calls.finish_reason(plan, finish_reason, num_calls[c.index])
                    if message or finish_reason is not None or logprobs is not None:
                        yield chunk(c.index, message, finish_reason, logprobs, c.stop_reason)
        if body.include_usage:
            yield sse(builder.usage_chunk(prompt_tokens, completion_tokens))
    except _ENGINE_ERRORS as e:
        yield _stream_error(e)
    finally:
        reservation.release()
    yield sse("[DONE]")
