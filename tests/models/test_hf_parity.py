"""Logits parity with HF transformers (torch, CPU) on tiny random checkpoints
of every supported family, loaded through jaxinfer's safetensors reader."""

import numpy as np
import pytest

import jaxinfer
import jaxinfer.errors
from tests.tiny_models import VARIANTS, assert_logits_close, hf_greedy, hf_logits, make_hf_model, save_hf_model

# Long enough to cross the Mistral window (16) and Llama-3's original context (32).
SEQ_LEN = 80


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_pair(request, tmp_path_factory):
    hf_model = make_hf_model(request.param)
    directory = save_hf_model(hf_model, tmp_path_factory.mktemp(request.param))
    return request.param, hf_model, jaxinfer.load(str(directory), progress=False)


def test_logits_match_transformers(variant_pair):
    name, hf_model, model = variant_pair
    tokens = np.random.default_rng(1).integers(0, hf_model.config.vocab_size, SEQ_LEN)
    assert_logits_close(model.logits(tokens), hf_logits(hf_model, tokens))


def test_greedy_continuation_matches_transformers(variant_pair):
    name, hf_model, model = variant_pair
    prompt = np.random.default_rng(2).integers(0, hf_model.config.vocab_size, 12).tolist()
    expected = hf_greedy(hf_model, prompt, 10)
    tokens = list(prompt)
    for _ in range(10):
        tokens.append(int(model.logits(tokens)[-1].argmax()))
    assert tokens[len(prompt) :] == expected


def test_sharded_safetensors_with_index(tmp_path):
    hf_model = make_hf_model("llama", seed=3)
    save_hf_model(hf_model, tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    tokens = np.arange(40) % hf_model.config.vocab_size
    assert_logits_close(jaxinfer.load(str(tmp_path), progress=False).logits(tokens), hf_logits(hf_model, tokens))


def test_bfloat16_close_to_float32(tmp_path):
    hf_model = make_hf_model("qwen2", seed=4)
    save_hf_model(hf_model, tmp_path)
    tokens = np.arange(30)
    f32 = jaxinfer.load(str(tmp_path), dtype="float32", progress=False)
    bf16 = jaxinfer.load(str(tmp_path), dtype="bfloat16", progress=False)
    assert bf16.params["embed"].dtype.name == "bfloat16"
    ref = f32.logits(tokens)
    # bfloat16 keeps 8 bits of mantissa: expect percent-level, not 1e-4, agreement.
    assert_logits_close(bf16.logits(tokens), ref, rtol=0.1)
    assert (bf16.logits(tokens).argmax(-1) == ref.argmax(-1)).mean() > 0.8


def test_safetensors_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    import json

    hf_model = make_hf_model("llama", seed=9)
    save_hf_model(hf_model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(jaxinfer.errors.CheckpointError, match=r"gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
        jaxinfer.load(str(tmp_path), progress=False)


def test_truncated_or_missing_safetensors(tmp_path):
    from jaxinfer.errors import CheckpointError

    save_hf_model(make_hf_model("llama", seed=10), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        jaxinfer.load(str(tmp_path), progress=False)
    weights.unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        jaxinfer.load(str(tmp_path), progress=False)
