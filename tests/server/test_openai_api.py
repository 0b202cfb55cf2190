"""`jaxinfer serve` over real HTTP on 127.0.0.1, checked with the real `openai`
client against LLM.generate / LLM.chat of the same model and engine, the
real tokenizer, and prometheus_client's own parser for /metrics.

One server for the module (uvicorn in a thread, on a port the OS picked),
over the embedded SmolLM2 with a small engine (few buckets to compile).
References are computed with the same LLM before the server starts: from
then on its engine belongs to the server's engine thread.
"""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer import LLM, SamplingParams
from jaxinfer.server.app import build_app
from tests.serving import served

MODEL = "smollm2-test"
KEY = "test-key"
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=96)
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SEEDED = dict(n=2, temperature=1.0, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True)
LOAD_PROMPTS = [f"Item {i}: the colour of the sky is" if i % 2 else f"{i} plus {i} equals" for i in range(64)]
LOAD_MAX_TOKENS = [1 + i % 4 for i in range(64)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(progress=False, **ENGINE)
    # Every bucket compiled before the reference: a step padded into a larger
    # bucket rounds differently (~1e-5 in a logprob), and the tests below
    # compare logprobs of the same engine at 1e-5.
    llm.wait_compiled()
    return llm


@pytest.fixture(scope="module")
def reference(llm):
    """What the offline API answers; computed before the server owns the engine."""
    out = {}
    out["greedy"] = llm.generate(PROMPT, greedy(8, logprobs=2), use_tqdm=False)[0].outputs[0]
    out["chat"] = llm.chat(CHAT, greedy(16))[0].outputs[0]
    out["chat_logprobs"] = llm.chat(CHAT, greedy(4, logprobs=2))[0].outputs[0]
    out["seeded"] = llm.generate(PROMPT, SamplingParams(**SEEDED), use_tqdm=False)[0].outputs
    out["two"] = [o.outputs[0] for o in llm.generate([PROMPT, "Water boils at"], greedy(5), use_tqdm=False)]
    out["load"] = [o.outputs[0] for o in llm.generate(
        LOAD_PROMPTS, [greedy(m, ignore_eos=True) for m in LOAD_MAX_TOKENS], use_tqdm=False)]
    return out


class Running:
    def __init__(self, url, app, llm):
        self.url, self.app, self.llm = url, app, llm
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        self.auth = {"Authorization": f"Bearer {KEY}"}

    @property
    def engine_thread(self):
        return self.app.state.server.engine

    def metrics(self) -> dict:
        """{(name, frozenset(labels minus model_name)): value} from GET /metrics."""
        text = httpx.get(self.url + "/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = frozenset((k, v) for k, v in sample.labels.items() if k != "model_name")
                values[(sample.name, labels)] = sample.value
        return values


@pytest.fixture(scope="module")
def server(llm, reference):
    app = build_app(llm, model_name=MODEL, api_key=KEY, max_queue=256)
    with served(app) as url:
        yield Running(url, app, llm)


def stream_text(chunks, chat=False):
    texts, finish, usage = {}, {}, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


# -- completions and chat --------------------------------------------------------------------------
@pytest.mark.slow
def test_completion_streamed_and_not_equal_generate(server, reference, llm):
    ref = reference["greedy"]
    full = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert full.choices[0].text == ref.text and full.choices[0].finish_reason == "length"
    prompt_tokens = len(llm.tokenizer.encode(PROMPT))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, 8)
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    texts, finish, usage = stream_text(chunks)
    assert texts == {0: ref.text} and finish == {0: "length"}
    assert len([c for c in chunks if c.choices]) > 1  # really streamed, not one chunk
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 8)


def test_chat_streamed_and_not_equal_llm_chat(server, reference):
    ref = reference["chat"]
    full = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert full.choices[0].message.content == ref.text and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert full.usage.completion_tokens == len(ref.token_ids)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, finish, usage = stream_text(chunks, chat=True)
    assert texts == {0: ref.text} and finish == {0: full.choices[0].finish_reason}
    assert usage.total_tokens == full.usage.total_tokens


