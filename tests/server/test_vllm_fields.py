"""What vLLM clients send, through `jaxinfer serve`: tool
calling, vLLM's sampling and output fields, its legacy guided_* fields,
prompt logprobs, the priority policy's field, vLLM-named metrics, CORS and
/version, each through the real `openai` client (or raw HTTP where the
client has no field) over 127.0.0.1.

References: jsonschema (tool arguments), transformers' own
apply_chat_template with the same template (tool rendering), re.fullmatch,
the offline LLM before the server owns its engine (generation logprobs, to
which the prompt-scoring pass's logprobs must agree), prometheus_client's
parser and Starlette's CORS contract as browsers read it.

One server for the module over the embedded SmolLM2, with a Hermes-style
chat template written here (SmolLM2's own template ignores tools), so the
tool-call parser is detected from the template.
"""

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer import LLM, SamplingParams
from jaxinfer.server.app import build_app
from tests.serving import served

MODEL = "smollm2-fields"
ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=160,
              scheduling_policy="priority")
PROMPT = "The capital of France is"
ORIGIN = "http://app.example"

# A Hermes-style template (tools in <tools>, calls as <tool_call> JSON), written for these tests.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(progress=False, **ENGINE)
    llm.wait_compiled()  # references and served requests run the same bucket programs
    return llm


@pytest.fixture(scope="module")
def reference(llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)[0]
    greedy8 = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    return {"ids": ids, "generated": out.outputs[0], "greedy8": greedy8}


@pytest.fixture(scope="module")
def server(llm, reference):
    app = build_app(llm, model_name=MODEL, max_queue=256, chat_template=HERMES_TEMPLATE,
                    allowed_origins=[ORIGIN])
    with served(app) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def streamed_tool_calls(chunks):
    """Assemble OpenAI tool-call deltas as a client does: by index, arguments concatenated."""
    calls, content, finish = {}, "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


# -- tool calling ------------------------------------------------------------------------------------
def test_named_function_arguments_validate_streamed_and_not(server):
    _, client = server
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (0, 1):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=40, temperature=1.0, seed=seed)
        call, = out.choices[0].message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert out.choices[0].finish_reason == "stop"  # OpenAI's for a named function
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=40, temperature=1.0, seed=0, stream=True))
    calls, content, finish = streamed_tool_calls(chunks)
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"] and content == ""
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2  # the arguments grew
    assert finish == "stop"


def test_required_calls_validate_and_parallel_flag(server):
    _, client = server
    for parallel, stream in ((True, False), (False, True)):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                  max_tokens=80, temperature=1.0, seed=3)
        if stream:
            calls, content, finish = streamed_tool_calls(client.chat.completions.create(**kw, stream=True))
        else:
            out = client.chat.completions.create(**kw)
            calls = [{"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
                     for c in out.choices[0].message.tool_calls]
            finish = out.choices[0].finish_reason
        assert calls and (parallel or len(calls) == 1) and finish == "tool_calls"
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert len({c["id"] for c in calls}) == len(calls)


# A tool whose schema (the get_time) says nothing of additionalProperties,
# at either depth; what the arguments must validate against, written closed.
OPEN_TIME = {"type": "object", "properties": {
    "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
    "options": {"type": "object", "properties": {"format": {"enum": ["12h", "24h"]}}, "required": ["format"]}},
    "required": ["zone", "options"]}
CLOSED_TIME = {"type": "object", "properties": {
    "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
    "options": {"type": "object", "properties": {"format": {"enum": ["12h", "24h"]}}, "required": ["format"],
                "additionalProperties": False}},
    "required": ["zone", "options"], "additionalProperties": False}
OPEN_TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                                "parameters": OPEN_TIME}}]


def test_unlisted_properties_are_not_generated(server):
    """vLLM's default: where a tool's schema does not say additionalProperties,
    the arguments hold only the listed keys, at every depth (sampled calls)."""
    _, client = server
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice in (named, "required"):
        for seed in (0, 1, 2):
            out = client.chat.completions.create(model=MODEL, messages=ASK, tools=OPEN_TOOLS,
                                                 tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=60,
                                                 temperature=1.0, seed=seed)
            call, = out.choices[0].message.tool_calls
            assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), CLOSED_TIME)


FORCED_CALL = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'


