"""LoRA adapters through `jaxinfer serve`: adapters served as
models of their own names, picked by the request's `model` field, checked
with the real `openai` client over HTTP on 127.0.0.1 against LLM.generate /
LLM.chat with the same LoRARequest (which tests/api/test_lora.py checks against
PeftModel).

One server for the module over the embedded SmolLM2 with two random PEFT
adapters (written by peft for an HF Llama of SmolLM2's shapes; only the
shapes matter to the adapter). References are computed with the same LLM
before the server starts: from then on its engine belongs to the server.
"""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import transformers

from jaxinfer import LLM, SamplingParams
from jaxinfer.cli import _engine_options, build_parser, parse_lora_modules
from jaxinfer.errors import RequestError
from jaxinfer.lora.request import LoRARequest
from jaxinfer.server.app import build_app
from jaxinfer.server.state import ServerState
from tests.lora_helpers import make_adapter
from tests.serving import served

MODEL = "smollm2-lora-test"
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64)
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(LLM with enable_lora, {served name: LoRARequest} as the CLI parses them, references)."""
    root = tmp_path_factory.mktemp("server_lora")
    llm = LLM(progress=False, enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    llm.wait_compiled()  # references and served requests then run the same bucket programs
    c = llm.model.checkpoint_config
    shaped = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim))
    paths = {"sql": make_adapter(shaped, root / "sql", 1, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
             "poet": make_adapter(shaped, root / "poet", 2, r=4, lora_alpha=8,
                                  target_modules=["o_proj", "gate_proj", "down_proj"])}
    modules = parse_lora_modules([f"{name}={path}" for name, path in paths.items()])
    references = {}
    for name in (MODEL, "sql", "poet"):
        lora = modules.get(name)
        references[name] = llm.generate(PROMPT, greedy(6), use_tqdm=False, lora_request=lora)[0].outputs[0].text
        references[name, "chat"] = llm.chat(CHAT, greedy(5), lora_request=lora)[0].outputs[0].text
    # The adapters matter (so that a request served by the wrong one would show).
    assert len({references[n] for n in (MODEL, "sql", "poet")}) == 3
    return llm, modules, references


@pytest.fixture(scope="module")
def server(setup):
    llm, modules, _ = setup
    app = build_app(llm, model_name=MODEL, lora_modules=modules)
    with served(app) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_models_lists_adapters_with_their_parent(server, setup):
    url, client = server
    _, modules, _ = setup
    assert [m.id for m in client.models.list().data] == [MODEL, "sql", "poet"]
    data = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert data[MODEL]["parent"] is None
    for name, lora in modules.items():
        assert data[name]["parent"] == MODEL and data[name]["root"] == lora.lora_path


def test_model_field_picks_the_adapter(server, setup):
    """Completions (plain and streamed) and chat, per served name, equal the
    offline API with that adapter; the response names the model asked for."""
    _, client = server
    _, _, references = setup
    for name in (MODEL, "sql", "poet"):
        full = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0)
        assert full.model == name and full.choices[0].text == references[name], name
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=name, prompt=PROMPT, max_tokens=6, temperature=0, stream=True) if c.choices)
        assert streamed == references[name], name
        chat = client.chat.completions.create(model=name, messages=CHAT, max_tokens=5, temperature=0)
        assert chat.model == name and chat.choices[0].message.content == references[name, "chat"], name


def test_concurrent_requests_for_different_adapters(server, setup):
    """Requests for the base model and both adapters in flight together
    (sharing steps: max_loras=2) each get their own model's tokens."""
    _, client = server
    _, _, references = setup
    names = [MODEL, "sql", "poet"] * 3

    def ask(name):
        return client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(ask, names))
    assert texts == [references[n] for n in names]


def test_unknown_model_is_404_and_names_the_served_ones(server, setup):
    url, client = server
    _, _, references = setup
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    body = error.value.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert all(f"'{n}'" in body["message"] for n in (MODEL, "sql", "poet"))
    r = httpx.post(url + "/v1/chat/completions", json={"model": "no-such-adapter", "messages": CHAT})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # still serving
    assert client.completions.create(model="sql", prompt=PROMPT, max_tokens=6,
                                     temperature=0).choices[0].text == references["sql"]


def test_a_bad_lora_module_fails_before_serving(setup, tmp_path):
    """A --lora-modules entry the engine cannot serve fails when the server
    attaches the model (so /health never turns ready), naming the module;
    a name that is the base model's is refused at once."""
    llm, _, _ = setup
    state = ServerState(MODEL, None, None, {"broken": LoRARequest("broken", 9, str(tmp_path / "missing"))})
    with pytest.raises(RequestError, match="LoRA module 'broken'.*not a directory"):
        state.attach(llm)
    assert state.engine is None
    with pytest.raises(ValueError, match="base model"):
        ServerState(MODEL, None, None, {MODEL: LoRARequest(MODEL, 1, str(tmp_path))})


def test_cli_lora_flags():
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x/a", "b=/x/b", "--max-lora-rank", "32"])
    modules = parse_lora_modules(args.lora_modules)
    assert modules == {"a": LoRARequest("a", 1, "/x/a"), "b": LoRARequest("b", 2, "/x/b")}
    options = _engine_options(args)
    assert (options["enable_lora"], options["max_loras"], options["max_lora_rank"]) == (True, 2, 32)
    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "3"])
    assert (_engine_options(args)["enable_lora"], _engine_options(args)["max_loras"]) == (True, 3)
    assert "enable_lora" not in _engine_options(build_parser().parse_args(["serve"]))
    for bad, words in (["a"], "NAME=PATH"), (["=p"], "NAME=PATH"), (["a=p", "a=q"], "twice"):
        with pytest.raises(ValueError, match=words):
            parse_lora_modules(bad)


def test_load_and_unload_adapters_at_run_time(server, setup):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a loaded
    adapter serves under its name as the same adapter given at start does,
    is listed, and once unloaded is a 404; a bad path is a 400 naming it."""
    url, client = server
    _, modules, references = setup
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "sql-again", "lora_path": modules["sql"].lora_path})
    assert r.status_code == 200 and "sql-again" in r.text
    assert "sql-again" in [m.id for m in client.models.list().data]
    out = client.completions.create(model="sql-again", prompt=PROMPT, max_tokens=6, temperature=0)
    assert out.choices[0].text == references["sql"] and out.model == "sql-again"
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "sql-again", "lora_path": "/x"})
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "nothing", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "/no/such/dir" in bad.json()["error"]["message"]
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql-again"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql-again", prompt=PROMPT, max_tokens=2)
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql-again"}).status_code == 404
    assert client.completions.create(model="sql", prompt=PROMPT, max_tokens=6,
                                     temperature=0).choices[0].text == references["sql"]


def test_adapter_routes_want_the_api_key(setup):
    from fastapi.testclient import TestClient

    llm, _, _ = setup
    client = TestClient(build_app(llm, model_name=MODEL, api_key="secret"))  # no lifespan: the engine stays free
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = client.post(path, json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
