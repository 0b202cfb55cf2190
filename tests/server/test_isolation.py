"""One request must never slow, break or starve the others.

Each test guards a failure the server once had: an unbounded
stop list was accepted, a huge /tokenize froze the event loop, admission
counted prompts rather than sequences, the grammar queue had no bound,
-inf logprobs of a masked distribution broke the JSON, and one failed step
ended serving for everyone.

One server for the module (real HTTP on 127.0.0.1, the real openai client)
over the embedded SmolLM2 with a small engine and --max-queue 16.
"""

import json
import threading
import time

import httpx
import openai
import pytest

from jaxinfer import LLM
from jaxinfer.server.app import build_app
from tests.serving import served

MODEL = "smollm2-isolation"
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=96)
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
MAX_QUEUE = 16


@pytest.fixture(scope="module")
def server():
    llm = LLM(progress=False, **ENGINE)
    app = build_app(llm, model_name=MODEL, max_queue=MAX_QUEUE)
    with served(app) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), llm


def strict_json(text):
    """json.loads without JavaScript's Infinity / NaN, which JSON does not have."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_stop_strings_are_bounded(server):
    url, client, _ = server
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError, match="at most 64 stop strings"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=8,
                                  stop=[f"stop-{i}" for i in range(10_000)])
    with pytest.raises(openai.BadRequestError, match="at most 1024 characters"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=["x" * 5000])
    assert time.perf_counter() - start < 10
    # Within the bounds, a stop string that only a late token completes still cuts the text.
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = text[-4:]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[f"never-{i}" for i in range(63)] + [stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_huge_tokenize_neither_blocks_the_loop_nor_runs_unbounded(server):
    """8 MB of text to /tokenize took ~6 s of tokenizing on the event loop,
    during which nothing else was answered. It is refused untokenized now (no
    tokenization of it could fit the context), and /health answers meanwhile."""
    url, _, _ = server
    result = {}

    def huge():
        result["r"] = httpx.post(url + "/tokenize", json={"prompt": "hello world " * 650_000}, timeout=120)

    thread = threading.Thread(target=huge)
    thread.start()
    time.sleep(0.3)  # the body is being sent or handled
    health = []
    for _ in range(5):
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        health.append(time.perf_counter() - start)
    thread.join(120)
    assert max(health) < 1.0, health
    r = result["r"]
    assert r.status_code == 400 and "max_model_len=256" in r.json()["error"]["message"]
    huge_chat = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "word " * 1_000_000}], "max_tokens": 2}, timeout=60)
    assert huge_chat.status_code == 400 and "max_model_len=256" in huge_chat.json()["error"]["message"]


def test_admission_counts_sequences_before_any_work(server):
    _, client, _ = server
    with pytest.raises(openai.RateLimitError, match="this request has 20"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=20)
    with pytest.raises(openai.RateLimitError, match="this request has 18"):
        client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT, PROMPT], max_tokens=2, n=6)
    ok = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=2, n=8)
    assert len(ok.choices) == 16


def test_grammar_queue_is_bounded():
    """A fresh compiler spends its first compile building the tokenizer's
    llguidance view (~1 s): distinct specs submitted meanwhile queue up, and
    past the bound they are refused instead of queued."""
    from jaxinfer.loading.checkpoint import open_checkpoint
    from jaxinfer.sampling_params import StructuredOutputsParams
    from jaxinfer.structured.grammar import GrammarCompiler, GrammarQueueFull

    _, _, tokenizer, _ = open_checkpoint(None)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, max_pending=8)
    futures = [compiler.submit(StructuredOutputsParams(regex=f"[a-z]{{{i + 1}}}")) for i in range(8)]
    with pytest.raises(GrammarQueueFull, match="at most 8"):
        compiler.submit(StructuredOutputsParams(regex="[0-9]+"))
    assert compiler.submit(StructuredOutputsParams(regex="[a-z]{1}")) is futures[0]  # a cached spec still is served
    for future in futures:
        future.result(60)
    compiler.submit(StructuredOutputsParams(regex="[0-9]+")).result(60)  # room again once they are done
    compiler.shutdown()


def test_a_full_grammar_queue_is_a_429(server):
    url, client, llm = server
    compiler = llm.engine.grammar_compiler
    compiler.max_pending, saved = 0, compiler.max_pending
    try:
        with pytest.raises(openai.RateLimitError, match="waiting to compile"):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                      extra_body={"structured_outputs": {"regex": "[a-z]{2,5}!"}})
    finally:
        compiler.max_pending = saved


def test_masked_logprobs_are_valid_json(server):
    """A constrained request's top logprobs include tokens the grammar masked
    (-inf): they were a 500 after the whole generation (not streamed) or
    `-Infinity` in a stream."""
    url, _, _ = server
    choices = ["the colour red is warm", "the colour blue is cool"]
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 16, "logprobs": True, "top_logprobs": 5,
            "temperature": 0, "structured_outputs": {"choice": choices}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    content = strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) in choices
    assert any(t["logprob"] == -9999.0 for c in content for t in c["top_logprobs"])
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all(strict_json(e) for e in events[:-1])
    legacy = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                      "logprobs": 5, "allowed_token_ids": [100, 200]}, timeout=60)
    assert legacy.status_code == 200 and strict_json(legacy.text)


def test_a_failed_step_fails_its_requests_and_serving_goes_on(server, monkeypatch):
    """The failure is injected below the engine, in llguidance's mask fill,
    which the step calls for a constrained request: that request gets a 500
    naming the error, and the server keeps serving (it used to turn /health
    503 and refuse everything after)."""
    import llguidance.numpy as llnp

    url, client, _ = server

    def broken(*args, **kwargs):
        raise RuntimeError("mask fill exploded")

    monkeypatch.setattr(llnp, "fill_next_token_bitmask", broken)
    with pytest.raises(openai.InternalServerError, match="mask fill exploded"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "[a-z]{3}"}})
    monkeypatch.undo()
    assert httpx.get(url + "/health").status_code == 200
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                      extra_body={"structured_outputs": {"regex": "[a-z]{3}"}})
    assert len(again.choices[0].text) == 3


def test_priority_needs_the_priority_policy(server):
    _, client, _ = server
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": 1})
