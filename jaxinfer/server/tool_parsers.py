"""Tool calls out of generated text, one parser per chat-template family.

A model that was shown tools (its chat template renders them) answers a
call in its family's format:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block
                 per call, after optional text (Hermes, Qwen2.5, Qwen3 templates)
    llama3_json  a bare {"name": ..., "parameters": {...}} object, optionally after
                 <|python_tag|>, several joined by ";" (Llama 3.1 / 3.2 templates)
    mistral      [TOOL_CALLS] then a JSON array of {"name", "arguments"} (Mistral v3
                 templates; [TOOL_CALLS] is a control token, so its requests keep
                 special tokens in the text)

and two shapes the server itself asks for by constraining decoding (server/
tool_calls.py): "required" (the array a mistral call carries, without the
marker) and "named" (the arguments object alone).

Every parser reads the whole text so far and returns a `Parsed`: the content
before the calls, how much of it is safe to send while a call marker may
still be forming, and the calls with whatever of each has been generated.
A call's arguments are the raw JSON text of its arguments value, so that
the pieces a stream sends always add up to the final arguments. The same
function serves a finished text and a stream (`ToolCallStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral")
_ARGUMENT_KEYS = ("arguments", "parameters")
_SCALAR = re.compile(r"[^,\]}\s]+")
_WHITESPACE = re.compile(r"\s*")


@dataclass
class PartialCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # raw JSON text of the arguments value so far ("" before it starts)


@dataclass
class Parsed:
    content: str  # text before the first call (all of it when there is none)
    safe_content: int  # characters of content that no later token can turn into a call marker
    calls: list[PartialCall] = field(default_factory=list)
    in_calls: bool = False  # a call marker (or the start of a call) has been seen


def detect_parser(chat_template: str | None) -> str | None:
    """The family a chat template's tool-call format belongs to, or None."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template
                                        and "tools" in template):
        return "llama3_json"
    return None


# -- partial JSON ----------------------------------------------------------------
def _skip_space(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def _string_end(text: str, i: int) -> int | None:
    """text[i] == '"': the index after the closing quote, or None while open."""
    j = i + 1
    while True:
        k = text.find('"', j)
        if k < 0:
            return None
        backslashes = len(text[j:k]) - len(text[j:k].rstrip("\\"))
        if backslashes % 2 == 0:
            return k + 1
        j = k + 1


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], or None while it is incomplete."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    match = _SCALAR.match(text, i)
    end = match.end() if match else i
    return end if end < len(text) else None  # a number may still grow


