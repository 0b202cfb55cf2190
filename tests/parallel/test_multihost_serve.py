"""`jaxinfer serve` across two processes in lockstep (jax.distributed on
127.0.0.1, gloo collectives, one CPU device each, TP 2 over both).

Host 0 answers the real openai client; process 1 answers /health only and
follows host 0's adds and aborts. The reference is HF transformers' greedy
generation of the same tiny checkpoint (a word-level tokenizer, "w0".."w127",
one word per token, so a text names its tokens). Then the follower is
killed: host 0 must fail its open request with a 503 naming it, and turn
/health 503, within the lost-host timeout. Processes started with different
engine options are refused at start.
"""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import tokenizers

from tests.tiny_models import hf_greedy, make_hf_model, save_hf_model
from tests.xla_flags import cpu_devices_env

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
LOST_HOST_TIMEOUT = 3.0
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
ENGINE = ["--tensor-parallel-size", "2", "--max-model-len", "64", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "32", "--num-kv-blocks", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pair(model_dir, extra=((), ())):
    """Host 0 and process 1 of one lockstep serve; returns ([Popen] * 2, [HTTP port] * 2)."""
    coordinator, ports = free_port(), [free_port(), free_port()]
    procs = []
    for process_id in range(2):
        env = cpu_devices_env(1, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
        for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(name, None)
        command = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", str(model_dir), *ENGINE,
                   "--served-model-name", MODEL, "--port", str(ports[process_id]), "--log-level", "warning",
                   "--chat-template", CHAT_TEMPLATE, "--lost-host-timeout", str(LOST_HOST_TIMEOUT),
                   "--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                   "--process-id", str(process_id), *extra[process_id]]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs, ports


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.communicate(timeout=30) for p in procs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multihost_serve")
    model = make_hf_model("llama", seed=21)
    save_hf_model(model, directory)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, model


@pytest.fixture(scope="module")
def pair(model_dir):
    procs, ports = start_pair(model_dir[0])
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    deadline = time.monotonic() + 150
    try:
        for url in urls:
            while True:
                assert all(p.poll() is None for p in procs), stop(procs)
                assert time.monotonic() < deadline, "the lockstep pair did not become ready"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        client = openai.OpenAI(base_url=urls[0] + "/v1", api_key="none", max_retries=0, timeout=60)
        yield procs, urls, client
    finally:
        stop(procs)


def words(ids):
    return [f"w{i}" for i in ids]


def test_mismatched_options_are_refused(model_dir):
    procs, _ = start_pair(model_dir[0], extra=((), ("--max-num-seqs", "8")))
    try:
        for p in procs:
            p.wait(timeout=60)
    finally:
        (_, err0), (_, err1) = stop(procs)
    assert procs[0].returncode == 1 and procs[1].returncode == 1
    assert "--max-num-seqs: host 0 has 4, this host 8" in err1
    assert "process 1: --max-num-seqs" in err0


@pytest.mark.slow
def test_completions_chat_and_n_match_one_process(pair, model_dir):
    _, urls, client = pair
    model = model_dir[1]
    prompt = [5, 17, 3, 99, 42]
    expected = words(hf_greedy(model, prompt, 8))
    out = client.completions.create(model=MODEL, prompt=" ".join(words(prompt)), max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text.split() == expected
    # n > 1: every completion of a greedy request is the greedy one.
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.text.split() for c in out.choices] == [expected, expected]
    # Chat: the template writes the message's words, then a space.
    chat_prompt = [7, 8, 9]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w7 w8 w9"}],
                                         max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content.split() == words(hf_greedy(model, chat_prompt, 6))
    # Sampled, unseeded, n=2 beside a greedy one: the hosts must draw the same seeds to stay in step.
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, n=2,
                                        extra_body={"ignore_eos": True})
    assert [len(c.text.split()) for c in sampled.choices] == [6, 6]
    assert httpx.get(urls[1] + "/health", timeout=5).status_code == 200
    assert httpx.post(urls[1] + "/v1/completions", json={"prompt": "w1"}, timeout=5).status_code == 404


def test_streaming_and_an_abort(pair, model_dir):
    _, _, client = pair
    model = model_dir[1]
    prompt = [11, 12, 13]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = []
    for chunk in stream:
        got += chunk.choices[0].text.split()
        if len(got) >= 3:
            break
    stream.close()  # the client disconnects: host 0 aborts it, and so must the follower, at the same step
    assert got == words(hf_greedy(model, prompt, len(got)))
    # Still in step after the abort: a streamed request's tokens are the greedy ones.
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text.split() == words(hf_greedy(model, prompt, 8))
    assert client.models.list().data[0].id == MODEL


def test_prompt_logprobs_are_refused(pair):
    _, _, client = pair
    with pytest.raises(openai.BadRequestError, match="multi-host"):
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1, extra_body={"prompt_logprobs": 1})


def test_a_killed_follower_gives_503s_within_the_bound(pair):
    """Last: it ends the pair."""
    procs, urls, client = pair
    stream = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError, match="process 1"):
        for _ in stream:
            pass
    bound = LOST_HOST_TIMEOUT + 4
    assert time.monotonic() - killed < bound
    health = httpx.get(urls[0] + "/health", timeout=5)
    assert health.status_code == 503 and "process 1" in json.dumps(health.json())
    with pytest.raises(openai.APIStatusError, match="process 1") as refused:
        client.completions.create(model=MODEL, prompt=[1], max_tokens=1)
    assert refused.value.status_code == 503
    assert time.monotonic() - killed < bound