def test_seeded_n2_sampling_reproducible_and_equal_generate(server, reference):
    kw = dict(model=MODEL, prompt=PROMPT, n=2, temperature=1.0, top_p=0.9, seed=5, max_tokens=6,
              extra_body={"ignore_eos": True})
    first = server.client.completions.create(**kw)
    again = server.client.completions.create(**kw)
    expected = [o.text for o in reference["seeded"]]
    assert [c.text for c in first.choices] == expected == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1] and expected[0] != expected[1]
    texts, _, _ = stream_text(server.client.completions.create(**kw, stream=True))
    assert texts == {0: expected[0], 1: expected[1]}


def test_logprobs_equal_generate(server, reference):
    ref = reference["greedy"]
    out = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)],
                                              abs=1e-5)
    assert "".join(lp.tokens) == ref.text and lp.text_offset[0] == 0
    assert all(1 <= len(top) <= 3 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    chat_ref = reference["chat_logprobs"]
    chat = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [e[t].logprob for t, e in zip(chat_ref.token_ids, chat_ref.logprobs)], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)  # greedy: rank 1


def test_stop_string_cut_streamed_and_not(server, reference):
    text = reference["greedy"].text
    stop = text[4:7]
    assert stop.strip(), text
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    full = server.client.completions.create(**kw)
    assert full.choices[0].text == text[: text.index(stop)] and full.choices[0].finish_reason == "stop"
    texts, finish, _ = stream_text(server.client.completions.create(**kw, stream=True))
    assert texts == {0: text[: text.index(stop)]} and finish == {0: "stop"}


def test_token_id_prompts_and_prompt_lists(server, reference, llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert out.choices[0].text == reference["two"][0].text
    both = server.client.completions.create(model=MODEL, prompt=[ids, llm.tokenizer.encode("Water boils at")],
                                            max_tokens=5, temperature=0)
    assert [c.text for c in both.choices] == [r.text for r in reference["two"]]
    texts, _, _ = stream_text(server.client.completions.create(model=MODEL, prompt=[PROMPT, "Water boils at"],
                                                               max_tokens=5, temperature=0, stream=True))
    assert texts == {0: reference["two"][0].text, 1: reference["two"][1].text}
    echoed = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + reference["two"][0].text


def test_models_and_tokenize_round_trip(server, llm):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    text = "Hello, world! Ünïcödé 漢字"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=server.auth).json()
    assert tokens["tokens"] == llm.tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=server.auth).json()
    assert back["prompt"] == llm.tokenizer.decode(tokens["tokens"]) == text
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, headers=server.auth).json()
    assert chat["tokens"] == llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)


# -- refusals --------------------------------------------------------------------------------------
def test_api_key_and_unknown_model(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # open: probes carry no key
    assert httpx.get(server.url + "/metrics").status_code == 200
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        server.client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)


def test_load_counts_an_open_stream(server):
    """GET /load (vLLM's shape, no API key: a router polls it) is 0 idle, 1
    while one streamed request is open, and 0 once its stream has ended."""
    def load():
        r = httpx.get(server.url + "/load")
        assert r.status_code == 200
        return r.json()

    assert load() == {"server_load": 0}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.auth) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert json.loads(first[len("data: "):])["choices"]
        assert load() == {"server_load": 1}
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert load() == {"server_load": 0}


