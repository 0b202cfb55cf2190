"""The tool-call parsers of each template family (server/tool_parsers.py), on
texts in each family's format: the calls found equal the calls written
(compared as JSON values, so json.loads is the reference), and a stream fed
the text in every split delivers arguments that add up to the same calls.
Which family a template is: detected from the template's own text."""

import json

import pytest

from jaxinfer.server.tool_parsers import (FAMILIES, ToolCallStream, detect_parser, final_message, named_parser,
                                          parse_required)

CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Europe/Paris", "n": [1, 2.5]})]
HERMES = ("Let me check. <tool_call>\n" + json.dumps({"name": CALLS[0][0], "arguments": CALLS[0][1]}) +
          "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": CALLS[1][0], "arguments": CALLS[1][1]}) +
          "\n</tool_call>")
LLAMA = "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)
MISTRAL = "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in CALLS])
CASES = [("hermes", HERMES, "Let me check. "), ("llama3_json", LLAMA, None), ("mistral", MISTRAL, None)]


def stream_all(parse, text, step):
    stream = ToolCallStream(parse)
    content, calls = "", {}
    for end in list(range(step, len(text), step)) + [len(text)]:
        piece, deltas = stream.update(text[:end], end == len(text))
        content += piece
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert call["name"] is None and d["type"] == "function"
                call["name"] = d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("family,text,content", CASES)
def test_family_parser_finds_the_calls_streamed_or_not(family, text, content):
    parse = FAMILIES[family]
    found_content, calls = final_message(parse, text)
    assert found_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    for step in (1, 3, 7, 50):
        streamed_content, streamed = stream_all(parse, text, step)
        assert streamed_content == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == CALLS


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_plain_text_is_content(family):
    text = "Paris is the capital of France."
    content, calls = final_message(FAMILIES[family], text)
    assert content == text and calls == []
    assert stream_all(FAMILIES[family], text, 2) == (text, [])


def test_a_marker_prefix_is_held_back_until_known():
    stream = ToolCallStream(FAMILIES["hermes"])
    assert stream.update("Sure <tool_", False) == ("Sure ", [])
    assert stream.update("Sure <tool_x> done", True) == ("<tool_x> done", [])


def test_required_and_named_shapes():
    text = json.dumps([{"name": n, "arguments": a} for n, a in CALLS], separators=(",", ":"))
    _, calls = final_message(parse_required, text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert [(c["name"], json.loads(c["arguments"])) for c in stream_all(parse_required, text, 4)[1]] == CALLS
    args = json.dumps(CALLS[0][1])
    _, calls = final_message(named_parser("get_weather"), args)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": args}


def test_detect_parser_from_templates():
    hermes = "{% for m in messages %}<tool_call>{{ m.content }}</tool_call>{% endfor %}"
    assert detect_parser(hermes) == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("{% if tools %}[AVAILABLE_TOOLS]{% endif %}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