def test_auto_reads_the_templates_call_format(server):
    """tool_choice auto: the model is free, and the parser the server detected
    from the template (Hermes) reads what it writes. The model is made to write a
    call with a regex (structured outputs), so the parse is tested on real output."""
    _, client = server
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=1.0, seed=2,
              extra_body={"structured_outputs": {"regex": FORCED_CALL}})
    out = client.chat.completions.create(**kw)
    message = out.choices[0].message
    call, = message.tool_calls
    assert call.function.name == "get_time" and message.content is None
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    assert out.choices[0].finish_reason == "tool_calls"
    calls, content, finish = streamed_tool_calls(client.chat.completions.create(**kw, stream=True))
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]
    assert content == "" and finish == "tool_calls"
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_tools_and_tool_history_render_as_transformers_does(server, llm):
    url, client = server
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    ours = httpx.post(url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=llm.tokenizer.rust_tokenizer)
    hf_history = [dict(m) for m in history]
    hf_history[1] = dict(history[1], tool_calls=[{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}])  # HF's convention: objects
    text = hf.apply_chat_template(hf_history, tools=TOOLS, chat_template=HERMES_TEMPLATE, tokenize=False,
                                  add_generation_prompt=True)
    assert "get_time" in text and "18 degrees" in text and '"city": "Paris"' in text
    assert ours == llm.tokenizer.encode(text, add_special_tokens=False)
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens == len(ours)


def test_tool_refusals_are_400s(server):
    _, client = server
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=4, response_format={"type": "json_object"})


# -- sampling and output fields ----------------------------------------------------------------------
def test_token_rules_and_logit_bias(server, llm, reference):
    _, client = server
    yes, no = llm.tokenizer.encode(" yes"), llm.tokenizer.encode(" no")
    assert len(yes) == len(no) == 1
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=0,
                                    extra_body={"allowed_token_ids": yes + no, "ignore_eos": True})
    assert re.fullmatch("( yes| no){6}", out.choices[0].text)
    biased = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(yes[0]): 100})
    assert biased.choices[0].text == " yes" * 4
    greedy = reference["greedy8"]
    first_word = greedy.text.split()[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"bad_words": [first_word]})
    assert first_word not in banned.choices[0].text and banned.choices[0].text != greedy.text
    # min_tokens: the first greedy token as a stop token ends the request at once, unless min_tokens
    stop_id = greedy.token_ids[0]
    at_once = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [stop_id]})
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
    assert at_once.choices[0].text == ""  # the stop token's text is not output (vLLM)
    later = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"stop_token_ids": [stop_id], "min_tokens": 4})
    assert later.usage.completion_tokens >= 4


def test_include_stop_str_and_guided_fields(server, reference):
    _, client = server
    text = reference["greedy8"].text
    stop = text[4:7]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == text[:text.index(stop) + len(stop)] and out.choices[0].finish_reason == "stop"
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1,
                                       extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert choice.choices[0].text in ("Paris", "Lyon")
    regex = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    guided = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=1.0, seed=1,
                                            extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(guided.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError, match="guided_"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                  extra_body={"guided_regex": "a", "structured_outputs": {"regex": "b"}})


def test_continuous_usage_stats(server):
    _, client = server
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage is not None for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_echo_and_prompt_logprobs_agree_with_generation(server, reference):
    """lm-eval-harness's loglikelihood request (echo, logprobs, max_tokens 1) over
    a prompt that ends with the model's own greedy continuation: the prompt-scoring
    pass's logprobs of those tokens equal the engine's while generating them."""
    url, client = server
    generated = reference["generated"]
    ids = reference["ids"] + generated.token_ids
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    n = len(reference["ids"])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.text_offset[0] == 0
    expected = [e[t].logprob for t, e in zip(generated.token_ids, generated.logprobs)]
    assert lp.token_logprobs[n:len(ids)] == pytest.approx(expected, abs=2e-4)
    assert "".join(lp.tokens[:len(ids)]) == out.choices[0].text[:len("".join(lp.tokens[:len(ids)]))]
    raw = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                    "temperature": 0, "prompt_logprobs": 2}).json()
    entries = raw["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry, logprob in zip(ids[n:], entries[n:], expected):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=2e-4) and entry[str(token)]["rank"] == 1
        assert 2 <= len(entry) <= 3


def test_priority_field(server):
    _, client = server
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": -5})
    assert out.choices[0].finish_reason in ("length", "stop")


# -- operations ----------------------------------------------------------------------------------------
def test_vllm_metric_names_cors_and_version(server):
    url, client = server
    asyncio.run(_a_few_requests(url))
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert name in families, name

    def value(name, suffix):
        return sum(s.value for s in families[name].samples if s.name == name + suffix)

    for name in ("prompt_tokens", "generation_tokens"):
        assert value(f"vllm:{name}", "_total") == value(f"jaxinfer:{name}", "_total") > 0
    assert value("vllm:request_decode_time_seconds", "_count") >= 4
    preflight = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(url + "/v1/models", headers={"Origin": "http://evil.example",
                                                       "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in other.headers
    from importlib.metadata import version

    assert httpx.get(url + "/version").json() == {"version": version("jaxinfer")}


async def _a_few_requests(url):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    await asyncio.gather(*(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                                     extra_body={"ignore_eos": True}) for _ in range(4)))
