"""A streamed generation as server-sent events, for both APIs.

`events` is the one loop: the API's opening chunks, then a chunk per delta
the API's shaper makes one of (with usage so far when the client asked for
continuous_usage_stats), then the usage chunk (include_usage), then
`data: [DONE]`. An engine error mid-stream is sent as OpenAI's error body
before [DONE]; the request's place in the queue is released however it ends.

The shapers: CompletionChunks (the echoed prompt and its logprobs first, then
text with logprobs' text_offset running on) and ChatChunks (the role first,
then content, or content and tool-call deltas read back as they grow).
"""

from __future__ import annotations

from contextlib import aclosing

from jaxinfer.server import tool_calls
from jaxinfer.server.errors import ENGINE_ERRORS, engine_failure, error_body
from jaxinfer.server.responses import (Extras, ResponseBuilder, chat_logprobs, completion_logprobs,
                                       echoed_prompt_logprobs, prompt_logprobs_json, sse, usage)
from jaxinfer.server.tool_parsers import ToolCallStream


class CompletionChunks:
    """/v1/completions chunks; choice i * n + j is prompt i's completion j."""

    def __init__(self, engine, body, requests, builder: ResponseBuilder, prompt_texts, extras: Extras):
        self.engine, self.body, self.requests, self.builder = engine, body, requests, builder
        self.prompt_texts, self.extras = prompt_texts, extras
        self.offsets = [0] * (len(requests) * body.n)  # characters sent per choice, for logprobs' text_offset

    def opening(self):
        """The prompt (and its logprobs), as its own chunk per choice, when echoed or scored."""
        body, n, scored = self.body, self.body.n, self.extras.scored
        if not (body.echo or scored):
            return
        for i in range(len(self.offsets)):
            text = self.prompt_texts[i // n] if body.echo else ""
            self.offsets[i] = len(text)
            logprobs = None
            if body.echo and body.logprobs is not None:
                r = self.requests[i // n]
                first = self.engine.engine.tokenizer.decode(r.prompt_token_ids[:1])
                logprobs = echoed_prompt_logprobs(r.prompt_token_ids, scored[i // n], body.logprobs, first)
            choice = self.builder.completion_choice(i, text, None, None, logprobs)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(scored[i // n])
            yield self.builder.completion_chunk(choice)

    def chunk(self, tag: int, c) -> dict:
        index = tag * self.body.n + c.index
        logprobs = (completion_logprobs(c.token_ids, c.logprobs, self.body.logprobs, self.offsets[index])
                    if self.body.logprobs is not None else None)
        self.offsets[index] += len(c.text)
        return self.builder.completion_chunk(
            self.builder.completion_choice(index, c.text, c.finish_reason, c.stop_reason, logprobs))


class ChatChunks:
    """/v1/chat/completions chunks (one prompt, n choices)."""

    def __init__(self, body, builder: ResponseBuilder, extras: Extras):
        self.body, self.builder, self.extras = body, builder, extras
        self.plan = extras.plan
        parse = self.plan.parse if self.plan is not None else None
        self.streams = [ToolCallStream(parse) for _ in range(body.n)] if parse is not None else None
        self.texts = [""] * body.n

    def opening(self):
        for index in range(self.body.n):  # OpenAI's first chunk per choice carries the role
            first = self.builder.chat_chunk(index, {"role": "assistant", "content": ""})
            if self.extras.scored:
                first["choices"][0]["prompt_logprobs"] = prompt_logprobs_json(self.extras.scored[0])
            yield first

    def chunk(self, tag: int, c) -> dict | None:
        k = self.body.num_logprobs
        logprobs = chat_logprobs(c.token_ids, c.logprobs, k) if k is not None else None
        finish_reason = c.finish_reason
        if self.streams is None:
            if not c.text and finish_reason is None and k is None:
                return None  # tokens that have not become text yet (a split character, a held stop prefix)
            return self.builder.chat_chunk(c.index, {"content": c.text} if c.text else {}, finish_reason, logprobs,
                                           c.stop_reason)
        self.texts[c.index] += c.text
        stream = self.streams[c.index]
        content, calls = stream.update(self.texts[c.index], finish_reason is not None)
        message = {}
        if content:
            message["content"] = content
        if calls:
            message["tool_calls"] = calls
        if finish_reason is not None:
            finish_reason = tool_calls.finish_reason(self.plan, finish_reason, len(stream.ids))
        if not message and finish_reason is None and logprobs is None:
            return None
        return self.builder.chat_chunk(c.index, message, finish_reason, logprobs, c.stop_reason)


def stream_error(e: Exception) -> str:
    error = engine_failure(e)
    return sse(error_body(error.status, error.message, error.param, error.code))


async def events(engine, body, requests, builder: ResponseBuilder, reservation, shaper):
    """The SSE lines of one streamed request; shaper: CompletionChunks or ChatChunks."""
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    completion_tokens = 0
    try:
        for chunk in shaper.opening():
            yield sse(chunk)
        async with aclosing(engine.generate(requests, reservation)) as stream:
            async for tag, delta in stream:
                for c in delta.completions:
                    completion_tokens += len(c.token_ids)
                    chunk = shaper.chunk(tag, c)
                    if chunk is None:
                        continue
                    if body.continuous_usage:
                        chunk["usage"] = usage(prompt_tokens, completion_tokens)
                    yield sse(chunk)
        if body.include_usage:
            yield sse(builder.usage_chunk(prompt_tokens, completion_tokens))
    except ENGINE_ERRORS as e:
        yield stream_error(e)
    finally:
        reservation.release()
    yield sse("[DONE]")