BAD_COMPLETIONS = [
    (b'{"prompt": "x", "max_tokens": ', "JSON"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_model_len=256"),
    ({"prompt": "x", "n": 10**6}, "n must be"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": list(range(1, 301))}, "300 tokens"),
    ({"prompt": [1, 10**7]}, "vocabulary"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x" * 100_000}, "max_model_len=256"),  # tokenized off the event loop, then too long
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ([1, 2, 3], "JSON object"),
    ({"prompt": "x", "max_tokens": "9" * 1_000_000}, "max_tokens"),  # a big wrong value is not echoed
    (b'{"prompt": "' + b"a" * 10_000_000 + b'"}', "limit"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": CHAT, "top_logprobs": 3}, "logprobs"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_tokens"),
]


def test_bad_inputs_are_named_while_a_stream_runs(server, reference):
    """Each bad request gets a 4xx whose OpenAI-shaped message names the
    problem, and a streamed request running meanwhile completes unchanged."""
    result = {}

    def stream():
        chunks = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                                       stream=True)
        result["texts"] = stream_text(chunks, chat=True)[0]

    thread = threading.Thread(target=stream)
    thread.start()
    cases = [("/v1/completions", b, m) for b, m in BAD_COMPLETIONS] + [("/v1/chat/completions", b, m)
                                                                      for b, m in BAD_CHATS]
    for path, body, expected in cases:
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.url + path, content=body, timeout=60,
                       headers={**server.auth, "Content-Type": "application/json"})
        assert r.status_code in (400, 413), (expected, r.status_code, r.text[:300])
        assert len(r.content) < 1000
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and expected in error["message"], error
    thread.join(120)
    assert result["texts"] == {0: reference["chat"].text}


# -- structured outputs ------------------------------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
        "required": ["city", "population"], "additionalProperties": False}


def test_structured_outputs_json_schema_regex_and_bad_schema(server):
    """response_format json_schema on chat (the real openai client) gives JSON
    that jsonschema validates; vLLM's structured_outputs on completions,
    streamed, fullmatches its regex; a schema that does not compile is a 400
    naming the problem, streamed or not."""
    import re

    import jsonschema

    for seed in (0, 1):
        full = server.client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=48, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
        jsonschema.validate(json.loads(full.choices[0].message.content), CITY)
        assert full.choices[0].finish_reason == "stop"
    chunks = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
                                              stream=True, extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,9}"}})
    texts, finish, _ = stream_text(chunks)
    assert re.fullmatch("[A-Z][a-z]{2,9}", texts[0]) and finish == {0: "stop"}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="structured_outputs.json: Invalid type"):
            server.client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=8, stream=stream,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})


# -- disconnects --------------------------------------------------------------------------------------
def wait_idle(server, before_aborts):
    """Poll /metrics (bounded) until no request runs or waits and no KV block is held."""
    for _ in range(100):
        m = server.metrics()
        if (m[("jaxinfer:num_requests_running", frozenset())] == 0
                and m[("jaxinfer:num_requests_waiting", frozenset())] == 0
                and m[("jaxinfer:kv_cache_usage_perc", frozenset())] == 0
                and aborts(m) > before_aborts):
            return m
        time.sleep(0.1)
    raise AssertionError(f"still busy: {server.engine_thread.stats}")


def aborts(m):
    return m.get(("jaxinfer:request_success_total", frozenset({("finished_reason", "abort")})), 0)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = aborts(server.metrics())
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.auth) as r:
        lines = r.iter_lines()
        chunks = [next(lines) for _ in range(6)]  # three events (a blank line after each)
    assert all(json.loads(c[len("data: "):])["choices"] for c in chunks if c)
    m = wait_idle(server, before)
    assert server.engine_thread.stats["kv_blocks_used"] == 0
    generated = m[("jaxinfer:generation_tokens_total", frozenset())]
    # And a request left without streaming: the client gives up after 0.3 s (200 tokens take ~1 s on the
    # 2-core CPU at batch 1: with 1 s the answer sometimes came first).
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, headers=server.auth, timeout=0.3)
    m = wait_idle(server, before + 1)
    assert m[("jaxinfer:generation_tokens_total", frozenset())] - generated < 200  # stopped, not run to the end


