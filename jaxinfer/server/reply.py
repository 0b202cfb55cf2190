"""A generation's reply: streamed as server-sent events (streaming.py), or
whole, once every choice has finished.

A client that disconnects cancels its handler (watched here for a whole
reply; a stream's generator is closed by the server), and leaving the engine
thread's generator aborts its requests there.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from jaxinfer.server import tool_calls
from jaxinfer.server.engine_thread import EngineThread
from jaxinfer.server.errors import ENGINE_ERRORS, engine_failure
from jaxinfer.server.responses import (Choice, Extras, chat_logprobs, completion_logprobs, echoed_prompt_logprobs,
                                       prompt_logprobs_json)
from jaxinfer.server.streaming import ChatChunks, CompletionChunks, events
from jaxinfer.server.tool_parsers import final_message

logger = logging.getLogger("jaxinfer.server")


async def respond(engine: EngineThread, request: Request, body, requests, builder, prompt_texts, reservation,
                  extras: Extras):
    """The reply to a request already admitted: its reservation is released however this ends."""
    if body.stream:
        shaper = (ChatChunks(body, builder, extras) if builder.chat
                  else CompletionChunks(engine, body, requests, builder, prompt_texts, extras))
        return StreamingResponse(events(engine, body, requests, builder, reservation, shaper),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    result = await _unless_disconnected(request, _whole(engine, body, requests, builder, prompt_texts,
                                                        reservation, extras))
    return Response(status_code=499) if result is None else result


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


async def _whole(engine, body, requests, builder, prompt_texts, reservation, extras: Extras) -> dict:
    n = body.n
    choices = [Choice() for _ in range(len(requests) * n)]
    try:
        async with aclosing(engine.generate(requests, reservation)) as stream:
            async for tag, delta in stream:
                for c in delta.completions:
                    choices[tag * n + c.index].add(c)
    except ENGINE_ERRORS as e:
        raise engine_failure(e) from None
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    if builder.chat:
        k = body.num_logprobs
        shaped = [_chat_choice(builder, i, c, extras.plan,
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


def _chat_choice(builder, index, choice: Choice, plan, logprobs) -> dict:
    """A finished chat choice: content, or content and tool calls (tool_calls.py)."""
    if plan is None or plan.parse is None:
        return builder.chat_choice(index, choice.text, choice.finish_reason, choice.stop_reason, logprobs)
    content, calls = final_message(plan.parse, choice.text)
    return builder.chat_choice(index, content, tool_calls.finish_reason(plan, choice.finish_reason, len(calls)),
                               choice.stop_reason, logprobs, calls)


def _echoed(request, scored, k, completion, engine) -> dict:
    """OpenAI's echo with logprobs: the prompt's columns, then the completion's."""
    tokenizer = engine.engine.tokenizer
    first_text = tokenizer.decode(request.prompt_token_ids[:1]) if tokenizer is not None else ""
    prompt = echoed_prompt_logprobs(request.prompt_token_ids, scored, k, first_text)
    return {key: prompt[key] + completion[key] for key in prompt}
