"""Defaults a served model brings: the sampling values of its
generation_config.json apply where a request sets none (vLLM's rule), and
max_model_len defaults to the model's whole context, failing at start-up,
with the numbers, when the KV pool cannot hold one such request.

A tiny random Llama (transformers' save_pretrained) with a word-level
tokenizer written here ("w0".."w127", one word per token, so the text names
the tokens), served over 127.0.0.1 and asked with the real openai client.
top_k=1 in the generation config makes sampling greedy, which a request at
temperature 0 shows independently.
"""

import json

import openai
import pytest
import tokenizers

from jaxinfer import LLM
from jaxinfer.server.app import build_app
from tests.serving import served
from tests.tiny_models import make_hf_model, save_hf_model

PROMPT = "w5 w17 w3 w99"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("defaults")
    save_hf_model(make_hf_model("llama", seed=34), directory)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_k": 1, "top_p": 0.9}))
    return directory


def test_generation_config_sampling_defaults(model_dir):
    llm = LLM(str(model_dir), progress=False, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              num_kv_blocks=32)
    with served(build_app(llm, model_name="tiny")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        def complete(**kw):
            return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, **kw).choices[0].text

        greedy = complete(temperature=0)
        assert len(greedy.split()) == 8
        assert all(complete(seed=seed) == greedy for seed in range(4))  # the config's top_k=1
        free = [complete(seed=seed, extra_body={"top_k": -1}, top_p=1.0) for seed in range(4)]  # the request's own
        assert any(text != greedy for text in free)


def test_max_model_len_defaults_to_the_models_context(model_dir, caplog):
    llm = LLM(str(model_dir), progress=False, max_num_seqs=2, max_num_batched_tokens=32)
    assert llm.max_model_len == 512  # tests/tiny_models.py: max_position_embeddings
    # A pool too small for the model's context: the longest it holds, said in one line.
    with caplog.at_level("WARNING", logger="jaxinfer.engine.config"):
        small = LLM(str(model_dir), progress=False, num_kv_blocks=8, max_num_seqs=2, max_num_batched_tokens=32)
    assert small.max_model_len == 7 * 16  # 8 blocks, the null block not counted
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxinfer.engine.config"]
    assert len(lines) == 1 and "max_model_len 112, not the model's 512" in lines[0] and "num_kv_blocks" in lines[0]


def test_the_context_is_decided_before_the_weights_load(model_dir, tmp_path, caplog):
    """Engine options and the context the KV pool holds are settled from the
    checkpoint's config before any weight is read: a checkpoint missing a
    weight fails only after both."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxinfer.errors import CheckpointError

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    [weights] = broken.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(str(broken), progress=False, no_such_option=1)
    with caplog.at_level("WARNING", logger="jaxinfer.engine.config"), pytest.raises(CheckpointError,
                                                                                   match="lacks tensor"):
        LLM(str(broken), progress=False, num_kv_blocks=8, max_num_seqs=2, max_num_batched_tokens=32)
    assert "max_model_len 112, not the model's 512" in caplog.text