# -- load ---------------------------------------------------------------------------------------------
def test_64_concurrent_streams_complete_and_metrics_agree(server, reference):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    before = server.metrics()

    async def one(prompt, max_tokens):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        return stream_text([chunk async for chunk in stream])

    async def all_of_them():
        return await asyncio.gather(*(one(p, m) for p, m in zip(LOAD_PROMPTS, LOAD_MAX_TOKENS)))

    results = asyncio.run(all_of_them())
    for (texts, finish, usage), ref, m in zip(results, reference["load"], LOAD_MAX_TOKENS):
        assert texts == {0: ref.text} and finish == {0: "length"} and usage.completion_tokens == m
    after = server.metrics()

    def delta(name, labels=frozenset()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert delta("jaxinfer:generation_tokens_total") == sum(u.completion_tokens for _, _, u in results)
    assert delta("jaxinfer:prompt_tokens_total") == sum(u.prompt_tokens for _, _, u in results)
    assert delta("jaxinfer:request_success_total", frozenset({("finished_reason", "length")})) == 64
    assert delta("jaxinfer:time_to_first_token_seconds_count") == 64
    assert delta("jaxinfer:e2e_request_latency_seconds_count") == 64
    assert server.llm.stats()["num_compilations_off_grid"] == 0  # every step of the load in a bucket of the grid


# -- the engine thread's failure paths, over a scripted engine --------------------------------------
class ScriptedEngine:
    """The engine interface the server uses; each step gives every request one
    token ("x"). `fail` makes the next step raise; `hold` makes steps idle."""

    def __init__(self):
        from types import SimpleNamespace

        self.requests, self.fail, self.hold = {}, False, threading.Event()
        self.config = SimpleNamespace(max_model_len=64)

    def validate(self, name, token_ids, params):
        pass

    def validate_prompt(self, name, token_ids):
        pass

    def validate_priority(self, name, priority):
        pass

    def add_request(self, request_id, token_ids, params, prompt=None, lora_request=None):
        from jaxinfer.outputs import CompletionOutput, RequestOutput

        self.requests[request_id] = (RequestOutput(request_id, prompt, list(token_ids),
                                                   [CompletionOutput(0, "", [])], False), params)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        if self.fail:
            raise RuntimeError("device lost")
        if self.hold.is_set():
            time.sleep(0.01)
            return []
        outputs = []
        for request_id, (output, params) in list(self.requests.items()):
            completion = output.outputs[0]
            completion.token_ids.append(87)
            completion.text += "x"
            if len(completion.token_ids) == params.max_tokens:
                completion.finish_reason, output.finished = "length", True
                del self.requests[request_id]
            outputs.append(output)
        return outputs

    def abort(self, request_id):
        output, _ = self.requests.pop(request_id, (None, None))
        if output is not None:
            output.outputs[0].finish_reason, output.finished = "abort", True
        return output

    def stats(self):
        return dict(num_requests_running=len(self.requests), num_requests_waiting=0, kv_blocks_used=0,
                    kv_blocks_total=1, num_compilations=0)


@pytest.fixture
def scripted(llm):
    from types import SimpleNamespace

    engine = ScriptedEngine()
    fake_llm = SimpleNamespace(engine=engine, tokenizer=llm.tokenizer, max_model_len=64,
                               model=SimpleNamespace(config=llm.model.config, source="scripted"))
    return engine, fake_llm


def test_health_503_while_loading_and_after_a_failed_step(scripted):
    from fastapi.testclient import TestClient

    engine, fake_llm = scripted
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return fake_llm

    body = {"prompt": "hi", "max_tokens": 50, "stream": True}
    with TestClient(build_app(model_name="m", load=load)) as client:
        r = client.get("/health")
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json=body).status_code == 503
        loaded.set()
        for _ in range(100):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        assert client.get("/health").status_code == 200
        engine.fail = True
        events = [line for line in client.post("/v1/completions", json=body).text.split("\n\n") if line]
        assert "device lost" in json.loads(events[-2][len("data: "):])["error"]["message"]
        assert events[-1] == "data: [DONE]"
        r = client.get("/health")
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json={**body, "stream": False}).status_code == 503


def test_queue_full_is_429(scripted):
    from fastapi.testclient import TestClient

    engine, fake_llm = scripted
    engine.hold.set()  # admitted requests stay in flight
    with TestClient(build_app(fake_llm, model_name="m", max_queue=1)) as client:
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 3})))
        thread.start()
        for _ in range(100):
            if client.app.state.server.engine.num_in_flight:
                break
            time.sleep(0.02)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        engine.hold.clear()
        thread.join(30)
        assert result["r"].json()["choices"][0]["text"] == "xxx"


