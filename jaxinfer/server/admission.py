"""What a generation request passes before it is submitted to the engine thread.

In this order: a place in the queue (its sequences against --max-queue,
before any costly work: a full server refuses cheaply), then its prompt
(the engine's rules: not empty, ids in the vocabulary, room to generate),
then max_tokens (vLLM's rule, the server's own: prompt plus max_tokens must
fit max_model_len), then the whole request (the engine's validate), then its
grammar, compiled on the engine's compile worker and awaited, not waited on
by a thread. The engine owns its rules; here they become OpenAI-shaped 400s
naming the field, before the engine thread ever sees the request.
"""

from __future__ import annotations

import asyncio

from jaxinfer.errors import RequestError
from jaxinfer.server.engine_thread import EngineDead, EngineThread, QueueFull
from jaxinfer.server.errors import APIError, engine_failure
from jaxinfer.server.prompt_logprobs import prompt_logprobs
from jaxinfer.server.state import ServerState
from jaxinfer.structured.grammar import GrammarError, GrammarQueueFull


def reserve(engine: EngineThread, num_sequences: int):
    try:
        return engine.reserve(num_sequences)
    except (QueueFull, EngineDead) as e:
        raise engine_failure(e) from None


def _engine_rule(check, *args, param: str | None, hint: str = "") -> None:
    """Run one of the engine's validation methods; its RequestError is a 400 naming `param`."""
    try:
        check(*args)
    except RequestError as e:
        raise APIError(400, f"{e}{hint}", param) from None


def check_priority(state: ServerState, priority: int) -> None:
    _engine_rule(state.llm.engine.validate_priority, "request", priority, param="priority",
                 hint="; start the server with --scheduling-policy priority")


def check_token_ids(state: ServerState, name: str, token_ids: list[int]) -> None:
    _engine_rule(state.llm.engine.check_token_ids, name, token_ids, param=name)


def check_prompt(state: ServerState, name: str, token_ids: list[int]) -> None:
    _engine_rule(state.llm.engine.validate_prompt, name, token_ids, param=name)


def check_request(state: ServerState, name: str, token_ids: list[int], params) -> None:
    _engine_rule(state.llm.engine.validate, name, token_ids, params, param=name)  # read-only: config, pool size


def max_tokens(state: ServerState, requested: int | None, prompt_len: int, name: str) -> int:
    """vLLM's rule for a prompt check_prompt let through: the prompt plus
    max_tokens must fit max_model_len; no max_tokens means the rest of the context."""
    room = state.llm.max_model_len - prompt_len
    if requested is not None and requested > room:
        raise APIError(400, f"max_tokens={requested} plus the {prompt_len} tokens of {name} exceed "
                            f"max_model_len={state.llm.max_model_len}", "max_tokens")
    return requested if requested is not None else room


async def compile_grammar(state: ServerState, name: str, params) -> None:
    """Structured outputs: compile the grammar on the engine's compile worker,
    awaited here, so that a spec that does not compile is a 400, streamed or
    not, and the engine then finds it in its cache. A full compile queue is a 429."""
    if params.structured_outputs is None:
        return
    engine = state.llm.engine
    try:
        future = engine.grammar_compiler.submit(params.structured_outputs)
    except GrammarQueueFull as e:
        raise APIError(429, f"the server is at capacity: {e}", "response_format", "queue_full") from None
    except RequestError as e:
        raise APIError(400, str(e), "response_format") from None
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                               engine.config.structured_outputs_compile_timeout)
    except asyncio.TimeoutError:
        raise APIError(400, f"{name}: {engine.grammar_timeout_message(params)}", "response_format") from None
    except GrammarError as e:
        raise APIError(400, f"{name}: {e}", "response_format") from None


async def score_prompt(state: ServerState, token_ids: list[int], k: int) -> list:
    """vLLM's prompt_logprobs: the prompt-scoring pass, off the event loop."""
    if state.lockstep is not None:  # its forward would run on host 0 alone and wait for the other hosts forever
        raise APIError(400, "prompt logprobs (prompt_logprobs, or echo with logprobs) are not computed in a "
                            "multi-host run", "prompt_logprobs")
    return await state.work.scoring.run(prompt_logprobs, state.llm.model, state.llm.tokenizer, token_ids, k)
