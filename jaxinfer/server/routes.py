"""The HTTP routes: OpenAI's, vLLM's, and the probes.

POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not),
GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /load,
GET /metrics, GET /version, and vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter.

Handlers run on the event loop and do only cheap work. A generation request
is admitted first (admission.py), then its text is tokenized and its chat
template rendered off the loop (host_work.py; a prompt longer than the
context could hold is refused before it is tokenized), then it is checked,
its grammar compiled, and it is submitted to the engine thread (reply.py).
"""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from jaxinfer.errors import RequestError
from jaxinfer.server import admission, tool_calls
from jaxinfer.server.engine_thread import EngineRequest
from jaxinfer.server.errors import APIError
from jaxinfer.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      LoadLoRARequest, TokenizeRequest, UnloadLoRARequest)
from jaxinfer.server.reply import respond
from jaxinfer.server.responses import Extras, ResponseBuilder
from jaxinfer.server.state import ServerState

logger = logging.getLogger("jaxinfer.server")

router = APIRouter()


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Depends(server_state)


# -- probes ------------------------------------------------------------------------------------------
@router.get("/health")
async def health(state: ServerState = State):
    try:
        state.ready()
    except APIError as e:
        return JSONResponse(e.body(), status_code=503)
    return Response(status_code=200)


@router.get("/load")
async def load(state: ServerState = State):
    """vLLM's load probe for a router: the sequences admitted and not yet
    finished (waiting, running, or still being tokenized), counted at
    admission on the event loop, so answering asks the engine nothing."""
    return {"server_load": state.engine.num_in_flight if state.engine is not None else 0}


@router.get("/metrics")
async def metrics(state: ServerState = State):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return {"version": package_version("jaxinfer")}
    except PackageNotFoundError:
        return {"version": "unknown"}


@router.get("/v1/models")
async def models(state: ServerState = State):
    state.ready()
    created = int(time.time())
    base = {"id": state.model_name, "object": "model", "created": created, "owned_by": "jaxinfer",
            "root": str(state.llm.model.source), "parent": None, "max_model_len": state.llm.max_model_len}
    adapters = [dict(base, id=name, root=str(lora.lora_path), parent=state.model_name)
                for name, lora in state.lora_modules.items()]
    return {"object": "list", "data": [base, *adapters]}


# -- tokenizer ---------------------------------------------------------------------------------------
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerState = State):
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


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerState = State):
    state.ready()
    state.check_model(body.model)
    admission.check_token_ids(state, "tokens", body.tokens)
    return {"prompt": state.tokenizer.decode(body.tokens)}


# -- LoRA adapters at run time (vLLM's routes) -------------------------------------------------------
@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, state: ServerState = State):
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


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, state: ServerState = State):
    state.ready()
    if body.lora_name not in state.lora_modules:
        raise APIError(404, f"no LoRA adapter named '{body.lora_name}' is served", "lora_name", "model_not_found")
    # Requests already running keep their adapter (the engine holds it); new ones cannot name it.
    del state.lora_modules[body.lora_name]
    logger.info("unloaded LoRA adapter %r", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


# -- generation --------------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = State):
    engine = state.ready()
    lora = state.check_model(body.model)
    body.check_unsupported()
    prompts = body.prompts()
    admission.check_priority(state, body.priority)
    num_prompt_logprobs = body.num_prompt_logprobs
    if num_prompt_logprobs is not None and lora is not None:
        raise APIError(400, "prompt logprobs (prompt_logprobs, or echo with logprobs) are not computed "
                            "for LoRA adapters", "prompt_logprobs")
    reservation = admission.reserve(engine, len(prompts) * body.n)
    try:
        many = len(prompts) > 1
        requests, prompt_texts, scored = [], [], []
        request_id = engine.new_id("cmpl")
        for i, prompt in enumerate(prompts):
            name = f"prompt[{i}]" if many else "prompt"
            if isinstance(prompt, str):
                token_ids = await state.encode(name, prompt, add_special_tokens=True)
                admission.check_prompt(state, name, token_ids)
            else:
                token_ids = list(prompt)
                admission.check_prompt(state, name, token_ids)
                prompt = state.tokenizer.decode(token_ids) if body.echo else None
            params = body.sampling_params(admission.max_tokens(state, body.max_tokens, len(token_ids), name),
                                          body.logprobs, state.sampling_defaults)
            admission.check_request(state, name, token_ids, params)
            await admission.compile_grammar(state, name, params)
            requests.append(EngineRequest(f"{request_id}-{i}", token_ids, params, prompt, lora, body.priority))
            prompt_texts.append(prompt or "")
        if num_prompt_logprobs is not None:
            for r in requests:
                scored.append(await admission.score_prompt(state, r.prompt_token_ids, num_prompt_logprobs))
    except BaseException:
        reservation.release()
        raise
    builder = ResponseBuilder(request_id, body.model or state.model_name, chat=False)
    return await respond(engine, request, body, requests, builder, prompt_texts, reservation, Extras(scored=scored))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerState = State):
    engine = state.ready()
    lora = state.check_model(body.model)
    body.check_unsupported()
    admission.check_priority(state, body.priority)
    plan = tool_calls.plan(body, state.tool_call_parser)
    if body.prompt_logprobs is not None and lora is not None:
        raise APIError(400, "prompt_logprobs are not computed for LoRA adapters", "prompt_logprobs")
    reservation = admission.reserve(engine, body.n)
    try:
        text = await state.chat_text(body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                                     tool_calls.template_tools(body))
        token_ids = await state.encode("messages", text, add_special_tokens=False)  # the template writes BOS
        admission.check_prompt(state, "messages", token_ids)
        overrides = {"skip_special_tokens": False} if plan.keep_special_tokens else {}
        params = body.sampling_params(admission.max_tokens(state, body.requested_max_tokens, len(token_ids),
                                                           "messages"),
                                      body.num_logprobs, state.sampling_defaults, plan.structured, **overrides)
        admission.check_request(state, "messages", token_ids, params)
        await admission.compile_grammar(state, "messages", params)
        scored = ([await admission.score_prompt(state, token_ids, body.prompt_logprobs)]
                  if body.prompt_logprobs is not None else [])
    except BaseException:
        reservation.release()
        raise
    request_id = engine.new_id("chatcmpl")
    builder = ResponseBuilder(request_id, body.model or state.model_name, chat=True)
    requests = [EngineRequest(f"{request_id}-0", token_ids, params, text, lora, body.priority)]
    return await respond(engine, request, body, requests, builder, [""], reservation,
                         Extras(scored=scored, plan=plan))
