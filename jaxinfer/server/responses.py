"""OpenAI response bodies and stream chunks, built from the engine thread's deltas.

Choice indices: a completions request with P prompts and n completions each
has P * n choices, prompt i's completion j at index i * n + j (as vLLM).
Usage counts each prompt once and every generated token of every choice.
Logprobs: completions get OpenAI's legacy columns (tokens, token_logprobs,
top_logprobs as {token text: logprob} with the sampled token included,
text_offset); chat gets `content: [{token, logprob, bytes, top_logprobs}]`
with exactly top_logprobs entries, best first. A logprob of a token that a
mask ruled out (structured outputs, allowed_token_ids, ...) is -inf, which
JSON cannot carry: it is sent as -9999.0, as vLLM does.
Prompt logprobs (vLLM's `prompt_logprobs`): [null, {"token id": {"logprob",
"rank", "decoded_token"}}, ...], the prompt's own token and the top k.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from jaxinfer.outputs import Logprob
from jaxinfer.server.engine_thread import CompletionDelta


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# The floor vLLM sends for -inf (and NaN) logprobs: JSON has no infinity.
MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)[:k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int, offset: int) -> dict:
    """OpenAI's legacy logprobs columns; offset: characters of text before the first token."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(finite(sampled.logprob))
        choices = {lp.decoded_token or "": finite(lp.logprob) for _, lp in _top(entry, k)}
        choices.setdefault(text, finite(sampled.logprob))
        top.append(choices)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echoed_prompt_logprobs(token_ids: list[int], entries: list, k: int, first_text: str) -> dict:
    """The legacy columns of an echoed prompt (entries from prompt_logprobs):
    its first token has no logprob (null); first_text is that token's text."""
    columns = completion_logprobs(token_ids[1:], entries[1:], k, len(first_text))
    return {"tokens": [first_text] + columns["tokens"], "token_logprobs": [None] + columns["token_logprobs"],
            "top_logprobs": [None] + columns["top_logprobs"], "text_offset": [0] + columns["text_offset"]}


def prompt_logprobs_json(entries: list) -> list:
    return [None if entry is None else {str(token): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                                     "decoded_token": lp.decoded_token}
                                        for token, lp in entry.items()} for entry in entries]


def _chat_token(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": finite(lp.logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> dict:
    content = []
    for token_id, entry in zip(token_ids, entries):
        item = _chat_token(entry[token_id])
        item["top_logprobs"] = [_chat_token(lp) for _, lp in _top(entry, k)]
        content.append(item)
    return {"content": content}


@dataclass
class Extras:
    """What a response carries beyond the engine's deltas: prompt logprobs, the tool plan."""

    scored: list = field(default_factory=list)  # per prompt: prompt_logprobs entries
    plan: object = None  # tool_calls.ToolPlan, or None


@dataclass
class Choice:
    """One choice accumulated over deltas (non-streamed responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class ResponseBuilder:
    """Ids, timestamps and shapes of one HTTP request's response (both APIs, both modes)."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    # -- completions ----------------------------------------------------------
    def completion_choice(self, index: int, text: str, finish_reason, stop_reason, logprobs) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def completion(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        body = self._envelope("text_completion", choices)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def completion_chunk(self, choice: dict) -> dict:
        return self._envelope("text_completion", [choice])

    # -- chat -----------------------------------------------------------------
    def chat_choice(self, index: int, text: str | None, finish_reason, stop_reason, logprobs,
                    tool_calls: list | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def chat_completion(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        body = self._envelope("chat.completion", choices)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chat_chunk(self, index: int, delta: dict, finish_reason=None, logprobs=None, stop_reason=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._envelope("chat.completion.chunk", [choice])

    # -- both -------------------------------------------------------------------
    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