def test_shutdown_aborts_in_flight_and_tells_the_client(scripted):
    from jaxinfer.server.engine_thread import EngineRequest, EngineThread

    engine, _ = scripted
    thread = EngineThread(engine)
    thread.start()

    async def run():
        deltas = []
        # More tokens than the engine thread can step through before this
        # loop sees the first delta and holds it: a loaded machine once let a
        # 1,000-token request finish first, leaving nothing to abort.
        async for _, delta in thread.generate([EngineRequest("r", [1, 2], greedy(10**7))]):
            deltas.append(delta)
            if len(deltas) == 1:
                engine.hold.set()
                aborted = await asyncio.get_running_loop().run_in_executor(None, thread.stop)
                assert aborted == 1
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finished and deltas[-1].completions[0].finish_reason == "abort"
    assert not thread.alive


# -- the command line -------------------------------------------------------------------------------
def test_cli_serve_options_reach_llm_and_server(monkeypatch):
    import jaxinfer
    from jaxinfer import cli
    from jaxinfer.server import launch

    served, built = {}, {}
    monkeypatch.setattr(launch, "serve", lambda load, **kw: served.update(kw, llm=load()))
    monkeypatch.setattr(jaxinfer, "LLM", lambda model, **kw: built.update(kw, model=model) or "llm")
    assert cli.main(["serve", "--model", "m.gguf", "--port", "9", "--api-key", "k", "--max-num-seqs", "4",
                     "--quantization", "int8", "--speculative-method", "ngram", "--data-parallel-size", "2"]) == 0
    assert served["model_name"] == "m.gguf" and served["port"] == 9 and served["api_key"] == "k"
    assert served["host"] == "127.0.0.1" and served["llm"] == "llm"
    assert built["model"] == "m.gguf" and built["max_num_seqs"] == 4 and built["quantization"] == "int8"
    assert built["speculative"]["method"] == "ngram" and built["data_parallel_size"] == 2
    assert cli.main(["serve", "--served-model-name", "x"]) == 0 and served["model_name"] == "x"


def test_non_loopback_without_key_warns(monkeypatch, caplog):
    from jaxinfer.server import launch

    monkeypatch.setattr(launch._Server, "run", lambda self: None)
    with caplog.at_level("WARNING", logger="jaxinfer.server"):
        launch.serve(lambda: None, model_name="m", host="0.0.0.0")
    assert "without --api-key" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxinfer.server"):
        launch.serve(lambda: None, model_name="m", host="127.0.0.1")
    assert "without --api-key" not in caplog.text


# -- jaxinfer bench serve ------------------------------------------------------------------------------
def test_bench_serve_counts_what_the_server_generated(server):
    from jaxinfer.server.bench_serve import build_dataset, run_bench, summarize

    dataset = build_dataset("random", 8, 12, 4, 0.5, 0, 1, 32000, seed=1)
    before = server.metrics()
    results, duration = asyncio.run(run_bench(server.url, None, dataset, 50.0, 4, KEY))
    summary = summarize(results, duration, {"ttft": 1e6, "tpot": 1e6})
    after = server.metrics()
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(m for _, m in dataset)
    assert summary["total_input_tokens"] == sum(len(p) for p, _ in dataset)
    # The untimed first request generates 2 tokens.
    generated = after[("jaxinfer:generation_tokens_total", frozenset())] - before[
        ("jaxinfer:generation_tokens_total", frozenset())]
    assert generated == summary["total_output_tokens"] + 2
    assert summary["goodput"] == summary["request_throughput"]
    assert all(summary[k]["median_ms"] > 0 for k in ("ttft", "tpot", "itl", "e2el"))
    assert sum(len(r.itl) for r in results) == sum(m - 1 for _, m in dataset)  # one chunk per token here


def test_shared_prefix_dataset_groups():
    from jaxinfer.server.bench_serve import build_dataset

    data = build_dataset("shared-prefix", 6, 5, 3, 0.0, 20, 2, 32000, seed=0)
    assert len(data) == 6 and all(len(p) == 25 for p, _ in data)
    assert data[0][0][:20] == data[2][0][:20] != data[3][0][:20] == data[5][0][:20]
    assert data[0][0][20:] != data[1][0][20:]