def _object_call(text: str, i: int) -> tuple[PartialCall, int | None] | None:
    """text[i] == '{': the call its members describe so far, and the index
    after the object (None while it is open); None if it is not JSON."""
    members: dict[str, tuple[int, int | None]] = {}
    j = _skip_space(text, i + 1)
    end = None
    while j < len(text):
        if text[j] == "}":
            end = j + 1
            break
        if text[j] != '"':
            return None
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = _skip_space(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            return None
        j = _skip_space(text, j + 1)
        if j >= len(text):
            break
        stop = value_end(text, j)
        members[key] = (j, stop)
        if stop is None:
            break
        j = _skip_space(text, stop)
        if j < len(text) and text[j] == ",":
            j = _skip_space(text, j + 1)
        elif j < len(text) and text[j] != "}":
            return None
    name = None
    if "name" in members and members["name"][1] is not None:
        start, stop = members["name"]
        value = json.loads(text[start:stop])
        name = value if isinstance(value, str) else None
    arguments = ""
    key = next((k for k in _ARGUMENT_KEYS if k in members), None)
    if key is not None:
        start, stop = members[key]
        if text[start] == '"':  # arguments given as a JSON text inside a string
            arguments = json.loads(text[start:stop]) if stop is not None else ""
        else:
            arguments = text[start:stop] if stop is not None else text[start:].rstrip()
    elif end is not None:
        arguments = "{}"  # a call without arguments
    return PartialCall(name, arguments), end


def _calls_in_array(text: str, i: int) -> list[PartialCall]:
    """text[i] == '[': the call objects of a JSON array, the last possibly open."""
    calls = []
    j = _skip_space(text, i + 1)
    while j < len(text) and text[j] == "{":
        found = _object_call(text, j)
        if found is None:
            break
        call, end = found
        calls.append(call)
        if end is None:
            break
        j = _skip_space(text, end)
        if j < len(text) and text[j] == ",":
            j = _skip_space(text, j + 1)
        else:
            break
    return calls


def _held_marker(text: str, marker: str) -> int:
    """Characters at the end of text that could be the start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# -- the families -----------------------------------------------------------------
def parse_hermes(text: str) -> Parsed:
    start_tag, end_tag = "<tool_call>", "</tool_call>"
    first = text.find(start_tag)
    if first < 0:
        return Parsed(text, len(text) - _held_marker(text, start_tag))
    parsed = Parsed(text[:first], first, in_calls=True)
    position = first
    while position >= 0:
        body = position + len(start_tag)
        close = text.find(end_tag, body)
        segment = text[body:close if close >= 0 else len(text)]
        j = _skip_space(segment, 0)
        if j < len(segment) and segment[j] == "{":
            found = _object_call(segment, j)
            if found is not None:
                parsed.calls.append(found[0])
        if close < 0:
            break
        position = text.find(start_tag, close + len(end_tag))
    return parsed


def parse_llama3_json(text: str) -> Parsed:
    tag = "<|python_tag|>"
    j = _skip_space(text, 0)
    if text.startswith(tag, j):
        j = _skip_space(text, j + len(tag))
    elif j < len(text) and tag.startswith(text[j:]):
        return Parsed("", 0)  # may be the tag: wait
    if j >= len(text):
        return Parsed(text, 0)  # only whitespace so far: a call may follow
    if text[j] != "{":
        return Parsed(text, len(text))
    parsed = Parsed("", 0, in_calls=True)
    while j < len(text) and text[j] == "{":
        found = _object_call(text, j)
        if found is None:
            break
        call, end = found
        parsed.calls.append(call)
        if end is None:
            break
        j = _skip_space(text, end)
        if j < len(text) and text[j] == ";":
            j = _skip_space(text, j + 1)
        else:
            break
    return parsed


def parse_mistral(text: str) -> Parsed:
    marker = "[TOOL_CALLS]"
    first = text.find(marker)
    if first < 0:
        return Parsed(text, len(text) - _held_marker(text, marker))
    parsed = Parsed(text[:first], first, in_calls=True)
    j = _skip_space(text, first + len(marker))
    if j < len(text) and text[j] == "[":
        parsed.calls = _calls_in_array(text, j)
    return parsed


def parse_required(text: str) -> Parsed:
    """The array of calls that tool_choice "required" constrains the output to."""
    j = _skip_space(text, 0)
    return Parsed("", 0, _calls_in_array(text, j) if j < len(text) and text[j] == "[" else [], in_calls=True)


def named_parser(name: str):
    """A named tool_choice constrains the output to that function's arguments."""

    def parse(text: str) -> Parsed:
        return Parsed("", 0, [PartialCall(name, text.strip())], in_calls=True)

    return parse


FAMILIES = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's streamed tool calls: fed the whole text so far, returns
    what is new as OpenAI deltas. A call is announced (index, id, type and
    name, arguments "") once its name is complete, then its arguments grow.
    Content before the calls streams as it comes, less what could still be
    the start of a call marker, and nothing while it is only whitespace."""

    def __init__(self, parse):
        self.parse = parse
        self.sent_content = 0
        self.sent_arguments: list[int] = []  # per announced call
        self.ids: list[str] = []

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        parsed = self.parse(text)
        content_end = len(parsed.content) if (final or parsed.in_calls) else parsed.safe_content
        content = ""
        if parsed.content[:content_end].strip() and content_end > self.sent_content:
            content = parsed.content[self.sent_content:content_end]
            self.sent_content = content_end
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_arguments.append(0)
                deltas.append({"index": index, "id": self.ids[index], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.sent_arguments[index]:
                deltas.append({"index": index,
                               "function": {"arguments": call.arguments[self.sent_arguments[index]:]}})
            self.sent_arguments[index] = len(call.arguments)
        return content, deltas


def final_message(parse, text: str) -> tuple[str | None, list[dict]]:
    """(content or None, tool_calls in OpenAI's shape) of a finished text."""
    parsed = parse(text)
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls if c.name is not None]
    content = parsed.content if parsed.content.strip() else None
    return content, calls
